"""Evaluation building blocks shared by the pipelines' test entry points.

- `forecast_scores`: CRPS, pinball loss, coverage, naive baselines, and one call that scores a forecast run.
- `statistics`: HAC variance, bootstrap intervals and the paired helps / hurts / no_evidence verdict.
- `signals`: trade-consistent labels, IC / long-short analysis and baseline signals for the Qlib pipeline."""
