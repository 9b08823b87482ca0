"""Settings of the CSV finetuning pipeline: typed dataclasses filled from YAML, validated up front.

A YAML file in configs/ fills `CsvFinetuneConfig`; `--set training.epochs=3`-style overrides are applied on top
(see `load`). `validate()` checks every setting at once and raises ONE ValueError listing each problem with
the YAML key to change, before any data is read or any folder is created.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from finetune.utils.config_utils import Problems, load_config
from finetune.utils.stage_config import PredictorStageConfig, TokenizerStageConfig, apply_stage, validate_stage
from finetune.utils.training_utils import TrainingConfig, validate_training_config

# Column names of a candle as the models see it, in feature order (the model contract).
FEATURES = ("open", "high", "low", "close", "volume", "amount")
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
    """

    path: str = ""
    """A CSV file, or a folder of CSV files (one series per file unless `symbol_column` is set)."""
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


@dataclass
class TokenizerArch:
    """KronosTokenizer constructor arguments, used when training a tokenizer from scratch."""

    d_model: int = 256
    """Width of the tokenizer's transformer."""
    n_heads: int = 4
    """Attention heads."""
    ff_dim: int = 512
    """Hidden width of the feed-forward layers."""
    n_enc_layers: int = 4
    """Encoder depth (the model builds n_enc_layers - 1 blocks, as the published one does)."""
    n_dec_layers: int = 4
    """Decoder depth (n_dec_layers - 1 blocks)."""
    ffn_dropout_p: float = 0.0
    """Dropout after the feed-forward layers."""
    attn_dropout_p: float = 0.0
    """Dropout on attention weights."""
    resid_dropout_p: float = 0.0
    """Dropout on the attention output."""
    s1_bits: int = 10
    """Bits of the coarse sub-token (vocabulary 2^s1_bits)."""
    s2_bits: int = 10
    """Bits of the fine sub-token (must equal s1_bits)."""
    beta: float = 0.05
    """Commitment loss weight of the BSQ quantizer."""
    gamma0: float = 1.0
    """Per-sample entropy weight."""
    gamma: float = 1.1
    """Codebook entropy weight."""
    zeta: float = 0.05
    """Weight of the entropy terms."""
    group_size: int = 4
    """Quantizer group size for the codebook entropy (must divide s1_bits + s2_bits)."""


@dataclass
class PredictorArch:
    """Kronos constructor arguments, used when training a predictor from scratch (s1/s2 bits come from the tokenizer)."""

    n_layers: int = 12
    """Transformer depth."""
    d_model: int = 832
    """Width of the transformer."""
    n_heads: int = 16
    """Attention heads (must divide d_model)."""
    ff_dim: int = 2048
    """Hidden width of the feed-forward layers."""
    ffn_dropout_p: float = 0.2
    """Dropout after the feed-forward layers."""
    attn_dropout_p: float = 0.0
    """Dropout on attention weights."""
    resid_dropout_p: float = 0.2
    """Dropout on the attention output."""
    token_dropout_p: float = 0.0
    """Dropout on the input embeddings."""
    learn_te: bool = True
    """Learned time embeddings (true, as published) or fixed sinusoidal ones."""


@dataclass
class ModelConfig:
    """Starting points of the two models: published weights, or from scratch with the architecture below."""

    pretrained_tokenizer: str | None = "NeoQuasar/Kronos-Tokenizer-base"
    """Folder or Hugging Face hub id of the tokenizer to finetune; null = train one from scratch (tokenizer_arch)."""
    pretrained_predictor: str | None = "NeoQuasar/Kronos-base"
    """Folder or hub id of the predictor to finetune; null = train one from scratch (predictor_arch)."""
    tokenizer_arch: TokenizerArch = field(default_factory=TokenizerArch)
    """Tokenizer architecture when pretrained_tokenizer is null (ignored otherwise)."""
    predictor_arch: PredictorArch = field(default_factory=PredictorArch)
    """Predictor architecture when pretrained_predictor is null (ignored otherwise)."""


@dataclass
class CsvTrainingConfig(TrainingConfig):
    """Loop settings shared by both stages (finetune.utils.training_utils.TrainingConfig documents every field).

    Per-stage values (epochs, lr, batch_size, clip_grad_norm) live in `tokenizer_training` / `predictor_training`
    and win over these. Only the defaults below differ from the shared engine's.
    """

    resume: str = "never"
    """'never' = start fresh (the --resume flag switches to 'auto': continue from checkpoints/last.pt); or a path."""
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
class ForecastConfig:
    """Held-out forecast after training (scripts/demo.sh, finetune_csv/forecast.py)."""

    max_windows: int = 4
    """Test windows forecast per series (evenly spaced over its test split)."""
    sample_count: int = 1
    """Forecast paths averaged per window."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_k: int = 0
    """Keep the k most likely tokens when sampling (0 = off; 1 = greedy and deterministic)."""
    top_p: float = 0.9
    """Nucleus sampling threshold (1.0 = off)."""
    seed: int = 0
    """Seed of the forecast's sampling."""


