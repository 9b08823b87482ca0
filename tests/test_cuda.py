"""Issue 23: the paths that run on a GPU.

On any machine: a checkpoint loaded the way a GPU resume loads it (`map_location` = the training device, here 'meta':
any device that is not the CPU) restores the RNG streams exactly, and puts the weights and optimizer moments on that
device.

Marked `cuda` (skipped without a GPU; tests/conftest.py): SIGKILL and SIGTERM then resume on cuda:0 end with the
uninterrupted run's weights, EXACTLY: the runs compared are made deterministic by launching them through this file
(`python tests/test_cuda.py <script> <args>`: torch.use_deterministic_algorithms + CUBLAS_WORKSPACE_CONFIG); a worker
killed under torchrun + NCCL (one rank) restarts and ends on the same weights; bf16 training of both CSV stages ends
with finite weights (and a calibration, and a forecast, on the GPU); LoRA on cuda; the greedy forecast on cuda
agrees with the CPU's within rtol 1e-4 (fp32 on both, TF32 off: only the order of float sums differs); a stored
calibration applied on cuda.

    python tests/test_cuda.py tests/engine_dist_worker.py predictor out/  # a deterministic run of a script
"""

from __future__ import annotations

import json
import os
import random
import runpy
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.utils.checkpoint import (
    CHECKPOINT_FORMAT,
    check_format,
    load_checkpoint,
    load_latest,
    rng_state,
    save,
    set_rng_state,
)
from finetune.utils.distributed import seed_everything

ROOT = Path(__file__).resolve().parents[1]
DETERMINISTIC = [sys.executable, str(Path(__file__).resolve())]  # + a script and its arguments


def draws() -> tuple:
    """The next values of the python, numpy (uniform and the cached normal) and torch CPU streams."""
    return random.random(), np.random.rand(3).tolist(), np.random.normal(), torch.rand(3).tolist()


@pytest.mark.parametrize("loader", ["load_checkpoint", "load_latest"])
def test_a_checkpoint_loaded_for_another_device_restores_the_rng_streams_exactly(tmp_path, loader):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    seed_everything(5)
    draws()  # the streams somewhere past their seeds
    np.random.normal()  # numpy now holds a cached gaussian: part of its state
    state = {"format": CHECKPOINT_FORMAT, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "rng": [rng_state()], "loop": {"global_step": 1}}
    save(state, tmp_path, 1)
    expected = draws()

    seed_everything(99)  # a new process: other streams
    if loader == "load_checkpoint":
        loaded = load_checkpoint(tmp_path / "last.pt", map_location="meta")  # as for cuda:0
    else:
        loaded = load_latest(tmp_path, map_location="meta", validate=check_format)[1]
    assert {t.device.type for t in loaded["model"].values()} == {"meta"}
    assert {t.device.type for s in loaded["optimizer"]["state"].values() for t in s.values()} == {"meta"}
    set_rng_state(loaded["rng"][0])
    assert draws() == expected


@pytest.mark.skipif(subprocess.run("nvidia-smi -L", shell=True, capture_output=True).returncode == 0,
                    reason="a GPU machine: gpu_check.sh runs its check there")
def test_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "GPU_CHECK_OUT": str(tmp_path)})
    assert run.returncode == 0 and run.stdout.strip() == "no GPU: nothing to check", run.stderr


# ----------------------------------------------------------------------------------------------------------------
# on a GPU

def cuda_env(**extra: str) -> dict[str, str]:
    """A child on the GPU: CUDA visible (whatever the parent was given) and cuBLAS in its deterministic mode."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" or v}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **extra}


@pytest.fixture(scope="module")
def loops():
    """tests/test_safety_restart_loops.py's kill and stop loops (its worker, arguments and checks)."""
    from tests import test_safety_restart_loops

    return test_safety_restart_loops


def worker_command(loops, out: Path) -> list[str]:
    """The restart loops' run (one process, cuda:0), made deterministic."""
    return [*DETERMINISTIC, str(loops.WORKER), loops.ARGS[0], str(out), *loops.ARGS[1:]]


