"""Issue 30's kill-and-change loop: `kronos finetune` and `kronos walk-forward` SIGKILLed at random moments, then
a random change (data cut or extended, one setting changed, or nothing), then run again: each re-run ends with
exactly what an uninterrupted run on the new inputs gives (20 trials). A walk-forward fold that FINISHED on other
inputs is refused naming --overwrite (the ledger's third answer); the re-run with it then ends the same way."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune.utils.errors import run_main
from finetune_csv import walk_forward as wf
from tests.conftest import cpu_env
from tests.test_csv_train import make_run
from tests.test_safety_stage_boundaries import outputs, run
from tests.test_walk_forward import run_config  # noqa: F401 - the two-fold walk-forward fixture

CHANGES = {"nothing": (240, []), "cut": (200, []), "extended": (280, []),
           "setting": (240, ["--set", "predictor_training.lr=2.0e-3"])}
ENV = cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def kill_at_random(command: list[str], started: Path, rng: random.Random) -> bool:
    """Start `command`, wait for `started` to exist, SIGKILL it after a random delay; True if it was killed."""
    job = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while job.poll() is None and not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 2.0))
    job.kill()
    return job.wait() == -9


@pytest.mark.slow
def test_finetune_killed_then_changed_then_rerun_equals_an_uninterrupted_run_on_the_new_inputs(
        tmp_path_factory, one_thread):
    rng, expected, kills = random.Random(30), {}, 0
    for trial in range(16):
        change = rng.choice(sorted(CHANGES))
        bars, flags = CHANGES[change]
        if change not in expected:
            ref = tmp_path_factory.mktemp(f"ref_{change}")
            assert run(make_run(ref, n_bars=bars), *flags) == 0
            expected[change] = outputs(ref)
        root = tmp_path_factory.mktemp(f"trial_{trial}")
        config = make_run(root)
        kills += kill_at_random([sys.executable, "-m", "finetune.cli", "finetune", "--config", str(config)],
                                root / "out" / "tiny", rng)
        if bars != 240:
            write_csv_folder(generate_ohlcv(n_series=2, n_bars=bars, freq="5min", seed=0), root / "data")
        # --skip-existing: what the killed run left is reused or resumed while current, else trained again
        rerun = flags + (["--skip-existing"] if change != "nothing" or trial % 2 else [])
        assert run(config, *rerun) == 0, (trial, change)
        assert outputs(root) == expected[change], (trial, change)
    assert kills >= 8, f"only {kills} of 16 runs were killed before they finished"


def report(root: Path) -> tuple:
    out = root / "wf" / "walk_forward"
    got = json.loads((out / "report.json").read_text())
    return got["paired"], got["verdict"], [f["scores"] for f in got["folds"]], (out / "windows.csv").read_bytes()


@pytest.mark.slow
def test_walk_forward_killed_then_changed_then_rerun_equals_an_uninterrupted_run_on_the_new_inputs(
        run_config, tmp_path, capsys, one_thread):  # noqa: F811
    rng, kills = random.Random(31), 0
    data = {p.name: p.read_text() for p in (tmp_path / "data").glob("*.csv")}
    for trial, change in enumerate(["cut", "setting", "nothing", "cut"]):
        for name, text in data.items():  # every trial starts from the original data
            (tmp_path / "data" / name).write_text(text)
        out = tmp_path / f"out_{trial}"
        config = tmp_path / f"trial_{trial}.yaml"
        config.write_text(run_config.read_text().replace(str(tmp_path / "out"), str(out)))
        kills += kill_at_random([sys.executable, "-m", "finetune.cli", "walk-forward", "--config", str(config)],
                                out / "wf" / "walk_forward" / "fold_0" / "basemodel", rng)
        if change == "cut":
            for path in (tmp_path / "data").glob("*.csv"):
                path.write_text("".join(path.read_text().splitlines(keepends=True)[:-16]))
        flags = ["--set", "predictor_training.lr=2.0e-3"] if change == "setting" else []
        code = run_main(wf.main, ["--config", str(config), *flags])
        if code == 5 and change != "nothing":  # a FINISHED fold of other inputs is refused, naming --overwrite
            assert "pass --overwrite" in capsys.readouterr().err
            code = run_main(wf.main, ["--config", str(config), *flags, "--overwrite"])
        assert code == 0, (trial, change)
        ref = tmp_path / f"ref_{trial}"
        reference = tmp_path / f"ref_{trial}.yaml"
        reference.write_text(run_config.read_text().replace(str(tmp_path / "out"), str(ref)))
        assert run_main(wf.main, ["--config", str(reference), *flags]) == 0
        assert report(out) == report(ref), (trial, change)
    assert kills >= 2, f"only {kills} of 4 walk-forwards were killed before they finished"
