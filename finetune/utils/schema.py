"""The settings both pipelines share, filled by config_utils.py (no torch): `PipelineConfig`, the typed contract
between the engine and a pipeline (what the stage runner reads of `Pipeline.cfg`), and its sections: `WindowSettings`
(`data:`'s window), `ModelConfig`, `TrainingConfig` and its checks, `StageConfig` (`<stage>_training:` over
`training:`); `SamplingConfig` (`forecast:`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from finetune.utils.adapters import mode_problems
from finetune.utils.config_utils import Problems, convert, parse_date
from model.config import KronosConfig, KronosTokenizerConfig, Window
from model.features import FEATURES


@dataclass
class TrainingConfig:
    """Settings of the shared training loop (a `training:`-style YAML section in both pipelines)."""

    epochs: int = 30
    """Passes over the (possibly capped) training windows."""
    batch_size: int = 50
    """Windows per forward pass on EACH process; global batch = batch_size * world_size * accumulation_steps."""
    accumulation_steps: int = 1
    """Micro-batches whose gradients are summed before one optimizer step."""
    lr: float = 2e-4
    """Peak learning rate of the OneCycle schedule (reference: 2e-4 tokenizer, 4e-5 predictor)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (kept fixed: the schedule does not cycle momentum)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    pct_start: float = 0.03
    """Fraction of all optimizer steps spent warming the learning rate up to `lr`."""
    div_factor: float = 10.0
    """OneCycle: the first learning rate is lr / div_factor."""
    final_div_factor: float = 1e4
    """OneCycle: the last learning rate is lr / div_factor / final_div_factor."""
    clip_grad_norm: float | None = None
    """Max gradient norm; null = stage default (2.0 tokenizer, 3.0 predictor); 0 = no clipping."""
    amp: Literal["auto", "none", "bf16"] = "auto"
    """Mixed precision. 'auto': bfloat16 autocast on a CUDA GPU that supports it (torch.cuda.is_bf16_supported),
    else float32, with TF32 matmuls for what stays float32 on CUDA; float32 on CPU. 'none': float32 everywhere
    (TF32 off). 'bf16': bfloat16 autocast on CUDA (float32 on CPU). The train log says which ran and why."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the training loss (forward + backward) once per stage: 'auto' = on with CUDA, off on CPU;
    true / false. An epoch's ragged last micro-batch runs eagerly (static shapes); a compile that fails at the first
    step logs one warning and training goes on eagerly."""
    deterministic: bool = False
    """true: deterministic kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN
    deterministic, no cuDNN benchmark) and training.compile 'auto' runs eagerly, so on a GPU a resumed run equals the
    uninterrupted one bit for bit; slower. false: a GPU's atomics may differ run to run (on CPU both are exact)."""
    seed: int = 100
    """Base seed; each process uses seed + rank; data order depends on (seed, epoch) only."""
    num_workers: int = 2
    """DataLoader worker processes per rank (0 = load in the training process)."""
    max_train_samples: int | None = None
    """Windows drawn per training epoch (a fresh seeded subset each epoch; Qlib's n_train_iter); null = all."""
    max_val_samples: int | None = None
    """Windows drawn per validation (a fresh seeded subset each epoch; Qlib's n_val_iter); null = all."""
    log_every_steps: int = 10
    """Write a metrics.jsonl record every this many optimizer steps (and at each epoch's last step)."""
    save_every_steps: int = 0
    """Also write checkpoints/last.pt every this many optimizer steps (0 = only at the end of each epoch)."""
    patience: int = 0
    """Stop after this many epochs without a better validation loss (0 = never stop early)."""
    min_delta: float = 0.0
    """A validation loss counts as better only if it beats the best by more than this."""
    resume: str = "auto"
    """'auto' = continue an unfinished run in the output folder (skip a finished one); 'required' = the same but an
    error when there is nothing to resume; 'never' = start fresh (an error if the folder holds a run); or a path
    to a checkpoint file / run folder."""
    overwrite: bool = False
    """Replace a run already in the output folder (finished or not): its outputs are deleted once this run holds
    the folder's lock."""
    keep_checkpoints: int = 2
    """How many step checkpoints (checkpoints/step-*.pt) to keep; last.pt links to the newest."""
    accept_changed_data: bool = False
    """Resume even though the data (data_info fingerprint) or the frozen tokenizer's weights changed since the
    checkpoint; what changed is recorded in run_info.json."""
    select_by: str = "loss"
    """What picks best_model/ and drives early stopping: 'loss' (validation loss) or the name of a forecast metric
    the pipeline computes (e.g. 'crps'; lower is better)."""
    teacher_forcing: bool = True
    """Predictor: condition s2 on the true next s1 (false = on a sampled s1); validation always uses the true s1."""
    dist_timeout_s: float = 1800.0
    """Seconds a collective waits for the other ranks before the job fails instead of hanging."""
    progress_bar: bool = True
    """Show a tqdm progress bar (rank 0 only)."""
    tensorboard: bool = False
    """Also log to TensorBoard under <output_dir>/tensorboard (needs `pip install 'kronos-finetune[tensorboard]'`)."""
    mlflow: bool = False
    """Also log to MLflow: config as params, metrics per step, loss_curve.png and run_info.json (needs mlflow)."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; null = an offline store sqlite:///<output_dir>/mlruns/mlflow.db in the stage folder."""
    mlflow_experiment: str = "kronos-finetune"
    """MLflow experiment name (created if missing)."""
    comet: bool = False
    """Also log to Comet (if comet_ml is installed and configured)."""
    comet_project: str = "kronos-finetune"
    """Comet project name."""
    finetune_mode: str = "full"
    """Predictor stage: 'full' trains every weight, 'lora' low-rank adapters (peft), 'freeze' only `trainable`."""
    lora_rank: int = 8
    """lora: rank r of each adapter (B (out, r) @ A (r, in))."""
    lora_alpha: float = 16.0
    """lora: the adapter's output is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """lora: dropout on the adapter's input while training."""
    lora_targets: list[str] = field(default_factory=lambda: ["attention"])
    """lora: layers that get adapters: groups attention, feed_forward, heads, or module names (e.g. q_proj, w1)."""
    trainable: list[str] = field(default_factory=list)
    """freeze: parameter-name prefixes that train, e.g. [head, transformer.1, embedding]; the rest is frozen.
    [] = the heads and the last transformer block."""



