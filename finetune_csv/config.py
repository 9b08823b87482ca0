"""Settings of the CSV finetuning pipeline: typed dataclasses filled from YAML, validated up front.

A YAML file in configs/ fills `CsvFinetuneConfig`; `--set training.epochs=3`-style overrides are applied on top
(see `load`). `validate()` checks every setting at once and raises ONE ValueError listing each problem with
the YAML key to change, before any data is read or any folder is created. Keys shared with the Qlib pipeline
(model:, data.lookback / predict / clip, training:, the stage sections, the sampling keys of forecast:) have the
same names and defaults there (finetune/utils/factory.py, forecast_config.py, stage_config.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from finetune.utils.config_utils import Problems, load_config
from finetune.utils.data.candle_checks import frequency_problem, timezone_problem
from finetune.utils.factory import ModelConfig
from finetune.utils.forecast_config import SamplingConfig
from finetune.utils.stage_config import (
    StageConfig,
    apply_stage,
    validate_stage,
    warn_shadowed_overrides,
)
from finetune.utils.training_utils import TrainingConfig, validate_training_config

NAN_POLICIES = ("error", "ffill", "drop")


@dataclass
class ColumnsConfig:
    """Which column of the user's CSV holds each field (user name -> our name)."""

    timestamps: str = "timestamps"
    """Column with the bar's timestamp (anything pandas.to_datetime parses)."""
    open: str = "open"
    """Column with the opening price."""
    high: str = "high"
    """Column with the highest price."""
    low: str = "low"
    """Column with the lowest price."""
    close: str = "close"
    """Column with the closing price."""
    volume: str | None = "volume"
    """Column with the traded volume; null = the data has none (volume and amount become 0)."""
    amount: str | None = "amount"
    """Column with the traded amount (turnover); null = none (amount = volume * mean(open, high, low, close))."""


@dataclass
class DataConfig:
    """Where the candles come from and how they are cut into windows.

    Policies (also in the README):
    - unsorted timestamps inside a series are sorted (stable), with a warning naming the file;
    - duplicate timestamps inside a series are an error (which row is right cannot be guessed);
    - NaN in a price/volume column follows `nan_policy`: `error` (default) names file, column and row;
      `ffill` carries the last value forward (a NaN in the first row stays an error); `drop` removes the rows
      and warns how many. Nothing is skipped silently.
    - each series is split by time: the first `train_ratio` of its rows train, the next `val_ratio` validate,
      the rest test. A validation/test window may read the `lookback` rows before its split as context, so every
      row it predicts belongs to that split and no predicted row is shared between splits.
    - time: the model's time features (minute, hour, weekday, day, month) are the exchange's LOCAL wall-clock
      time. Timestamps without a UTC offset are taken as that time. Timestamps with an offset
      (`2024-03-08 09:30:00-05:00`, `...Z`, a tz-aware Parquet column) are converted to `timezone` when it is set
      (an IANA name such as America/New_York), otherwise each keeps the clock time it states; so a daylight-saving
      change inside a file (-05:00, then -04:00) still reads 09:30 every morning. Files with offsets and files
      without them cannot be mixed (an error names both kinds).
    - bar length: each file's is the median spacing of its stamps; files that differ from the rest are named in
      a warning, or are an error when `frequency` is set.
    - values beyond float32's range (|x| > 3.4e38) are an error naming file, column and line (the model computes
      in float32).
    - an unnamed first column (what DataFrame.to_csv writes for the index) is taken as the timestamps when the
      `columns.timestamps` column is missing and its first value reads as a date (a log line says so).
    - the files are parsed once into a prepared store (`store_dir`), memory-mapped by every process; a re-run with
      the same files (size + mtime, else sha256) and the same data settings reuses it, a change re-prepares it and
      the log says why.
    """

    path: str = ""
    """A CSV or Parquet file, or a folder of them (one series per file unless `symbol_column` is set)."""
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    """Column mapping: the name in your CSV of each field."""
    symbol_column: str | None = None
    """Column whose values split a file into several series (e.g. a ticker column); null = one series per file."""
    timestamp_format: str | None = None
    """strftime format of the timestamps (e.g. '%Y/%m/%d %H:%M'); null = let pandas infer it."""
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


