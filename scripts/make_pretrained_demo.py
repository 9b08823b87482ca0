"""Build the demo's small pretrained checkpoint: a tiny tokenizer + predictor trained on a broad synthetic mix.

    OMP_NUM_THREADS=1 python scripts/make_pretrained_demo.py                 # -> checkpoints/demo-pretrained/
    OMP_NUM_THREADS=1 python scripts/make_pretrained_demo.py --force         # rebuild over an existing one

Published weights cannot be downloaded everywhere, so the demo finetunes from this stand-in instead. The data is
`finetune.synthetic.generate_mix` (many calendars, bar lengths and dynamics, unlike the demo market); the models have
the demo's architecture (configs/csv_demo.yaml) and are trained with the project's own engine
(`train_tokenizer`, then `train_predictor` on the best tokenizer's tokens). The best epochs are copied, in the
published format, to <out>/tokenizer/ and <out>/predictor/, and <out>/README.md records how they were made.
Then `scripts/compare_pretrained_demo.py` measures what the checkpoint is worth on the demo market.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from finetune.synthetic import generate_mix
from finetune.utils.distributed import distributed_context, seed_everything
from finetune.utils.errors import setup_logging
from finetune.utils.metrics import git_commit
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import train_predictor, train_tokenizer
from finetune.utils.windows import SeriesArrays, WindowDataset
from model import Kronos, KronosTokenizer
from model.config import Window
from model.features import FEATURES, calc_time_stamps
from model.fileio import atomic_dir, write_json
from model.hub import weights_fingerprint
from model.predictor import PREDICTOR_INFO_NAME, predictor_info

REPO = Path(__file__).resolve().parents[1]
# The demo's shapes (configs/csv_demo.yaml), so that the demo can start from this checkpoint unchanged.
TOKENIZER_ARCH = {"d_in": 6, "d_model": 32, "n_heads": 2, "ff_dim": 64, "n_enc_layers": 2, "n_dec_layers": 2,
                  "ffn_dropout_p": 0.0, "attn_dropout_p": 0.0, "resid_dropout_p": 0.0, "s1_bits": 6, "s2_bits": 6,
                  "beta": 0.05, "gamma0": 1.0, "gamma": 1.1, "zeta": 0.05, "group_size": 4}
PREDICTOR_ARCH = {"s1_bits": 6, "s2_bits": 6, "n_layers": 2, "d_model": 64, "n_heads": 4, "ff_dim": 128,
                  "ffn_dropout_p": 0.0, "attn_dropout_p": 0.0, "resid_dropout_p": 0.0, "token_dropout_p": 0.0,
                  "learn_te": True}
LOOKBACK, PREDICT = 64, 16  # the demo's window
VAL_SHARE = 0.1  # last 10% of every mix series is the validation split

log = logging.getLogger("make_pretrained_demo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "checkpoints" / "demo-pretrained"), help="checkpoint folder to write")
    p.add_argument("--work", default=str(REPO / "outputs" / "demo_pretrain"),
                   help="training folder (metrics, loss curves, last.pt); replaced on every run")
    p.add_argument("--n-series", type=int, default=60, help="series in the synthetic mix (12 per bar length)")
    p.add_argument("--n-bars", type=int, default=3000, help="bars per series")
    p.add_argument("--stride", type=int, default=8, help="rows between training windows")
    p.add_argument("--tokenizer-epochs", type=int, default=2)
    p.add_argument("--predictor-epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="seed of the mix and of training")
    p.add_argument("--force", action="store_true", help="replace an existing checkpoint in --out")
    return p.parse_args(argv)


def mix_datasets(n_series: int, n_bars: int, seed: int, stride: int) -> tuple[WindowDataset, WindowDataset, dict]:
    """Train/val window datasets of the mix: each series split by time, val keeps `LOOKBACK` rows of context."""
    mix = generate_mix(n_series, n_bars, seed=seed)
    cut = round(n_bars * (1.0 - VAL_SHARE))
    train, val = [], []
    for s in mix:
        feats = s.frame[list(FEATURES)].to_numpy(dtype=np.float32)  # (n_bars, 6)
        stamps = calc_time_stamps(s.frame["timestamps"]).to_numpy(dtype=np.int64)  # (n_bars, 5)
        train.append(SeriesArrays(feats[:cut], stamps[:cut], s.name))
        val.append(SeriesArrays(feats[cut - LOOKBACK:], stamps[cut - LOOKBACK:], s.name))
    train_set = WindowDataset(train, Window(LOOKBACK, PREDICT), stride=stride)
    val_set = WindowDataset(val, Window(LOOKBACK, PREDICT), stride=stride)
    counts = dict(Counter(key for s in mix for key in (s.freq, s.session, s.dynamics)))
    info = {"generator": "finetune.synthetic.generate_mix", "n_series": n_series, "n_bars": n_bars, "seed": seed,
            "val_share": VAL_SHARE, "stride": stride, "train_windows": len(train_set), "val_windows": len(val_set),
            "composition": counts}
    return train_set, val_set, info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    out, work = Path(args.out), Path(args.work)
    if out.exists() and any(out.iterdir()) and not args.force:
        raise SystemExit(f"error: {out} already holds a checkpoint; pass --force to replace it")
    if work.exists():
        shutil.rmtree(work)  # a scratch folder of this script only: fresh training, never a resumed mix
    t0 = time.perf_counter()
    train_set, val_set, data_info = mix_datasets(args.n_series, args.n_bars, args.seed, args.stride)
    log.info("mix: %d train / %d val windows; %s", len(train_set), len(val_set), data_info["composition"])
    base = TrainingConfig(batch_size=args.batch_size, weight_decay=0.1, pct_start=0.1, num_workers=0,
                          seed=args.seed, log_every_steps=50, progress_bar=False, resume="never")
    tok_cfg = TrainingConfig(**{**vars(base), "epochs": args.tokenizer_epochs, "lr": 2e-3})
    pred_cfg = TrainingConfig(**{**vars(base), "epochs": args.predictor_epochs, "lr": 2e-3})
    run_config = {"script": "scripts/make_pretrained_demo.py", "args": vars(args), "tokenizer_arch": TOKENIZER_ARCH,
                  "predictor_arch": PREDICTOR_ARCH, "lookback": LOOKBACK, "predict": PREDICT}

    with distributed_context() as dist:
        seed_everything(args.seed, dist.rank)
        t_tok = time.perf_counter()
        tok_result = train_tokenizer(KronosTokenizer(**TOKENIZER_ARCH), train_set, val_set, tok_cfg,
                                     work / "tokenizer", dist, run_config=run_config, data_info=data_info)
        t_pred = time.perf_counter()
        tokenizer = KronosTokenizer.from_pretrained(tok_result.best_model_dir)
        pred_result = train_predictor(Kronos(**PREDICTOR_ARCH), tokenizer, train_set, val_set, pred_cfg,
                                      work / "predictor", dist, run_config=run_config, data_info=data_info)
        t_end = time.perf_counter()

    git = git_commit(REPO)
    # best_model/ never holds NaN/inf weights (the engine's save_best and save_pretrained refuse to write them).
    # Publish: both best models go into a folder built beside `out`, swapped in whole (a failure keeps the old one).
    with atomic_dir(out) as tmp:
        for name, src in (("tokenizer", tok_result.best_model_dir), ("predictor", pred_result.best_model_dir)):
            (tmp / name).mkdir()
            for f in ("config.json", "model.safetensors"):
                shutil.copy2(src / f, tmp / name / f)
        # The window, clip (WindowDataset's default 5.0) and tokenizer beside it: from_pretrained needs nothing else.
        write_json(tmp / "predictor" / PREDICTOR_INFO_NAME, predictor_info(
            tmp / "predictor", max_context=LOOKBACK + PREDICT, lookback=LOOKBACK, tokenizer=tmp / "tokenizer",
            tokenizer_sha256=weights_fingerprint(tokenizer), clip=5.0))
        summary = {
            "command": "OMP_NUM_THREADS=1 python scripts/make_pretrained_demo.py " + " ".join(argv or sys.argv[1:]),
            "git_commit": "unknown" if git is None else git["commit"] + ("-dirty" if git["dirty"] else ""),
            "torch": torch.__version__, "data": data_info,
            "tokenizer": _stage_summary(tok_result, tok_cfg, t_pred - t_tok),
            "predictor": _stage_summary(pred_result, pred_cfg, t_end - t_pred),
            "total_seconds": round(time.perf_counter() - t0, 1),
        }
        write_json(tmp / "training_info.json", summary)
        for p in (out / "README.md", out / "comparison.json"):  # hand-written README and the last comparison
            if p.is_file():  # survive a rebuild (the numbers are re-measured)
                shutil.copy2(p, tmp / p.name)
    size_kb = sum(f.stat().st_size for f in out.rglob("*.safetensors")) / 1024
    log.info("wrote %s (%.0f KB of weights) in %.0f s: tokenizer val %.4f (epoch %s), predictor val %.4f (epoch %s)",
             out, size_kb, summary["total_seconds"], tok_result.best_val_loss, tok_result.best_epoch,
             pred_result.best_val_loss, pred_result.best_epoch)
    return 0


def _stage_summary(result, cfg: TrainingConfig, seconds: float) -> dict:
    return {"epochs": cfg.epochs, "lr": cfg.lr, "batch_size": cfg.batch_size, "steps": result.global_step,
            "best_epoch": result.best_epoch, "best_val_loss": _round(result.best_val_loss),
            "history": [{k: _round(v) for k, v in h.items() if k in ("epoch", "train_loss", "val_loss")}
                        for h in result.history],
            "seconds": round(seconds, 1)}


def _round(v):
    return round(v, 5) if isinstance(v, float) and math.isfinite(v) else v


if __name__ == "__main__":
    sys.exit(main())
