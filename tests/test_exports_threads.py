"""Issue 33: the engine chooses torch's intra-op threads and says so."""

import torch

from finetune.utils.distributed import choose_threads


def test_threads_follow_omp_num_threads_else_cores_per_rank(one_thread):
    assert choose_threads({"OMP_NUM_THREADS": "3"}) == (3, "OMP_NUM_THREADS") and torch.get_num_threads() == 3
    threads, why = choose_threads({"LOCAL_WORLD_SIZE": "64"})
    assert threads == 1 and "/ 64 rank(s)" in why and torch.get_num_threads() == 1
