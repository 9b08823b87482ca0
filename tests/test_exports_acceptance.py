"""Issue 33 acceptance: a Date + Time export and a Yahoo export with Adj Close go through `kronos finetune` and
`kronos forecast` with one setting each (the Yahoo one: data.adjust: adj_close), on tiny models."""

import pandas as pd
import pytest

from finetune.cli import main
from finetune.synthetic import generate_ohlcv
from tests.test_csv_train import TINY_YAML


def _date_time(folder):
    for name, frame in generate_ohlcv(n_series=2, n_bars=240, freq="5min", seed=0).items():
        ts = pd.DatetimeIndex(frame.pop("timestamps"))
        frame.insert(0, "Time", ts.strftime("%H:%M"))
        frame.insert(0, "Date", ts.strftime("%m/%d/%Y"))
        frame.rename(columns=str.title).to_csv(folder / f"{name}.csv", index=False)
    return ""


def _yahoo(folder):
    for name, frame in generate_ohlcv(n_series=2, n_bars=240, freq="1D", seed=1).items():
        frame = frame.drop(columns="amount").rename(columns=str.title).rename(columns={"Timestamps": "Date"})
        frame.insert(5, "Adj Close", frame["Close"] * 0.8)  # dividends: only the close is adjusted
        frame.to_csv(folder / f"{name}.csv", index=False)
    return "  adjust: adj_close\n"


@pytest.mark.slow
@pytest.mark.parametrize("export", [_date_time, _yahoo])
def test_real_exports_finetune_and_forecast_with_one_setting(tmp_path, export, one_thread):
    (tmp_path / "data").mkdir()
    setting = export(tmp_path / "data")
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_YAML.format(data=tmp_path / "data", out=tmp_path / "out").replace(
        "  lookback: 16\n", "  lookback: 16\n" + setting))
    assert main(["finetune", "--config", str(config)]) == 0
    assert main(["forecast", "--config", str(config), "--future"]) == 0
    assert list((tmp_path / "out").rglob("forecast.csv"))
    header = (tmp_path / "out" / "tiny" / "basemodel" / "train.log").read_text().splitlines()[0]
    assert "command: 'kronos finetune' --config" in header and "intra-op thread(s)" in header  # the threads, once
