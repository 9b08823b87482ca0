"""Input embeddings of the Kronos predictor: hierarchical token embedding and calendar (time) embedding."""
from __future__ import annotations

import math

import torch
from torch import nn


class HierarchicalEmbedding(nn.Module):
    """(s1, s2) ids -> fusion_proj([emb_s1(s1) * sqrt(d), emb_s2(s2) * sqrt(d)])."""

    def __init__(self, s1_bits: int, s2_bits: int, d_model: int):
        super().__init__()
        self.d_model = d_model
        self.emb_s1 = nn.Embedding(2 ** s1_bits, d_model)
        self.emb_s2 = nn.Embedding(2 ** s2_bits, d_model)
        self.fusion_proj = nn.Linear(2 * d_model, d_model)

    def forward(self, token_ids) -> torch.Tensor:
        """token_ids: (s1_ids, s2_ids) each (B, T) -> (B, T, d_model)."""
        s1_ids, s2_ids = token_ids
        scale = math.sqrt(self.d_model)
        return self.fusion_proj(torch.cat([self.emb_s1(s1_ids) * scale, self.emb_s2(s2_ids) * scale], dim=-1))


class FixedEmbedding(nn.Module):
    """A frozen sinusoidal table (learn_te=false); the weight lives under `.emb.weight` as published."""

    def __init__(self, c_in: int, d_model: int):
        super().__init__()
        w = torch.zeros(c_in, d_model)
        position = torch.arange(0, c_in).float().unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        w[:, 0::2] = torch.sin(position * div_term)
        w[:, 1::2] = torch.cos(position * div_term)
        self.emb = nn.Embedding(c_in, d_model)
        self.emb.weight = nn.Parameter(w, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x).detach()


class TemporalEmbedding(nn.Module):
    """Calendar stamps (B, T, 5) = minute, hour, weekday, day, month -> (B, T, d_model)."""

    def __init__(self, d_model: int, learn_pe: bool):
        super().__init__()
        make = (lambda n: nn.Embedding(n, d_model)) if learn_pe else (lambda n: FixedEmbedding(n, d_model))
        self.minute_embed = make(60)
        self.hour_embed = make(24)
        self.weekday_embed = make(7)
        self.day_embed = make(32)
        self.month_embed = make(13)

    def forward(self, stamp: torch.Tensor) -> torch.Tensor:
        x = stamp.long()
        # Summation order matches the published model (it shows in the last bits of the logits).
        return (self.hour_embed(x[..., 1]) + self.weekday_embed(x[..., 2]) + self.day_embed(x[..., 3])
                + self.month_embed(x[..., 4]) + self.minute_embed(x[..., 0]))
