"""End to end runs of finetune_csv/train_sequential.py (+ forecast.py) on tiny models and data, on CPU.

In-process runs cover the files written, the flags, and bad input leaving nothing behind; subprocess runs cover
--resume after a crash, torchrun with two processes and a two-node launch on one machine (gloo).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from finetune.synthetic import generate_ohlcv, write_csv_folder
from finetune.utils.ledger import stage_status
from finetune.utils.schema import STAGES
from finetune.utils.stages import plan_stages
from finetune_csv import train_sequential
from finetune_csv.config import load
from finetune_csv.forecast import run_forecast
from finetune_csv.pipeline import CsvPipeline
from model.errors import PathError
from tests.conftest import cpu_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "finetune_csv" / "train_sequential.py"

TINY_YAML = """
data:
  path: {data}
  lookback: 16
  predict: 4
  train_ratio: 0.7
  val_ratio: 0.15
  test_ratio: 0.15
  stride: 8
model:
  pretrained_tokenizer: null
  pretrained_predictor: null
  tokenizer_arch: {{d_model: 16, n_heads: 2, ff_dim: 32, n_enc_layers: 2, n_dec_layers: 2, s1_bits: 4, s2_bits: 4,
                   group_size: 4}}
  predictor_arch: {{n_layers: 1, d_model: 16, n_heads: 2, ff_dim: 32}}
training:
  epochs: 1
  batch_size: 16
  num_workers: 0
  log_every_steps: 2
  progress_bar: false
  dist_timeout_s: 120
tokenizer_training: {{lr: 1.0e-3}}
predictor_training: {{lr: 1.0e-3}}
paths:
  exp_name: tiny
  base_dir: {out}/{{exp_name}}
