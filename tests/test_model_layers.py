"""Attention facts the published checkpoints rely on: causality rules, rotary positions, the dependency layer."""
import pytest
import torch

from model.layers import (
    MultiHeadAttentionWithRoPE,
    MultiHeadCrossAttentionWithRoPE,
    RMSNorm,
    RotaryPositionalEmbedding,
)
from tests.model_factory import tiny_models


def test_rmsnorm_matches_formula():
    norm = RMSNorm(8)
    x = torch.randn(3, 8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(norm(x), expected, atol=1e-6)


def test_rotary_is_identity_at_position_zero_and_relative():
    rot = RotaryPositionalEmbedding(8)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    q1, k1 = rot(q, k)
    assert torch.equal(q1, q) and torch.equal(k1, k)  # query length 1: no rotation of q or k
    # scores depend on position differences only: q at 3 with k at 1 scores like q at 7 with k at 5
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    at = lambda v, pos: rot(v, v, offset=pos)[0]
    assert torch.allclose((at(q, 3) * at(k, 1)).sum(), (at(q, 7) * at(k, 5)).sum(), atol=1e-5)


def test_self_attention_is_causal_in_train_and_eval():
    torch.manual_seed(0)
    attn = MultiHeadAttentionWithRoPE(16, 2)
    x = torch.randn(1, 6, 16)
    for mode in (attn.train, attn.eval):
        mode()
        y = x.clone()
        y[:, 4:] += 1.0
        assert torch.allclose(attn(x)[:, :4], attn(y)[:, :4], atol=1e-6)


def test_self_attention_padding_mask_true_means_attend():
    torch.manual_seed(0)
    attn = MultiHeadAttentionWithRoPE(16, 2).eval()
    x = torch.randn(1, 5, 16)
    mask = torch.tensor([[False, True, True, True, True]])
    y = x.clone()
    y[:, 0] += 3.0  # a masked key changes nothing at later positions
    assert torch.allclose(attn(x, mask)[:, 1:], attn(y, mask)[:, 1:], atol=1e-6)


def test_cross_attention_causal_only_in_training_unless_forced():
    torch.manual_seed(0)
    attn = MultiHeadCrossAttentionWithRoPE(16, 4)
    q, kv = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    kv2 = kv.clone()
    kv2[:, 5] += 1.0
    attn.train()
    assert torch.allclose(attn(q, kv, kv)[:, :5], attn(q, kv2, kv2)[:, :5], atol=1e-6)
    attn.eval()
    assert not torch.allclose(attn(q, kv, kv)[:, :5], attn(q, kv2, kv2)[:, :5], atol=1e-6)
    assert torch.allclose(attn(q, kv, kv, causal=True)[:, :5], attn(q, kv2, kv2, causal=True)[:, :5], atol=1e-6)


def test_eval_loss_with_causal_dep_does_not_see_the_future():
    _, pred = tiny_models(seed=0)
    s1, s2 = torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8))
    s2_future = s2.clone()
    s2_future[:, 6:] = (s2_future[:, 6:] + 1) % 16
    with torch.no_grad():
        leak = [pred(s1, b, use_teacher_forcing=True, s1_targets=s1)[1][:, :6] for b in (s2, s2_future)]
        causal = [pred(s1, b, use_teacher_forcing=True, s1_targets=s1, causal_dep=True)[1][:, :6]
                  for b in (s2, s2_future)]
    # the published eval-mode dependency layer lets early positions see later tokens; causal_dep=True does not
    assert not torch.allclose(leak[0], leak[1])
    assert torch.allclose(causal[0], causal[1], atol=1e-6)


def test_cached_decoding_methods_equal_the_full_window():
    """Kronos' cached-decoding API (what generation.py uses) gives the numbers of decode_s1/decode_s2."""
    _, pred = tiny_models(seed=7)
    g = torch.Generator().manual_seed(0)
    s1, s2 = torch.randint(0, 16, (2, 9), generator=g), torch.randint(0, 16, (2, 9), generator=g)
    stamp = torch.randint(0, 7, (2, 9, 5), generator=g)
    nxt = torch.randint(0, 16, (2, 1), generator=g)
    cache = pred.new_cache(2, 12, "cpu")
    assert len(cache.k) == pred.n_layers + 1 and pred.dep_slot == pred.n_layers
    assert cache.k[0].shape == (2, 2, 12, 8) and cache.k[pred.dep_slot].shape == (2, 4, 12, 4)
    with torch.no_grad():
        full_s1, ctx = pred.decode_s1(s1, s2, stamp)
        full_s2 = pred.decode_s2(ctx, nxt)[:, -1]
        pred.decode_s1_cached(s1[:, :5], s2[:, :5], stamp[:, :5], cache, 0)  # a prefix, then the rest
        logits, h_last = pred.decode_s1_cached(s1[:, 5:], s2[:, 5:], stamp[:, 5:], cache, 5)
        s2_logits = pred.decode_s2_cached(h_last, nxt, cache, 9)
        step = pred.dep_layer.step(ctx[:, -1:], pred.embedding.emb_s1(nxt), *pred.dep_layer.memory(ctx))
        fwd = pred.dep_layer(ctx, pred.embedding.emb_s1(nxt))[:, -1:]
    torch.testing.assert_close(logits, full_s1[:, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2_logits, full_s2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, fwd, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="overflow"):
        pred.decode_s1_cached(s1[:, :4], s2[:, :4], stamp[:, :4], cache, 9)
    with pytest.raises(ValueError, match="one query"):
        pred.dep_layer.cross_attn.attend_kv(ctx, *pred.dep_layer.memory(ctx))
