"""kronos tune's study (finetune/utils/tune.py): parallel workers' draws, PBO's ties, bounds of its counts."""

from __future__ import annotations

import json
import multiprocessing
import os
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


def test_pbo_under_persistent_luck_is_not_stated_or_near_a_half_and_counts_its_independent_blocks():
    """Issue 51: each trial's luck AR(1) 0.9, no effect; plain CSCV read 0.24-0.32 (falsely reassuring)."""
    rng = np.random.default_rng(9)
    for dates, draws in ((60, 5), (120, 5), (250, 5), (500, 30)):
        got = []
        for _ in range(draws):
            x = np.empty((20, dates))
            x[:, 0] = rng.standard_normal(20)
            for t in range(1, dates):
                x[:, t] = 0.9 * x[:, t - 1] + np.sqrt(1 - 0.81) * rng.standard_normal(20)
            inner = pd.DataFrame(x, columns=range(dates))
            got.append(tune.pbo(inner))
            assert (got[-1] is None) == (tune.pbo_blocks(inner) < tune.PBO_MIN_SHARE * 8)
        if dates < 500:
            assert got == [None] * draws, (dates, got)  # 2.6-5.6 independent blocks of 8: not stated
        else:  # 6.7 independent blocks: stated, and about a half (one draw is noisy: the mean of 30, s.e. ~0.04)
            assert None not in got and 0.35 <= np.mean(got) <= 0.6, got
    assert tune.pbo_blocks(pd.DataFrame(rng.standard_normal((20, 120)))) > 7.5  # i.i.d. scores: all 8 blocks


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


def _study(folder: Path, n: int) -> dict:
    """A study of `n` trials on `folder`'s journal, its objective free (the lr as the score)."""
    tc = tune.TuneConfig(n_trials=n, space=SPACE, heartbeat_seconds=2)
    study = tune.open_study(folder, tc, {"setup": 1}, [], 1)
    tune.work(
        study,
        tc,
        folder,
        {"predictor_training": {"lr": 1e-3}},
        {"predictor_training.lr": 1e-3},
        lambda params, number: {"2024-01-01": params["predictor_training.lr"]},
    )
    return tune.trial_table(study)[0]


@pytest.mark.parametrize("damage", ["kill mid-write", "truncated copy", "garbled last line"])
def test_a_journal_with_a_broken_last_record_is_cut_back_said_and_the_study_goes_on(tmp_path, caplog, damage):
    _study(tmp_path, 2)
    journal = tmp_path / "journal.log"
    whole = journal.read_bytes()
    journal.write_bytes(
        {
            "kill mid-write": whole + b'{"op_code": 5, "trial_id": 2, "sta',
            "truncated copy": whole[:-7],
            "garbled last line": whole + b"\x00\x00garbage\n",
        }[damage]
    )
    trials = _study(tmp_path, 3)
    assert "cut back to its last whole record" in caplog.text
    assert trials["complete"] == 3 and journal.read_bytes().endswith(b"\n")
    assert _study(tmp_path, 3)["complete"] == 3  # the rerun reads it whole


def test_a_garbled_record_before_the_last_is_refused_naming_the_journal(tmp_path):
    from model.errors import RefusedError

    _study(tmp_path, 2)
    journal = tmp_path / "journal.log"
    lines = journal.read_bytes().split(b"\n")
    journal.write_bytes(b"\n".join([lines[0], b"{garbled", *lines[1:]]))
    with pytest.raises(RefusedError, match="journal.log: record 2 is garbled"):
        _study(tmp_path, 3)


@pytest.mark.slow
def test_an_edited_unit_windows_file_is_scored_again_not_used(tune_config, tmp_path):  # noqa: F811
    import finetune_csv.config as csv_config
    from finetune_csv.prepare import prepare_data

    cfg = csv_config.load(tune_config)
    data = prepare_data(cfg.data, cfg.store_dir, with_splits=False)
    files = [f.get("sha256") for f in data.store.manifest.get("sources", [])]
    fold, out = wf.tune_folds(cfg, data.panel, True)[0], cfg.base_dir / "tune"
    first = wf._unit(cfg, cfg, fold, out, files)
    (rows,) = (out / "units").glob("*/windows_*.csv")
    edited = pd.read_csv(rows)
    edited["crps"] /= 2  # the audit's edit: CRPS halved
    edited.to_csv(rows, index=False)
    pd.testing.assert_frame_equal(wf._unit(cfg, cfg, fold, out, files), first)
    assert len((out / "trainings.jsonl").read_text().splitlines()) == 1  # scored again, not retrained


