"""Hub surface: config.json checked before allocation, snapshot_download options, one-line Hub errors,
push_to_hub through huggingface_hub's HfApi (monkeypatched: no network), no non-finite weights on disk."""
import functools
import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from model import Kronos, KronosTokenizer
from tests.model_factory import tiny_models


def _saved(tmp_path, which="pred"):
    tok, pred = tiny_models()
    model = pred if which == "pred" else tok
    model.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("key, value, message", [
    ("d_model", 2 ** 20, "d_model: must be >= 4 and <= 16384"),
    ("n_layers", "8", "n_layers: must be int, got '8'"),
    ("learn_te", 1, "learn_te: must be bool"),
    ("s1_bits", None, "s1_bits: must not be null"),
    ("n_heads", 3, "n_heads: (3) must divide d_model"),
])
def test_predictor_config_is_checked_before_allocating(tmp_path, monkeypatch, key, value, message):
    cfg = _saved(tmp_path)
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    @functools.wraps(Kronos.__init__)  # keeps the signature from_pretrained reads the argument names from
    def never(*a, **k):
        raise AssertionError("the model must not be built from an invalid config")
    monkeypatch.setattr(Kronos, "__init__", never)
    with pytest.raises(ValueError) as info:
        Kronos.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value) and message in str(info.value)


def test_tokenizer_config_is_checked(tmp_path):
    cfg = _saved(tmp_path, "tok")
    cfg["ff_dim"], cfg["beta"] = 10 ** 9, "x"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="beta: must be float"):
        KronosTokenizer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        KronosTokenizer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        KronosTokenizer.from_pretrained(tmp_path)


def test_hub_options_reach_snapshot_download(tmp_path, monkeypatch):
    _, pred = tiny_models(seed=5)
    pred.save_pretrained(tmp_path / "snap")
    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(tmp_path / "snap")
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    loaded = Kronos.from_pretrained("me/my-kronos", revision="v1", cache_dir=tmp_path / "c", token="t",
                                    local_files_only=True, force_download=True)
    assert torch.equal(loaded.head.proj_s1.weight, pred.head.proj_s1.weight)
    repo, kw = calls[0]
    assert repo == "me/my-kronos" and kw["revision"] == "v1" and kw["token"] == "t"
    assert kw["cache_dir"] == tmp_path / "c" and kw["local_files_only"] and kw["force_download"]
    assert set(kw["allow_patterns"]) == {"config.json", "model.safetensors"}


def test_failed_hub_lookup_is_one_clear_line_without_a_chain(monkeypatch):
    def fail(*a, **k):
        raise RuntimeError("Repository Not Found for url: https://huggingface.co/api/models/x/y.\nmany\nlines")
    monkeypatch.setattr("huggingface_hub.snapshot_download", fail)
    with pytest.raises(FileNotFoundError) as info:
        Kronos.from_pretrained("x/y", revision="main")
    msg = str(info.value)
    assert msg.startswith("'x/y' is not a local folder") and "at revision 'main'" in msg
    assert "Repository Not Found" in msg and "many" not in msg and "\n" not in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


class FakeApi:
    instances: ClassVar[list] = []

    def __init__(self, token=None):
        self.token, self.created, self.uploaded = token, [], {}
        FakeApi.instances.append(self)

    def create_repo(self, repo_id, **kw):
        self.created.append((repo_id, kw))

    def upload_folder(self, *, repo_id, folder_path, **kw):
        self.uploaded = {p.name: p.read_bytes() for p in Path(folder_path).iterdir()}
        self.upload_kw = dict(repo_id=repo_id, **kw)
        return "commit-info"


@pytest.mark.parametrize("which", ["tok", "pred"])
def test_push_to_hub_uploads_the_published_format(tmp_path, monkeypatch, which):
    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    tok, pred = tiny_models(seed=2)
    model = tok if which == "tok" else pred
    assert model.push_to_hub("me/kronos-ft", private=True, token="t", commit_message="hi") == "commit-info"
    api = FakeApi.instances[-1]
    assert api.token == "t" and api.created == [("me/kronos-ft", {"private": True, "exist_ok": True,
                                                                  "repo_type": "model"})]
    assert sorted(api.uploaded) == ["config.json", "model.safetensors"]
    assert json.loads(api.uploaded["config.json"]) == model.config
    assert api.upload_kw["repo_id"] == "me/kronos-ft" and api.upload_kw["commit_message"] == "hi"
    # the uploaded folder loads back to the same weights
    (tmp_path / "m").mkdir()
    for name, data in api.uploaded.items():
        (tmp_path / "m" / name).write_bytes(data)
    again = type(model).from_pretrained(tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ValueError, match="owner/name"):
        model.push_to_hub("./local")


def test_non_finite_weights_are_never_saved(tmp_path):
    _, pred = tiny_models()
    with torch.no_grad():
        pred.norm.weight[0] = float("nan")
    with pytest.raises(ValueError, match="NaN/inf, first 'norm.weight'"):
        pred.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
