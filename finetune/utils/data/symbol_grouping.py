"""Split one file with a symbol column into its series without holding the file in memory.

Rows of different symbols may be interleaved anywhere in the file. The parsed rows are spilled to scratch files
(64 bytes a row), counted per symbol, then scattered into per-symbol order with a stable counting sort read in
blocks (memory O(block + symbols)); each symbol's rows are then one contiguous slice, read back one series at a
time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .streaming_reader import FEATURES, SourceProblems, SourceReader

__all__ = ["grouped_series"]


def grouped_series(reader: SourceReader, scratch: Path, block_rows: int) -> Iterator[tuple]:
    """Yield (name, timestamps (n,) int64, values (n, 6) float64, lines (n,) int64) per symbol of one file, sorted
    by symbol name (the CSV pipeline's order), rows of a symbol in file order. Scratch files go to `scratch` and
    are removed at the end."""
    spill = {k: scratch / f".spill.{k}" for k in ("ts", "values", "lines", "codes")}
    counts = np.zeros(0, dtype=np.int64)
    try:
        with open(spill["ts"], "wb") as f_ts, open(spill["values"], "wb") as f_v, \
                open(spill["lines"], "wb") as f_l, open(spill["codes"], "wb") as f_c:
            for b in reader.blocks():
                b.timestamps.tofile(f_ts)
                b.values.tofile(f_v)
                b.lines.tofile(f_l)
                b.symbols.tofile(f_c)
                counts = np.pad(counts, (0, len(reader.symbols) - len(counts)))
                counts += np.bincount(b.symbols, minlength=len(reader.symbols))
        if reader.problems:
            raise SourceProblems(reader.problems)
        n = int(counts.sum())
        order = sorted(range(len(reader.symbols)), key=lambda c: reader.symbols[c])  # by symbol name
        start = np.zeros(len(counts), dtype=np.int64)
        start[order] = np.concatenate([[0], np.cumsum(counts[order])[:-1]])
        src = {"ts": np.memmap(spill["ts"], np.int64, "r", shape=(n,)),
               "values": np.memmap(spill["values"], np.float64, "r", shape=(n, len(FEATURES))),
               "lines": np.memmap(spill["lines"], np.int64, "r", shape=(n,))}
        codes = np.memmap(spill["codes"], np.int32, "r", shape=(n,))
        dst = {k: np.memmap(scratch / f".grouped.{k}", a.dtype, "w+", shape=a.shape) for k, a in src.items()}
        cursor = start.copy()
        for a in range(0, n, block_rows):
            c = np.asarray(codes[a : a + block_rows])
            perm = np.argsort(c, kind="stable")
            sc = c[perm]
            rank = np.arange(len(sc)) - np.searchsorted(sc, sc, side="left")  # position within its symbol
            where = cursor[sc] + rank
            for k in src:
                dst[k][where] = np.asarray(src[k][a : a + block_rows])[perm]
            cursor += np.bincount(c, minlength=len(cursor))
        del src, codes
        for c in order:
            rows = slice(int(start[c]), int(start[c] + counts[c]))
            yield (f"{reader.path.name}[{reader.symbols[c]}]", np.array(dst["ts"][rows]),
                   np.array(dst["values"][rows]), np.array(dst["lines"][rows]))
        del dst
    finally:
        for p in list(spill.values()) + [scratch / f".grouped.{k}" for k in ("ts", "values", "lines")]:
            p.unlink(missing_ok=True)
