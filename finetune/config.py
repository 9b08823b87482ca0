"""Settings of the Qlib pipeline (preprocess -> tokenizer -> predictor -> backtest), one typed dataclass per section;
`load(path, overrides)` raises one ConfigError listing every problem by its YAML key. Defaults and the one deliberate
change from the original Kronos Qlib recipe: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from finetune.utils.cli_args import add_config_args
from finetune.utils.config_utils import Problems, load_config, parse_date
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

# Signals from a forecast of `predict` closes: predicted return of the last / mean / max / min close
# relative to the last observed close.
SIGNALS = ("last", "mean", "max", "min")
# Benchmark index of each Qlib universe (CN as in the original config; US as in Qlib's us_data).
DEFAULT_BENCHMARKS = {"csi300": "SH000300", "csi500": "SH000905", "csi800": "SH000906", "csi1000": "SH000852",
                      "sp500": "^gspc", "nasdaq100": "^ndx"}


@dataclass
class DataConfig(WindowSettings):
    """Where the Qlib data is, which instruments and dates, and how windows are cut (`data:` in YAML)."""

    qlib_data_path: str = "~/.qlib/qlib_data/cn_data"
    """Qlib provider folder (holds calendars/, instruments/, features/)."""
    region: Literal["cn", "us"] = "cn"
    """Qlib region passed to qlib.init (trading rules such as the A-share price limits)."""
    freq: str = "day"
    """Qlib frequency of the bars: 'day' (calendars/day.txt) or e.g. '1min'."""
    instrument: str = "csi300"
    """Universe: the name of a file instruments/<name>.txt in the provider folder (csi300, csi500, all, ...)."""
    dataset_begin_time: str = "2011-01-01"
    """First date loaded; together with dataset_end_time it must contain the three ranges below."""
    dataset_end_time: str = "2025-06-05"
    """Last date loaded."""
    train_time_range: list[str] = field(default_factory=lambda: ["2011-01-01", "2022-12-31"])
    """[start, end] of the training split (inclusive dates); every bar of a training window lies inside it."""
    val_time_range: list[str] = field(default_factory=lambda: ["2023-01-01", "2024-06-30"])
    """[start, end] of the validation split; its windows also read the lookback bars before start."""
    test_time_range: list[str] = field(default_factory=lambda: ["2024-07-01", "2025-06-05"])
    """[start, end] of the test split: one forecast per instrument and trading day in it (the backtest period)."""
    lookback: int = 90
    """Bars of context per window (the normalisation statistics come from these only)."""
    predict: int = 10
    """Bars forecast after the context."""
    max_context: int = 512
    """Predictor context length (512 for Kronos-small/base); lookback + predict must fit in it."""
    amount_source: Literal["ohlc_mean", "vwap"] = "ohlc_mean"
    """amount = $volume * mean(open, high, low, close) (the original's choice, and what the forecaster assumes
    when a series has no amount) or $volume * $vwap. The features are model.features.FEATURES."""
    clip: float = 5.0
    """Normalised values are clipped to [-clip, clip]."""
    max_gap_days: int = 5
    """A stock's history is cut into separate series where more than this many of its trading days in a row are
    missing (suspended or absent): no window, context or label ever joins bars across such a gap."""
    dataset_path: str = "./data/processed_datasets"
    """Folder for the preprocessed splits (train/, val/, test/ memory-mappable stores, manifest.json)."""


@dataclass
class QlibTrainingConfig(TrainingConfig):
    """Loop settings shared by both stages (`training:`; TrainingConfig documents every field). Only the defaults
    below differ from the engine's; per-stage values live in `tokenizer_training` / `predictor_training`."""

    max_train_samples: int | None = 100_000
    """Windows drawn per training epoch (original n_train_iter = 2000 * batch_size 50); null = all."""
    max_val_samples: int | None = 20_000
    """Windows drawn per validation (original n_val_iter = 400 * batch_size 50); null = all."""


@dataclass
class PathsConfig:
    """Where the stages write (`paths:` in YAML); `{name}` refers to another field of this section."""

    save_path: str = "./outputs/models"
    """Base folder of the trained models."""
    tokenizer_dir: str = "{save_path}/finetune_tokenizer"
    """Tokenizer stage output: best_model/, checkpoints/last.pt, metrics.jsonl, loss_curve.png, run_info.json."""
    predictor_dir: str = "{save_path}/finetune_predictor"
    """Predictor stage output (same layout)."""
    finetuned_tokenizer_path: str = "{tokenizer_dir}/best_model"
    """Tokenizer the predictor stage and the backtest use (a save_pretrained folder)."""
    finetuned_predictor_path: str = "{predictor_dir}/best_model"
    """Predictor the backtest uses."""
    backtest_result_path: str = "./outputs/backtest_results"
    """Folder for report.json, signals.csv, ic_daily.csv, ic_decay.csv/.png, backtest_daily.csv, positions.csv and
    cumulative_return.png."""


