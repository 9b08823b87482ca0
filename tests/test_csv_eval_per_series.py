"""Issue 38: the held-out finetuned-vs-zero-shot difference is reported per series, so a panel's headline cannot
hide that one group carries it; a group priced 1e-5 of the others gets the numbers it gets in ordinary units."""
from __future__ import annotations

import pytest

from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune_csv import forecast
from finetune_csv.config import load
from tests.test_csv_eval import make_run

PRICES = ["open", "high", "low", "close", "amount"]


def panel_run(root, factor: float) -> dict:
    """Six series (SH600000..5), the first four with prices x factor; the held-out forecast's metrics."""
    config = make_run(root)
    frames = generate_ohlcv(n_series=6, n_bars=150, freq="5min", seed=3)
    for name in list(frames)[:4]:
        frames[name][PRICES] *= factor
    write_csv_folder(frames, root / "data")
    return forecast.run_forecast(load(config))


@pytest.mark.slow
def test_the_per_series_difference_does_not_move_with_the_unit_of_four_series(tmp_path):
    ordinary = panel_run(tmp_path / "a", 1.0)
    tiny = panel_run(tmp_path / "b", 1e-5)
    per, per_tiny = ordinary["finetuned_vs_zero_shot"]["per_series"], tiny["finetuned_vs_zero_shot"]["per_series"]
    assert sorted(per) == sorted(per_tiny) == [f"SH60000{i}.csv" for i in range(6)]
    noise = 0.01 * ordinary["zero_shot"]["model"]["overall"]["crps"]  # 1% of the CRPS itself
    for name, row in per.items():
        assert row["windows"] == per_tiny[name]["windows"] == 5
        # Series in ordinary units: equal. The x1e-5 ones: within sampling noise, measured 0.5e-7 to 4.4e-6 (their std
        # eps is relative below a price of 1, absolute above: a token may flip); the absolute eps: 1e-4 to 1e-3 off.
        assert per_tiny[name]["mean"] == pytest.approx(row["mean"], abs=noise if name < "SH600004" else 1e-12), name
    total = ordinary["finetuned_vs_zero_shot"]
    assert sum(r["mean"] * r["windows"] for r in per.values()) / 30 == pytest.approx(total["crps"])
    line = next(x for x in forecast.format_report(tiny).splitlines() if "by series" in x)
    best = min(per_tiny, key=lambda n: per_tiny[n]["mean"])
    assert f"most gained {best} {per_tiny[best]['mean']:+.4f} (5 windows" in line
    assert f"better on {sum(r['mean'] < 0 for r in per_tiny.values())} of 6" in line
