"""Train-step time at the published shapes: a plain fp32 step vs the shared engine's step (more columns on CUDA).
What each column measures, and the results, are in docs/benchmarks.md.

    python -m finetune.benchmarks.train_step                                  # CPU defaults: batch 2 x 128, few steps
    python -m finetune.benchmarks.train_step --batch 8 --seq 512 --models tokenizer-base kronos-small kronos-base
    python -m finetune.benchmarks.train_step --safety        # run-safety overheads, demo and Kronos-small scale
    python -m finetune.benchmarks.train_step --modes full lora freeze        # finetune modes, Kronos-small predictor

"plain" is the minimal hand-written step on tensors already in memory (forward, loss, backward, clip, AdamW);
"engine" runs `train_tokenizer` / `train_predictor` for one epoch and reads the per-step wall time from its
metrics.jsonl, so it includes everything a real step costs. Both show the fastest of the timed steps (as timeit
does: on a shared machine the minimum is the least disturbed measurement) and the median. fp32 columns run with
TF32 off, as `training.amp=none` trains; on CUDA the engine also runs with `amp=bf16`, eager and compiled.
`--safety` times the non-finite guard and one rotating checkpoint save against a predictor step in one process;
`--modes` runs the engine's predictor step once per `training.finetune_mode`, each in a fresh process (its peak
memory is its own). Models are randomly initialised (no download).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from finetune.utils.distributed import DistInfo
from finetune.utils.metrics import read_metrics
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import (
    PREDICTOR_CLIP,
    TOKENIZER_CLIP,
    predictor_loss,
    tokenizer_loss,
    train_predictor,
    train_tokenizer,
)
from finetune.utils.windows import SeriesArrays, WindowDataset
from model import Kronos, KronosTokenizer
from model.config import KronosConfig, KronosTokenizerConfig, Window

TOKENIZER_BASE = asdict(KronosTokenizerConfig())  # the published Kronos-Tokenizer-base
PREDICTORS = {
    "kronos-small": asdict(KronosConfig(s1_bits=10, s2_bits=10)),
    "kronos-base": asdict(KronosConfig(s1_bits=10, s2_bits=10, n_layers=12, d_model=832, n_heads=16, ff_dim=2048)),
}
GPU_SHAPES = {"tokenizer-base": (64, 512), "kronos-small": (64, 512), "kronos-base": (32, 512)}  # batch, seq


@dataclass
class Timing:
    """One column of one model: fastest and median ms per step, tokens/s of the fastest, its MFU (None: unknown)."""
    ms: float
    median_ms: float
    tokens_per_s: float
    mfu: float | None = None

    def cell(self) -> str:
        mfu = f"{100 * self.mfu:5.1f}%" if self.mfu is not None else "     -"
        return f"{self.ms:9.1f} ms {self.tokens_per_s:10,.0f} tok/s {mfu}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--models", nargs="+", default=["kronos-small", "kronos-base"] if cuda else
                   ["tokenizer-base", "kronos-small"], choices=["tokenizer-base", *PREDICTORS])
    p.add_argument("--batch", type=int, default=None if cuda else 2, help="windows per step (CUDA: per model)")
    p.add_argument("--seq", type=int, default=None if cuda else 128, help="window length (lookback + predict)")
    p.add_argument("--steps", type=int, default=20 if cuda else 5, help="timed steps")
    p.add_argument("--warmup", type=int, default=5 if cuda else 3, help="untimed steps first")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--safety", action="store_true", help="time the run-safety overheads instead (see above)")
    p.add_argument("--modes", nargs="+", choices=["full", "lora", "freeze"], help="compare finetune modes (see above)")
    p.add_argument("--targets", action="store_true", help="only the engine with its defaults (amp auto, compile "
                   "auto) at the issue's shapes, MFU = 6N FLOPs per token against --peak (gpu_check.sh)")
    p.add_argument("--peak", type=float, default=790e12, help="FLOP/s for --targets' MFU (790e12: the bf16 matrix "
                   "rate measured on an H100/H200)")
    return p.parse_args(argv)


def make_dataset(n_windows: int, seq: int, seed: int = 0) -> WindowDataset:
    """One random-walk series holding exactly `n_windows` windows of `seq` rows."""
    rng = np.random.default_rng(seed)
    n = n_windows + seq - 1
    close = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, n)))
    vol = rng.uniform(1e3, 1e4, n)
    feats = np.stack([close, close * 1.001, close * 0.999, close, vol, vol * close], 1).astype(np.float32)
    t = np.arange(n)
    stamps = np.stack([t % 60, (t // 60) % 24, t % 7, 1 + t % 28, 1 + t % 12], 1).astype(np.int64)
    return WindowDataset([SeriesArrays(feats, stamps, "bench")], Window(seq - 1, 1))


def plain_step_ms(name: str, args: argparse.Namespace, device: torch.device) -> Timing:
    """The hand-written fp32 step (TF32 off) on a fixed in-memory batch."""
    torch.manual_seed(0)
    tok = KronosTokenizer(**TOKENIZER_BASE).to(device)
    x, stamp = make_dataset(args.batch, args.seq).get_batch(list(range(args.batch)))
    x, stamp = x.to(device), stamp.to(device)
    if name == "tokenizer-base":
        model, clip = tok, TOKENIZER_CLIP

        def loss_fn():
            return tokenizer_loss(model, x)[0]
    else:
        model, clip = Kronos(**PREDICTORS[name]).to(device), PREDICTOR_CLIP
        tok.eval().requires_grad_(False)

        def loss_fn():
            return predictor_loss(model, tok, x, stamp)[0]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        loss_fn().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return Timing(1000 * min(times), 1000 * statistics.median(times), args.batch * args.seq / min(times))


def engine_step_ms(name: str, args: argparse.Namespace, device: torch.device, amp: str, mode: str = "full",
                   extra: dict | None = None, compile: bool | str = False, log_every: int = 1) -> Timing:
    """Per optimizer step of the real loop (one epoch of warmup + steps batches; metrics.jsonl; the compile, if
    any, happens in the first warmup step). `extra` (a dict) receives the run's parameter counts and its
    checkpoint's size."""
    torch.manual_seed(0)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    train_set = make_dataset(args.batch * (args.warmup + args.steps), args.seq)
    val_set = make_dataset(1, args.seq, seed=1)
    cfg = TrainingConfig(epochs=1, batch_size=args.batch, lr=1e-5, num_workers=0, log_every_steps=log_every, amp=amp,
                         compile=compile, progress_bar=False, resume="never", seed=0, finetune_mode=mode,
                         trainable=["head", "transformer.7"])
    tok = KronosTokenizer(**TOKENIZER_BASE)
    with tempfile.TemporaryDirectory() as out:
        if name == "tokenizer-base":
            train_tokenizer(tok, train_set, val_set, cfg, out, dist)
        else:
            train_predictor(Kronos(**PREDICTORS[name]), tok, train_set, val_set, cfg, out, dist)
        records = [r for r in read_metrics(Path(out) / "metrics.jsonl") if r["kind"] == "train"]
        if extra is not None:
            info = json.loads((Path(out) / "run_info.json").read_text())
            extra.update(trainable=info["trainable_parameters"], total=info["total_parameters"],
                         ckpt_mb=(Path(out) / "checkpoints" / "last.pt").stat().st_size / 2**20)
    # Each record covers `log_every` steps (the epoch's last maybe fewer), measured on the host; the logging
    # all-reduce/.item() synchronises CUDA, so the time is the steps' real cost. log_every > 1: every record after
    # the first (which holds the compile), as the engine's default (10) logs, with no host sync between its steps.
    prev = [0] + [r["step"] for r in records[:-1]]
    timed = [(r["seconds"] / (r["step"] - p), r) for r, p in zip(records, prev)][args.warmup if log_every == 1 else 1:]
    best_s, best = min(timed, key=lambda t: t[0])
    return Timing(1000 * best_s, 1000 * statistics.median(t[0] for t in timed), best["tokens_per_s"], best.get("mfu"))