def _edit(journal: Path, trial: int, what: str) -> None:
    """The audit's edits of a complete trial's record in tune/journal.log, by hand as a user would."""
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    for r in lines:
        if r.get("trial_id") != trial:
            continue
        if what == "value" and r.get("state") == 1:
            r["values"] = [-1.0]  # now the best of all, while its scores say otherwise
        attr = r.get("user_attr") or {}
        if what in attr:
            key = next(iter(attr[what]))
            attr[what][key] = attr[what][key] * (0.5 if what == "scores" else 2)
    journal.write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.mark.parametrize("what", ["value", "scores", "settings"])
def test_an_edited_trial_record_in_the_journal_is_refused_naming_the_journal_not_reported(tmp_path, what):
    import argparse

    from finetune.evaluation.statistics import paired_test
    from model.errors import EXIT_REFUSED, RefusedError

    calls = []
    tc = tune.TuneConfig(n_trials=4, space=SPACE, heartbeat_seconds=2)
    dates = [f"2024-01-{d:02d}" for d in range(1, 9)]

    def objective(params: dict, number: int) -> dict:  # the trial's inner scores, as its units' files give them
        calls.append(number)
        return {d: params["predictor_training.lr"] * (1 + i % 3) for i, d in enumerate(dates)}

    args = argparse.Namespace(worker=False, workers=1, config="tune.yaml", set=[])
    given = {"predictor_training": {"lr": 1e-3}}
    study = lambda: tune.run(tmp_path, tc, {"setup": 1}, [], given, objective, args, "tune", paired_test)
    first = study()
    assert study() == first and sorted(calls) == [0, 0, 1, 1, 2, 2, 3, 3]  # intact: all checked, same report
    other = next(r["number"] for r in first["trials"]["list"] if r["number"] != first["selected"]["number"])
    _edit(tmp_path / "journal.log", other, what)
    with pytest.raises(RefusedError, match=rf"journal.log: trial {other}'s recorded settings or scores") as err:
        study()
    assert err.value.exit_code == EXIT_REFUSED and "delete it" in str(err.value)
    (tmp_path / "journal.log").unlink()  # the fix the refusal names: the study re-runs from the units
    assert {k: v for k, v in study().items() if k != "study"} == {k: v for k, v in first.items() if k != "study"}


@pytest.mark.slow
def test_a_unit_samples_its_validation_windows_once_and_the_zero_shot_once_per_fold_and_sampling(
    tune_config,  # noqa: F811
    monkeypatch,
):
    """Issue 48 item 9: a unit's calibration sampled the validation windows at training and, under a trial's other
    sampling, again when scored; every unit sampled the same zero-shot again. Now one pass each, same numbers."""
    import finetune_csv.config as csv_config
    import finetune_csv.pipeline as pipeline
    from finetune_csv.prepare import prepare_data

    cfg = csv_config.load(tune_config)
    data = prepare_data(cfg.data, cfg.store_dir, with_splits=False)
    files = [f.get("sha256") for f in data.store.manifest.get("sources", [])]
    fold, out = wf.tune_folds(cfg, data.panel, True)[0], cfg.base_dir / "tune"
    passes, frames = [], []
    for module in (wf, pipeline):
        real = module.sample_paths
        spy = lambda *a, real=real, **k: passes.append(len(a[1])) or real(*a, **k)  # noqa: E731
        monkeypatch.setattr(module, "sample_paths", spy)
    trial = lambda **values: csv_config.load(tune_config, [f"{k}={v}" for k, v in values.items()])
    test, val = (len(wf.held_out_windows(s, cfg.data.window)) for s in (fold.test, fold.val))
    for settings, expected in (
        # zero-shot, finetuned, the calibration under this sampling, the zero-shot's own margins (like with like)
        ({}, [test, test, val, val]),
        ({"predictor_training.lr": 0.002, "forecast.temperature": 0.8}, [test, test, val, val]),  # other sampling
        ({"predictor_training.lr": 0.003}, [test, val]),  # the zero-shot's paths of this sampling are kept
        ({"predictor_training.lr": 0.003, "forecast.temperature": 0.8}, [test, val]),  # forecast-only: no training
    ):
        passes.clear()
        frames.append(wf._unit(cfg, trial(**settings), fold, out, files))
        assert passes == expected, settings
    assert len((out / "trainings.jsonl").read_text().splitlines()) == 3
    for kept in (out / "zero_shot").glob("*.npy"):  # T 1.0 and 0.8, test and validation; edited: sampled again
        np.save(kept, np.load(kept) * 0.5)
    passes.clear()
    zero_shot = lambda f: f[f.candidate == "zero_shot"].reset_index(drop=True)  # noqa: E731
    again = wf._unit(cfg, trial(**{"predictor_training.lr": 0.004}), fold, out, files)
    assert passes == [test, test, val, val]
    pd.testing.assert_frame_equal(zero_shot(again), zero_shot(frames[0]))
    # as before: the unit calibrated at training (reusing its trained predictor), scored with a fresh zero-shot
    folder = out / "units" / json.loads((out / "trainings.jsonl").read_text().splitlines()[0])["unit"]
    fold_cfg, _ = wf._train_fold(cfg, fold, folder)
    before = wf.score_fold(cfg, fold_cfg, fold)
    now = wf._unit(cfg, cfg, fold, out, files)
    pd.testing.assert_frame_equal(now, before, check_dtype=False, check_exact=False, rtol=1e-12)


