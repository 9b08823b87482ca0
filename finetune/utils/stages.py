"""What differs between tokenizer and predictor training: the loss, the default gradient clip, the loss parts
reported beside the loss, and how the best model is saved. The trainer is written once against `Stage`.

    stage = TokenizerStage(tokenizer)                    # or PredictorStage(predictor, tokenizer, teacher_forcing)
    loss, parts = stage.loss(wrapped, x, stamp, training=True)   # x (B, T, F), stamp (B, T, 5); parts keyed by
    stage.part_names                                              # ... these names, in this order
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.predictor_files import PREDICTOR_INFO_NAME, TOKENIZER_CONFIG_NAME, predictor_info

from .checkpoint import save_pretrained_atomic
from .safety.stage_folder import weights_fingerprint

__all__ = ["TOKENIZER_CLIP", "PREDICTOR_CLIP", "tokenizer_loss", "predictor_loss", "Stage", "TokenizerStage",
           "PredictorStage"]

TOKENIZER_CLIP = 2.0  # reference finetuning's gradient-norm clip for the tokenizer
PREDICTOR_CLIP = 3.0  # ... and for the predictor


def tokenizer_loss(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Tokenizer objective on x (B, T, F): ((mse(z_pre, x) + mse(z, x)) + bsq_loss) / 2.

    `model` is the tokenizer or its DDP wrapper (the forward must go through the wrapper for gradient sync).
    Returns (loss, parts) with parts {"recon_pre", "recon", "bsq"} (detached scalars).
    """
    (z_pre, z), bsq_loss, _, _ = model(x)  # z_pre, z (B, T, F): decodes of the s1 bits and of the full code
    recon_pre = F.mse_loss(z_pre.float(), x)
    recon = F.mse_loss(z.float(), x)
    loss = (recon_pre + recon + bsq_loss.float()) / 2
    return loss, {"recon_pre": recon_pre.detach(), "recon": recon.detach(), "bsq": bsq_loss.detach().float()}


def predictor_loss(
    model: nn.Module,
    tokenizer: nn.Module,
    x: torch.Tensor,
    x_stamp: torch.Tensor,
    *,
    teacher_forcing: bool = True,
    causal_dep: bool | None = None,
    head: nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token objective of the predictor: mean of the s1 and s2 cross-entropies over all positions.

    x (B, T, F) is encoded by the frozen `tokenizer` (no grad, float32 even under autocast, so the tokens are the
    ones inference would produce); the predictor reads tokens[:, :-1] with stamps[:, :-1] and is scored on
    tokens[:, 1:]. `model` is Kronos or its DDP wrapper; `head` defaults to the unwrapped model's head.
    `causal_dep=True` keeps the dependency layer causal in eval mode (needed for an honest validation loss).
    Returns (loss, {"s1_loss", "s2_loss"}).
    """
    with torch.no_grad(), torch.autocast(device_type=x.device.type, enabled=False):
        s1, s2 = tokenizer.encode(x, half=True)  # (B, T) int64 each
    s1_in, s2_in, stamp_in = s1[:, :-1], s2[:, :-1], x_stamp[:, :-1]  # (B, T-1)
    s1_target, s2_target = s1[:, 1:], s2[:, 1:]  # (B, T-1)
    kwargs = {"use_teacher_forcing": teacher_forcing, "s1_targets": s1_target}
    if causal_dep is not None:
        kwargs["causal_dep"] = causal_dep
    s1_logits, s2_logits = model(s1_in, s2_in, stamp_in, **kwargs)  # (B, T-1, 2^s1_bits), (B, T-1, 2^s2_bits)
    if head is None:
        head = getattr(model, "module", model).head
    loss, s1_loss, s2_loss = head.compute_loss(s1_logits.float(), s2_logits.float(), s1_target, s2_target)
    return loss, {"s1_loss": s1_loss.detach(), "s2_loss": s2_loss.detach()}


class Stage:
    """One training stage: the model it trains and what is specific to it."""

    name: str
    """'tokenizer' or 'predictor' (messages, checkpoint's "stage" key)."""
    default_clip: float
    """Gradient-norm clip used when training.clip_grad_norm is null."""
    part_names: tuple[str, ...]
    """Names of the detached loss parts `loss()` returns beside the loss, in this order (logged as-is, and as
    val_<name> after validation)."""
    model: nn.Module
    """The module whose parameters are trained (unwrapped)."""

    def loss(
        self, wrapped: nn.Module, x: torch.Tensor, stamp: torch.Tensor, training: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss on one batch: x (B, T, F) float32, stamp (B, T, 5) int64 -> (scalar loss, {part: scalar}).

        `wrapped` is `model` or its DDP wrapper (the forward must go through the wrapper for gradient sync);
        `training=False` gives the validation loss.
        """
        raise NotImplementedError

    def save_best(self, folder: Path) -> None:
        """Write the model in the published format (save_pretrained) to `folder`, atomically."""
        raise NotImplementedError

    def frozen_fingerprint(self) -> str | None:
        """sha256 of the frozen model this stage's loss depends on (stored in checkpoints; a resume with other
        frozen weights is refused); None when there is none."""
        return None


class TokenizerStage(Stage):
    """The BSQ tokenizer trained on reconstruction + BSQ loss."""

    name = "tokenizer"
    default_clip = TOKENIZER_CLIP
    part_names = ("recon_pre", "recon", "bsq")

    def __init__(self, tokenizer: nn.Module):
        self.model = tokenizer

    def loss(self, wrapped, x, stamp, training):
        return tokenizer_loss(wrapped, x)

    def save_best(self, folder):
        save_pretrained_atomic(self.model, folder)


class PredictorStage(Stage):
    """The Kronos predictor trained on the next tokens of a frozen tokenizer."""

    name = "predictor"
    default_clip = PREDICTOR_CLIP
    part_names = ("s1_loss", "s2_loss")

    def __init__(self, predictor: nn.Module, tokenizer: nn.Module, teacher_forcing: bool,
                 forecast_info: dict[str, Any] | None = None):
        self.model = predictor
        self.tokenizer = tokenizer
        self.teacher_forcing = teacher_forcing
        self.forecast_info = forecast_info  # max_context / tokenizer / clip for KronosPredictor.from_pretrained

    def loss(self, wrapped, x, stamp, training):
        # Validation is always teacher-forced and causal: the s2 head at position t must not see later positions.
        return predictor_loss(
            wrapped,
            self.tokenizer,
            x,
            stamp,
            teacher_forcing=self.teacher_forcing if training else True,
            causal_dep=None if training else True,
            head=self.model.head,
        )

    def save_best(self, folder):
        # The tokenizer's config travels with the predictor so the pair cannot drift apart.
        extra = {TOKENIZER_CONFIG_NAME: dict(getattr(self.tokenizer, "config", {}) or {})}
        if self.forecast_info is not None:  # so that KronosPredictor.from_pretrained(best_model/) needs nothing else
            extra[PREDICTOR_INFO_NAME] = predictor_info(folder, **self.forecast_info)
        save_pretrained_atomic(self.model, folder, extra_json=extra)

    def frozen_fingerprint(self):
        return weights_fingerprint(self.tokenizer)