forecast: {{max_windows: 2}}
"""

STAGE_FILES = {"best_model/config.json", "best_model/model.safetensors", "best_model/run_info.json",
               "best_model/SHA256SUMS",
               "checkpoints/last.pt", "metrics.jsonl", "loss_curve.png", "run_info.json", "train.log"}
EXPECTED_FILES = ({f"tokenizer/{f}" for f in STAGE_FILES} | {f"basemodel/{f}" for f in STAGE_FILES}
                  | {"basemodel/best_model/tokenizer_config.json", "basemodel/best_model/kronos_predictor.json"}
                  | {f"basemodel/best_model/tokenizer/{f}" for f in ("config.json", "model.safetensors")}
                  | {f"data_store/{f}" for f in ("features_t.npy", "stamps.npy", "datetimes.npy", "offsets.npy",
                                                 "names.json", "manifest.json")})


def make_run(root: Path, n_bars: int = 240) -> Path:
    """Two synthetic series and a tiny config under `root`; returns the config path."""
    write_csv_folder(generate_ohlcv(n_series=2, n_bars=n_bars, freq="5min", seed=0), root / "data")
    config = root / "tiny.yaml"
    config.write_text(TINY_YAML.format(data=root / "data", out=root / "out"))
    return config


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def without_step_files(files: set[str]) -> set[str]:
    """The files minus the rotating checkpoints (step-<8 digits>.pt; the newest is also last.pt)."""
    return {f for f in files if not re.fullmatch(r"(tokenizer|basemodel)/checkpoints/step-\d{8}\.pt", f)}


def env_one_thread() -> dict:
    # Tiny models: one intra-op thread per process keeps two processes from fighting over the cores.
    return cpu_env(OMP_NUM_THREADS="1", DIST_BACKEND="gloo", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("csv_run")
    config = make_run(root)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: extra intra-op threads only fight the other tests for the cores
    try:
        assert train_sequential.main(["--config", str(config)]) == 0
    finally:
        torch.set_num_threads(threads)
    return config, root / "out" / "tiny"


# ------------------------------------------------------------------------------------------ single process


def test_single_process_run_writes_exactly_the_expected_files(trained):
    _, base = trained
    files = files_under(base)
    # Rotating checkpoints: step-<8 digits>.pt files, the newest hard-linked as last.pt.
    steps = {f for f in files if re.fullmatch(r"(tokenizer|basemodel)/checkpoints/step-\d{8}\.pt", f)}
    assert files - steps == EXPECTED_FILES
    for stage in ("tokenizer", "basemodel"):
        newest = max(f for f in steps if f.startswith(stage))
        assert (base / newest).stat().st_ino == (base / stage / "checkpoints" / "last.pt").stat().st_ino


def test_run_info_records_config_data_and_splits(trained):
    config, base = trained
    info = json.loads((base / "basemodel" / "run_info.json").read_text())
    data_files = sorted((config.parent / "data").glob("*.csv"))
    assert [f["sha256"] for f in info["data"]["files"]] == [
        hashlib.sha256(p.read_bytes()).hexdigest() for p in data_files]
    assert set(info["data"]["splits"]) == {"train", "val", "test"}
    assert info["config"]["data"]["lookback"] == 16
    assert info["config"]["paths"]["base_dir"] == str(config.parent / "out" / "tiny")
    tok_cfg = json.loads((base / "basemodel" / "best_model" / "tokenizer_config.json").read_text())
    assert tok_cfg == json.loads((base / "tokenizer" / "best_model" / "config.json").read_text())


def test_skip_existing_leaves_trained_stages_alone(trained):
    config, base = trained
    weights = base / "basemodel" / "best_model" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert train_sequential.main(["--config", str(config), "--skip-existing"]) == 0
    assert weights.stat().st_mtime_ns == before


def test_forecast_scores_the_held_out_split_and_writes_its_files(trained):
    config, base = trained
    metrics = run_forecast(load(config))
    assert metrics["windows"] == 4 and metrics["horizon"] == 4  # 2 series x forecast.max_windows=2
    model = metrics["finetuned"]["model"]["overall"]
    assert 0.0 <= model["direction_accuracy"] <= 1.0 and model["mae"] >= 0.0
    assert files_under(base / "forecast") == {"metrics.json", "forecast.csv", "forecast.json", "forecast_vs_actual.png",
                                              "report.html", "context.csv", "SHA256SUMS"}
    table = pd.read_csv(base / "forecast" / "forecast.csv")
    assert len(table) == 4 * 4 and {"pred_close", "actual_close", "series"} <= set(table.columns)


def test_plan_stages_reports_why_a_stage_is_skipped(trained):
    config, _ = trained
    cfg = load(config, ["tokenizer_training.epochs=0"])
    plan = plan_stages(CsvPipeline(cfg), STAGES, {"predictor": "--skip-basemodel"}, False)
    assert plan == {"tokenizer": "tokenizer_training.epochs is 0", "predictor": "--skip-basemodel"}
    plan = plan_stages(CsvPipeline(load(config)), STAGES, {}, skip_existing=True)
    assert plan["tokenizer"].startswith("--skip-existing") and plan["predictor"].startswith("--skip-existing")


# ------------------------------------------------------------------------------------------ bad input


def test_bad_csv_fails_before_any_output_exists(tmp_path):
    config = make_run(tmp_path)
    bad = tmp_path / "data" / "SH600001.csv"
    frame = pd.read_csv(bad, dtype=str)
    frame.loc[5, "close"] = "n/a?"
    frame.to_csv(bad, index=False)
    with pytest.raises(ValueError, match=r"SH600001.csv: column 'close' .* line\(s\) 7"):
        train_sequential.main(["--config", str(config)])
    assert not (tmp_path / "out").exists()


def test_bad_settings_are_listed_together_before_any_output(tmp_path):
    config = make_run(tmp_path)
    with pytest.raises(ValueError) as info:
        train_sequential.main(["--config", str(config), "--set", "data.lookback=0", "--set", "training.lr=-1"])
    assert "data.lookback" in str(info.value) and "training.lr" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_too_little_data_says_how_many_rows_are_needed(tmp_path):
    config = make_run(tmp_path, n_bars=24)
    with pytest.raises(ValueError, match=r"needs at least \d+ rows"):
        train_sequential.main(["--config", str(config)])
    assert not (tmp_path / "out").exists()


def test_skip_tokenizer_without_any_tokenizer_is_an_error(tmp_path):
    config = make_run(tmp_path)
    with pytest.raises(ValueError, match="no trained tokenizer"):
        train_sequential.main(["--config", str(config), "--skip-tokenizer"])
    assert not (tmp_path / "out").exists()


def test_missing_pretrained_folder_names_the_setting(tmp_path):
    config = make_run(tmp_path)
    with pytest.raises(PathError, match="model.pretrained_tokenizer"):
        train_sequential.main(["--config", str(config), "--set", f"model.pretrained_tokenizer={tmp_path / 'nope'}"])
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ processes


def run(cmd: list[str], timeout: int = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env or env_one_thread(), capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_resume_continues_after_a_crash(tmp_path):
    config = make_run(tmp_path, n_bars=480)
    crash = {**env_one_thread(), "KRONOS_FAULT_EXIT_AFTER_STEP": "3"}
    args = [sys.executable, str(SCRIPT), "--config", str(config), "--set", "training.save_every_steps=2",
            "--skip-basemodel"]
    first = run(args, env=crash)
    assert first.returncode == 17, first.stderr[-2000:]
    stage = tmp_path / "out" / "tiny" / "tokenizer"
    assert (stage / "checkpoints" / "last.pt").is_file()
    # best_model/ holds the starting model (epoch 0 is validated first); the stage is unfinished, not done
    assert json.loads((stage / "best_model" / "run_info.json").read_text())["epoch"] == 0
    assert stage_status(stage) == "unfinished"

    second = run(args + ["--resume"])
    assert second.returncode == 0, second.stderr[-2000:]
    info = json.loads((stage / "run_info.json").read_text())
    # the newest periodic checkpoint: step 2 (saved every 2 steps; the crash came after step 3)
    assert info["resumed_from"] == str(stage / "checkpoints" / "step-00000002.pt")
    steps = [r["step"] for r in map(json.loads, (stage / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == sorted(set(steps)) and steps[0] == 2  # step 2 kept from the first run, nothing logged twice
    assert (stage / "best_model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    config = make_run(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
           "--config", str(config)]
    result = run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    base = tmp_path / "out" / "tiny"
    assert without_step_files(files_under(base)) == EXPECTED_FILES
    assert json.loads((base / "basemodel" / "run_info.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_two_node_launch_on_one_machine(tmp_path):
    config = make_run(tmp_path)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=csv_two_node", str(SCRIPT),
             "--config", str(config), "--skip-basemodel"],
            cwd=REPO, env=env_one_thread(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    stage = tmp_path / "out" / "tiny" / "tokenizer"
    assert json.loads((stage / "run_info.json").read_text())["world_size"] == 2
    assert (stage / "best_model" / "model.safetensors").is_file()


def test_select_by_crps_keeps_the_epoch_with_the_lowest_validation_crps(tmp_path):
    """training.select_by: crps - every validation (epoch 0 = the starting model) records metric_crps, and
    best_model/ holds the epoch with the lowest CRPS (the first one on a tie), not the lowest loss."""
    from tests.model_factory import tiny_models

    config = make_run(tmp_path, n_bars=200)
    tok, pred = tiny_models(seed=0)
    tok.save_pretrained(tmp_path / "start/tokenizer")
    pred.save_pretrained(tmp_path / "start/predictor")
    overrides = [f"model.pretrained_tokenizer={tmp_path / 'start/tokenizer'}",
                 f"model.pretrained_predictor={tmp_path / 'start/predictor'}", "tokenizer_training.epochs=0",
                 "training.select_by=crps", "predictor_training.epochs=3", "predictor_training.lr=0.02",
                 "forecast.sample_count=3"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results, plan, _ = train_sequential.run_finetune(load(config, overrides))
    finally:
        torch.set_num_threads(threads)
    assert plan["tokenizer"] is not None and [r.stage for r in results] == ["predictor"]
    out = tmp_path / "out" / "tiny" / "basemodel"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if r.get("kind") == "val"]
    assert [r["epoch"] for r in vals] == [0, 1, 2, 3]
    crps = [r["metric_crps"] for r in vals]
    assert all(c > 0 for c in crps) and all(r["score"] == r["metric_crps"] for r in vals)
    assert len(set(crps)) > 1  # the epochs really differ, so the choice below is a real one
    best = min(range(len(crps)), key=lambda i: crps[i])
    losses = [r["val_loss"] for r in vals]
    assert best != losses.index(min(losses))  # here the loss would have kept another epoch: CRPS really decided
    info = json.loads((out / "best_model" / "run_info.json").read_text())
    assert info["epoch"] == best == results[0].best_epoch and info["select_by"] == "crps"
    assert [h["metric_crps"] for h in results[0].history] == crps


def test_best_predictor_folder_loads_as_a_whole_forecaster(trained):
    """kronos_predictor.json beside the weights: the finetuned tokenizer and the training window come with it."""
    from model import KronosPredictor

    config, base = trained
    info = json.loads((base / "basemodel/best_model/kronos_predictor.json").read_text())
    assert info["tokenizer"] == "tokenizer"  # a copy inside: best_model/ is self-contained
    forecaster = KronosPredictor.from_pretrained(base / "basemodel/best_model", device="cpu")
    cfg = yaml.safe_load(config.read_text())
    assert forecaster.max_context == cfg["data"]["lookback"] + cfg["data"]["predict"] == info["max_context"]


def test_a_moved_best_model_forecasts_identically(trained, tmp_path):
    """best_model/ carries its tokenizer; copied elsewhere (the run folder gone) it forecasts the same."""
    import shutil

    import pandas as pd

    from model import KronosPredictor

    _, base = trained
    moved = shutil.copytree(base / "basemodel/best_model", tmp_path / "elsewhere" / "my_model")
    series = pd.read_csv(next((base.parent.parent / "data").glob("*.csv")))
    frame = series[["open", "high", "low", "close", "volume"]].iloc[:64]
    stamps = pd.to_datetime(series["timestamps"])
    future = pd.Series(pd.date_range(stamps.iloc[63], periods=5, freq="5min")[1:])
    out = [KronosPredictor.from_pretrained(folder, device="cpu").predict(
        frame, stamps.iloc[:64], future, pred_len=4, top_k=1, sample_count=1, verbose=False, calibrated=False)
        for folder in (base / "basemodel/best_model", moved)]
    pd.testing.assert_frame_equal(out[0], out[1])