def test_a_partial_last_line_is_left_alone_while_another_workers_heartbeat_is_fresh(tmp_path):
    """Another worker (another host here) may be writing that line: cutting the file would drop its record. Once
    its heartbeat is stale (3 beats), the line is a kill's leftover and is cut back."""
    journal, beats = tmp_path / "journal.log", tmp_path / "heartbeats"
    beats.mkdir()
    journal.write_bytes(b'{"op_code": 0}\n{"op_code": 5, "trial_id": 2, "sta')
    (beats / "study-2").write_text(json.dumps({"host": "another-host", "pid": 1}))
    tune._repair_journal(journal, beats, every=30.0)
    assert journal.read_bytes().endswith(b'"sta')  # untouched
    old = time.time() - 100
    os.utime(beats / "study-2", (old, old))
    tune._repair_journal(journal, beats, every=30.0)
    assert journal.read_bytes() == b'{"op_code": 0}\n'


def test_a_trial_killed_while_its_settings_were_drawn_is_drawn_again_as_an_uninterrupted_study_draws_it(tmp_path):
    """A kill between two suggestions left trial 2 running with only its lr: re-queued with that lr, its temperature
    was drawn apart and the study's selection changed (seen in the SIGKILL test); failed alone, the next draw repeats
    the uninterrupted one's."""
    space = {**SPACE, "forecast.temperature": {"low": 0.5, "high": 1.5}}
    tc = tune.TuneConfig(n_trials=4, space=space, heartbeat_seconds=2)
    given, defaults = {"predictor_training": {"lr": 1e-3}, "forecast": {"temperature": 1.0}}, {
        "predictor_training.lr": 1e-3, "forecast.temperature": 1.0}
    objective = lambda params, number: {"2024-01-01": params["predictor_training.lr"] * params["forecast.temperature"]}  # noqa: E731

    def settings(folder: Path) -> list:
        rows = tune.trial_table(tune.open_study(folder, tc, {"setup": 1}, [], 1))[0]["list"]
        return [r["settings"] for r in rows if r["state"] == "complete"]

    tune.work(tune.open_study(tmp_path / "a", tc, {"setup": 1}, [], 1), tc, tmp_path / "a", given, defaults, objective)
    two = tune.TuneConfig(n_trials=2, space=space, heartbeat_seconds=2)
    study = tune.open_study(tmp_path / "b", two, {"setup": 1}, [], 1)
    tune.work(study, two, tmp_path / "b", given, defaults, objective)
    import optuna

    study.sampler = optuna.samplers.TPESampler(seed=tc.seed + 2, constant_liar=True)  # what work() draws trial 2 with
    trial = study.ask()
    trial.suggest_float("predictor_training.lr", 1e-5, 1e-2, log=True)  # the kill lands before the temperature
    # no heartbeat: it is written only once the settings are drawn (its absence reads as a gone worker)
    tune.work(tune.open_study(tmp_path / "b", tc, {"setup": 1}, [], 1), tc, tmp_path / "b", given, defaults, objective)
    assert settings(tmp_path / "b") == settings(tmp_path / "a") and len(settings(tmp_path / "a")) == 4