# the models of configs/csv_demo.yaml
DEMO_TOKENIZER = asdict(KronosTokenizerConfig(d_model=32, n_heads=2, ff_dim=64, n_enc_layers=2, n_dec_layers=2,
                                              s1_bits=6, s2_bits=6))
DEMO_PREDICTOR = asdict(KronosConfig(s1_bits=6, s2_bits=6, n_layers=2, d_model=64, n_heads=4, ff_dim=128,
                                     ffn_dropout_p=0.0, resid_dropout_p=0.0))
SAFETY_SCALES = {  # name: (tokenizer args, predictor args, batch, seq)
    "demo": (DEMO_TOKENIZER, DEMO_PREDICTOR, 32, 80),  # the demo's batch 32 x (lookback 64 + predict 16)
    "kronos-small": (TOKENIZER_BASE, PREDICTORS["kronos-small"], 2, 128),
}


def safety_overhead(scale: str, steps: int, warmup: int) -> dict[str, float]:
    """ms of a predictor step, of the guard check and of one checkpoint save, measured in one process."""
    import finetune.utils.checkpoint as checkpoint_store
    from finetune.utils.safety import NonFiniteGuard

    tok_args, pred_args, batch, seq = SAFETY_SCALES[scale]
    torch.manual_seed(0)
    tok = KronosTokenizer(**tok_args).eval().requires_grad_(False)
    model = Kronos(**pred_args).train()
    x, stamp = make_dataset(batch, seq).get_batch(list(range(batch)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1)
    guard = NonFiniteGuard(amp=False)
    step_t, guard_t, norm_t = [], [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = predictor_loss(model, tok, x, stamp)[0]
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, PREDICTOR_CLIP)
        opt.step()
        t1 = time.perf_counter()
        guard.check(i + 1, loss.detach(), norm)
        t2 = time.perf_counter()
        torch.nn.utils.get_total_norm([p.grad for p in params])
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        if i >= warmup:
            step_t.append(t1 - t0)
            guard_t.append(t2 - t1)
            norm_t.append(t3 - t2)
    state = {"format": "bench", "model": model.state_dict(), "optimizer": opt.state_dict(), "loop": {"step": 1}}
    save_t = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(4):
            t0 = time.perf_counter()
            checkpoint_store.save(state, folder, i + 1, keep=2)
            save_t.append(time.perf_counter() - t0)
        size = (Path(folder) / "last.pt").stat().st_size
    return {"step_ms": 1000 * statistics.median(step_t), "guard_ms": 1000 * statistics.median(guard_t),
            "norm_ms": 1000 * statistics.median(norm_t), "save_ms": 1000 * statistics.median(save_t[1:]),
            "ckpt_mb": size / 2**20, "batch": batch, "seq": seq}


def safety_main(args: argparse.Namespace) -> list[dict]:
    print(f"run-safety overhead, CPU ({torch.get_num_threads()} threads), torch {torch.__version__}, medians of "
          f"{args.steps} steps after {args.warmup} warmup; predictor step incl. the frozen tokenizer's encode")
    print(f"{'scale':<14}{'batch x seq':>12}{'step ms':>10}{'guard ms':>10}{'guard %':>9}{'+norm %':>9}"
          f"{'save ms':>10}{'ckpt MiB':>10}{'save/step':>11}{'% @ every 100':>15}")
    rows = []
    for scale in SAFETY_SCALES:
        r = safety_overhead(scale, args.steps, args.warmup)
        rows.append({"scale": scale, **r})
        print(f"{scale:<14}{r['batch']:>5} x {r['seq']:<4}{r['step_ms']:10.2f}{r['guard_ms']:10.3f}"
              f"{100 * r['guard_ms'] / r['step_ms']:9.2f}{100 * r['norm_ms'] / r['step_ms']:9.2f}"
              f"{r['save_ms']:10.1f}{r['ckpt_mb']:10.1f}{r['save_ms'] / r['step_ms']:11.2f}"
              f"{r['save_ms'] / (100 * r['step_ms']) * 100:15.2f}", flush=True)
    return rows


def _mode_child(mode: str, args: argparse.Namespace, queue) -> None:
    """One finetune mode in a fresh process (its peak memory is its own)."""
    import resource

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    extra: dict = {}
    timing = engine_step_ms("kronos-small", args, device, "none", mode=mode, extra=extra)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
    queue.put({"mode": mode, "step_ms": timing.ms, "median_ms": timing.median_ms, "peak_mb": peak / 2**20, **extra})


def modes_main(args: argparse.Namespace) -> list[dict]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for mode in args.modes:
        queue = ctx.Queue()
        child = ctx.Process(target=_mode_child, args=(mode, args, queue))
        child.start()
        rows.append(queue.get())
        child.join()
    base = next((r for r in rows if r["mode"] == "full"), rows[0])
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    print(f"finetune modes, Kronos-small predictor, {args.batch} x {args.seq}, {device}, torch {torch.__version__}, "
          f"fastest of {args.steps} steps after {args.warmup} warmup; ratios to '{base['mode']}'")
    print(f"{'mode':<8}{'trainable':>12}{'share':>8}{'step ms':>10}{'ratio':>7}{'peak MiB':>10}{'ratio':>7}"
          f"{'ckpt MiB':>10}{'ratio':>7}")
    for r in rows:
        print(f"{r['mode']:<8}{r['trainable']:>12,}{100 * r['trainable'] / r['total']:7.2f}%{r['step_ms']:10.1f}"
              f"{r['step_ms'] / base['step_ms']:7.2f}{r['peak_mb']:10.0f}{r['peak_mb'] / base['peak_mb']:7.2f}"
              f"{r['ckpt_mb']:10.1f}{r['ckpt_mb'] / base['ckpt_mb']:7.3f}   (median {r['median_ms']:.1f} ms)")
    return rows


def targets_main(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The issue's train-step targets: the engine as a user runs it (amp auto, compile auto), tokens/s of the
    fastest step and MFU = tokens/s x 6N / peak (N: the predictor's parameters, nanoGPT's estimate without the
    attention term), beside the MFU the engine logs (its own peak table and FLOPs count)."""
    rows = []
    for name in [m for m in args.models if m != "tokenizer-base"]:
        shape = argparse.Namespace(**{**vars(args), "batch": args.batch or GPU_SHAPES[name][0],
                                      "seq": args.seq or GPU_SHAPES[name][1], "steps": max(args.steps, 40)})
        n = sum(p.numel() for p in Kronos(**PREDICTORS[name]).parameters())
        t = engine_step_ms(name, shape, device, "auto", compile="auto", log_every=10)  # the default logging
        rows.append({"model": name, "batch": shape.batch, "seq": shape.seq, "parameters": n, **t.__dict__,
                     "mfu_at_peak": t.tokens_per_s * 6 * n / args.peak, "peak": args.peak})
        print(f"{name} {shape.batch} x {shape.seq}: {t.ms:.1f} ms/step (median {t.median_ms:.1f}), "
              f"{t.tokens_per_s:,.0f} tokens/s, MFU {100 * rows[-1]['mfu_at_peak']:.1f}% of {args.peak / 1e12:.0f} "
              f"TFLOP/s (the log's: {'-' if t.mfu is None else f'{100 * t.mfu:.1f}%'})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = (safety_main(args) if args.safety else modes_main(args) if args.modes
            else targets_main(args, device) if args.targets else columns_main(args, device))
    if args.json:  # every table's rows, as printed
        args.json.write_text(json.dumps(rows, indent=2))


def columns_main(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The default table: plain vs engine step per model (the module docstring)."""
    # No torch.set_float32_matmul_precision here: every fp32 column is what training.amp=none trains (TF32 off).
    columns = {"plain fp32": None, "engine fp32": ("none", False)}
    if device.type == "cuda":
        columns.update({"engine bf16": ("bf16", False), "engine bf16 compiled": ("bf16", True)})
    rows = []
    for name in args.models:
        shape = argparse.Namespace(**{**vars(args), "batch": args.batch or GPU_SHAPES[name][0],
                                      "seq": args.seq or GPU_SHAPES[name][1]})
        timings = {col: plain_step_ms(name, shape, device) if how is None
                   else engine_step_ms(name, shape, device, how[0], compile=how[1]) for col, how in columns.items()}
        rows.append({"model": name, "batch": shape.batch, "seq": shape.seq,
                     **{col: t.__dict__ for col, t in timings.items()}})
        print(f"done {name}", flush=True)

    label = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\ntrain step, {label}, torch {torch.__version__}, fastest of {args.steps} steps after {args.warmup} warmup "
          "(fp32 = TF32 off, as training.amp=none; MFU where the device's peak is known)")
    for r in rows:
        print(f"{r['model']} {r['batch']} x {r['seq']}")
        for col in columns:
            t = Timing(**r[col])
            ratio = (f"  engine/plain {t.ms / r['plain fp32']['ms']:.2f}" if col == "engine fp32" else
                     f"  {r['engine fp32']['ms'] / t.ms:.2f}x engine fp32" if col != "plain fp32" else "")
            print(f"  {col:<22}{t.cell()}   (median {t.median_ms:.1f} ms){ratio}")
    if device.type == "cuda":
        print("training.amp=auto + compile=auto (the defaults) = 'engine bf16 compiled' plus TF32 for what stays "
              "float32 (the predictor stage's frozen tokenizer encode)")
    return rows


if __name__ == "__main__":
    import sys

    from finetune.utils.errors import run_main  # clean errors and exit codes (finetune/utils/errors.py)

    sys.exit(run_main(main))
