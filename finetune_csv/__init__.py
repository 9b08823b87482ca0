"""Finetune Kronos on your own candles (CSV or Parquet files, or DataFrames from Python).

    from finetune_csv import finetune        # finetune_csv/api.py"""

from __future__ import annotations

__all__ = ["FinetuneResult", "finetune"]


def __getattr__(name: str):
    # Lazy: `import finetune_csv.config` must not import the training engine (and torch) through this package.
    if name in __all__:
        from finetune_csv import api

        return getattr(api, name)
    raise AttributeError(f"module 'finetune_csv' has no attribute {name!r}")
