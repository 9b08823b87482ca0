"""The one training engine both pipelines share.

- `training_utils` - the public entry (`train_tokenizer`, `train_predictor`, `evaluate_*`); `trainer` holds the
  loop, `training_config` / `stage_config` / `forecast_config` the settings, `stages` the losses, `factory` the
  models built from settings, `config_utils` / `config_help` YAML loading and the key listing, `errors` the
  user-error contract of every entry point.
- `data/` - `SeriesPanel`, the prepared memory-mapped store, windows (`WindowDataset`) and the epoch order.
- `safety/` - what a re-run does with a stage folder, resume, the run lock, graceful stop, the non-finite guard,
  rotating checkpoints.
- observability - `logging_setup` (rank-0 filter, train.log), `metrics` (metrics.jsonl, loss plot), `trackers`,
  `provenance` (run_info.json); `distributed` the process group.
"""
