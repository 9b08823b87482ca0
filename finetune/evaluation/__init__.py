"""Evaluation building blocks shared by the pipelines' test entry points.

- `scoring_rules`: CRPS, pinball loss, quantiles and interval coverage of sample ensembles (pure numpy).
- `bootstrap`: seeded (block) bootstrap confidence intervals over forecast windows.
- `forecast_baselines`: persistence and seasonal-naive forecasts in the same sample layout as the model's.
- `forecast_scores`: one call that scores a CSV-pipeline forecast run into a metrics.json-ready dict.
- `qlib_labels`, `signal_analysis`, `baselines`: trade-consistent labels, IC / long-short analysis and baseline
  signals for the Qlib pipeline.
"""
