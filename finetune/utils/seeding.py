"""Seeding, in one place: the engine seeds each training run; model building gets a private, seeded stream.

    with seeded_init(cfg.training.seed):                 # entry point: a from-scratch model's initial weights
        tokenizer = build_tokenizer(cfg.model)
    result = train_tokenizer(tokenizer, ...)             # the engine calls seed_everything(seed, rank) first

Why the engine and not the entry point: a stage's random stream (dropout, sampled s1 tokens) must depend on
(seed, rank) only, not on what the process did before the stage started - e.g. whether the tokenizer stage ran
before the predictor stage or was skipped because it had already finished. So the trainer seeds python, numpy and
torch with `seed + rank` as the first thing of every run, and nothing else sets the global streams.
Model initialisation happens earlier, in the entry point; `seeded_init` gives it the same weights on every run
without touching the global streams (under DDP, rank 0's weights are broadcast, so one seed for all ranks is right).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["seed_everything", "seeded_init"]


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed python, numpy and torch (all devices) with `seed + rank`; returns the seed used."""
    s = int(seed) + int(rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s


@contextlib.contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Run the body (building models) on torch's CPU generator seeded with `seed`; restore the generator after."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(seed))  # CPU only: models are built on the CPU
        yield
