"""Tiny Kronos models for tests (built locally: nothing is downloaded)."""
from __future__ import annotations

import torch

from model import Kronos, KronosTokenizer

TINY_TOKENIZER = dict(d_in=6, d_model=16, n_heads=2, ff_dim=32, n_enc_layers=2, n_dec_layers=2, ffn_dropout_p=0.0,
                      attn_dropout_p=0.0, resid_dropout_p=0.0, s1_bits=4, s2_bits=4, beta=0.05, gamma0=1.0,
                      gamma=1.1, zeta=0.05, group_size=4)
TINY_PREDICTOR = dict(s1_bits=4, s2_bits=4, n_layers=2, d_model=16, n_heads=2, ff_dim=32, ffn_dropout_p=0.0,
                      attn_dropout_p=0.0, resid_dropout_p=0.0, token_dropout_p=0.0, learn_te=True)


def tiny_models(seed: int = 0, **predictor_overrides) -> tuple[KronosTokenizer, Kronos]:
    torch.manual_seed(seed)
    tok = KronosTokenizer(**TINY_TOKENIZER)
    pred = Kronos(**{**TINY_PREDICTOR, **predictor_overrides})
    return tok.eval(), pred.eval()
