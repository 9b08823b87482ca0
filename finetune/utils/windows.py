"""The one sliding-window dataset both pipelines train on, over index ranges of a `SeriesPanel` (no copies); an
epoch's window order is a pure function of (seed, epoch). Splits as column ranges and an example:
docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import math
import random
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from finetune.utils.store import N_STAMP_COLUMNS, SeriesPanel
from model.config import Window
from model.errors import DataError
from model.features import normalize


@dataclass(frozen=True)
class PanelSegments:
    """The rows of each series one split may read, as panel column ranges (arrays of shape (S,), int64)."""

    panel: SeriesPanel  # The whole panel (possibly memory-mapped); never copied.
    start: np.ndarray  # First column a window of this split may read, per series.
    # First column that belongs to the split itself (columns before it are context), per series.
    first_target: np.ndarray
    stop: np.ndarray  # One past the split's last column, per series.

    def dataset(self, window: Window, *, stride: int = 1) -> WindowDataset:
        """The split's windows: the shared WindowDataset reading the panel (memory map) inside these ranges."""
        return WindowDataset(self.panel, window, stride=stride, ranges=(self.start, self.stop))


EXACT_LIMIT = 1 << 24  # windows up to which the original full permutation is used
BLOCK_SIZE = 1 << 16  # windows per block of the blocked order (one block is shuffled at a time)
_SALT = 0x4B524F4E  # separates the in-block seeds from the block-order seed


