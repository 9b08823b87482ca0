"""The order in which an epoch reads its windows, produced chunk by chunk: a pure function of (seed, epoch).

Two regimes, chosen by the number of windows n:

- n <= `exact_limit` (16.8M windows by default): the exact order the engine has always used,
  `np.random.default_rng([seed, epoch]).permutation(n)` (computed as an int32 shuffle, which draws the same
  random numbers: 4 bytes a window). Exact resume and the golden engine tests depend on this order.
- n > `exact_limit`: a blocked order that needs O(block) memory and starts at once (a full permutation of 100M
  windows takes 20+ s and 400 MB per rank). The windows are dealt into nb = ceil(n / block) strided blocks,
  block b = {b, b + nb, b + 2 nb, ...} (so every block samples the whole data set evenly: all series, all dates);
  the blocks are visited in the order `default_rng([seed, epoch]).permutation(nb)` and each block's members are
  shuffled with `default_rng([seed, epoch, _SALT, b])`. Every window is still read exactly once per epoch.

`max_samples` takes the first m windows of the order (sorted again when shuffle=False); `drop_remainder` drops the
last m % world_size so every rank reads the same number. Rank r reads positions r, r + W, r + 2W, ... of the order.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["BLOCK_SIZE", "EXACT_LIMIT", "EpochOrder"]

EXACT_LIMIT = 1 << 24  # windows up to which the original full permutation is used
BLOCK_SIZE = 1 << 16  # windows per block of the blocked order (one block is shuffled at a time)
_SALT = 0x4B524F4E  # separates the in-block seeds from the block-order seed


class EpochOrder:
    """The windows chosen for one epoch, all ranks, as consecutive chunks (int32/int64 arrays).

    Args:
        n: windows in the data set.
        seed, epoch: the order is a pure function of these (and of n and the options below).
        shuffle: False = ascending order (a capped subset is drawn at random, then sorted).
        max_samples: use only the first m = min(max_samples, n) windows of the order (None = all).
        world_size, drop_remainder: the total is m - m % world_size when drop_remainder.
        exact_limit, block_size: the regime switch and the block size (see the module docstring).
    """

    def __init__(self, n: int, seed: int, epoch: int, *, shuffle: bool = True, max_samples: int | None = None,
                 world_size: int = 1, drop_remainder: bool = True, exact_limit: int = EXACT_LIMIT,
                 block_size: int = BLOCK_SIZE):
        self.n, self.seed, self.epoch = int(n), int(seed), int(epoch)
        self.shuffle = shuffle
        self.m = self.n if max_samples is None else min(int(max_samples), self.n)
        self.world_size = int(world_size)
        self.total = self.m - self.m % self.world_size if drop_remainder else self.m
        self.dtype = np.int32 if self.n < 2**31 else np.int64
        self.blocked = self.n > exact_limit and (shuffle or self.m < self.n)
        self.n_blocks = -(-self.n // int(block_size))

    # ------------------------------------------------------------------------------------------------------------
    def chunks(self) -> Iterator[np.ndarray]:
        """The epoch's order in consecutive pieces; their concatenation has `total` entries."""
        if not self.blocked:
            yield self._exact()[: self.total]
            return
        if not self.shuffle:  # a capped, sorted subset: materialise the m chosen windows (m is the cap)
            chosen = np.concatenate(list(self._blocked(self.m)))
            yield np.sort(chosen)[: self.total]
            return
        yield from self._blocked(self.total)

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

    # ------------------------------------------------------------------------------------------------------------
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

    def _blocked(self, limit: int) -> Iterator[np.ndarray]:
        for _, make in self._blocked_lazy(limit):
            yield make()
