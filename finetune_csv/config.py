"""Settings of the CSV finetuning pipeline: typed dataclasses filled from YAML (`load`, which also translates an
original Kronos `finetune_csv` file), validated up front into ONE ConfigError naming each key. The loading rules
and the sections shared with the Qlib pipeline: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from finetune.utils.config_utils import Problems, build_config, parse_date, read_yaml
from finetune.utils.schema import (
    ModelConfig,
    PipelineConfig,
    SamplingConfig,
    StageConfig,
    TrainingConfig,
    WindowSettings,
    warn_shadowed_overrides,
)
from finetune.utils.tune import TuneConfig
from finetune_csv.original_config import translate_original
from finetune_csv.timestamps import frequency_problem, timezone_problem
from model.errors import ConfigError
from model.features import FEATURES

NAN_POLICIES = ("error", "ffill", "drop")  # data.nan_policy (applied by finetune_csv/prepare.py `clean_series`)
BAD_CANDLE_POLICIES = ("error", "warn")  # data.bad_candles


@dataclass
class ColumnsConfig:
    """Which column of the user's CSV holds each field (user name -> our name; a number with data.header: none)."""

    timestamps: str | int = "timestamps"
    """Column with the bar's timestamp (anything pandas.to_datetime parses)."""
    open: str | int = "open"
    """Column with the opening price."""
    high: str | int = "high"
    """Column with the highest price."""
    low: str | int = "low"
    """Column with the lowest price."""
    close: str | int = "close"
    """Column with the closing price."""
    volume: str | int | None = "volume"
    """Column with the traded volume; null = the data has none (volume and amount become 0)."""
    amount: str | int | None = "amount"
    """Column with the traded amount (turnover); null = none (amount = volume * mean(open, high, low, close))."""
    factor: str | int | None = None
    """Column with a cumulative back-adjustment factor (Qlib's $factor; e.g. 0.25 before a 4:1 split, 1 after):
    open/high/low/close are multiplied by it and volume divided (amount kept); finite and > 0. null = none."""


@dataclass
class DataConfig(WindowSettings):
    """Where the candles come from and how they are cut into windows (finetune_csv/prepare.py applies it).

    Each field's docstring gives its policy; the README's Data / Splits / Checks paragraphs tell the whole story
    (nothing is skipped silently; every predicted row is its split's; parsed once into the store `store_dir`)."""

    path: str = ""
    """A CSV or Parquet file, or a folder of them (one series per file unless `symbol_column` is set)."""
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    """Column mapping: the name in your CSV of each field."""
    header: Literal["first_row", "none"] = "first_row"
    """CSV files: first_row = the first line names the columns; none = there is no header row (Lean, many vendor
    and exchange dumps): the columns are named by position, 0, 1, ..., for data.columns (e.g. timestamps: 0)."""
    symbol_column: str | None = None
    """Column whose values split a file into several series (e.g. a ticker column); null = one series per file."""
    adjust: Literal["none", "adj_close"] = "none"
    """adj_close: scale open/high/low by 'Adj Close' / close and train on the adjusted candles (a Yahoo export
    adjusts only its 'Adj Close' for splits and dividends); none: the prices as they are."""
    splits_path: str | None = None
    """A CSV of splits, columns symbol, date, ratio (4 or 4:1 = a 4:1 split, 0.125 or 1:8 = a 1:8 reverse split):
    each series' bars before the date are back-adjusted as by data.columns.factor (prices / ratio, volume x ratio);
    a series is matched by its symbol (data.symbol_column) or its file name without suffix. null = none."""
    timestamp_format: str | None = None
    """strftime format of the timestamps (e.g. '%Y/%m/%d %H:%M'); null = let pandas infer it."""
    timestamp_unit: Literal["s", "ms", "us", "ns"] | None = None
    """Unit of integer (epoch, UTC) timestamps such as an exchange's 1714521600000; null = read from their magnitude
    (1e9 s, 1e12 ms, 1e15 us, 1e18 ns); integers below 1e8 are dates such as 20240102."""
    lookback: int = 512
    """Context candles per window (the tokenizer/predictor input)."""
    predict: int = 48
    """Candles after the context in each window (what the predictor learns to forecast)."""
    clip: float = 5.0
    """Normalised values are clipped to [-clip, clip] (the published models use 5)."""
    train_ratio: float = 0.9
    """Share of each series' rows (oldest first) used for training."""
    val_ratio: float = 0.1
    """Share of each series' rows after the training part used for validation (must be > 0)."""
    test_ratio: float = 0.0
    """Share of each series' rows at the end held out for testing; train + val + test must be 1."""
    stride: int = 1
    """Distance in rows between the starts of consecutive windows (1 = every possible window)."""
    nan_policy: Literal["error", "ffill", "drop"] = "error"
    """What to do with NaN in price/volume columns: error | ffill | drop (see above)."""
    timezone: str | None = None
    """The exchange's IANA time zone; timestamps with a UTC offset are converted to it (null = keep their clock)."""
    frequency: str | None = None
    """Expected bar length, e.g. 5min, 1h, 1D: a file of another length is an error (null = infer, warn if mixed)."""
    store_dir: str | None = None
    """Folder of the prepared, memory-mapped data store (null = <paths.base_dir>/data_store; may be shared)."""
    split: str | None = None
    """by_date (every series cut at the same dates) | per_series (each by its own rows); null = by_date when the
    series overlap in time, else per_series."""
    train_end: str | None = None
    """by_date: first date of the validation period (e.g. 2015-01-01); null = from the ratios."""
    val_end: str | None = None
    """by_date with train_end: first date of the test period; null = no test split (validation runs to the end)."""
    bad_candles: str = "error"
    """A high below max(open, close) or a low above min(open, close): error | warn (train on them, warned)."""
    max_gap_days: int | None = None
    """Drop each series' bars before its last gap of more than this many calendar days (a series that stopped and
    restarted: no window joins bars across the gap); null = keep them (gaps of many bar spacings are warned)."""
    allow_zero_volume: bool = False
    """Allow a volume column that is zero in every row of a series (e.g. an index); false = an error."""


