"""The layers both Kronos models are built from: RMSNorm, SwiGLU feed-forward, rotary attention (self and the
predictor's cross-attention) with an optional key/value cache, the pre-norm transformer block, and the predictor's
input embeddings (hierarchical token embedding, calendar embedding).

Module and parameter names are the published checkpoints' state-dict keys; do not rename them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (so bf16 autocast does not lose precision)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class FeedForward(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x), then dropout."""

    def __init__(self, d_model: int, ff_dim: int, ffn_dropout_p: float = 0.0):
        super().__init__()
        self.w1 = nn.Linear(d_model, ff_dim, bias=False)
        self.w3 = nn.Linear(d_model, ff_dim, bias=False)
        self.w2 = nn.Linear(ff_dim, d_model, bias=False)
        self.ffn_dropout = nn.Dropout(ffn_dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[a, b] -> [-b, a] over the halves of the last dim."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryPositionalEmbedding(nn.Module):
    """Rotary embedding. `inv_freq` is a persistent float32 buffer (it is in the published state dict)."""

    def __init__(self, dim: int):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                offset: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, H, Lq, Dh) and k (B, H, Lk, Dh) with the positions of the *query* (published rule),
        offset..offset+Lq-1; a tensor offset (1,) is read on the device (a static-cache decoding step)."""
        t = torch.arange(q.shape[-2], device=self.inv_freq.device, dtype=self.inv_freq.dtype) + offset
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (Lq, Dh)
        cos, sin = emb.cos()[None, None].to(q.dtype), emb.sin()[None, None].to(q.dtype)  # (1, 1, Lq, Dh)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class KVCache:
    """Pre-allocated key/value buffers for incremental decoding, one slot per attention module. Slot i holds
    `k[i]`, `v[i]`, each (B, H_i, max_len, Dh_i): the predictor uses slots 0..n_layers-1 for its self-attention
    layers and slot n_layers for the dependency layer's keys/values (4 heads, another head_dim). The caller tracks
    how many positions are filled. A static decoding step gives its position as a tensor (1,): it is written in
    place with index_copy_ and the step attends to the whole buffer under a mask, so the step's shapes and addresses
    never change and nothing is read back to the host (a CUDA graph can capture it)."""

    def __init__(self, batch: int, max_len: int, slots: list[tuple[int, int]], device: torch.device | str,
                 dtype: torch.dtype):  # slots: (n_heads, head_dim) of every attention module that caches
        self.k = [torch.zeros((batch, h, max_len, dh), device=device, dtype=dtype) for h, dh in slots]
        self.v = [torch.zeros((batch, h, max_len, dh), device=device, dtype=dtype) for h, dh in slots]
        self.max_len = max_len

    def update(self, slot: int, start: int | torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H, L_new, Dh) at positions start.. and return all filled keys/values
        (B, H, start+L_new, Dh); a tensor `start` (1,) writes one position and returns the whole buffers."""
        if isinstance(start, torch.Tensor):
            self.k[slot].index_copy_(2, start, k)
            self.v[slot].index_copy_(2, start, v)
            return self.k[slot], self.v[slot]
        end = start + k.shape[-2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_len {self.max_len}")
        self.k[slot][:, :, start:end] = k
        self.v[slot][:, :, start:end] = v
        return self.k[slot][:, :, :end], self.v[slot][:, :, :end]

    def filled(self, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` cached keys/values of `slot`, each (B, H, length, Dh)."""
        return self.k[slot][:, :, :length], self.v[slot][:, :, :length]

    def load(self, other: KVCache, repeat: int) -> None:
        """Copy `other`'s positions 0..other.max_len-1 into this cache, each of its sequences `repeat` times in a
        row (a prefill shared by the sample paths of a series); rows beyond stay as they are."""
        for dst, src in zip(self.k + self.v, other.k + other.v):
            dst[:src.shape[0] * repeat, :, :src.shape[2]].copy_(src.repeat_interleave(repeat, dim=0))

    def valid(self, end: torch.Tensor) -> torch.Tensor:
        """Mask (max_len,) of the positions before `end` (1,): True = filled."""
        return torch.arange(self.max_len, device=end.device) < end


def _attention_mask(key_padding_mask: torch.Tensor | None, lq: int, lk: int, causal: bool,
                    device: torch.device) -> torch.Tensor | None:
    """Boolean mask (B or 1, 1, Lq, Lk), True = may attend; None when no masking is needed. The causal rule is
    aligned to the *end* of the keys (query i sits at key position lk - lq + i): a query chunk appended after cached
    keys, the plain lower triangle when lq == lk."""
    mask = None
    if causal and lq > 1:
        qpos = torch.arange(lk - lq, lk, device=device)[:, None]
        mask = (torch.arange(lk, device=device)[None, :] <= qpos)[None, None]  # (1, 1, Lq, Lk)
    if key_padding_mask is not None:
        pad = key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, Lk)
        mask = pad if mask is None else (mask & pad)
    return mask


class _Attention(nn.Module):
    """Shared projections and SDPA call of self- and cross-attention (names match the published keys)."""

    def __init__(self, d_model: int, n_heads: int, attn_dropout_p: float = 0.0, resid_dropout_p: float = 0.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.rotary = RotaryPositionalEmbedding(self.head_dim)
        self.attn_dropout_p = attn_dropout_p
        self.resid_dropout = nn.Dropout(resid_dropout_p)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d) -> (B, H, L, Dh)."""
        b, l, _ = x.shape
        return x.view(b, l, self.n_heads, self.head_dim).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               is_causal: bool, valid: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, H, Lq, Dh), k/v (B, H, Lk, Dh) -> projected output (B, Lq, d). valid (Lk,): the filled keys of a
        static cache (one query only)."""
        dropout = self.attn_dropout_p if self.training else 0.0
        if q.shape[-2] == 1 and mask is None and dropout == 0.0:
            # One query (a generation step): two small matmuls. The CPU flash kernel spends ~20x longer on this
            # shape than the arithmetic needs, and it dominated the cost of a cached decoding step.
            scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)  # (B, H, 1, Lk)
            if valid is not None:
                scores = scores.masked_fill(~valid, float("-inf"))
            out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v    # (B, H, 1, Dh)
        elif mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        else:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=is_causal)
        b, _, lq, _ = out.shape
        out = out.transpose(1, 2).reshape(b, lq, self.d_model)
        return self.resid_dropout(self.out_proj(out))


class MultiHeadAttentionWithRoPE(_Attention):
    """Causal self-attention with rotary positions (causal in training and in eval)."""

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                cache: KVCache | None = None, layer_idx: int = 0, start_pos: int | torch.Tensor = 0) -> torch.Tensor:
        """x (B, L, d) -> (B, L, d). With `cache`, x holds positions start_pos.. and attends to the cached past
        (a tensor start_pos (1,): one token of a static cache)."""
        q, k, v = self.split_heads(self.q_proj(x)), self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))
        q, k = self.rotary(q, k, offset=start_pos)
        if cache is not None:
            k, v = cache.update(layer_idx, start_pos, k, v)
            if isinstance(start_pos, torch.Tensor):  # a static step: one query over the filled part of the buffer
                return self.attend(q, k, v, None, False, valid=cache.valid(start_pos + 1))
        lq, lk = q.shape[-2], k.shape[-2]
        if key_padding_mask is None and lq == lk:
            return self.attend(q, k, v, None, is_causal=True)
        return self.attend(q, k, v, _attention_mask(key_padding_mask, lq, lk, True, x.device), is_causal=False)


class MultiHeadCrossAttentionWithRoPE(_Attention):
    """Cross-attention of the dependency layer. Published behaviour kept for checkpoint parity: rotary cos/sin come
    from the *query* length and are applied to q and k; the attention is causal only in training mode.
    `causal=True/False` overrides the mode rule (a validation loss must be causal, or position t would see the hidden
    states of later positions)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, causal: bool | None = None) -> torch.Tensor:
        """query (B, Lq, d), key/value (B, Lk, d) -> (B, Lq, d)."""
        q = self.split_heads(self.q_proj(query))
        k, v = self.split_heads(self.k_proj(key)), self.split_heads(self.v_proj(value))
        q, k = self.rotary(q, k)
        is_causal = self.training if causal is None else causal
        lq, lk = q.shape[-2], k.shape[-2]
        if key_padding_mask is None and (not is_causal or lq == lk):
            return self.attend(q, k, v, None, is_causal=is_causal)
        return self.attend(q, k, v, _attention_mask(key_padding_mask, lq, lk, is_causal, query.device), is_causal=False)

    # Incremental decoding. At inference the query is one s1 embedding, whose rotary table has one row (position 0,
    # the identity), so keys need no rotation and can be projected once per position and cached.
    def project_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value (B, L, d) -> cacheable keys and values, each (B, H, L, Dh), as a length-1 query sees them."""
        return self.split_heads(self.k_proj(key)), self.split_heads(self.v_proj(value))

    def attend_kv(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  valid: torch.Tensor | None = None) -> torch.Tensor:
        """One query (B, 1, d) over projected keys/values (B, H, Lk, Dh) -> (B, 1, d); no mask (eval, one query)
        but `valid` (Lk,), the filled keys of a static cache."""
        if query.shape[1] != 1:
            raise ValueError(f"attend_kv takes one query position, got {query.shape[1]}")
        return self.attend(self.split_heads(self.q_proj(query)), k, v, None, False, valid)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + ffn(norm2(x))."""

    def __init__(self, d_model: int, n_heads: int, ff_dim: int = 1024, ffn_dropout_p: float = 0.0,
                 attn_dropout_p: float = 0.0, resid_dropout_p: float = 0.0):
        super().__init__()
        self.norm1 = RMSNorm(d_model)
        self.self_attn = MultiHeadAttentionWithRoPE(d_model, n_heads, attn_dropout_p, resid_dropout_p)
        self.norm2 = RMSNorm(d_model)
        self.ffn = FeedForward(d_model, ff_dim, ffn_dropout_p)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                cache: KVCache | None = None, layer_idx: int = 0, start_pos: int | torch.Tensor = 0) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x), key_padding_mask, cache, layer_idx, start_pos)
        return x + self.ffn(self.norm2(x))


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
