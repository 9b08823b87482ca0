"""kronos tune (finetune/utils/tune.py + finetune_csv/walk_forward.py): selection, verdict, PBO, study, units."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from finetune.evaluation.statistics import paired_test
from finetune.utils import tune
from finetune_csv import walk_forward as wf
from model.errors import RefusedError
from tests.test_walk_forward import run_config  # noqa: F401 (the fixture)


def simulate(n: int, reps: int, planted: float = 0.0, seed: int = 0, inner_dates: int = 120,
             outer_dates: int = 200) -> dict:
    """Per-trial per-date (trial - zero_shot) scores with no effect (trial n-1 `planted` SD better), through the
    selection and verdict code `kronos tune` runs: shares of outer / in-sample "helps", found, mean PBO."""
    rng = np.random.default_rng(seed)
    outer_helps = inner_helps = found = 0
    pbos = []
    for _ in range(reps):
        shift = np.zeros((n, 1))
        shift[-1] = -planted
        inner = pd.DataFrame(rng.standard_normal((n, inner_dates)) + shift, columns=range(inner_dates))
        outer = rng.standard_normal((n, outer_dates)) + shift
        res = tune.in_sample(inner, paired_test)
        inner_helps += res["optimistic"]["verdict"] == "helps"
        outer_helps += paired_test(outer[res["selected"]], np.arange(outer_dates))["verdict"] == "helps"
        found += res["selected"] == n - 1
        if res["pbo"] is not None:
            pbos.append(res["pbo"])
    return {"outer": outer_helps / reps, "inner": inner_helps / reps, "found": found / reps,
            "pbo": float(np.mean(pbos)) if pbos else None}


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 5, 20, 50])
def test_under_the_null_the_outer_verdict_rarely_says_helps_while_in_sample_best_of_20_often_does(n):
    got = simulate(n, reps=300, seed=n)
    assert got["outer"] <= 0.05, got
    if n == 20:
        assert got["inner"] >= 0.20, got  # why the outer rule exists: the best of 20 judged on its own dates
    if n >= 5:
        assert 0.4 <= got["pbo"] <= 0.6, got


@pytest.mark.slow
def test_a_setting_planted_half_an_sd_better_is_found_and_judged_helps_with_low_pbo():
    got = simulate(20, reps=200, planted=0.5, seed=1)
    assert got["found"] >= 0.9 and got["outer"] >= 0.9 and got["pbo"] <= 0.2, got


def test_expected_best_of_n_under_no_effect():
    assert tune.expected_best_null(1) == pytest.approx(0.0, abs=1e-9)
    assert tune.expected_best_null(2) == pytest.approx(1 / np.sqrt(np.pi), rel=1e-6)
    assert tune.expected_best_null(20) == pytest.approx(1.8675, abs=1e-3)


def test_unit_fingerprint_ignores_forecast_only_settings_and_nothing_else():
    base = {"forecast": {"temperature": 1.0, "sample_count": 20, "window_stride": None}, "training": {"lr": 1e-4}}
    fp = tune.unit_fingerprint(base, ["2024-01-01"], ["abc"])
    assert tune.unit_fingerprint({**base, "forecast": {**base["forecast"], "temperature": 0.6, "sample_count": 4}},
                                 ["2024-01-01"], ["abc"]) == fp
    for other in (({**base, "training": {"lr": 2e-4}}, ["2024-01-01"], ["abc"]), (base, ["2024-01-02"], ["abc"]),
                  (base, ["2024-01-01"], ["abd"])):
        assert tune.unit_fingerprint(*other) != fp


TUNE = """
tune:
  n_trials: 3
  inner_folds: 2
  heartbeat_seconds: 2
  space:
    predictor_training.lr: {low: 1.0e-4, high: 1.0e-2, log: true}
    forecast.temperature: {low: 0.6, high: 1.4}
"""


@pytest.fixture
def tune_config(request):
    """tests/test_walk_forward.py's two-fold config with a 3-trial study of one training and one forecast key."""
    config = request.getfixturevalue("run_config")
    config.write_text(config.read_text() + TUNE)
    return config


