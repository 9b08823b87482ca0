"""One rank of the data-store test: ensure the store (rank 0 prepares, others wait), read this rank's windows.

    torchrun --nproc_per_node=2 tests/data_store_worker.py <csv_dir> <store_dir> <out_dir>

Each rank writes <out_dir>/rank<r>.npz: the window indices it read (EpochSampler, 2 epochs), their first panel
columns, the gathered batch, whether the panel is memory-mapped, and the StoreInfo reason; or rank<r>.err with
the error message when ensure_store raised.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from finetune.utils.distributed import barrier, distributed_context
from finetune.utils.windows import EpochSampler
from finetune_csv.prepare import StoreSettings, ensure_store
from finetune_csv.splits import split_panel
from model.config import Window

LOOKBACK, PREDICT = 8, 4


def main(csv_dir: str, store_dir: str, out_dir: str) -> None:
    out = Path(out_dir)
    with distributed_context(timeout_s=60) as dist:
        try:
            info = ensure_store(csv_dir, store_dir, StoreSettings(), dist=dist, barrier=barrier)
        except ValueError as e:
            (out / f"rank{dist.rank}.err").write_text(str(e))
            return
        panel = info.open()
        train = split_panel(panel, 0.6, 0.2, 0.2, Window(LOOKBACK, PREDICT))["train"].dataset(Window(LOOKBACK, PREDICT))
        sampler = EpochSampler(len(train), shuffle=True, seed=3, rank=dist.rank, world_size=dist.world_size)
        indices = np.concatenate([sampler.rank_indices(epoch) for epoch in (0, 1)])
        x, stamp = train.get_batch(indices)
        np.savez(out / f"rank{dist.rank}.npz", indices=indices, starts=train.starts(indices), x=x.numpy(),
                 stamp=stamp.numpy(), memmap=isinstance(panel.features, np.memmap), reason=info.reason,
                 reused=info.reused, n_windows=len(train))


if __name__ == "__main__":
    main(*sys.argv[1:4])
