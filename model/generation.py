"""Autoregressive token generation for forecasting: a key/value-cached path (eager, or a static step that a CUDA
graph records once and replays per token) and a plain full-recompute path, computing the same thing. Why the cache
holds until the window slides: docs/architecture.md, "Formats and designs"."""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from model.errors import DataError
from model.kronos import Kronos


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise DataError(f"temperature T must be > 0, got {temperature}")


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = 0,
                  top_p: float | None = 1.0) -> torch.Tensor:
    """logits (B, V) -> float32 logits (B, V) with the tokens the filters drop at -inf: temperature first; then
    top-k if top_k > 0, else nucleus top-p if top_p < 1 (the first token past the threshold is kept). `None`
    disables either filter. top_k=1 is greedy."""
    check_temperature(temperature)
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
    return logits


def sample_from_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = 0,
                       top_p: float | None = 1.0, generators: Sequence[torch.Generator] | None = None) -> torch.Tensor:
    """logits (B, V) -> sampled ids (B, 1), filtered as `filter_logits` says. generators: one per series, each
    drawing for its B / len(generators) consecutive rows (its sample paths), so a series' draws never depend on
    the rows beside it; None = the global generator."""
    probs = F.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    if generators is None:
        return torch.multinomial(probs, num_samples=1)
    rows = probs.split(len(probs) // len(generators))
    return torch.cat([torch.multinomial(p, num_samples=1, generator=g) for p, g in zip(rows, generators)])


def race_sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = 0,
                top_p: float | None = 1.0) -> torch.Tensor:
    """The distribution of `sample_from_logits`, drawn without reading anything back to the host (a CUDA graph can
    hold it): the exponential race argmax_i p_i / E_i with E_i ~ Exp(1) independent picks i with probability p_i.
    logits (B, V) -> ids (B, 1)."""
    probs = F.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    race = torch.empty_like(probs).exponential_().clamp_min_(torch.finfo(probs.dtype).tiny)  # E = 0 would give 0/0
    return torch.argmax(probs / race, dim=-1, keepdim=True)


