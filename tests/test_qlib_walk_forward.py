"""kronos qlib-walk-forward: periods that never train on what they test, the verdict the right way round, and the
whole command on a tiny synthetic Qlib folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from finetune.evaluation.statistics import paired_test
from finetune.qlib_walk_forward import signal_days, walk_forward_periods
from model.errors import ConfigError
from tests.conftest import cpu_env

CAL = pd.bdate_range("2019-01-01", "2022-12-30")


@pytest.mark.parametrize("months,val_months,purge", [(6, 6, 10), (3, 2, 5), (1, 12, 20)])
def test_no_training_or_validation_target_reaches_its_test_period(months, val_months, purge):
    periods = walk_forward_periods(CAL, "2019-01-01", "2021-01-01", "2022-06-30", months, val_months, purge)
    pos = lambda day: int(CAL.searchsorted(day))  # noqa: E731
    assert periods[0].test[0] == pd.Timestamp("2021-01-01") and periods[-1].test[1] == pd.Timestamp("2022-06-30")
    for k, p in enumerate(periods):
        first_signal = pos(p.test[0]) - 1  # the day before the period's first trading day trades on it
        assert pos(p.val[0]) - pos(p.train[1]) - 1 == purge  # trading days strictly between the blocks
        assert first_signal - pos(p.val[1]) - 1 == purge
        assert p.train[0] == pd.Timestamp("2019-01-01") and p.train[1] < p.val[0] <= p.val[1] < p.test[0]
        if k:  # consecutive, non-overlapping test periods; each signal day belongs to exactly one period
            assert p.test[0] == periods[k - 1].test[1] + pd.Timedelta(days=1)
            assert signal_days(CAL, periods, k)[0] > signal_days(CAL, periods, k - 1)[1]
    assert len(periods) == -(-18 // months)


def test_a_span_without_room_for_training_is_named():
    with pytest.raises(ConfigError, match="walk_forward.test_range: period 0"):
        walk_forward_periods(CAL, "2019-01-01", "2019-06-01", "2019-12-31", 6, 6, 10)


def ic_verdict(diff: pd.Series, lag: int) -> dict:
    """The Qlib walk-forward's verdict on daily IC differences (finetuned - zero-shot: higher is better)."""
    return paired_test(diff.to_numpy(), diff.index, lag, higher_is_better=True)


def test_verdict_direction_and_recomputation():
    rng = np.random.default_rng(0)
    days = pd.bdate_range("2024-01-01", periods=300)
    noise = pd.Series(rng.normal(0, 0.05, len(days)), index=days)
    assert ic_verdict(noise + 0.03, 9)["verdict"] == "helps"
    hurts = ic_verdict(noise - 0.03, 9)
    assert hurts["verdict"] == "hurts" and hurts["ci_high"] < 0 and "below 0" in hurts["reason"]
    none = ic_verdict(noise - noise.mean(), 9)
    assert none["verdict"] == "no_evidence" and none["ci_low"] < 0 < none["ci_high"]
    assert none["mean"] == pytest.approx(0.0, abs=1e-12) and none["dates"] == 300
    # the same rule as the CSV verdict: 9 days of dependence -> prewhitening at lag 10 leaves MA(10) residuals,
    # bandwidth 2 x 10 (issue 51), 30 stretches of 10 days
    assert (none["lag"], none["blocks"]) == (20, 30)
    short = ic_verdict(noise[:100] + 0.03, 9)  # 10 stretches of 10 days: too few for an interval, whatever the mean
    assert short["verdict"] == "no_evidence" and "only 10 non-overlapping stretches of 10 dates" in short["reason"]
    assert short["ci_low"] is None  # nothing for a plot to draw either


def tiny_walk_forward_config(tmp_path) -> dict:
    """A tiny Qlib store of 6 synthetic stocks, a tiny pretrained pair and the walk-forward settings over them."""
    from finetune.qlib_builder import build_qlib_provider
    from finetune.synthetic import generate_ohlcv
    from tests.model_factory import tiny_models
    from tests.test_qlib_pipeline import tiny_config

    frames = generate_ohlcv(6, None, "1D", start="2021-01-04", end="2022-06-30", seed=3)
    build_qlib_provider(frames, tmp_path / "qlib", universe="csi300", benchmark="SH000300")
    tokenizer, predictor = tiny_models()
    tokenizer.save_pretrained(tmp_path / "pre_tok")
    predictor.save_pretrained(tmp_path / "pre_pred")
    cfg = yaml.safe_load(tiny_config(tmp_path).read_text())
    cfg["model"] = {"pretrained_tokenizer": str(tmp_path / "pre_tok"),
                    "pretrained_predictor": str(tmp_path / "pre_pred")}
    cfg["walk_forward"] = {"test_range": ["2022-01-01", "2022-04-30"], "period_months": 2, "val_months": 2,
                           "block_days": 5}
    return cfg


@pytest.mark.slow
def test_walk_forward_command_on_a_tiny_store(tmp_path):
    pytest.importorskip("qlib")
    cfg = tiny_walk_forward_config(tmp_path)
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(cfg))
    env = cpu_env(DIST_BACKEND="gloo", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", "qlib-walk-forward", "--config",
                           str(tmp_path / "wf.yaml"), "--device", "cpu"], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "models" / "walk_forward"
    assert {"report.json", "periods.csv", "signals.csv", "walk_forward.png", "period_0", "period_1"} <= {
        p.name for p in out.iterdir()}
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] in ("helps", "hurts", "no_evidence") and "verdict: " in proc.stdout
    periods = pd.read_csv(out / "periods.csv")
    assert list(periods["period"]) == ["0", "1", "all"]
    signals = pd.read_csv(out / "signals.csv", parse_dates=["datetime"])
    assert not signals.duplicated(["datetime", "instrument"]).any()
    for k in (0, 1):  # every period trained on data that ends before its first signal day
        run = yaml.safe_load((out / f"period_{k}" / "config.yaml").read_text())
        assert pd.Timestamp(run["data"]["val_time_range"][1]) < pd.Timestamp(periods["test_start"][k])
        assert (out / f"period_{k}" / "finetune_predictor" / "best_model" / "config.json").is_file()
    assert report["periods"][-1]["days_finetuned"] == signals["datetime"].nunique()
