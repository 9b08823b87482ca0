"""Finetune modes of the predictor stage (`training.finetune_mode`): all weights, LoRA adapters, or named parts.

    training:
      finetune_mode: lora           # full | lora | freeze
      lora_rank: 8                  # lora: B (out, r) @ A (r, in) beside each target layer, scaled alpha / r
      lora_alpha: 16
      lora_dropout: 0.0
      lora_targets: [attention]     # groups (LORA_GROUPS) or module names, e.g. [attention, heads] or [q_proj, w1]
      trainable: [head, transformer.7]   # freeze: parameter-name prefixes that train (dotted: transformer.1 is
                                         # not transformer.10)

- full: every parameter trains (the published recipe); checkpoints hold the whole state dict.
- lora: `peft` injects LoRA layers into the model in place (the base weights frozen); only the adapters train.
- freeze: parameters whose names start with one of `trainable` train; the rest get requires_grad=False and are not
  in the optimizer.
The tokenizer is frozen in every mode of the predictor stage; lora / freeze of the tokenizer stage is refused
(the pipelines keep the given tokenizer instead).

What a run writes (`Adapter`): in lora / freeze, step checkpoints hold the trainable parameters only (and the
optimizer state of those), so they are small; a resume rebuilds the base model the pipeline loaded, checks it is
the same (its sha256 joins the frozen tokenizer's in the checkpoint), then loads them. `best_model/` is always the
published format: for lora the adapters merged into the weights (W + alpha / r * B @ A), so
`KronosPredictor.from_pretrained`, `kronos forecast` and `push_to_hub` need nothing new, and the adapter alone in
peft's format under `best_model/adapter/` (`PeftModel.from_pretrained(base_model, "best_model/adapter")`).
After training the in-memory model is plain again (lora: merged, freeze: requires_grad restored).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from finetune.utils.checkpoint import save_pretrained_atomic, write_extras
from finetune.utils.config_utils import Problems, TrainingConfig, validate_training_config
from model.errors import ConfigError, MissingExtraError
from model.fileio import atomic_dir

# Layer groups of the Kronos predictor (model/layers.py, model/kronos.py): names of nn.Linear modules.
LORA_GROUPS = {
    "attention": ("q_proj", "k_proj", "v_proj", "out_proj"),  # self-attention of every block + the dependency layer
    "feed_forward": ("w1", "w2", "w3"),  # SwiGLU of every block
    "heads": ("proj_s1", "proj_s2"),  # the two vocabulary projections
    "embedding": ("fusion_proj",),  # the (s1, s2) embedding fusion
}
ADAPTER_DIR = "adapter"
ADAPTER_NAME = "default"  # peft's name of the one adapter


def _prefix_matches(name: str, prefix: str) -> bool:
    """`transformer.1` matches transformer.1 and transformer.1.x, not transformer.10."""
    prefix = prefix.rstrip(".")
    return name == prefix or name.startswith(prefix + ".")


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise MissingExtraError("training.finetune_mode=lora needs the peft library, which is not installed; install "
                                "it with: pip install 'kronos-finetune[lora]'  (from a checkout: pip install "
                                "'.[lora]'), or set training.finetune_mode to full or freeze") from e
    return peft


def lora_target_names(model: nn.Module, targets: list[str]) -> list[str]:
    """The Linear module names (last name part) that `targets` (groups or names) select in `model`; a target that
    matches no Linear is a ConfigError naming training.lora_targets and what exists."""
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    names, unknown = [], []
    for target in targets:
        wanted = LORA_GROUPS.get(target, (target,))
        if not set(wanted) & linear:
            unknown.append(target)
        names.extend(n for n in wanted if n in linear and n not in names)
    if unknown:
        raise ConfigError([f"training.lora_targets: {unknown} match no linear layer of the model; use groups "
                           f"{sorted(LORA_GROUPS)} or module names {sorted(linear)}"])
    return names


def _fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes (name order)."""
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Adapter:
    """One model prepared for a finetune mode; what the trainer asks of it (`prepare` builds it).

    model: the module the loop trains (for lora: with peft's LoRA layers injected in place).
    mode: 'full' | 'lora' | 'freeze'.
    peft_model: peft's wrapper around `model` (lora only; it writes the adapter in peft's format).
    base_fingerprint: sha256 of every tensor that does not train (None in full mode).
    """

    def __init__(self, model: nn.Module, mode: str = "full", peft_model: Any = None):
        self.model, self.mode, self.peft_model = model, mode, peft_model
        self.base_fingerprint: str | None = None
        if mode != "full":
            trainable = set(self.trainable_names())
            self.base_fingerprint = _fingerprint({k: v for k, v in model.state_dict().items() if k not in trainable})
        self.saved_requires_grad: dict[str, bool] = {}  # freeze: the flags to restore after training

    def trainable_names(self) -> list[str]:
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def counts(self) -> dict[str, Any]:
        """{"finetune_mode", "trainable_parameters", "total_parameters"} (run_info.json and the log)."""
        params = list(self.model.parameters())
        return {"finetune_mode": self.mode, "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
                "total_parameters": sum(p.numel() for p in params)}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The checkpoint's "model": the whole state dict (full), else the trainable parameters only."""
        if self.mode == "full":
            return self.model.state_dict()
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], path: Path) -> None:
        """Load what `checkpoint_state` wrote (`path` names the checkpoint in errors)."""
        if self.mode == "full":
            self.model.load_state_dict(state)
            return
        expected = set(self.trainable_names())
        if set(state) != expected:
            raise ConfigError([f"training.finetune_mode: {path} holds {len(state)} tensors, not the {len(expected)} "
                               f"trainable parameters of this {self.mode} run; set training.overwrite=true to start "
                               "over"], title=f"Cannot resume from {path}")
        self.model.load_state_dict(state, strict=False)

    def merged_state(self) -> dict[str, torch.Tensor]:
        """lora: the state dict in the published keys with each adapter folded in: W + alpha / r * B @ A."""
        from peft.tuners.lora import LoraLayer

        state = {k.replace(".base_layer.", "."): v for k, v in self.model.state_dict().items() if ".lora_" not in k}
        with torch.no_grad():
            for name, module in self.model.named_modules():
                if isinstance(module, LoraLayer):
                    weight = f"{name}.weight"
                    state[weight] = state[weight] + module.get_delta_weight(ADAPTER_NAME).to(state[weight].dtype)
        return state

    def save_best(self, folder: Path, extra_json: dict[str, Any], extra_models: dict[str, Any] | None = None) -> None:
        """best_model/ in the published format (lora: merged) plus `extra_json` files and `extra_models` subfolders,
        and for lora the adapter alone in peft's format under `adapter/`; swapped in whole (atomic_dir)."""
        if self.mode != "lora":
            save_pretrained_atomic(self.model, folder, extra_json=extra_json, extra_models=extra_models)
            return
        # A shell of the model on the meta device (no memory, no random draws) takes the merged tensors as they are.
        with torch.device("meta"):
            merged = type(self.model)(**self.model.config)
        merged.load_state_dict(self.merged_state(), assign=True)
        with atomic_dir(folder) as tmp:
            merged.save_pretrained(str(tmp))
            write_extras(tmp, extra_json, extra_models)
            self.peft_model.save_pretrained(str(tmp / ADAPTER_DIR))

    def unload(self) -> None:
        """Leave the model plain after training: lora merged into the weights (peft's merge_and_unload, in place),
        freeze's requires_grad flags restored."""
        if self.mode == "lora":
            self.peft_model.merge_and_unload()
        for name, p in self.model.named_parameters():
            p.requires_grad_(self.saved_requires_grad.get(name, p.requires_grad))


