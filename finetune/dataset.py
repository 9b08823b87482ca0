"""The preprocessed Qlib splits on disk (`load_split`, `save_split`; layout in docs/CONTRACTS.md, "File formats:
the preprocessed Qlib splits") and `QlibPipeline`, the data side of the engine's stage runner that the two trainer
scripts run under torchrun."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from finetune.config import QlibConfig, check_model_folder, cli_parser, load
from finetune.qlib_io import date_range
from finetune.utils.cli_args import add_run_flags, parse_config_args, run_overrides
from finetune.utils.config_utils import Problems, get_dotted
from finetune.utils.distributed import DistInfo, require_torchrun
from finetune.utils.errors import StoreError, setup_logging
from finetune.utils.fingerprint import digest, tree_sha256
from finetune.utils.stages import plan_stages, run_stages
from finetune.utils.store import SeriesPanel, open_store, write_panel
from finetune.utils.windows import WindowDataset
from model.errors import DataError
from model.features import FEATURES
from model.fileio import read_json_object

log = logging.getLogger("finetune.qlib")

SPLITS = ("train", "val", "test")
MANIFEST_NAME = "manifest.json"
# v3: one memory-mappable store per split (v2: .npz), series cut at gaps and membership spells, calendar_ns;
# v4: content_sha256 identifies the splits (the source path is no longer compared)
FORMAT = "kronos-qlib-splits/v4"


def split_path(dataset_path: str | Path, split: str) -> Path:
    """The store folder of one split."""
    return Path(dataset_path).expanduser() / split


def save_split(path: str | Path, split: SeriesPanel) -> Path:
    """Write one split (a panel with datetimes) as a prepared data store (finetune/utils/store.py, the writer the
    CSV pipeline uses too). `path` must not exist yet (the caller writes into a fresh folder)."""
    write_panel(path, split, list(FEATURES), source="qlib_data_preprocess.py")
    return Path(path)


def load_split(path: str | Path) -> SeriesPanel:
    """Open a split written by `save_split` as a SeriesPanel of read-only memory maps (no copy)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} not found: run `python finetune/qlib_data_preprocess.py --config ...` "
                                "first (data.dataset_path)")
    try:
        panel = open_store(path, verify=True)  # a damaged split is named, never trained on
    except (StoreError, OSError, KeyError) as e:
        raise DataError(f"{path}: not a readable split ({e}); rerun the preprocessing") from None
    if panel.n_features != len(FEATURES):
        raise DataError(f"{path}: features must be ({len(FEATURES)}, N), got {panel.features.shape}; rerun the "
                        "preprocessing")
    return panel


def content_sha256(dataset_path: str | Path) -> str:
    """The identity of the splits in `dataset_path`: sha256 of every split's array sha256s (its store manifest's
    `checksums`, which `load_split` verifies against the arrays). Same content, same hash, wherever it lies."""
    sums = {s: read_manifest(split_path(dataset_path, s)).get("checksums") for s in SPLITS
            if (split_path(dataset_path, s) / MANIFEST_NAME).is_file()}
    return digest(sums)


def read_manifest(dataset_path: str | Path) -> dict[str, Any]:
    return read_json_object(Path(dataset_path).expanduser() / MANIFEST_NAME, "a splits manifest")


def manifest_settings(cfg: QlibConfig) -> dict[str, Any]:
    """The settings recorded in manifest.json that the splits depend on (compared by `check_processed`): changing
    any of them after preprocessing means preprocessing again."""
    d = cfg.data
    source = Path(os.path.expanduser(d.qlib_data_path)).resolve()
    # The source's content at this frequency (calendar, universes, feature files): rebuilt in place, it is noticed
    # (None once it is gone: the splits alone are then what the trainers read).
    qlib_files = lambda name: name.startswith(("calendars/", "instruments/")) or (  # noqa: E731
        name.startswith("features/") and name.endswith(f".{d.freq}.bin"))
    content = tree_sha256(source, qlib_files) if source.is_dir() else None
    return {"qlib_data_path": str(source), "qlib_data_content": content,
            **{k: getattr(d, k) for k in ("instrument", "freq", "lookback", "predict", "amount_source")},
            **{k: list(getattr(d, k)) for k in ("train_time_range", "val_time_range", "test_time_range")},
            "max_gap_days": d.max_gap_days, "features": list(FEATURES)}


