"""Finetune modes (training.finetune_mode): lora and freeze train only what they should, write small checkpoints,
a merged best_model/ that forecasts as the base model with the adapter, and refuse a resume on another base model.
Kill/resume loops and DDP: tests/test_adapters_dist.py."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from finetune.utils import adapters
from finetune.utils.checkpoint import load_checkpoint
from finetune.utils.config_utils import load_config
from finetune.utils.distributed import DistInfo
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import train_predictor, train_tokenizer
from model import Kronos, KronosPredictor
from model.errors import ConfigError, MissingExtraError
from tests.engine_dist_worker import tiny_datasets, tiny_predictor, tiny_tokenizer

peft = pytest.importorskip("peft")

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
# A high lr so that a few steps move the adapters far enough to change greedy forecasts.
FAST = TrainingConfig(epochs=2, batch_size=4, lr=2e-2, max_train_samples=8, num_workers=0, log_every_steps=1,
                      progress_bar=False, finetune_mode="lora", lora_rank=2, lora_alpha=4.0)
ATTENTION = ("q_proj.", "k_proj.", "v_proj.", "out_proj.")


def train(tmp_path: Path, cfg: TrainingConfig, pred: Kronos | None = None):
    train_set, val_set = tiny_datasets()
    pred = pred if pred is not None else tiny_predictor()
    start = {k: v.clone() for k, v in pred.state_dict().items()}
    result = train_predictor(pred, tiny_tokenizer(), train_set, val_set, cfg, tmp_path, CPU,
                             forecast_info={"max_context": 10, "clip": 5.0})
    return pred, start, result


def forecast(predictor: Kronos | KronosPredictor) -> np.ndarray:
    """Greedy (top_k=1), uncalibrated forecast of 3 bars of a fixed frame (prices, (3, 6)); a bare Kronos forecasts
    with the tiny tokenizer."""
    ts = pd.date_range("2024-01-01", periods=12, freq="1h")
    values = np.random.default_rng(0).uniform(10, 11, (12, 6))
    values[:, 1], values[:, 2] = values[:, :4].max(axis=1), values[:, :4].min(axis=1)  # valid candles
    df = pd.DataFrame(values, columns=["open", "high", "low", "close", "volume", "amount"])
    future = pd.Series(pd.date_range(ts[-1] + pd.Timedelta("1h"), periods=3, freq="1h"))
    if isinstance(predictor, Kronos):
        predictor = KronosPredictor(predictor.eval(), tiny_tokenizer().eval(), device="cpu")
    # greedy raw bands: a calibrated best_model refuses sampling other than its margins were fitted with
    out = predictor.predict(df, pd.Series(ts), future, pred_len=3, top_k=1, verbose=False, calibrated=False)
    return out.to_numpy()


def test_lora_trains_only_the_adapters_and_best_model_is_the_merged_published_model(tmp_path):
    pred, start, result = train(tmp_path, replace(FAST, select_by="loss"))
    best = Kronos.from_pretrained(result.best_model_dir)  # the published format: strict keys and shapes
    assert result.best_epoch == 2  # an epoch beat the starting model, so best_model/ holds trained adapters
    final = pred.state_dict()  # after training the caller's predictor is plain again (the adapters merged)
    assert final.keys() == start.keys() == best.state_dict().keys()
    for name, before in start.items():
        targeted = name.endswith(".weight") and any(a in name for a in ATTENTION)
        if targeted:
            assert not torch.equal(final[name], before), name
        else:  # every weight outside the adapted layers (biases of those included) is bit-equal to the start
            assert torch.equal(final[name], before) and torch.equal(best.state_dict()[name], before), name

    # best_model/adapter is peft's format, a fraction of the model; base + adapter forecasts as the merged model.
    adapter_dir = result.best_model_dir / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter_dir))
    size = (adapter_dir / "adapter_model.safetensors").stat().st_size
    assert size < 0.25 * (result.best_model_dir / "model.safetensors").stat().st_size
    with_adapter = tiny_predictor()
    peft.PeftModel.from_pretrained(with_adapter, str(adapter_dir))  # LoRA layers injected into with_adapter, unmerged
    np.testing.assert_array_equal(forecast(best), forecast(with_adapter))
    ids = torch.randint(0, 16, (2, 10))
    logits = [m.eval()(ids, ids)[0] for m in (best, with_adapter, tiny_predictor())]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert (logits[0] - logits[2]).abs().max() > 1e-2  # the adapter does change the model
    # ... and the merged folder loads as a whole forecaster unchanged.
    assert (result.best_model_dir / "kronos_predictor.json").is_file()


def test_lora_step_checkpoints_hold_only_the_adapters_and_run_info_counts_parameters(tmp_path):
    _, start, result = train(tmp_path, FAST)
    state = load_checkpoint(result.last_checkpoint)
    assert state["model"] and all(".lora_A." in k or ".lora_B." in k for k in state["model"])
    n_adapter = sum(t.numel() for t in state["model"].values())
    # AdamW moments of the adapters only
    moments = [s["exp_avg"].numel() for s in state["optimizer"]["state"].values()]
    assert sum(moments) == n_adapter
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["finetune_mode"] == "lora" and info["trainable_parameters"] == n_adapter
    assert info["total_parameters"] == sum(p.numel() for p in tiny_predictor().parameters()) + n_adapter
    line = f"finetune_mode=lora: {n_adapter} of {info['total_parameters']} parameters train"
    assert line in (tmp_path / "train.log").read_text()


def test_freeze_trains_only_the_named_prefixes(tmp_path):
    cfg = replace(FAST, finetune_mode="freeze", trainable=["head", "transformer.0.ffn"])
    pred, start, result = train(tmp_path, cfg)
    final = pred.state_dict()
    moved = {k for k in start if not torch.equal(final[k], start[k])}
    assert moved and all(k.startswith(("head.", "transformer.0.ffn.")) for k in moved)
    assert all(p.requires_grad for p in pred.parameters())  # the flags are restored after training
    state = load_checkpoint(result.last_checkpoint)
    assert set(state["model"]) == {k for k in start if k.startswith(("head.", "transformer.0.ffn."))}
    best = Kronos.from_pretrained(result.best_model_dir)
    assert all(torch.equal(best.state_dict()[k], start[k]) for k in start if k not in moved)
    assert not (result.best_model_dir / "adapter").exists()


def test_freeze_without_trainable_trains_the_heads_and_the_last_block(tmp_path):
    pred, start, result = train(tmp_path, replace(FAST, finetune_mode="freeze", trainable=[]))
    last = f"transformer.{pred.config['n_layers'] - 1}."
    state = load_checkpoint(result.last_checkpoint)
    assert set(state["model"]) == {k for k, _ in pred.named_parameters() if k.startswith(("head.", last))}
    moved = {k for k, v in pred.state_dict().items() if not torch.equal(v, start[k])}
    assert moved and moved <= set(state["model"])


def test_lora_targets_select_groups_and_names():
    pred = tiny_predictor()
    assert adapters.lora_target_names(pred, ["attention"]) == ["q_proj", "k_proj", "v_proj", "out_proj"]
    assert adapters.lora_target_names(pred, ["heads", "w1"]) == ["proj_s1", "proj_s2", "w1"]
    with pytest.raises(ConfigError, match=r"training.lora_targets: \['qproj'\] match no linear layer"):
        adapters.lora_target_names(pred, ["qproj"])


def test_settings_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"training.trainable: \['transformer.9'\] match no parameter name.*the "
                                          r"model has 1 transformer blocks \(transformer.0 ... transformer.0\)"):
        train(tmp_path / "a", replace(FAST, finetune_mode="freeze", trainable=["transformer.9"]))
    with pytest.raises(ConfigError, match="training.finetune_mode: must be 'full', 'lora' or 'freeze'"):
        train(tmp_path / "c", replace(FAST, finetune_mode="adapters"))
    with pytest.raises(ConfigError, match="training.finetune_mode: 'lora' applies to the predictor stage only"):
        train_tokenizer(tiny_tokenizer(), *tiny_datasets(), FAST, tmp_path / "d", CPU)
    with pytest.raises(ConfigError, match="lora_rank: must be >= 1"):
        train(tmp_path / "e", replace(FAST, lora_rank=0))
    assert load_config(TrainingConfig, overrides=["finetune_mode=lora", "lora_targets=[attention, heads]"]
                       ).lora_targets == ["attention", "heads"]


def test_lora_without_peft_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'kronos-finetune\[lora\]'"):
        train(tmp_path, FAST)


def test_resume_refuses_another_base_model_or_mode(tmp_path):
    train(tmp_path, FAST)
    info = json.loads((tmp_path / "run_info.json").read_text())
    del info["result"]  # as if the run had been killed after its last checkpoint: the next run resumes it
    (tmp_path / "run_info.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError, match="the base predictor's"):
        train(tmp_path, FAST, pred=tiny_predictor(seed=7))
    with pytest.raises(ConfigError, match="training.finetune_mode: the checkpoint was made with 'lora'"):
        train(tmp_path, replace(FAST, finetune_mode="full"))
    train(tmp_path, FAST)  # the same base model resumes (and finds nothing left to train)


def test_csv_pipeline_in_lora_mode_keeps_the_tokenizer_selects_by_crps_and_forecasts(tmp_path):
    from finetune_csv import train_sequential
    from finetune_csv.config import load
    from tests.model_factory import tiny_models
    from tests.test_csv_train import make_run

    config = make_run(tmp_path, n_bars=200)
    tok, pred = tiny_models(seed=0)
    tok.save_pretrained(tmp_path / "start/tokenizer")
    pred.save_pretrained(tmp_path / "start/predictor")
    overrides = [f"model.pretrained_tokenizer={tmp_path / 'start/tokenizer'}",
                 f"model.pretrained_predictor={tmp_path / 'start/predictor'}", "training.finetune_mode=lora",
                 "training.select_by=crps", "predictor_training.epochs=2", "predictor_training.lr=0.02",
                 "forecast.sample_count=2"]
    cfg = load(config, overrides)
    results, plan, _ = train_sequential.run_finetune(cfg)
    assert "finetune_mode is lora" in plan["tokenizer"] and [r.stage for r in results] == ["predictor"]
    assert all("metric_crps" in h for h in results[0].history)
    best = results[0].best_model_dir
    assert (best / "adapter" / "adapter_config.json").is_file()
    assert np.isfinite(forecast(KronosPredictor.from_pretrained(best))).all()  # a whole forecaster, as any


def test_csv_freeze_on_the_shipped_demo_model_trains_the_default_blocks_and_a_missing_block_is_refused_first(
        tmp_path):
    from finetune_csv import train_sequential
    from finetune_csv.config import load
    from tests.test_csv_train import make_run

    demo = Path(__file__).resolve().parents[1] / "checkpoints/demo-pretrained"  # a predictor of 2 blocks
    overrides = [f"model.pretrained_tokenizer={demo / 'tokenizer'}", f"model.pretrained_predictor={demo / 'predictor'}",
                 "training.finetune_mode=freeze"]
    config = make_run(tmp_path)
    cfg = load(config, [*overrides, "training.trainable=[head, transformer.7]"])
    with pytest.raises(ConfigError, match=r"\['transformer.7'\] match no parameter name.*the model has 2 "
                                          r"transformer blocks \(transformer.0 ... transformer.1\)"):
        train_sequential.run_finetune(cfg)
    assert not cfg.base_dir.exists()  # refused before the data store or a stage folder was written
    results, plan, _ = train_sequential.run_finetune(load(config, overrides))  # no trainable: the default
    assert "finetune_mode is freeze" in plan["tokenizer"] and [r.stage for r in results] == ["predictor"]
    info = json.loads((results[0].output_dir / "run_info.json").read_text())
    heads_and_last = sum(p.numel() for n, p in Kronos.from_pretrained(demo / "predictor").named_parameters()
                         if n.startswith(("head.", "transformer.1.")))
    assert info["finetune_mode"] == "freeze" and info["trainable_parameters"] == heads_and_last
