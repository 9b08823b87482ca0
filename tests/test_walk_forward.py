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
from model.config import Window
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
forecast: {{sample_count: 4}}
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
def test_folds_are_date_ranges_shared_by_all_series_and_purged_on_each(purge, embargo):
    lookback, predict = 16, 4
    # s1 is shorter and s2 ends (is delisted) 30 hours before the others: uneven lengths AND end dates
    p = panel([300, 220, 260], ["2024-03-01 00:00", "2024-03-01 00:00", "2024-02-28 18:00"])
    folds = wf.make_folds(p, Window(lookback, predict), folds=3, test_bars=12, purge=purge, embargo=embargo,
                          val_ratio=0.2)
    when = np.asarray(p.datetimes)
    calendar = np.unique(when)
    prev_last = None
    for fold in folds:
        on = fold.test.stop > fold.test.first_target  # series in this fold
        block = calendar[len(calendar) - (2 - fold.index) * (12 + embargo) - 12:][:12]  # the fold's 12 dates
        for s in np.flatnonzero(on):
            test_dates = when[fold.test.first_target[s]:fold.test.stop[s]]
            assert np.isin(test_dates, block).all()  # one calendar: the series' test rows are the block's dates
            # every training and validation target ends `purge` of this series' own rows before its test rows
            assert fold.val.stop[s] <= fold.test.first_target[s] - purge
            assert fold.train.stop[s] <= fold.val.first_target[s] - purge
            assert fold.train.stop[s] - fold.train.start[s] >= lookback + predict
            assert fold.test.first_target[s] - fold.test.start[s] == lookback  # context only, read before the block
            assert when[fold.val.stop[s] - 1] < block[0]
        if prev_last is not None:  # fold k's test dates all follow fold k-1's
            assert when[fold.test.first_target[on]].min() > prev_last
        prev_last = when[fold.test.stop[on] - 1].max()
        assert wf.fold_dates(fold)["test_start"] == str(pd.Timestamp(block[0]))
    # s2 ends before the last two blocks: scored in fold 0 only, yet still trained on (all its rows but the
    # purged validation tail, every one before the block) in folds 1 and 2 -- never dropped silently
    assert [bool(f.test.stop[2] > f.test.first_target[2]) for f in folds] == [True, False, False]
    for f in folds[1:]:
        assert f.train.stop[2] - f.train.start[2] >= lookback + predict and f.val.stop[2] <= p.offsets[3]
        assert when[f.val.stop[2] - 1] < calendar[len(calendar) - (2 - f.index) * (12 + embargo) - 12]


def test_a_folds_validation_is_what_kronos_finetune_cuts_from_the_same_span():
    from finetune_csv.config import DataConfig
    from finetune_csv.splits import split_data

    lookback, predict, val_ratio = 16, 4, 0.2
    # uneven lengths and end dates: a per-series share would start each series' validation on another date
    p = panel([300, 220, 260], ["2024-03-01 00:00", "2024-03-01 00:00", "2024-02-28 18:00"])
    when = np.asarray(p.datetimes)
    cfg = DataConfig(path="x", lookback=lookback, predict=predict, train_ratio=1 - val_ratio, val_ratio=val_ratio,
                     test_ratio=0.0, split="by_date")
    for fold in wf.make_folds(p, Window(lookback, predict), folds=3, test_bars=12, purge=predict, embargo=0,
                              val_ratio=val_ratio):
        first = np.asarray(p.offsets[:-1])
        span = SeriesPanel.from_series(  # each series up to its last validation target: what the fold trains on
            [np.ones((e - o, 6), np.float32) for o, e in zip(first, fold.val.stop)],
            [np.zeros((e - o, 5), np.int64) for o, e in zip(first, fold.val.stop)], p.names,
            [when[o:e] for o, e in zip(first, fold.val.stop)])
        splits, how = split_data(span, cfg)
        for name, got in (("val", fold.val), ("train", fold.train)):  # purge = predict: finetune's purge too
            ref = splits[name]
            for a in ("start", "first_target", "stop"):  # the same rows of each series (local row numbers)
                assert (getattr(got, a) - first == getattr(ref, a) - np.asarray(span.offsets[:-1])).all(), (name, a)
            assert len(got.dataset(Window(lookback, predict))) == len(ref.dataset(Window(lookback, predict))) > 0
        val_first = when[fold.val.first_target[fold.val.stop > fold.val.first_target]]
        assert val_first.min() >= pd.Timestamp(how["train_end"]).value  # one date for every series
        assert (when[fold.val.first_target - 1] < pd.Timestamp(how["train_end"]).value).all()


