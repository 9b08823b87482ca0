"""How fast the engine trains and what it says about it: training.amp (precision on a device), training.compile
(compiled step = eager losses; a failing compile falls back), the FLOPs estimate behind MFU, and a stage too short
for its OneCycle warm-up."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from finetune.utils.checkpoint import load_checkpoint
from finetune.utils.distributed import DistInfo
from finetune.utils.metrics import read_metrics
from finetune.utils.precision import Precision, resolve_precision
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import (
    PredictorStage,
    TokenizerStage,
    one_cycle_pct_start,
    predictor_loss,
    tokenizer_loss,
    train_tokenizer,
)
from tests.engine_dist_worker import tiny_datasets, tiny_predictor, tiny_tokenizer

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
# 10 windows in batches of 4: micro-batches 4, 4 and a ragged 2 per epoch (3 optimizer steps).
CFG = TrainingConfig(epochs=1, batch_size=4, lr=1e-3, max_train_samples=10, num_workers=0, log_every_steps=1,
                     progress_bar=False, seed=3)


def train_losses(result) -> list[float]:
    return [r["loss"] for r in read_metrics(result.metrics_path) if r["kind"] == "train"]


def test_amp_auto_is_float32_on_cpu_and_bf16_with_tf32_on_a_gpu_that_has_it(monkeypatch):
    cpu = resolve_precision("auto", torch.device("cpu"))
    assert cpu.autocast_dtype is None and not cpu.tf32 and cpu.peak_flops is None
    assert "no MFU on CPU" in cpu.text
    assert TrainingConfig().amp == "auto"

    gpu = torch.device("cuda", 0)
    for name, bf16, amp, want in [
        ("NVIDIA H100 80GB HBM3", True, "auto", (torch.bfloat16, True, 989e12)),
        ("NVIDIA H100 PCIe", True, "auto", (torch.bfloat16, True, 756e12)),
        ("NVIDIA H200", True, "none", (None, False, 67e12)),  # none: float32, TF32 off, the fp32 peak
        ("NVIDIA A100-SXM4-40GB", True, "bf16", (torch.bfloat16, False, 312e12)),
        ("Tesla V100-SXM2-16GB", False, "auto", (None, True, None)),  # no bf16: float32 (TF32 asked); peak unknown
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, b=bf16, **k: b)
        p = resolve_precision(amp, gpu)
        assert (p.autocast_dtype, p.tf32, p.peak_flops) == want, name
        text = p.text
        assert f"training.amp={amp}" in text
        assert ("no MFU" in text) == (want[2] is None), text


@pytest.mark.parametrize("seq", [16, 64])
def test_flops_estimate_matches_torchs_flop_counter(seq):
    """The MFU numerator (6N + attention, nanoGPT's estimate) against torch's own count of one training step's
    matmul FLOPs (attention through the math kernel, which the counter sees), for both stages."""
    tok, pred = tiny_tokenizer(), tiny_predictor()
    x, stamp = torch.randn(2, seq, tok.d_in), torch.zeros(2, seq, 5, dtype=torch.long)
    with FlopCounterMode(display=False) as counted, sdpa_kernel(SDPBackend.MATH):
        tokenizer_loss(tok, x)[0].backward()
    assert TokenizerStage(tok).flops_per_token(seq) * 2 * seq == pytest.approx(counted.get_total_flops(), rel=0.02)
    tok.eval().requires_grad_(False)
    with FlopCounterMode(display=False) as counted, sdpa_kernel(SDPBackend.MATH):
        predictor_loss(pred, tok, x, stamp)[0].backward()
    estimate = PredictorStage(pred, tok, True).flops_per_token(seq) * 2 * seq
    assert estimate == pytest.approx(counted.get_total_flops(), rel=0.02)


def test_a_failing_compile_warns_once_and_trains_exactly_like_eager(tmp_path, monkeypatch, caplog):
    train_set, val_set = tiny_datasets()
    cfg = replace(CFG, epochs=2)
    eager = train_losses(train_tokenizer(tiny_tokenizer(dropout=0.1), train_set, val_set, cfg, tmp_path / "e", CPU))

    def broken_compile(fn, **kwargs):
        def first_call(*args, **kw):
            torch.rand(100)  # the failed attempt moved the random stream; the eager step must not see that
            raise RuntimeError("backend compiler failed: simulated\nsecond line")
        return first_call

    monkeypatch.setattr(torch, "compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger="finetune.utils"):
        result = train_tokenizer(tiny_tokenizer(dropout=0.1), train_set, val_set, replace(cfg, compile=True),
                                 tmp_path / "c", CPU)
    warned = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING and "training.compile" in r.getMessage()]
    assert len(warned) == 1 and "RuntimeError: backend compiler failed: simulated" in warned[0]
    assert "second line" not in warned[0]
    assert train_losses(result) == eager  # bit-identical: dropout 0.1, same random streams
    assert result.global_step == 6


@pytest.mark.slow
def test_compiled_training_matches_eager_losses_and_saves_the_same_keys(tmp_path):
    """Real torch.compile (inductor on CPU, ~1 min to compile on 2 cores). Full micro-batches run compiled, the
    epoch's ragged one eagerly; the losses agree with eager to 1e-5 relative (fused kernels round differently,
    measured ~2e-7), the step count is the same, and the checkpoint holds the module's own keys."""
    train_set, val_set = tiny_datasets()
    runs = {}
    for compiled in (False, True):
        tok = tiny_tokenizer()
        result = train_tokenizer(tok, train_set, val_set, replace(CFG, compile=compiled), tmp_path / str(compiled),
                                 CPU)
        runs[compiled] = (train_losses(result), result.global_step,
                          sorted(load_checkpoint(result.last_checkpoint)["model"]), tok.state_dict())
    (eager, eager_steps, eager_keys, eager_sd), (comp, comp_steps, comp_keys, comp_sd) = runs[False], runs[True]
    assert comp_steps == eager_steps == 3
    assert comp == pytest.approx(eager, rel=1e-5)
    assert comp_keys == eager_keys and not any("_orig_mod" in k for k in comp_keys)
    for k in eager_sd:
        torch.testing.assert_close(comp_sd[k], eager_sd[k], rtol=1e-4, atol=1e-6)