@dataclass
class ForecastConfig(SamplingConfig):
    """How test windows are forecast (`forecast:` in YAML): the shared sampling keys plus the batch size."""

    batch_size: int = 1000
    """Sequences per forward pass (windows x sample_count), as the original's backtest_batch_size."""
    seeds: list[int] | None = None
    """Repeat the test forecast once per seed (e.g. [0, 1, 2]) and report the mean and spread of IC and excess
    return across them; null = one forecast with `seed`."""

    def seed_list(self) -> list[int]:
        """The seeds the test forecast runs with."""
        return list(self.seeds) if self.seeds else [self.seed]


@dataclass
class BacktestConfig:
    """Signals, IC and Qlib's TopkDropoutStrategy backtest (`backtest:` in YAML).

    Defaults are the ORIGINAL KRONOS example's, kept so results stay comparable with it; Qlib's benchmark workflows
    (e.g. LightGBM on Alpha158, CSI300) differ where noted per field: deal_price close, open_cost 0.0005,
    hold_thresh 1. Same as Qlib's: topk 50, n_drop 5, close_cost 0.0015, min_cost 5, limit_threshold 0.095,
    benchmark SH000300 for csi300. Qlib's workflows start with 1e8 of cash, as here. See docs/qlib_evaluation.md."""

    benchmark: str = ""
    """Benchmark instrument; empty = the universe's index (csi300 -> SH000300, csi800 -> SH000906, ...)."""
    signals: list[str] = field(default_factory=lambda: list(SIGNALS))
    """Signals to evaluate and backtest, among last, mean, max, min."""
    topk: int = 50
    """Stocks held (original backtest_n_symbol_hold; Qlib's workflows: 50 too)."""
    n_drop: int = 5
    """Stocks swapped per day (original backtest_n_symbol_drop; Qlib's workflows: 5 too)."""
    hold_thresh: int = 5
    """Minimum days a stock is held before it may be sold (original 5; Qlib's default 1)."""
    account: float = 100_000_000
    """Initial cash (Qlib's workflows: 1e8 too)."""
    deal_price: Literal["open", "close", "vwap"] = "open"
    """Price the orders fill at: the score of day t trades on day t+1 (original open; Qlib's workflows close).
    The IC labels follow it: price(t+1+h) / price(t+1) - 1."""
    open_cost: float = 0.001
    """Cost rate of buying (original 0.001; Qlib's workflows 0.0005)."""
    close_cost: float = 0.0015
    """Cost rate of selling (original and Qlib: 0.0015)."""
    min_cost: float = 5.0
    """Minimum cost per order (original and Qlib: 5)."""
    limit_threshold: float | None = 0.095
    """Daily price limit: no buying at limit-up / selling at limit-down (null = no limit; Qlib: 0.095 too)."""
    baselines: bool = True
    """Also score and backtest the momentum and short-term reversal signals over the same days."""
    momentum_window: int = 20
    """Momentum baseline: close(t) / close(t - momentum_window) - 1."""
    reversal_window: int = 5
    """Reversal baseline: close(t - reversal_window) / close(t) - 1."""
    quantile: float = 0.2
    """Share of stocks in each leg of the long-short return (Qlib's calc_long_short_return default)."""


@dataclass
class WalkForwardConfig:
    """Rolling retrains over consecutive out-of-sample periods (`walk_forward:`, run by `kronos qlib-walk-forward`):
    each period is trained only on data before it, and its finetuned and zero-shot signals are scored out of
    sample."""

    test_range: list[str] | None = None
    """[start, end] of the out-of-sample span, cut into consecutive periods; null = data.test_time_range."""
    period_months: int = 6
    """Length of each test period in calendar months (6 = half-years; the last one may be shorter)."""
    val_months: int = 6
    """Validation block before each test period (picks the checkpoint); training takes everything before it."""
    purge: int | None = None
    """Trading days left out between the last training target and the validation block, and between the last
    validation target and the period's first signal; null = data.predict (also the minimum)."""
    signal: Literal["last", "mean", "max", "min"] = "last"
    """Signal of the verdict: its daily IC at its own horizon, finetuned minus zero-shot."""
    block_days: int = 10
    """Trading days over which daily IC differences are taken as dependent (at least the signal's horizon: ICs of
    overlapping labels are correlated); the verdict's HAC variance spans them (finetune/evaluation/statistics.py)."""
    nproc_per_node: int = 1
    """Training processes per stage (torchrun --nproc_per_node; e.g. the number of GPUs)."""


