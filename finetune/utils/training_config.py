"""Settings of the shared training loop (`TrainingConfig`), their validation, and the resume compatibility check.

Both pipelines embed `TrainingConfig` as their `training:` YAML section and call `validate_training_config` while
collecting every problem of their config; the engine calls it again before a run. `check_resume_compatible` lists
every setting that differs from a checkpoint's, since those would change the data order or the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .config_utils import Problems, config_to_dict
from .trackers import tracker_problems

__all__ = ["TrainingConfig", "validate_training_config", "RESUME_KEYS", "CHANGEABLE_KEYS", "check_resume_compatible",
           "plain"]


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
    amp: Literal["none", "bf16"] = "none"
    """Mixed precision: 'bf16' runs the forward under bfloat16 autocast on CUDA (ignored with a warning on CPU)."""
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



# Settings a checkpoint cannot be resumed with if changed: they fix the data order, the step count or shapes.
RESUME_KEYS = ("epochs", "batch_size", "accumulation_steps", "seed", "max_train_samples")
# Optimisation settings a resume may change (e.g. a lower lr after a divergence); each change is reported.
CHANGEABLE_KEYS = ("lr", "pct_start", "div_factor", "final_div_factor", "betas", "weight_decay", "clip_grad_norm",
                   "amp", "patience", "min_delta", "teacher_forcing", "max_val_samples", "select_by")


def validate_training_config(cfg: TrainingConfig, problems: Problems, prefix: str = "training") -> None:
    """Add every problem of `cfg` to `problems`, each named by its YAML key (`prefix.field`)."""
    k = (lambda name: f"{prefix}.{name}" if prefix else name)
    problems.check(cfg.epochs >= 1, k("epochs"), f"must be >= 1, got {cfg.epochs}")
    problems.check(cfg.batch_size >= 1, k("batch_size"), f"must be >= 1, got {cfg.batch_size}")
    problems.check(cfg.accumulation_steps >= 1, k("accumulation_steps"), f"must be >= 1, got {cfg.accumulation_steps}")
    problems.check(cfg.lr > 0, k("lr"), f"must be > 0, got {cfg.lr}")
    problems.check(
        len(cfg.betas) == 2 and all(0 <= b < 1 for b in cfg.betas), k("betas"),
        f"need two values in [0, 1), got {cfg.betas}",
    )
    problems.check(cfg.weight_decay >= 0, k("weight_decay"), f"must be >= 0, got {cfg.weight_decay}")
    problems.check(0 < cfg.pct_start < 1, k("pct_start"), f"must be in (0, 1), got {cfg.pct_start}")
    problems.check(cfg.div_factor > 0, k("div_factor"), f"must be > 0, got {cfg.div_factor}")
    problems.check(cfg.final_div_factor > 0, k("final_div_factor"), f"must be > 0, got {cfg.final_div_factor}")
    problems.check(
        cfg.clip_grad_norm is None or cfg.clip_grad_norm >= 0, k("clip_grad_norm"),
        f"must be >= 0 or null, got {cfg.clip_grad_norm}",
    )
    problems.check(cfg.amp in ("none", "bf16"), k("amp"), f"must be 'none' or 'bf16', got {cfg.amp!r}")
    problems.check(cfg.num_workers >= 0, k("num_workers"), f"must be >= 0, got {cfg.num_workers}")
    for name in ("max_train_samples", "max_val_samples"):
        v = getattr(cfg, name)
        problems.check(v is None or v >= 1, k(name), f"must be >= 1 or null (all windows), got {v}")
    problems.check(cfg.log_every_steps >= 1, k("log_every_steps"), f"must be >= 1, got {cfg.log_every_steps}")
    problems.check(cfg.save_every_steps >= 0, k("save_every_steps"), f"must be >= 0, got {cfg.save_every_steps}")
    problems.check(cfg.patience >= 0, k("patience"), f"must be >= 0 (0 = no early stopping), got {cfg.patience}")
    problems.check(cfg.min_delta >= 0, k("min_delta"), f"must be >= 0, got {cfg.min_delta}")
    problems.check(cfg.keep_checkpoints >= 1, k("keep_checkpoints"), f"must be >= 1, got {cfg.keep_checkpoints}")
    problems.check(isinstance(cfg.select_by, str) and cfg.select_by.strip() != "", k("select_by"),
                   f"must be 'loss' or a metric name, got {cfg.select_by!r}")
    problems.check(cfg.dist_timeout_s > 0, k("dist_timeout_s"), f"must be > 0, got {cfg.dist_timeout_s}")
    for key, message in tracker_problems(tensorboard=cfg.tensorboard, mlflow=cfg.mlflow, comet=cfg.comet,
                                         prefix=prefix):
        problems.add(key, message)



def check_resume_compatible(saved: dict, cfg: TrainingConfig, world_size: int, stage: str,
                            model_args: dict[str, Any], path: Path) -> list[str]:
    """Raise one ConfigError listing every setting that cannot differ from the checkpoint `saved` (loaded from
    `path`); return 'training.key: old -> new' for each changeable optimisation setting that did change.

    Parameters
    ----------
    saved: the checkpoint dict (keys "stage", "model_args", "training_config", "world_size").
    cfg, world_size, stage: this run's loop settings, process count and stage name.
    model_args: this run's model constructor arguments, already `plain()`.
    """
    problems = Problems(f"Cannot resume from {path}")
    if saved.get("stage") != stage:
        problems.add("training.resume", f"the checkpoint is from the {saved.get('stage')} stage, not {stage}")
    for key in sorted(set(model_args) | set(saved.get("model_args", {}))):
        if saved.get("model_args", {}).get(key) != model_args.get(key):
            problems.add(f"model.{key}", f"the checkpoint's model has {saved['model_args'].get(key)!r}, "
                                         f"this one {model_args.get(key)!r}")
    old = saved.get("training_config", {})
    for key in RESUME_KEYS:
        new_value = config_to_dict(getattr(cfg, key))
        if key in old and old[key] != new_value:
            problems.add(f"training.{key}",
                         f"the checkpoint was made with {old[key]!r}, the config now says {new_value!r}")
    if saved.get("world_size") != world_size:
        problems.add("(torchrun --nproc_per_node)",
                     f"the checkpoint was made with {saved.get('world_size')} processes, now {world_size}")
    if problems:
        problems.add("training.overwrite", "set it to true (or use a new output folder) to start over")
    problems.raise_if_any()
    changed = []
    for key in CHANGEABLE_KEYS:
        new_value = plain(getattr(cfg, key))
        if key in old and plain(old[key]) != new_value:
            changed.append(f"training.{key}: {old[key]!r} -> {new_value!r}")
    return changed


def plain(obj: Any) -> Any:
    """Config data reduced to str/int/float/bool/None/list/dict (so the checkpoint loads with weights_only=True)."""
    obj = config_to_dict(obj)
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)
