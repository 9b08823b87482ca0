"""Training metrics: a JSON-lines log (always), experiment trackers (opt-in, trackers.py), and the loss plot.

Only rank 0 creates a `MetricsLogger(enabled=True)`; on other ranks `enabled=False` makes every call a no-op, so
the loop does not branch. Each record is one JSON object per line in `metrics.jsonl`. Epochs are numbered the same
everywhere: epoch 0 is the validation of the starting model before the first optimizer step (step 0); trained
epochs are 1, 2, ... e.g.
    {"kind": "val", "step": 0, "epoch": 0, "val_loss": 0.52, "best_val_loss": 0.52, ...}
    {"kind": "train", "step": 20, "epoch": 1, "lr": 1.9e-4, "loss": 0.41, "samples_per_s": 812.0, ...}
    {"kind": "val", "step": 40, "epoch": 1, "val_loss": 0.38, "best_val_loss": 0.38, ...}
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .trackers import Tracker, open_trackers

__all__ = [
    "MetricsLogger",
    "best_val_record",
    "loss_curve_figure",
    "loss_plot_title",
    "plot_loss_curves",
    "read_metrics",
]


class MetricsLogger:
    """Append records to `<folder>/metrics.jsonl` and mirror their numbers to the enabled trackers.

    Args:
        folder: the stage's output folder (created if needed).
        enabled: False on non-main ranks: nothing is created or written.
        tensorboard: also write TensorBoard events under `<folder>/tensorboard` (`training.tensorboard`).
        mlflow: also log to MLflow (`training.mlflow`).
        mlflow_tracking_uri: None = offline store under `<folder>/mlruns` (`training.mlflow_tracking_uri`).
        mlflow_experiment: MLflow experiment name (`training.mlflow_experiment`).
        comet: also log to Comet (needs comet_ml and its API key in the environment).
        comet_project: Comet project name.
        run_name: name of the run in MLflow / Comet.
        resume_step: when resuming from the checkpoint of this optimizer step, drop records of later steps (they
            were logged by the interrupted run and are about to be redone) instead of duplicating them; the
            stage's MLflow run is continued.

    Raises `TrackerUnavailable` (a ConfigError naming the setting) before writing anything when an enabled
    tracker's package is missing.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = False,
        mlflow: bool = False,
        mlflow_tracking_uri: str | None = None,
        mlflow_experiment: str = "kronos-finetune",
        comet: bool = False,
        comet_project: str | None = None,
        run_name: str | None = None,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = Path(folder) / "metrics.jsonl"
        self._file = None
        self.trackers: list[Tracker] = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Trackers first: a missing package fails here, before the old metrics.jsonl is touched.
        self.trackers = open_trackers(
            folder, tensorboard=tensorboard, mlflow=mlflow, mlflow_tracking_uri=mlflow_tracking_uri,
            mlflow_experiment=mlflow_experiment, comet=comet, comet_project=comet_project, run_name=run_name,
            resume=resume_step is not None,
        )
        if resume_step is None:
            self.path.unlink(missing_ok=True)  # a fresh run starts a fresh log
        elif self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (a flat dict of numbers/strings; must hold "step")."""
        if not self.enabled:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(record, default=float) + "\n")  # NaN/inf -> null: strict JSON for any reader
        self._file.flush()
        step = int(record.get("step", 0))
        prefix = record.get("kind", "train")
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        for tracker in self.trackers:
            tracker.log_metrics(prefix, numbers, step)

    def log_params(self, params: dict[str, Any]) -> None:
        """Send the resolved config to the trackers (the JSON log keeps it in run_info.json instead)."""
        if not self.enabled:
            return
        for tracker in self.trackers:
            tracker.log_params(params)

    def log_artifacts(self, *paths: str | Path | None) -> None:
        """Attach finished files (loss_curve.png, run_info.json) to the tracker runs; None / missing are skipped."""
        if not self.enabled:
            return
        files = [Path(p) for p in paths if p is not None and Path(p).exists()]
        for tracker in self.trackers:
            tracker.log_artifacts(files)

    def close(self, failed: bool = False) -> None:
        """Close metrics.jsonl and end the tracker runs (`failed=True` marks the MLflow run FAILED). Idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(failed=failed)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (a torn last line from a killed run is ignored)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


# ----------------------------------------------------------------------------------------------------------------
# loss plot


def loss_plot_title(stage: str, source: str | None) -> str:
    """"<stage>: finetuned from <source>" (source = the pretrained model's id or path) or "<stage>: trained from
    scratch" (source None)."""
    return f"{stage}: trained from scratch" if source is None else f"{stage}: finetuned from {source}"


def best_val_record(records: Iterable[dict[str, Any]], best_epoch: int | None = None) -> dict[str, Any] | None:
    """The validation record of `best_epoch` (the last one logged for it), or with None the one with the lowest
    finite val_loss (the earliest on ties); None when there is no such record."""
    val = [r for r in records if r.get("kind") == "val" and _finite(r.get("val_loss"))]
    if best_epoch is not None:
        of_epoch = [r for r in val if r.get("epoch") == best_epoch]
        return of_epoch[-1] if of_epoch else None
    return min(val, key=lambda r: r["val_loss"]) if val else None


