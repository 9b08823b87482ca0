"""Finetune modes of the predictor stage (`training.finetune_mode`): one class each in the registry `MODES`, which
the configuration checks, the stage runner and the trainer read (a new mode is one class here). The settings, what a
run writes per mode and the published `best_model/`: docs/architecture.md, "Formats and designs"."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from model.errors import ConfigError, MissingExtraError
from model.fileio import atomic_dir, write_json

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


def lora_target_names(model: Any, targets: list[str]) -> list[str]:
    """The Linear module names (last name part) that `targets` (groups or names) select in `model`; a target that
    matches no Linear is a ConfigError naming training.lora_targets and what exists."""
    from torch import nn

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


class Adapter:
    """full: every parameter trains. The base of the modes: what the trainer asks of a model prepared for one.
    `model`: the module the loop trains; `base_fingerprint`: sha256 of every tensor that does not train, or None."""

    name: ClassVar[str] = "full"
    trains_tokenizer: ClassVar[bool] = True  # may the tokenizer stage run in this mode

    def __init__(self, model: Any):
        self.model = model
        self.base_fingerprint: str | None = None

    @staticmethod
    def problems(cfg: Any) -> list[tuple[str, str]]:
        """(field of `training:`, message) for each setting of this mode that is wrong on its own."""
        return []

    @classmethod
    def check(cls, model: Any, cfg: Any) -> None:
        """ConfigError when the settings select what `model` lacks (the runner asks before any data is written)."""

    @classmethod
    def prepare(cls, model: Any, cfg: Any) -> Adapter:
        """`model` set up for this mode, before the optimizer is built."""
        return cls(model)

    def trainable_names(self) -> list[str]:
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def counts(self) -> dict[str, Any]:
        """{"finetune_mode", "trainable_parameters", "total_parameters"} (run_info.json and the log)."""
        params = list(self.model.parameters())
        return {"finetune_mode": self.name, "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
                "total_parameters": sum(p.numel() for p in params)}

    def checkpoint_state(self) -> dict[str, Any]:
        """The checkpoint's "model"."""
        return self.model.state_dict()

    def load_checkpoint_state(self, state: dict[str, Any], path: Path) -> None:
        """Load what `checkpoint_state` wrote (`path` names the checkpoint in errors)."""
        self.model.load_state_dict(state)

    def published_model(self) -> Any:
        """The model as best_model/ holds it."""
        return self.model

    def save_best(self, folder: Path, extra_json: dict[str, Any], extra_models: dict[str, Any] | None = None) -> None:
        """best_model/ in the published format plus `extra_json` files and `extra_models` subfolders (and what the
        mode adds, `save_extra`), swapped in whole (atomic_dir): a reader never sees a mix of old and new files."""
        with atomic_dir(folder, sealed=True) as tmp:  # SHA256SUMS: from_pretrained refuses a damaged file
            self.published_model().save_pretrained(str(tmp))
            for name, data in extra_json.items():
                write_json(tmp / name, data)
            for name, extra in (extra_models or {}).items():
                extra.save_pretrained(str(tmp / name))
            self.save_extra(tmp)

    def save_extra(self, tmp: Path) -> None:
        """Files of this mode beside the published model."""

    def unload(self) -> None:
        """Leave the model plain after training."""


class PartialAdapter(Adapter):
    """Part of the model trains: checkpoints hold it only; the frozen rest is fingerprinted (resume checks it)."""

    trains_tokenizer = False

    def __init__(self, model: Any):
        from model.hub import weights_fingerprint

        super().__init__(model)
        trainable = set(self.trainable_names())
        self.base_fingerprint = weights_fingerprint({k: v for k, v in model.state_dict().items() if k not in trainable})

    def checkpoint_state(self) -> dict[str, Any]:
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def load_checkpoint_state(self, state: dict[str, Any], path: Path) -> None:
        expected = set(self.trainable_names())
        if set(state) != expected:
            raise ConfigError([f"training.finetune_mode: {path} holds {len(state)} tensors, not the {len(expected)} "
                               f"trainable parameters of this {self.name} run; set training.overwrite=true to start "
                               "over"], title=f"Cannot resume from {path}")
        self.model.load_state_dict(state, strict=False)


class FreezeAdapter(PartialAdapter):
    """freeze: the parameters named by `training.trainable` prefixes train (default: the heads and the last block)."""

    name = "freeze"

    def __init__(self, model: Any, saved_requires_grad: dict[str, bool]):
        super().__init__(model)
        self.saved_requires_grad = saved_requires_grad  # restored after training

    @staticmethod
    def trainable(model: Any, cfg: Any) -> list[str]:
        """`cfg.trainable`, or when empty the default: `head` and the last transformer block."""
        if cfg.trainable:
            return list(cfg.trainable)
        blocks = _blocks(model)
        return ["head"] + ([f"transformer.{blocks - 1}"] if blocks else [])

    @classmethod
    def check(cls, model: Any, cfg: Any) -> None:
        names = [name for name, _ in model.named_parameters()]
        unused = [t for t in cls.trainable(model, cfg) if not any(_prefix_matches(n, t) for n in names)]
        if unused:
            tops = sorted({n.split(".")[0] for n in names})
            blocks = _blocks(model)
            raise ConfigError([f"training.trainable: {unused} match no parameter name; names start with {tops}, and "
                               f"the model has {blocks} transformer blocks (transformer.0 ... "
                               f"transformer.{max(blocks - 1, 0)})"])

    @classmethod
    def prepare(cls, model: Any, cfg: Any) -> Adapter:
        cls.check(model, cfg)
        prefixes = cls.trainable(model, cfg)
        saved = {name: p.requires_grad for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad and any(_prefix_matches(name, t) for t in prefixes))
        return cls(model, saved)

    def unload(self) -> None:
        for name, p in self.model.named_parameters():
            p.requires_grad_(self.saved_requires_grad.get(name, p.requires_grad))


