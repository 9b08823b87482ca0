"""The Python API `finetune_csv.finetune`: DataFrames or paths in, the CLI's checks and engine, paths and metrics
out."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest

from finetune_csv import train_sequential
from finetune_csv.api import FinetuneResult, finetune
from model import Kronos, KronosTokenizer

TINY = {
    "model.pretrained_tokenizer": None, "model.pretrained_predictor": None,
    "model.tokenizer_arch": {"d_model": 16, "n_heads": 2, "ff_dim": 32, "n_enc_layers": 2, "n_dec_layers": 2,
                             "s1_bits": 4, "s2_bits": 4, "group_size": 4},
    "model.predictor_arch": {"n_layers": 1, "d_model": 16, "n_heads": 2, "ff_dim": 32},
    "training.num_workers": 0, "training.progress_bar": False, "training.log_every_steps": 2,
    "tokenizer_training.lr": 1e-3, "predictor_training.lr": 1e-3,
}


def frame(n: int = 160, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    close = 100 + np.cumsum(rng.normal(0, 0.5, n))
    return pd.DataFrame({"open": close + rng.normal(0, 0.1, n), "high": close + 1, "low": close - 1, "close": close,
                         "volume": rng.uniform(100, 200, n)},
                        index=pd.date_range("2024-01-02 09:30", periods=n, freq="5min"))


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


def test_finetune_a_dataframe_returns_model_folders_and_metrics(tmp_path, caplog):
    capitalised = frame(seed=1).rename(columns=str.capitalize).rename_axis("Date")  # as predict_df accepts it
    with caplog.at_level(logging.INFO):
        result = finetune({"AAA": frame(seed=0), "BBB": capitalised}, overrides=TINY, output_dir=tmp_path / "run",
                          lookback=16, predict=4, stride=8, epochs=2, batch_size=16, train_ratio=0.8, val_ratio=0.2)
    assert isinstance(result, FinetuneResult)
    assert result.output_dir == tmp_path / "run"
    assert result.predictor_dir == tmp_path / "run" / "basemodel" / "best_model"
    assert result.tokenizer_dir == tmp_path / "run" / "tokenizer" / "best_model"
    assert set(result.metrics) == {"tokenizer", "predictor"} and result.skipped == {}
    for stage, folder in (("tokenizer", "tokenizer"), ("predictor", "basemodel")):
        m = result.metrics[stage]
        assert m["epochs"] == 2 and np.isfinite(m["best_val_loss"]) and m["best_epoch"] in (0, 1, 2)
        logged = [json.loads(line) for line in (tmp_path / "run" / folder / "metrics.jsonl").read_text().splitlines()]
        assert min(r["val_loss"] for r in logged if "val_loss" in r) == pytest.approx(m["best_val_loss"])
    # the models load; the data went through the store with its checks (DatetimeIndex -> timestamps)
    KronosTokenizer.from_pretrained(result.tokenizer_dir)
    Kronos.from_pretrained(result.predictor_dir)
    assert [s["name"] for s in result.data["series"]] == ["AAA", "BBB"]
    assert result.data["series"][0]["start"] == "2024-01-02 09:30:00"
    assert not (tmp_path / "run" / "input").exists()  # the frames went to the store as they are, no Parquet copies
    assert "2 series from 2 file(s)" in caplog.text and "split by date" in caplog.text  # progress, like the CLI
    assert result.config.training.epochs == 2 and result.config.data.lookback == 16


def test_finetune_runs_the_same_function_as_the_cli(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("finetune_csv.api.run_finetune", lambda cfg, **kw: calls.append(cfg) or ([], {}, {}))
    csv = tmp_path / "a.csv"
    frame().rename_axis("timestamps").reset_index().to_csv(csv, index=False)
    finetune(csv, overrides=TINY, output_dir=tmp_path / "out", lookback=16)
    assert calls[0].data.path == str(csv) and calls[0].base_dir == tmp_path / "out"
    assert train_sequential.run_finetune.__module__ == "finetune_csv.train_sequential"  # main() calls it too


def test_user_mistakes_raise_value_errors_and_leave_nothing(tmp_path):
    with pytest.raises(ValueError, match="data.lookback"):
        finetune(frame(), overrides=TINY, output_dir=tmp_path / "a", lookback=0)
    with pytest.raises(ValueError, match=r"epoch=...\): no config section has it"):
        finetune(frame(), overrides=TINY, output_dir=tmp_path / "b", epoch=1)
    bad = frame()
    bad.iloc[5, 3] = np.nan
    with pytest.raises(ValueError, match=r"frame 'series': missing values in column close at row\(s\) 6"):
        finetune(bad, overrides=TINY, output_dir=tmp_path / "c", lookback=16, predict=4)
    text = frame().rename(columns=str.capitalize).astype({"Close": object})
    text.iloc[7, 3] = "n/a?"
    with pytest.raises(ValueError, match=r"frame 'AAPL': column 'Close' \(data.columns.close\) has 1 non-numeric "
                                         r"value\(s\) at row\(s\) 8"):
        finetune({"AAPL": text}, overrides=TINY, output_dir=tmp_path / "d", lookback=16, predict=4)
    with pytest.raises(ValueError, match=r"frame 'AAPL': no 'close' column, in any case \(did you mean 'Clsoe'\?\)"):
        finetune({"AAPL": frame().rename(columns={"close": "Clsoe"})}, overrides=TINY, output_dir=tmp_path / "e")
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c", "d", "e"))