# What a changed training setting means for a checkpoint (the ledger's rule; tests/test_ledger.py fails for a setting
# without a class). "match": a resume is refused (it fixes the data order, the step count or shapes); "may_change":
# a resume continues with the new value and says so; "irrelevant": it does not change the trained weights (where and
# how the run reports, how the loader runs). A finished run is current only while every "match" and "may_change"
# setting is the one it was made with.
RESUME_CLASS: dict[str, Literal["match", "may_change", "irrelevant"]] = {
    **dict.fromkeys(("epochs", "batch_size", "accumulation_steps", "seed", "max_train_samples", "finetune_mode",
                     "lora_rank", "lora_alpha", "lora_targets", "trainable"), "match"),
    **dict.fromkeys(("lr", "pct_start", "div_factor", "final_div_factor", "betas", "weight_decay", "clip_grad_norm",
                     "amp", "compile", "deterministic", "patience", "min_delta", "teacher_forcing", "max_val_samples",
                     "select_by", "lora_dropout"), "may_change"),
    **dict.fromkeys(("num_workers", "log_every_steps", "save_every_steps", "resume", "overwrite", "keep_checkpoints",
                     "accept_changed_data", "dist_timeout_s", "progress_bar", "tensorboard", "mlflow",
                     "mlflow_tracking_uri", "mlflow_experiment", "comet", "comet_project"), "irrelevant")}