def loss_curve_figure(records: Iterable[dict[str, Any]], title: str = "", best_epoch: int | None = None,
                      smoothing: float = 0.9):
    """The loss figure: losses on top, learning rate below, both against the optimizer step.

    Top: train loss per logged step (raw, faint; and an exponential moving average, debiased like TensorBoard's,
    with weight `smoothing`), validation loss per epoch (epoch 0 = the starting model, at step 0), and the best
    epoch marked with a star (artist gid "best_epoch") labelled with its epoch and loss. Bottom: the learning rate
    of each train record (log scale). Needs matplotlib; returns a `matplotlib.figure.Figure` (not shown anywhere).

    Parameters
    ----------
    records: metrics.jsonl records (kind "train" with step/loss/lr, kind "val" with step/epoch/val_loss).
    title: figure title, e.g. `loss_plot_title(stage, source)`.
    best_epoch: the epoch to mark (the trainer's, which honours min_delta); None = the lowest validation loss.
    smoothing: EMA weight in [0, 1); 0 = no smoothing.
    """
    # no pyplot: no global backend or figure registry involved
    from matplotlib.figure import Figure

    records = sorted(records, key=lambda r: r.get("step", 0))  # sorted() is stable: same-step order kept
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and _finite(r.get("loss"))]
    lr = [(r["step"], r["lr"]) for r in records if r.get("kind") == "train" and _finite(r.get("lr"))]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "val" and _finite(r.get("val_loss"))]

    fig = Figure(figsize=(8, 6), dpi=100)
    ax, ax_lr = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if train:
        steps, losses = zip(*train)
        ax.plot(steps, losses, color="C0", alpha=0.3, linewidth=0.8, label="train loss (raw)")
        ax.plot(steps, _ema(losses, smoothing), color="C0", linewidth=1.5, label="train loss (smoothed)")
    if val:
        ax.plot(*zip(*val), "o-", color="C1", linewidth=1.5, label="validation loss (per epoch)")
    best = best_val_record(records, best_epoch)
    if best is not None:
        ax.plot([best["step"]], [best["val_loss"]], linestyle="none", marker="*", markersize=16, color="C3",
                zorder=5, gid="best_epoch", label=f"best: epoch {best.get('epoch')} (val {best['val_loss']:.4g})")
        ax_lr.axvline(best["step"], color="C3", linestyle=":", linewidth=1)
    # A checkpoint-selection metric (training.select_by: crps / ic -> "metric_<name>" in the val records) on its own
    # axis: the curve the best epoch was chosen by.
    metric_keys = sorted({k for r in records if r.get("kind") == "val" for k in r if k.startswith("metric_")})
    handles = []
    if metric_keys:
        ax_metric = ax.twinx()
        for i, key in enumerate(metric_keys):
            points = [(r["step"], r[key]) for r in records if r.get("kind") == "val" and _finite(r.get(key))]
            if points:
                handles += ax_metric.plot(*zip(*points), "s--", color=f"C{4 + i}", linewidth=1.2, gid=key,
                                          label=f"validation {key.removeprefix('metric_')} (per epoch)")
        ax_metric.set_ylabel(", ".join(k.removeprefix("metric_") for k in metric_keys))
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or val:
        lines, labels = ax.get_legend_handles_labels()
        ax.legend(lines + handles, labels + [h.get_label() for h in handles], loc="upper right")
    else:
        ax.text(0.5, 0.5, "no finite losses logged", ha="center", va="center", transform=ax.transAxes)

    if lr:
        ax_lr.plot(*zip(*lr), color="C2", linewidth=1.2)
        if all(v > 0 for _, v in lr):
            ax_lr.set_yscale("log")  # OneCycle spans ~4 decades; linear would hide warmup and the tail
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_loss_curves(records: Iterable[dict[str, Any]], png_path: str | Path, title: str = "",
                     best_epoch: int | None = None) -> Path | None:
    """Write `loss_curve_figure(records, title, best_epoch)` to `png_path` (atomically: no torn PNG on a crash).

    Returns the PNG path, or None when matplotlib is not installed (a warning says so).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        warnings.warn("matplotlib is not installed; no loss_curve.png written", stacklevel=2)
        return None
    fig = loss_curve_figure(records, title=title, best_epoch=best_epoch)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = png_path.with_name(png_path.name + ".tmp")
    try:
        fig.savefig(tmp, format="png")
        tmp.replace(png_path)
    finally:
        tmp.unlink(missing_ok=True)
    return png_path


def _ema(values: Iterable[float], weight: float) -> list[float]:
    """Debiased exponential moving average (the first points are not pulled toward 0)."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg = weight * avg + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(avg / norm if norm > 0 else v)
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
