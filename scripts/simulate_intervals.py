"""The interval rule's tables of docs/evaluation.md (issue 51): null false-positive rate per design and span, power
at a true 0.5 SD gain against the oracle (the true s.d. of the mean, 1.96), the printed minimum detectable effect
against the simulated one. `python scripts/simulate_intervals.py [runs]` (2,000 for the doc, about 15 s on 1 core);
`python scripts/simulate_intervals.py table 30000` rebuilds statistics.AR1_CV (about 30 s)."""

from __future__ import annotations

import sys

import numpy as np
from scipy.optimize import brentq

from finetune.evaluation.statistics import AR1_RHOS, AR1_SPANS, ar1_interval, mean_interval

SPANS = (24, 32, 50, 100, 200, 500)
NULLS = ("iid", "t3", "garch", "uneven", "factor", "ar-0.5", "ar0.3", "ar0.6", "ar0.9", "ar0.97", "shift", "ov5_0",
         "ov5_0.6", "ov5_-0.5", "ov20_0", "garch_ov5")


def ar(rng, runs: int, n: int, rho: float) -> np.ndarray:
    """(runs, n) stationary AR(1), unit variance."""
    e = rng.standard_normal((runs, n)) * np.sqrt(1 - rho**2)
    x = np.empty((runs, n))
    x[:, 0] = rng.standard_normal(runs)
    for t in range(1, n):
        x[:, t] = rho * x[:, t - 1] + e[:, t]
    return x


def design(name: str, rng, runs: int, n: int) -> tuple[np.ndarray, int]:
    """(runs, n) null series of a design and its known overlap q (h - 1)."""
    if name == "iid":
        return rng.standard_normal((runs, n)), 0
    if name == "t3":
        return rng.standard_t(3, (runs, n)), 0
    if name.startswith("garch"):  # GARCH(1,1) 0.08 / 0.90 (persistence 0.98), alone or summed over 5 steps
        z, h, x = rng.standard_normal((runs, n + 204)), np.ones(runs), np.empty((runs, n + 204))
        for t in range(n + 204):
            x[:, t] = np.sqrt(h) * z[:, t]
            h = 0.02 + 0.08 * x[:, t] ** 2 + 0.90 * h
        return (x[:, 200:-4], 0) if name == "garch" else (sum(x[:, 200 + j:200 + j + n] for j in range(5)), 4)
    if name == "uneven":  # session means of 1-20 windows
        return rng.standard_normal((runs, n)) / np.sqrt(rng.integers(1, 21, (runs, n))), 0
    if name == "factor":  # a session factor shared by 1-39 windows, window-weighted
        w = rng.integers(1, 40, (runs, n))
        return (0.3 * rng.standard_normal((runs, n)) + rng.standard_normal((runs, n)) / np.sqrt(w)) * w / w.mean(), 0
    if name == "shift":  # +0.5 SD then -0.5 SD: a level shift at mid-span, mean 0
        return rng.standard_normal((runs, n)) + np.where(np.arange(n) < n // 2, 0.5, -0.5), 0
    if name.startswith("ov"):  # h-step sums over AR(rho) innovations (overlapping targets)
        h, rho = name[2:].split("_")
        c = np.cumsum(np.pad(ar(rng, runs, n + int(h) - 1, float(rho)), ((0, 0), (1, 0))), axis=1)
        return c[:, int(h):] - c[:, :-int(h)], int(h) - 1
    return ar(rng, runs, n, float(name[2:])), 0


def fires(x: np.ndarray, q: int, shift: float = 0.0) -> tuple[float, float, float]:
    """Shares of runs whose 95% interval lies above 0, below 0, and that have an interval."""
    r = mean_interval(x + shift, q)
    ok = r["has_interval"]
    return (ok & (r["mean"] - r["half"] > 0)).mean(), (ok & (r["mean"] + r["half"] < 0)).mean(), ok.mean()


def table(runs: int = 30000) -> None:
    """Prints AR1_CV: the 95% quantile of |mean| / se of the AR(1) branch under a true AR(1) (seed 7), made
    non-decreasing in rho and rounded up to 0.01 (conservative where the Monte Carlo wobbles)."""
    rng, rows = np.random.default_rng(7), []
    for n in AR1_SPANS:
        q = []
        for rho in AR1_RHOS:
            x = ar(rng, runs, n, rho)
            q.append(np.quantile(np.abs(x.mean(axis=1) / ar1_interval(x - x.mean(axis=1, keepdims=True))[1]), 0.95))
        rows.append(np.ceil(np.maximum.accumulate(q) * 100) / 100)
    print("AR1_CV = (" + ",\n          ".join("(" + ", ".join(f"{v:.2f}" for v in r) + ")" for r in rows) + ")")


def main(runs: int = 2000) -> None:
    print("size, two-sided per cent (above / below 0); '-' no interval at this span")
    print("| design | " + " | ".join(map(str, SPANS)) + " |\n|---|" + "---|" * len(SPANS))
    for name in NULLS:
        cells = []
        for n in SPANS:
            up, down, ok = fires(*design(name, np.random.default_rng([51, n, NULLS.index(name)]), runs, n))
            cells.append("-" if ok == 0 else f"{100 * (up + down):.1f} ({100 * up:.1f}/{100 * down:.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\npower at a true 0.5 SD gain: rule, oracle, share; MDE printed (median) / simulated")
    for name, n in (("iid", 24), ("iid", 50), ("ar0.6", 50), ("ar0.6", 100), ("ar0.6", 200), ("ov5_0.6", 200),
                    ("ov5_0.6", 500), ("garch", 100)):
        x, q = design(name, np.random.default_rng([52, n]), runs, n)
        sd, sd_mean = x.std(), x.mean(axis=1).std()  # the oracle knows the s.d. of the mean
        rule = fires(x, q, 0.5 * sd)[0]
        oracle = float(((x.mean(axis=1) + 0.5 * sd) / sd_mean > 1.96).mean())
        printed = float(np.median(mean_interval(x, q)["mde"]))
        top = 40 * sd_mean
        sim = brentq(lambda e, x=x, q=q: fires(x, q, e)[0] - 0.8, 0, top, xtol=1e-3 * sd_mean) \
            if fires(x, q, top)[0] > 0.8 else float("nan")
        print(f"{name} {n} dates: rule {rule:.3f} oracle {oracle:.3f} share {rule / oracle:.2f}; "
              f"MDE printed {printed:.3f} simulated {sim:.3f} ratio {printed / sim:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["table"]:
        table(int(sys.argv[2]) if len(sys.argv) > 2 else 30000)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