def validate_training_config(cfg: TrainingConfig, problems: Problems, prefix: str = "training") -> None:
    """Add every problem of `cfg` to `problems`, each named by its YAML key (`prefix.field`)."""
    k = (lambda name: f"{prefix}.{name}" if prefix else name)
    at_least_one = ("epochs", "batch_size", "accumulation_steps", "log_every_steps", "keep_checkpoints")
    positive = ("lr", "div_factor", "final_div_factor", "dist_timeout_s")
    non_negative = ("weight_decay", "num_workers", "save_every_steps", "min_delta")
    for names, ok, bound in ((at_least_one, lambda v: v >= 1, ">= 1"), (positive, lambda v: v > 0, "> 0"),
                             (non_negative, lambda v: v >= 0, ">= 0")):
        for name in names:
            problems.check(ok(getattr(cfg, name)), k(name), f"must be {bound}, got {getattr(cfg, name)}")
    problems.check(len(cfg.betas) == 2 and all(0 <= b < 1 for b in cfg.betas), k("betas"),
                   f"need two values in [0, 1), got {cfg.betas}")
    problems.check(0 < cfg.pct_start < 1, k("pct_start"), f"must be in (0, 1), got {cfg.pct_start}")
    problems.check(cfg.clip_grad_norm is None or cfg.clip_grad_norm >= 0, k("clip_grad_norm"),
                   f"must be >= 0 or null, got {cfg.clip_grad_norm}")
    hints = typing.get_type_hints(TrainingConfig)
    for name in ("amp", "compile"):  # their choices are their annotations; a config built in code is checked too
        convert(getattr(cfg, name), hints[name], k(name), problems)
    for name in ("max_train_samples", "max_val_samples"):
        v = getattr(cfg, name)
        problems.check(v is None or v >= 1, k(name), f"must be >= 1 or null (all windows), got {v}")
    problems.check(cfg.patience >= 0, k("patience"), f"must be >= 0 (0 = no early stopping), got {cfg.patience}")
    problems.check(isinstance(cfg.select_by, str) and cfg.select_by.strip() != "", k("select_by"),
                   f"must be 'loss' or a metric name, got {cfg.select_by!r}")
    for name, message in mode_problems(cfg):  # the finetune modes' registry (finetune/utils/adapters.py)
        problems.add(k(name), message)
    for key, message in tracker_problems(tensorboard=cfg.tensorboard, mlflow=cfg.mlflow, comet=cfg.comet,
                                         prefix=prefix):
        problems.add(key, message)



log = logging.getLogger("finetune.config")

STAGES = ("tokenizer", "predictor")


@dataclass
class StageConfig:
    """What one stage sets differently from `training:`; null = use the `training:` value."""

    epochs: int | None = None
    """Epochs of this stage; null = training.epochs (the CSV pipeline also takes 0 = skip this stage)."""
    lr: float | None = None
    """Peak learning rate of this stage; null = training.lr (reference finetuning: 2e-4 tokenizer, 4e-5 predictor)."""
    batch_size: int | None = None
    """Windows per micro-batch on each process; null = training.batch_size."""
    clip_grad_norm: float | None = None
    """Gradient-norm clip; null = training.clip_grad_norm, whose null means 2.0 (tokenizer) / 3.0 (predictor)."""


class WindowSettings:
    """Base of both pipelines' `data:` sections, which declare `lookback`, `predict` and `clip` (each with its own
    defaults: Qlib daily 90 / 10, CSV 512 / 48)."""

    lookback: int
    predict: int
    clip: float

    @property
    def window(self) -> Window:
        return Window(self.lookback, self.predict, self.clip)

    def check_window(self, problems: Problems) -> None:
        """The window's rules, one set for both pipelines."""
        problems.check(self.lookback >= 2, "data.lookback",
                       f"must be >= 2 (a window is normalised by the std of its lookback bars), got {self.lookback}")
        problems.check(self.predict >= 1, "data.predict", f"must be >= 1, got {self.predict}")
        problems.check(self.clip > 0, "data.clip", f"must be > 0, got {self.clip}")


