"""Training metrics: a JSON-lines log (metrics.jsonl), the experiment trackers it mirrors to (rank 0 only), and
run_info.json. Backends, their install errors and MLflow's offline store: docs/architecture.md, "Formats and
designs"."""

from __future__ import annotations

import datetime
import json
import math
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from finetune.utils.errors import TrackerUnavailable
from finetune.utils.schema import tracker_problems
from model.fileio import write_json

_MLFLOW_PARAM_CHARS = 6000  # MLflow rejects longer parameter values
_MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit; metrics allow 1000)


def flatten_params(d: Any, prefix: str = "", lists: bool = False) -> dict[str, Any]:
    """Nested config dict -> {"training.lr": 2e-4, ...}: lists and other leaves kept as they are, or with `lists`
    each list item under its own key (`a.b[0]`; an empty list stays a leaf)."""
    if isinstance(d, Mapping):
        items = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in d.items()]
    elif lists and isinstance(d, list) and d:
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(d)]
    else:
        return {prefix: d}
    return {key: leaf for k, v in items for key, leaf in flatten_params(v, k, lists).items()}


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
        """Attach finished files (loss_curve.png, run_info.json; `MetricsLogger` passes existing ones only)."""

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
    of one process (and tests) never log into each other's run."""

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
            self.experiment.log_asset(str(p))

    def close(self, failed: bool = False) -> None:
        self.experiment.end()


def open_trackers(folder: str | Path, *, tensorboard: bool = False, mlflow: bool = False,
                  mlflow_tracking_uri: str | None = None, mlflow_experiment: str = "kronos-finetune",
                  comet: bool = False, comet_project: str | None = None, run_name: str | None = None,
                  resume: bool = False) -> list[Tracker]:
    """One `Tracker` per enabled backend of a stage (rank 0 only: the caller guards it); `TrackerUnavailable` naming
    every enabled backend not installed. mlflow_tracking_uri None = the offline `default_mlflow_uri(folder)`;
    resume continues this stage's earlier MLflow run."""
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


_LIBRARIES = ("torch", "numpy", "pandas", "pyqlib", "safetensors", "pyyaml", "huggingface_hub", "matplotlib",
              "tensorboard", "mlflow")  # the last three: plot and trackers, so a run says which it used


def library_versions() -> dict[str, str | None]:
    """Python and library versions (None for a library that is not installed), plus CUDA when present."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    import torch  # a dependency of the engine (imported here only to keep this module's import light)

    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda if torch.cuda.is_available() else None
    return out


def git_commit(path: str | Path | None = None) -> dict[str, Any] | None:
    """{"commit": sha, "dirty": bool} of the git checkout holding `path` (this package by default), else None."""
    where = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10,
                             check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(status.strip())} if sha else None


def write_run_info(folder: str | Path, config: Any, data: dict[str, Any] | None = None,
                   extra: dict[str, Any] | None = None) -> Path:
    """Write `<folder>/run_info.json` atomically (rank 0 only: the caller guards it) and return its path: time,
    command line, config, library versions, git commit, data, and `extra`."""
    info = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": sys.argv,
            "config": config, "versions": library_versions(), "git": git_commit(), "data": data, **(extra or {})}
    return write_json(Path(folder) / "run_info.json", info)


class MetricsLogger:
    """Append records to `<folder>/metrics.jsonl` (nothing when not `enabled`: other ranks) and mirror their numbers
    to the trackers `tracking` names (`open_trackers`; a missing package: `TrackerUnavailable` before any write).
    resume_step: records of later steps (the interrupted run's, about to be redone) are dropped, not duplicated;
    the stage's MLflow run is continued."""

    def __init__(self, folder: str | Path, *, enabled: bool = True, resume_step: int | None = None, **tracking: Any):
        self.enabled = enabled
        self.path = Path(folder) / "metrics.jsonl"
        self._file = None
        self.trackers: list[Tracker] = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Trackers first: a missing package fails here, before the old metrics.jsonl is touched.
        self.trackers = open_trackers(folder, resume=resume_step is not None, **tracking)
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
        for tracker in self.trackers:
            tracker.log_params(params)

    def log_artifacts(self, *paths: str | Path | None) -> None:
        """Attach finished files (loss_curve.png, run_info.json) to the tracker runs; None / missing are skipped."""
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
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # also a blank line
                continue
    return records
