"""What the demo's pretrained checkpoint is worth on the demo market: zero-shot vs finetuned vs from scratch.

    OMP_NUM_THREADS=1 python scripts/compare_pretrained_demo.py [--save]   # --save: <checkpoint>/comparison.json

Writes the demo market (scripts/make_synthetic_data.py's data: 4 series x 3000 five-minute bars, seed 0) into
<work>/data, then scores three predictors on the held-out TEST split (never used for training or model selection)
with the same (pretrained, frozen) tokenizer, so their losses are on the same tokens and compare directly:

  (a) zero-shot:   the pretrained predictor as it is;
  (b) finetuned:   finetune_csv/train_sequential.py with --config (default configs/csv_demo.yaml);
  (c) scratch:     the same run and budget (epochs, batch), predictor started from random weights of the same shape,
                   at --scratch-lr (default 2e-3: the from-scratch demo's rate).

The score is the engine's validation loss (teacher-forced, causal cross-entropy, mean of s1 and s2), per window;
95% intervals follow the project's one interval rule (finetune.evaluation.statistics.session_test: windows of one
trading session are one observation; too few sessions, no interval), and the differences are paired (same windows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from finetune.evaluation.statistics import session_test
from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune.utils.distributed import DistInfo
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import evaluate_predictor
from finetune.utils.windows import WindowDataset
from finetune_csv import train_sequential
from finetune_csv.config import load
from finetune_csv.pipeline import CsvPipeline
from finetune_csv.prepare import prepare_data
from finetune_csv.splits import build_dataset
from model import Kronos, KronosTokenizer
from model.errors import DataError
from model.predictor import load_pretrained_pair, load_trained_pair

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "demo-pretrained"))
    p.add_argument("--config", default=str(REPO / "configs" / "csv_demo.yaml"))
    p.add_argument("--work", default=str(REPO / "outputs" / "demo_compare"))
    p.add_argument("--scratch-lr", type=float, default=2e-3)
    p.add_argument("--set", action="append", default=[], help="extra config override for both training runs")
    p.add_argument("--save", action="store_true", help="write comparison.json into the checkpoint folder")
    return p.parse_args(argv)


@torch.no_grad()
def window_losses(predictor: Kronos, tokenizer: KronosTokenizer, dataset: WindowDataset,
                  batch: int = 64) -> np.ndarray:
    """Per-window loss (n_windows,) float64: mean over positions of (CE(s1) + CE(s2)) / 2, teacher-forced and
    causal as the engine's validation; its mean equals `evaluate_predictor` (checked by the caller)."""
    predictor.eval()
    tokenizer.eval()
    out = []
    for lo in range(0, len(dataset), batch):
        x, stamp = dataset.get_batch(np.arange(lo, min(lo + batch, len(dataset))))  # (B, W, 6), (B, W, 5)
        s1, s2 = tokenizer.encode(x, half=True)  # (B, W) each
        s1_logits, s2_logits = predictor(s1[:, :-1], s2[:, :-1], stamp[:, :-1], use_teacher_forcing=True,
                                         s1_targets=s1[:, 1:], causal_dep=True)  # (B, W-1, 2^bits)
        ce1 = F.cross_entropy(s1_logits.transpose(1, 2), s1[:, 1:], reduction="none").mean(1)  # (B,)
        ce2 = F.cross_entropy(s2_logits.transpose(1, 2), s2[:, 1:], reduction="none").mean(1)
        out.append(((ce1 + ce2) / 2).double().numpy())
    return np.concatenate(out)


def mean_ci95(values: np.ndarray, times: np.ndarray) -> list[float] | None:
    """95% interval of the mean of `values (n,)` over test windows at `times (n,)` (each window's last bar), by the
    interval rule over trading sessions; None where the rule claims no interval."""
    test = session_test(values, times)
    return None if test["ci_low"] is None else [test["ci_low"], test["ci_high"]]


