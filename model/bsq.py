"""Binary spherical quantisation (BSQ) as used by the Kronos tokenizer.

A D-dimensional vector (D = s1_bits + s2_bits) is L2-normalised and every coordinate is snapped to +-1/sqrt(D).
The first s1_bits coordinates form the coarse token, the last s2_bits the fine token.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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
        self.embed_dim = embed_dim
        self.beta, self.gamma0, self.gamma, self.zeta = beta, gamma0, gamma, zeta
        self.group_size = group_size
        self.q_scale = 1.0 / math.sqrt(embed_dim)
        self.register_buffer("basis", 2 ** torch.arange(embed_dim - 1, -1, -1, dtype=torch.long))
        self.register_buffer("group_basis", 2 ** torch.arange(group_size - 1, -1, -1, dtype=torch.long))
        # All 2^g sign patterns of one group, big-endian: row c is the binary expansion of c mapped to +-1.
        codes = torch.arange(2 ** group_size, dtype=torch.long)
        group_codebook = ((codes[:, None] // self.group_basis) % 2).float() * 2 - 1  # (2^g, g)
        self.register_buffer("group_codebook", group_codebook, persistent=False)

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Sign with a straight-through gradient (z > 0 -> +1, else -1)."""
        zhat = torch.where(z > 0, torch.ones_like(z), -torch.ones_like(z))
        return z + (zhat - z).detach()

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z (..., D), already L2-normalised -> (zq scaled to +-1/sqrt(D), bsq_loss scalar)."""
        zq = self.quantize(z) * self.q_scale
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