@dataclass
class CsvTrainingConfig(TrainingConfig):
    """Loop settings shared by both stages (finetune.utils.training_utils.TrainingConfig documents every field).

    Per-stage values (epochs, lr, batch_size, clip_grad_norm) live in `tokenizer_training` / `predictor_training`
    and win over these. Only the defaults below differ from the shared engine's.
    """

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
    bootstrap_samples: int = 1000
    """Bootstrap resamples of the confidence intervals (0 = no intervals)."""
    bootstrap_block: int = 1
    """Bootstrap block length in consecutive windows (1 = windows resampled independently)."""
    compare_pretrained: bool = True
    """Also forecast the same windows with model.pretrained_predictor (zero-shot) and report the paired difference."""
    calendar: str | None = None
    """Trading days of --future forecasts: null = weekdays seen in the history; a CSV file whose first column lists
    the trading dates (e.g. the exchange's sessions). Intraday bar times are always taken from the history."""
    batch_size: int = 32
    """Windows per generation call (x sample_count sequences in memory at once)."""

@dataclass
class CsvFinetuneConfig:
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

    @property
    def base_dir(self) -> Path:
        """The run's output folder ({exp_name} is filled in when the YAML is loaded)."""
        return Path(self.paths.base_dir)

    def stage_training(self, stage: Literal["tokenizer", "predictor"]) -> TrainingConfig:
        """The engine's settings for `stage`: `training:` with the stage's non-null overrides applied."""
        return apply_stage(self.training, getattr(self, f"{stage}_training"))

    @property
    def store_dir(self) -> Path:
        """Where the prepared data store lives: data.store_dir, or data_store/ inside the output folder."""
        return Path(self.data.store_dir) if self.data.store_dir else self.base_dir / "data_store"

    @property
    def tokenizer_dir(self) -> Path:
        """Output folder of the tokenizer stage."""
        return self.base_dir / "tokenizer"

    @property
    def predictor_dir(self) -> Path:
        """Output folder of the predictor stage (named basemodel/ as in the original pipeline)."""
        return self.base_dir / "basemodel"


