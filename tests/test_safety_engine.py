"""Run safety wired into the engine, one process on CPU: re-runs (resume / skip / overwrite / refuse),
the run lock, graceful stop on SIGTERM, the per-step non-finite guard and what a resume may change, checkpoint
rotation with fallback, the data fingerprint, disk-full errors and orphans; plus epoch-0 validation and the
val_metric hook."""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import replace

import pytest
import torch

import finetune.utils.checkpoint as checkpoint_store
from finetune.utils.checkpoint import load_checkpoint
from finetune.utils.distributed import DistInfo
from finetune.utils.errors import (
    CheckpointWriteError,
    DivergenceError,
    RunLockedError,
    StageFolderError,
    TrainingStopped,
)
from finetune.utils.ledger import stage_status
from finetune.utils.safety import STOPPED_EXIT_CODE, RunLock
from finetune.utils.schema import TrainingConfig
from finetune.utils.training_utils import TokenizerStage, Trainer, restore_optimizer, train_predictor, train_tokenizer
from finetune.utils.windows import WindowDataset
from model.config import Window
from model.errors import ConfigError
from tests.engine_dist_worker import tiny_datasets, tiny_predictor, tiny_tokenizer

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
# 16 windows / batch 4 = 4 steps per epoch, 2 epochs = 8 steps.
CFG = TrainingConfig(epochs=2, batch_size=4, lr=1e-3, max_train_samples=16, num_workers=0, log_every_steps=1,
                     progress_bar=False)
DATA = {"files": [{"path": "a.csv", "sha256": "aa"}], "splits": {"train": {"rows": 80, "end": "2024-01-01"}},
        "lookback": 8, "predict": 2, "stride": 1}


