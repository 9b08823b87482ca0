"""The forecast journal end to end on real daily candles (scripts/real_market_data.py: S&P 500 and NASDAQ from the
`arch` package): `kronos forecast --future`, new bars appended, the model replaced, `--future` again, more bars;
`kronos track` scores exactly the steps whose bars arrived, each under the model that made it, and a rerun on the
same data changes no file."""

import json
import runpy
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from finetune.evaluation.held_out import held_out_windows
from finetune_csv import forecast, journal
from finetune_csv.config import load
from finetune_csv.pipeline import calibrate
from finetune_csv.prepare import prepare_data
from model.config import Window
from model.fileio import seal
from tests.model_factory import tiny_predictor
from tests.test_csv_eval import make_run
from tests.test_csv_eval_candidates import record_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_track_on_real_candles_scores_what_arrived_under_the_model_that_made_it(tmp_path):
    pytest.importorskip("arch", reason="the real candles ship in the arch package (pip install arch)")
    config = make_run(tmp_path, zero_shot=None, extra=", calibration_method: adaptive")
    for f in (tmp_path / "data").glob("*.csv"):
        f.unlink()
    real = tmp_path / "real"
    assert runpy.run_path(str(ROOT / "scripts/real_market_data.py"))["main"]([str(real), "--only", "sp500",
                                                                              "nasdaq"]) == 0
    full = {n: pd.read_csv(real / f"{n}.csv").iloc[-320:] for n in ("sp500", "nasdaq")}  # 2017-10 .. 2018-12
    write = lambda k: [f.iloc[: 300 + k].to_csv(tmp_path / "data" / f"{n}.csv", index=False)  # noqa: E731
                       for n, f in full.items()]
    write(0)
    cfg = load(config)
    best = record_tokenizer(cfg, tmp_path / "start/tokenizer")
    val = held_out_windows(prepare_data(cfg.data, cfg.store_dir).splits["val"], Window(24, 6), None)
    calibrate(best, val, cfg.forecast, Window(24, 6, cfg.data.clip))
    assert forecast.main(["--config", str(config), "--future"]) == 0  # model A at bar 300
    write(3)
    tiny_predictor(seed=7).save_pretrained(best)  # the model is replaced (its calibration kept)
    seal(best)
    assert forecast.main(["--config", str(config), "--future"]) == 0  # model B at bar 303
    write(5)
    assert journal.main(["--config", str(config)]) == 0
    folder = cfg.base_dir / "journal"
    records = [json.loads(x) for x in (folder / "forecasts.jsonl").read_text().splitlines()]
    a, b = records[0]["model"]["predictor_sha256"], records[-1]["model"]["predictor_sha256"]
    assert len(records) == 4 and a != b
    report = json.loads((folder / "track.json").read_text())
    assert report["scored_steps"] == 2 * 5 + 2 * 2  # A: 5 bars arrived after its origin; B: 2
    assert report["models"][a]["steps"] == 10 and report["models"][b]["steps"] == 4
    assert len(report["fed"]) == 4  # only the current model's outcomes move its adaptive state
    for sha in (a, b):  # each model's live 80% coverage from its own records' quantiles and the real closes
        hits = []
        for rec in (r for r in records if r["model"]["predictor_sha256"] == sha):
            frame = full[Path(rec["series"]).stem].iloc[:305]  # the series' bars as track read them
            close, at = frame["close"].to_numpy(), list(pd.to_datetime(frame["timestamps"])).index(
                pd.Timestamp(rec["origin"]))
            q = np.asarray(rec["quantiles"])
            lo, hi = (q[rec["levels"].index(x)] for x in (0.1, 0.9))
            y = close[at + 1 : at + 1 + len(q[0])]
            hits += list((lo[: len(y)] <= y) & (y <= hi[: len(y)]))
        assert report["models"][sha]["cov80"] == pytest.approx(np.mean(hits))
    files = {p: p.read_bytes() for p in [*folder.glob("track.*"), best / "kronos_predictor.json"]}
    assert journal.main(["--config", str(config)]) == 0  # a rerun on the same data changes nothing
    assert {p: p.read_bytes() for p in files} == files