class EpochOrder:
    """The windows an `EpochSampler` chooses for one epoch, all ranks, as consecutive chunks (int32/int64 arrays), a
    pure function of (n, seed, epoch) and its options: shuffle False = ascending (a capped subset is drawn at random,
    then sorted); only the first m = min(max_samples, n) windows of the order; m - m % world_size of them when
    drop_remainder. Up to `exact_limit` windows the order is one full permutation, above it blocks of `block_size`
    are shuffled."""

    def __init__(self, s: EpochSampler, epoch: int):
        self.n, self.seed, self.epoch, self.shuffle = s.num_samples, s.seed, int(epoch), s.shuffle
        self.m = self.n if s.max_samples is None else min(int(s.max_samples), self.n)
        self.world_size = int(s.world_size)
        self.total = self.m - self.m % self.world_size if s.drop_remainder else self.m
        self.dtype = np.int32 if self.n < 2**31 else np.int64
        self.blocked = self.n > s.exact_limit and (self.shuffle or self.m < self.n)
        self.n_blocks = -(-self.n // int(s.block_size))

    def chunks(self) -> Iterator[np.ndarray]:
        """The epoch's order in consecutive pieces; their concatenation has `total` entries."""
        if not self.blocked:
            yield self._exact()[: self.total]
            return
        if not self.shuffle:  # a capped, sorted subset: materialise the m chosen windows (m is the cap)
            chosen = np.concatenate([make() for _, make in self._blocked_lazy(self.m)])
            yield np.sort(chosen)[: self.total]
            return
        yield from (make() for _, make in self._blocked_lazy(self.total))

    def rank_chunks(self, rank: int, skip: int = 0) -> Iterator[np.ndarray]:
        """Rank `rank`'s windows (positions rank, rank + W, ... of the order), after skipping its first `skip`."""
        w = self.world_size
        if not self.blocked:
            yield self._exact()[: self.total][rank::w][skip:]
            return
        pos = 0  # global position of the current chunk's first entry
        for length, make in self._blocked_lazy(self.total):
            first = (rank - pos) % w
            mine = len(range(first, length, w))
            pos += length
            if skip >= mine:  # skipped whole: no need to shuffle this block
                skip -= mine
                continue
            yield make()[first::w][skip:]
            skip = 0

    def _exact(self) -> np.ndarray:
        if self.shuffle or self.m < self.n:
            chosen = np.arange(self.n, dtype=self.dtype)
            np.random.default_rng([self.seed, self.epoch]).shuffle(chosen)  # == permutation(n): same draws
            chosen = chosen[: self.m]
            return chosen if self.shuffle else np.sort(chosen)
        return np.arange(self.n, dtype=self.dtype)

    def _blocked_lazy(self, limit: int):
        """(length, make) per block in visiting order, truncated to `limit` windows; make() builds the block."""
        nb = self.n_blocks
        left = limit
        for b in np.random.default_rng([self.seed, self.epoch]).permutation(nb).tolist():
            if left <= 0:
                return
            size = len(range(b, self.n, nb))
            take = min(size, left)
            left -= take

            def make(b: int = b, take: int = take) -> np.ndarray:
                members = np.arange(b, self.n, nb, dtype=self.dtype)  # (size,) strided over the whole data set
                np.random.default_rng([self.seed, self.epoch, _SALT, b]).shuffle(members)
                return members[:take]

            yield take, make


_NS_PER_DAY = 86_400_000_000_000
_NS_PER_MINUTE = 60_000_000_000


def wallclock_stamps(ts: np.ndarray) -> np.ndarray:
    """Calendar stamps of naive wall-clock ns times: int64 (n, 5) minute, hour, weekday (Monday=0), day, month
    (equal to model.features.calc_time_stamps of the same times)."""
    ts = np.asarray(ts, dtype=np.int64)
    days = ts // _NS_PER_DAY  # floor: times before 1970 count back correctly
    minute_of_day = (ts - days * _NS_PER_DAY) // _NS_PER_MINUTE
    d = days.astype("datetime64[D]")
    month_start = d.astype("datetime64[M]")
    out = np.empty((len(ts), 5), dtype=np.int64)
    out[:, 0] = minute_of_day % 60
    out[:, 1] = minute_of_day // 60
    out[:, 2] = (days + 3) % 7  # 1970-01-01 was a Thursday
    out[:, 3] = (d - month_start).astype(np.int64) + 1
    out[:, 4] = month_start.astype(np.int64) % 12 + 1
    return out


_ITER_CHUNK = 1 << 16  # window indices turned into Python ints at a time by EpochSampler.__iter__


@dataclass(frozen=True)
class SeriesArrays:
    """One series, already converted to arrays by the pipeline (built once, never per sample)."""

    features: np.ndarray  # float32 (N, F): open, high, low, close, volume, amount.
    stamps: np.ndarray  # int64 (N, 5): minute, hour, weekday, day of month, month.
    name: str = ""  # Symbol or file name, used in messages.


def panel_from_series(series: Sequence[SeriesArrays | tuple[np.ndarray, np.ndarray]]) -> SeriesPanel:
    """`SeriesArrays` or `(features (N_s, F), stamps (N_s, 5))` pairs -> one `SeriesPanel` (one copy), after checking
    every series' shapes."""
    items = [s if isinstance(s, SeriesArrays) else SeriesArrays(s[0], s[1]) for s in series]
    if not items:
        raise ValueError("WindowDataset got no series")
    names = [s.name or f"series {i}" for i, s in enumerate(items)]
    n_features = items[0].features.shape[1] if items[0].features.ndim == 2 else -1
    for name, s in zip(names, items):
        if s.features.ndim != 2 or s.features.shape[1] != n_features:
            raise ValueError(f"{name}: features must be (N, {n_features}), got {s.features.shape}")
        if s.stamps.shape != (s.features.shape[0], N_STAMP_COLUMNS):
            raise ValueError(f"{name}: stamps must be ({s.features.shape[0]}, 5), got {s.stamps.shape}")
    return SeriesPanel.from_series([s.features for s in items], [s.stamps for s in items], names)


def _as_block(array: np.ndarray, dtype: type) -> np.ndarray:
    """`array` itself when it already has `dtype` and C order (a memmap stays a memmap), else one converted copy."""
    if array.dtype == dtype and array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array, dtype=dtype)


