"""Benchmark: forecasting with the key/value cache vs the plain full-recompute generator.

Kronos-small + Kronos-Tokenizer-base shapes (randomly initialised: timing does not depend on the weights), greedy
decoding so both paths must produce the same forecast, which is checked. Uses CUDA when present.

    python scripts/bench_generation.py                       # context 400 and 392, 120 steps, 1 sample
    python scripts/bench_generation.py --context 200 --steps 60 --samples 4

Past `max_context` the window slides and every hidden state in it changes, so both paths recompute the whole
window at each such step: with context 400 + 120 steps and max_context 512, the last 8 steps are full recomputes
in both paths, which bounds the speed-up at about 120 / (1 prefill + 8) even for a free cached step. Context 392
fills the window exactly and shows the cache alone.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd
import torch

from model import Kronos, KronosPredictor, KronosTokenizer

TOKENIZER_BASE = dict(d_in=6, d_model=256, n_heads=4, ff_dim=512, n_enc_layers=4, n_dec_layers=4, ffn_dropout_p=0.0,
                      attn_dropout_p=0.0, resid_dropout_p=0.0, s1_bits=10, s2_bits=10, beta=0.05, gamma0=1.0,
                      gamma=1.1, zeta=0.05, group_size=4)
KRONOS_SMALL = dict(s1_bits=10, s2_bits=10, n_layers=8, d_model=512, n_heads=8, ff_dim=1024, ffn_dropout_p=0.2,
                    attn_dropout_p=0.0, resid_dropout_p=0.2, token_dropout_p=0.0, learn_te=True)


def make_inputs(context: int, steps: int):
    rng = np.random.default_rng(0)
    close = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, context)))
    df = pd.DataFrame({"open": close, "high": close * 1.002, "low": close * 0.998, "close": close,
                       "volume": rng.uniform(1e3, 2e3, context)})
    ts = pd.date_range("2024-01-02 09:30", periods=context + steps, freq="5min")
    return df, pd.Series(ts[:context]), pd.Series(ts[context:])


def time_predict(predictor, args, inputs, repeats: int) -> tuple[float, pd.DataFrame]:
    best, out = float("inf"), None
    for _ in range(repeats):
        if predictor.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = predictor.predict(*inputs, args.steps, top_k=1, sample_count=args.samples, verbose=False)
        if predictor.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, nargs="+", default=[400, 392])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--max-context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1, help="best of N timings per path")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    tok, model = KronosTokenizer(**TOKENIZER_BASE), Kronos(**KRONOS_SMALL)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cached = KronosPredictor(model, tok, device=device, max_context=args.max_context, use_cache=True)
    plain = KronosPredictor(model, tok, device=device, max_context=args.max_context, use_cache=False)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"
    print(f"Generation, Kronos-small + Tokenizer-base shapes, {args.steps} steps, {args.samples} sample(s), greedy, "
          f"max_context {args.max_context}, device {name}, torch {torch.__version__}")
    print("| context | sliding steps | full recompute s | kv cache s | cached steps/s | speed-up | identical |")
    print("|---|---|---|---|---|---|---|")
    differ = False
    for context in args.context:
        inputs = make_inputs(context, args.steps)
        time_predict(cached, args, inputs, 1)  # warm-up (allocator, kernels)
        t_cache, a = time_predict(cached, args, inputs, args.repeats)
        t_plain, b = time_predict(plain, args, inputs, args.repeats)
        same = np.allclose(a.to_numpy(), b.to_numpy(), rtol=1e-4, atol=1e-4)
        differ |= not same
        sliding = max(0, context + args.steps - args.max_context)
        print(f"| {context} | {sliding} | {t_plain:.2f} | {t_cache:.2f} | {args.steps / t_cache:.1f} | "
              f"{t_plain / t_cache:.1f}x | {same} |", flush=True)
    if differ:
        raise SystemExit("cached and full-recompute forecasts differ")


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # clean errors and exit codes (finetune/utils/errors.py)

    sys.exit(run_main(main))
