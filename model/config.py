"""Typed constructor arguments of the two models, in the spirit of nanoGPT's `GPTConfig` and Chronos' `ChronosConfig`:
one field per constructor argument (the published `config.json` keys), the published checkpoints' values as defaults,
e.g. `KronosTokenizer(**asdict(KronosTokenizerConfig(d_model=32)))`. `problems(prefix)` lists every value that the
constructor would reject or that cannot be allocated sanely, so configs and untrusted `config.json` files are checked
before any tensor exists."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# Sane upper bounds for values read from files we did not write (a config.json from the Hub, a YAML typo):
# far above every published model, far below what would try to allocate terabytes.
MAX_WIDTH = 16_384
MAX_LAYERS = 256
MAX_BITS = 20  # vocabulary 2^20 ~ 1M tokens per sub-token
# Each field can be within bounds and the model still need terabytes (d_model 16384 x 256 layers): the total
# parameter count is bounded too, before anything is allocated. Kronos-base has ~100M; 2e9 leaves room.
DEFAULT_MAX_PARAMETERS = 2_000_000_000


def block_parameters(d_model: int, ff_dim: int) -> int:
    """Parameters of one `layers.TransformerBlock`: two RMSNorms, q/k/v/out projections with bias, SwiGLU."""
    return 2 * d_model + 4 * (d_model * d_model + d_model) + 3 * d_model * ff_dim


@dataclass(frozen=True)
class Window:
    """One sample of the sequence a predictor trains and forecasts on: `lookback` bars of context, then `predict`
    bars to forecast; the features are normalised over the lookback and clipped to [-clip, clip]. `size` is the
    predictor's context (kronos_predictor.json's max_context). Both pipelines' `data:` sections give one (`window`)."""

    lookback: int
    predict: int
    clip: float = 5.0

    @property
    def size(self) -> int:
        return self.lookback + self.predict

    def info(self) -> dict[str, Any]:
        """The one saved form of a window: kronos_predictor.json's keys, a checkpoint's "window"."""
        return {"max_context": self.size, "lookback": self.lookback, "clip": self.clip}

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any] | None) -> Window | None:
        """The window a file records: `info()`'s form, or a checkpoint's older {lookback, predict, clip}; None when it
        records none. A missing clip is the default one (files written before it was recorded)."""
        saved = saved or {}
        if "lookback" not in saved or not ("predict" in saved or "max_context" in saved):
            return None
        predict = saved["predict"] if "predict" in saved else saved["max_context"] - saved["lookback"]
        return cls(int(saved["lookback"]), int(predict), float(saved.get("clip", cls.clip)))

    def differences(self, recorded: Window | None, keys: tuple[str, ...] = ("lookback", "predict", "clip")
                    ) -> list[tuple[str, Any, Any]]:
        """(setting, recorded, now) for each of `keys` where `recorded` (what a model was trained on) differs from
        this window: the one compatibility check (a resume and a finished run compare all three; a forecast may
        use another horizon, so it compares lookback and clip)."""
        if recorded is None:
            return []
        return [(f"data.{k}", getattr(recorded, k), getattr(self, k)) for k in keys
                if getattr(recorded, k) != getattr(self, k)]


@dataclass
class KronosTokenizerConfig:
    """`KronosTokenizer` constructor arguments (defaults: the published Kronos-Tokenizer-base)."""

    d_in: int = 6
    """Features per candle: open, high, low, close, volume, amount."""
    d_model: int = 256
    """Width of the tokenizer's transformer."""
    n_heads: int = 4
    """Attention heads (must divide d_model)."""
    ff_dim: int = 512
    """Hidden width of the feed-forward layers."""
    n_enc_layers: int = 4
    """Encoder depth (the model builds n_enc_layers - 1 blocks, as the published one does)."""
    n_dec_layers: int = 4
    """Decoder depth (n_dec_layers - 1 blocks)."""
    ffn_dropout_p: float = 0.0
    """Dropout after the feed-forward layers."""
    attn_dropout_p: float = 0.0
    """Dropout on attention weights."""
    resid_dropout_p: float = 0.0
    """Dropout on the attention output."""
    s1_bits: int = 10
    """Bits of the coarse sub-token (vocabulary 2^s1_bits)."""
    s2_bits: int = 10
    """Bits of the fine sub-token (must equal s1_bits)."""
    beta: float = 0.05
    """Commitment loss weight of the BSQ quantizer."""
    gamma0: float = 1.0
    """Per-sample entropy weight."""
    gamma: float = 1.1
    """Codebook entropy weight."""
    zeta: float = 0.05
    """Weight of the entropy terms."""
    group_size: int = 4
    """Quantizer group size for the codebook entropy (must divide s1_bits + s2_bits)."""

    def parameter_count(self) -> int:
        """The tokenizer's number of parameters, from the arithmetic of its layers (nothing is allocated)."""
        d, code = self.d_model, self.s1_bits + self.s2_bits
        blocks = (self.n_enc_layers - 1 + self.n_dec_layers - 1) * block_parameters(d, self.ff_dim)
        # embed, quant_embed, post_quant_embed_pre, post_quant_embed, head (Linear layers with bias)
        return (blocks + (self.d_in + 1) * d + (d + 1) * code + (self.s1_bits + 1) * d + (code + 1) * d
                + (d + 1) * self.d_in)

    def problems(self, prefix: str = "") -> list[tuple[str, str]]:
        """Every invalid value as (key, message); empty when the tokenizer can be built."""
        k = _keyer(prefix)
        out = _type_problems(self, k)
        if out:
            return out
        _bounded(out, k("d_in"), self.d_in, 1, 1024)
        _bounded(out, k("d_model"), self.d_model, 1, MAX_WIDTH)
        _bounded(out, k("ff_dim"), self.ff_dim, 1, 4 * MAX_WIDTH)
        _bounded(out, k("n_heads"), self.n_heads, 1, max(self.d_model, 1))
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            out.append((k("n_heads"), f"({self.n_heads}) must divide d_model ({self.d_model})"))
        _bounded(out, k("n_enc_layers"), self.n_enc_layers, 1, MAX_LAYERS)
        _bounded(out, k("n_dec_layers"), self.n_dec_layers, 1, MAX_LAYERS)
        for name in ("ffn_dropout_p", "attn_dropout_p", "resid_dropout_p"):
            _bounded(out, k(name), getattr(self, name), 0.0, 1.0, high_open=True)
        _bounded(out, k("s1_bits"), self.s1_bits, 1, MAX_BITS)
        _bounded(out, k("s2_bits"), self.s2_bits, 1, MAX_BITS)
        if self.s1_bits != self.s2_bits:
            out.append((k("s2_bits"), f"must equal s1_bits ({self.s2_bits} != {self.s1_bits}): decoding assumes it"))
        _bounded(out, k("group_size"), self.group_size, 1, 16)
        if self.group_size >= 1 and (self.s1_bits + self.s2_bits) % self.group_size:
            out.append((k("group_size"),
                        f"({self.group_size}) must divide s1_bits + s2_bits ({self.s1_bits + self.s2_bits})"))
        for name in ("beta", "gamma0", "gamma", "zeta"):
            _bounded(out, k(name), getattr(self, name), 0.0, 1e6)
        return out


