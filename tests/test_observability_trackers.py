"""Experiment trackers behind MetricsLogger: MLflow (real, offline store in tmp_path), TensorBoard, missing packages."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest

from finetune.utils.errors import TrackerUnavailable
from finetune.utils.metrics import MetricsLogger, default_mlflow_uri, flatten_params, read_metrics
from finetune.utils.schema import tracker_problems
from model.errors import ConfigError

CONFIG = {"training": {"lr": 2e-4, "epochs": 3, "betas": [0.9, 0.95]}, "model": {"pretrained": "NeoQuasar/x"}}


def _log_run(logger: MetricsLogger, steps) -> None:
    for step in steps:
        logger.log({"kind": "train", "step": step, "epoch": 1, "loss": 1.0 / step, "lr": 1e-4})
    logger.log({"kind": "val", "step": steps[-1], "epoch": 1, "val_loss": 0.5, "stage": "tokenizer"})


def _client(folder):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=default_mlflow_uri(folder))


@pytest.mark.slow  # MLflow creates its SQLite schema on first use (several seconds)
def test_mlflow_run_holds_params_metrics_and_artifacts_and_resume_continues_it(tmp_path):
    pytest.importorskip("mlflow")
    out = tmp_path / "tokenizer"
    logger = MetricsLogger(out, mlflow=True, mlflow_experiment="exp-test", run_name="run-a")
    logger.log_params(CONFIG)
    _log_run(logger, [1, 2, 4])
    (out / "run_info.json").write_text("{}", encoding="utf-8")
    (out / "loss_curve.png").write_bytes(b"png")
    logger.log_artifacts(out / "loss_curve.png", out / "run_info.json", None, out / "missing.txt")
    logger.close()

    client = _client(out)
    run_id = (out / "mlruns" / "run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert client.get_experiment(run.info.experiment_id).name == "exp-test"
    assert run.data.params["training.lr"] == "0.0002" and run.data.params["model.pretrained"] == "NeoQuasar/x"
    assert json.loads(run.data.params["training.betas"]) == [0.9, 0.95]
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (4, 0.25)]
    assert [m.value for m in client.get_metric_history(run_id, "val/val_loss")] == [0.5]
    assert "train/step" not in run.data.metrics  # the step is the x axis, not a metric
    assert sorted(a.path for a in client.list_artifacts(run_id)) == ["loss_curve.png", "run_info.json"]

    # A resumed stage continues the same run; a failed close marks it FAILED.
    resumed = MetricsLogger(out, mlflow=True, mlflow_experiment="exp-test", run_name="run-a", resume_step=4)
    resumed.log({"kind": "train", "step": 5, "epoch": 2, "loss": 0.2})
    resumed.close(failed=True)
    assert (out / "mlruns" / "run_id").read_text().strip() == run_id
    assert client.get_run(run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2, 4, 5]
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # A fresh run of the stage is a new MLflow run in the same experiment.
    with MetricsLogger(out, mlflow=True, mlflow_experiment="exp-test") as fresh:
        fresh.log({"kind": "train", "step": 1, "epoch": 1, "loss": 3.0})
    assert (out / "mlruns" / "run_id").read_text().strip() != run_id
    assert len(client.search_runs([run.info.experiment_id])) == 2


def test_missing_tracker_package_is_a_config_error_naming_the_setting(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("mlflow", "comet_ml") else real(name, *a))
    assert tracker_problems(mlflow=True, comet=True, tensorboard=False) == [
        ("training.mlflow", "is true but mlflow is not installed: `pip install mlflow` or set it to false"),
        ("training.comet", "is true but comet_ml is not installed: `pip install comet_ml` or set it to false"),
    ]
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        MetricsLogger(tmp_path, mlflow=True)
    assert isinstance(err.value, TrackerUnavailable)
    assert "training.mlflow" in str(err.value) and "pip install mlflow" in str(err.value)
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"kind": "train", "step": 1}]  # nothing touched
    assert not (tmp_path / "mlruns").exists()


def test_disabled_logger_opens_no_tracker_even_if_asked(tmp_path):
    logger = MetricsLogger(tmp_path / "out", enabled=False, mlflow=True, tensorboard=True)
    logger.log({"kind": "train", "step": 1, "loss": 1.0})
    logger.log_artifacts(tmp_path)
    logger.close()
    assert logger.trackers == [] and not (tmp_path / "out").exists()


def test_flatten_params_joins_nested_keys_with_dots():
    assert flatten_params(CONFIG) == {"training.lr": 2e-4, "training.epochs": 3, "training.betas": [0.9, 0.95],
                                      "model.pretrained": "NeoQuasar/x"}


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as logger:
        logger.log_params(CONFIG)
        _log_run(logger, [1, 2, 4])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5), (4, 0.25)]
    assert [e.value for e in events.Scalars("val/val_loss")] == [0.5]


class _CometExperiment:
    """Stands in for comet_ml.Experiment: records the calls our CometTracker makes (no account, no network)."""

    made: list[_CometExperiment] = []

    def __init__(self, project_name=None):
        self.project, self.calls = project_name, []
        _CometExperiment.made.append(self)

    def __getattr__(self, name):  # set_name, log_metrics, log_parameters, log_asset, end
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_comet_experiment_gets_the_name_params_metrics_artifacts_and_one_end(tmp_path, monkeypatch):
    comet = types.ModuleType("comet_ml")
    comet.__spec__ = importlib.machinery.ModuleSpec("comet_ml", None)  # find_spec (tracker_problems) sees it
    comet.Experiment = _CometExperiment
    monkeypatch.setitem(sys.modules, "comet_ml", comet)
    monkeypatch.setattr(_CometExperiment, "made", [])
    (tmp_path / "run_info.json").write_text("{}")
    with MetricsLogger(tmp_path / "out", comet=True, comet_project="proj", run_name="run-a") as logger:
        logger.log_params(CONFIG)
        _log_run(logger, [1, 2])
        logger.log_artifacts(tmp_path / "run_info.json", tmp_path / "missing.png", None)
    (experiment,) = _CometExperiment.made
    assert experiment.project == "proj"
    assert experiment.calls == [
        ("set_name", ("run-a",), {}),
        ("log_parameters", (flatten_params(CONFIG),), {}),
        ("log_metrics", ({"epoch": 1, "loss": 1.0, "lr": 1e-4},), {"prefix": "train", "step": 1}),
        ("log_metrics", ({"epoch": 1, "loss": 0.5, "lr": 1e-4},), {"prefix": "train", "step": 2}),
        ("log_metrics", ({"epoch": 1, "val_loss": 0.5},), {"prefix": "val", "step": 2}),
        ("log_asset", (str(tmp_path / "run_info.json"),), {}),  # the missing file and None are skipped
        ("end", (), {}),
    ]
    assert read_metrics(tmp_path / "out" / "metrics.jsonl")[0]["loss"] == 1.0  # the JSON log is written as well
