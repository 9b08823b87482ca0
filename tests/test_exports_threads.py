"""Issues 33 and 48 (item 8): one rule chooses torch's intra-op threads, for the CLI and for KronosPredictor, and
keeps a count the user set."""

import os
import subprocess
import sys

import pytest
import torch

from model import KronosPredictor
from model import predictor as forecaster
from model.predictor import choose_threads, torch_default_threads, use_chosen_threads
from tests.model_factory import tiny_models


@pytest.fixture
def threads_at_torchs_default(monkeypatch):
    """torch's threads as a fresh process starts (as nobody set them), the once-per-process choice forgotten; both
    restored after."""
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(torch_default_threads())
    use_chosen_threads.cache_clear()
    yield
    use_chosen_threads.cache_clear()
    torch.set_num_threads(threads)


def test_torchs_default_is_what_a_fresh_process_starts_with():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True)
    assert int(out.stdout) == torch_default_threads()


def test_threads_follow_omp_num_threads_else_cores_per_rank_less_busy(threads_at_torchs_default, monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(forecaster.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine
    assert choose_threads({"LOCAL_WORLD_SIZE": "64"}).startswith("1 intra-op thread(s) (")
    assert torch.get_num_threads() == 1
    torch.set_num_threads(torch_default_threads())
    assert choose_threads({}).startswith(f"{cores} intra-op thread(s) ({cores} cores / 1 rank(s), 0 busy")
    monkeypatch.setattr(forecaster.os, "getloadavg", lambda: (float(cores), 0.0, 0.0))  # every core busy
    torch.set_num_threads(torch_default_threads())
    assert choose_threads({}).startswith("1 intra-op thread(s) (")
    assert choose_threads({"OMP_NUM_THREADS": "3"}) == "3 intra-op thread(s) (OMP_NUM_THREADS)"
    assert torch.get_num_threads() == 3


def test_a_count_set_with_torch_set_num_threads_is_kept(threads_at_torchs_default, monkeypatch):
    monkeypatch.setattr(forecaster.os, "getloadavg", lambda: (64.0, 0.0, 0.0))  # the rule alone would say 1
    mine = torch_default_threads() + 1
    torch.set_num_threads(mine)
    assert choose_threads({}) == f"{mine} intra-op thread(s) (torch.set_num_threads, kept)"
    assert torch.get_num_threads() == mine


@pytest.mark.parametrize("user", [None, "set_num_threads", "OMP_NUM_THREADS"])
def test_kronos_predictor_on_cpu_chooses_threads_as_the_cli(threads_at_torchs_default, monkeypatch, user):
    monkeypatch.setattr(forecaster.os, "getloadavg", lambda: (64.0, 0.0, 0.0))  # a busy machine
    mine = torch_default_threads() + 1
    if user == "set_num_threads":
        torch.set_num_threads(mine)
    elif user == "OMP_NUM_THREADS":
        monkeypatch.setenv("OMP_NUM_THREADS", str(mine))
    tok, pred = tiny_models()
    KronosPredictor(pred, tok, device="cpu")
    assert torch.get_num_threads() == (1 if user is None else mine)
    torch.set_num_threads(mine + 1)  # a later choice of the user: a second predictor leaves it (once per process)
    KronosPredictor(pred, tok, device="cpu")
    assert torch.get_num_threads() == mine + 1


def test_the_cli_chooses_by_the_same_rule(threads_at_torchs_default, monkeypatch, capsys):
    from finetune import cli

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(forecaster.os, "getloadavg", lambda: (64.0, 0.0, 0.0))  # a busy machine
    try:
        cli.main(["make-synthetic", "--help"])  # threads are chosen before the command runs
    except SystemExit:
        pass
    assert torch.get_num_threads() == 1
    assert use_chosen_threads() == f"1 intra-op thread(s) ({cores} cores / 1 rank(s), {cores} busy; set " \
        "OMP_NUM_THREADS to override)"
