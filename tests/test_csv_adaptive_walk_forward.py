"""The walk-forward scores adaptive bands as `kronos forecast` does: each fold's test windows replayed in time order
with only the outcomes published by each window's origin, and its report carries the same band fields."""

import json

import numpy as np
import pandas as pd
import pytest

from finetune_csv import walk_forward as wf
from finetune_csv.config import load
from finetune_csv.prepare import prepare_data
from tests.test_walk_forward import run_config  # noqa: F401 - the fixture: three tiny series, two folds


@pytest.mark.slow
def test_walk_forward_replays_adaptive_bands_in_time_order(run_config, tmp_path, monkeypatch):  # noqa: F811
    assert wf.main(["--config", str(run_config), "--set", "forecast.calibration_method=adaptive"]) == 0
    out = tmp_path / "out" / "wf" / "walk_forward"
    report = json.loads((out / "report.json").read_text())
    cal = report["calibration"]
    assert cal["method"] == "adaptive" and 0 < cal["width80_raw"] and 0 < cal["width80_calibrated"] < np.inf
    assert 0 <= cal["cov80_rolling_worst"] <= 1 and len(cal["cov80_by_volatility"]) == 3
    assert set(cal["cov80_over_time"]) >= {"time", "raw", "calibrated", "split"} and cal["width80_split"] > 0
    assert [f["calibration"]["method"] for f in report["folds"]] == ["adaptive", "adaptive"]
    rows = pd.read_csv(out / "windows.csv", parse_dates=["window_start"])
    # like with like: the zero-shot model's bands calibrated too (its own validation margins, replayed the same way)
    per = rows.groupby("candidate").size()
    assert per["zero_shot_calibrated"] == per["calibrated"] == per["split"] == per["zero_shot"]
    assert not np.allclose(rows.query("candidate == 'zero_shot_calibrated'").width80,
                           rows.query("candidate == 'zero_shot'").width80)
    adaptive_rows, split_rows = (rows[rows.candidate == c].set_index(["fold", "series", "window_start"])
                                 for c in ("calibrated", "split"))

    # the same fold models scored with split bands: windows forecast before any test outcome was published get the
    # split margins; later ones the margins moved by the outcomes published by their origin
    cfg = load(run_config)
    panel = prepare_data(cfg.data, cfg.store_dir, with_splits=False).panel
    loads = []  # each model is loaded once per fold: sampled on the test and the validation windows
    counted = lambda name, real: lambda *a: loads.append(name) or real(*a)  # noqa: E731
    for name in ("load_trained_pair", "load_pretrained_pair"):
        monkeypatch.setattr(wf, name, counted(name, getattr(wf, name)))
    for fold in wf.tune_folds(cfg, panel, False):
        fold_cfg, _ = wf._train_fold(cfg, fold, out / f"fold_{fold.index}")  # finished: reused, not retrained
        loads.clear()
        split = wf.score_fold(cfg, fold_cfg, fold).query("candidate == 'calibrated'")
        assert sorted(loads) == ["load_pretrained_pair", "load_trained_pair"]
        split = split.set_index(["fold", "series", "window_start"])
        mine = adaptive_rows.loc[split.index]
        assert np.allclose(split_rows.loc[split.index].crps, split.crps)  # the "split" rows: the split bands
        first = split.index.get_level_values("window_start") == split.index.get_level_values("window_start").min()
        assert np.allclose(mine.crps[first], split.crps[first])
        assert not np.allclose(mine.width80[~first], split.width80[~first])
