"""Evaluation building blocks shared by the pipelines' test entry points: scores, statistics, Qlib signals."""
