"""The whole Qlib chain on a tiny synthetic Qlib folder, as a user runs it:
build -> preprocess -> torchrun tokenizer (2 gloo ranks) -> torchrun predictor -> qlib_test.py backtest."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

pytest.importorskip("qlib")
from finetune.qlib_builder import build_qlib_provider
from finetune.synthetic import generate_ohlcv
from tests.conftest import cpu_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
N_STOCKS, TEST_RANGE = 6, ["2022-04-01", "2022-05-31"]


def tiny_config(tmp_path: Path) -> Path:
    cfg = {
        "data": {
            "qlib_data_path": str(tmp_path / "qlib"), "instrument": "csi300",
            "dataset_begin_time": "2021-01-04", "dataset_end_time": "2022-06-30",
            "train_time_range": ["2021-01-04", "2021-12-31"], "val_time_range": ["2022-01-01", "2022-03-31"],
            "test_time_range": TEST_RANGE, "lookback": 20, "predict": 3,
            "dataset_path": str(tmp_path / "processed"),
        },
        "model": {
            "pretrained_tokenizer": None, "pretrained_predictor": None,
            "tokenizer_arch": {"d_in": 6, "d_model": 16, "n_heads": 2, "ff_dim": 32, "n_enc_layers": 2,
                               "n_dec_layers": 2, "ffn_dropout_p": 0.0, "attn_dropout_p": 0.0, "resid_dropout_p": 0.0,
                               "s1_bits": 4, "s2_bits": 4, "beta": 0.05, "gamma0": 1.0, "gamma": 1.1, "zeta": 0.05,
                               "group_size": 4},
            "predictor_arch": {"n_layers": 1, "d_model": 16, "n_heads": 2, "ff_dim": 32, "ffn_dropout_p": 0.0,
                               "attn_dropout_p": 0.0, "resid_dropout_p": 0.0, "token_dropout_p": 0.0, "learn_te": True},
        },
        "training": {"epochs": 1, "batch_size": 16, "max_train_samples": 128, "max_val_samples": 64, "pct_start": 0.2,
                     "num_workers": 0, "log_every_steps": 1, "progress_bar": False},
        "tokenizer_training": {"lr": 1e-3},
        "predictor_training": {"lr": 1e-3},
        "paths": {"save_path": str(tmp_path / "models"), "backtest_result_path": str(tmp_path / "backtest")},
        "forecast": {"sample_count": 1, "batch_size": 256},
        "backtest": {"signals": ["mean", "last"], "topk": 3, "n_drop": 1, "hold_thresh": 1, "account": 1_000_000},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = cpu_env(DIST_BACKEND="gloo", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[:4]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def torchrun(script: str, config: Path) -> subprocess.CompletedProcess:
    return run(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, "--config", str(config)])


def finite_losses(metrics: Path) -> tuple[list[float], list[float]]:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r["loss"] for r in records if r.get("kind") == "train"]
    val = [r["val_loss"] for r in records if r.get("kind") == "val"]
    assert train and val and all(math.isfinite(v) for v in train + val)
    return train, val


def test_qlib_chain_end_to_end(tmp_path):
    frames = generate_ohlcv(N_STOCKS, None, "1D", start="2021-01-04", end="2022-06-30", seed=3)
    build_qlib_provider(frames, tmp_path / "qlib", universe="csi300", benchmark="SH000300")
    config = tiny_config(tmp_path)

    run(["finetune/qlib_data_preprocess.py", "--config", str(config)])
    processed = tmp_path / "processed"
    assert sorted(p.name for p in processed.iterdir()) == ["manifest.json", "test", "train", "val"]
    manifest = json.loads((processed / "manifest.json").read_text())
    assert [manifest["splits"][s]["instruments"] for s in ("train", "val", "test")] == [N_STOCKS] * 3

    torchrun("finetune/train_tokenizer.py", config)
    tok_dir = tmp_path / "models" / "finetune_tokenizer"
    for name in ("best_model/config.json", "best_model/model.safetensors", "checkpoints/last.pt", "metrics.jsonl",
                 "loss_curve.png", "run_info.json"):
        assert (tok_dir / name).is_file(), name
    finite_losses(tok_dir / "metrics.jsonl")

    torchrun("finetune/train_predictor.py", config)
    pred_dir = tmp_path / "models" / "finetune_predictor"
    for name in ("best_model/config.json", "best_model/model.safetensors", "best_model/tokenizer_config.json",
                 "checkpoints/last.pt", "metrics.jsonl", "loss_curve.png", "run_info.json"):
        assert (pred_dir / name).is_file(), name
    finite_losses(pred_dir / "metrics.jsonl")
    run_info = json.loads((pred_dir / "run_info.json").read_text())
    assert run_info["world_size"] == 2  # both ranks trained
    assert run_info["data"]["splits"]["train"]["instruments"] == N_STOCKS
    assert run_info["config"]["data"]["lookback"] == 20
    # best_model/ is a whole forecaster: KronosPredictor.from_pretrained finds the tokenizer and the window in it
    from model import KronosPredictor
    forecaster = KronosPredictor.from_pretrained(pred_dir / "best_model", device="cpu")
    assert forecaster.max_context == run_info["config"]["data"]["lookback"] + run_info["config"]["data"]["predict"]

    proc = run(["finetune/qlib_test.py", "--config", str(config), "--device", "cpu"])
    out = tmp_path / "backtest"
    assert {"report.json", "summary.csv", "signals.csv", "ic_decay.csv", "ic_decay.png", "backtest_daily.csv",
            "cumulative_return.png"} <= {p.name for p in out.iterdir()}
    signals = pd.read_csv(out / "signals.csv", parse_dates=["datetime"])
    test_days = pd.bdate_range(*TEST_RANGE)
    # one forecast per stock and trading day of the test range, plus the day before it (it trades on the first)
    assert len(signals) == N_STOCKS * (len(test_days) + 1)
    assert signals["datetime"].min() == pd.Timestamp("2022-03-31")
    assert signals[["mean", "last", "momentum"]].notna().all().all()
    report = json.loads((out / "report.json").read_text())
    for s in ("mean", "last", "momentum", "reversal"):
        assert math.isfinite(report["summary"][s]["IC"])
        excess = report["signals"][s]["backtest"]["excess_return_with_cost"]
        assert math.isfinite(excess["annualized_return"]) and excess["max_drawdown"] <= 0
        assert report["signals"][s]["backtest"]["first_day_turnover"] > 0
    daily = pd.read_csv(out / "backtest_daily.csv")
    assert {"mean_return", "mean_cost", "mean_turnover", "mean_held", "last_return", "bench"} <= set(daily.columns)
    assert "excess_ann" in proc.stdout and "best by IC at h=" in proc.stdout
