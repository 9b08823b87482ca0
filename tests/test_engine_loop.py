"""The training loops end to end on tiny models (CPU, one process): files, losses, checkpoints, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from finetune.utils.checkpoint import load_checkpoint
from finetune.utils.distributed import DistInfo
from finetune.utils.metrics import read_metrics
from finetune.utils.safety import FAULT_ENV
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import (
    evaluate_predictor,
    predictor_loss,
    tokenizer_loss,
    train_predictor,
    train_tokenizer,
)
from model import Kronos, KronosPredictor, KronosTokenizer
from tests.conftest import cpu_env
from tests.engine_dist_worker import tiny_datasets, tiny_predictor, tiny_tokenizer

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
WORKER = Path(__file__).with_name("engine_dist_worker.py")
FAST = TrainingConfig(epochs=2, batch_size=4, lr=1e-3, max_train_samples=8, num_workers=0, log_every_steps=1,
                      progress_bar=False)


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_tokenizer_run_writes_the_expected_files_and_resume_of_a_finished_run_is_a_no_op(tmp_path):
    train_set, val_set = tiny_datasets()
    tok = tiny_tokenizer()
    data_info = {"files": [{"path": "x.csv", "sha256": "ab"}], "splits": {"train": {"rows": 80}}}
    result = train_tokenizer(tok, train_set, val_set, FAST, tmp_path, CPU, run_config={"exp": "t"}, data_info=data_info)

    assert files_under(tmp_path) == {
        "best_model/config.json", "best_model/model.safetensors", "best_model/run_info.json", "best_model/SHA256SUMS",
        "checkpoints/last.pt", "checkpoints/step-00000002.pt", "checkpoints/step-00000004.pt", "metrics.jsonl",
        "loss_curve.png", "run_info.json", "train.log",
    }  # the two newest step checkpoints (training.keep_checkpoints=2); last.pt is the newest's hard link
    assert os.path.samefile(tmp_path / "checkpoints/last.pt", tmp_path / "checkpoints/step-00000004.pt")
    # 8 windows / batch 4 = 2 steps per epoch; history: epoch 0 (the starting model), 1, 2
    assert result.global_step == 4 and [h["epoch"] for h in result.history] == [0, 1, 2]
    assert result.history[0]["step"] == 0 and result.history[0]["train_loss"] is None
    assert result.best_val_loss == min(h["val_loss"] for h in result.history)
    assert result.plot_path == tmp_path / "loss_curve.png"

    records = read_metrics(result.metrics_path)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["epoch"] for r in train] == [1, 1, 2, 2]
    for key in ("loss", "lr", "recon", "bsq", "samples_per_s", "tokens_per_s", "data_wait_s", "grad_norm"):
        assert np.isfinite(train[-1][key]), key
    assert [r["val_loss"] for r in records if r["kind"] == "val"] == [h["val_loss"] for h in result.history]

    info = json.loads(result.run_info_path.read_text())
    assert info["config"] == {"exp": "t"} and info["data"] == data_info
    assert info["versions"]["torch"] == torch.__version__ and info["versions"]["numpy"] == np.__version__
    assert info["result"]["global_step"] == 4 and info["result"]["finished"] is True

    best = KronosTokenizer.from_pretrained(result.best_model_dir)
    best_epoch_is_last = result.best_epoch == 2
    same = all(torch.equal(best.state_dict()[k], v) for k, v in tok.state_dict().items())
    assert same == best_epoch_is_last

    ckpt = load_checkpoint(result.last_checkpoint)
    assert ckpt["loop"]["finished"] and ckpt["loop"]["global_step"] == 4
    assert ckpt["model_args"] == tok.config and ckpt["optimizer"]["state"]

    # Running again with resume=auto from the same start on the finished run skips it: the result (and the final
    # weights) are read back, nothing changes.
    before = {k: v.clone() for k, v in tok.state_dict().items()}
    mtime = (tmp_path / "run_info.json").stat().st_mtime_ns
    again = train_tokenizer(start := tiny_tokenizer(), train_set, val_set, FAST, tmp_path, CPU)
    assert again.skipped and again.global_step == 4 and again.history == result.history
    assert again.resumed_from == tmp_path / "checkpoints/step-00000004.pt"
    assert all(torch.equal(before[k], v) for k, v in start.state_dict().items())
    assert (tmp_path / "run_info.json").stat().st_mtime_ns == mtime


def test_predictor_best_folder_keeps_the_tokenizer_config_and_feeds_kronos_predictor(tmp_path):
    train_set, val_set = tiny_datasets()
    tok, pred = tiny_tokenizer(), tiny_predictor()
    result = train_predictor(pred, tok, train_set, val_set, replace(FAST, epochs=1), tmp_path, CPU)
    assert json.loads((result.best_model_dir / "tokenizer_config.json").read_text()) == tok.config
    loaded = Kronos.from_pretrained(result.best_model_dir)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in pred.state_dict().items())
    assert all(not p.requires_grad for p in tok.parameters())  # the tokenizer stayed frozen

    ts = pd.date_range("2024-01-01", periods=12, freq="1h")
    values = np.random.default_rng(0).uniform(10, 11, (12, 6))
    values[:, 1], values[:, 2] = values[:, :4].max(axis=1), values[:, :4].min(axis=1)  # valid candles
    df = pd.DataFrame(values, columns=["open", "high", "low", "close", "volume", "amount"])
    future = pd.Series(pd.date_range(ts[-1] + pd.Timedelta("1h"), periods=3, freq="1h"))
    out = KronosPredictor(loaded, tok, device="cpu").predict(df, pd.Series(ts), future, pred_len=3, top_k=1,
                                                            verbose=False)
    assert out.shape == (3, 6) and np.isfinite(out.to_numpy()).all()


def test_validation_loss_is_the_mean_over_all_windows_whatever_the_batch_size():
    _, val_set = tiny_datasets(n_val_rows=16)  # 7 windows: batches of 3 leave a partial one
    tok, pred = tiny_tokenizer(), tiny_predictor()
    per_window = []
    pred.eval()
    with torch.no_grad():
        for i in range(len(val_set)):
            x, stamp = (t[None] for t in val_set[i])
            per_window.append(predictor_loss(pred, tok, x, stamp, causal_dep=True)[0].item())
    for batch_size in (3, 7):
        cfg = replace(FAST, batch_size=batch_size)
        val = evaluate_predictor(pred, tok, val_set, cfg, CPU)
        assert val["val_windows"] == 7
        assert val["val_loss"] == pytest.approx(np.mean(per_window), rel=1e-6)


def test_validation_keeps_the_dependency_layer_causal():
    train_set, _ = tiny_datasets()
    tok, pred = tiny_tokenizer(), tiny_predictor()  # no dropout: train and eval modes compute the same trunk
    x, stamp = train_set.get_batch([0, 5, 9])
    with torch.no_grad():
        train_mode = predictor_loss(pred.train(), tok, x, stamp)[0]
        causal_eval = predictor_loss(pred.eval(), tok, x, stamp, causal_dep=True)[0]
        leaky_eval = predictor_loss(pred.eval(), tok, x, stamp)[0]  # published eval mode: sees later positions
    torch.testing.assert_close(causal_eval, train_mode)
    assert not torch.allclose(leaky_eval, train_mode)


def test_tokenizer_loss_is_the_reference_formula():
    train_set, _ = tiny_datasets()
    tok = tiny_tokenizer()
    x, _ = train_set.get_batch([0, 1, 2])
    loss, parts = tokenizer_loss(tok, x)
    (z_pre, z), bsq, _, _ = tok(x)
    expected = (F.mse_loss(z_pre, x) + F.mse_loss(z, x) + bsq) / 2
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(parts["recon"], F.mse_loss(z, x))


@pytest.mark.parametrize("samples, accumulated", [(12, dict(batch_size=2, accumulation_steps=3)),
                                                  (10, dict(batch_size=3, accumulation_steps=2))])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, samples, accumulated):
    """Steps of 6 windows: 1 x 6 vs 3 x 2; and with 10 windows [6, 4] vs [3 + 3, 3 + 1] (uneven micro-batches)."""
    train_set, val_set = tiny_datasets()
    cfg = replace(FAST, epochs=1, max_train_samples=samples, resume="never")
    weights = []
    for i, shape in enumerate([dict(batch_size=6, accumulation_steps=1), accumulated]):
        pred = tiny_predictor()
        train_predictor(pred, tiny_tokenizer(), train_set, val_set, replace(cfg, **shape), tmp_path / str(i), CPU)
        weights.append(pred.state_dict())
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_killed_run_resumed_ends_with_the_same_weights_as_an_uninterrupted_run(tmp_path):
    # Dropout on and s1 sampled (not teacher-forced): resuming must restore the RNG streams too.
    # 16 windows / batch 4 = 4 steps per epoch; last.pt every 2 steps; the kill comes after step 3 (mid-epoch),
    # so the resumed run redoes step 3 from the step-2 checkpoint.
    args = ["predictor", "--dropout", "0.1", "--set", "teacher_forcing=false", "--set", "max_train_samples=16",
            "--set", "save_every_steps=2", "--set", "num_workers=1"]

    def start(out: Path, **env) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(WORKER), args[0], str(out), *args[1:]], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=cpu_env(OMP_NUM_THREADS="1", **env))

    def run(out: Path, **env) -> subprocess.CompletedProcess:
        proc = start(out, **env)
        stdout, stderr = proc.communicate(timeout=240)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    started = start(tmp_path / "whole")  # the uninterrupted run, beside the killed one (separate folders)
    killed = run(tmp_path / "resumed", **{FAULT_ENV: "3"})
    whole = subprocess.CompletedProcess(started.args, 0, *started.communicate(timeout=240))
    whole.returncode = started.returncode
    assert whole.returncode == 0, whole.stderr
    assert killed.returncode == 17, killed.stderr  # the fault hook's exit code: it really died mid-run
    assert load_checkpoint(tmp_path / "resumed/checkpoints/last.pt")["loop"]["global_step"] == 2
    resumed = run(tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr

    a = torch.load(tmp_path / "whole/final_state.pt")
    b = torch.load(tmp_path / "resumed/final_state.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra = json.loads((tmp_path / "whole/result.json").read_text())
    rb = json.loads((tmp_path / "resumed/result.json").read_text())
    assert [h["val_loss"] for h in ra["history"]] == [h["val_loss"] for h in rb["history"]]
    assert [h["train_loss"] for h in ra["history"]] == pytest.approx([h["train_loss"] for h in rb["history"]])
    # The log of the resumed run has each step once (records after the checkpoint were replaced).
    steps = [r["step"] for r in read_metrics(tmp_path / "resumed/metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 9))