def load(config_path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> CsvFinetuneConfig:
    """Read the YAML file, apply `--set key=value` overrides and validate; one ValueError lists every problem.
    Warns about `--set training.X` overrides that a stage section shadows."""
    cfg = load_config(CsvFinetuneConfig, config_path, overrides)
    validate(cfg)  # errors first: a warning printed before them would push the useful line down
    warn_shadowed_overrides(cfg, overrides)
    return cfg


def validate(cfg: CsvFinetuneConfig) -> None:
    """Check every setting; raise ONE ValueError (ConfigError) listing each problem with the YAML key to change."""
    problems = Problems("Invalid CSV finetuning configuration")
    _check_data(cfg.data, problems)
    cfg.model.check(problems, "model")
    _check_training(cfg, problems)
    _check_paths(cfg.paths, problems)
    _check_forecast(cfg.forecast, problems)
    problems.raise_if_any()


def _check_data(d: DataConfig, p: Problems) -> None:
    p.check(bool(d.path), "data.path", "is empty: set it to a CSV/Parquet file or a folder of them")
    for key, problem in (("data.timezone", timezone_problem(d.timezone)),
                         ("data.frequency", frequency_problem(d.frequency))):
        p.check(problem is None, key, problem or "")
    for name in ("timestamps", "open", "high", "low", "close"):
        p.check(bool(getattr(d.columns, name)), f"data.columns.{name}", f"is empty: name the CSV column holding {name}")
    p.check(not (d.columns.volume is None and d.columns.amount is not None), "data.columns.amount",
            "is set but data.columns.volume is null: amount without volume is not supported")
    mapped = [v for v in vars(d.columns).values() if v]
    p.check(len(set(mapped)) == len(mapped), "data.columns", f"maps one CSV column to several fields: {mapped}")
    p.check(d.symbol_column is None or d.symbol_column not in mapped, "data.symbol_column",
            f"'{d.symbol_column}' is also mapped in data.columns")
    p.check(d.lookback >= 1, "data.lookback", f"must be >= 1 (got {d.lookback})")
    p.check(d.predict >= 1, "data.predict", f"must be >= 1 (got {d.predict})")
    p.check(d.clip > 0, "data.clip", f"must be > 0 (got {d.clip})")
    p.check(d.stride >= 1, "data.stride", f"must be >= 1 (got {d.stride})")
    p.check(0 < d.train_ratio < 1, "data.train_ratio", f"must be in (0, 1) (got {d.train_ratio})")
    p.check(0 < d.val_ratio < 1, "data.val_ratio",
            f"must be in (0, 1): the validation split selects the best checkpoint (got {d.val_ratio})")
    p.check(0 <= d.test_ratio < 1, "data.test_ratio", f"must be in [0, 1) (got {d.test_ratio})")
    total = d.train_ratio + d.val_ratio + d.test_ratio
    p.check(math.isclose(total, 1.0, abs_tol=1e-6), "data.train_ratio",
            f"data.train_ratio + data.val_ratio + data.test_ratio must be 1 (got {total:g})")
    p.check(d.nan_policy in NAN_POLICIES, "data.nan_policy",
            f"must be one of {', '.join(NAN_POLICIES)} (got '{d.nan_policy}')")


def _check_training(cfg: CsvFinetuneConfig, p: Problems) -> None:
    validate_training_config(cfg.training, p, prefix="training")
    p.check(cfg.training.select_by in ("loss", "crps"), "training.select_by",
            f"must be 'loss' (validation token loss) or 'crps' (forecast CRPS on validation windows), "
            f"got {cfg.training.select_by!r}")
    for key in ("tokenizer_training", "predictor_training"):
        validate_stage(getattr(cfg, key), key, p, min_epochs=0)  # epochs 0 = skip the stage


def _check_paths(paths: PathsConfig, p: Problems) -> None:
    p.check(bool(paths.exp_name) and not any(c in paths.exp_name for c in "/\\"), "paths.exp_name",
            f"must be a non-empty name without slashes (got '{paths.exp_name}')")
    p.check(bool(paths.base_dir), "paths.base_dir", "is empty: name the output folder, e.g. outputs/{exp_name}")


def _check_forecast(f: ForecastConfig, p: Problems) -> None:
    f.check(p, "forecast")
    p.check(f.window_stride is None or f.window_stride >= 1, "forecast.window_stride",
            f"must be >= 1 or null (= data.predict) (got {f.window_stride})")
    p.check(f.max_windows is None or f.max_windows >= 1, "forecast.max_windows",
            f"must be >= 1 or null (= every window) (got {f.max_windows})")
    p.check(f.season is None or f.season >= 1, "forecast.season", f"must be >= 1 or null (got {f.season})")
    p.check(f.bootstrap_samples >= 0, "forecast.bootstrap_samples", f"must be >= 0 (got {f.bootstrap_samples})")
    p.check(f.bootstrap_block >= 1, "forecast.bootstrap_block", f"must be >= 1 (got {f.bootstrap_block})")
    p.check(f.batch_size >= 1, "forecast.batch_size", f"must be >= 1 (got {f.batch_size})")
    p.check(f.calendar is None or Path(f.calendar).is_file(), "forecast.calendar",
            f"'{f.calendar}' is not a file: give a CSV whose first column lists the trading dates, or null")
