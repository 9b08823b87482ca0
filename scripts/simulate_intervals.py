"""The interval rule's tables of docs/evaluation.md (issue 51): null false-positive rate per design and span, power
at a true 0.5 SD gain against the oracle (the true s.d. of the mean, 1.96), the printed minimum detectable effect
against the simulated one. `python scripts/simulate_intervals.py [runs]` (2,000 for the doc, about 15 s on 1 core);
`python scripts/simulate_intervals.py table` rebuilds statistics' AR1_TABLE (about 5 minutes); `... ceiling` prints the
most power any rule on (a, |t|) can have at AR(1) 0.6 with the size kept."""

from __future__ import annotations

import sys

import numpy as np
from scipy import sparse
from scipy.optimize import brentq, linprog

from finetune.evaluation.statistics import AR1_A, AR1_SPANS, AR1_TABLE, ar1_interval, mean_interval

SPANS = (24, 32, 50, 100, 200, 500)
NULLS = ("iid", "t3", "garch", "uneven", "factor", "ar-0.5", "ar0.3", "ar0.6", "ar0.9", "ar0.97", "ar0.99", "shift",
         "ov5_0", "ov5_0.6", "ov5_-0.5", "ov20_0", "garch_ov5")


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


NULL_RHOS = (*np.round(np.arange(-0.9, 0.91, 0.05), 2), 0.92, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99)
ALT_RHOS = (-0.9, -0.8, -0.5, 0.0, 0.3, 0.6, 0.8, 0.9, 0.95)  # the alternatives whose average power the table maximises
T_EDGES = np.r_[0, np.arange(1.5, 4, 0.05), np.arange(4, 12.1, 0.25)]  # |t| cells


def critical_values(n: int, runs: int, alpha: float = 0.045, alt_rhos=ALT_RHOS, null_rhos=NULL_RHOS,
                    gain: float | None = None) -> np.ndarray:
    """One row of statistics' AR(1) table: the critical value of |mean| / se per a in AR1_A at span n (seed 7).
    A linear programme over cells (a, |t|) chooses the rejection region with the largest average power over
    ALT_RHOS (each at the effect the oracle detects half the time) subject to size <= `alpha` under every AR(1) of
    NULL_RHOS (4.5%: the programme favours cells where its own runs happen to be sparse; fresh runs read up to 5%),
    rejecting more as |t| grows and less as |a| grows; cv(a) is where the region starts, raised one cell at
    a time where rounding the programme's fractional cells overshoots `alpha`; inf where it never rejects (a
    persistence this span cannot tell from AR(1) 0.99). `gain`: the alternatives' mean in marginal s.d. instead.
    Returns `(len(AR1_A),)`."""
    rng, na, nt = np.random.default_rng([7, n]), len(AR1_A), len(T_EDGES)
    a_edges = np.r_[-np.inf, (AR1_A[:-1] + AR1_A[1:]) / 2, np.inf]

    def cells(x: np.ndarray, signed: bool) -> np.ndarray:  # (na, nt) the share of runs per cell
        a, se = ar1_interval(x - x.mean(axis=1, keepdims=True))[:2]
        t = np.maximum(x.mean(axis=1) / se, 0) if signed else np.abs(x.mean(axis=1) / se)
        h = np.zeros((na, nt))
        np.add.at(h, (np.digitize(a, a_edges) - 1, np.digitize(t, T_EDGES) - 1), 1)
        return h / len(x)

    nulls = np.array([cells(ar(rng, runs, n, r), False) for r in null_rhos])  # (rhos, na, nt)
    shift = lambda x: gain * x.std() if gain else 1.96 * x.mean(axis=1).std()  # noqa: E731
    alts = np.mean([cells(x + shift(x), True) for x in (ar(rng, runs, n, r) for r in alt_rhos)], axis=0)
    idx = np.arange(na * nt).reshape(na, nt)
    zero = int(np.searchsorted(AR1_A, 0.0))
    pairs = [(idx[:, :-1], idx[:, 1:]), (idx[zero + 1:], idx[zero:-1]), (idx[:zero], idx[1:zero + 1])]  # phi lo <= hi
    lo, hi = (np.concatenate([p[k].ravel() for p in pairs]) for k in (0, 1))
    k = np.arange(len(lo))
    order = sparse.csr_matrix((np.r_[np.ones(len(k)), -np.ones(len(k))], (np.r_[k, k], np.r_[lo, hi])),
                              shape=(len(k), na * nt))
    res = linprog(-alts.ravel(), A_ub=sparse.vstack([sparse.csr_matrix(nulls.reshape(len(nulls), -1)), order]),
                  b_ub=np.r_[np.full(len(nulls), alpha), np.zeros(len(k))], bounds=(0, 1), method="highs")
    first = np.r_[(res.x.reshape(na, nt) >= 0.5).argmax(axis=1)]  # (na,) the first rejecting |t| cell
    first[~(res.x.reshape(na, nt) >= 0.5).any(axis=1)] = nt
    tail = np.pad(nulls[:, :, ::-1].cumsum(axis=2)[:, :, ::-1], ((0, 0), (0, 0), (0, 1)))  # P(a cell, |t| >= edge)
    while True:
        first[zero:] = np.maximum.accumulate(first[zero:])  # the shape the programme imposed, kept after rounding
        first[:zero + 1] = np.maximum.accumulate(first[:zero + 1][::-1])[::-1]
        size = tail[:, np.arange(na), first]  # (rhos, na)
        worst = size.sum(axis=1).argmax()
        if size[worst].sum() <= alpha:
            break
        first[size[worst].argmax()] += 1
    power = np.pad(alts[:, ::-1].cumsum(axis=1)[:, ::-1], ((0, 0), (0, 1)))[np.arange(na), first].sum()
    print(f"{n} dates: average power {power:.3f} (programme {-res.fun:.3f}), size <= {size.sum(axis=1).max():.3f}",
          file=sys.stderr)
    return np.r_[T_EDGES, np.inf][first]


