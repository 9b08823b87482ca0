"""One interval rule for `kronos forecast`: HAC-t over trading sessions, no interval below MIN_BLOCKS blocks."""

import numpy as np
import pandas as pd
import pytest

from finetune.evaluation.statistics import session_test


def null_differences(rng, n: int, phi: float) -> np.ndarray:
    """(n,) mean-0 paired differences: Student-t(3) noise, AR(1) with coefficient phi."""
    e = rng.standard_t(3, size=n + 50)
    x = np.zeros_like(e)
    for i in range(1, len(e)):
        x[i] = phi * x[i - 1] + e[i]
    return x[50:]


@pytest.mark.parametrize("phi", [0.0, 0.3])
def test_null_intervals_exclude_zero_at_most_7_percent_at_any_sample_size(phi):
    rng = np.random.default_rng(7)
    for n in (9, 13, 36, 72):
        dates = pd.bdate_range("2024-01-01", periods=n)
        runs = [session_test(null_differences(rng, n, phi), dates) for _ in range(400)]
        claimed = np.mean([r["verdict"] != "no_evidence" for r in runs])
        assert claimed <= 0.07, (n, phi, claimed)
        if n < 20:  # too few independent blocks: no interval, and the reason says so
            assert all("no 95% interval" in r["reason"] and "[" not in r["reason"] for r in runs)


def test_intraday_windows_are_blocked_by_trading_session_not_by_window_time():
    # 36 windows of 5-minute bars, 6 per session over 6 sessions: 6 dates, far too few blocks for an interval.
    days = pd.bdate_range("2024-03-04", periods=6)
    times = np.concatenate([d + pd.Timedelta("09:30:00") + pd.to_timedelta(np.arange(6) * 30, "min") for d in days])
    out = session_test(np.full(36, -1.0) + np.random.default_rng(0).normal(0, 0.1, 36), times)
    assert out["dates"] == 6 and out["verdict"] == "no_evidence" and "no 95% interval" in out["reason"]
    daily = session_test(np.full(36, -1.0) + np.random.default_rng(0).normal(0, 0.1, 36),
                         pd.bdate_range("2024-03-04", periods=36))
    assert daily["dates"] == 36 and daily["verdict"] == "helps"


def test_a_date_split_that_leaves_a_series_without_test_windows_names_it(caplog):
    from finetune.utils.store import SeriesPanel
    from finetune_csv.config import DataConfig
    from finetune_csv.splits import split_data

    # s1 ends before data.val_end: it trains and validates, but has no test window (hourly bars)
    when = [pd.date_range(end=end, periods=n, freq="1h").as_unit("ns").asi8
            for n, end in ((300, "2024-03-01 00:00"), (200, "2024-02-25 00:00"))]
    p = SeriesPanel.from_series([np.ones((len(w), 6), np.float32) for w in when],
                                [np.zeros((len(w), 5), np.int64) for w in when], ["s0", "s1"], when)
    cfg = DataConfig(split="by_date", train_end="2024-02-20 00:00", val_end="2024-02-26 00:00", lookback=16,
                     predict=4)
    with caplog.at_level("WARNING"):
        splits, _ = split_data(p, cfg)
    assert "s1 has no test window" in caplog.text and "train window" not in caplog.text
    assert splits["train"].stop[1] - splits["train"].start[1] > 20  # still trained on
