"""Issue 33: the engine chooses torch's intra-op threads and says so."""

import subprocess
import sys

import torch

from finetune.utils.distributed import choose_threads
from tests.conftest import cpu_env


def test_threads_follow_omp_num_threads_else_cores_per_rank(one_thread):
    assert choose_threads({"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS") and torch.get_num_threads() == 3
    threads, why = choose_threads({"LOCAL_WORLD_SIZE": "64"})
    assert threads == 1 and "/ 64 rank(s)" in why and torch.get_num_threads() == 1


def test_every_command_says_its_threads_once():
    env = {k: v for k, v in cpu_env().items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-m", "finetune.cli", "forecast", "--help"], capture_output=True, text=True,
                         env=env)
    assert out.stderr.count("intra-op thread(s)") == 1 and "cores" in out.stderr