def prepare(model: nn.Module, cfg: TrainingConfig, stage: str) -> Adapter:
    """Set `model` up for `cfg.finetune_mode` before the optimizer is built; the `Adapter` the trainer uses.

    lora adapters are initialised from `cfg.seed` (the same on every run and rank; the global random streams are
    left as they were). Raises ConfigError for a target or prefix that matches nothing, for lora / freeze of the
    tokenizer stage, and MissingExtraError when lora is asked for without peft.
    """
    problems = Problems()
    validate_training_config(cfg, problems)  # before peft sees a rank or the model is touched
    problems.raise_if_any()
    mode = cfg.finetune_mode
    if mode == "full":
        return Adapter(model)
    if stage != "predictor":
        raise ConfigError([f"training.finetune_mode: '{mode}' applies to the predictor stage only (the tokenizer "
                           "then stays as it is): skip the tokenizer stage, or train it with finetune_mode=full"])
    if mode == "freeze":
        saved = {name: p.requires_grad for name, p in model.named_parameters()}
        unused = [t for t in cfg.trainable if not any(_prefix_matches(n, t) for n in saved)]
        if unused:
            tops = sorted({n.split(".")[0] for n in saved})
            raise ConfigError([f"training.trainable: {unused} match no parameter name; names start with {tops} "
                               "(blocks: transformer.0 ... transformer.N-1)"])
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad and any(_prefix_matches(name, t) for t in cfg.trainable))
        adapter = Adapter(model, mode)
        adapter.saved_requires_grad = saved
    else:
        peft = _import_peft()
        config = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                 target_modules=lora_target_names(model, cfg.lora_targets), bias="none")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)  # lora_A's random init (lora_B starts at 0: the run starts at the base model)
            adapter = Adapter(model, mode, peft.get_peft_model(model, config))
    return adapter
