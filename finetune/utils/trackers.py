"""Experiment trackers the metrics log mirrors to: TensorBoard, MLflow, Comet (each optional, each opt-in).

`MetricsLogger` (metrics.py) always writes metrics.jsonl; with `training.tensorboard`, `training.mlflow` or
`training.comet` set it also hands every record to one `Tracker` per backend built by `open_trackers`. Only rank 0
builds trackers (the logger is disabled elsewhere), so a torchrun job makes one run per stage, not one per process.

Each backend's package is imported only when it is enabled. A backend that is enabled but not installed is a
configuration mistake: `tracker_problems` names it (for the up-front config check) and `open_trackers` raises
`TrackerUnavailable` (a `ConfigError`) with the setting to change and the `pip install` line.

MLflow works offline by default: the tracking store is `<stage folder>/mlruns/mlflow.db` (SQLite; MLflow 3 refuses
plain-file stores) and artefacts go to `<stage folder>/mlruns/artifacts`; view them with
    mlflow ui --backend-store-uri sqlite:///<stage folder>/mlruns/mlflow.db
A resumed stage continues the MLflow run it started (its id is kept in `<stage folder>/mlruns/run_id`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .config_utils import ConfigError

__all__ = [
    "CometTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackerUnavailable",
    "default_mlflow_uri",
    "flatten_params",
    "open_trackers",
    "tracker_problems",
]

# setting -> (module to import, pip package): what each backend needs installed.
_NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
          "comet": ("comet_ml", "comet_ml")}

_MLFLOW_PARAM_CHARS = 6000  # MLflow rejects longer parameter values
_MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit; metrics allow 1000)


class TrackerUnavailable(ConfigError):
    """A tracker is enabled in the config but its package is not installed."""


def tracker_problems(*, tensorboard: bool = False, mlflow: bool = False, comet: bool = False,
                     prefix: str = "training") -> list[tuple[str, str]]:
    """(yaml key, message) for every enabled tracker whose package is missing; [] when all can be used.

    Lets config validation report a missing package before any data is loaded or model built.
    """
    out = []
    for name, enabled in (("tensorboard", tensorboard), ("mlflow", mlflow), ("comet", comet)):
        module, package = _NEEDS[name]
        if enabled and importlib.util.find_spec(module) is None:
            out.append((f"{prefix}.{name}" if prefix else name,
                        f"is true but {package} is not installed: `pip install {package}` or set it to false"))
    return out


def flatten_params(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config dict -> {"training.lr": 2e-4, ...} (lists and other leaves kept as they are)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten_params(v, key))
        else:
            out[key] = v
    return out


def default_mlflow_uri(folder: str | Path) -> str:
    """The offline tracking store of a stage: `sqlite:///<folder>/mlruns/mlflow.db` (absolute path)."""
    return "sqlite:///" + str((Path(folder) / "mlruns" / "mlflow.db").resolve())


class Tracker:
    """One experiment-tracking backend; the base class ignores everything (so subclasses override what they use)."""

    def log_metrics(self, prefix: str, numbers: Mapping[str, float], step: int) -> None:
        """Record the finite `numbers` of one metrics.jsonl record under `prefix/` at optimizer step `step`."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Record the resolved config (nested dict)."""

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        """Attach finished files (loss_curve.png, run_info.json) to the run."""

    def close(self, failed: bool = False) -> None:
        """End the run (`failed` marks it so where the backend knows run states)."""