class Poisoned:
    """A WindowDataset whose `at`-th fetched batch (1-based) is NaN, or that sends this process SIGTERM then."""

    def __init__(self, inner, at: int, action: str):
        self.inner, self.at, self.action, self.calls = inner, at, action, 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, indices):  # the loader asks for whole batches (lists of indices)
        return self.get_batch(indices)

    def get_batch(self, indices):
        self.calls += 1
        x, stamp = self.inner.get_batch(indices)
        if self.calls == self.at:
            if self.action == "nan":
                x = x.clone()
                x[0, 0, 0] = float("nan")
            else:
                os.kill(os.getpid(), signal.SIGTERM)
        return x, stamp


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Weights and history of a whole tokenizer run with CFG (the reference for stopped-and-resumed runs)."""
    train_set, val_set = tiny_datasets()
    tok = tiny_tokenizer()
    result = train_tokenizer(tok, train_set, val_set, CFG, tmp_path_factory.mktemp("whole"), CPU, data_info=DATA)
    return weights(tok), result


# ---- obs. 5 + 1: SIGTERM stops after the step, saves, says how to resume; the re-run resumes to the same weights
def test_sigterm_saves_and_stops_and_the_rerun_resumes_to_the_same_weights(tmp_path, uninterrupted, caplog):
    train_set, val_set = tiny_datasets()
    tok = tiny_tokenizer()
    # Batch 3 = step 3 (mid-epoch 1): the step finishes, is saved, then the run stops.
    with pytest.raises(TrainingStopped) as stopped:
        train_tokenizer(tok, Poisoned(train_set, 3, "sigterm"), val_set, CFG, tmp_path, CPU, data_info=DATA)
    assert stopped.value.exit_code == STOPPED_EXIT_CODE == 75
    assert str(stopped.value) == (f"stopped on SIGTERM at step 3; saved {tmp_path / 'checkpoints/last.pt'}; run "
                                  "the same command again to resume from there")
    assert load_checkpoint(tmp_path / "checkpoints/last.pt")["loop"]["global_step"] == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    assert stage_status(tmp_path) == "unfinished"

    with pytest.raises(StageFolderError, match=r"training\.resume=never but .* holds a tokenizer run .*"
                                               r"training\.overwrite=true"):
        train_tokenizer(tok, train_set, val_set, replace(CFG, resume="never"), tmp_path, CPU, data_info=DATA)

    with caplog.at_level(logging.INFO, logger="finetune.utils"):
        result = train_tokenizer(tiny_tokenizer(), train_set, val_set, CFG, tmp_path, CPU, data_info=DATA)
    assert any("holds an unfinished run: resuming it" in r.getMessage() for r in caplog.records)
    whole_weights, whole = uninterrupted
    assert result.resumed_from == tmp_path / "checkpoints/step-00000003.pt" and result.global_step == 8
    assert [h["val_loss"] for h in result.history] == [h["val_loss"] for h in whole.history]
    assert stage_status(tmp_path) == "finished"
    final = load_checkpoint(tmp_path / "checkpoints/last.pt")["model"]
    assert equal(final, whole_weights)


# ---- obs. 1: finished -> skipped; overwrite replaces and says what; required with nothing to resume is an error
def test_finished_run_is_skipped_overwrite_replaces_it_and_required_needs_a_checkpoint(tmp_path, caplog):
    train_set, val_set = tiny_datasets()
    assert stage_status(tmp_path / "nothing") == "empty"
    with pytest.raises(StageFolderError, match=r"training\.resume=required but .* holds no checkpoint"):
        train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(CFG, resume="required"), tmp_path, CPU)
    assert stage_status(tmp_path) == "empty" and not (tmp_path / "checkpoints").exists()

    first = train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(CFG, epochs=1), tmp_path, CPU)
    assert stage_status(tmp_path) == "finished" and first.global_step == 4
    (tmp_path / "notes.txt").write_text("mine")
    with caplog.at_level(logging.INFO, logger="finetune.utils"):
        again = train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(CFG, overwrite=True), tmp_path, CPU)
    line = next(r.getMessage() for r in caplog.records if "overwrite" in r.getMessage())
    assert "replacing the finished run" in line and "checkpoints, best_model, metrics.jsonl" in line
    assert again.global_step == 8 and not again.skipped and again.resumed_from is None
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only the run's own outputs are replaced
    epochs = [r["epoch"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "val"]
    assert epochs == [0, 1, 2]  # no record of the replaced run left


def test_best_model_of_epoch_one_alone_is_not_a_finished_run(tmp_path):
    train_set, val_set = tiny_datasets()
    train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(CFG, epochs=1), tmp_path, CPU)
    info = json.loads((tmp_path / "run_info.json").read_text())
    info["result"].pop("finished")
    (tmp_path / "run_info.json").write_text(json.dumps(info))
    assert stage_status(tmp_path) == "unfinished"


# ---- obs. 4: one run per folder
def test_a_second_run_into_a_locked_folder_is_refused_and_writes_nothing(tmp_path):
    train_set, val_set = tiny_datasets()
    with RunLock(tmp_path):
        with pytest.raises(RunLockedError, match=rf"another run is already writing into {tmp_path}: pid {os.getpid()}"):
            train_tokenizer(tiny_tokenizer(), train_set, val_set, CFG, tmp_path, CPU)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run.lock"]
    train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(CFG, epochs=1), tmp_path, CPU)
    assert not (tmp_path / "run.lock").exists()  # released at the end


# ---- obs. 2: non-finite step -> DivergenceError before the update; resume with a lower lr continues
def test_nan_batch_stops_before_the_update_and_a_resume_may_lower_the_lr(tmp_path, caplog):
    train_set, val_set = tiny_datasets()
    tok = tiny_tokenizer()
    cfg = replace(CFG, save_every_steps=1)
    with pytest.raises(DivergenceError, match=r"training diverged at step 3 .*nothing of this step was applied: "
                                              r"most likely a data value") as err:
        train_tokenizer(tok, Poisoned(train_set, 3, "nan"), val_set, cfg, tmp_path, CPU)
    assert err.value.step == 3
    saved = load_checkpoint(tmp_path / "checkpoints/last.pt")
    assert saved["loop"]["global_step"] == 2 and equal(saved["model"], weights(tok))  # step 3 never applied
    assert all(torch.isfinite(v).all() for v in tok.state_dict().values())

    # Settings that fix the data order or shapes are refused, each by its YAML key.
    with pytest.raises(ConfigError) as refused:
        train_tokenizer(tok, train_set, val_set, replace(cfg, batch_size=2, seed=1), tmp_path, CPU)
    assert "training.batch_size: the checkpoint was made with 4" in str(refused.value)
    assert "training.seed: the checkpoint was made with 100" in str(refused.value)
    with pytest.raises(ConfigError, match=r"model\.ffn_dropout_p: the checkpoint's model has 0\.0, this one 0\.1"):
        train_tokenizer(tiny_tokenizer(dropout=0.1), train_set, val_set, cfg, tmp_path, CPU)

    lower = replace(cfg, lr=5e-4, weight_decay=0.05, clip_grad_norm=1.0)
    with caplog.at_level(logging.INFO, logger="finetune.utils"):
        result = train_tokenizer(tiny_tokenizer(), train_set, val_set, lower, tmp_path, CPU)
    changed = next(r.getMessage() for r in caplog.records if "settings changed" in r.getMessage())
    assert "training.lr: 0.001 -> 0.0005" in changed and "training.weight_decay: 0.1 -> 0.05" in changed
    assert "training.clip_grad_norm: None -> 1.0" in changed
    assert result.global_step == 8
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert "training.lr: 0.001 -> 0.0005" in info["changed_on_resume"]


def test_restore_optimizer_moves_the_new_one_cycle_schedule_to_the_checkpoint_step():
    def build(lr, wd=0.1):
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=20, pct_start=0.3,
                                                    cycle_momentum=False)
        return p, opt, sched

    p, opt, sched = build(1e-3)
    for _ in range(7):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    saved = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    # Same settings: exactly the saved lr (the exact-resume case).
    _, same_opt, same_sched = build(1e-3)
    restore_optimizer(same_opt, same_sched, saved)
    assert same_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] and same_sched.last_epoch == 7
    # Half the peak lr and another weight decay: the new schedule at step 7 (half of the old one), new decay, and
    # the AdamW moments of the checkpoint.
    _, new_opt, new_sched = build(5e-4, wd=0.01)
    restore_optimizer(new_opt, new_sched, saved)
    assert new_opt.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"] / 2, rel=1e-12)
    assert new_opt.param_groups[0]["weight_decay"] == 0.01
    torch.testing.assert_close(next(iter(new_opt.state.values()))["exp_avg"], next(iter(opt.state.values()))["exp_avg"])
    _, ref_opt, ref_sched = build(5e-4)  # the new schedule from the start: the resumed one follows it exactly
    for step in range(1, 20):
        ref_opt.step()
        ref_sched.step()
        if step > 7:
            new_opt.step()
            new_sched.step()
        if step >= 7:
            assert new_sched.get_last_lr() == ref_sched.get_last_lr(), step


# ---- obs. 7: rotation, corrupt newest falls back to the previous one
def test_rotation_keeps_k_and_a_corrupt_newest_falls_back_to_the_previous(tmp_path, uninterrupted, caplog):
    train_set, val_set = tiny_datasets()
    cfg = replace(CFG, save_every_steps=1, keep_checkpoints=3)
    with pytest.raises(TrainingStopped):
        train_tokenizer(tiny_tokenizer(), Poisoned(train_set, 6, "sigterm"), val_set, cfg, tmp_path, CPU,
                        data_info=DATA)
    ckpt = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["last.pt", "step-00000004.pt", "step-00000005.pt",
                                                      "step-00000006.pt"]
    (ckpt / "step-00000006.pt").unlink()
    (ckpt / "step-00000006.pt").write_bytes(b"PK\x03\x04 truncated")  # last.pt still holds the old inode
    (ckpt / "last.pt").unlink()
    with caplog.at_level(logging.WARNING):
        result = train_tokenizer(tiny_tokenizer(), train_set, val_set, cfg, tmp_path, CPU, data_info=DATA)
    warning = next(r.getMessage() for r in caplog.records if "unusable" in r.getMessage())
    assert str(ckpt / "step-00000006.pt") in warning and "using the previous one, step-00000005.pt" in warning
    assert "weights_only=False" not in caplog.text  # never advise an unsafe load
    assert result.resumed_from == ckpt / "step-00000005.pt"
    assert equal(load_checkpoint(ckpt / "last.pt")["model"], uninterrupted[0])
    assert len(checkpoint_store.list_checkpoints(ckpt)) == 3


# ---- obs. 3: the data and the frozen tokenizer are part of what a resume must match
def test_resume_with_changed_data_is_refused_unless_accepted(tmp_path):
    train_set, val_set = tiny_datasets()
    with pytest.raises(TrainingStopped):
        train_tokenizer(tiny_tokenizer(), Poisoned(train_set, 2, "sigterm"), val_set, CFG, tmp_path, CPU,
                        data_info=DATA)
    changed = {**DATA, "splits": {"train": {"rows": 90, "end": "2024-02-01"}}}
    with pytest.raises(ConfigError) as err:
        train_tokenizer(tiny_tokenizer(), train_set, val_set, CFG, tmp_path, CPU, data_info=changed)
    text = str(err.value)
    assert "the training data changed: splits.train.end: '2024-01-01' -> '2024-02-01'; splits.train.rows: 80 -> 90" \
        in text and "training.accept_changed_data" in text
    train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(CFG, accept_changed_data=True), tmp_path, CPU,
                    data_info=changed)
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["accepted_changed_data"][0].startswith("the training data changed: splits.train.end")


def test_predictor_resume_with_other_tokenizer_weights_is_refused(tmp_path):
    train_set, val_set = tiny_datasets()
    with pytest.raises(TrainingStopped):
        train_predictor(tiny_predictor(), tiny_tokenizer(), Poisoned(train_set, 2, "sigterm"), val_set, CFG,
                        tmp_path, CPU)
    with pytest.raises(ConfigError, match=r"the frozen tokenizer's weights changed"):
        train_predictor(tiny_predictor(), tiny_tokenizer(seed=3), train_set, val_set, CFG, tmp_path, CPU)
    result = train_predictor(tiny_predictor(), tiny_tokenizer(), train_set, val_set, CFG, tmp_path, CPU)
    assert result.global_step == 8


# ---- obs. 8: disk full names file, free space and bytes needed; orphans are removed at the start
def test_disk_full_is_named_and_orphans_of_killed_writes_are_removed(tmp_path, monkeypatch):
    train_set, val_set = tiny_datasets()
    (tmp_path / "checkpoints").mkdir(parents=True)
    orphan_file = tmp_path / "checkpoints" / ".step-00000002.pt.x1y2.tmp"
    orphan_file.write_bytes(b"half")
    orphan_dir = tmp_path / ".best_model.ab12cd34"
    orphan_dir.mkdir()
    (orphan_dir / "config.json").write_text("{}")
    Usage = type(checkpoint_store.shutil.disk_usage(tmp_path))
    monkeypatch.setattr(checkpoint_store.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointWriteError) as err:
        train_tokenizer(tiny_tokenizer(), train_set, val_set, CFG, tmp_path, CPU)
    assert not orphan_file.exists() and not orphan_dir.exists()
    text = str(err.value)
    assert f"cannot write checkpoint {tmp_path / 'checkpoints' / 'step-00000004.pt'}" in text
    assert "1000 B free on that disk, about" in text and "needed" in text
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == []  # no partial file


# ---- epoch 0 is the starting model; a forecast metric can pick the best model
def test_epoch_zero_is_validated_and_a_metric_can_keep_the_starting_model(tmp_path, caplog):
    train_set, val_set = tiny_datasets()
    tok = tiny_tokenizer()
    start = weights(tok)
    calls = []

    def worse_every_epoch(model):  # the starting model scores best
        calls.append(model.training)
        return {"score": float(len(calls)), "crps": 10.0 + len(calls)}

    with pytest.raises(ConfigError, match=r"training\.select_by: 'crps' needs a forecast metric"):
        Trainer(TokenizerStage(tok), train_set, val_set, replace(CFG, select_by="crps"), tmp_path, CPU)
    with caplog.at_level(logging.INFO, logger="finetune.utils"):
        result = Trainer(TokenizerStage(tok), train_set, val_set, replace(CFG, select_by="crps"), tmp_path, CPU,
                         val_metric=worse_every_epoch).fit()
    assert [h["epoch"] for h in result.history] == [0, 1, 2]
    assert [h["metric_crps"] for h in result.history] == [11.0, 12.0, 13.0]
    assert result.best_epoch == 0 and result.best_score == 1.0
    assert result.best_val_loss == result.history[0]["val_loss"]
    assert any(r.getMessage() == "[tokenizer] no epoch beat the starting model; best_model/ is the starting model"
               for r in caplog.records)
    from model import KronosTokenizer

    assert equal(KronosTokenizer.from_pretrained(result.best_model_dir).state_dict(), start)
    assert not equal(weights(tok), start)
    vals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["metric_score"] for r in vals if r["kind"] == "val"] == [1.0, 2.0, 3.0]


def test_finished_run_with_other_schedule_settings_is_not_skipped_silently(tmp_path):
    train_set, val_set = tiny_datasets()
    train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(CFG, epochs=1), tmp_path, CPU)
    with pytest.raises(ConfigError) as err:
        train_tokenizer(tiny_tokenizer(), train_set, val_set, CFG, tmp_path, CPU)
    assert "training.epochs: the checkpoint was made with 1, the config now says 2" in str(err.value)
    assert "training.overwrite: set it to true" in str(err.value)


def test_rerun_with_more_stage_epochs_names_the_stage_key_and_does_not_say_skipping(tmp_path, caplog):
    train_set, val_set = tiny_datasets()
    train_tokenizer(tiny_tokenizer(), train_set, val_set, replace(CFG, epochs=1), tmp_path, CPU,
                    run_config={"tokenizer_training": {"epochs": 1}})
    with caplog.at_level(logging.INFO), pytest.raises(ConfigError) as err:
        train_tokenizer(tiny_tokenizer(), train_set, val_set, CFG, tmp_path, CPU,
                        run_config={"tokenizer_training": {"epochs": 2}})
    text = str(err.value)
    assert text.startswith(f"{tmp_path} holds a finished tokenizer run made with other settings; nothing was trained")
    assert "tokenizer_training.epochs: the checkpoint was made with 1, the config now says 2" in text
    assert "  - training.epochs" not in text
    assert not any("skipping it" in r.getMessage() for r in caplog.records)


class HandlerProbe:
    """A batch dataset that reports, from inside the loader worker, what SIGINT does there."""

    def __len__(self):
        return 4

    def __getitem__(self, indices):
        return torch.tensor([int(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)])

    get_batch = __getitem__


def test_loader_workers_ignore_sigint_and_keep_their_seeding():
    from finetune.utils.windows import EpochSampler, make_loader

    # A pytest started in the background (`cmd &`) inherits SIGINT ignored: start from Python's own handler.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        loader = make_loader(HandlerProbe(), EpochSampler(4, shuffle=False, seed=0), 2, epoch=0, seed=0,
                             num_workers=1)
        assert [int(b) for b in loader] == [1, 1]  # Ctrl-C reaches the training process only (graceful stop)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the main process is untouched
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_rank0_deserialises_a_resumed_checkpoint_once(tmp_path, monkeypatch):
    train_set, val_set = tiny_datasets()
    cfg = replace(CFG, epochs=1)
    train_tokenizer(tiny_tokenizer(), train_set, val_set, cfg, tmp_path / "a", CPU)
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a[0]) or real_load(*a, **k))
    train_tokenizer(tiny_tokenizer(), train_set, val_set, cfg, tmp_path / "a", CPU)  # finished: read back
    assert len(calls) == 1
    calls.clear()
    explicit = replace(cfg, epochs=1, resume=str(tmp_path / "a" / "checkpoints" / "last.pt"))
    train_tokenizer(tiny_tokenizer(), train_set, val_set, explicit, tmp_path / "b", CPU)  # an explicit file
    assert len(calls) == 1


def test_a_divergence_names_the_stage_section_that_sets_the_lr(tmp_path):
    # tokenizer_training.lr / clip_grad_norm shadow training.*: lowering training.lr would change nothing.
    train_set, val_set = tiny_datasets()
    run_config = {"training": {"lr": 1e-3}, "tokenizer_training": {"lr": 1e-3, "clip_grad_norm": 2.0}}
    for config, lr_key, clip_key in ((run_config, "tokenizer_training.lr", "tokenizer_training.clip_grad_norm"),
                                     (None, "training.lr", "training.clip_grad_norm")):
        trainer = Trainer(TokenizerStage(tiny_tokenizer()), train_set, val_set, CFG, tmp_path, CPU,
                          run_config=config)
        for step, loss in enumerate([1.0] * 10 + [5.0] * 4, start=1):  # the loss grew 5x, then turned NaN
            trainer.guard.check(step, torch.tensor(loss), torch.tensor(1.0))
        with pytest.raises(DivergenceError, match=rf"most likely the learning rate: .*lower {lr_key} "
                                                  rf"\(or set {clip_key}\)"):
            trainer.guard.check(15, torch.tensor(float("nan")), torch.tensor(1.0))


def test_windows_cut_or_normalised_otherwise_are_refused_by_name_on_resume_and_on_a_finished_run(tmp_path):
    # A new clip keeps every row and window count (data_info is the same): only the recorded window tells. The
    # window is given to the Trainer, so a dataset wrapper (Poisoned has no `window`) keeps the guard.
    train_set, val_set = tiny_datasets()
    window = train_set.window
    clipped = WindowDataset(train_set.panel, Window(window.lookback, window.predict, 3.0))
    cfg = replace(CFG, save_every_steps=1)
    with pytest.raises(DivergenceError):  # an unfinished run, stopped at step 3
        train_tokenizer(tiny_tokenizer(), Poisoned(train_set, 3, "nan"), val_set, cfg, tmp_path / "a", CPU,
                        window=window)
    with pytest.raises(ConfigError, match=r"data\.clip: the checkpoint's windows were made with 5\.0, the config now "
                                          r"says 3\.0"):
        train_tokenizer(tiny_tokenizer(), Poisoned(clipped, 0, "nan"), val_set, cfg, tmp_path / "a", CPU,
                        window=clipped.window)
    train_tokenizer(tiny_tokenizer(), train_set, val_set, CFG, tmp_path / "b", CPU, window=window)  # finished
    with pytest.raises(ConfigError, match=r"holds a finished tokenizer run made with other settings(.|\n)*data\.clip"):
        train_tokenizer(tiny_tokenizer(), clipped, val_set, CFG, tmp_path / "b", CPU, window=clipped.window)
    assert train_tokenizer(tiny_tokenizer(), train_set, val_set, CFG, tmp_path / "b", CPU, window=window).skipped