class PipelineConfig:
    """Base of both pipelines' settings (`QlibConfig`, `CsvFinetuneConfig`): the sections the engine reads. Each
    pipeline's dataclass declares them with its own defaults and subclasses, and adds its own sections."""

    data: WindowSettings
    model: ModelConfig
    training: TrainingConfig
    tokenizer_training: StageConfig
    predictor_training: StageConfig

    def stage_training(self, stage: Literal["tokenizer", "predictor"]) -> TrainingConfig:
        """`training` with the stage's non-null overrides applied: what the engine runs that stage with."""
        section = getattr(self, f"{stage}_training")
        changed = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
                   if getattr(section, f.name) is not None}
        return dataclasses.replace(self.training, **changed)

    def check_training(self, problems: Problems, select_by: Mapping[str, str], min_epochs: int = 1) -> None:
        """Add the problems of `training:` and of both stage sections (each value may be null = inherit); `select_by`
        maps each allowed training.select_by to what it selects by."""
        validate_training_config(self.training, problems, "training")
        choices = " or ".join(f"'{name}' ({meaning})" for name, meaning in select_by.items())
        problems.check(self.training.select_by in select_by, "training.select_by",
                       f"must be {choices}, got {self.training.select_by!r}")
        rules = (("epochs", lambda v: v >= min_epochs, f">= {min_epochs}"), ("lr", lambda v: v > 0, "> 0"),
                 ("batch_size", lambda v: v >= 1, ">= 1"), ("clip_grad_norm", lambda v: v >= 0, ">= 0"))
        for k in ("tokenizer_training", "predictor_training"):
            for name, ok, bound in rules:
                v = getattr(getattr(self, k), name)
                problems.check(v is None or ok(v), f"{k}.{name}", f"must be {bound} or null, got {v}")


def stage_key(run_config: Mapping[str, Any] | None, stage: str, name: str) -> str:
    """The YAML key that sets loop setting `name` for `stage` in the pipeline's resolved config `run_config`:
    `<stage>_training.<name>` when that section sets it (it shadows `training:`), else `training.<name>`."""
    section = (run_config or {}).get(f"{stage}_training") or {}
    return f"{stage}_training.{name}" if section.get(name) is not None else f"training.{name}"


def warn_shadowed_overrides(cfg: Any, overrides: Iterable[str]) -> None:
    """Log one warning, naming both keys, per `--set training.X=...` in `overrides` (raw `KEY=VALUE` strings) that
    a stage section of the pipeline config `cfg` shadows (sets X)."""
    stage_fields = {f.name for f in dataclasses.fields(StageConfig)}
    for item in overrides or ():
        key = item.partition("=")[0].strip()
        section, _, name = key.partition(".")
        if section != "training" or name not in stage_fields:
            continue
        for stage in STAGES:
            value = getattr(getattr(cfg, f"{stage}_training"), name)
            if value is not None:
                log.warning("--set %s does not change the %s stage: %s_training.%s = %s shadows it; set %s_training.%s "
                            "instead (or set it to null to inherit)", key, stage, stage, name, value, stage, name)