def check_processed(cfg: QlibConfig, splits: tuple[str, ...], problems: Problems) -> None:
    """Record a problem (naming data.dataset_path or the changed setting) unless the splits exist and were made
    with the current settings (a different lookback, range or universe would silently mix two setups)."""
    folder = Path(cfg.data.dataset_path).expanduser()
    fix = "run `python finetune/qlib_data_preprocess.py` with this config first"
    missing = [MANIFEST_NAME] if not (folder / MANIFEST_NAME).is_file() else [
        f"{s}/" for s in splits if not (split_path(folder, s) / MANIFEST_NAME).is_file()]
    if missing:
        problems.add("data.dataset_path", f"{folder} lacks {', '.join(missing)}; {fix}")
        return
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as e:
        problems.add("data.dataset_path", f"{folder / MANIFEST_NAME} is unreadable ({e}); {fix}")
        return
    if manifest.get("format") != FORMAT:
        problems.add("data.dataset_path", f"{folder} holds splits of format {manifest.get('format')!r}, not "
                     f"{FORMAT!r}; {fix}")
        return
    if manifest.get("content_sha256") != content_sha256(folder):
        problems.add("data.dataset_path", f"the splits in {folder} are not the ones its {MANIFEST_NAME} was written "
                     f"with (their content hash differs: a split replaced or copied in from elsewhere?); {fix}")
        return
    made_with = manifest.get("settings", {})
    for key, now in manifest_settings(cfg).items():
        if key == "qlib_data_content" and None not in (made_with.get(key), now) and made_with[key] != now:
            problems.add("data.qlib_data_path", f"its content changed since the splits in {folder} were made from it "
                         f"(sha256 {made_with[key][:12]} -> {now[:12]}: the store was rebuilt or edited); {fix}")
        elif key not in ("qlib_data_path", "qlib_data_content") and key in made_with and made_with[key] != now:
            problems.add(f"data.{key}", f"is {now!r} but the splits in {folder} were made with {made_with[key]!r}; "
                         f"{fix}")


def build_window_dataset(split: SeriesPanel, cfg: QlibConfig, name: str) -> WindowDataset:
    """Every window of lookback + predict bars inside each instrument of `split`, as the shared WindowDataset.
    Instruments too short for one window are logged (never dropped silently); no window at all is a DataError."""
    d = cfg.data
    if split.n_series == 0:
        raise DataError(f"data.{name}_time_range: the {name} split holds no instrument; widen the range and "
                        "preprocess again")
    try:
        ds = WindowDataset(split, d.window)
    except ValueError as e:
        raise DataError(f"data.{name}_time_range: the {name} split has no window ({e})") from None
    if ds.short_series:
        shown = ", ".join(f"{n} ({rows} bars)" for n, rows in ds.short_series[:10])
        more = f" and {len(ds.short_series) - 10} more" if len(ds.short_series) > 10 else ""
        log.info("[%s] %d instrument(s) shorter than one window of %d bars give no window: %s%s",
                 name, len(ds.short_series), d.window.size, shown, more)
    log.info("[%s] %d instruments, %d bars, %d windows", name, split.n_series, split.n_rows, len(ds))
    return ds


