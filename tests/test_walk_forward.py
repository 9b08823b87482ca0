"""kronos walk-forward (finetune_csv/walk_forward.py): purged folds, paired statistics, verdict, report, resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune.utils.store import SeriesPanel
from finetune_csv import walk_forward as wf
from finetune_csv.config import load
from model.errors import ConfigError, RefusedError
from tests import model_factory

YAML = """
data:
  path: {data}
  lookback: 16
  predict: 4
  train_ratio: 0.7
  val_ratio: 0.15
  test_ratio: 0.15
  stride: 8
model:
  pretrained_tokenizer: {models}/tokenizer
  pretrained_predictor: {models}/predictor
training: {{epochs: 1, batch_size: 16, num_workers: 0, log_every_steps: 50, progress_bar: false}}
tokenizer_training: {{epochs: 0}}
predictor_training: {{lr: 1.0e-3}}
paths:
  exp_name: wf
  base_dir: {out}/{{exp_name}}
forecast: {{sample_count: 4, bootstrap_samples: 200}}
walk_forward: {{folds: 2, test_bars: 8}}
"""


def panel(lengths: list[int], ends: list[str]) -> SeriesPanel:
    """Series of the given lengths, hourly bars ending at the given times (uneven lengths and end dates)."""
    feats, stamps, when = [], [], []
    for n, end in zip(lengths, ends):
        feats.append(np.ones((n, 6), np.float32))
        stamps.append(np.zeros((n, 5), np.int64))
        when.append(pd.date_range(end=end, periods=n, freq="1h").asi8)
    return SeriesPanel.from_series(feats, stamps, [f"s{i}" for i in range(len(lengths))], when)


@pytest.mark.parametrize("purge,embargo", [(4, 0), (7, 3)])
def test_no_training_or_validation_target_reaches_into_the_test_block(purge, embargo):
    lookback, predict = 16, 4
    p = panel([300, 220, 260], ["2024-03-01 00:00", "2024-03-01 00:00", "2024-02-28 12:00"])
    folds = wf.make_folds(p, lookback, predict, folds=3, test_bars=12, purge=purge, embargo=embargo, val_ratio=0.2)
    when = np.asarray(p.datetimes)
    prev_test_stop = None
    for fold in folds:
        test_first = fold.test.first_target
        for s in range(3):
            # every row a training or validation window reads lies `purge` rows before this series' test block
            assert fold.train.stop[s] <= test_first[s] - purge
            assert fold.val.stop[s] <= test_first[s] - purge
            assert fold.train.stop[s] <= fold.val.first_target[s] - purge  # the validation block is purged too
            assert fold.train.stop[s] - fold.train.start[s] >= lookback + predict
            assert fold.test.first_target[s] - fold.test.start[s] == lookback  # context only, read before the block
        # and no training/validation target is dated at or after the fold's earliest test start in ANY series
        assert when[fold.val.stop - 1].max() < when[test_first].min()
        assert when[fold.train.stop - 1].max() < when[test_first].min()
        if prev_test_stop is not None:  # blocks never overlap, `embargo` rows apart
            assert (test_first - prev_test_stop == embargo).all()
        prev_test_stop = fold.test.stop
    # the series ending earlier (s2) pulls the others' training end before its test start
    assert when[folds[-1].train.stop[0] - 1] < when[folds[-1].test.first_target[2]]


def test_too_short_series_and_a_purge_below_predict_are_named(tmp_path):
    with pytest.raises(ValueError, match="walk_forward.folds"):
        wf.make_folds(panel([60], ["2024-03-01"]), 16, 4, folds=4, test_bars=12, purge=4, embargo=0, val_ratio=0.2)
    config = tmp_path / "c.yaml"
    config.write_text(YAML.format(data=tmp_path, models=tmp_path, out=tmp_path))
    with pytest.raises(ConfigError, match="walk_forward.purge"):
        load(config, ["walk_forward.purge=3"])
    with pytest.raises(ConfigError, match="walk_forward.candidates"):
        load(config, ["walk_forward.candidates=[finetuned, persistence]"])


def make_blocks(effect: float, n_folds: int = 4, n_series: int = 3, n_windows: int = 20, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = [(k, f"s{s}", pd.Timestamp("2024-01-01") + pd.Timedelta(hours=k * n_windows + i))
            for k in range(n_folds) for s in range(n_series) for i in range(n_windows)]
    fold, series, when = map(np.array, zip(*rows))
    diff = effect + 0.002 * rng.standard_normal(len(rows))
    return diff, fold, series, when


@pytest.mark.parametrize("effect,word", [(-0.003, "helps"), (0.003, "hurts"), (0.0, "no_evidence")])
def test_the_verdict_points_the_right_way(effect, word):
    diff, fold, series, when = make_blocks(effect)
    stats = wf.paired_stats(diff, fold, series, when, n_boot=500)
    assert wf.verdict(stats)[0] == word
    assert stats["mean"] == pytest.approx(diff.mean())
    assert stats["windows"] == len(diff) and stats["blocks"] == 12
    if word != "no_evidence":
        assert stats["p_value"] < 0.01 and np.sign(stats["dm_stat"]) == np.sign(effect)
        assert stats["share_folds_won"] == (1.0 if word == "helps" else 0.0)
        assert stats["windows_needed"] < len(diff)  # detected, so fewer windows would have done


def test_newey_west_equals_the_variance_without_lags_and_grows_with_positive_autocorrelation():
    x = np.random.default_rng(1).standard_normal(400)
    assert wf.newey_west(x, lags=0) == pytest.approx(x.var())
    smooth = np.convolve(x, np.ones(5) / 5, mode="valid")
    assert wf.newey_west(smooth, lags=8) > 2 * smooth.var()


@pytest.fixture
def run_config(tmp_path: Path) -> Path:
    """Three uneven synthetic series, a tiny pretrained pair on disk and a two-fold config."""
    frames = generate_ohlcv(n_series=2, n_bars=150, freq="5min", seed=0)
    frames["SH700000"] = generate_ohlcv(n_series=1, n_bars=130, freq="5min", seed=1)["SH600000"]
    write_csv_folder(frames, tmp_path / "data")
    tok, pred = model_factory.tiny_models()
    tok.save_pretrained(tmp_path / "models" / "tokenizer")
    pred.save_pretrained(tmp_path / "models" / "predictor")
    config = tmp_path / "wf.yaml"
    config.write_text(YAML.format(data=tmp_path / "data", models=tmp_path / "models", out=tmp_path / "out"))
    return config


def test_report_and_windows_csv_agree_and_a_rerun_skips_finished_folds(run_config, tmp_path, capsys):
    assert wf.main(["--config", str(run_config)]) == 0
    out = tmp_path / "out" / "wf" / "walk_forward"
    report = json.loads((out / "report.json").read_text())
    assert [f["fold"] for f in report["folds"]] == [0, 1]
    for f in report["folds"]:
        assert pd.Timestamp(f["train_end"]) < pd.Timestamp(f["val_start"]) <= pd.Timestamp(f["val_end"]) \
            < pd.Timestamp(f["test_start"]) < pd.Timestamp(f["test_end"])
        assert f["purge"] == 4 and f["windows"]["test"] == 3 * 2  # 3 series x 8 bars / 4
    assert (out / "walk_forward.png").stat().st_size > 0
    assert (out / "fold_1" / "basemodel" / "best_model" / "model.safetensors").is_file()

    # (b) the paired mean and the verdict recomputed from windows.csv
    rows = pd.read_csv(out / "windows.csv", parse_dates=["window_start"])
    assert set(rows.candidate) >= {"zero_shot", "finetuned", "persistence", "empirical"}
    spans = rows.groupby(["series", "fold"]).window_start.agg(["min", "max"])  # per series the blocks follow in time
    for name in rows.series.unique():
        assert spans.loc[(name, 0), "max"] < spans.loc[(name, 1), "min"]
    assert len(rows) == rows[["fold", "series", "window_start", "candidate"]].drop_duplicates().shape[0]
    wide = rows.pivot_table(index=["fold", "series", "window_start"], columns="candidate", values=["crps", "mae"])
    crps = report["paired"]["finetuned_vs_zero_shot"]["crps"]
    assert crps["mean"] == pytest.approx((wide["crps"]["finetuned"] - wide["crps"]["zero_shot"]).mean(), abs=1e-12)
    assert report["paired"]["finetuned_vs_zero_shot"]["mae"]["mean"] == pytest.approx(
        (wide["mae"]["finetuned"] - wide["mae"]["zero_shot"]).mean(), abs=1e-12)
    assert crps["windows"] == 12
    again = wf.paired_from_windows(rows, report["settings"]["bootstrap_samples"], 0)
    assert wf.verdict(again["crps"])[0] == report["verdict"] in ("helps", "hurts", "no_evidence")
    assert again["crps"]["ci_low"] == pytest.approx(crps["ci_low"])
    assert "verdict:" in capsys.readouterr().out

    # (d) a re-run skips finished folds: nothing retrained or rescored, the same report
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and "fold_" in str(p)}
    assert wf.main(["--config", str(run_config)]) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert json.loads((out / "report.json").read_text())["paired"] == report["paired"]

    # a cutoff after fold 0's test start leaves it out of the verdict (no retraining: the folds are unchanged)
    cutoff = report["folds"][1]["test_start"]
    assert wf.main(["--config", str(run_config), "--set", f"model.pretraining_cutoff='{cutoff}'"]) == 0
    cut = json.loads((out / "report.json").read_text())
    assert cut["excluded_folds"] == [0] and cut["paired"]["finetuned_vs_zero_shot"]["crps"]["windows"] == 6
    assert not pd.read_csv(out / "windows.csv").query("fold == 0").in_verdict.any()

    # other settings are refused without --overwrite, and redone with it
    with pytest.raises(RefusedError, match="--overwrite"):
        wf.main(["--config", str(run_config), "--set", "forecast.sample_count=3"])
    assert wf.main(["--config", str(run_config), "--set", "forecast.sample_count=3", "--overwrite"]) == 0
    assert json.loads((out / "report.json").read_text())["settings"]["samples"] == 3
