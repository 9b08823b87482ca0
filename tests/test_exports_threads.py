"""Issue 33: the engine chooses torch's intra-op threads and says so."""

import torch

from finetune.utils.distributed import choose_threads


def test_threads_follow_omp_num_threads_else_cores_per_rank(one_thread):
    assert choose_threads({"OMP_NUM_THREADS": "3"}) == "3 intra-op thread(s) (OMP_NUM_THREADS)"
    assert torch.get_num_threads() == 3
    assert choose_threads({"LOCAL_WORLD_SIZE": "64"}).startswith("1 intra-op thread(s) (")
    assert torch.get_num_threads() == 1
