"""Training metrics: a JSON-lines log (always), TensorBoard / Comet (only when enabled and installed), a loss plot.

Only rank 0 creates a `MetricsLogger(enabled=True)`; on other ranks `enabled=False` makes every call a no-op, so
the loop does not branch. Each record is one JSON object per line in `metrics.jsonl`, e.g.
    {"kind": "train", "step": 20, "epoch": 0, "lr": 1.9e-4, "loss": 0.41, "samples_per_s": 812.0, ...}
    {"kind": "val", "step": 40, "epoch": 0, "val_loss": 0.38, "best_val_loss": 0.38, ...}
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "read_metrics", "plot_loss_curves"]


class MetricsLogger:
    """Append records to `<folder>/metrics.jsonl` and mirror numbers to TensorBoard / Comet if asked.

    Args:
        folder: output folder (created if needed).
        enabled: False on non-main ranks: nothing is created or written.
        tensorboard: also write TensorBoard events under `<folder>/tensorboard` (needs the tensorboard package).
        comet: also log to Comet (needs comet_ml and its API key in the environment).
        comet_project: Comet project name.
        run_name: name shown in Comet.
        resume_step: when resuming from the checkpoint of this optimizer step, drop records of later steps (they
            were logged by the interrupted run and are about to be redone) instead of duplicating them.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = False,
        comet: bool = False,
        comet_project: str | None = None,
        run_name: str | None = None,
        resume_step: int | None = None,
    ):
        self.enabled = enabled
        self.path = Path(folder) / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._comet = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.unlink(missing_ok=True)  # a fresh run starts a fresh log
        elif self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(folder) / "tensorboard"))
            except ImportError:
                warnings.warn("training.tensorboard is true but tensorboard is not installed; skipping it")
        if comet:
            try:
                import comet_ml

                self._comet = comet_ml.Experiment(project_name=comet_project or None)
                if run_name:
                    self._comet.set_name(run_name)
            except ImportError:
                warnings.warn("training.comet is true but comet_ml is not installed; skipping it")

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (a flat dict of numbers/strings; must hold "step")."""
        if not self.enabled:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(record, default=float) + "\n")  # NaN/inf -> null: strict JSON for any reader
        self._file.flush()
        step = int(record.get("step", 0))
        prefix = record.get("kind", "train")
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numbers.items():
                if k not in ("step",):
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if self._comet is not None:
            self._comet.log_metrics(numbers, prefix=prefix, step=step)

    def log_params(self, params: dict[str, Any]) -> None:
        """Send the resolved config to Comet / TensorBoard (the JSON log keeps it in run_info.json instead)."""
        if not self.enabled:
            return
        if self._comet is not None:
            self._comet.log_parameters(_flatten(params))
        if self._tb is not None:
            self._tb.add_text("config", "```\n" + json.dumps(params, indent=2, default=str) + "\n```", 0)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._comet is not None:
            self._comet.end()
            self._comet = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


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


def plot_loss_curves(records: Iterable[dict[str, Any]], png_path: str | Path, title: str = "") -> Path | None:
    """Plot train loss (per logged step) and validation loss (per epoch) against the optimizer step.

    Returns the PNG path, or None when matplotlib is not installed (a warning says so).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window (works on headless training machines)
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed; no loss_curve.png written")
        return None
    records = list(records)
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and _finite(r.get("loss"))]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "val" and _finite(r.get("val_loss"))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", linewidth=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
