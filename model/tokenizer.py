"""The Kronos tokenizer: candles (B, T, 6) <-> pairs of token ids, through a binary spherical quantiser (BSQ).

A causal transformer encoder maps each normalised candle to a D-dimensional latent (D = s1_bits + s2_bits); BSQ
L2-normalises it and snaps every coordinate to +-1/sqrt(D); the first s1_bits coordinates are the coarse token, the
last s2_bits the fine token; a decoder reconstructs the candle from the code (from the coarse bits alone too, the
second training target). Read top-down: id <-> bits helpers, the quantiser and its loss, `KronosTokenizer`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import KronosTokenizerConfig
from model.hub import PretrainedMixin
from model.layers import TransformerBlock


def bits_to_ids(bits: torch.Tensor) -> torch.Tensor:
    """(..., n) tensor of +-values -> (...,) int64 ids, little-endian (coordinate i is bit i, set when >= 0)."""
    weights = 2 ** torch.arange(bits.shape[-1], device=bits.device, dtype=torch.long)
    return ((bits >= 0).long() * weights).sum(-1)


def ids_to_bits(ids: torch.Tensor, n_bits: int) -> torch.Tensor:
    """(...,) int64 ids -> (..., n_bits) float tensor of +-1 (inverse of `bits_to_ids`)."""
    mask = 2 ** torch.arange(n_bits, device=ids.device, dtype=torch.long)
    return ((ids.unsqueeze(-1) & mask) != 0).float() * 2 - 1


class BinarySphericalQuantizer(nn.Module):
    """Quantiser and its loss; buffers `basis` and `group_basis` are persistent (published state-dict keys)."""

    def __init__(self, embed_dim: int, beta: float, gamma0: float, gamma: float, zeta: float, group_size: int):
        super().__init__()
        if embed_dim % group_size:
            raise ValueError(f"s1_bits + s2_bits ({embed_dim}) must be divisible by group_size ({group_size})")
        self.embed_dim, self.group_size = embed_dim, group_size
        self.beta, self.gamma0, self.gamma, self.zeta = beta, gamma0, gamma, zeta
        self.q_scale = 1.0 / math.sqrt(embed_dim)
        self.register_buffer("basis", 2 ** torch.arange(embed_dim - 1, -1, -1, dtype=torch.long))
        self.register_buffer("group_basis", 2 ** torch.arange(group_size - 1, -1, -1, dtype=torch.long))
        # All 2^g sign patterns of one group, big-endian: row c is the binary expansion of c mapped to +-1.
        codes = torch.arange(2 ** group_size, dtype=torch.long)
        group_codebook = ((codes[:, None] // self.group_basis) % 2).float() * 2 - 1  # (2^g, g)
        self.register_buffer("group_codebook", group_codebook, persistent=False)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z (..., D), already L2-normalised -> (zq scaled to +-1/sqrt(D), bsq_loss scalar)."""
        zhat = torch.where(z > 0, torch.ones_like(z), -torch.ones_like(z))  # the sign, with 0 -> -1
        zq = (z + (zhat - z).detach()) * self.q_scale  # a straight-through gradient
        commit = self.beta * ((zq.detach() - z) ** 2).sum(-1).mean()
        per_sample, codebook = self.soft_entropy(z)
        loss = commit + self.zeta * (self.gamma0 * per_sample - self.gamma * codebook)
        return zq, loss

    def soft_entropy(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample binary entropy, codebook entropy) of the soft assignments of z (..., D)."""
        # Per-sample: analytical binary entropy of each coordinate, summed over D, mean over tokens.
        p = torch.sigmoid(-4 * z / math.sqrt(self.embed_dim))
        h = -(p * torch.log(p + 1e-8) + (1 - p) * torch.log(1 - p + 1e-8))
        per_sample = h.sum(-1).mean()
        # Codebook: softmax over the 2^g codes of each group, averaged over all tokens, entropy per group.
        groups = z.reshape(-1, self.embed_dim // self.group_size, self.group_size)  # (N, D/g, g)
        codebook = self.group_codebook.to(z.dtype) * self.q_scale                   # (2^g, g)
        probs = F.softmax(2 * groups @ codebook.t(), dim=-1).mean(0)                 # (D/g, 2^g)
        codebook_entropy = -(probs * torch.log(probs + 1e-8)).sum(-1).sum()
        return per_sample, codebook_entropy


class BSQuantizer(nn.Module):
    """Normalise, quantise and turn codes into token ids (the tokenizer's `tokenizer` submodule)."""

    def __init__(self, s1_bits: int, s2_bits: int, beta: float, gamma0: float, gamma: float, zeta: float,
                 group_size: int):
        super().__init__()
        self.s1_bits, self.s2_bits = s1_bits, s2_bits
        self.codebook_dim = s1_bits + s2_bits
        self.bsq = BinarySphericalQuantizer(self.codebook_dim, beta, gamma0, gamma, zeta, group_size)

    def forward(self, z: torch.Tensor, half: bool = False):
        """z (B, T, D) -> (bsq_loss, quantized (B, T, D), ids: (s1, s2) each (B, T) if half else (B, T))."""
        z = F.normalize(z, dim=-1)
        quantized, loss = self.bsq(z)
        if half:
            ids = (bits_to_ids(quantized[..., : self.s1_bits]), bits_to_ids(quantized[..., self.s1_bits:]))
        else:
            ids = bits_to_ids(quantized)
        return loss, quantized, ids


class KronosTokenizer(nn.Module, PretrainedMixin):
    """Encode normalised candles (B, T, d_in) into token ids and decode ids back to candles; the encoder has
    n_enc_layers - 1 blocks and the decoder n_dec_layers - 1 blocks (published layout)."""

    config_class = KronosTokenizerConfig  # checks config.json before from_pretrained allocates anything

    def __init__(self, d_in: int, d_model: int, n_heads: int, ff_dim: int, n_enc_layers: int, n_dec_layers: int,
                 ffn_dropout_p: float, attn_dropout_p: float, resid_dropout_p: float, s1_bits: int, s2_bits: int,
                 beta: float, gamma0: float, gamma: float, zeta: float, group_size: int):
        super().__init__()
        self._record_config(locals())
        self.d_in, self.d_model = d_in, d_model
        self.s1_bits, self.s2_bits = s1_bits, s2_bits
        self.codebook_dim = s1_bits + s2_bits

        def blocks(n: int) -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(d_model, n_heads, ff_dim, ffn_dropout_p, attn_dropout_p,
                                                  resid_dropout_p) for _ in range(n))

        self.embed = nn.Linear(d_in, d_model)
        self.encoder = blocks(n_enc_layers - 1)
        self.quant_embed = nn.Linear(d_model, self.codebook_dim)
        self.tokenizer = BSQuantizer(s1_bits, s2_bits, beta, gamma0, gamma, zeta, group_size)
        self.post_quant_embed_pre = nn.Linear(s1_bits, d_model)
        self.post_quant_embed = nn.Linear(self.codebook_dim, d_model)
        self.decoder = blocks(n_dec_layers - 1)
        self.head = nn.Linear(d_model, d_in)

    def _encode_latent(self, x: torch.Tensor) -> torch.Tensor:
        z = self.embed(x)  # (B, T, d_model)
        for layer in self.encoder:
            z = layer(z)
        return self.quant_embed(z)  # (B, T, D)

    def _decode_latent(self, z: torch.Tensor) -> torch.Tensor:
        for layer in self.decoder:
            z = layer(z)
        return self.head(z)  # (B, T, d_in)

    def forward(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor,
                                                torch.Tensor]:
        """Normalised candles x (B, T, d_in) -> ((z_pre, z), bsq_loss, quantized (B, T, D), ids (B, T) over all D
        bits) (training): z the reconstruction (B, T, d_in) from the full code, z_pre from the coarse (s1) bits."""
        bsq_loss, quantized, ids = self.tokenizer(self._encode_latent(x))
        z_pre = self._decode_latent(self.post_quant_embed_pre(quantized[..., : self.s1_bits]))
        z = self._decode_latent(self.post_quant_embed(quantized))
        return (z_pre, z), bsq_loss, quantized, ids

    def encode(self, x: torch.Tensor, half: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalised candles (B, T, d_in) -> (s1_ids, s2_ids) each (B, T) int64 if half, else one id (B, T) over
        all D bits."""
        _, _, ids = self.tokenizer(self._encode_latent(x), half=half)
        return ids

    def indices_to_bits(self, ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                        half: bool = False) -> torch.Tensor:
        """Token ids -> scaled code (B, T, D) of +-1/sqrt(D)."""
        if half:
            s1_ids, s2_ids = ids
            bits = torch.cat([ids_to_bits(s1_ids, self.s1_bits), ids_to_bits(s2_ids, self.s2_bits)], dim=-1)
        else:
            bits = ids_to_bits(ids, self.codebook_dim)
        return bits * self.tokenizer.bsq.q_scale

    def decode(self, ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor], half: bool = False) -> torch.Tensor:
        """Token ids ((s1_ids, s2_ids) each (B, T) if half, else (B, T)) -> normalised candles (B, T, d_in)."""
        bits = self.indices_to_bits(ids, half).to(self.post_quant_embed.weight.dtype)
        return self._decode_latent(self.post_quant_embed(bits))