@dataclass
class QlibConfig(PipelineConfig):
    """Every setting of the Qlib pipeline."""

    data: DataConfig = field(default_factory=DataConfig)
    """Qlib data, universe, date ranges, windows."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Pretrained or from-scratch models."""
    training: QlibTrainingConfig = field(default_factory=QlibTrainingConfig)
    """Training loop settings shared by both stages."""
    tokenizer_training: StageConfig = field(default_factory=StageConfig)
    """Tokenizer-stage overrides of training (null = inherit)."""
    predictor_training: StageConfig = field(default_factory=StageConfig)
    """Predictor-stage overrides of training (null = inherit)."""
    paths: PathsConfig = field(default_factory=PathsConfig)
    """Output folders."""
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    """Sampling of the test forecasts."""
    backtest: BacktestConfig = field(default_factory=BacktestConfig)
    """Signals, IC and backtest."""
    walk_forward: WalkForwardConfig = field(default_factory=WalkForwardConfig)
    """Rolling retrains and the out-of-sample verdict (kronos qlib-walk-forward)."""
    tune: TuneConfig = field(default_factory=TuneConfig)
    """Settings search judged on the walk-forward's periods (kronos qlib-tune)."""

    @property
    def benchmark(self) -> str:
        """The benchmark instrument actually used ('' when none is configured and the universe has no default)."""
        return self.backtest.benchmark or DEFAULT_BENCHMARKS.get(self.data.instrument, "")

    def problems(self) -> Problems:
        """Every problem of the settings themselves (no file access), each named by its YAML key."""
        p = Problems()
        _check_data(self.data, p)
        self.model.check(p, "model")
        self.check_training(p, {"loss": "validation token loss", "ic": "RankIC of validation forecasts"})
        _check_forecast(self.forecast, p)
        _check_backtest(self, p)
        _check_walk_forward(self, p)
        return p

    def validate(self) -> None:
        """Raise one ConfigError (a ValueError) listing every problem; nothing when the settings are consistent."""
        self.problems().raise_if_any()