@dataclass
class CsvTrainingConfig(TrainingConfig):
    """Loop settings shared by both stages (`training:`; TrainingConfig documents every field). Only the defaults
    below differ from the engine's; per-stage values live in `tokenizer_training` / `predictor_training`."""

    num_workers: int = 0
    """DataLoader worker processes per rank; 0 loads in the training process (the CSV dataset is fast enough)."""


@dataclass
class PathsConfig:
    """Where outputs go; `{exp_name}` in a path is replaced by the experiment name."""

    exp_name: str = "kronos_csv"
    """Name of this experiment, substituted for {exp_name} in the paths below."""
    base_dir: str = "outputs/{exp_name}"
    """Folder for everything this run writes: tokenizer/, basemodel/ and the forecast."""


@dataclass
class ForecastConfig(SamplingConfig):
    """Held-out and future forecasts (finetune_csv/forecast.py, scripts/demo.sh): the shared sampling keys plus how
    the test split is cut into windows and scored."""

    window_stride: int | None = None
    """Rows between the starts of consecutive held-out windows; null = data.predict (every non-overlapping window)."""
    max_windows: int | None = None
    """Cap of held-out windows per series (evenly spread over its test split); null = every window (the default)."""
    season: int | None = None
    """Season of the seasonal-naive baseline in bars; null = inferred (bars per day intraday, 5 for daily bars)."""
    empirical_window: int = 250
    """Trailing bars whose realised data.predict-bar paths, rescaled to the last close, form the `empirical`
    baseline (taken from the whole series, beyond the lookback)."""
    repair_candles: bool = False
    """Repair sampled candles to valid ones (high = max(open, high, close), low = min(open, low, close))."""
    calibrate: bool = True
    """Fit a conformal calibration of the bands on the validation windows after training (stored in
    best_model/kronos_predictor.json) and apply it in forecasts."""
    calibration_method: str = "split"
    """split: the margins fitted on the validation windows, fixed; adaptive: tracked from there on every published
    outcome (model/adaptive.py: held-out windows replayed in time order, the end state kept for --future)."""
    per_series: bool = False
    """adaptive: one margin tracker per series (each needs its own test windows) instead of one shared."""
    ensemble_weight: float = 0.5
    """Share of the `ensemble` candidate's sample paths drawn from the finetuned model (the rest: zero-shot)."""
    compare_pretrained: bool = True
    """Also forecast the same windows with model.pretrained_predictor (zero-shot) and report the paired difference."""
    calendar: str | None = None
    """Trading days of --future forecasts: null = each series' trading calendar learned from its history
    (model.calendar); a CSV file whose first column lists the trading dates (e.g. the exchange's sessions)."""
    holidays: str | None = None
    """Holidays skipped by --future forecasts: a market of the `holidays` package (NYSE, XNYS, ...) or a country
    (US, GB, ...); needs the `calendars` extra. null = none: business-day forecasts say once that holidays are not
    skipped."""
    batch_size: int = 32
    """Windows per generation call (x sample_count sequences in memory at once)."""


