"""Tiny Kronos models for tests (built locally: nothing is downloaded). The single implementation: the fixtures in
tests/conftest.py and the engine worker (tests/engine_dist_worker.py) call these functions."""
from __future__ import annotations

from typing import Any

import torch

from model import Kronos, KronosTokenizer

TINY_TOKENIZER = dict(d_in=6, d_model=16, n_heads=2, ff_dim=32, n_enc_layers=2, n_dec_layers=2, ffn_dropout_p=0.0,
                      attn_dropout_p=0.0, resid_dropout_p=0.0, s1_bits=4, s2_bits=4, beta=0.05, gamma0=1.0,
                      gamma=1.1, zeta=0.05, group_size=4)
TINY_PREDICTOR = dict(s1_bits=4, s2_bits=4, n_layers=2, d_model=16, n_heads=2, ff_dim=32, ffn_dropout_p=0.0,
                      attn_dropout_p=0.0, resid_dropout_p=0.0, token_dropout_p=0.0, learn_te=True)


def _dropout(p: float | None) -> dict[str, Any]:
    return {} if p is None else {"ffn_dropout_p": p, "resid_dropout_p": p}


def tiny_tokenizer(seed: int | None = 0, dropout: float | None = None, **overrides: Any) -> KronosTokenizer:
    """A width-16 tokenizer (4+4 bits), seeded with `seed` (None = do not reseed), in training mode as built.

    dropout sets ffn and residual dropout; overrides replace TINY_TOKENIZER entries (e.g. gamma=0).
    """
    if seed is not None:
        torch.manual_seed(seed)
    return KronosTokenizer(**{**TINY_TOKENIZER, **_dropout(dropout), **overrides})


def tiny_predictor(seed: int | None = 1, dropout: float | None = None, **overrides: Any) -> Kronos:
    """A width-16 predictor matching `tiny_tokenizer`, seeded with `seed` (None = do not reseed), training mode."""
    if seed is not None:
        torch.manual_seed(seed)
    return Kronos(**{**TINY_PREDICTOR, **_dropout(dropout), **overrides})


def tiny_models(seed: int = 0, **predictor_overrides: Any) -> tuple[KronosTokenizer, Kronos]:
    """(tokenizer, predictor) in eval mode, both drawn after one `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    tok = tiny_tokenizer(seed=None)
    pred = tiny_predictor(seed=None, **predictor_overrides)
    return tok.eval(), pred.eval()