def train(config: str, data: Path, out: Path, extra: list[str]) -> dict:
    """One train_sequential run into `out`; returns {'seconds', 'predictor_dir', 'tokenizer_source'}."""
    sets = [f"data.path={data}", f"paths.base_dir={out}", "training.resume=never", *extra]
    t0 = time.perf_counter()
    rc = train_sequential.main(["--config", config, *[a for s in sets for a in ("--set", s)]])
    if rc != 0:
        raise DataError(f"training into {out} failed with exit code {rc}")
    cfg = load(config, sets)
    return {"seconds": time.perf_counter() - t0, "predictor_dir": str(cfg.predictor_dir / "best_model"),
            "tokenizer_source": CsvPipeline(cfg).tokenizer_source()[0], "config": cfg}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    ckpt, work = Path(args.checkpoint), Path(args.work)
    data = work / "data"
    write_csv_folder(generate_ohlcv(4, 3000, "5min", seed=0), data)  # = scripts/demo.sh's market
    tok_src, pred_src = ckpt / "tokenizer", ckpt / "predictor"
    zero, tokenizer = load_pretrained_pair(pred_src, tok_src)
    arch = {k: zero.config[k] for k in ("n_layers", "d_model", "n_heads", "ff_dim", "ffn_dropout_p",
                                        "attn_dropout_p", "resid_dropout_p", "token_dropout_p", "learn_te")}
    common = [f"model.pretrained_tokenizer={tok_src}", *args.set]
    runs = {
        "finetuned": train(args.config, data, work / "finetuned", [*common, f"model.pretrained_predictor={pred_src}"]),
        "scratch": train(args.config, data, work / "scratch",
                         [*common, "model.pretrained_predictor=null", f"predictor_training.lr={args.scratch_lr}",
                          *[f"model.predictor_arch.{k}={v}" for k, v in arch.items()]]),
    }
    cfg = runs["finetuned"]["config"]
    test_set = build_dataset(prepare_data(cfg.data, cfg.store_dir).splits["test"], cfg.data)  # the run's store
    # load_trained_pair: each trained predictor must record this tokenizer's fingerprint
    models = {"zero_shot": zero, **{k: load_trained_pair(r["predictor_dir"], tokenizer)[0] for k, r in runs.items()}}
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    times = np.asarray(test_set.panel.datetimes)[test_set.starts(np.arange(len(test_set))) + cfg.data.window.size - 1]
    sessions = int(np.unique(times.astype("datetime64[ns]").astype("datetime64[D]")).size)
    losses, result = {}, {"test_windows": len(test_set), "sessions": sessions, "models": {}}
    for name, model in models.items():
        for run in runs.values():
            assert Path(run["tokenizer_source"]).resolve() == tok_src.resolve(), "all must share the tokenizer"
        losses[name] = window_losses(model, tokenizer, test_set)
        engine = evaluate_predictor(model, tokenizer, test_set, TrainingConfig(batch_size=64, num_workers=0),
                                    dist)["val_loss"]
        if not np.isclose(engine, losses[name].mean(), rtol=1e-4):
            raise AssertionError(f"{name}: per-window mean {losses[name].mean()} != engine loss {engine}")
        result["models"][name] = {"test_loss": float(losses[name].mean()), "ci95": mean_ci95(losses[name], times)}
        if name in runs:
            result["models"][name]["train_seconds"] = round(runs[name]["seconds"], 1)
    for a, b in (("finetuned", "zero_shot"), ("finetuned", "scratch"), ("zero_shot", "scratch")):
        d = losses[a] - losses[b]
        result[f"{a}_minus_{b}"] = {"mean": float(d.mean()), "ci95": mean_ci95(d, times)}
    result["config"] = str(args.config)
    result["overrides"] = args.set
    result["scratch_lr"] = args.scratch_lr
    print(format_table(result))
    if args.save:
        (ckpt / "comparison.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


def format_table(r: dict) -> str:
    ci = lambda c: f"[{c[0]:+.4f}, {c[1]:+.4f}]" if c else "none (too few sessions)"  # noqa: E731
    lines = [(f"test split of the demo market, {r['test_windows']} windows in {r['sessions']} trading sessions; loss = "
              "(CE s1 + CE s2) / 2, 95% intervals by the interval rule"),
             "| predictor | test loss | 95% interval | training |", "|---|---|---|---|"]
    for name, m in r["models"].items():
        secs = f"{m['train_seconds']:.0f} s" if "train_seconds" in m else "none"
        lines.append(f"| {name} | {m['test_loss']:.4f} | {ci(m['ci95'])} | {secs} |")
    for key in ("finetuned_minus_zero_shot", "finetuned_minus_scratch", "zero_shot_minus_scratch"):
        lines.append(f"{key.replace('_minus_', ' - ')}: {r[key]['mean']:+.4f} {ci(r[key]['ci95'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
