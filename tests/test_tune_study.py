"""kronos tune's study (finetune/utils/tune.py): parallel workers' draws, PBO's ties, bounds of its counts."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from finetune.utils import tune
from finetune_csv import walk_forward as wf
from model.errors import EXIT_CONFIG, ConfigError
from tests.test_tune import tune_config  # noqa: F401 (the fixture)
from tests.test_walk_forward import run_config  # noqa: F401 (the fixture)

SPACE = {"predictor_training.lr": {"low": 1e-5, "high": 1e-2, "log": True}}


def _worker(folder: str) -> None:
    """One worker of a 6-trial study whose objective takes a second (the units' cost, without training)."""
    tc = tune.TuneConfig(n_trials=6, space=SPACE, heartbeat_seconds=2)
    study = tune.open_study(Path(folder), tc, {"setup": 1}, [], 3)
    tune.work(
        study,
        tc,
        Path(folder),
        {"predictor_training": {"lr": 1e-3}},
        {"predictor_training.lr": 1e-3},
        lambda params, number: (time.sleep(1.0), {"2024-01-01": params["predictor_training.lr"]})[1],
    )


@pytest.mark.slow
def test_three_workers_of_a_six_trial_study_evaluate_six_distinct_settings(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    jobs = [ctx.Process(target=_worker, args=(str(tmp_path),)) for _ in range(3)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(120)
    assert [job.exitcode for job in jobs] == [0, 0, 0]
    trials = tune.trial_table(tune.open_study(tmp_path, tune.TuneConfig(space=SPACE), {"setup": 1}, [], 1))[0]
    settings = [r["settings"]["predictor_training.lr"] for r in trials["list"] if r["state"] == "complete"]
    assert len(settings) == 6 and len(set(settings)) == 6, settings


def test_pbo_of_a_dominating_setting_with_an_exact_duplicate_is_zero():
    rng = np.random.default_rng(0)
    best = rng.standard_normal(16) - 10.0
    inner = pd.DataFrame([best, best, rng.standard_normal(16)], columns=range(16))
    assert tune.pbo(inner) == 0.0


@pytest.mark.parametrize("value", ["1000000000000", "1e12"])
def test_a_count_beyond_its_bound_is_refused_at_load_on_the_command_line_and_in_a_tune_space(
    tune_config,  # noqa: F811
    tmp_path,
    value,
):
    for flags in (
        ["--set", f"predictor_training.epochs={value}"],
        ["--set", f"tune.space={{predictor_training.epochs: {{low: 1, high: {value}}}}}"],
    ):
        with pytest.raises(ConfigError, match="predictor_training.epochs") as err:
            wf.tune_main(["--config", str(tune_config), *flags])
        assert err.value.exit_code == EXIT_CONFIG
    assert not (tmp_path / "out/wf/tune").exists()


def test_epochs_at_the_bound_load_and_above_it_are_named_with_the_bound(tune_config):  # noqa: F811
    import finetune_csv.config as csv_config

    assert csv_config.load(tune_config, ["predictor_training.epochs=100000"]).predictor_training.epochs == 100_000
    with pytest.raises(ConfigError, match=r"predictor_training.epochs: must be <= 100_000.*got 100001"):
        csv_config.load(tune_config, ["predictor_training.epochs=100001", "tune.n_trials=1000000"])
    with pytest.raises(ConfigError, match=r"tune.n_trials: must be <= 100_000"):
        csv_config.load(tune_config, ["tune.n_trials=1000000"])


@pytest.mark.slow
def test_a_unit_trained_by_a_run_stopped_before_recording_it_is_in_trainings_jsonl_after_the_rerun(
    tune_config,  # noqa: F811
    tmp_path,
):
    import finetune_csv.config as csv_config
    from finetune_csv.prepare import prepare_data

    cfg = csv_config.load(tune_config)
    data = prepare_data(cfg.data, cfg.store_dir, with_splits=False)
    files = [f.get("sha256") for f in data.store.manifest.get("sources", [])]
    fold, out = wf.tune_folds(cfg, data.panel, True)[0], cfg.base_dir / "tune"
    folder = out / "units" / tune.unit_fingerprint(wf._settings(cfg), wf.fold_dates(fold), files)
    wf._train_fold(cfg, fold, folder)  # what a run SIGTERMed after the unit's last epoch leaves: trained, unrecorded
    wf._unit(cfg, cfg, fold, out, files)  # the rerun reuses it
    assert [json.loads(line)["unit"] for line in (out / "trainings.jsonl").read_text().splitlines()] == [folder.name]
