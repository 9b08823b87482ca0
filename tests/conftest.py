"""Shared fixtures: tiny Kronos models (one implementation: tests/model_factory.py), logging isolation; under
pytest-xdist (scripts/test.sh) the tests that time signals against a running job share one worker; `cpu_env` for
child processes that must run on the CPU; the `cuda` tests skip without a GPU, and every other test runs as on a
machine without one (`hide_cuda`)."""
from __future__ import annotations

import logging
import os

import pytest

from tests import model_factory

# Tests that signal or kill runs at chosen moments while polling their checkpoints: never two at once.
TIMED_SIGNAL_MODULES = ("test_cluster_elastic", "test_cluster_signals", "test_cuda", "test_safety_guard",
                        "test_safety_interrupts", "test_safety_restart_loops", "test_walk_forward")


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that must run on the CPU (N gloo ranks, or a CPU run compared exactly
    with another), also on a machine with a GPU: CUDA hidden, so the engine picks the CPU. `extra` is added."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", **extra}


def pytest_collection_modifyitems(config, items):
    """With `--dist loadgroup`, the slow tests of TIMED_SIGNAL_MODULES run one after another on one worker; the
    tests marked `cuda` skip on a machine without a GPU."""
    for item in items:
        if item.get_closest_marker("slow") and item.module.__name__.rpartition(".")[2] in TIMED_SIGNAL_MODULES:
            item.add_marker(pytest.mark.xdist_group("timed_signals"))
    if any(item.get_closest_marker("cuda") for item in items):
        import torch

        if not torch.cuda.is_available():
            for item in items:
                if item.get_closest_marker("cuda"):
                    item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))


@pytest.fixture(autouse=True)
def hide_cuda(request, monkeypatch):
    """Every test not marked `cuda` runs as on a CPU-only machine, also beside a GPU: its result and time are the CPU
    machine's, and the `cuda` tests are the only GPU users. Children inherit CUDA_VISIBLE_DEVICES=""; in-process,
    torch may already have seen the GPU, so its two queries the code asks are patched."""
    if request.node.get_closest_marker("cuda"):
        yield
        return
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    yield


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (tiny models: threads only fight over the cores), restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_pair():
    """(tokenizer, predictor), width 16, eval mode, seed 0."""
    return model_factory.tiny_models()


@pytest.fixture
def make_tiny_models():
    """`model_factory.tiny_models(seed=0, **predictor_overrides)` -> (tokenizer, predictor) in eval mode."""
    return model_factory.tiny_models


@pytest.fixture
def make_tiny_tokenizer():
    """`model_factory.tiny_tokenizer(seed=0, dropout=None, **overrides)` (training mode)."""
    return model_factory.tiny_tokenizer


@pytest.fixture
def make_tiny_predictor():
    """`model_factory.tiny_predictor(seed=1, dropout=None, **overrides)` (training mode)."""
    return model_factory.tiny_predictor


@pytest.fixture
def restore_root_logger():
    """Undo what a test did to the root logger (handlers it added, its level, warnings capture)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)
    logging.captureWarnings(False)
