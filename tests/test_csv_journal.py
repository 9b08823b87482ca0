"""The forecast journal end to end on a tiny run: `--future` twice, new bars appended to the CSVs, `kronos track`
scores exactly the steps whose bars arrived, feeds them to the adaptive state once, and a rerun changes nothing."""

import json

import pandas as pd
import pytest

from finetune.evaluation.held_out import held_out_windows
from finetune_csv import forecast, journal
from finetune_csv.config import load
from finetune_csv.pipeline import calibrate
from finetune_csv.prepare import prepare_data
from model.config import Window
from model.errors import DataError
from tests.test_csv_eval import make_run
from tests.test_csv_eval_candidates import record_tokenizer


@pytest.mark.slow
def test_track_scores_exactly_the_arrived_steps_and_a_rerun_changes_nothing(tmp_path):
    config = make_run(tmp_path, zero_shot=None, extra=", calibration_method: adaptive")
    cfg = load(config)
    best = record_tokenizer(cfg, tmp_path / "start/tokenizer")
    calibrate(
        best,
        held_out_windows(prepare_data(cfg.data, cfg.store_dir).splits["val"], Window(24, 6), None),
        cfg.forecast,
        Window(24, 6, cfg.data.clip),
    )
    with pytest.raises(DataError, match="no forecast journal"):
        journal.track(cfg)
    forecast.run_future(cfg)
    forecast.run_future(load(config, ["forecast.seed=2"]))  # another draw: a second journaled forecast per series
    lines = (cfg.base_dir / "journal" / "forecasts.jsonl").read_text().splitlines()
    assert len(lines) == 4 and {json.loads(x)["margins"] is not None for x in lines} == {True}
    raw = {**json.loads(lines[0]), "id": "served-with-other-sampling", "margins": None}  # raw bands (serve's
    with open(cfg.base_dir / "journal" / "forecasts.jsonl", "a") as f:  # answer to other sampling): scored, not fed
        f.write(json.dumps(raw) + "\n")
    assert journal.track(cfg)["scored_steps"] == 0  # no bar after the origins yet
    for path in sorted((tmp_path / "data").glob("*.csv")):  # three new bars per series
        frame = pd.read_csv(path, parse_dates=["timestamps"])
        new = frame.tail(3).copy()
        new["timestamps"] = frame["timestamps"].iloc[-1] + pd.Timedelta("5min") * pd.RangeIndex(1, 4)
        pd.concat([frame, new]).to_csv(path, index=False)
    info = lambda: (best / "kronos_predictor.json").read_text()  # noqa: E731
    before = info()
    report = journal.track(cfg)
    assert report["scored_steps"] == 5 * 3 and len(report["fed"]) == 12  # 4 calibrated forecasts x 3 steps fed
    (model,) = report["models"].values()
    assert model["steps"] == 15 and 0 <= model["cov80"] <= 1 and model["crps"] > 0
    assert info() != before  # the adaptive state moved on
    after, track_json = info(), (cfg.base_dir / "journal" / "track.json").read_text()
    assert journal.track(cfg) == report and info() == after
    assert (cfg.base_dir / "journal" / "track.json").read_text() == track_json
    assert "Live forecasts" in (cfg.base_dir / "journal" / "track.html").read_text()
