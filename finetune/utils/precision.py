"""How fast and how exactly the engine computes: `training.amp` resolved on the device (`Precision`: bf16 autocast,
TF32 matmuls, the peak FLOP/s behind MFU), `training.deterministic` (`Precision.kernels`), and the FLOPs estimate
of a model (`forward_flops_per_token`). The Trainer resolves it once per run and hands it to the Validator."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from model.layers import MultiHeadAttentionWithRoPE, MultiHeadCrossAttentionWithRoPE

# datasheets (SXM parts unless named): (bf16, TF32, float32) peak FLOP/s; the first name part found in
# torch.cuda.get_device_name() is used.
PEAK_FLOPS = {"H100 PCIe": (756e12, 378e12, 51e12), "H100": (989e12, 495e12, 67e12), "H200": (989e12, 495e12, 67e12),
              "A100": (312e12, 156e12, 19.5e12), "L40S": (362e12, 183e12, 91.6e12)}


@dataclass(frozen=True)
class Precision:
    """What training.amp resolves to on the training device."""

    autocast_dtype: torch.dtype | None  # bf16 autocast, or None: float32
    tf32: bool  # float32 matmuls run in TF32 (CUDA)
    peak_flops: float | None  # the device's peak at this precision; None: no MFU (CPU, or a GPU not in PEAK_FLOPS)
    text: str  # the log's line: which precision, why, and whether MFU is reported

    def autocast(self) -> torch.autocast:
        """bf16 autocast on CUDA when it applies; a no-op otherwise."""
        return torch.autocast("cuda", dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    @contextlib.contextmanager
    def kernels(self, deterministic: bool) -> Iterator[str]:
        """The block runs with TF32 matmuls when `tf32`, and with `deterministic` (training.deterministic) on
        deterministic kernels only (an op that has none raises); yields the log's words on determinism. The
        process's settings are put back afterwards. cuBLAS reads CUBLAS_WORKSPACE_CONFIG when its handle is made:
        it is set first."""
        before = (torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
                  torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
        torch.set_float32_matmul_precision("high" if self.tf32 else before[0])
        words = "off (GPU kernels may differ run to run)"
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
            words = ("on: torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG="
                     f"{os.environ['CUBLAS_WORKSPACE_CONFIG']}, cuDNN deterministic, compile 'auto' eager")
        try:
            yield words
        finally:
            torch.set_float32_matmul_precision(before[0])
            torch.use_deterministic_algorithms(before[1])
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def resolve_precision(amp: str, device: torch.device) -> Precision:
    """training.amp (checked with the other settings: schema.validate_training_config) on `device`: 'auto' = bf16
    autocast where the GPU supports it, else float32, with TF32 matmuls for what stays float32 (e.g. the predictor
    stage's frozen tokenizer); 'none' float32 (TF32 off); 'bf16' bf16 autocast; float32 on CPU."""
    if device.type != "cuda":
        return Precision(None, False, None, f"float32 (training.amp={amp}: no CUDA device); tokens/s, no MFU on CPU")
    name = torch.cuda.get_device_name(device)
    bf16 = amp == "bf16" or (amp == "auto" and torch.cuda.is_bf16_supported())
    why = f"training.amp={amp}" + (f": {name} {'supports' if bf16 else 'lacks'} bf16" if amp == "auto" else "")
    peak = next((p[0 if bf16 else 1 if amp == "auto" else 2] for part, p in PEAK_FLOPS.items() if part in name), None)
    text = ("bf16 autocast" if bf16 else "float32") + (", TF32 matmuls for what stays float32" if amp == "auto" else "")
    text += f" ({why}); " + (f"MFU against {peak / 1e12:.0f} TFLOP/s per device" if peak else
                             f"no MFU: {name}'s peak FLOP/s is not known")
    return Precision(torch.bfloat16 if bf16 else None, amp == "auto", peak, text)


def forward_flops_per_token(modules: Sequence[nn.Module], seq: int) -> float:
    """Forward FLOPs per token of `modules` on windows of `seq` tokens, counted as nanoGPT's estimate_mfu does: 2 per
    nn.Linear weight (a multiply-add) + 4 * d_model * seq per attention layer (q @ k^T and softmax @ v, the causal
    half not subtracted); lookups, norms and element-wise ops are left out. A training step costs 3x (backward: input
    and weight gradients), i.e. 6 * N + 12 * L * d_model * seq, also for frozen weights (lora / freeze: too high)."""
    found = [m for module in modules for m in module.modules()]
    weights = sum(m.weight.numel() for m in found if isinstance(m, nn.Linear))
    attention = sum(m.d_model for m in found
                    if isinstance(m, (MultiHeadAttentionWithRoPE, MultiHeadCrossAttentionWithRoPE)))
    return 2 * weights + 4 * attention * seq