def table(runs: int = 30000) -> None:
    """Rewrites statistics' AR(1) table, finetune/evaluation/ar1_critical_values.csv (span rows, a columns)."""
    rows = [critical_values(n, runs if n <= 500 else runs // 2) for n in AR1_SPANS]
    text = "span," + ",".join(f"{a:.2f}" for a in AR1_A) + "\n"
    text += "".join(f"{n}," + ",".join(f"{v:.2f}" for v in r) + "\n" for n, r in zip(AR1_SPANS, rows))
    AR1_TABLE.write_text(text, encoding="utf-8")


def main(runs: int = 2000) -> None:
    print("size, two-sided per cent (above / below 0); '-' no interval at this span, [i%] runs with one where < 99.5%")
    print("| design | " + " | ".join(map(str, SPANS)) + " |\n|---|" + "---|" * len(SPANS))
    for name in NULLS:
        cells = []
        for n in SPANS:
            up, down, ok = fires(*design(name, np.random.default_rng([51, n, NULLS.index(name)]), runs, n))
            cells.append("-" if ok == 0 else f"{100 * (up + down):.1f} ({100 * up:.1f}/{100 * down:.1f})"
                         + (f" [i {100 * ok:.0f}%]" if ok < 0.995 else ""))
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


def ceiling(runs: int = 40000) -> None:
    """The most power at a true 0.5 SD gain under AR(1) 0.6 that any rule on (a, |t|) can have with size <= 5% for
    every AR(1) from -0.9 to 0.97 (the programme aimed at that one alternative, read on its own runs: optimistic)."""
    for n in (50, 100):
        x = ar(np.random.default_rng([53, n]), runs, n, 0.6)
        oracle = float(((x.mean(axis=1) + 0.5 * x.std()) / x.mean(axis=1).std() > 1.96).mean())
        print(f"{n} dates, oracle {oracle:.3f}; the best rule:", file=sys.stderr)
        critical_values(n, runs, 0.05, (0.6,), tuple(r for r in NULL_RHOS if r <= 0.97), gain=0.5)


if __name__ == "__main__":
    if sys.argv[1:2] == ["ceiling"]:
        ceiling()
    elif sys.argv[1:2] == ["table"]:
        table(int(sys.argv[2]) if len(sys.argv) > 2 else 30000)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
