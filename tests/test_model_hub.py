"""Published checkpoint format: config.json + model.safetensors, key names and shapes, clear errors."""
import json

import pytest
import torch
from safetensors.torch import load_file

from model import Kronos, KronosTokenizer
from tests.model_factory import TINY_PREDICTOR, TINY_TOKENIZER, tiny_models

PUBLISHED_SHAPES = {
    # checkpoint: (class, constructor kwargs, parameter count from the paper / model cards)
    "Kronos-small": (Kronos, dict(s1_bits=10, s2_bits=10, n_layers=8, d_model=512, n_heads=8, ff_dim=1024,
                                  ffn_dropout_p=0.2, attn_dropout_p=0.0, resid_dropout_p=0.2, token_dropout_p=0.0,
                                  learn_te=True), 24.7e6),
    "Kronos-base": (Kronos, dict(s1_bits=10, s2_bits=10, n_layers=12, d_model=832, n_heads=16, ff_dim=2048,
                                 ffn_dropout_p=0.2, attn_dropout_p=0.0, resid_dropout_p=0.2, token_dropout_p=0.0,
                                 learn_te=True), 102.3e6),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SHAPES))
def test_published_parameter_counts(name):
    cls, kwargs, expected = PUBLISHED_SHAPES[name]
    n = sum(p.numel() for p in cls(**kwargs).parameters())
    assert abs(n - expected) / expected < 0.002, n


def test_tokenizer_state_dict_keys_match_published_layout():
    tok, _ = tiny_models()
    keys = set(tok.state_dict())
    # n_enc_layers - 1 encoder blocks and n_dec_layers - 1 decoder blocks.
    assert "encoder.0.self_attn.q_proj.weight" in keys and "encoder.1.norm1.weight" not in keys
    assert "decoder.0.ffn.w3.weight" in keys and "decoder.1.ffn.w3.weight" not in keys
    for k in ["embed.weight", "quant_embed.bias", "post_quant_embed_pre.weight", "post_quant_embed.weight",
              "head.weight", "encoder.0.self_attn.rotary.inv_freq", "tokenizer.bsq.basis",
              "tokenizer.bsq.group_basis"]:
        assert k in keys, k
    assert not any("codebook" in k for k in keys)  # the group codebook is not persistent
    assert tok.state_dict()["tokenizer.bsq.basis"].tolist() == [128, 64, 32, 16, 8, 4, 2, 1]
    assert tok.state_dict()["tokenizer.bsq.group_basis"].tolist() == [8, 4, 2, 1]


@pytest.mark.parametrize("learn_te, key", [(True, "time_emb.minute_embed.weight"),
                                           (False, "time_emb.minute_embed.emb.weight")])
def test_predictor_state_dict_keys(learn_te, key):
    _, pred = tiny_models(learn_te=learn_te)
    sd = pred.state_dict()
    assert key in sd
    for k in ["embedding.emb_s1.weight", "embedding.emb_s2.weight", "embedding.fusion_proj.weight",
              "transformer.1.self_attn.out_proj.bias", "norm.weight", "dep_layer.cross_attn.q_proj.weight",
              "dep_layer.cross_attn.rotary.inv_freq", "dep_layer.norm.weight", "head.proj_s1.weight",
              "head.proj_s2.bias"]:
        assert k in sd, k
    # the dependency layer has 4 heads whatever n_heads is: its rotary table has head_dim/2 entries
    assert sd["dep_layer.cross_attn.rotary.inv_freq"].numel() == (16 // 4) // 2
    assert sd["transformer.0.self_attn.rotary.inv_freq"].numel() == (16 // 2) // 2


def test_save_load_round_trip_gives_identical_outputs(tmp_path):
    tok, pred = tiny_models(seed=3)
    tok.save_pretrained(tmp_path / "tok")
    pred.save_pretrained(tmp_path / "pred")
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "tok" / "config.json").read_text()) == TINY_TOKENIZER
    assert json.loads((tmp_path / "pred" / "config.json").read_text()) == TINY_PREDICTOR
    saved = load_file(str(tmp_path / "pred" / "model.safetensors"))
    assert set(saved) == set(pred.state_dict())

    tok2 = KronosTokenizer.from_pretrained(tmp_path / "tok").eval()
    pred2 = Kronos.from_pretrained(str(tmp_path / "pred")).eval()
    x = torch.randn(2, 12, 6)
    stamp = torch.randint(0, 7, (2, 12, 5))
    with torch.no_grad():
        ids = tok.encode(x, half=True)
        ids2 = tok2.encode(x, half=True)
        assert torch.equal(ids[0], ids2[0]) and torch.equal(ids[1], ids2[1])
        assert torch.equal(tok.decode(ids, half=True), tok2.decode(ids, half=True))
        out = pred(ids[0], ids[1], stamp, use_teacher_forcing=True, s1_targets=ids[0])
        out2 = pred2(ids[0], ids[1], stamp, use_teacher_forcing=True, s1_targets=ids[0])
    assert torch.equal(out[0], out2[0]) and torch.equal(out[1], out2[1])


def test_missing_path_is_an_error_not_a_hub_lookup(tmp_path, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("must not reach the hub")
    monkeypatch.setattr("huggingface_hub.snapshot_download", fail)
    for path in [tmp_path / "nope", "./outputs/models/best", "outputs/x/best", "/abs/missing"]:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            Kronos.from_pretrained(path)


def test_hub_id_offline_fails_with_clear_message(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def offline(*a, **k):
        raise OSError("offline")
    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="NeoQuasar/Kronos-small.*Hugging Face Hub"):
        Kronos.from_pretrained("NeoQuasar/Kronos-small")


def test_config_missing_keys_are_named(tmp_path):
    _, pred = tiny_models()
    pred.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["n_layers"], cfg["learn_te"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="n_layers, learn_te"):
        Kronos.from_pretrained(tmp_path)


def test_missing_config_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        KronosTokenizer.from_pretrained(tmp_path)


def test_wrong_shapes_fail_loudly(tmp_path):
    _, pred = tiny_models()
    pred.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["d_model"] = 32
    cfg["ff_dim"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="size mismatch"):
        Kronos.from_pretrained(tmp_path)


def test_saved_files_get_ordinary_permissions(tmp_path):
    import os
    _, pred = tiny_models()
    pred.save_pretrained(tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
