"""Autoregressive token generation for forecasting, with a key/value cache and a plain full-recompute path.

Both paths compute the same thing: at every step the predictor sees the last `min(len, max_context)` tokens with
positions restarting at 0 inside that window. While the sequence fits in `max_context` nothing before the new token
changes, so the cached path runs the trunk on one token per step. Once the window slides, every hidden state in it
changes (the dropped token no longer influences anything), so both paths recompute the window.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from model.errors import DataError
from model.kronos import Kronos


def sample_from_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = 0,
                       top_p: float | None = 1.0) -> torch.Tensor:
    """logits (B, V) -> sampled ids (B, 1).

    Temperature first; then top-k if top_k > 0, else nucleus top-p if top_p < 1 (the first token past the
    threshold is kept). `None` disables either filter. top_k=1 is greedy.
    """
    if temperature <= 0:
        raise DataError(f"temperature T must be > 0, got {temperature}")
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    elif top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        drop_sorted = cum > top_p
        drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()  # keep the first token past the threshold
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


class _CachedWindow:
    """The cache of one batch of sequences: tokens from absolute position `offset` on, at window positions
    0..length-1. All model access goes through Kronos' cached-decoding methods."""

    def __init__(self, model: Kronos, batch: int, max_context: int, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.cache = model.new_cache(batch, max_context, device, dtype)
        self.offset = 0
        self.length = 0

    def restart(self, offset: int) -> None:
        """Forget everything: the next `extend` starts a window at absolute position `offset`."""
        self.offset, self.length = offset, 0

    def extend(self, s1: torch.Tensor, s2: torch.Tensor, stamp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tokens (B, L) -> (s1 logits of the last one (B, V1), its hidden state (B, 1, d))."""
        logits, h_last = self.model.decode_s1_cached(s1, s2, stamp, self.cache, self.length)
        self.length += s1.shape[1]
        return logits, h_last

    def s2_logits(self, h_last: torch.Tensor, s1: torch.Tensor) -> torch.Tensor:
        """h_last (B, 1, d), sampled s1 (B, 1) -> s2 logits (B, V2); the s1 query attends to the whole window."""
        return self.model.decode_s2_cached(h_last, s1, self.cache, self.length)


@torch.inference_mode()
def generate_tokens(model: Kronos, s1_ctx: torch.Tensor, s2_ctx: torch.Tensor, stamps: torch.Tensor, pred_len: int,
                    max_context: int, temperature: float = 1.0, top_k: int | None = 0, top_p: float | None = 1.0,
                    use_cache: bool = True, verbose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Continue context ids s1_ctx, s2_ctx (B, N) by `pred_len` steps, with `stamps` (B, N + pred_len, 5) -> the full
    sequences (s1, s2), each (B, N + pred_len) int64. use_cache False: the published full recompute (same tokens in
    greedy mode)."""
    batch, n_ctx = s1_ctx.shape
    total = n_ctx + pred_len
    s1 = torch.cat([s1_ctx, s1_ctx.new_zeros(batch, pred_len)], dim=1)
    s2 = torch.cat([s2_ctx, s2_ctx.new_zeros(batch, pred_len)], dim=1)
    decoder = None
    if use_cache:
        decoder = _CachedWindow(model, batch, max_context, s1.device, next(model.parameters()).dtype)
    for cur in tqdm(range(n_ctx, total), disable=not verbose, desc="forecast", leave=False):
        start = max(0, cur - max_context)  # the window is tokens start..cur-1, at positions 0..cur-start-1
        if decoder is not None:
            if start != decoder.offset:
                # The window slid: every hidden state in it changes, so the cache restarts on the new window.
                decoder.restart(start)
            lo = decoder.offset + decoder.length  # feed what the cache has not seen (the whole window at first)
            s1_logits, h_last = decoder.extend(s1[:, lo:cur], s2[:, lo:cur], stamps[:, lo:cur])
            s1_next = sample_from_logits(s1_logits, temperature, top_k, top_p)
            s2_logits = decoder.s2_logits(h_last, s1_next)
        else:
            # Full recompute of the window (the published algorithm).
            s1_logits, context = model.decode_s1(s1[:, start:cur], s2[:, start:cur], stamps[:, start:cur])
            s1_next = sample_from_logits(s1_logits[:, -1], temperature, top_k, top_p)
            s2_logits = model.decode_s2(context, s1_next)[:, -1]
        s2_next = sample_from_logits(s2_logits, temperature, top_k, top_p)
        s1[:, cur] = s1_next[:, 0]
        s2[:, cur] = s2_next[:, 0]
    return s1, s2