def test_a_series_that_ends_before_every_test_block_is_named_in_a_warning(caplog):
    # s1 ends (is delisted) 100 hours before the others: the 3 blocks of 12 bars follow s0, s1 is in no fold
    p = panel([300, 260], ["2024-03-01 00:00", "2024-02-26 20:00"])
    with caplog.at_level("WARNING", logger=wf.log.name):
        folds = wf.make_folds(p, Window(16, 4), folds=3, test_bars=12, purge=4, embargo=0, val_ratio=0.2)
    assert all(f.test.stop[1] == f.test.first_target[1] for f in folds)
    assert "s1 are scored in no fold, only trained on" in caplog.text and "the verdict covers 1 of 2" in caplog.text
    assert all(f.train.stop[1] - f.train.start[1] >= 20 for f in folds)  # s1 still trains in every fold
    caplog.clear()
    with caplog.at_level("WARNING", logger=wf.log.name):  # ends 30 hours early: in fold 0, no warning
        wf.make_folds(panel([300, 260], ["2024-03-01 00:00", "2024-02-28 18:00"]), Window(16, 4), folds=3, test_bars=12,
                      purge=4, embargo=0, val_ratio=0.2)
    assert "in no fold" not in caplog.text


def test_too_short_series_and_a_purge_below_predict_are_named(tmp_path):
    with pytest.raises(ValueError, match="walk_forward.folds"):
        wf.make_folds(panel([60], ["2024-03-01"]), Window(16, 4), folds=4, test_bars=12, purge=4, embargo=0,
                      val_ratio=0.2)
    config = tmp_path / "c.yaml"
    config.write_text(YAML.format(data=tmp_path, models=tmp_path, out=tmp_path))
    with pytest.raises(ConfigError, match="walk_forward.purge"):
        load(config, ["walk_forward.purge=3"])
    with pytest.raises(ConfigError, match="walk_forward.candidates"):
        load(config, ["walk_forward.candidates=[finetuned, persistence]"])


def windows_frame(effect: float, n_folds: int = 4, n_series: int = 3, n_windows: int = 20, seed: int = 0):
    """windows.csv rows of finetuned and zero_shot: `effect` + noise as the CRPS difference per window."""
    rng = np.random.default_rng(seed)
    rows = pd.DataFrame([(k, f"s{s}", pd.Timestamp("2024-01-01") + pd.Timedelta(days=k * n_windows + i))
                         for k in range(n_folds) for s in range(n_series) for i in range(n_windows)],
                        columns=["fold", "series", "window_start"])
    diff = effect + 0.002 * rng.standard_normal(len(rows))
    return pd.concat([rows.assign(candidate="zero_shot", crps=0.01, mae=0.01),
                      rows.assign(candidate="finetuned", crps=0.01 + diff, mae=0.01 + diff)]), diff


@pytest.mark.parametrize("effect,word", [(-0.003, "helps"), (0.003, "hurts"), (0.0, "no_evidence")])
def test_the_verdict_points_the_right_way(effect, word):
    frame, diff = windows_frame(effect)
    stats = wf.paired_from_windows(frame)["crps"]
    assert stats["verdict"] == word
    assert stats["mean"] == pytest.approx(diff.mean())
    assert stats["windows"] == len(diff) and stats["dates"] == 80 and [r["fold"] for r in stats["per_fold"]] == [0, 1,
                                                                                                                2, 3]
    if word != "no_evidence":
        assert stats["p_value"] < 0.01 and np.sign(stats["dm_stat"]) == np.sign(effect)
        assert stats["share_folds_won"] == (1.0 if word == "helps" else 0.0)
        assert stats["windows_needed"] < len(diff)  # detected, so fewer windows would have done


