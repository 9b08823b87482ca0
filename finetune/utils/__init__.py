"""The one training engine both pipelines share; `training_utils.py` holds the loop (see docs/CONTRACTS.md)."""
