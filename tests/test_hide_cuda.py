"""The suite ignores a GPU: a test without the `cuda` marker sees none, in-process and in a child process
(tests/conftest.py `hide_cuda`), so its result and time beside a GPU are a CPU machine's."""
import os
import subprocess
import sys

import torch


def test_a_test_without_the_cuda_marker_sees_no_gpu_in_process_or_in_a_child():
    assert torch.cuda.is_available() is False
    assert torch.cuda.device_count() == 0
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    child = subprocess.run([sys.executable, "-c", "import os, torch; "
                            "print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.device_count())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.split() == ["''", "0"]