@dataclass
class KronosConfig:
    """`Kronos` (predictor) constructor arguments (defaults: the published Kronos-small); null bits are filled in
    from the paired tokenizer by a factory, which refuses bits that differ from the tokenizer's."""

    s1_bits: int | None = None
    """Bits of the coarse sub-token; null = the tokenizer's."""
    s2_bits: int | None = None
    """Bits of the fine sub-token; null = the tokenizer's."""
    n_layers: int = 8
    """Transformer depth."""
    d_model: int = 512
    """Width of the transformer (a multiple of 4: the dependency layer always has 4 heads)."""
    n_heads: int = 8
    """Attention heads (must divide d_model)."""
    ff_dim: int = 1024
    """Hidden width of the feed-forward layers."""
    ffn_dropout_p: float = 0.2
    """Dropout after the feed-forward layers."""
    attn_dropout_p: float = 0.0
    """Dropout on attention weights."""
    resid_dropout_p: float = 0.2
    """Dropout on the attention output."""
    token_dropout_p: float = 0.0
    """Dropout on the input embeddings."""
    learn_te: bool = True
    """Learned time embeddings (true, as published) or fixed sinusoidal ones."""

    def parameter_count(self) -> int:
        """The predictor's number of parameters, from the arithmetic of its layers (nothing is allocated); the
        bits must be set."""
        d, v1, v2 = self.d_model, 2 ** self.s1_bits, 2 ** self.s2_bits
        embedding = (v1 + v2) * d + (2 * d + 1) * d  # emb_s1, emb_s2, fusion_proj
        time = (60 + 24 + 7 + 32 + 13) * d           # minute, hour, weekday, day, month tables
        dep = 4 * (d * d + d) + d                    # cross-attention projections + norm
        head = (d + 1) * (v1 + v2)
        return embedding + time + self.n_layers * block_parameters(d, self.ff_dim) + d + dep + head

    def problems(self, prefix: str = "") -> list[tuple[str, str]]:
        """Every invalid value as (key, message); empty when the predictor can be built (bits may be null)."""
        k = _keyer(prefix)
        out = _type_problems(self, k)
        if out:
            return out
        for name in ("s1_bits", "s2_bits"):
            if getattr(self, name) is not None:
                _bounded(out, k(name), getattr(self, name), 1, MAX_BITS)
        _bounded(out, k("n_layers"), self.n_layers, 1, MAX_LAYERS)
        _bounded(out, k("d_model"), self.d_model, 4, MAX_WIDTH)
        if self.d_model % 4:
            out.append((k("d_model"), f"({self.d_model}) must be a multiple of 4 (the dependency layer has 4 heads)"))
        _bounded(out, k("ff_dim"), self.ff_dim, 1, 4 * MAX_WIDTH)
        _bounded(out, k("n_heads"), self.n_heads, 1, max(self.d_model, 1))
        if self.n_heads >= 1 and self.d_model % self.n_heads:
            out.append((k("n_heads"), f"({self.n_heads}) must divide d_model ({self.d_model})"))
        for name in ("ffn_dropout_p", "attn_dropout_p", "resid_dropout_p", "token_dropout_p"):
            _bounded(out, k(name), getattr(self, name), 0.0, 1.0, high_open=True)
        return out


def _keyer(prefix: str):
    return lambda name: f"{prefix}.{name}" if prefix else name


_TYPE_CHECKS = {  # the annotation's first type -> its check; bool is not an int here
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
}


def _type_problems(cfg: Any, k) -> list[tuple[str, str]]:
    """Wrong types first (a string d_model would make every bound check meaningless)."""
    out = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        want = str(f.type)
        check = next((c for t, c in _TYPE_CHECKS.items() if want.startswith(t)), None)
        if not (value is None and "None" in want) and check is not None and not check(value):
            out.append((k(f.name), f"must be {want.split(' |')[0]}, got {value!r} ({type(value).__name__})"))
    return out


def _bounded(out: list, key: str, value: float, low: float, high: float, high_open: bool = False) -> None:
    if value < low or value > high or (high_open and value >= high):
        upper = f"< {high}" if high_open else f"<= {high}"
        out.append((key, f"must be >= {low} and {upper}, got {value}"))