def load(yaml_path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> QlibConfig:
    """QlibConfig from a YAML file and `key=value` overrides, validated: one ConfigError (a ValueError) lists every
    problem by YAML key. Warns about `--set training.X` overrides that a stage section shadows."""
    cfg = load_config(QlibConfig, yaml_path, overrides)
    cfg.validate()  # errors first: a warning printed before them would push the useful line down
    warn_shadowed_overrides(cfg, overrides)
    return cfg


# checks (pure: settings only)

def parse_range(value: Any, key: str, problems: Problems) -> tuple[pd.Timestamp, pd.Timestamp] | None:
    """(start, end) of a `[start, end]` setting with start <= end, or None after recording the problem."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        problems.add(key, f"expected [start, end] dates, got {value!r}")
        return None
    start, end = parse_date(value[0], f"{key}[0]", problems), parse_date(value[1], f"{key}[1]", problems)
    if start is None or end is None:
        return None
    if start > end:
        problems.add(key, f"is empty: start {value[0]} is after end {value[1]}")
        return None
    return start, end


def _check_data(d: DataConfig, p: Problems) -> None:
    p.check(bool(str(d.qlib_data_path).strip()), "data.qlib_data_path", "is empty; set it to your Qlib data folder")
    p.check(bool(d.instrument.strip()), "data.instrument", "is empty; name a universe such as csi300")
    p.check(bool(d.freq.strip()), "data.freq", "is empty; use 'day' for daily bars")
    d.check_window(p)
    p.check(d.max_context >= 3, "data.max_context", f"must be >= 3 (2 bars of context, the fewest a forecast "
            f"normalises over, + 1 forecast), got {d.max_context}; the published models use 512")
    p.check(d.window.size <= d.max_context or d.max_context < 3, "data.lookback", f"lookback + predict = "
            f"{d.window.size} does not fit in data.max_context = {d.max_context}; shorten the windows")
    p.check(d.max_gap_days >= 0, "data.max_gap_days", f"must be >= 0, got {d.max_gap_days}")
    p.check(bool(str(d.dataset_path).strip()), "data.dataset_path", "is empty; name a folder for the splits")

    begin = parse_date(d.dataset_begin_time, "data.dataset_begin_time", p)
    end = parse_date(d.dataset_end_time, "data.dataset_end_time", p)
    if begin is not None and end is not None and begin > end:
        p.add("data.dataset_end_time", f"{d.dataset_end_time} is before dataset_begin_time {d.dataset_begin_time}")
        begin = end = None
    ranges = {name: parse_range(getattr(d, name), f"data.{name}", p)
              for name in ("train_time_range", "val_time_range", "test_time_range")}
    for name, r in ranges.items():
        if r is None or begin is None or end is None:
            continue
        if r[0] < begin or r[1] > end:
            p.add(f"data.{name}", f"{[str(x.date()) for x in r]} is not inside dataset_begin_time..dataset_end_time "
                                  f"({d.dataset_begin_time}..{d.dataset_end_time}); widen the dataset range or move "
                                  "this range")
    order = list(ranges.items())
    for i, (a_name, a) in enumerate(order):
        for b_name, b in order[i + 1 :]:
            if a is not None and b is not None and b[0] <= a[1]:
                p.add(f"data.{b_name}", f"starts on {b[0].date()}, not after {a_name} ends ({a[1].date()}); the "
                                        "ranges must not overlap (the lookback bars before each range are added "
                                        "automatically)")


def _check_forecast(f: ForecastConfig, p: Problems) -> None:
    f.check(p, "forecast")
    if f.seeds is not None:
        p.check(len(f.seeds) >= 1 and len(set(f.seeds)) == len(f.seeds), "forecast.seeds",
                f"must list distinct seeds (or be null), got {f.seeds}")
    p.check(f.batch_size >= f.sample_count, "forecast.batch_size", f"must be >= forecast.sample_count "
            f"({f.sample_count}): one window's samples share a batch, got {f.batch_size}")


def _check_walk_forward(cfg: QlibConfig, p: Problems) -> None:
    w = cfg.walk_forward
    if w.test_range is not None:
        r = parse_range(w.test_range, "walk_forward.test_range", p)
        end = parse_date(cfg.data.dataset_end_time, "data.dataset_end_time", Problems())
        if r is not None and end is not None:
            p.check(r[1] <= end, "walk_forward.test_range",
                    f"ends after data.dataset_end_time ({cfg.data.dataset_end_time}); widen the dataset range")
    for name in ("period_months", "val_months", "block_days", "nproc_per_node"):
        p.check(getattr(w, name) >= 1, f"walk_forward.{name}", f"must be >= 1, got {getattr(w, name)}")
    p.check(w.purge is None or w.purge >= cfg.data.predict, "walk_forward.purge",
            f"must be >= data.predict ({cfg.data.predict}) so no training target reaches the next block, got {w.purge}")


def _check_backtest(cfg: QlibConfig, p: Problems) -> None:
    b = cfg.backtest
    p.check(bool(cfg.benchmark), "backtest.benchmark", f"no default benchmark for universe "
            f"{cfg.data.instrument!r} (known: {DEFAULT_BENCHMARKS}); set it, e.g. SH000300")
    unknown = [s for s in b.signals if s not in SIGNALS]
    p.check(not unknown, "backtest.signals", f"unknown {unknown}; choose among {list(SIGNALS)}")
    p.check(bool(b.signals), "backtest.signals", f"is empty; choose among {list(SIGNALS)}")
    p.check(1 <= b.n_drop <= b.topk, "backtest.n_drop", f"must be in [1, topk={b.topk}], got {b.n_drop}" + (
        " (Qlib's TopkDropoutStrategy reads 0 as 'drop all': the whole portfolio sold every day)" if b.n_drop == 0
        else ""))
    p.check(b.account > 0, "backtest.account", f"must be > 0, got {b.account}")
    for name in ("open_cost", "close_cost", "min_cost"):
        p.check(getattr(b, name) >= 0, f"backtest.{name}", f"must be >= 0, got {getattr(b, name)}")
    p.check(b.limit_threshold is None or 0 < b.limit_threshold < 1, "backtest.limit_threshold",
            f"must be in (0, 1) or null, got {b.limit_threshold}")
    for name in ("topk", "hold_thresh", "momentum_window", "reversal_window"):
        p.check(getattr(b, name) >= 1, f"backtest.{name}", f"must be >= 1, got {getattr(b, name)}")
    p.check(0 < b.quantile <= 0.5, "backtest.quantile", f"must be in (0, 0.5], got {b.quantile}")


# file checks shared by the entry points (they add to the same Problems as the settings checks)

def check_model_folder(path: str | None, key: str, problems: Problems, *, hub_ok: bool) -> None:
    """Record a problem for `key` unless `path` is a model folder with config.json (or, with `hub_ok`, a bare
    `owner/name` Hugging Face Hub id, resolved when the model is loaded)."""
    if path is None:
        return
    local = Path(os.path.expanduser(path))
    if local.is_dir():
        problems.check((local / "config.json").is_file(), key,
                       f"{local} has no config.json; expected a save_pretrained folder")
        return
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not local.exists()
    if hub_ok and looks_like_hub_id:
        return
    hint = " (train that stage first, or point the setting at a trained model folder)" if not hub_ok else ""
    problems.add(key, f"{path} does not exist{hint}")


def cli_parser(doc: str) -> argparse.ArgumentParser:
    """What every Qlib entry point takes: --config (default configs/qlib_csi300.yaml), repeatable --set,
    --help-config and --print-config (parse it with `cli_args.parse_config_args`)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    add_config_args(parser, QlibConfig, load, default_config="configs/qlib_csi300.yaml")
    return parser