def trainings(out) -> list[str]:
    path = out / "trainings.jsonl"
    return [json.loads(line)["unit"] for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.slow
def test_a_small_csv_study_end_to_end_writes_the_report_and_a_rerun_trains_nothing(tune_config, tmp_path, capsys):
    assert wf.tune_main(["--config", str(tune_config)]) == 0
    out = tmp_path / "out/wf/tune"
    report = json.loads((out / "report.json").read_text())
    assert report["trials"]["complete"] == 3 and report["trials"]["failed"] == 0
    assert report["trials"]["list"][0]["defaults"] and report["trials"]["list"][0]["settings"] == {
        "predictor_training.lr": 1e-3, "forecast.temperature": 1.0}
    assert set(report["outer"]) == {"tuned_vs_zero_shot", "tuned_vs_default"}
    assert report["verdict"] in ("helps", "hurts", "no_evidence") and "best by CRPS" in report["best"]["line"]
    assert {"tuned", "default", "zero_shot", "persistence"} <= set(report["best"]["ranking"])
    assert "verdict:" in capsys.readouterr().out
    units = trainings(out)
    assert len(units) == len(set(units))  # no unit trained twice
    # units = 2 inner folds x distinct lr + 2 outer folds x (selected, default): the defaults' outer units are shared
    # when trial 0 is selected
    lrs = {r["settings"]["predictor_training.lr"] for r in report["trials"]["list"]}
    assert len(units) == 2 * len(lrs) + 2 * len({1e-3, report["selected"]["settings"]["predictor_training.lr"]})
    # a re-run (more trials would continue the study) trains and reports the same
    assert wf.tune_main(["--config", str(tune_config)]) == 0
    assert trainings(out) == units
    assert json.loads((out / "report.json").read_text())["outer"] == report["outer"]
    # the audit's edit: a trial's value in the journal made the best; refused naming the journal, the report kept
    other = next(r["number"] for r in report["trials"]["list"] if r["number"] != report["selected"]["number"])
    journal, kept = out / "journal.log", (out / "report.json").read_text()
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    for r in records:
        if r.get("trial_id") == other and r.get("state") == 1:
            r["values"] = [-1.0]
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(RefusedError, match=rf"journal.log: trial {other}'s recorded settings or scores"):
        wf.tune_main(["--config", str(tune_config)])
    assert (out / "report.json").read_text() == kept
    journal.unlink()  # the fix the refusal names: the study re-runs from its units, nothing retrains
    assert wf.tune_main(["--config", str(tune_config)]) == 0
    assert trainings(out) == units
    again = json.loads((out / "report.json").read_text())
    assert (again["selected"], again["outer"]) == (report["selected"], report["outer"])


@pytest.mark.parametrize("seed", range(12))
def test_no_inner_training_or_scoring_bar_lies_after_the_first_judged_target_minus_purge_and_embargo(seed):
    from finetune.utils.config_utils import build_config
    from finetune_csv.config import CsvFinetuneConfig
    from tests.test_walk_forward import panel

    rng = np.random.default_rng(seed)
    p = panel([int(n) for n in rng.integers(260, 400, 3)], [f"2024-03-0{int(d)} 00:00" for d in rng.integers(1, 4, 3)])
    predict = int(rng.integers(2, 6))
    purge, embargo = predict + int(rng.integers(0, 5)), int(rng.integers(0, 6))
    cfg = build_config(CsvFinetuneConfig, {}, values={
        "data.lookback": 16, "data.predict": predict, "data.val_ratio": 0.2,
        "walk_forward.folds": int(rng.integers(1, 4)), "walk_forward.test_bars": 12, "walk_forward.purge": purge,
        "walk_forward.embargo": embargo,
        "tune.inner_folds": int(rng.integers(1, 4))})
    calendar = np.unique(p.datetimes)
    for k, judged in enumerate(wf.tune_folds(cfg, p, inner=False)):  # nested mode: fold k's search (k = 0: holdout's)
        first_target = int(np.min(np.asarray(p.datetimes)[judged.test.first_target[judged.test.stop
                                                                                   > judged.test.first_target]]))
        limit = calendar[np.searchsorted(calendar, first_target) - purge - embargo]  # the first bar inner may not use
        for fold in wf.tune_folds(cfg, p, inner=True, before=k):
            for seg in (fold.train, fold.val, fold.test):
                used = seg.stop > seg.start
                assert (np.asarray(p.datetimes)[seg.stop[used] - 1] < limit).all()


@pytest.mark.slow
def test_forecast_only_trials_train_nothing_and_a_changed_setting_outside_the_space_starts_a_new_study(
        tune_config, tmp_path, caplog):
    only = ["--set", "tune.space={forecast.temperature: {low: 0.6, high: 1.4}, "
                     "forecast.sample_count: {choices: [2, 6]}}"]
    assert wf.tune_main(["--config", str(tune_config), *only]) == 0
    out = tmp_path / "out/wf/tune"
    first = json.loads((out / "report.json").read_text())
    assert first["trials"]["complete"] == 3
    assert len(trainings(out)) == 2 + 2  # trial 0 on 2 inner folds, the selected = given training on 2 outer folds
    assert wf.tune_main(["--config", str(tune_config), *only, "--set", "predictor_training.lr=2.0e-3"]) == 0
    second = json.loads((out / "report.json").read_text())
    assert second["study"]["name"] != first["study"]["name"] and second["trials"]["complete"] == 3
    assert "predictor_training.lr: 0.001 -> 0.002" in caplog.text and "starting study" in caplog.text
    assert second["study"]["studies_judged_on_this_holdout"] == 2


def test_every_space_problem_is_named_before_anything_runs(tune_config, tmp_path):
    from model.errors import ConfigError

    bad = "tune.space={training.lr: {low: 1.0e-3, high: 1.0e-4}, data.lookbak: {choices: [8]}, " \
          "forecast.top_p: {low: 0.5, high: 1.5}, paths.base_dir: {choices: [x]}}"
    with pytest.raises(ConfigError) as err:
        wf.tune_main(["--config", str(tune_config), "--set", bad])
    text = str(err.value)
    for key in ("tune.space.training.lr: low < high", "tune.space.data.lookbak", "tune.space.forecast.top_p: value 1.5",
                "tune.space.paths.base_dir"):
        assert key in text, text
    assert not (tmp_path / "out/wf/tune").exists()


@pytest.mark.slow
def test_a_nested_csv_study_searches_once_per_judged_fold_and_pools_their_selections(tune_config, tmp_path):
    assert wf.tune_main(["--config", str(tune_config), "--set", "tune.mode=nested", "--set", "tune.n_trials=2"]) == 0
    out = tmp_path / "out/wf/tune"
    report = json.loads((out / "report.json").read_text())
    assert [f["fold"] for f in report["folds"]] == [0, 1] and report["trials"]["complete"] == 4
    assert report["selected"] in [f["selected"] for f in report["folds"]]
    assert set(report["outer"]) == {"tuned_vs_zero_shot", "tuned_vs_default"} and report["verdict"] in (
        "helps", "hurts", "no_evidence") and {"tuned", "default", "zero_shot"} <= set(report["best"]["ranking"])
    studies = [json.loads((out / f"fold_{k}/study.json").read_text())["identity"]["inner"] for k in (0, 1)]
    assert studies[0][1] == studies[1][0]  # fold 1's search sees one block more, ending a block later
    units = trainings(out)
    assert len(units) == len(set(units))  # no unit trained twice: fold 1's search reuses fold 0's on their shared block
    lrs = [{r["settings"]["predictor_training.lr"] for r in f["trials"]["list"]} for f in report["folds"]]
    inner = {(json.dumps(d), lr) for dates, ls in zip(studies, lrs) for d in dates for lr in ls}
    assert len(inner) < sum(len(d) * len(ls) for d, ls in zip(studies, lrs))
    judged = {(k, lr) for k, f in enumerate(report["folds"]) for lr in (1e-3, f["selected"]["settings"][
        "predictor_training.lr"])}
    assert len(units) == len(inner) + len(judged)


def test_an_unknown_tune_mode_is_refused_naming_the_setting(tune_config, tmp_path):
    from model.errors import EXIT_CONFIG, ConfigError

    with pytest.raises(ConfigError, match="tune.mode") as err:
        wf.tune_main(["--config", str(tune_config), "--set", "tune.mode=nestd"])
    assert err.value.exit_code == EXIT_CONFIG and not (tmp_path / "out/wf/tune").exists()


def test_qlib_tune_refuses_the_nested_mode_naming_the_setting(tmp_path):
    import yaml

    pytest.importorskip("qlib")
    from finetune.qlib_walk_forward import tune_main
    from model.errors import EXIT_CONFIG, ConfigError
    from tests.test_qlib_pipeline import tiny_config

    cfg = yaml.safe_load(tiny_config(tmp_path).read_text())
    cfg["tune"] = {"mode": "nested", "space": {"forecast.temperature": {"low": 0.5, "high": 1.5}}}
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="tune.mode: nested") as err:
        tune_main(["--config", str(tmp_path / "tune.yaml")])
    assert err.value.exit_code == EXIT_CONFIG