WALK_FORWARD_CANDIDATES = ("zero_shot", "finetuned", "persistence", "empirical", "ensemble")


@dataclass
class WalkForwardConfig:
    """`kronos walk-forward` (finetune_csv/walk_forward.py): does finetuning pay over several out-of-sample periods?"""

    folds: int = 4
    """Consecutive test blocks, date ranges shared by all series, at the end; fold k trains on what precedes block k."""
    test_bars: int | None = None
    """Calendar bars (all series' bar times) per test block; null = 10% of the shortest series, in whole windows."""
    purge: int | None = None
    """Rows left out between the last training (and validation) target and the next block; null = data.predict
    (also the minimum: a target window of predict rows must end before the block starts)."""
    embargo: int = 0
    """Calendar bars left out after each fold's test block before the next one's (decorrelates the blocks)."""
    candidates: list[str] = field(default_factory=lambda: list(WALK_FORWARD_CANDIDATES))
    """Forecasters scored on every test window: zero_shot, finetuned, persistence, empirical, ensemble (the
    ensemble only where finetune_csv.forecast.ensemble_paths exists). zero_shot and finetuned are required."""


@dataclass
class CsvFinetuneConfig(PipelineConfig):
    """Everything the CSV pipeline needs; one YAML file fills it."""

    data: DataConfig = field(default_factory=DataConfig)
    """Input candles and windows."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Starting weights or architectures."""
    training: CsvTrainingConfig = field(default_factory=CsvTrainingConfig)
    """Loop settings shared by both stages."""
    tokenizer_training: StageConfig = field(default_factory=StageConfig)
    """Tokenizer-stage overrides (epochs, lr, batch_size, clip_grad_norm; null = inherit training:)."""
    predictor_training: StageConfig = field(default_factory=StageConfig)
    """Predictor-stage overrides (epochs, lr, batch_size, clip_grad_norm; null = inherit training:)."""
    paths: PathsConfig = field(default_factory=PathsConfig)
    """Output locations."""
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    """Held-out forecast settings."""
    walk_forward: WalkForwardConfig = field(default_factory=WalkForwardConfig)
    """Walk-forward evaluation (kronos walk-forward)."""
    tune: TuneConfig = field(default_factory=TuneConfig)
    """Settings search judged on the walk-forward's blocks (kronos tune)."""

    @property
    def base_dir(self) -> Path:
        """The run's output folder ({exp_name} is filled in when the YAML is loaded)."""
        return Path(self.paths.base_dir)

    @property
    def store_dir(self) -> Path:
        """Where the prepared data store lives: data.store_dir, or data_store/ inside the output folder."""
        return Path(self.data.store_dir) if self.data.store_dir else self.base_dir / "data_store"

    @property
    def tokenizer_dir(self) -> Path:
        return self.base_dir / "tokenizer"

    @property
    def predictor_dir(self) -> Path:
        """Output folder of the predictor stage (named basemodel/ as in the original pipeline)."""
        return self.base_dir / "basemodel"


def load(config_path: str | Path | None, overrides: Sequence[str] = (),
         values: Mapping[str, Any] | None = None) -> CsvFinetuneConfig:
    """Read the YAML file, apply `--set key=value` overrides, then typed `values` {dotted key: value} (from
    Python), and validate; one ConfigError lists every problem.

    A file in the original Kronos finetune_csv format is translated here (each mapped key logged once, see
    `original_config.translate`); `--set` items with original keys are applied before the translation, this
    project's after it. Warns about `--set training.X` overrides that a stage section shadows."""
    raw, overrides, original = translate_original(read_yaml(config_path), list(overrides or ()), config_path)
    source = None if config_path is None else str(config_path)
    try:
        cfg = build_config(CsvFinetuneConfig, raw, overrides, source, values)
        validate(cfg)  # errors first: a warning printed before them would push the useful line down
    except ConfigError as err:
        if not original:
            raise
        raise ConfigError(err.problems, f"Invalid configuration from {config_path} (original Kronos format, "
                                        "problems named with this project's keys)") from None
    warn_shadowed_overrides(cfg, [*overrides, *(f"{k}=" for k in values or {})])
    return cfg


