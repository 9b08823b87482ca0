"""Kronos finetuning: the Qlib pipeline (`qlib_*`, `train_tokenizer`, `train_predictor`), the `kronos` command
(`cli`), the shared engine (`utils`) and the evaluation functions (`evaluation`)."""
