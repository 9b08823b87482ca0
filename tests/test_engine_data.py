"""The shared window dataset and the epoch-aware distributed sampler."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import Dataset

from finetune.utils.store import SeriesPanel
from finetune.utils.windows import EpochSampler, SeriesArrays, WindowDataset, make_loader
from model.config import Window
from tests.engine_dist_worker import random_walk_series

LOOKBACK, PREDICT = 6, 2


def window_starts(dataset: WindowDataset) -> np.ndarray:
    """Global first row of every window, read back from the id stamps (stamp column 0 = global row)."""
    return np.array([int(dataset[i][1][0, 0]) for i in range(len(dataset))])


def test_windows_never_cross_series_and_respect_stride():
    series = random_walk_series(n_series=3, n_rows=20, id_stamps=True)
    series[1] = SeriesArrays(series[1].features[:9], series[1].stamps[:9], "short")  # 9 rows: 2 windows of 8
    ds = WindowDataset(series, Window(LOOKBACK, PREDICT), stride=3)
    # Series 0 rows 0..19 -> starts 0,3,6,9,12; series 1 rows 20..28 -> start 20; series 2 rows 40..59.
    assert window_starts(ds).tolist() == [0, 3, 6, 9, 12, 20, 40, 43, 46, 49, 52]
    for i in range(len(ds)):
        rows = ds[i][1][:, 0].numpy()
        assert (np.diff(rows) == 1).all()  # contiguous rows of one series
        assert rows[0] // 20 == rows[-1] // 20
    series_idx, start = ds.locate(np.array([0, 5, 6, 10]))
    assert series_idx.tolist() == [0, 1, 2, 2] and start.tolist() == [0, 0, 0, 12]


def test_item_matches_a_per_sample_pandas_reference():
    series = random_walk_series(n_series=2, n_rows=30)
    ds = WindowDataset(series, Window(LOOKBACK, PREDICT, 5.0))
    frames = [pd.DataFrame(s.features) for s in series]
    for i in [0, 7, len(ds) - 1]:
        s, start = (int(v) for v in ds.locate(i))
        window = frames[s].iloc[start : start + LOOKBACK + PREDICT].to_numpy(np.float32)
        past = window[:LOOKBACK]
        expected = np.clip((window - past.mean(0)) / (past.std(0) + 1e-5), -5, 5)  # population std
        x, stamp = ds[i]
        assert x.dtype == torch.float32 and stamp.dtype == torch.int64
        assert x.shape == (LOOKBACK + PREDICT, 6) and stamp.shape == (LOOKBACK + PREDICT, 5)
        np.testing.assert_allclose(x.numpy(), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(stamp.numpy(), series[s].stamps[start : start + LOOKBACK + PREDICT])


def test_future_rows_do_not_leak_into_the_normalisation():
    series = random_walk_series(n_series=1, n_rows=LOOKBACK + PREDICT)
    changed = series[0].features.copy()
    changed[LOOKBACK:] *= 50  # a huge move in the predicted part
    a = WindowDataset(series, Window(LOOKBACK, PREDICT, 1e9))[0][0]
    b = WindowDataset([SeriesArrays(changed, series[0].stamps)], Window(LOOKBACK, PREDICT, 1e9))[0][0]
    torch.testing.assert_close(a[:LOOKBACK], b[:LOOKBACK])
    assert not torch.allclose(a[LOOKBACK:], b[LOOKBACK:])
    assert WindowDataset(series, Window(LOOKBACK, PREDICT, 2.0))[0][0].abs().max() <= 2.0


def test_batched_fetch_equals_single_items():
    ds = WindowDataset(random_walk_series(2, 25), Window(LOOKBACK, PREDICT))
    x, stamp = ds.get_batch([3, 0, 20])
    for row, i in enumerate([3, 0, 20]):
        torch.testing.assert_close(x[row], ds[i][0])
        assert torch.equal(stamp[row], ds[i][1])


def test_short_series_are_reported_and_bad_input_raises():
    series = random_walk_series(n_series=2, n_rows=20)
    tiny = SeriesArrays(series[0].features[:5], series[0].stamps[:5], "TINY")
    ds = WindowDataset([series[0], tiny], Window(LOOKBACK, PREDICT))
    assert ds.short_series == [("TINY", 5)]
    with pytest.raises(ValueError, match="lookback \\+ predict = 8 rows.*longest series: 5 rows"):
        WindowDataset([tiny], Window(LOOKBACK, PREDICT))
    with pytest.raises(ValueError, match="stamps must be"):
        WindowDataset([(series[0].features, series[0].stamps[:, :4])], Window(LOOKBACK, PREDICT))


def collect(dataset, sampler_kwargs, world_size, epoch, num_workers, batch_size=3):
    """Window starts read by every rank (each with `num_workers` loader workers) in one epoch."""
    seen = []
    for rank in range(world_size):
        sampler = EpochSampler(len(dataset), rank=rank, world_size=world_size, seed=7, **sampler_kwargs)
        loader = make_loader(dataset, sampler, batch_size, epoch=epoch, seed=7, num_workers=num_workers)
        per_rank = [int(r) for _, stamp in loader for r in stamp[:, 0, 0]]
        assert len(per_rank) == len(sampler)
        seen.append(per_rank)
    return seen


def test_every_window_once_per_epoch_across_two_ranks_and_two_workers():
    ds = WindowDataset(random_walk_series(3, 17, id_stamps=True), Window(LOOKBACK, PREDICT))  # 3 * 10 = 30 windows
    all_starts = sorted(window_starts(ds).tolist())
    # Validation policy: nothing dropped, nothing duplicated (ranks get 15 and 15 here; uneven sizes are allowed).
    val = collect(ds, dict(shuffle=False, drop_remainder=False), world_size=2, epoch=0, num_workers=2)
    assert sorted(val[0] + val[1]) == all_starts
    # Training policy: shuffled, equal share per rank, each chosen window exactly once.
    ds31 = WindowDataset(random_walk_series(1, 38, id_stamps=True), Window(LOOKBACK, PREDICT))  # 31 windows
    train = collect(ds31, dict(shuffle=True, drop_remainder=True), world_size=2, epoch=3, num_workers=2)
    merged = train[0] + train[1]
    assert len(train[0]) == len(train[1]) == 15
    assert len(set(merged)) == 30 and set(merged) <= set(window_starts(ds31).tolist())
    val31 = collect(ds31, dict(shuffle=False, drop_remainder=False), world_size=2, epoch=0, num_workers=0)
    assert (len(val31[0]), len(val31[1])) == (16, 15)


def test_order_depends_on_seed_and_epoch_only_and_capping_draws_fresh_subsets():
    s = EpochSampler(100, seed=1, max_samples=10)
    s.set_epoch(0)
    a = list(s)
    s.set_epoch(1)
    b = list(s)
    again = EpochSampler(100, seed=1, max_samples=10)
    again.set_epoch(0)
    assert a == list(again) and len(a) == 10 and len(set(a)) == 10
    assert set(a) != set(b)  # a fresh subset each epoch
    capped_val = EpochSampler(100, shuffle=False, seed=1, max_samples=10, drop_remainder=False)
    subset = capped_val.epoch_indices(0)
    assert len(subset) == 10 and (np.diff(subset) > 0).all()
    assert EpochSampler(5, max_samples=50).samples_per_rank() == 5  # a cap above the data size uses all


def test_skip_resumes_in_the_middle_of_the_epoch_order():
    s = EpochSampler(20, seed=3, rank=1, world_size=2)
    full = s.rank_indices(2).tolist()
    s.set_epoch(2, skip=4)
    assert list(s) == full[4:] and len(s) == len(full) - 4


class _RandomItems(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([np.random.rand(), torch.rand(()).item()])


def test_each_worker_gets_a_distinct_reproducible_seed():
    def draws(epoch):
        sampler = EpochSampler(8, shuffle=False)
        loader = make_loader(_RandomItems(), sampler, 2, epoch=epoch, seed=5, num_workers=2)
        return torch.cat(list(loader))

    first, repeat, other_epoch = draws(0), draws(0), draws(1)
    assert torch.equal(first, repeat)
    assert not torch.equal(first, other_epoch)
    # Worker 0 made batches 0 and 2, worker 1 batches 1 and 3: numpy streams must differ between workers.
    assert not torch.equal(first[0:2, 0], first[2:4, 0])


def test_a_memmapped_panel_is_read_in_place_and_gives_the_windows_of_the_array_path(tmp_path):
    series = random_walk_series(n_series=3, n_rows=25, seed=4)
    from_arrays = WindowDataset(series, Window(LOOKBACK, PREDICT, 3.0), stride=2)
    panel = SeriesPanel.from_series([s.features for s in series], [s.stamps for s in series],
                                    [s.name for s in series])
    # the panel on disk, opened read-only as every rank of a prepared data store would
    feats = np.lib.format.open_memmap(tmp_path / "f.npy", mode="w+", dtype=np.float32, shape=panel.features.shape)
    stamps = np.lib.format.open_memmap(tmp_path / "s.npy", mode="w+", dtype=np.int64, shape=panel.stamps.shape)
    feats[:], stamps[:] = panel.features, panel.stamps
    feats.flush(), stamps.flush()
    mapped = SeriesPanel(np.load(tmp_path / "f.npy", mmap_mode="r"), np.load(tmp_path / "s.npy", mmap_mode="r"),
                         panel.offsets, panel.names)
    ds = WindowDataset(mapped, Window(LOOKBACK, PREDICT, 3.0), stride=2)
    assert isinstance(ds.features_t, np.memmap) and isinstance(ds.stamps, np.memmap)  # no copy in memory
    assert ds.features_t is mapped.features and ds.stamps is mapped.stamps
    assert len(ds) == len(from_arrays) and ds.names == from_arrays.names
    x, stamp = ds.get_batch(np.arange(len(ds)))
    x_ref, stamp_ref = from_arrays.get_batch(np.arange(len(ds)))
    assert torch.equal(x, x_ref) and torch.equal(stamp, stamp_ref)  # bit-identical windows


def test_a_panel_of_another_dtype_is_converted_once_and_the_list_constructor_equals_the_panel_one():
    series = random_walk_series(n_series=2, n_rows=20)
    panel = SeriesPanel.from_series([s.features for s in series], [s.stamps for s in series], ["a", "b"])
    as_f64 = SeriesPanel(panel.features.astype(np.float64), panel.stamps, panel.offsets, panel.names)
    ds = WindowDataset(as_f64, Window(LOOKBACK, PREDICT))
    assert ds.features_t.dtype == np.float32 and ds.features_t.flags.c_contiguous
    a, b = WindowDataset(series, Window(LOOKBACK, PREDICT)), WindowDataset(panel, Window(LOOKBACK, PREDICT))
    assert torch.equal(a[len(a) - 1][0], b[len(b) - 1][0]) and torch.equal(ds[3][0], b[3][0])


def _reference_epoch_order(n, seed, epoch, rank, world_size, max_samples=None, shuffle=True, drop_remainder=True):
    """The sampler's order as it was first written (int64 permutation, whole share as a list): resume and the
    engine's golden runs depend on it staying identical."""
    m = n if max_samples is None else min(max_samples, n)
    if shuffle or m < n:
        chosen = np.random.default_rng([seed, epoch]).permutation(n)[:m]
        if not shuffle:
            chosen = np.sort(chosen)
    else:
        chosen = np.arange(n)
    if drop_remainder:
        chosen = chosen[: len(chosen) - len(chosen) % world_size]
    return chosen[rank::world_size].tolist()