class LoraAdapter(PartialAdapter):
    """lora: peft's low-rank adapters beside the `training.lora_targets` layers; best_model/ merged."""

    name = "lora"

    def __init__(self, model: Any, peft_model: Any):
        super().__init__(model)
        self.peft_model = peft_model  # peft's wrapper around `model` (writes the adapter in peft's format)

    @staticmethod
    def problems(cfg: Any) -> list[tuple[str, str]]:
        out = [("lora_rank", f"must be >= 1, got {cfg.lora_rank}")] if cfg.lora_rank < 1 else []
        out += [("lora_alpha", f"must be > 0, got {cfg.lora_alpha}")] if not cfg.lora_alpha > 0 else []
        out += [("lora_dropout", f"must be in [0, 1), got {cfg.lora_dropout}")] if not 0 <= cfg.lora_dropout < 1 else []
        if not cfg.lora_targets:
            out.append(("lora_targets", "must name at least one layer group or module, e.g. [attention]"))
        return out

    @classmethod
    def check(cls, model: Any, cfg: Any) -> None:
        lora_target_names(model, cfg.lora_targets)

    @classmethod
    def prepare(cls, model: Any, cfg: Any) -> Adapter:
        """The adapters start from `cfg.seed` (the same on every run and rank; the global streams untouched)."""
        import torch

        peft = _import_peft()
        config = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                 target_modules=lora_target_names(model, cfg.lora_targets), bias="none")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)  # lora_A's random init (lora_B starts at 0: the run starts at the base model)
            return cls(model, peft.get_peft_model(model, config))

    def merged_state(self) -> dict[str, Any]:
        """The state dict in the published keys with each adapter folded in: W + alpha / r * B @ A."""
        import torch
        from peft.tuners.lora import LoraLayer

        state = {k.replace(".base_layer.", "."): v for k, v in self.model.state_dict().items() if ".lora_" not in k}
        with torch.no_grad():
            for name, module in self.model.named_modules():
                if isinstance(module, LoraLayer):
                    weight = f"{name}.weight"
                    state[weight] = state[weight] + module.get_delta_weight(ADAPTER_NAME).to(state[weight].dtype)
        return state

    def published_model(self) -> Any:
        """A shell of the model on the meta device (no memory, no random draws) holding the merged tensors."""
        import torch

        with torch.device("meta"):
            merged = type(self.model)(**self.model.config)
        merged.load_state_dict(self.merged_state(), assign=True)
        return merged

    def save_extra(self, tmp: Path) -> None:
        self.peft_model.save_pretrained(str(tmp / ADAPTER_DIR))

    def unload(self) -> None:
        self.peft_model.merge_and_unload()  # in place: the caller's predictor is a plain Kronos again


# training.finetune_mode -> its class
MODES: dict[str, type[Adapter]] = {mode.name: mode for mode in (Adapter, LoraAdapter, FreezeAdapter)}


def _blocks(model: Any) -> int:
    """Number of transformer blocks (parameters named transformer.<i>...)."""
    return len({n.split(".")[1] for n, _ in model.named_parameters() if n.startswith("transformer.")})


def mode_problems(cfg: Any) -> list[tuple[str, str]]:
    """(field, message) for `cfg.finetune_mode` and the settings of that mode (configuration checks)."""
    mode = MODES.get(cfg.finetune_mode)
    if mode is None:
        names = [repr(n) for n in MODES]
        return [("finetune_mode", f"must be {', '.join(names[:-1])} or {names[-1]}, got {cfg.finetune_mode!r}")]
    return mode.problems(cfg)


def prepare(model: Any, cfg: Any, stage: str) -> Adapter:
    """Set `model` up for `cfg.finetune_mode` before the optimizer is built; the `Adapter` the trainer uses.

    Raises ConfigError for a mode setting that is wrong, a target or prefix that matches nothing, for lora /
    freeze of the tokenizer stage, and MissingExtraError when lora is asked for without peft."""
    problems = mode_problems(cfg)  # before peft sees a rank or the model is touched
    if problems:
        raise ConfigError([f"training.{key}: {message}" for key, message in problems])
    mode = MODES[cfg.finetune_mode]
    if stage != "predictor" and not mode.trains_tokenizer:
        raise ConfigError([f"training.finetune_mode: '{mode.name}' applies to the predictor stage only (the "
                           "tokenizer then stays as it is): skip the tokenizer stage, or train it with "
                           "finetune_mode=full"])
    return mode.prepare(model, cfg)