@dataclass
class SamplingConfig:
    """Sampling of the forecast paths (`forecast:` in YAML)."""

    temperature: float = 1.0
    """Sampling temperature (the original Qlib backtest used 0.6)."""
    top_k: int = 0
    """Keep the k most likely tokens when sampling (0 = off; 1 = greedy and deterministic)."""
    top_p: float = 0.9
    """Nucleus sampling threshold (1.0 = off)."""
    sample_count: int = 20
    """Sample paths per forecast: their mean is the point forecast, their spread the quantiles / CRPS / coverage
    (a single path is noise; the issue-12 audit saw the headline score move 17% across seeds with 1)."""
    seed: int = 0
    """Seed of the sampling, so a forecast can be reproduced."""

    def decoding(self) -> dict:
        """The settings a calibration holds for (model.calibration.decoding_changes), in the predictor's names."""
        return {"T": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "sample_count": self.sample_count}

    def check(self, problems: Problems, prefix: str = "forecast") -> None:
        """Add every problem of these settings to `problems`, named `prefix.key`."""
        problems.check(self.temperature > 0, f"{prefix}.temperature", f"must be > 0, got {self.temperature}")
        problems.check(self.top_k >= 0, f"{prefix}.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        problems.check(0 < self.top_p <= 1, f"{prefix}.top_p", f"must be in (0, 1], got {self.top_p}")
        problems.check(self.sample_count >= 1, f"{prefix}.sample_count", f"must be >= 1, got {self.sample_count}")


def tracker_problems(*, tensorboard: bool = False, mlflow: bool = False, comet: bool = False,
                     prefix: str = "training") -> list[tuple[str, str]]:
    """(yaml key, message) for every enabled tracker whose package is missing; [] when all can be used.

    Lets config validation report a missing package before any data is loaded or model built."""
    out = []
    for name, enabled, package in (("tensorboard", tensorboard, "tensorboard"), ("mlflow", mlflow, "mlflow"),
                                   ("comet", comet, "comet_ml")):  # package = the module to import
        if enabled and importlib.util.find_spec(package) is None:
            out.append((f"{prefix}.{name}" if prefix else name,
                        f"is true but {package} is not installed: `pip install {package}` or set it to false"))
    return out


@dataclass
class ModelConfig:
    """Starting points of the two models (`model:` in YAML, the same in both pipelines)."""

    pretrained_tokenizer: str | None = "NeoQuasar/Kronos-Tokenizer-base"
    """Tokenizer to finetune: a save_pretrained folder or a Hugging Face Hub id; null = from scratch
    (tokenizer_arch)."""
    pretrained_predictor: str | None = "NeoQuasar/Kronos-small"
    """Predictor to finetune: a save_pretrained folder or a Hub id; null = from scratch (predictor_arch)."""
    tokenizer_arch: KronosTokenizerConfig = field(default_factory=KronosTokenizerConfig)
    """KronosTokenizer constructor arguments when pretrained_tokenizer is null (ignored otherwise)."""
    predictor_arch: KronosConfig = field(default_factory=KronosConfig)
    """Kronos constructor arguments when pretrained_predictor is null (s1/s2 bits null = the tokenizer's)."""
    pretraining_cutoff: Any = None
    """Last date the published weights were trained on (a date, e.g. 2024-06-30); walk-forward test blocks that start
    before it are flagged and left out of the verdict. null = unknown (nothing is excluded)."""

    def check(self, problems: Problems, prefix: str = "model") -> None:
        """Add every problem of these settings to `problems`, named `prefix.key` (no file or Hub access)."""
        if self.pretraining_cutoff is not None:
            parse_date(self.pretraining_cutoff, f"{prefix}.pretraining_cutoff", problems, "use e.g. 2024-06-30 or null")
        for name in ("pretrained_tokenizer", "pretrained_predictor"):
            value = getattr(self, name)
            problems.check(value is None or bool(str(value).strip()), f"{prefix}.{name}",
                           "is empty; give a folder or hub id, or null to train from scratch")
        tok, pred = self.tokenizer_arch, self.predictor_arch
        if self.pretrained_tokenizer is None:
            for key, message in tok.problems(f"{prefix}.tokenizer_arch"):
                problems.add(key, message)
            problems.check(tok.d_in == len(FEATURES), f"{prefix}.tokenizer_arch.d_in",
                           f"must be {len(FEATURES)} (the features {FEATURES}), got {tok.d_in}")
        if self.pretrained_predictor is None:
            for key, message in pred.problems(f"{prefix}.predictor_arch"):
                problems.add(key, message)
            if self.pretrained_tokenizer is None:  # both from scratch: the bits can be compared now
                for bits in ("s1_bits", "s2_bits"):
                    want, got = getattr(tok, bits), getattr(pred, bits)
                    problems.check(got is None or got == want, f"{prefix}.predictor_arch.{bits}",
                                   f"is {got} but {prefix}.tokenizer_arch.{bits} is {want}; set it to null "
                                   "(= the tokenizer's) or to the same value")
