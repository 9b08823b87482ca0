"""The models a pipeline starts from: the `model:` settings both pipelines share, and the one factory that builds them.

    model:
      pretrained_tokenizer: NeoQuasar/Kronos-Tokenizer-base   # folder or hub id; null = from scratch (tokenizer_arch)
      pretrained_predictor: NeoQuasar/Kronos-small            # folder or hub id; null = from scratch (predictor_arch)
      tokenizer_arch: {d_model: 32, ...}                      # model.config.KronosTokenizerConfig
      predictor_arch: {n_layers: 2, ...}                      # model.config.KronosConfig (bits null = the tokenizer's)

A pretrained folder or hub id wins over the architecture, which is then ignored (and not checked). Every failure
is a ValueError naming the YAML keys to change."""
from __future__ import annotations

from dataclasses import asdict

from finetune.utils.checkpoint import check_token_sizes
from finetune.utils.config_utils import Problems
from model import Kronos, KronosTokenizer
from model.config import KronosConfig, KronosTokenizerConfig
from model.hub import load_pretrained


def build_tokenizer(pretrained: str | None, arch: KronosTokenizerConfig, key: str = "model") -> KronosTokenizer:
    """The tokenizer to finetune: `pretrained` loaded (folder or hub id), or with None a fresh one built from `arch`;
    errors name `{key}.pretrained_tokenizer` / `{key}.tokenizer_arch`."""
    if pretrained is not None:
        return load_pretrained(KronosTokenizer, pretrained, f"{key}.pretrained_tokenizer")
    problems = Problems(f"Invalid {key}.tokenizer_arch")
    for k, message in arch.problems(f"{key}.tokenizer_arch"):
        problems.add(k, message)
    problems.raise_if_any()
    return KronosTokenizer(**asdict(arch))


def build_predictor(pretrained: str | None, arch: KronosConfig, tokenizer: KronosTokenizer, key: str = "model",
                    *, tokenizer_key: str | None = None) -> Kronos:
    """The predictor to finetune, reading the tokens of `tokenizer`: `pretrained` loaded, or with None a fresh one
    built from `arch` (its s1_bits / s2_bits None = the tokenizer's). Its vocabularies (2^s1_bits, 2^s2_bits) match
    the tokenizer's; a mismatch is a ValueError naming the keys that chose the pair (`tokenizer_key`: the setting
    the tokenizer came from, default `{key}.pretrained_tokenizer / {key}.tokenizer_arch`)."""
    tokenizer_key = tokenizer_key or f"{key}.pretrained_tokenizer / {key}.tokenizer_arch"
    if pretrained is not None:
        predictor = load_pretrained(Kronos, pretrained, f"{key}.pretrained_predictor")
        check_token_sizes(tokenizer, predictor, f"{tokenizer_key} / {key}.pretrained_predictor")
        return predictor
    problems = Problems(f"Invalid {key}.predictor_arch")
    for k, message in arch.problems(f"{key}.predictor_arch"):
        problems.add(k, message)
    args = asdict(arch)
    for bits in ("s1_bits", "s2_bits"):
        have = getattr(tokenizer, bits)
        if args[bits] is None:
            args[bits] = have
        problems.check(args[bits] == have, f"{key}.predictor_arch.{bits}",
                       f"is {args[bits]} but the tokenizer ({tokenizer_key}) has {bits} = {have}; set it to null "
                       "(= the tokenizer's) or to the same value")
    problems.raise_if_any()
    return Kronos(**args)