def build_train_val_datasets(cfg: QlibConfig) -> tuple[WindowDataset, WindowDataset, dict[str, Any]]:
    """(train_set, val_set, data_info for run_info.json) from the files in data.dataset_path."""
    folder = Path(cfg.data.dataset_path).expanduser()
    manifest = read_manifest(folder)
    settings = {k: v for k, v in manifest.get("settings", {}).items() if k != "qlib_data_path"}
    # What defines the data (its fingerprint guards a resume): the content, never where it lies.
    sets, info = {}, {"content_sha256": manifest.get("content_sha256"), "settings": settings, "splits": {}}
    for name in ("train", "val"):
        split = load_split(split_path(folder, name))
        sets[name] = build_window_dataset(split, cfg, name)
        dates = date_range(split)
        info["splits"][name] = {"instruments": split.n_series, "rows": split.n_rows, "windows": len(sets[name]),
                                "start": dates[0] if dates else None, "end": dates[1] if dates else None}
    return sets["train"], sets["val"], info


TOKENIZER_KEY = "paths.finetuned_tokenizer_path"


@dataclass(frozen=True)
class StageSpec:
    """One Qlib training stage: its name, script, and the model folders it reads."""

    stage: Literal["tokenizer", "predictor"]  # Engine stage; also the per-stage config section `<stage>_training`.
    script: str  # The script path, for the torchrun hint.
    # (dotted config key of a model folder/hub id the stage reads, whether a Hub id is allowed).
    model_folders: tuple[tuple[str, bool], ...]


class QlibPipeline:
    """The Qlib pipeline's side of the stage runner: the processed splits, the finetuned tokenizer the predictor
    trains with, and selection by validation RankIC (`training.select_by: ic`); no calibration."""

    def __init__(self, cfg: QlibConfig):
        self.cfg = cfg
        self.val_set = None

    def stage_dir(self, stage: str) -> Path:
        return Path(getattr(self.cfg.paths, f"{stage}_dir"))

    def output_key(self, stage: str) -> str:
        return f"paths.{stage}_dir"

    def datasets(self, dist: DistInfo) -> tuple:
        train_set, self.val_set, data_info = build_train_val_datasets(self.cfg)
        return train_set, self.val_set, data_info

    def tokenizer_source(self) -> tuple[str, str]:
        return self.cfg.paths.finetuned_tokenizer_path, TOKENIZER_KEY

    def val_metric(self, select_by: str, tokenizer):
        if select_by != "ic":
            return None
        from finetune.qlib_forecast import make_ic_val_metric  # choose the checkpoint by validation RankIC

        calendar_ns = np.asarray(read_manifest(self.cfg.data.dataset_path)["calendar_ns"], dtype=np.int64)
        return make_ic_val_metric(self.cfg, self.val_set.panel, tokenizer, calendar_ns)

    def calibrate(self, best: Path) -> None:  # the Qlib forecast reports no bands to calibrate
        return None


def check_inputs(spec: StageSpec, cfg: QlibConfig) -> None:
    """Every settings and input-file problem of the stage, raised as one ConfigError before anything starts."""
    problems = cfg.problems()
    check_processed(cfg, ("train", "val"), problems)
    for key, hub_ok in spec.model_folders:
        check_model_folder(get_dotted(cfg, key), key, problems, hub_ok=hub_ok)
    problems.raise_if_any()


def run_stage(spec: StageSpec, argv: list[str] | None = None, doc: str = "") -> None:
    """Parse, check every input before the process group starts, then train `spec.stage` under torchrun."""
    setup_logging()  # rank 0 reports; the other ranks only warn (torchrun sets RANK before the process starts)
    parser = add_run_flags(cli_parser(doc or spec.script))
    parser.add_argument("--skip-existing", action="store_true",
                        help="reuse a finished stage while it is current, else train it again (the walk-forward's "
                             "periods); without it a finished stage that is not current is refused by name")
    args = parse_config_args(parser, argv)
    require_torchrun(spec.script, args=f"--config {args.config}")
    cfg = load(args.config, list(args.set) + run_overrides(args))
    check_inputs(spec, cfg)
    pipe = QlibPipeline(cfg)
    run_stages(pipe, plan_stages(pipe, (spec.stage,), {}, args.skip_existing), rebuild_changed=args.skip_existing)