@pytest.fixture(scope="module")
def cuda_reference(loops, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole_cuda")
    whole = subprocess.run(worker_command(loops, out), capture_output=True, text=True, env=cuda_env(), timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    return loops.final_weights(out)


@pytest.fixture
def loops_on_cuda(loops, monkeypatch):
    monkeypatch.setattr(loops, "command", lambda out, nproc: worker_command(loops, out))
    monkeypatch.setattr(loops, "env", cuda_env)
    return loops


@pytest.mark.cuda
@pytest.mark.slow
def test_sigkill_then_resume_on_cuda_gives_the_uninterrupted_weights(tmp_path, cuda_reference, loops_on_cuda):
    runs = loops_on_cuda.interrupt_loop(tmp_path, 1, signal.SIGKILL, times=3, rng=random.Random(1))
    assert all(r.returncode != 0 for _, r in runs)
    assert "device type" not in "".join(r.stderr for _, r in runs)  # the resume crash of issue 23 is gone
    loops_on_cuda.assert_same_run(tmp_path, cuda_reference)


@pytest.mark.cuda
@pytest.mark.slow
def test_sigterm_then_resume_on_cuda_gives_the_uninterrupted_weights(tmp_path, cuda_reference, loops_on_cuda):
    runs = loops_on_cuda.interrupt_loop(tmp_path, 1, signal.SIGTERM, times=2, rng=random.Random(11))
    for _, r in runs:
        assert r.returncode == 75 and "stopped on SIGTERM at step" in r.stderr, r.stderr[-3000:]
    loops_on_cuda.assert_same_run(tmp_path, cuda_reference)


@pytest.mark.cuda
@pytest.mark.slow
def test_torchrun_nccl_one_rank_killed_and_restarted_gives_the_uninterrupted_weights(tmp_path, loops,
                                                                                     cuda_reference):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "--max-restarts=1",
           *worker_command(loops, tmp_path)[1:]]
    job = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env=cuda_env(DIST_BACKEND="nccl", KRONOS_FAULT_EXIT_AFTER_STEP="4"))
    assert job.returncode == 0, job.stderr[-3000:]
    assert "exitcode: 17" in job.stderr, "the worker was not killed"
    loops.assert_same_run(tmp_path, cuda_reference)


@pytest.mark.cuda
@pytest.mark.slow
def test_bf16_training_of_both_csv_stages_on_cuda_then_forecast(tmp_path):
    from tests.test_csv_train import SCRIPT, make_run

    config = make_run(tmp_path, n_bars=480)
    env = cuda_env()
    train = subprocess.run([sys.executable, str(SCRIPT), "--config", str(config), "--set", "training.amp=bf16"],
                           capture_output=True, text=True, timeout=300, env=env)
    assert train.returncode == 0, train.stderr[-3000:]
    from safetensors.torch import load_file

    base = tmp_path / "out" / "tiny"
    for stage in ("tokenizer", "basemodel"):
        weights = load_file(base / stage / "best_model" / "model.safetensors")
        assert weights and all(torch.isfinite(t).all() for t in weights.values()), stage
        assert all(torch.isfinite(t).all() for t in load_checkpoint(base / stage / "checkpoints" / "last.pt",
                                                                   map_location="cuda:0")["model"].values())
    info = json.loads((base / "basemodel" / "best_model" / "kronos_predictor.json").read_text())
    assert info.get("calibration"), "the calibration was not fitted on the GPU"
    forecast = subprocess.run([sys.executable, str(ROOT / "finetune_csv" / "forecast.py"), "--config", str(config)],
                              capture_output=True, text=True, timeout=300, env=env)
    assert forecast.returncode == 0, forecast.stderr[-3000:]


def _finetune_on_cuda(root: Path, *settings: str, kill_after: int | None = None) -> dict[str, torch.Tensor]:
    """`kronos finetune` (both CSV stages, 3 epochs, a checkpoint every step) on cuda:0 in `root`; with `kill_after`
    the process dies after that optimizer step (no handler runs) and `--resume` finishes it. -> best predictor."""
    from safetensors.torch import load_file

    from tests.test_csv_train import SCRIPT, make_run

    config = make_run(root, n_bars=480)
    cmd = [sys.executable, str(SCRIPT), "--config", str(config), "--set", "training.epochs=3",
           "--set", "training.save_every_steps=1", *[a for s in settings for a in ("--set", s)]]
    if kill_after is not None:
        killed = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                                env=cuda_env(KRONOS_FAULT_EXIT_AFTER_STEP=str(kill_after)))
        assert killed.returncode == 17, killed.stderr[-3000:]
        cmd = [*cmd, "--resume"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cuda_env())
    assert run.returncode == 0, run.stderr[-3000:]
    return load_file(root / "out" / "tiny" / "basemodel" / "best_model" / "model.safetensors")


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.cuda
@pytest.mark.slow
def test_resume_with_the_default_settings_is_as_close_as_two_uninterrupted_runs_and_exact_when_deterministic(
        tmp_path):
    """Default settings (amp auto = bf16, compile auto = on): GPU kernels may differ run to run, so a resumed run is
    held to the distance between two uninterrupted runs (x2: both are draws of the same spread). With
    training.deterministic: true the resumed run equals the uninterrupted one exactly."""
    whole = [_finetune_on_cuda(tmp_path / f"whole{i}") for i in range(2)]
    resumed = _finetune_on_cuda(tmp_path / "resumed", kill_after=4)
    two_runs, resume = _distance(*whole), _distance(whole[0], resumed)
    print(f"default settings: two uninterrupted runs differ by {two_runs:.3g}, resumed vs uninterrupted {resume:.3g}")
    assert resume <= 2 * two_runs + 1e-6
    exact = [_finetune_on_cuda(tmp_path / "det_whole", "training.deterministic=true"),
             _finetune_on_cuda(tmp_path / "det_resumed", "training.deterministic=true", kill_after=4)]
    assert _distance(*exact) == 0.0