class _StaticStep:
    """One decoding step of `rows` sequences on a preallocated cache of `length` window positions: the token pair
    (s1, s2 (R, 1)) at window position `pos` (1,) with its stamp (R, 1, 5) goes through the trunk and both heads and
    the next pair is sampled into the same buffers. Shapes and addresses never change and no value is read back to
    the host, so on CUDA the whole step is recorded once as a graph and replayed (`capture`)."""

    def __init__(self, model: Kronos, rows: int, length: int, device: torch.device,
                 sampling: tuple[float, int | None, float | None]):
        self.sampling = sampling  # the model is passed to each call: a step kept per model must not keep it alive
        self.cache = model.new_cache(rows, length, device, next(model.parameters()).dtype)
        self.s1 = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.s2 = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.stamp = torch.zeros(rows, 1, 5, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _heads(self, model: Kronos, s1_logits: torch.Tensor, h_last: torch.Tensor) -> None:
        """s1 logits (R, V1) and hidden state (R, 1, d) of the token at `pos` -> the next pair, sampled in fp32."""
        s1 = race_sample(s1_logits, *self.sampling)
        s2 = race_sample(model.decode_s2_cached(h_last, s1, self.cache, self.pos + 1), *self.sampling)
        self.s1.copy_(s1)
        self.s2.copy_(s2)

    def step(self, model: Kronos) -> None:
        """The captured step: feed the pair at `pos`, sample the next one into s1 / s2."""
        self._heads(model, *model.decode_s1_cached(self.s1, self.s2, self.stamp, self.cache, self.pos))

    def prefill(self, model: Kronos, s1: torch.Tensor, s2: torch.Tensor, stamp: torch.Tensor, repeat: int) -> None:
        """Encode windows (n, L) at positions 0..L-1 (eagerly, as the cached generator does), give each of them to
        `repeat` rows in a row (the sample paths of one series share it) and sample those rows' next pair."""
        n, length = s1.shape
        cache = model.new_cache(n, length, s1.device, self.cache.k[0].dtype)
        s1_logits, h_last = model.decode_s1_cached(s1, s2, stamp, cache, 0)  # (n, V1), (n, 1, d)
        self.cache.load(cache, repeat)
        pad = self.s1.shape[0] - n * repeat  # rows padded to a captured batch size
        self.pos.fill_(length - 1)
        self._heads(model, F.pad(s1_logits.repeat_interleave(repeat, 0), (0, 0, 0, pad)),
                    F.pad(h_last.repeat_interleave(repeat, 0), (0, 0, 0, 0, 0, pad)))

    def capture(self, model: Kronos) -> None:
        """Record `step` as one CUDA graph: warm-up runs on a side stream first (allocator, lazy kernels), as
        capture requires. The buffers it touches are the graph's static inputs and outputs. Warm-up and capture
        draw from the device's generator; its state is put back afterwards, so a seeded first call (which
        captures) draws the same paths as a later one (which only replays)."""
        device = self.s1.device
        with torch.random.fork_rng(devices=[device], device_type=device.type):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.step(model)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step(model)
        self.graph = graph

    def run(self, model: Kronos) -> None:
        if self.graph is None:
            self.step(model)
        else:
            self.graph.replay()


_KEEP_GRAPHS = 2  # captured steps kept per owner (each holds its cache: rows x length x layers x 2)
_graph_failed = False  # capture failed once in this process: the eager generator runs, said once


def _graphed_step(model: Kronos, rows: int, length: int, device: torch.device,
                  sampling: tuple[float, int | None, float | None], steps: dict) -> _StaticStep | None:
    """A captured step for `rows` sequences padded to a power of two, taken from or kept in `steps` (the
    parameters' address is in the key: a moved model is captured again); None when capture fails."""
    global _graph_failed
    padded = 1 << (rows - 1).bit_length()
    key = (padded, length, next(model.parameters()).data_ptr(), sampling)
    if key not in steps and not _graph_failed:
        try:
            step = _StaticStep(model, padded, length, device, sampling)
            step.capture(model)
        except Exception as err:  # a driver, an op or memory: the eager generator still works
            _graph_failed = True
            warnings.warn(f"CUDA-graph decoding failed ({type(err).__name__}: {err}); using the eager generator",
                          stacklevel=3)
            return None
        while len(steps) >= _KEEP_GRAPHS:
            steps.pop(next(iter(steps)))
        steps[key] = step
    return steps.get(key)


def _generate_static(model: Kronos, step: _StaticStep, s1_ctx: torch.Tensor, s2_ctx: torch.Tensor,
                     stamps: torch.Tensor, pred_len: int, max_context: int, sample_count: int,
                     verbose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`generate_tokens` with a static step: the context is encoded once per series and copied to its sample
    paths; each next token is one `step.run()`; a slid window is encoded again (as in the eager paths)."""
    n_ctx = s1_ctx.shape[1]
    rep = lambda t: t.repeat_interleave(sample_count, dim=0)  # noqa: E731  (B, ...) -> (B * S, ...)
    s1 = torch.cat([rep(s1_ctx), s1_ctx.new_zeros(len(s1_ctx) * sample_count, pred_len)], dim=1)
    s2 = torch.cat([rep(s2_ctx), s2_ctx.new_zeros(len(s2_ctx) * sample_count, pred_len)], dim=1)
    stamps_rows, rows = rep(stamps), len(s1)
    for cur in tqdm(range(n_ctx, n_ctx + pred_len), disable=not verbose, desc="forecast", leave=False):
        start = max(0, cur - max_context)
        if cur == n_ctx:
            step.prefill(model, s1_ctx[:, start:], s2_ctx[:, start:], stamps[:, start:cur], sample_count)
        elif start > 0:
            step.prefill(model, s1[:, start:cur], s2[:, start:cur], stamps_rows[:, start:cur], 1)
        else:
            step.pos.fill_(cur - 1)
            step.stamp[:rows].copy_(stamps_rows[:, cur - 1:cur])
            step.run(model)
        s1[:, cur] = step.s1[:rows, 0]
        s2[:, cur] = step.s2[:rows, 0]
    return s1, s2


@torch.inference_mode()
def generate_tokens(model: Kronos, s1_ctx: torch.Tensor, s2_ctx: torch.Tensor, stamps: torch.Tensor, pred_len: int,
                    max_context: int, temperature: float = 1.0, top_k: int | None = 0, top_p: float | None = 1.0,
                    use_cache: bool = True, verbose: bool = False, sample_count: int = 1, decode: str = "eager",
                    graphs: dict | None = None, generators: Sequence[torch.Generator] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Continue context ids s1_ctx, s2_ctx (B, N) by `pred_len` steps, `sample_count` paths per series, with
    `stamps` (B, N + pred_len, 5) -> the full sequences (s1, s2), each (B * S, N + pred_len) int64, the S paths of
    a series in consecutive rows. use_cache False: the published full recompute. decode (with the cache): "eager",
    "static" (the CUDA graph's step without the graph: preallocated cache, `race_sample`) or "graph" (falls back to
    "eager" with one warning when capture fails); `graphs` keeps the recorded steps between calls (None = record
    afresh). What each guarantees (same greedy tokens; same distribution, not the same draws): README "Decoding".
    generators: one per series (`sample_from_logits`); the static step cannot take them, so they decode eagerly."""
    sampling = (temperature, top_k, top_p)
    check_temperature(temperature)  # before a graph capture, which would take the error for a failed capture
    if use_cache and decode in ("static", "graph") and generators is None:
        rows, length = len(s1_ctx) * sample_count, min(max_context, s1_ctx.shape[1] + pred_len - 1)
        graph = decode == "graph" and s1_ctx.is_cuda
        step = (_graphed_step(model, rows, length, s1_ctx.device, sampling, {} if graphs is None else graphs) if graph
                else _StaticStep(model, rows, length, s1_ctx.device, sampling))
        if step is not None:
            return _generate_static(model, step, s1_ctx, s2_ctx, stamps, pred_len, max_context, sample_count, verbose)
    if sample_count > 1:  # every path re-encodes its context (the published way)
        s1_ctx, s2_ctx, stamps = (t.repeat_interleave(sample_count, dim=0) for t in (s1_ctx, s2_ctx, stamps))
    batch, n_ctx = s1_ctx.shape
    s1 = torch.cat([s1_ctx, s1_ctx.new_zeros(batch, pred_len)], dim=1)
    s2 = torch.cat([s2_ctx, s2_ctx.new_zeros(batch, pred_len)], dim=1)
    cache = model.new_cache(batch, max_context, s1.device, next(model.parameters()).dtype) if use_cache else None
    offset = length = 0  # the cache holds tokens offset..offset+length-1 at window positions 0..length-1
    for cur in tqdm(range(n_ctx, n_ctx + pred_len), disable=not verbose, desc="forecast", leave=False):
        start = max(0, cur - max_context)  # the window is tokens start..cur-1, at positions 0..cur-start-1
        if cache is not None:
            if start != offset:
                # The window slid: every hidden state in it changes, so the cache restarts on the new window.
                offset, length = start, 0
            lo = offset + length  # feed what the cache has not seen (the whole window at first)
            s1_logits, h_last = model.decode_s1_cached(s1[:, lo:cur], s2[:, lo:cur], stamps[:, lo:cur], cache, length)
            length = cur - offset
            s1_next = sample_from_logits(s1_logits, temperature, top_k, top_p, generators)
            s2_logits = model.decode_s2_cached(h_last, s1_next, cache, length)  # the s1 query sees the whole window
        else:
            # Full recompute of the window (the published algorithm).
            s1_logits, context = model.decode_s1(s1[:, start:cur], s2[:, start:cur], stamps[:, start:cur])
            s1_next = sample_from_logits(s1_logits[:, -1], temperature, top_k, top_p, generators)
            s2_logits = model.decode_s2(context, s1_next)[:, -1]
        s2_next = sample_from_logits(s2_logits, temperature, top_k, top_p, generators)
        s1[:, cur] = s1_next[:, 0]
        s2[:, cur] = s2_next[:, 0]
    return s1, s2
