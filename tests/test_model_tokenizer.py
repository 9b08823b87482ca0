"""Tokenizer: ids <-> bits round trips, quantiser facts, loss terms, training forward."""
import math

import pytest
import torch

from model import KronosTokenizer
from model.tokenizer import BinarySphericalQuantizer, bits_to_ids, ids_to_bits
from tests.model_factory import TINY_TOKENIZER


def make_tokenizer(s1_bits, s2_bits, group_size=2):
    torch.manual_seed(0)
    return KronosTokenizer(**{**TINY_TOKENIZER, "s1_bits": s1_bits, "s2_bits": s2_bits,
                              "group_size": group_size}).eval()


@pytest.mark.parametrize("n_bits", [1, 4, 10])
def test_ids_bits_round_trip(n_bits):
    ids = torch.arange(2 ** n_bits)
    bits = ids_to_bits(ids, n_bits)
    assert set(bits.unique().tolist()) <= {-1.0, 1.0}
    assert torch.equal(bits_to_ids(bits), ids)


def test_ids_are_little_endian():
    # coordinate 0 is bit 0: only the first coordinate positive -> id 1; only the last -> 2^(n-1)
    assert bits_to_ids(torch.tensor([1.0, -1, -1, -1])).item() == 1
    assert bits_to_ids(torch.tensor([-1.0, -1, -1, 1])).item() == 8
    assert bits_to_ids(torch.tensor([0.0, -1, -1, -1])).item() == 1  # >= 0 counts as a set bit


@pytest.mark.parametrize("s1_bits, s2_bits", [(2, 2), (4, 4), (6, 6), (10, 10)])
def test_encode_decode_bits_round_trip(s1_bits, s2_bits):
    tok = make_tokenizer(s1_bits, s2_bits)
    x = torch.randn(3, 9, 6)
    with torch.no_grad():
        (z_pre, z), loss, quantized, _ = tok(x)
        s1, s2 = tok.encode(x, half=True)
        full = tok.encode(x, half=False)
        bits = tok.indices_to_bits((s1, s2), half=True)
    assert s1.dtype == torch.int64 and s1.shape == (3, 9)
    assert int(s1.max()) < 2 ** s1_bits and int(s2.max()) < 2 ** s2_bits and int(s1.min()) >= 0
    # ids -> bits reproduces the quantised code exactly, with both id layouts
    assert torch.equal(bits, quantized)
    assert torch.equal(tok.indices_to_bits(full, half=False), quantized)
    assert torch.equal(full, s1 + s2 * 2 ** s1_bits)
    # decoding the ids equals the training forward's full-code reconstruction
    with torch.no_grad():
        assert torch.allclose(tok.decode((s1, s2), half=True), z, atol=1e-6)
    assert z_pre.shape == z.shape == x.shape
    assert torch.isfinite(loss)


def test_quantised_code_is_scaled_sign():
    tok = make_tokenizer(4, 4)
    with torch.no_grad():
        _, _, quantized, _ = tok(torch.randn(2, 5, 6))
    assert torch.allclose(quantized.abs(), torch.full_like(quantized, 1 / math.sqrt(8)))


def test_straight_through_gradient_reaches_encoder():
    tok = make_tokenizer(4, 4).train()
    (z_pre, z), bsq_loss, _, _ = tok(torch.randn(2, 5, 6))
    (z.pow(2).mean() + z_pre.pow(2).mean() + bsq_loss).backward()
    assert tok.embed.weight.grad is not None and tok.embed.weight.grad.abs().sum() > 0


def test_bsq_loss_terms():
    d, g = 4, 2
    q = BinarySphericalQuantizer(d, beta=0.5, gamma0=1.0, gamma=1.0, zeta=1.0, group_size=g)
    # A vector already on the code: commitment is zero.
    z = torch.full((1, 1, d), 1 / math.sqrt(d))
    zq, _ = q(z)
    assert torch.allclose(zq, z)
    # At z = 0 every coordinate is a fair coin: per-sample entropy D*ln2; every group code equally likely:
    # codebook entropy (D/g) * g*ln2 = D*ln2; commitment beta * D * (1/D) = beta.
    per_sample, codebook = q.soft_entropy(torch.zeros(3, d))
    assert per_sample.item() == pytest.approx(d * math.log(2), rel=1e-5)
    assert codebook.item() == pytest.approx(d * math.log(2), rel=1e-5)
    _, loss = q(torch.zeros(3, d))
    assert loss.item() == pytest.approx(0.5 + (d * math.log(2) - d * math.log(2)), abs=1e-5)


def test_group_codebook_is_big_endian():
    q = BinarySphericalQuantizer(4, 0.05, 1.0, 1.1, 0.05, group_size=2)
    assert q.group_codebook.tolist() == [[-1, -1], [-1, 1], [1, -1], [1, 1]]