@dataclass
class CsvFinetuneConfig:
    """Everything the CSV pipeline needs; one YAML file fills it."""

    data: DataConfig = field(default_factory=DataConfig)
    """Input candles and windows."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Starting weights or architectures."""
    training: CsvTrainingConfig = field(default_factory=CsvTrainingConfig)
    """Loop settings shared by both stages."""
    tokenizer_training: TokenizerStageConfig = field(default_factory=TokenizerStageConfig)
    """Tokenizer-stage overrides (epochs, lr, batch_size, clip_grad_norm)."""
    predictor_training: PredictorStageConfig = field(default_factory=PredictorStageConfig)
    """Predictor-stage overrides (epochs, lr, batch_size, clip_grad_norm)."""
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
    def tokenizer_dir(self) -> Path:
        """Output folder of the tokenizer stage."""
        return self.base_dir / "tokenizer"

    @property
    def predictor_dir(self) -> Path:
        """Output folder of the predictor stage (named basemodel/ as in the original pipeline)."""
        return self.base_dir / "basemodel"


def load(config_path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> CsvFinetuneConfig:
    """Read the YAML file, apply `--set key=value` overrides and validate; one ValueError lists every problem."""
    cfg = load_config(CsvFinetuneConfig, config_path, overrides)
    validate(cfg)
    return cfg


def validate(cfg: CsvFinetuneConfig) -> None:
    """Check every setting; raise ONE ValueError (ConfigError) listing each problem with the YAML key to change."""
    problems = Problems("Invalid CSV finetuning configuration")
    _check_data(cfg.data, problems)
    _check_model(cfg.model, problems)
    _check_training(cfg, problems)
    _check_paths(cfg.paths, problems)
    _check_forecast(cfg.forecast, problems)
    problems.raise_if_any()


def _check_data(d: DataConfig, p: Problems) -> None:
    p.check(bool(d.path), "data.path", "is empty: set it to a CSV file or a folder of CSV files")
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


def _check_model(m: ModelConfig, p: Problems) -> None:
    t, a = m.tokenizer_arch, m.predictor_arch
    if m.pretrained_tokenizer is None:
        k = "model.tokenizer_arch"
        p.check(t.s1_bits == t.s2_bits, f"{k}.s2_bits", f"must equal s1_bits ({t.s2_bits} != {t.s1_bits})")
        p.check(t.s1_bits >= 1 and t.s2_bits >= 1, f"{k}.s1_bits", "s1_bits and s2_bits must be >= 1")
        p.check(t.group_size >= 1 and (t.s1_bits + t.s2_bits) % t.group_size == 0, f"{k}.group_size",
                f"({t.group_size}) must divide s1_bits + s2_bits ({t.s1_bits + t.s2_bits})")
        p.check(t.n_heads >= 1 and t.d_model % t.n_heads == 0, f"{k}.n_heads",
                f"({t.n_heads}) must divide d_model ({t.d_model})")
        p.check(t.n_enc_layers >= 1 and t.n_dec_layers >= 1, f"{k}.n_enc_layers",
                "n_enc_layers and n_dec_layers must be >= 1")
    if m.pretrained_predictor is None:
        k = "model.predictor_arch"
        p.check(a.n_heads >= 1 and a.d_model % a.n_heads == 0, f"{k}.n_heads",
                f"({a.n_heads}) must divide d_model ({a.d_model})")
        p.check(a.d_model % 4 == 0, f"{k}.d_model",
                f"({a.d_model}) must be a multiple of 4 (the dependency layer always has 4 heads)")
        p.check(a.n_layers >= 1, f"{k}.n_layers", f"must be >= 1 (got {a.n_layers})")
    for key in ("pretrained_tokenizer", "pretrained_predictor"):
        value = getattr(m, key)
        p.check(value is None or bool(str(value).strip()), f"model.{key}",
                "is an empty string: give a folder or hub id, or null to train from scratch")


def _check_training(cfg: CsvFinetuneConfig, p: Problems) -> None:
    validate_training_config(cfg.training, p, prefix="training")
    for key in ("tokenizer_training", "predictor_training"):
        validate_stage(getattr(cfg, key), key, p, min_epochs=0)  # epochs 0 = skip the stage


def _check_paths(paths: PathsConfig, p: Problems) -> None:
    p.check(bool(paths.exp_name) and not any(c in paths.exp_name for c in "/\\"), "paths.exp_name",
            f"must be a non-empty name without slashes (got '{paths.exp_name}')")
    p.check(bool(paths.base_dir), "paths.base_dir", "is empty: name the output folder, e.g. outputs/{exp_name}")


def _check_forecast(f: ForecastConfig, p: Problems) -> None:
    p.check(f.max_windows >= 1, "forecast.max_windows", f"must be >= 1 (got {f.max_windows})")
    p.check(f.sample_count >= 1, "forecast.sample_count", f"must be >= 1 (got {f.sample_count})")
    p.check(f.temperature > 0, "forecast.temperature", f"must be > 0 (got {f.temperature})")
    p.check(f.top_k >= 0, "forecast.top_k", f"must be >= 0 (got {f.top_k})")
    p.check(0 < f.top_p <= 1, "forecast.top_p", f"must be in (0, 1] (got {f.top_p})")