@pytest.fixture
def fp32_matmuls():
    """Full fp32 matmuls (no TF32) for a comparison with the CPU; the previous setting restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.cuda
def test_greedy_forecast_on_cuda_agrees_with_the_cpu(fp32_matmuls):
    from model import KronosPredictor
    from tests.model_factory import tiny_models
    from tests.test_model_predictor import candles

    tok, pred = tiny_models(seed=1)
    df, x_ts, y_ts = candles(40)
    out = {device: KronosPredictor(pred, tok, device=device).predict(df, x_ts, y_ts[:8], 8, top_k=1,
                                                                     verbose=False).to_numpy()
           for device in ("cpu", "cuda:0")}
    # rtol 1e-4: the same fp32 computation with its float sums in another order (~1e-6 apart); a greedy token
    # flipped by that would move a price by a step of the tokenizer's grid, far more.
    np.testing.assert_allclose(out["cuda:0"], out["cpu"], rtol=1e-4)


@pytest.mark.cuda
def test_lora_trains_on_cuda_and_its_merged_model_forecasts_there(tmp_path):
    pytest.importorskip("peft")
    from finetune.utils.distributed import DistInfo
    from finetune.utils.training_utils import train_predictor
    from model import Kronos, KronosPredictor
    from tests.engine_dist_worker import tiny_datasets, tiny_predictor, tiny_tokenizer
    from tests.test_adapters import FAST

    gpu = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    train_set, val_set = tiny_datasets()
    pred = tiny_predictor()
    start = {k: v.clone() for k, v in pred.state_dict().items()}
    result = train_predictor(pred, tiny_tokenizer(), train_set, val_set, replace(FAST, select_by="loss"), tmp_path,
                             gpu)
    best = Kronos.from_pretrained(result.best_model_dir)
    weights = best.state_dict()
    assert weights.keys() == start.keys() and all(torch.isfinite(t).all() for t in weights.values())
    assert any(not torch.equal(weights[k], start[k]) for k in weights)  # the merged adapters moved it
    from tests.test_model_predictor import candles

    df, x_ts, y_ts = candles(20)
    fc = KronosPredictor(best, tiny_tokenizer().eval(), device="cuda:0").predict(df, x_ts, y_ts[:3], 3, top_k=1,
                                                                                 verbose=False)
    assert np.isfinite(fc.to_numpy()).all()


@pytest.mark.cuda
def test_a_stored_calibration_widens_the_price_bands_on_cuda(tmp_path):
    from model import KronosPredictor
    from tests.test_model_calibration import _folder
    from tests.test_model_predictor import candles

    margins = [[0.05] * 4 for _ in range(10)]
    calibration = {"method": "conformal", "space": "log_return", "levels": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8,
                                                                             0.9, 0.95], "margins": margins,
                   "windows": 100}
    p = KronosPredictor.from_pretrained(_folder(tmp_path, calibration), device="cuda:0")
    df, x_ts, y_ts = candles(30)
    runs = {}
    for calibrated in (True, False):
        torch.manual_seed(0)
        runs[calibrated] = p.predict(df, x_ts, y_ts[:4], 4, T=1.5, top_p=1.0, sample_count=20, verbose=False,
                                     quantiles=[0.1, 0.9], calibrated=calibrated)
    width = lambda fc: (fc.quantiles[0.9]["close"] - fc.quantiles[0.1]["close"]).to_numpy()  # noqa: E731
    assert (width(runs[True]) > width(runs[False])).all()
    np.testing.assert_array_equal(runs[True].samples[..., 4:], runs[False].samples[..., 4:])  # volume as drawn


@pytest.mark.cuda
def test_seeded_sampling_repeats_on_cuda_on_the_first_call_as_on_later_ones():
    """The first graph call captures (warm-up steps draw random numbers), later ones replay: one seed must still give
    one set of paths on every call, for the graph and the eager decode. The graph replays the static step's kernels
    on the same generator state, so graph and static draw the same paths (eager samples another way: multinomial)."""
    from model import KronosPredictor
    from tests.model_factory import tiny_models
    from tests.test_model_predictor import candles

    tok, pred = tiny_models(seed=1)
    df, x_ts, y_ts = candles(40)
    paths = {}
    for decode in ("graph", "static", "eager"):
        p = KronosPredictor(pred, tok, device="cuda:0", decode=decode)
        calls = []
        for _ in range(3):  # the first call of a fresh predictor captures its graph
            torch.manual_seed(0)
            calls.append(p.predict(df, x_ts, y_ts[:6], 6, T=1.0, top_p=0.9, sample_count=4, verbose=False,
                                   return_samples=True).samples)
        for later in calls[1:]:
            np.testing.assert_array_equal(later, calls[0], err_msg=decode)
        paths[decode] = calls[0]
    np.testing.assert_allclose(paths["graph"], paths["static"], rtol=1e-5)


if __name__ == "__main__":  # python tests/test_cuda.py <script.py> <args>: run the script deterministically
    torch.use_deterministic_algorithms(True, warn_only=True)
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # as `python <script.py>` would have it
    runpy.run_path(sys.argv[0], run_name="__main__")


def test_the_deferred_guard_skips_a_non_finite_step_in_the_fused_adamw_and_raises_at_the_next_read():
    """The guard of one CUDA process (`check_later`), on CPU tensors: a non-finite step is not applied (the fused
    AdamW's found_inf) and its DivergenceError comes when the verdict is read."""
    from finetune.utils.errors import DivergenceError
    from finetune.utils.safety import NonFiniteGuard

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    guard = NonFiniteGuard(amp=False)

    def step(n: int, grad: list[float]) -> None:
        w.grad = torch.tensor(grad)
        opt.found_inf = guard.check_later(n, w.grad.sum(), torch.linalg.vector_norm(w.grad))
        opt.step()

    step(1, [1.0, 1.0, 1.0])
    moved = w.detach().clone()
    assert not torch.equal(moved, torch.ones(3))
    step(2, [float("nan"), 1.0, 1.0])
    assert torch.equal(w.detach(), moved) and opt.state[w]["step"].item() == 1  # step 2 not applied
    with pytest.raises(DivergenceError, match=r"training diverged at step 2 \(loss nan, gradient norm nan\); "
                                              r"nothing of this step was applied"):
        guard.settle()
    guard.settle()  # read once


@pytest.mark.cuda
@pytest.mark.parametrize("log_every, save_every", [(1, 1), (100, 2)])
def test_a_nan_batch_on_cuda_is_never_applied_logged_or_saved(tmp_path, log_every, save_every):
    """Engine on cuda:0, one process (the guard without a host sync): step 3's batch is NaN -> DivergenceError
    naming step 3, read at step 3's log (log_every 1) or at step 4's update (log_every 100); the model and the last
    checkpoint hold step 2's weights."""
    from finetune.utils.distributed import DistInfo
    from finetune.utils.errors import DivergenceError
    from finetune.utils.training_utils import train_tokenizer
    from tests.engine_dist_worker import tiny_datasets, tiny_tokenizer
    from tests.test_safety_engine import CFG, Poisoned

    train_set, val_set = tiny_datasets()
    tok = tiny_tokenizer()
    cuda = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda:0"))
    cfg = replace(CFG, save_every_steps=save_every, log_every_steps=log_every)
    with pytest.raises(DivergenceError, match=r"training diverged at step 3 .*nothing of this step was applied"):
        train_tokenizer(tok, Poisoned(train_set, 3, "nan"), val_set, cfg, tmp_path, cuda)
    saved = load_checkpoint(tmp_path / "checkpoints/last.pt")
    assert saved["loop"]["global_step"] == 2
    assert all(torch.equal(v.cpu(), saved["model"][k].cpu()) for k, v in tok.state_dict().items())
