"""The non-finite guard: every step checked, the likely cause named, non-finite weights never written."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from finetune.utils.checkpoint import assert_finite_state_dict
from finetune.utils.errors import DivergenceError, NonFiniteWeightsError
from finetune.utils.safety import NonFiniteGuard, StepStats, check_step, diagnose
from tests.conftest import cpu_env

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")


def stable(n: int, loss: float = 2.0, norm: float | None = 1.0) -> list[StepStats]:
    return [StepStats(i + 1, loss + 0.01 * (i % 3), norm) for i in range(n)]


def test_check_step_single_process():
    assert check_step(torch.tensor(1.5), torch.tensor(0.3)) == (True, False)
    assert check_step(1.5) == (True, False)
    assert check_step(torch.tensor(NAN), torch.tensor(0.3)) == (False, False)
    assert check_step(torch.tensor(1.0), torch.tensor(INF)) == (False, False)
    assert check_step(1.0, NAN, stop=True) == (False, True)
    assert check_step(torch.tensor(1.0), None, stop=True) == (True, True)


def test_diagnose_data_value_when_the_data_check_flagged_extremes():
    text = diagnose(stable(30), amp=True, step=31, loss=NAN, data_extremes="volume up to 3e+38 in a.csv")
    assert text.startswith("most likely a data value") and "volume up to 3e+38 in a.csv" in text


@pytest.mark.parametrize("amp", [False, True])
def test_diagnose_data_value_when_the_first_steps_are_non_finite(amp):
    text = diagnose(stable(1), amp=amp, step=2, loss=NAN, grad_norm=NAN)
    assert text.startswith("most likely a data value: the loss was non-finite in the forward pass at step 2")
    assert ("training.amp=none" in text) == amp


def test_diagnose_learning_rate_when_the_loss_grew():
    history = stable(10) + [StepStats(11 + i, 2.0 * 1.5 ** i, 1.0) for i in range(6)]  # 2 -> 15
    text = diagnose(history, amp=True, step=17, loss=NAN, lr_key="predictor_training.lr")
    assert text.startswith("most likely the learning rate: the loss grew from")
    assert "lower predictor_training.lr" in text and "training.clip_grad_norm" in text


def test_diagnose_learning_rate_when_the_gradient_norm_explodes_with_a_flat_loss():
    history = stable(20) + [StepStats(21, 2.0, 50.0)]
    text = diagnose(history, amp=False, step=22, loss=NAN, grad_norm=NAN)
    assert text.startswith("most likely the learning rate: the gradient norm rose to 50")


def test_diagnose_learning_rate_when_only_the_gradient_overflowed_without_amp():
    text = diagnose(stable(20), amp=False, step=21, loss=2.0, grad_norm=INF)
    assert text.startswith("most likely the learning rate") and "gradient overflowed" in text


def test_diagnose_bf16_when_a_stable_run_breaks_with_amp_on():
    for loss, norm in ((NAN, NAN), (2.0, INF)):
        text = diagnose(stable(30), amp=True, step=31, loss=loss, grad_norm=norm)
        assert text.startswith("most likely bf16") and "set training.amp=none" in text


def test_diagnose_one_bad_batch_when_a_stable_run_breaks_without_amp():
    text = diagnose(stable(30), amp=False, step=31, loss=NAN, grad_norm=None)
    assert text.startswith("most likely a data value: the loss was stable (about 2")


def test_diagnose_negative_losses_growth():
    flat = [StepStats(i, -0.5, 1.0) for i in range(1, 11)]
    assert diagnose(flat, amp=False, step=11, loss=NAN).startswith("most likely a data value")
    grown = flat + [StepStats(11, 0.8, 1.0)]
    assert diagnose(grown, amp=False, step=12, loss=NAN).startswith("most likely the learning rate")


def test_guard_records_finite_steps_and_raises_with_the_cause():
    guard = NonFiniteGuard(amp=True, window=5)
    for step in range(1, 9):
        guard.check(step, torch.tensor(2.0), torch.tensor(1.0))
    assert len(guard.history) == 5 and guard.history[-1] == StepStats(8, 2.0, 1.0)
    with pytest.raises(DivergenceError) as info:
        guard.check(9, torch.tensor(NAN), torch.tensor(1.0))
    e = info.value
    assert isinstance(e, ValueError) and e.step == 9 and e.cause == "bf16"
    assert str(e).startswith("training diverged at step 9 (loss nan, gradient norm 1); nothing of this step was "
                             "applied: most likely bf16")
    assert len(guard.history) == 5  # the bad step is not remembered

    early = NonFiniteGuard(amp=False)
    with pytest.raises(DivergenceError) as info:
        early.check(1, torch.tensor(INF))
    assert info.value.cause == "data"


def test_assert_finite_state_dict_names_the_first_bad_tensor():
    good = {"a.weight": torch.ones(3), "steps": torch.tensor([1, 2]), "b.bias": torch.zeros(2)}
    assert_finite_state_dict(good, "x.pt")
    bad = {"a.weight": torch.ones(3), "b.weight": torch.tensor([1.0, NAN, INF, NAN]), "c": torch.tensor([INF])}
    with pytest.raises(NonFiniteWeightsError) as info:
        assert_finite_state_dict(bad, "checkpoints/step-00000007.pt")
    msg = str(info.value)
    assert msg.startswith("refusing to write checkpoints/step-00000007.pt: tensor 'b.weight' holds 3 non-finite "
                          "value(s) (NaN, inf) of 4 (2 tensor(s) affected)")
    assert isinstance(info.value, DivergenceError)
    # Whole checkpoints: nested optimizer state is searched too, with a readable path.
    ckpt = {"model": good, "optimizer": {"state": {0: {"exp_avg": torch.tensor([math.inf])}}}, "step": 7}
    with pytest.raises(NonFiniteWeightsError, match=r"'optimizer\.state\.0\.exp_avg' holds 1 non-finite value\(s\) "
                                                    r"\(inf\)"):
        assert_finite_state_dict(ckpt, "last.pt")
    assert_finite_state_dict({"bf16": torch.ones(2, dtype=torch.bfloat16), "list": [torch.ones(1)]}, "m")


CHECK = textwrap.dedent("""
    import sys, torch, torch.distributed as tdist
    from finetune.utils.safety import NonFiniteGuard
    from finetune.utils.errors import DivergenceError
    rank = int(sys.argv[2])
    tdist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=2)
    guard = NonFiniteGuard(amp=False)
    for step in range(1, 6):
        loss = torch.tensor(float("nan") if (rank == 1 and step == 4) else 2.0)
        try:
            guard.check(step, loss, torch.tensor(1.0))
        except DivergenceError as e:
            print(step, e.cause, "another rank" in str(e))
            break
    tdist.destroy_process_group()
""")


@pytest.mark.slow
def test_all_ranks_stop_at_the_same_step_when_one_rank_diverges(tmp_path):
    env = cpu_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", CHECK, str(tmp_path / "rdv"), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip() for o, _ in outs] == ["4 data True", "4 data False"]
