"""Prepared data store: equal to the CSV pipeline's arrays, reused and invalidated correctly, memory-mapped,
bit-identical windows, clear errors without partial output, and two ranks reading disjoint windows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from finetune.utils.errors import StoreError
from finetune.utils.store import SeriesPanel, npy_header, open_store
from finetune.utils.windows import SeriesArrays, WindowDataset, wallclock_stamps
from finetune_csv.config import ColumnsConfig, DataConfig
from finetune_csv.prepare import StoreSettings, ensure_store, prepare_store
from finetune_csv.splits import split_panel
from model.config import Window
from model.features import calc_time_stamps
from tests.conftest import cpu_env
from tests.csv_reference import candles, load_series, split_series


def reference_panel(cfg: DataConfig) -> SeriesPanel:
    """What the CSV pipeline loads, as a panel (the store must equal it)."""
    series = load_series(cfg)
    return SeriesPanel.from_series([s.values for s in series],
                                   [calc_time_stamps(s.timestamps).to_numpy(dtype=np.int64) for s in series],
                                   [s.name for s in series],
                                   [s.timestamps.tz_localize(None).as_unit("ns").asi8 if s.timestamps.tz else
                                    s.timestamps.as_unit("ns").asi8 for s in series])


def assert_panels_equal(store: SeriesPanel, ref: SeriesPanel) -> None:
    assert list(store.names) == list(ref.names)
    np.testing.assert_array_equal(store.offsets, ref.offsets)
    assert store.features.dtype == np.float32 and store.stamps.dtype == np.int64
    assert np.array_equal(store.features, ref.features)  # bit for bit
    assert np.array_equal(store.stamps, ref.stamps)
    assert np.array_equal(store.datetimes, ref.datetimes)


def messy_folder(folder: Path) -> None:
    """Files exercising every rule: interleaved symbols, unsorted rows, missing amount, NaN, padded cells."""
    folder.mkdir(parents=True, exist_ok=True)
    a = candles(300, seed=1, ticker="BBB")
    b = candles(250, seed=2, start="2024-03-30 22:00", ticker="AAA")  # crosses a month end, odd hours
    mixed = pd.concat([a, b]).sample(frac=1.0, random_state=0)  # interleaved AND unsorted within each symbol
    mixed.loc[mixed.index[5], "volume"] = np.nan
    mixed.to_csv(folder / "multi.csv", index=False)
    c = candles(200, seed=3).drop(columns=["amount"])
    c.loc[17, "close"] = np.nan
    text = c.to_csv(index=False).replace(",", ", ")  # spaces after commas, as hand-written files have
    (folder / "single.csv").write_text(text)


@pytest.mark.parametrize("policy", ["ffill", "drop"])
def test_store_arrays_equal_the_csv_pipeline_bit_for_bit(tmp_path, policy):
    messy_folder(tmp_path / "csv")
    cfg = DataConfig(path=str(tmp_path / "csv"), symbol_column="ticker", nan_policy=policy)
    # single.csv has no ticker column: give it its own config below; here only multi.csv
    (tmp_path / "csv" / "single.csv").rename(tmp_path / "single.csv")
    info = prepare_store(tmp_path / "csv", tmp_path / "store", StoreSettings.from_data_config(cfg), block_rows=64)
    assert_panels_equal(open_store(tmp_path / "store"), reference_panel(cfg))
    assert info.manifest["n_series"] == 2 and any("not sorted" in w for w in info.manifest["warnings"])

    cfg1 = DataConfig(path=str(tmp_path / "single.csv"), nan_policy=policy)
    prepare_store(tmp_path / "single.csv", tmp_path / "store1", StoreSettings.from_data_config(cfg1), block_rows=50)
    assert_panels_equal(open_store(tmp_path / "store1"), reference_panel(cfg1))


def test_column_mapping_tz_offsets_and_no_volume_match_the_csv_pipeline(tmp_path):
    frame = candles(120).rename(columns={"timestamps": "Date", "close": "Close"}).drop(columns=["volume", "amount"])
    frame["Date"] = frame["Date"].dt.strftime("%Y-%m-%d %H:%M:%S+08:00")  # offsets: stamps use local time
    frame.to_csv(tmp_path / "a.csv", index=False)
    cfg = DataConfig(path=str(tmp_path / "a.csv"), columns=ColumnsConfig(timestamps="Date", close="Close"))
    prepare_store(cfg.path, tmp_path / "store", StoreSettings.from_data_config(cfg))
    store, ref = open_store(tmp_path / "store"), reference_panel(cfg)
    assert_panels_equal(store, ref)
    assert store.stamps[0, 1] == 9 and not store.features[4:].any()  # 09:30 local; volume and amount 0


def test_parquet_input_gives_the_same_store_as_csv(tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "pq").mkdir()
    for i in range(3):
        frame = candles(150 + 10 * i, seed=i)
        frame.to_csv(tmp_path / "csv" / f"s{i}.csv", index=False)
        # Parquet keeps the float64 the CSV's shortest repr encodes, and typed timestamps (UTC -> local time).
        tz = frame.assign(timestamps=frame["timestamps"].dt.tz_localize("Asia/Shanghai"))
        pq.write_table(pa.Table.from_pandas(tz, preserve_index=False), tmp_path / "pq" / f"s{i}.csv.parquet")
    prepare_store(tmp_path / "csv", tmp_path / "s_csv")
    prepare_store(tmp_path / "pq", tmp_path / "s_pq", block_rows=40)
    a, b = open_store(tmp_path / "s_csv"), open_store(tmp_path / "s_pq")
    assert [n.replace(".parquet", "") for n in b.names] == list(a.names)
    for k in ("features", "stamps", "datetimes", "offsets"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k


def test_parquet_with_a_categorical_symbol_column_matches_csv(tmp_path):
    both = pd.concat([candles(80, seed=1, ticker="BBB"), candles(60, seed=2, ticker="AAA")]).sample(
        frac=1.0, random_state=1)
    both.to_csv(tmp_path / "m.csv", index=False)
    table = pa.Table.from_pandas(both.astype({"ticker": "category"}), preserve_index=False)
    pq.write_table(table, tmp_path / "m.parquet")
    settings = StoreSettings(symbol_column="ticker")
    prepare_store(tmp_path / "m.csv", tmp_path / "a", settings, block_rows=32)
    prepare_store(tmp_path / "m.parquet", tmp_path / "b", settings, block_rows=32)
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    assert list(b.names) == ["m.parquet[AAA]", "m.parquet[BBB]"] and b.lengths().tolist() == [60, 80]
    for k in ("features", "stamps", "datetimes"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k


def test_store_is_reused_and_invalidated_with_a_reason(tmp_path, caplog):
    data = tmp_path / "csv"
    data.mkdir()
    candles(100, seed=1).to_csv(data / "a.csv", index=False)
    candles(90, seed=2).to_csv(data / "b.csv", index=False)
    store = tmp_path / "store"
    first = ensure_store(data, store)
    assert not first.reused and "first run" in first.reason
    again = ensure_store(data, store)
    assert again.reused and again.reason == "inputs and settings unchanged"

    os.utime(data / "a.csv", ns=(10**18, 10**18))  # touched: content identical -> reused, mtime refreshed
    touched = ensure_store(data, store)
    assert touched.reused and "1 file(s) touched" in touched.reason
    assert ensure_store(data, store).reason == "inputs and settings unchanged"

    lines = (data / "a.csv").read_text().splitlines()
    lines[1] = lines[1][:-1] + ("1" if lines[1][-1] != "1" else "2")  # same size, other content
    (data / "a.csv").write_text("\n".join(lines) + "\n")
    changed = ensure_store(data, store)
    assert not changed.reused and "a.csv changed (its content differs" in changed.reason

    with open(data / "b.csv", "a") as f:  # one more row
        f.write("2030-01-01 00:00:00,1,2,0.5,1.5,10,15\n")
    grown = ensure_store(data, store)
    assert not grown.reused and "b.csv changed" in grown.reason and "bytes" in grown.reason
    assert open_store(store).lengths().tolist() == [100, 91]

    policy = ensure_store(data, store, StoreSettings(nan_policy="drop"))
    assert not policy.reused and "data.nan_policy changed from 'error' to 'drop'" in policy.reason
    candles(80, seed=3).to_csv(data / "c.csv", index=False)
    added = ensure_store(data, store, StoreSettings(nan_policy="drop"))
    assert not added.reused and "added" in added.reason and open_store(store).n_series == 3
    assert "preparing it" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["csv", "store"]  # nothing left behind


def test_bad_cells_raise_one_error_naming_file_column_line_and_leave_no_output(tmp_path):
    data = tmp_path / "csv"
    data.mkdir()
    frame = candles(60, seed=1).astype({"close": object})
    frame.loc[10, "close"] = "12,5"
    frame.loc[40, "close"] = "abc"
    frame.to_csv(data / "a.csv", index=False)
    dup = candles(30, seed=2)
    dup.loc[7, "timestamps"] = dup.loc[6, "timestamps"]
    dup.to_csv(data / "b.csv", index=False)
    with pytest.raises(StoreError) as err:
        prepare_store(data, tmp_path / "store", block_rows=16)
    msg = str(err.value)
    assert "a.csv: column 'close' (data.columns.close) has 2 non-numeric value(s) at line(s) 12, 42" in msg
    assert "b.csv: 1 duplicate timestamp(s)" in msg and "line(s) 8, 9" in msg
    assert list(tmp_path.iterdir()) == [data]  # no store, no temporary folder


def test_missing_values_with_policy_error_and_a_misspelt_column_are_reported(tmp_path):
    frame = candles(40)
    frame.loc[3, "volume"] = np.nan
    frame.to_csv(tmp_path / "a.csv", index=False)
    with pytest.raises(StoreError, match=r"missing values in column volume at line\(s\) 5 .*data.nan_policy"):
        prepare_store(tmp_path / "a.csv", tmp_path / "store")
    candles(40).rename(columns={"close": "Clsoe"}).to_csv(tmp_path / "b.csv", index=False)
    with pytest.raises(StoreError, match=r"no 'close' column, in any case \(did you mean 'Clsoe'\?\).*data.columns"):
        prepare_store(tmp_path / "b.csv", tmp_path / "store")


def test_a_folder_that_is_not_a_store_is_never_overwritten(tmp_path):
    candles(40).to_csv(tmp_path / "a.csv", index=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.txt").write_text("user's work")
    with pytest.raises(StoreError, match="is not a prepared data store; it is left untouched"):
        ensure_store(tmp_path / "a.csv", tmp_path / "out")
    assert (tmp_path / "out" / "results.txt").read_text() == "user's work"


def test_mapped_windows_equal_in_memory_windows_bit_for_bit(tmp_path):
    messy_folder(tmp_path / "csv")
    (tmp_path / "csv" / "single.csv").unlink()
    cfg = DataConfig(path=str(tmp_path / "csv"), symbol_column="ticker", nan_policy="ffill", lookback=16,
                     predict=4, train_ratio=0.6, val_ratio=0.2, test_ratio=0.2, stride=3)
    prepare_store(cfg.path, tmp_path / "store", StoreSettings.from_data_config(cfg))
    panel = open_store(tmp_path / "store")
    assert isinstance(panel.features, np.memmap) and isinstance(panel.stamps, np.memmap)
    mapped = split_panel(panel, cfg.train_ratio, cfg.val_ratio, cfg.test_ratio, cfg.window)
    for name, segments in split_series(load_series(cfg), cfg).items():
        ref = WindowDataset([SeriesArrays(s.values.astype(np.float32),
                                          calc_time_stamps(s.timestamps).to_numpy(dtype=np.int64))
                             for s in segments], cfg.window, stride=cfg.stride)
        ours = mapped[name].dataset(cfg.window, stride=cfg.stride)
        assert isinstance(ours.features_t, np.memmap)  # the shared WindowDataset reads the map, no copy
        assert len(ours) == len(ref)
        idx = np.random.default_rng(0).permutation(len(ref))
        x_ref, st_ref = ref.get_batch(idx)
        x, st = ours.get_batch(idx)
        assert x.dtype == x_ref.dtype and np.array_equal(x.numpy(), x_ref.numpy()), name
        assert np.array_equal(st.numpy(), st_ref.numpy()), name
        # val/test windows start `lookback` rows before the split: the first one predicts the split's first row
        assert np.array_equal(mapped[name].first_target - mapped[name].start,
                              [s.first_target - s.start for s in segments])


def test_wallclock_stamps_equal_calc_time_stamps():
    rng = np.random.default_rng(0)
    ns = rng.integers(-(10**18), 4 * 10**18, 5000)  # 1938..2096, leap years, before 1970
    expected = calc_time_stamps(pd.DatetimeIndex(ns.astype("datetime64[ns]"))).to_numpy(dtype=np.int64)
    assert np.array_equal(wallclock_stamps(ns), expected)


def test_npy_header_is_what_numpy_reads(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    (tmp_path / "a.npy").write_bytes(npy_header(a.dtype, a.shape) + a.tobytes())
    assert np.array_equal(np.load(tmp_path / "a.npy", mmap_mode="r"), a)


@pytest.mark.slow
def test_two_ranks_share_one_store_and_read_disjoint_windows(tmp_path):
    data = tmp_path / "csv"
    data.mkdir()
    for i in range(3):
        candles(120 + 7 * i, seed=i).to_csv(data / f"s{i}.csv", index=False)
    worker = Path(__file__).with_name("data_store_worker.py")

    def torchrun(out: Path) -> subprocess.CompletedProcess:
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker),
               str(data), str(tmp_path / "store"), str(out)]
        return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=180,
                              env=cpu_env(DIST_BACKEND="gloo", OMP_NUM_THREADS="1"))

    job = torchrun(tmp_path / "run1")
    assert job.returncode == 0, job.stderr[-3000:]
    r0, r1 = (np.load(tmp_path / "run1" / f"rank{r}.npz") for r in (0, 1))
    assert bool(r0["memmap"]) and bool(r1["memmap"])
    assert not bool(r0["reused"]) and str(r1["reason"]) == "prepared by the main process"
    for epoch in (0, 1):  # each epoch: disjoint halves that together cover every window (n is even here)
        n = int(r0["n_windows"])
        half = slice(epoch * (n // 2), (epoch + 1) * (n // 2))
        a, b = r0["indices"][half], r1["indices"][half]
        assert not set(a) & set(b) and len(set(a) | set(b)) == n - n % 2
    # what each rank read equals a single-process read of the same windows
    panel = open_store(tmp_path / "store")
    train = split_panel(panel, 0.6, 0.2, 0.2, Window(8, 4))["train"].dataset(Window(8, 4))
    for r in (r0, r1):
        assert np.array_equal(train.get_batch(r["indices"])[0].numpy(), r["x"])

    # a bad file makes rank 0 fail; rank 1 gets an error instead of waiting forever or reading a stale store
    (data / "s1.csv").write_text("timestamps,open,high,low,close\n2024-01-01,1,2,x,1\n")
    job = torchrun(tmp_path / "run2")
    assert "non-numeric" in (tmp_path / "run2" / "rank0.err").read_text()
    assert "did not leave a matching data store" in (tmp_path / "run2" / "rank1.err").read_text()


@pytest.mark.parametrize("where", ["append", "finish"])
def test_a_full_disk_while_writing_the_store_is_one_line_naming_the_folder(tmp_path, monkeypatch, capsys, where):
    import errno

    from finetune.utils import store as store_module
    from finetune.utils.errors import run_main

    candles(40).to_csv(tmp_path / "a.csv", index=False)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.GrowingNpy, where, full)
    with pytest.raises(StoreError) as err:
        prepare_store(tmp_path / "a.csv", tmp_path / "out" / "store")
    assert str(err.value).startswith(f"cannot write the data store in {tmp_path / 'out'}: no space left on device")
    assert "data.store_dir / data.dataset_path" in str(err.value) and "\n" not in str(err.value)
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written
    monkeypatch.delenv("KRONOS_DEBUG", raising=False)
    write = lambda argv=None: prepare_store(tmp_path / "a.csv", tmp_path / "out" / "store")  # noqa: E731
    assert run_main(write) == StoreError.exit_code
    assert "Traceback" not in capsys.readouterr().err