def _same_result(got: dict, expected: dict) -> None:
    """The seeded result, trial numbers aside (a killed trial is re-run under a new number)."""
    assert got["trials"]["complete"] == expected["trials"]["complete"]
    assert got["selected"]["settings"] == expected["selected"]["settings"]
    assert {k: v for k, v in got["inner"].items() if k != "selected"} == \
        {k: v for k, v in expected["inner"].items() if k != "selected"}
    assert (got["outer"], got["pbo"], got["best"]) == (expected["outer"], expected["pbo"], expected["best"])


@pytest.mark.slow
def test_sigkill_a_study_at_random_moments_then_rerun_trains_no_unit_twice_and_equals_the_uninterrupted_study(
        tune_config, tmp_path):
    import random
    import subprocess
    import sys
    import time

    from tests.conftest import cpu_env

    tune_config.write_text(tune_config.read_text().replace("n_trials: 3", "n_trials: 5"))
    env = cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = lambda config: [sys.executable, "-m", "finetune.cli", "tune", "--config", str(config)]
    reference = tmp_path / "reference.yaml"
    reference.write_text(tune_config.read_text().replace(str(tmp_path / "out"), str(tmp_path / "ref")))
    subprocess.run(command(reference), env=env, capture_output=True, text=True, timeout=900, check=True)
    out = tmp_path / "out/wf/tune"
    rng, kills = random.Random(3), 0
    while kills < 5:
        beats = lambda: len([p for p in (out / "heartbeats").glob("*") if p.suffix != ".tmp"])
        before, deadline = beats(), time.monotonic() + 300
        job = subprocess.Popen(command(tune_config), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while job.poll() is None and beats() == before and time.monotonic() < deadline:
            time.sleep(0.05)  # until a trial runs (its heartbeat file appears), then at a random moment of it
        time.sleep(rng.uniform(0.0, 6.0))
        if job.poll() is not None:
            break
        job.kill()
        kills += job.wait() == -9
    assert kills >= 5, f"the study finished after {kills} kills"
    final = subprocess.run(command(tune_config), env=env, capture_output=True, text=True, timeout=900)
    assert final.returncode == 0, final.stderr[-3000:]
    units = trainings(out)
    assert len(units) == len(set(units))  # no finished unit trained again
    got, expected = (json.loads((root / "wf/tune/report.json").read_text()) for root in (tmp_path / "out",
                                                                                          tmp_path / "ref"))
    _same_result(got, expected)
    assert got["trials"]["failed"] >= 1  # the killed trials, re-run with their settings


@pytest.mark.slow
def test_three_workers_on_one_journal_complete_exactly_n_trials_and_train_no_unit_twice(tune_config, tmp_path):
    tune_config.write_text(tune_config.read_text().replace("n_trials: 3", "n_trials: 4"))
    assert wf.tune_main(["--config", str(tune_config), "--workers", "3"]) == 0
    out = tmp_path / "out/wf/tune"
    report = json.loads((out / "report.json").read_text())
    assert report["trials"]["complete"] == 4 and report["trials"]["failed"] == 0
    units = trainings(out)
    assert len(units) == len(set(units))


@pytest.mark.slow
def test_a_small_qlib_study_end_to_end(tmp_path):
    """kronos qlib-tune on tests/test_qlib_walk_forward.py's tiny store: a forecast-only space (one unit trained per
    period, shared by both trials), 2 trials on one inner period before the 2 judged ones."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    pytest.importorskip("qlib")
    from tests.conftest import cpu_env
    from tests.test_qlib_walk_forward import tiny_walk_forward_config

    cfg = tiny_walk_forward_config(tmp_path)
    cfg["tune"] = {"n_trials": 2, "inner_folds": 1, "space": {"forecast.temperature": {"low": 0.5, "high": 1.5}}}
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump(cfg))
    env = cpu_env(DIST_BACKEND="gloo", OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "finetune.cli", "qlib-tune", "--config", str(tmp_path / "tune.yaml"),
                           "--device", "cpu"], cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "models" / "tune"
    report = json.loads((out / "report.json").read_text())
    assert report["trials"]["complete"] == 2 and report["verdict"] in ("helps", "hurts", "no_evidence")
    assert set(report["outer"]) == {"tuned_vs_zero_shot", "tuned_vs_default"} and "verdict: " in proc.stdout
    assert len(list((out / "units").glob("*/finetune_predictor/best_model"))) == 3  # 1 inner + 2 judged periods


def test_without_optuna_tune_names_the_extra_before_any_work(tune_config, tmp_path, monkeypatch):
    import importlib.util

    from model.errors import EXIT_MISSING_EXTRA, MissingExtraError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "optuna" else real(n, *a))
    with pytest.raises(MissingExtraError, match=r"pip install 'kronos-finetune\[tune\]'") as err:
        wf.tune_main(["--config", str(tune_config)])
    assert err.value.exit_code == EXIT_MISSING_EXTRA and not (tmp_path / "out").exists()
