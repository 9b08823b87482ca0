"""Seeding, in one place: the engine seeds each training run with (seed, rank) (`seed_everything`); model building
gets a private, seeded stream (`seeded_init`). Why the engine and not the entry point: docs/architecture.md,
"Formats and designs"."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import random
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from model.errors import DataError, UserError


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


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int  # Global rank, 0..world_size-1.
    world_size: int  # Number of processes in the job (1 without torchrun).
    local_rank: int  # Rank on this machine; picks the GPU (cuda:local_rank).
    device: torch.device  # Device this process trains on.

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only process that creates folders and writes logs, checkpoints and plots."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when there is more than one process (models are then wrapped in DDP)."""
        return self.world_size > 1


def launched_by_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True when the process was started by torchrun (RANK and WORLD_SIZE are set)."""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env


def require_torchrun(*launches: str, args: str = "--config <your.yaml>") -> None:
    """Raise a UserError showing the torchrun command(s) unless this process was started by torchrun.

    `launches`: what follows torchrun's options, e.g. `finetune/train_tokenizer.py` or `--no-python kronos
    qlib-train-tokenizer` (default: this script); `args`: the command's arguments shown after it."""
    if launched_by_torchrun():
        return
    launches = launches or (sys.argv[0] if sys.argv and sys.argv[0] else "<script.py>",)
    shown = "".join(f"  torchrun --standalone --nproc_per_node=1 {launch} {args}\n" for launch in launches)
    raise UserError(f"this trainer trains with DistributedDataParallel and must be launched by torchrun, e.g.\n"
                    f"{shown}Use --nproc_per_node=<number of GPUs>; on a machine without GPUs put DIST_BACKEND=gloo "
                    "in front.")


def resolve_backend(requested: str | None, cuda_available: bool) -> str:
    """The process-group backend: `requested` (from DIST_BACKEND) or nccl with CUDA / gloo without.

    Raises DataError when nccl is asked for on a machine without CUDA (nccl only runs on GPUs)."""
    backend = (requested or "").strip().lower() or ("nccl" if cuda_available else "gloo")
    if backend not in ("nccl", "gloo", "mpi", "ucc"):
        raise DataError(f"DIST_BACKEND={requested!r} is not a torch.distributed backend; use nccl or gloo")
    if backend == "nccl" and not cuda_available:
        raise DataError("DIST_BACKEND=nccl needs CUDA GPUs, but torch.cuda.is_available() is False on this machine; "
                        "set DIST_BACKEND=gloo to train on CPU")
    return backend


@contextlib.contextmanager
def distributed_context(timeout_s: float = 1800.0) -> Iterator[DistInfo]:
    """Set up this process (process group if launched by torchrun, device) and tear it down on exit.
    timeout_s: how long a collective may wait for the other ranks before the job fails instead of hanging.
    The backend is DIST_BACKEND's (resolve_backend).
    Yields a `DistInfo`. The process group is destroyed here, and only here, whether the body succeeds or raises."""
    cuda = torch.cuda.is_available()
    if not launched_by_torchrun():
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        yield DistInfo(rank=0, world_size=1, local_rank=0, device=device)
        return

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = resolve_backend(os.environ.get("DIST_BACKEND"), cuda)
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise DataError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible; "
                            "lower torchrun's --nproc_per_node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    with setup_deadline(min(timeout_s, INIT_TIMEOUT_S), rank, world_size):
        tdist.init_process_group(backend=chosen, rank=rank, world_size=world_size,
                                 timeout=datetime.timedelta(seconds=timeout_s),
                                 store=attempt_store(rank, world_size, timeout_s))
        barrier()  # every rank is here at once: connects nccl too, so the deadline covers the whole setup
    try:
        yield DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


INIT_TIMEOUT_S = 300.0
"""Process-group setup (connect + first barrier) taking longer than this (or training.dist_timeout_s if lower)
ends the process with one line instead of hanging: under torchrun --max-restarts the agent then starts again."""


def attempt_store(rank: int, world_size: int, timeout_s: float) -> tdist.Store | None:
    """The process group's key-value store under torchrun's shared agent store, with a prefix per restart.

    torchrun's workers use the agent's rendezvous TCP store, which outlives a restart and still holds the previous
    attempt's keys (e.g. gloo's peer addresses): a restarted rank read the dead rank's old port (Connection refused)
    or hung. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in torchrun's environment avoids it; this prefix does it for a
    plain `torchrun --max-restarts=N`. None (torch's default env:// store) when not under an elastic agent store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store, _, _ = next(tdist.rendezvous("env://", rank, world_size, timeout=datetime.timedelta(seconds=timeout_s)))
    return tdist.PrefixStore(f"kronos/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


@contextlib.contextmanager
def setup_deadline(seconds: float, rank: int, world_size: int) -> Iterator[None]:
    """Exit the process (status 1, one line) if the body has not finished within `seconds`."""
    def give_up() -> None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        os.write(2, (f"error (rank {rank}): process-group setup with {world_size} processes did not finish within "
                     f"{seconds:.0f} s (torchrun restart {restart}; MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
                     f"MASTER_PORT={os.environ.get('MASTER_PORT')}): another rank did not join; giving up so the "
                     "launcher can restart the job\n").encode())
        os._exit(1)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _active() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def barrier() -> None:
    """Wait for every rank (no-op in a single process); used before ranks read what rank 0 wrote."""
    if _active() and tdist.get_world_size() > 1:  # nccl: on this rank's GPU
        tdist.barrier(device_ids=[torch.cuda.current_device()] if tdist.get_backend() == "nccl" else None)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over all ranks in place and return it (unchanged in a single process)."""
    if _active() and tdist.get_world_size() > 1:
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (`[obj]` in a single process); must be picklable."""
    if not (_active() and tdist.get_world_size() > 1):
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def wrap_model(model: nn.Module, dist: DistInfo) -> nn.Module:
    """DDP around `model` when there are several processes; the model itself otherwise (same call syntax).

    Wrapping broadcasts rank 0's parameters to the other ranks, so every rank starts from the same weights."""
    if not dist.distributed:
        return model
    # broadcast_buffers=False: the only buffers are constants (rotary frequencies, BSQ bases), and skipping the
    # per-forward broadcast lets ranks run different numbers of validation batches without a collective mismatch.
    # (newer torch names the flag forward_sync_buffers and deprecates broadcast_buffers)
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    no_buffer_sync = {"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
                                   gradient_as_bucket_view=True, **no_buffer_sync)


def no_sync(wrapped: nn.Module) -> contextlib.AbstractContextManager:
    """Skip DDP's gradient all-reduce in this backward (all but the last micro-batch of an optimizer step)."""
    return wrapped.no_sync() if isinstance(wrapped, DistributedDataParallel) else contextlib.nullcontext()