def test_a_ten_step_stage_with_pct_start_0_1_trains_with_one_warm_up_step(tmp_path):
    """OneCycleLR divides by the warm-up's length, which pct_start 0.1 of 10 steps makes exactly 0."""
    train_set, val_set = tiny_datasets()
    cfg = replace(CFG, batch_size=1, pct_start=0.1)  # 10 windows, batch 1: 10 optimizer steps
    result = train_tokenizer(tiny_tokenizer(), train_set, val_set, cfg, tmp_path, CPU)
    lrs = [r["lr"] for r in read_metrics(result.metrics_path) if r["kind"] == "train"][:-1]  # of steps 1..9
    assert result.global_step == 10 and len(lrs) == 9
    assert lrs[0] == pytest.approx(cfg.lr, rel=0.1) and all(a > b for a, b in zip(lrs, lrs[1:]))

    # The schedule the trainer builds: step 0 at lr / div_factor (one warm-up step), step 1 near the peak; a
    # 2-step stage (pct_start 0.5 divides by 0 too) warms up in step 0 and ends at the final lr in step 1.
    for total, pct in [(10, 0.1), (20, 0.05), (2, 0.5)]:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total, cycle_momentum=False,
                                                    div_factor=10, pct_start=one_cycle_pct_start(pct, total))
        seen = []
        for _ in range(total):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        peak = cfg.lr if total > 2 else cfg.lr / 10 / 1e4
        assert seen[0] == pytest.approx(cfg.lr / 10) and seen[1] == pytest.approx(peak, rel=0.2), (total, pct)
    assert one_cycle_pct_start(0.03, 8) == 0.03  # a usable pct_start is kept as it is


def test_train_records_and_the_epoch_line_carry_tokens_per_s_and_mfu_when_the_peak_is_known(tmp_path, monkeypatch):
    import finetune.utils.training_utils as engine

    peak = 1e9  # a pretend device peak, so MFU is reported on this CPU
    monkeypatch.setattr(engine, "resolve_precision", lambda amp, device: Precision(None, False, peak, "fp32"))
    train_set, val_set = tiny_datasets()
    tok = tiny_tokenizer()
    result = train_tokenizer(tok, train_set, val_set, CFG, tmp_path, CPU)
    records = [r for r in read_metrics(result.metrics_path) if r["kind"] == "train"]
    seq = train_set[0][0].shape[0]
    flops = TokenizerStage(tok).flops_per_token(seq)
    assert len(records) == 3
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * seq)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / peak)
    epoch_line = [line for line in (tmp_path / "train.log").read_text().splitlines() if "epoch 1/1" in line]
    assert len(epoch_line) == 1 and "tokens/s  MFU " in epoch_line[0]


def test_training_deterministic_runs_the_stage_under_deterministic_kernels_and_says_so(tmp_path, monkeypatch,
                                                                                       caplog):
    """training.deterministic: true turns on torch's deterministic algorithms for the stage (a kernel without a
    deterministic version would raise, not silently differ), turns compile 'auto' off, says so in the log, and puts
    the process's setting back afterwards; the default leaves them off and says that too."""
    seen = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    train_set, val_set = tiny_datasets()
    with caplog.at_level(logging.INFO):
        for on in (True, False):
            train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(CFG, deterministic=on), tmp_path / str(on),
                            CPU)
    assert seen[:3] == [True] * 3 and seen[3:] == [False] * 3
    assert not torch.are_deterministic_algorithms_enabled()
    text = caplog.text
    assert "training.deterministic: on: torch.use_deterministic_algorithms" in text
    assert "training.deterministic: off" in text


def test_a_resume_uses_the_intra_op_threads_of_the_run_it_continues(tmp_path, monkeypatch, caplog):
    """CPU sums are split by thread, and the engine picks its threads from the machine's load: a resume on another
    count would continue with other rounding. The checkpoint records the count; the resume takes it (and says so)
    unless OMP_NUM_THREADS is set."""
    import finetune.utils.training_utils as tu

    class Killed(Exception):
        pass

    def die(step, rank):
        if step == 2:
            raise Killed

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    train_set, val_set = tiny_datasets()
    cfg = replace(CFG, save_every_steps=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setattr(tu, "maybe_die_after_step", die)
        with pytest.raises(Killed):
            train_tokenizer(tiny_tokenizer(), train_set, val_set, cfg, tmp_path, CPU)
        monkeypatch.undo()
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        with caplog.at_level(logging.INFO):
            result = train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(cfg, resume="required"), tmp_path,
                                     CPU)
        assert result.global_step == 3 and torch.get_num_threads() == 1
        assert "1 intra-op threads, as the run being resumed used" in caplog.text
    finally:
        torch.set_num_threads(before)