@pytest.mark.parametrize("n,max_samples,shuffle,drop", [(1, None, True, True), (31, None, True, True),
                                                        (200_003, None, True, True), (1000, 100, False, False),
                                                        (70_000, 65_537, True, False)])
def test_compact_epoch_order_equals_the_original_order_and_iterates_in_chunks(n, max_samples, shuffle, drop):
    for rank in (0, 1, 2):
        s = EpochSampler(n, seed=11, rank=rank, world_size=3, max_samples=max_samples, shuffle=shuffle,
                         drop_remainder=drop)
        for epoch in (0, 4):
            s.set_epoch(epoch, skip=2)
            got = list(iter(s))
            want = _reference_epoch_order(n, 11, epoch, rank, 3, max_samples, shuffle, drop)[2:]
            assert got == want and len(got) == len(s)
            assert all(type(i) is int for i in got[:3])
    assert EpochSampler(1000).epoch_indices(0).dtype == np.int32  # 4 bytes a window, not 8


def blocked_sampler(n, rank=0, world_size=3, **kw):
    s = EpochSampler(n, seed=5, rank=rank, world_size=world_size, **kw)
    s.exact_limit, s.block_size = 1000, 64  # the large-data regime, at a test's size
    return s


def test_blocked_order_above_the_exact_limit_reads_every_window_once_evenly_and_resumes_exactly():
    n = 5003
    for epoch in (0, 1):
        shares = []
        for rank in range(3):
            s = blocked_sampler(n, rank)
            s.set_epoch(epoch)
            shares.append(list(s))
            assert len(shares[-1]) == len(s) == n // 3
            s.set_epoch(epoch, skip=777)  # mid-epoch resume: exactly the tail
            assert list(s) == shares[-1][777:]
        merged = shares[0] + shares[1] + shares[2]
        assert len(set(merged)) == len(merged) == n - n % 3
        assert list(blocked_sampler(n, 1).rank_indices(epoch)) == shares[1]  # a pure function of (seed, epoch)
        # a batch mixes the whole data set: 32 windows spread over most of the index range (all series, all dates)
        first = np.array(shares[0][:32])
        assert first.max() - first.min() > n // 2
    assert blocked_sampler(n).epoch_indices(0).tolist() != blocked_sampler(n).epoch_indices(1).tolist()
    capped = blocked_sampler(n, world_size=1, max_samples=300, shuffle=False, drop_remainder=False)
    subset = capped.epoch_indices(0)
    assert len(subset) == 300 and (np.diff(subset) > 0).all()
    assert blocked_sampler(n).order(0).blocked  # the regime switch took effect
    assert EpochSampler(n).order(0).blocked is False  # default limit: the exact original order