def validate(cfg: CsvFinetuneConfig) -> None:
    """Check every setting; raise ONE ConfigError listing each problem with the YAML key to change."""
    problems = Problems("Invalid CSV finetuning configuration")
    _check_data(cfg.data, problems)
    cfg.model.check(problems, "model")
    cfg.check_training(problems, {"loss": "validation token loss", "crps": "forecast CRPS on validation windows"},
                       min_epochs=0)  # epochs 0 = skip the stage
    _check_paths(cfg.paths, problems)
    _check_forecast(cfg.forecast, problems)
    _check_walk_forward(cfg.walk_forward, cfg.data.predict, problems)
    problems.raise_if_any()


def check_data_settings(d: Mapping[str, Any], p: Problems) -> None:
    """The rules of the settings that say how files become series (data.columns, symbol_column, nan_policy,
    bad_candles, timezone, frequency), from `d` {setting: value} with `columns` a mapping {field: column}; checked by
    `validate` and by the data store (`StoreSettings.validate`) for callers that build its settings directly."""
    columns = d["columns"]
    known = ("timestamps", *FEATURES, "factor")
    for key in columns:
        p.check(key in known, f"data.columns.{key}", f"unknown field; the fields are {list(known)}")
    for name in known[:5]:
        p.check(columns.get(name) not in (None, ""), f"data.columns.{name}",
                f"is empty: name the CSV column holding {name}")
    p.check(not (columns.get("volume") is None and columns.get("amount") is not None), "data.columns.amount",
            "is set but data.columns.volume is null: amount without volume is not supported")
    mapped = [str(v) for v in columns.values() if v is not None]
    p.check(len(set(mapped)) == len(mapped), "data.columns", f"maps one CSV column to several fields: {mapped}")
    p.check(d["symbol_column"] is None or d["symbol_column"] not in mapped, "data.symbol_column",
            f"'{d['symbol_column']}' is also mapped in data.columns")
    p.check(d["nan_policy"] in NAN_POLICIES, "data.nan_policy",
            f"must be one of {', '.join(NAN_POLICIES)} (got '{d['nan_policy']}')")
    p.check(d["bad_candles"] in BAD_CANDLE_POLICIES, "data.bad_candles",
            f"must be error or warn, got {d['bad_candles']!r}")
    p.check(d.get("max_gap_days") is None or d["max_gap_days"] >= 1, "data.max_gap_days",
            f"must be >= 1 or null, got {d.get('max_gap_days')}")
    p.check(d.get("splits_path") is None or Path(d["splits_path"]).is_file(), "data.splits_path",
            f"{d.get('splits_path')!r} is not a file: give a CSV with columns symbol, date, ratio, or null")
    ways = [k for k, on in (("data.columns.factor", (d.get("columns") or {}).get("factor") is not None),
                            ("data.splits_path", d.get("splits_path") is not None),
                            ("data.adjust: adj_close", d.get("adjust") == "adj_close")) if on]
    p.check(len(ways) <= 1, ways[-1] if ways else "data.adjust",  # each would adjust the same splits again
            f"{' and '.join(ways)} both adjust the prices: keep one")
    for key, problem in (("data.timezone", timezone_problem(d["timezone"])),
                         ("data.frequency", frequency_problem(d["frequency"]))):
        p.check(problem is None, key, problem or "")


