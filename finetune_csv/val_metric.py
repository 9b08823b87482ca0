"""A forecast metric on the validation split for checkpoint selection (`training.select_by: crps`).

A lower token loss does not promise better forecasts, so the predictor's best epoch can be chosen by the CRPS of
sampled forecasts instead: `make_crps_val_metric` fixes a subsample of validation windows once (evenly spread over
every series' validation split) and returns a callable the trainer runs after each validation pass (epoch 0, the
starting model, included). The score is deterministic: sampling uses its own seeded RNG state and leaves the
training RNG untouched, so the same weights always get the same score and selecting by it does not perturb training.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from finetune.evaluation.scoring_rules import crps_ensemble
from finetune_csv.held_out import CLOSE, HeldOutWindows, sample_paths, spread_evenly
from model import KronosPredictor, KronosTokenizer

DEFAULT_MAX_WINDOWS = 64  # windows scored per validation pass: enough to rank epochs, cheap next to an epoch


def make_crps_val_metric(cfg, val_windows: HeldOutWindows, tokenizer: KronosTokenizer,
                         max_windows: int = DEFAULT_MAX_WINDOWS) -> Callable[[nn.Module, object], dict | None]:
    """Build `metric(model, stage) -> {"score": mean CRPS, ...}` over a fixed subsample of validation windows.

    Parameters
    ----------
    cfg : CsvFinetuneConfig (data.lookback / predict / clip and the forecast: sampling keys are used).
    val_windows : the validation windows, e.g. `held_out_windows(prepare_data(...).splits["val"], lookback, predict)`
        (what finetune_csv/train_sequential.py passes with training.select_by: crps).
    tokenizer : the tokenizer the predictor is trained with (frozen while the predictor trains).
    max_windows : size of the fixed subsample (evenly spread, first and last window included).

    Returns
    -------
    A callable. For the predictor stage it returns {"score": mean CRPS of the close in returns from the last context
    close (lower is better), "crps", "mae": MAE of the sample median, "windows", "samples"}; for the tokenizer stage
    (no forecast to score) None.
    """
    if len(val_windows) == 0:
        raise ValueError("the validation split has no window to score: lower data.lookback / data.predict or raise "
                         "data.val_ratio, or select checkpoints by loss (training.select_by: loss)")
    windows = val_windows.subset(spread_evenly(len(val_windows), max_windows))
    x_stamps, y_stamps = windows.stamps()  # (W, L, 5), (W, P, 5)
    last = windows.context[:, -1, CLOSE]  # (W,)
    obs = windows.actual[..., CLOSE] / last[:, None] - 1.0  # (W, P)
    f = cfg.forecast

    def metric(model: nn.Module, stage) -> dict | None:
        if getattr(stage, "name", stage) != "predictor":
            return None
        module = getattr(model, "module", model)  # DDP-wrapped or not
        device = next(module.parameters()).device
        was_training = module.training
        predictor = KronosPredictor(module, tokenizer, device=str(device),
                                    max_context=cfg.data.lookback + cfg.data.predict, clip=cfg.data.clip)
        devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                paths = sample_paths(predictor, windows.context, x_stamps, y_stamps, cfg.data.predict, f,
                                     f.batch_size)  # (W, S, P, 6), seeded with forecast.seed inside
        finally:
            module.train(was_training)
        ens = np.moveaxis(paths[..., CLOSE] / last[:, None, None] - 1.0, 1, -1)  # (W, P, S)
        crps = float(crps_ensemble(obs, ens).mean())
        mae = float(np.abs(np.median(ens, axis=-1) - obs).mean())
        return {"score": crps, "crps": crps, "mae": mae, "windows": len(windows), "samples": int(ens.shape[-1])}

    return metric