@pytest.fixture
def run_config(tmp_path: Path) -> Path:
    """Three uneven synthetic series, a tiny pretrained pair on disk and a two-fold config."""
    frames = generate_ohlcv(n_series=2, n_bars=150, freq="5min", seed=0)
    # ends 8 bars (one test block) before the others: in fold 0, absent from fold 1
    frames["SH700000"] = generate_ohlcv(n_series=1, n_bars=142, freq="5min", seed=1)["SH600000"]
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
    for f, n_series in zip(report["folds"], (3, 2)):
        assert pd.Timestamp(f["train_end"]) < pd.Timestamp(f["val_start"]) <= pd.Timestamp(f["val_end"]) \
            < pd.Timestamp(f["test_start"]) < pd.Timestamp(f["test_end"])
        assert f["purge"] == 4 and f["windows"]["test"] == n_series * 2  # 8 bars / 4; SH700000 ended before fold 1
    assert (out / "walk_forward.png").stat().st_size > 0
    assert (out / "fold_1" / "basemodel" / "best_model" / "model.safetensors").is_file()

    # (b) the paired mean and the verdict recomputed from windows.csv
    rows = pd.read_csv(out / "windows.csv", parse_dates=["window_start"])
    assert set(rows.candidate) >= {"zero_shot", "finetuned", "persistence", "empirical"}
    spans = rows.groupby("fold").window_start.agg(["min", "max"])  # one calendar: fold 1 follows all of fold 0
    assert spans.loc[0, "max"] < spans.loc[1, "min"]
    assert rows.groupby("fold").window_start.nunique().tolist() == [2, 2]  # series share the blocks' dates
    assert len(rows) == rows[["fold", "series", "window_start", "candidate"]].drop_duplicates().shape[0]
    wide = rows.pivot_table(index=["fold", "series", "window_start"], columns="candidate", values=["crps", "mae"])
    crps = report["paired"]["finetuned_vs_zero_shot"]["crps"]
    # the verdict's mean is over windows, as the ranking's; its unit is the trading session (fold 1 has one series
    # fewer)
    diff = wide["crps"]["finetuned"] - wide["crps"]["zero_shot"]
    sessions = diff.index.get_level_values("window_start").normalize().nunique()
    assert crps["mean"] == pytest.approx(diff.mean(), abs=1e-12) and crps["dates"] == sessions
    assert crps["windows"] == 10
    again = wf.paired_from_windows(rows[rows.in_verdict])
    assert again["crps"]["verdict"] == report["verdict"] == "no_evidence"
    assert "no 95% interval: only" in report["verdict_reason"]  # 5-minute bars: the test windows span 1-2 sessions
    assert again["crps"]["ci_low"] is None and crps["ci_low"] is None  # and the plot draws none
    assert "verdict:" in capsys.readouterr().out

    # (d) a re-run skips finished folds: nothing retrained or rescored, the same report
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and "fold_" in str(p)}
    assert wf.main(["--config", str(run_config)]) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert json.loads((out / "report.json").read_text())["paired"] == report["paired"]

    # --report-only rewrites report.json, windows.csv and the plot from the folds' windows.csv: the same report
    written = {n: (out / n).read_bytes() for n in ("report.json", "windows.csv")}
    for name in ("report.json", "windows.csv", "walk_forward.png"):
        (out / name).unlink()
    assert wf.main(["--config", str(run_config), "--report-only"]) == 0
    assert {n: (out / n).read_bytes() for n in written} == written and (out / "walk_forward.png").is_file()
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # nothing trained or rescored

    # a cutoff after fold 0's test start leaves it out of the verdict (no retraining: the folds are unchanged)
    cutoff = report["folds"][1]["test_start"]
    assert wf.main(["--config", str(run_config), "--set", f"model.pretraining_cutoff='{cutoff}'"]) == 0
    cut = json.loads((out / "report.json").read_text())
    assert cut["excluded_folds"] == [0] and cut["paired"]["finetuned_vs_zero_shot"]["crps"]["windows"] == 4
    assert not pd.read_csv(out / "windows.csv").query("fold == 0").in_verdict.any()

    # other settings are refused without --overwrite, and redone with it
    with pytest.raises(RefusedError, match="made with other settings; pass --overwrite"):  # named part by part
        wf.main(["--config", str(run_config), "--set", "forecast.sample_count=3"])
    for flags in (["--report-only"], ["--report-only", "--overwrite"]):  # it never reports (or redoes) such folds
        with pytest.raises(RefusedError, match="--report-only: .* no fold finished with these settings"):
            wf.main(["--config", str(run_config), "--set", "forecast.sample_count=3", *flags])
    assert wf.main(["--config", str(run_config), "--set", "forecast.sample_count=3", "--overwrite"]) == 0
    assert json.loads((out / "report.json").read_text())["settings"]["samples"] == 3