def _check_data(d: DataConfig, p: Problems) -> None:
    p.check(bool(d.path), "data.path", "is empty: set it to a CSV/Parquet file or a folder of them")
    check_data_settings({**vars(d), "columns": vars(d.columns)}, p)
    d.check_window(p)
    p.check(d.stride >= 1, "data.stride", f"must be >= 1 (got {d.stride})")
    p.check(0 < d.train_ratio < 1, "data.train_ratio", f"must be in (0, 1) (got {d.train_ratio})")
    p.check(0 < d.val_ratio < 1, "data.val_ratio",
            f"must be in (0, 1): the validation split selects the best checkpoint (got {d.val_ratio})")
    p.check(0 <= d.test_ratio < 1, "data.test_ratio", f"must be in [0, 1) (got {d.test_ratio})")
    total = d.train_ratio + d.val_ratio + d.test_ratio
    p.check(math.isclose(total, 1.0, abs_tol=1e-6), "data.train_ratio",
            f"data.train_ratio + data.val_ratio + data.test_ratio must be 1 (got {total:g})")
    p.check(d.split in (None, "by_date", "per_series"), "data.split",
            f"must be by_date, per_series or null (= by_date when the series overlap in time), got {d.split!r}")
    dates = {key: parse_date(getattr(d, key), f"data.{key}", p, "use YYYY-MM-DD, e.g. 2015-01-01")
             for key in ("train_end", "val_end") if getattr(d, key) is not None}
    if d.train_end is not None or d.val_end is not None:
        p.check(d.split != "per_series", "data.split", "per_series cuts by ratios: unset data.train_end / "
                "data.val_end, or set data.split: by_date")
        p.check(d.train_end is not None, "data.train_end", "is needed when data.val_end is set")
        if dates.get("train_end") is not None and dates.get("val_end") is not None:
            p.check(dates["train_end"] < dates["val_end"], "data.val_end",
                    f"must be after data.train_end ({d.train_end}), got {d.val_end}")


def _check_paths(paths: PathsConfig, p: Problems) -> None:
    p.check(bool(paths.exp_name) and not any(c in paths.exp_name for c in "/\\"), "paths.exp_name",
            f"must be a non-empty name without slashes (got '{paths.exp_name}')")
    p.check(bool(paths.base_dir), "paths.base_dir", "is empty: name the output folder, e.g. outputs/{exp_name}")


def _check_forecast(f: ForecastConfig, p: Problems) -> None:
    f.check(p, "forecast")
    for name, null in (("window_stride", " (= data.predict)"), ("max_windows", " (= every window)"), ("season", "")):
        value = getattr(f, name)
        p.check(value is None or value >= 1, f"forecast.{name}", f"must be >= 1 or null{null} (got {value})")
    p.check(f.calibration_method in ("split", "adaptive"), "forecast.calibration_method",
            f"must be split or adaptive (got {f.calibration_method!r})")
    p.check(f.empirical_window >= 2, "forecast.empirical_window", f"must be >= 2 (got {f.empirical_window})")
    p.check(0 <= f.ensemble_weight <= 1, "forecast.ensemble_weight", f"must be in [0, 1] (got {f.ensemble_weight})")
    p.check(f.batch_size >= 1, "forecast.batch_size", f"must be >= 1 (got {f.batch_size})")
    p.check(f.calendar is None or Path(f.calendar).is_file(), "forecast.calendar",
            f"'{f.calendar}' is not a file: give a CSV whose first column lists the trading dates, or null")


def _check_walk_forward(w: WalkForwardConfig, predict: int, p: Problems) -> None:
    p.check(w.folds >= 1, "walk_forward.folds", f"must be >= 1 (got {w.folds})")
    p.check(w.test_bars is None or w.test_bars >= predict, "walk_forward.test_bars",
            f"must be >= data.predict ({predict}) or null (got {w.test_bars})")
    p.check(w.purge is None or w.purge >= predict, "walk_forward.purge",
            f"must be >= data.predict ({predict}) or null (= data.predict): a shorter purge lets a training target "
            f"reach into the test block (got {w.purge})")
    p.check(w.embargo >= 0, "walk_forward.embargo", f"must be >= 0 (got {w.embargo})")
    unknown = [c for c in w.candidates if c not in WALK_FORWARD_CANDIDATES]
    p.check(not unknown, "walk_forward.candidates",
            f"unknown {unknown}; choose from {', '.join(WALK_FORWARD_CANDIDATES)}")
    p.check({"zero_shot", "finetuned"} <= set(w.candidates), "walk_forward.candidates",
            "must include zero_shot and finetuned (the paired comparison that decides)")


def best_dir(stage_dir: Path) -> Path:
    """Where a stage's best model (published format) lives: the training engine writes it to best_model/."""
    return Path(stage_dir) / "best_model"


