"""The forecast journal end to end on a tiny run: `--future` twice, new bars appended to the CSVs, `kronos track`
scores exactly the steps whose bars arrived, feeds them to the adaptive state once, and a rerun changes nothing; a
served series data.path lacks is counted, not scored; `kronos forecast` rebuilding the state makes track feed again."""

import json
import logging

import pandas as pd
import pytest

from finetune.evaluation.held_out import held_out_windows
from finetune_csv import forecast, journal
from finetune_csv.config import load
from finetune_csv.pipeline import calibrate
from finetune_csv.prepare import prepare_data
from model.config import Window
from model.errors import DataError
from model.kronos import Kronos
from tests.test_csv_eval import make_run
from tests.test_csv_eval_candidates import record_tokenizer


@pytest.mark.slow
def test_track_scores_exactly_the_arrived_steps_and_a_rerun_changes_nothing(tmp_path, monkeypatch, capsys, caplog):
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
    served = {**json.loads(lines[1]), "id": "served-A", "series": "A"}  # a served id data.path does not hold
    folder = cfg.base_dir / "journal"
    with open(folder / "forecasts.jsonl", "a") as f:  # answer to other sampling): scored, not fed
        f.write(json.dumps(raw) + "\n" + json.dumps(served) + "\n")
    first = journal.track(cfg)
    assert first["scored_steps"] == 0  # no bar after the origins yet
    assert first["unscored"] == {"A": {"forecasts": 1, "reason": journal.NOT_IN_DATA}}
    journal_text = (folder / "forecasts.jsonl").read_text()  # a series of data.path whose origin bar is gone: refused
    gone = {**raw, "id": "gone", "origin": (pd.Timestamp(raw["origin"]) + pd.Timedelta("1min")).isoformat()}
    (folder / "forecasts.jsonl").write_text(journal_text + json.dumps(gone) + "\n")
    with pytest.raises(DataError, match="origin bar is no longer in data.path"):
        journal.track(cfg)
    (folder / "forecasts.jsonl").write_text(journal_text)
    for path in sorted((tmp_path / "data").glob("*.csv")):  # three new bars per series
        frame = pd.read_csv(path, parse_dates=["timestamps"])
        new = frame.tail(3).copy()
        new["timestamps"] = frame["timestamps"].iloc[-1] + pd.Timedelta("5min") * pd.RangeIndex(1, 4)
        pd.concat([frame, new]).to_csv(path, index=False)
    info = lambda: (best / "kronos_predictor.json").read_text()  # noqa: E731
    before = info()
    with monkeypatch.context() as m:  # the current model is fingerprinted from its file, never built
        m.setattr(Kronos, "from_pretrained", lambda *a, **k: pytest.fail("track built the model"))
        report = journal.track(cfg)
    assert report["scored_steps"] == 5 * 3 and len(report["fed"]) == 12  # 4 calibrated forecasts x 3 steps fed
    (model,) = report["models"].values()
    assert model["steps"] == 15 and 0 <= model["cov80"] <= 1 and model["crps"] > 0
    hits = [c * (k + 1) for k, (_, c) in enumerate(model["cov80_over_time"])]  # the 80% hits so far: exact counts
    assert hits == [round(h) for h in hits] and {b - a for a, b in zip([0, *hits], hits)} <= {0, 1}
    assert hits[-1] / 15 == model["cov80"]
    assert info() != before  # the adaptive state moved on
    after, track_json = info(), (folder / "track.json").read_text()
    assert journal.main(["--config", str(config)]) == 0 and info() == after  # a rerun changes nothing
    assert "1 journaled forecast not scored, no such series in data.path" in capsys.readouterr().out
    assert (folder / "track.json").read_text() == track_json
    assert "Live forecasts" in (page := (folder / "track.html").read_text()) and "A (1)" in page
    # `kronos forecast` again rebuilds the state from the split margins and the held-out replay: the next track
    # feeds every live outcome again, to the state one track after that forecast would reach, bit for bit
    forecast.run_forecast(cfg)
    rebuilt = {p: p.read_bytes() for p in (best / "kronos_predictor.json", best / "SHA256SUMS")}
    (folder / "track.json").unlink()
    journal.track(cfg)
    single = info()
    for p, data in rebuilt.items():
        p.write_bytes(data)
    (folder / "track.json").write_text(track_json)
    with caplog.at_level(logging.WARNING, "finetune_csv.journal"):
        assert journal.track(cfg)["fed"] == report["fed"]
    assert info() == single != after
    assert "the adaptive state was rebuilt since the last track (kronos forecast?): 12 live outcomes fed again" in \
        caplog.text