class WindowDataset(Dataset):
    """All windows of `window.size` rows (every `stride` rows) inside each series of a `SeriesPanel`.

    data: a `SeriesPanel` (used as it is: an np.memmap panel stays memory-mapped), or `SeriesArrays` /
        `(features, stamps)` pairs, concatenated into a panel once. The normalisation uses the lookback rows only.
    ranges: optional (start, stop), int64 (S,) each: series s reads only panel columns [start[s], stop[s]) (a time
        split as index ranges; they may overlap, as a val split's context overlaps train).
    Series shorter than a window give no windows and are listed in `short_series` (name, rows); a dataset with no
    window at all raises DataError."""

    def __init__(self, data: SeriesPanel | Sequence[SeriesArrays | tuple[np.ndarray, np.ndarray]], window: Window,
                 *, stride: int = 1, ranges: tuple[np.ndarray, np.ndarray] | None = None):
        if window.lookback < 1 or window.predict < 0 or stride < 1:
            raise ValueError(f"need lookback >= 1, predict >= 0, stride >= 1; got {window}, stride {stride}")
        self.window, self.stride = window, int(stride)

        panel = data if isinstance(data, SeriesPanel) else panel_from_series(data)
        if panel.n_series == 0:
            raise ValueError("WindowDataset got no series")
        self.panel = panel
        self.names = [str(n) or f"series {i}" for i, n in enumerate(panel.names)]
        offsets = np.asarray(panel.offsets, dtype=np.int64)
        # no ranges: every series whole, from its first column
        start, stop = (np.asarray(r, dtype=np.int64) for r in (ranges or (offsets[:-1], offsets[1:])))
        if start.shape != (panel.n_series,) or stop.shape != start.shape or (start < offsets[:-1]).any() \
                or (stop > offsets[1:]).any() or (stop < start).any():
            raise ValueError("ranges must give, per series, a column range inside that series")
        lengths, self.row_offsets = stop - start, start  # (S,) rows readable, first panel column of each series
        w = window.size
        counts = np.where(lengths >= w, (lengths - w) // self.stride + 1, 0)
        self.windows_per_series = counts.astype(np.int64)
        self.cum_windows = np.cumsum(self.windows_per_series)  # cum_windows[s] = windows in series 0..s
        self.short_series = [(self.names[i], int(lengths[i])) for i in np.flatnonzero(counts == 0)]
        if self.cum_windows[-1] == 0:
            raise DataError(f"no series has enough rows for one window of lookback + predict = {w} rows "
                            f"(longest series: {int(lengths.max())} rows); lower the lookback/predict window or add "
                            "data")
        # The panel's blocks as they are (one copy only if the dtype or layout is not the engine's): cheap to share
        # with forked DataLoader workers (copy-on-write), and a memmap stays on disk. Features are feature-major,
        # (F, sum N): a window's statistics are then reductions over a contiguous time axis (4x faster than (N, F)).
        self.features_t = _as_block(panel.features, np.float32)  # (F, sum N)
        self.stamps = _as_block(panel.stamps, np.int64)  # (sum N, 5)
        # Read-only window views indexed by a window's first global row, without copying:
        # (sum N - W + 1, F, W) and (sum N - W + 1, W, 5). Gathering B windows copies B contiguous blocks.
        n_rows, f = self.stamps.shape[0], self.features_t.shape[0]
        self._feature_windows = np.lib.stride_tricks.as_strided(
            self.features_t, (n_rows - w + 1, f, w), (self.features_t.strides[1], self.features_t.strides[0],
                                                       self.features_t.strides[1]), writeable=False)
        self._stamp_windows = np.lib.stride_tricks.as_strided(
            self.stamps, (n_rows - w + 1, w, N_STAMP_COLUMNS), (self.stamps.strides[0],) + self.stamps.strides,
            writeable=False)

    @property
    def features(self) -> np.ndarray:
        """All series' features, (sum N, F) (a view of the feature-major block)."""
        return self.features_t.T

    def __len__(self) -> int:
        return int(self.cum_windows[-1])

    def locate(self, index: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample index (or array of indices) -> (series index, first row of the window within that series)."""
        idx = np.asarray(index, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)})")
        series = np.searchsorted(self.cum_windows, idx, side="right")
        before = np.where(series > 0, self.cum_windows[np.maximum(series - 1, 0)], 0)
        return series, (idx - before) * self.stride

    def starts(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Window indices (B,) -> the first panel column of each window, int64 (B,)."""
        series, start = self.locate(np.asarray(indices, dtype=np.int64))
        return self.row_offsets[series] + start  # (B,) global first row of each window

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows `indices` as one batch, vectorised: x (B, W, F) float32, x_stamp (B, W, 5) int64.

        x is normalised by `model.features.normalize` (the forecasters' own) over its lookback rows only."""
        starts = self.starts(np.asarray(indices, dtype=np.int64))
        x, _, _ = normalize(self._feature_windows[starts], self.window.clip, axis=2,
                            stats_len=self.window.lookback)  # (B, F, W)
        x = np.ascontiguousarray(x.transpose(0, 2, 1))  # (B, W, F)
        return torch.from_numpy(x), torch.from_numpy(self._stamp_windows[starts])

    def __getitem__(self, index):
        """One window (int index) -> (x (W, F), x_stamp (W, 5)); a list of indices -> a whole batch
        (x (B, W, F), x_stamp (B, W, 5)), which is what `make_loader` asks for."""
        if isinstance(index, (list, tuple, np.ndarray)):
            return self.get_batch(index)
        x, stamp = self.get_batch([int(index)])
        return x[0], stamp[0]


class EpochSampler(Sampler[int]):
    """Which windows this rank reads in an epoch: a pure function of (seed, epoch, rank), so runs are reproducible;
    `set_epoch(epoch, skip=k)` starts the epoch after this rank's first k windows (mid-epoch resume). The order,
    the per-epoch subset, the dealing to ranks and the remainder policy: docs/architecture.md, "Formats and designs"."""

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0, max_samples: int | None = None,
                 rank: int = 0, world_size: int = 1, drop_remainder: bool = True):
        if num_samples < 1:
            raise ValueError("EpochSampler needs at least one sample")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.max_samples = max_samples
        self.rank = rank
        self.world_size = world_size
        self.drop_remainder = drop_remainder
        self.epoch = self.skip = 0
        # see EpochOrder (tests lower both to reach the blocked order)
        self.exact_limit, self.block_size = EXACT_LIMIT, BLOCK_SIZE

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch (changes the order/subset) and how many of this rank's windows to skip (resume)."""
        self.epoch = int(epoch)
        self.skip = int(skip)

    def order(self, epoch: int | None = None) -> EpochOrder:
        """The epoch's order (an `EpochOrder`)."""
        return EpochOrder(self, self.epoch if epoch is None else epoch)

    def epoch_indices(self, epoch: int | None = None) -> np.ndarray:
        """The windows chosen for `epoch` (all ranks), in the order they are dealt out (materialised: for tests
        and small data; iterating the sampler streams the order instead)."""
        return np.concatenate(list(self.order(epoch).chunks()) or [np.zeros(0, dtype=np.int64)])

    def rank_indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's windows for `epoch`, before skipping (materialised, see `epoch_indices`)."""
        return np.concatenate(list(self.order(epoch).rank_chunks(self.rank)) or [np.zeros(0, dtype=np.int64)])

    def samples_per_rank(self) -> int:
        """Windows this rank reads in a full epoch (equal on all ranks when drop_remainder=True)."""
        return len(range(self.rank, self.order().total, self.world_size))  # total: m, or m - m % W when dropping

    def __iter__(self) -> Iterator[int]:
        # Python ints a chunk at a time: a list of this rank's whole share would cost ~36 bytes a window
        # (45M windows per rank: 1.6 GB), a chunk costs a few MB.
        for chunk in self.order().rank_chunks(self.rank, self.skip):
            for a in range(0, len(chunk), _ITER_CHUNK):
                yield from chunk[a : a + _ITER_CHUNK].tolist()

    def __len__(self) -> int:
        return max(0, self.samples_per_rank() - self.skip)


def init_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed numpy and python from the worker's torch seed (base seed + worker id); ignore
    SIGINT and SIGTERM, so a Ctrl-C or a scheduler's group SIGTERM (Slurm, torchrun's agent) stops the run gracefully
    instead of killing the loader under the save (a worker still ends with its training process: the loader shuts
    it down, torch's watchdog ends it if the parent dies)."""
    s = torch.initial_seed() % 2**32
    np.random.seed(s)
    random.seed(s)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_loader(dataset: Dataset, sampler: EpochSampler, batch_size: int, *, epoch: int, seed: int,
                skip_batches: int = 0, num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """The DataLoader for one epoch: `sampler.set_epoch(epoch, skip_batches * batch_size)`, batches of
    `batch_size` (last one may be smaller), every worker seeded reproducibly from (seed, epoch, rank, worker id)
    and deaf to Ctrl-C (`init_worker`)."""
    sampler.set_epoch(epoch, skip=skip_batches * batch_size)
    # The loader hands the dataset whole index lists (batch_size=None + a BatchSampler): WindowDataset gathers a
    # batch with one vectorised fancy-index instead of B item fetches that collate would then stack again.
    batches = BatchSampler(sampler, batch_size, drop_last=False)
    # The DataLoader draws its workers' base seed from this generator, seeded from (seed, epoch, rank).
    mixed = np.random.SeedSequence([int(seed), int(epoch), int(sampler.rank)]).generate_state(1, dtype=np.uint64)[0]
    common = dict(num_workers=num_workers, pin_memory=pin_memory, generator=torch.Generator().manual_seed(
        int(mixed) & 0x7FFF_FFFF_FFFF_FFFF), worker_init_fn=init_worker if num_workers > 0 else None)
    if not hasattr(dataset, "get_batch"):  # any other map-style dataset: item fetches + default collation
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **common)
    return DataLoader(dataset, batch_size=None, sampler=batches, **common)


def batches_per_epoch(samples: int, batch_size: int) -> int:
    """Number of (possibly partial) batches for `samples` windows."""
    return math.ceil(samples / batch_size) if samples > 0 else 0
