"""finetune/dataset.py: windows from the stored splits, lookback-only normalisation, DDP sampling, stale files."""

import numpy as np
import pandas as pd
import pytest
import torch

from finetune import qlib_data_preprocess as pre
from finetune import qlib_io as qio
from finetune.config import load
from finetune.dataset import (
    FORMAT,
    build_window_dataset,
    check_processed,
    manifest_settings,
)
from finetune.utils.config_utils import Problems
from finetune.utils.store import SeriesPanel
from finetune.utils.windows import EpochSampler, wallclock_stamps

LOOKBACK, PREDICT = 5, 3


def tiny_split(lengths=(12, 4, 9), seed=0) -> SeriesPanel:
    """Instruments with `lengths` bars; feature values encode (instrument, bar) so windows can be traced back."""
    rng = np.random.default_rng(seed)
    feats, when, names = [], [], []
    for s, n in enumerate(lengths):
        f = rng.uniform(1, 2, (n, 6)).astype(np.float32)
        f[:, 0] = 1000 * s + np.arange(n)  # open = instrument * 1000 + bar number
        feats.append(f)
        when.append(qio.datetimes_ns(pd.bdate_range("2021-01-04", periods=n)))
        names.append(f"S{s}")
    when = np.concatenate(when)
    return SeriesPanel(np.ascontiguousarray(np.concatenate(feats).T), wallclock_stamps(when),
                       np.r_[0, np.cumsum(lengths)].astype(np.int64), names, when)


def cfg_for(tmp_path, *extra):
    return load(None, [f"data.lookback={LOOKBACK}", f"data.predict={PREDICT}",
                       f"data.dataset_path={tmp_path / 'processed'}", f"data.qlib_data_path={tmp_path}", *extra])


def test_windows_stay_inside_one_instrument_and_short_ones_are_reported(tmp_path, caplog):
    split = tiny_split()
    with caplog.at_level("INFO", logger="finetune.qlib"):
        ds = build_window_dataset(split, cfg_for(tmp_path), "train")
    window = LOOKBACK + PREDICT
    assert len(ds) == (12 - window + 1) + (9 - window + 1)  # S1 (4 bars) gives none
    assert "S1 (4 bars)" in caplog.text
    for i in range(len(ds)):
        series, start = ds.locate(i)
        rows = ds.row_offsets[series] + start + np.arange(window)
        raw_open = ds.features[rows, 0]
        assert len(set((raw_open // 1000).astype(int).tolist())) == 1  # one instrument
        assert (np.diff(raw_open) == 1).all()  # consecutive bars


def test_items_are_normalised_with_lookback_statistics_only(tmp_path):
    split = tiny_split()
    ds = build_window_dataset(split, cfg_for(tmp_path), "train")
    x, stamp = ds[2]  # instrument S0, bars 2..9
    raw = split.features[:, 2 : 2 + LOOKBACK + PREDICT].T.astype(np.float64)
    past = raw[:LOOKBACK]
    expected = np.clip((raw - past.mean(0)) / (past.std(0) + 1e-5), -5, 5)
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-4, atol=1e-4)
    assert x.shape == (LOOKBACK + PREDICT, 6) and stamp.dtype == torch.int64
    np.testing.assert_array_equal(stamp.numpy(), split.stamps[2 : 2 + LOOKBACK + PREDICT])


@pytest.mark.parametrize("cap", [None, 7])
def test_ddp_ranks_read_disjoint_windows_that_cover_the_epoch(tmp_path, cap):
    ds = build_window_dataset(tiny_split(lengths=(30, 25, 20)), cfg_for(tmp_path), "train")
    samplers = [EpochSampler(len(ds), shuffle=True, seed=100, max_samples=cap, rank=r, world_size=2) for r in (0, 1)]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        chosen = samplers[0].epoch_indices(epoch)
        assert len(per_rank[0]) == len(per_rank[1])  # DDP: same number of steps on every rank
        assert not set(per_rank[0]) & set(per_rank[1])  # no window read twice
        assert sorted(per_rank[0] + per_rank[1]) == sorted(chosen.tolist())
        assert len(chosen) == ((cap or len(ds)) // 2) * 2
    if cap:  # a fresh seeded subset each epoch (the original's n_train_iter)
        assert set(samplers[0].epoch_indices(0)) != set(samplers[0].epoch_indices(1))


def test_missing_preprocessed_files_are_named(tmp_path):
    problems = Problems()
    check_processed(cfg_for(tmp_path), ("train", "val"), problems)
    assert len(problems.items) == 1 and problems.items[0].startswith("data.dataset_path")
    assert "qlib_data_preprocess.py" in problems.items[0]


def test_splits_made_with_other_settings_are_named(tmp_path):
    cfg = cfg_for(tmp_path)
    split = tiny_split()
    manifest = {"format": FORMAT, "settings": manifest_settings(cfg)}
    pre.write_splits(cfg.data.dataset_path, {"train": split, "val": split, "test": split}, manifest)
    problems = Problems()
    check_processed(cfg, ("train", "val", "test"), problems)
    assert not problems

    changed = cfg_for(tmp_path, "data.lookback=7", "data.instrument=csi500", "backtest.benchmark=SH000905")
    check_processed(changed, ("train",), problems)
    keys = sorted(p.split(":")[0] for p in problems.items)
    assert keys == ["data.instrument", "data.lookback"]


def test_processed_splits_are_identified_by_content_and_may_move(tmp_path):
    import shutil

    from finetune.dataset import build_train_val_datasets

    cfg = cfg_for(tmp_path, "data.lookback=3", "data.predict=1")
    split = tiny_split()
    pre.write_splits(cfg.data.dataset_path, {"train": split, "val": split, "test": split},
                     {"format": FORMAT, "settings": manifest_settings(cfg)})
    info = build_train_val_datasets(cfg)[2]
    moved = tmp_path / "elsewhere" / "processed"
    shutil.move(cfg.data.dataset_path, moved)  # another folder; and the Qlib source lives elsewhere too
    there = cfg_for(tmp_path, "data.lookback=3", "data.predict=1", f"data.dataset_path={moved}",
                    f"data.qlib_data_path={tmp_path / 'other_machine_qlib'}")
    problems = Problems()
    check_processed(there, ("train", "val", "test"), problems)
    assert not problems.items
    assert build_train_val_datasets(there)[2] == info  # the same data fingerprint: a resume is allowed

    other = tmp_path / "other"
    pre.write_splits(other, {"train": tiny_split(seed=1), "val": split, "test": split},
                     {"format": FORMAT, "settings": manifest_settings(there)})
    shutil.rmtree(moved / "train")
    shutil.copytree(other / "train", moved / "train")  # another store at the same path
    check_processed(there, ("train",), problems)
    assert len(problems.items) == 1 and "their content hash differs" in problems.items[0]
    assert problems.items[0].startswith("data.dataset_path")