@pytest.mark.slow
def test_sigterm_after_a_predictor_while_scoring_or_calibrating_ends_with_the_uninterrupted_report(
        run_config, tmp_path, monkeypatch, capsys):
    """Each interruption stops with exit 75 and one line; the re-runs end with the uninterrupted run's report.json,
    with calibrated rows in every fold."""
    import os
    import signal

    import finetune.utils.stages as stages
    import finetune_csv.pipeline as pipeline
    from finetune.utils.errors import run_main

    reference = tmp_path / "reference.yaml"
    reference.write_text(run_config.read_text().replace(str(tmp_path / "out"), str(tmp_path / "ref")))
    assert run_main(wf.main, ["--config", str(reference)]) == 0
    expected = json.loads((tmp_path / "ref/wf/walk_forward/report.json").read_text())

    def signal_after(module, name: str, before: bool = False) -> None:
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            if before:
                os.kill(os.getpid(), signal.SIGTERM)
            value = real(*args, **kwargs)
            if not before:
                os.kill(os.getpid(), signal.SIGTERM)
            return value

        monkeypatch.setattr(module, name, wrapped)

    for module, name, before, said in ((stages, "train_predictor", False, "after the predictor stage"),
                                       (pipeline, "sample_paths", True, "while sampling forecasts"),  # calibrating
                                       (wf, "sample_paths", True, "while sampling forecasts")):  # scoring
        signal_after(module, name, before)
        assert run_main(wf.main, ["--config", str(run_config)]) == 75, name
        err = capsys.readouterr().err
        assert f"stopped on SIGTERM {said}" in err and "Traceback" not in err, err
        monkeypatch.undo()
    assert run_main(wf.main, ["--config", str(run_config)]) == 0
    out = tmp_path / "out/wf/walk_forward"
    report = json.loads((out / "report.json").read_text())
    assert report["paired"] == expected["paired"] and report["verdict"] == expected["verdict"]
    assert [f["scores"] for f in report["folds"]] == [f["scores"] for f in expected["folds"]]
    assert all("calibrated" in f["scores"] for f in report["folds"])
    assert (out / "windows.csv").read_bytes() == (tmp_path / "ref/wf/walk_forward/windows.csv").read_bytes()


@pytest.mark.slow
def test_sigkill_at_chosen_moments_of_a_walk_forward_then_rerun_gives_the_uninterrupted_report(run_config, tmp_path):
    """A walk-forward killed (SIGKILL: no handler runs) right after fold 0's predictor is published (calibration
    pending), while fold 1 trains and while fold 1 is scored, each at a random delay, then run again, ends with the
    uninterrupted run's verdict, scores and windows.csv, calibrated in every fold."""
    import random
    import subprocess
    import sys
    import time

    from tests.conftest import cpu_env

    env = cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = lambda config: [sys.executable, "-m", "finetune.cli", "walk-forward", "--config", str(config)]
    reference = tmp_path / "reference.yaml"
    reference.write_text(run_config.read_text().replace(str(tmp_path / "out"), str(tmp_path / "ref")))
    subprocess.run(command(reference), env=env, capture_output=True, text=True, timeout=600, check=True)
    out = tmp_path / "out/wf/walk_forward"
    calibrated = lambda fold: "calibration" in (
        (out / fold / "basemodel/best_model/kronos_predictor.json").read_text()
        if (out / fold / "basemodel/best_model/kronos_predictor.json").is_file() else "")
    moments = [lambda: (out / "fold_0/basemodel/best_model").is_dir(),
               lambda: (out / "fold_1/basemodel/checkpoints").is_dir(),
               lambda: calibrated("fold_1")]
    rng, kills = random.Random(7), 0
    for moment in moments:
        job = subprocess.Popen(command(run_config), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while job.poll() is None and not moment() and time.monotonic() < deadline:
            time.sleep(0.01)
        if job.poll() is None:
            time.sleep(rng.uniform(0.0, 0.3))
            job.kill()
            kills += job.wait() == -9
    assert kills >= 2, f"the walk-forward finished before {3 - kills} of the kills: nothing was interrupted"
    final = subprocess.run(command(run_config), env=env, capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    got, expected = (json.loads((root / "wf/walk_forward/report.json").read_text())
                     for root in (tmp_path / "out", tmp_path / "ref"))
    assert got["paired"] == expected["paired"] and got["verdict"] == expected["verdict"]
    assert [f["scores"] for f in got["folds"]] == [f["scores"] for f in expected["folds"]]
    assert all("calibrated" in f["scores"] for f in got["folds"])
    assert (out / "windows.csv").read_bytes() == (tmp_path / "ref/wf/walk_forward/windows.csv").read_bytes()


def test_an_empirical_baseline_that_beats_the_models_is_named_best_in_the_verdict_line():
    frame, _ = windows_frame(0.0)
    rows = frame[frame.candidate == "zero_shot"]
    frame = pd.concat([frame, rows.assign(candidate="empirical", crps=0.006), rows.assign(candidate="persistence",
                                                                                          crps=0.02)])
    best = wf.best_candidate(frame)
    assert best["candidate"] == "empirical" and best["runner_up"] in ("zero_shot", "finetuned")
    assert list(best["ranking"])[0] == "empirical" and list(best["ranking"])[-1] == "persistence"
    assert best["test"]["verdict"] == "helps" and best["test"]["ci_high"] < 0  # 80 dates: an interval, below 0
    assert best["line"].startswith("best by CRPS: empirical") and "95% interval [" in best["line"]
