"""KronosTokenizer: a causal transformer autoencoder with a BSQ bottleneck (one candle -> coarse + fine token)."""
from __future__ import annotations

import torch
from torch import nn

from .bsq import BSQuantizer, ids_to_bits
from .config import KronosTokenizerConfig
from .hub import PretrainedMixin
from .layers import TransformerBlock


class KronosTokenizer(nn.Module, PretrainedMixin):
    """Encode normalised candles (B, T, d_in) into token ids and decode ids back to candles.

    The encoder has n_enc_layers - 1 blocks and the decoder n_dec_layers - 1 blocks (published layout).
    """

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
        """Encode, quantise and reconstruct (training).

        Parameters
        ----------
        x: (B, T, d_in) normalised candles.

        Returns
        -------
        ((z_pre, z), bsq_loss, quantized, ids): z the reconstruction from the full code and z_pre from the coarse
        (s1) bits alone, both (B, T, d_in); bsq_loss a scalar; quantized (B, T, D) with D = s1_bits + s2_bits;
        ids (B, T) int64 over all D bits.
        """
        bsq_loss, quantized, ids = self.tokenizer(self._encode_latent(x))
        z_pre = self._decode_latent(self.post_quant_embed_pre(quantized[..., : self.s1_bits]))
        z = self._decode_latent(self.post_quant_embed(quantized))
        return (z_pre, z), bsq_loss, quantized, ids

    def encode(self, x: torch.Tensor, half: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Candles to token ids.

        Parameters
        ----------
        x: (B, T, d_in) normalised candles.
        half: split the code into coarse and fine ids.

        Returns
        -------
        (s1_ids, s2_ids) each (B, T) int64 if half, else one id (B, T) over all D bits.
        """
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
        """Token ids to candles.

        Parameters
        ----------
        ids: (s1_ids, s2_ids) each (B, T) if half, else one id tensor (B, T) over all D bits.

        Returns
        -------
        Reconstructed normalised candles (B, T, d_in).
        """
        bits = self.indices_to_bits(ids, half).to(self.post_quant_embed.weight.dtype)
        return self._decode_latent(self.post_quant_embed(bits))