class TensorBoardTracker(Tracker):
    """Event files under `<folder>/tensorboard` (view: `tensorboard --logdir <folder>/tensorboard`)."""

    def __init__(self, folder: Path):
        # needs the tensorboard package
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder / "tensorboard"))

    def log_metrics(self, prefix: str, numbers: Mapping[str, float], step: int) -> None:
        for k, v in numbers.items():
            self.writer.add_scalar(f"{prefix}/{k}", v, step)
        self.writer.flush()  # a crashed run still shows its curve up to here

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(params, indent=2, default=str) + "\n```", 0)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class MLflowTracker(Tracker):
    """One MLflow run per stage: flattened config as params, every record's numbers as metrics, final artefacts.

    Uses `MlflowClient` with an explicit run id rather than MLflow's process-global active run, so the two stages
    of one process (and tests) never log into each other's run.
    """

    def __init__(self, folder: Path, tracking_uri: str | None, experiment: str, run_name: str | None,
                 resume: bool):
        from mlflow.entities import RunStatus
        from mlflow.tracking import MlflowClient

        self._status = RunStatus
        store = folder / "mlruns"
        if tracking_uri is None:
            store.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=tracking_uri or default_mlflow_uri(folder))
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            # Offline default: artefacts beside the store; a user's server decides its own artefact location.
            location = (store / "artifacts").resolve().as_uri() if tracking_uri is None else None
            experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        self._id_file = store / "run_id"
        self.run_id = self._previous_run() if resume else None
        if self.run_id is not None:
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            store.mkdir(parents=True, exist_ok=True)
            self._id_file.write_text(self.run_id + "\n", encoding="utf-8")

    def _previous_run(self) -> str | None:
        """The run id an interrupted run of this stage left, if that run still exists in the store."""
        if not self._id_file.exists():
            return None
        run_id = self._id_file.read_text(encoding="utf-8").strip()
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:  # deleted or from another store: start a new run instead of failing the resume
            return None
        return run_id

    def log_metrics(self, prefix: str, numbers: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{prefix}/{k}", float(v), now, step) for k, v in numbers.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_value(v)) for k, v in flatten_params(params).items()]
        for i in range(0, len(items), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _MLFLOW_BATCH])

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        for p in paths:
            if p is not None and Path(p).exists():
                self.client.log_artifact(self.run_id, str(p))

    def close(self, failed: bool = False) -> None:
        status = self._status.FAILED if failed else self._status.FINISHED
        self.client.set_terminated(self.run_id, status=self._status.to_string(status))


class CometTracker(Tracker):
    """A Comet experiment (needs comet_ml and its API key in the environment)."""

    def __init__(self, project: str | None, run_name: str | None):
        import comet_ml

        self.experiment = comet_ml.Experiment(project_name=project or None)
        if run_name:
            self.experiment.set_name(run_name)

    def log_metrics(self, prefix: str, numbers: Mapping[str, float], step: int) -> None:
        self.experiment.log_metrics(dict(numbers), prefix=prefix, step=step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.experiment.log_parameters(flatten_params(params))

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        for p in paths:
            if p is not None and Path(p).exists():
                self.experiment.log_asset(str(p))

    def close(self, failed: bool = False) -> None:
        self.experiment.end()


def open_trackers(
    folder: str | Path,
    *,
    tensorboard: bool = False,
    mlflow: bool = False,
    mlflow_tracking_uri: str | None = None,
    mlflow_experiment: str = "kronos-finetune",
    comet: bool = False,
    comet_project: str | None = None,
    run_name: str | None = None,
    resume: bool = False,
) -> list[Tracker]:
    """The enabled trackers of a stage (rank 0 only: the caller guards it).

    Parameters
    ----------
    folder: the stage's output folder (TensorBoard events and the default MLflow store go under it).
    tensorboard, mlflow, comet: which backends to open.
    mlflow_tracking_uri: None = the offline store `default_mlflow_uri(folder)`; else any MLflow tracking URI.
    mlflow_experiment: MLflow experiment name (created if missing).
    comet_project: Comet project name.
    run_name: the run's name in MLflow / Comet.
    resume: continue this stage's earlier MLflow run instead of starting a new one.

    Returns
    -------
    One `Tracker` per enabled backend. Raises `TrackerUnavailable` naming every enabled backend not installed.
    """
    missing = tracker_problems(tensorboard=tensorboard, mlflow=mlflow, comet=comet)
    if missing:
        raise TrackerUnavailable([f"{k}: {m}" for k, m in missing], "Experiment tracker not installed")
    folder = Path(folder)
    trackers: list[Tracker] = []
    try:
        if tensorboard:
            trackers.append(TensorBoardTracker(folder))
        if mlflow:
            trackers.append(MLflowTracker(folder, mlflow_tracking_uri, mlflow_experiment, run_name, resume))
        if comet:
            trackers.append(CometTracker(comet_project, run_name))
    except BaseException:
        for t in trackers:  # no half-open runs left behind when a later backend fails to start
            t.close(failed=True)
        raise
    return trackers


def _param_value(v: Any) -> str:
    """A parameter as MLflow stores it: a string of at most 6000 characters."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text if len(text) <= _MLFLOW_PARAM_CHARS else text[: _MLFLOW_PARAM_CHARS - 3] + "..."
