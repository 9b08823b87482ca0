"""The ledger: every reuse decision, in one place (after DVC's dvc.lock and torchtitan's checkpointer). "Is this
artifact current for these inputs?": reuse; rebuild (the log says which input changed); refuse (damaged, or a change
only the user may accept). Asked of it: a stage folder (`open_stage`: fresh / resume / reuse / rebuild / refuse),
which stages run (`plan_stages`, `stage_resume`), a walk-forward fold (`reuse_fold`), a file such as Qlib's
signals.csv (`check_record` against its `write_record`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import pandas as pd

import finetune.utils.checkpoint as checkpoint_store
from finetune.utils import adapters
from finetune.utils.config_utils import Problems, config_to_dict, plain
from finetune.utils.distributed import DistInfo, all_gather_object
from finetune.utils.metrics import flatten_params
from finetune.utils.safety import StageFolderError
from finetune.utils.schema import STAGES, stage_key
from model.errors import ConfigError, DataError, RefusedError
from model.fileio import read_json_object, sha256_file, write_json

log = logging.getLogger(__name__)
T = TypeVar("T")
NOT_IN_RUN = "not this run's stage"
SKIP_EXISTING = "--skip-existing"  # a plan entry starting so: the finished stage is reused while current

RUN_OUTPUTS = ("checkpoints", "best_model", "metrics.jsonl", "loss_curve.png", "run_info.json", "tensorboard")
"""What a run writes into its stage folder (what training.overwrite deletes); nothing else is touched."""

Status = Literal["empty", "unfinished", "finished"]


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when it is missing or unreadable."""
    try:
        return read_json_object(path)
    except (OSError, ValueError):
        return {}


def _has_checkpoint(folder: Path) -> bool:
    ckpt = folder / "checkpoints"
    return bool(checkpoint_store.list_checkpoints(ckpt)) or (ckpt / checkpoint_store.LAST_NAME).is_file()


def stage_status(folder: str | Path) -> Status:
    """"finished" when run_info.json records a finished run, "unfinished" when the folder holds any run output
    (a checkpoint, best_model/, metrics.jsonl, run_info.json), else "empty" (also for a missing folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "empty"
    info = _read_json(folder / "run_info.json")
    if (info.get("result") or {}).get("finished") is True and _has_checkpoint(folder):
        return "finished"
    if _has_checkpoint(folder) or any((folder / name).exists() for name in RUN_OUTPUTS):
        return "unfinished"
    return "empty"


@dataclass(frozen=True)
class RunPlan:
    """What rank 0 decided to do with the stage folder (broadcast to every rank)."""

    # fresh = train from the start; resume = continue from `checkpoint_dir`/`checkpoint`; skip = finished.
    action: Literal["fresh", "resume", "skip"]
    # An explicit checkpoint file to resume from (training.resume=<path>), else None (use the newest).
    checkpoint: str | None = None
    # The folder whose newest usable checkpoint is resumed (or read back when skipping).
    checkpoint_dir: str | None = None
    message: str = ""  # The one line to log about the decision ('' = nothing to say).
    remove: tuple[str, ...] = ()  # Old outputs to delete before training (training.overwrite).
    # Set by `open_stage`: the checkpoint read back (skip) or resumed, its content (rank 0's copy on rank 0), the
    # optimisation settings changed since, the data changes kept under training.accept_changed_data.
    path: Path | None = None
    saved: checkpoint_store.Checkpoint | None = None
    changed: tuple[str, ...] = ()
    accepted: tuple[str, ...] = ()


def plan_run(folder: str | Path, resume: str, overwrite: bool, stage: str) -> RunPlan:
    """The `RunPlan` for the stage folder `folder` given training.resume ('auto', 'never', 'required' or a path to
    a checkpoint file / run folder) and training.overwrite (pure, reads only); `StageFolderError` when the settings
    contradict the folder's content."""
    folder = Path(folder)
    status = stage_status(folder)
    key = (resume or "never").strip()
    mode = key.lower()
    present = [name for name in RUN_OUTPUTS if (folder / name).exists()]
    if overwrite:
        if status == "empty":
            return RunPlan("fresh")
        return RunPlan("fresh", remove=tuple(present),
                       message=f"[{stage}] training.overwrite=true: replacing the {status} run in {folder} "
                               f"(deleting {', '.join(present)})")
    if mode in ("never", "no", "false", "none", ""):
        if status != "empty":
            raise StageFolderError(
                f"training.resume=never but {folder} already holds a{'' if status == 'unfinished' else ' finished'} "
                f"{stage} run ({', '.join(present)}); set training.overwrite=true (--overwrite) to replace it, "
                "training.resume=auto to continue it, or use another output folder")
        return RunPlan("fresh")
    if mode in ("auto", "required"):
        if status == "finished":
            return RunPlan("skip", checkpoint_dir=str(folder / "checkpoints"),
                           message=f"[{stage}] {folder} already holds a finished run; skipping it "
                                   "(--overwrite or training.overwrite=true trains it again)")
        if _has_checkpoint(folder):
            return RunPlan("resume", checkpoint_dir=str(folder / "checkpoints"),
                           message=f"[{stage}] {folder} holds an unfinished run: resuming it "
                                   "(--overwrite starts over instead)")
        if mode == "required" and status == "empty":
            raise StageFolderError(f"training.resume=required but {folder} holds no checkpoint to resume; "
                                   "set training.resume=auto to start a new run")
        if status == "unfinished":  # killed before its first checkpoint: nothing to continue, so start the stage
            return RunPlan("fresh", remove=tuple(present),
                           message=f"[{stage}] {folder} holds outputs of a run killed before its first checkpoint "
                                   f"({', '.join(present)}); starting over")
        return RunPlan("fresh")
    path = Path(key)
    if path.is_dir():
        path = (path / "checkpoints" if (path / "checkpoints").is_dir() else path) / checkpoint_store.LAST_NAME
    if not path.is_file():
        raise StageFolderError(f"training.resume: checkpoint {key} not found "
                               "(use 'auto', 'never', 'required' or a checkpoint file / run folder)")
    if status != "empty" and path.parent.resolve() != (folder / "checkpoints").resolve():
        raise StageFolderError(f"training.resume={key} resumes another run, but {folder} already holds a {status} "
                               f"run ({', '.join(present)}); set training.overwrite=true (--overwrite) to replace "
                               "it, or use another output folder")
    return RunPlan("resume", checkpoint=str(path), message=f"[{stage}] resuming from {path}")


def remove_outputs(folder: str | Path, names: tuple[str, ...]) -> None:
    """Delete the run outputs `names` (from RUN_OUTPUTS) in `folder`; call it only while holding the run lock."""
    folder = Path(folder)
    for name in names:
        if name not in RUN_OUTPUTS:
            raise ValueError(f"{name} is not a run output")
        p = folder / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

# Settings a checkpoint cannot be resumed with if changed: they fix the data order, the step count or shapes.
RESUME_KEYS = ("epochs", "batch_size", "accumulation_steps", "seed", "max_train_samples", "finetune_mode",
               "lora_rank", "lora_alpha", "lora_targets", "trainable")
# Optimisation settings a resume may change (e.g. a lower lr after a divergence); each change is reported.
CHANGEABLE_KEYS = ("lr", "pct_start", "div_factor", "final_div_factor", "betas", "weight_decay", "clip_grad_norm",
                   "amp", "compile", "patience", "min_delta", "teacher_forcing", "max_val_samples", "select_by",
                   "lora_dropout")


def check_resume_compatible(saved: checkpoint_store.Checkpoint, t: Any, path: Path, finished: bool = False
                            ) -> list[str]:
    """Raise one ConfigError listing every setting of the Trainer `t` (its cfg, world size, stage, model_args(), its
    windows' lookback / predict / clip) that cannot differ from the checkpoint `saved` (loaded from `path`); return
    'key: old -> new' for each changeable optimisation setting that did change. With the pipeline's resolved
    `t.run_config`, a setting its `<stage>_training:` section sets is named by that key (`predictor_training.epochs`),
    else `training.<name>`.
    `finished`: `saved` is the final checkpoint of a finished run that a re-run would otherwise skip."""
    cfg, stage, model_args, run_config = t.cfg, t.stage.name, t.model_args(), t.run_config
    title = (f"{path.parent.parent} holds a finished {stage} run made with other settings; nothing was trained"
             if finished else f"Cannot resume from {path}")
    problems = Problems(title)
    if saved.get("stage") != stage:
        problems.add("training.resume", f"the checkpoint is from the {saved.get('stage')} stage, not {stage}")
    for key in sorted(set(model_args) | set(saved.get("model_args", {}))):
        if saved.get("model_args", {}).get(key) != model_args.get(key):
            problems.add(f"model.{key}", f"the checkpoint's model has {saved['model_args'].get(key)!r}, "
                                         f"this one {model_args.get(key)!r}")
    old = saved.get("training_config", {})
    for key in RESUME_KEYS:
        new_value = config_to_dict(getattr(cfg, key))
        if key in old and old[key] != new_value:
            problems.add(stage_key(run_config, stage, key),
                         f"the checkpoint was made with {old[key]!r}, the config now says {new_value!r}")
    window = t.data_window() or {}  # how the windows are cut and normalised: not in data_info (the same rows)
    for key, was in (saved.get("window") or {}).items():  # absent from checkpoints written before it was recorded
        problems.check(window.get(key, was) == was, f"data.{key}",
                       f"the checkpoint's windows were made with {was!r}, the config now says {window.get(key)!r}")
    if saved.get("world_size") != t.dist.world_size:
        problems.add("(torchrun --nproc_per_node)",
                     f"the checkpoint was made with {saved.get('world_size')} processes, now {t.dist.world_size}")
    if problems:
        problems.add("training.overwrite", "set it to true (--overwrite) to train this stage again from the start "
                                           "with the new settings, or use a new output folder")
    problems.raise_if_any()
    changed = []
    for key in CHANGEABLE_KEYS:
        new_value = plain(getattr(cfg, key))
        if key in old and plain(old[key]) != new_value:
            changed.append(f"{stage_key(run_config, stage, key)}: {old[key]!r} -> {new_value!r}")
    return changed


def data_fingerprint(data_info: dict[str, Any] | None) -> str | None:
    """sha256 of `data_info` as canonical JSON (None without data_info)."""
    if data_info is None:
        return None
    canonical = json.dumps(data_info, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def describe_changes(old: dict[str, Any] | None, new: dict[str, Any] | None, limit: int = 8) -> list[str]:
    """'key: old -> new' for each differing leaf of two nested dicts (data_info), at most `limit` plus a count."""
    a, b = flatten_params(old or {}, lists=True), flatten_params(new or {}, lists=True)
    diffs = [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in sorted(set(a) | set(b))
             if a.get(k, "(absent)") != b.get(k, "(absent)")]
    return diffs[:limit] + ([f"... and {len(diffs) - limit} more"] if len(diffs) > limit else [])


def check_data(saved: dict, data_info: dict[str, Any] | None, frozen_fp: str | None, accept: bool,
               path: Path) -> list[str]:
    """Compare the checkpoint's data fingerprint and frozen-model hash with this run's.

    Returns the changes found (empty when none, or when the checkpoint predates fingerprints); raises a
    ConfigError naming them unless `accept` (training.accept_changed_data)."""
    changes = []
    old_fp = saved.get("data_fingerprint")
    if old_fp is not None and old_fp != data_fingerprint(data_info):
        diff = describe_changes(saved.get("data_info"), data_info) or ["(the data description differs)"]
        changes.append("the training data changed: " + "; ".join(diff))
    old_frozen = saved.get("frozen_fingerprint")
    if old_frozen is not None and old_frozen != frozen_fp:
        changes.append(f"the frozen tokenizer's weights changed (or, in lora / freeze, the base predictor's; sha256 "
                       f"{old_frozen[:12]} -> {str(frozen_fp)[:12]})")
    if changes and not accept:
        raise ConfigError([f"training.accept_changed_data: {c}; set it to true to resume anyway (recorded in "
                           "run_info.json), or training.overwrite=true to start over" for c in changes],
                          title=f"Cannot resume from {path}")
    return changes


def on_main(fn: Callable[[], T], dist: DistInfo) -> T:
    """Run `fn` on rank 0 and hand its value to every rank; a ValueError/OSError it raises is raised on every rank
    (the original on rank 0, a `StageFolderError` with the same message elsewhere), so all ranks exit cleanly."""
    value, error = None, None
    if dist.is_main:
        try:
            value = fn()
        except (ValueError, OSError) as e:
            error = e
    shared = all_gather_object((value, None if error is None else str(error)))[0]
    if error is not None:
        raise error
    if shared[1] is not None:
        raise StageFolderError(shared[1])
    return shared[0]


def load_for_resume(plan: RunPlan, dist: DistInfo, log: Callable[[str], None]
                    ) -> tuple[Path, checkpoint_store.Checkpoint] | None:
    """The checkpoint `plan` resumes (or reads back, when skipping): an explicit file, else the newest usable one
    in `plan.checkpoint_dir` (a corrupt newest is reported by path and the previous one used). None: nothing.

    Rank 0 deserialises the file once while choosing it and keeps that copy; the other ranks load the chosen path."""
    found: tuple[Path, checkpoint_store.Checkpoint] | None = None

    def pick() -> str | None:
        nonlocal found
        if plan.checkpoint is not None:  # an unusable explicit file is an error, not a silent fresh start
            found = Path(plan.checkpoint), checkpoint_store.load_checkpoint(plan.checkpoint, map_location=dist.device)
        else:
            found = checkpoint_store.load_latest(plan.checkpoint_dir, map_location=dist.device,
                                                 validate=checkpoint_store.check_format, log=log)
        return None if found is None else str(found[0])

    path = on_main(pick, dist)
    if path is None:
        return None
    return found if dist.is_main else (Path(path), checkpoint_store.load_checkpoint(path, map_location=dist.device))


def open_stage(t: Any, rebuild_changed: bool = False) -> RunPlan:
    """Take the Trainer `t`'s stage folder (rank 0 locks it, deletes replaced outputs and leftovers of killed
    writes) and decide, on every rank: fresh, resume (the checkpoint checked: settings that cannot change, data,
    frozen weights), or a finished run reused only while it is current. A run whose settings, data or frozen
    tokenizer changed is trained again with one warning naming the change when `rebuild_changed` (--skip-existing,
    walk-forward folds), else refused (StageFolderError / ConfigError, exit 5)."""

    def decide() -> RunPlan:
        t.lock.acquire()
        plan = plan_run(t.out, t.cfg.resume, t.cfg.overwrite, t.stage.name)
        if plan.message and plan.action != "skip":  # a skip is announced once its inputs are checked
            log.info("%s", plan.message)
        remove_outputs(t.out, plan.remove)
        checkpoint_store.prepare_folder(t.out, log=log.warning)
        checkpoint_store.prepare_folder(t.out / "checkpoints", log=log.warning)
        return plan

    plan = on_main(decide, t.dist)
    found = load_for_resume(plan, t.dist, log.warning) if plan.action != "fresh" else None
    if found is None and plan.action == "skip":
        raise DataError(f"{t.out}: run_info.json says finished but no checkpoint is left")
    if found is None:
        return plan
    path, saved = found
    changes = finished_changes(t, saved, path, rebuild_changed) if rebuild_changed or plan.action == "skip" else []
    if not changes and plan.action == "resume":
        changed = check_resume_compatible(saved, t, path)
        accepted = check_data(saved, t.data_info, t.frozen_fp, t.cfg.accept_changed_data, path)
        return dataclasses.replace(plan, path=path, saved=saved, changed=tuple(changed), accepted=tuple(accepted))
    if not changes:
        if t.dist.is_main:
            log.info("%s", plan.message)
        return dataclasses.replace(plan, path=path, saved=saved)

    def rebuild() -> RunPlan:
        log.warning("[%s] %s holds a%s run that is no longer current (%s): training it again", t.stage.name, t.out,
                    " finished" if plan.action == "skip" else "n unfinished", "; ".join(changes))
        remove_outputs(t.out, tuple(n for n in RUN_OUTPUTS if (t.out / n).exists()))
        checkpoint_store.prepare_folder(t.out / "checkpoints")
        return RunPlan("fresh")

    return on_main(rebuild, t.dist)


def finished_changes(t: Any, saved: checkpoint_store.Checkpoint, path: Path, rebuild_changed: bool) -> list[str]:
    """What changed since the finished run in `saved` was made: its settings (every one, also the optimisation
    settings a resume may change), data and frozen weights. Without `rebuild_changed` a change refuses the run
    (reused only under training.accept_changed_data, with a warning), so the list is then empty."""
    if not rebuild_changed:  # a finished run made with other epochs / batch / model settings is not "this" run
        check_resume_compatible(saved, t, path, finished=True)
    if t.data_info is None:  # the caller describes no data this time: only the frozen model is compared
        saved = {**saved, "data_fingerprint": None}
    changes = check_data(saved, t.data_info, t.frozen_fp, True, path)
    if rebuild_changed:
        try:
            changes += check_resume_compatible(saved, t, path)
        except ConfigError as e:
            changes += [str(p) for p in e.problems[:-1]]  # the last one advises --overwrite
        return changes
    if changes and not t.cfg.accept_changed_data:
        raise StageFolderError(
            f"[{t.stage.name}] {t.out} holds a finished run, but {'; '.join(changes)}; set "
            "training.overwrite=true (--overwrite) to retrain it on what the run now uses, or "
            "training.accept_changed_data=true to keep it as it is")
    for text in changes:
        log.warning("[%s] training.accept_changed_data=true: keeping the finished run although %s", t.stage.name, text)
    return []


def plan_stages(pipe: Any, stages: Sequence[str], skip: Mapping[str, str], skip_existing: bool
                ) -> dict[str, str | None]:
    """For each of STAGES, None if it trains, else why not: not in `stages`, `skip[stage]` (the flag that skipped
    it), 0 epochs, a finetune mode that keeps the tokenizer frozen (when the predictor follows it in this run),
    --skip-existing on a finished stage (`SKIP_EXISTING`: reused by `open_stage` while current, else
    retrained)."""
    plan: dict[str, str | None] = {}
    mode = pipe.cfg.training.finetune_mode
    for stage in STAGES:
        if stage not in stages:
            plan[stage] = NOT_IN_RUN
        elif stage in skip:
            plan[stage] = skip[stage]
        elif pipe.cfg.stage_training(stage).epochs == 0:
            plan[stage] = f"{stage}_training.epochs is 0"
        elif stage == "tokenizer" and "predictor" in stages and not adapters.MODES[mode].trains_tokenizer:
            plan[stage] = f"training.finetune_mode is {mode} (the tokenizer stays frozen)"
        elif skip_existing and stage_status(pipe.stage_dir(stage)) == "finished":
            plan[stage] = f"{SKIP_EXISTING} and {pipe.stage_dir(stage)} holds a finished run"
        else:
            plan[stage] = None
    return plan


def stage_resume(pipe: Any, plan: Mapping[str, str | None]) -> dict[str, str]:
    """Each stage's training.resume. --resume (required) insists on resuming the RUN: when some stage that trains
    has a run in its folder, a stage with an empty folder starts fresh (e.g. the predictor after a kill in the
    tokenizer stage) instead of failing; with nothing anywhere to resume, it stays an error."""
    status = {stage: stage_status(pipe.stage_dir(stage)) for stage in STAGES if plan[stage] is None}
    resume = {stage: pipe.cfg.stage_training(stage).resume for stage in STAGES}
    if any(s != "empty" for s in status.values()):
        for stage, s in status.items():
            if s == "empty" and resume[stage].strip().lower() == "required":
                resume[stage] = "auto"
    return resume


# Records of file artifacts: `<file>.record.json` = {"sha256": of the file's bytes, "inputs": what made it}.

def folder_sha256(folder: Path) -> str:
    """sha256 over the relative paths and bytes of every file under `folder` (a saved model, say)."""
    digest = hashlib.sha256()
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        digest.update(str(p.relative_to(folder)).encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()


def write_record(path: Path, inputs: Mapping[str, Any]) -> None:
    """Record beside the complete file `path` (<name>.record.json, atomically) its sha256 and what made it
    (`inputs`: hashes of upstream artifacts, settings)."""
    record = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "inputs": plain(dict(inputs))}
    write_json(path.with_name(path.name + ".record.json"), record)


def check_record(path: Path, inputs: Mapping[str, Any]) -> Literal["reuse", "rebuild"]:
    """Is the file `path` current for `inputs`? "reuse" when its bytes and inputs are the recorded ones; else
    "rebuild", logged with why: missing, no record, damaged (a kill mid-write, an edit), made from other inputs."""
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "rebuild"  # not there yet
    record = _read_json(path.with_name(path.name + ".record.json"))
    changed = describe_changes(record.get("inputs"), plain(dict(inputs)))
    why = ("it has no record of what made it (an older version wrote it)" if not record else
           "its bytes are not the ones recorded (damaged or edited)" if record.get("sha256") != digest else
           "what made it changed: " + "; ".join(changed) if changed else None)
    if why is not None:
        log.warning("%s is not current (%s): building it again", path, why)
    return "rebuild" if why else "reuse"


def reuse_fold(folder: Path, fingerprint: str, report_only: bool, overwrite: bool) -> dict | None:
    """A walk-forward fold in `folder`: its fold.json record when it is current (made with `fingerprint`, and its
    windows.csv still the rows it recorded: the count and each candidate's mean score), else None: score it again
    (after deleting the folder under `overwrite`). Refused (RefusedError): a fold of other settings or data without
    `overwrite`, and under `report_only` any fold that is not current."""
    done, rows = folder / "fold.json", folder / "windows.csv"
    info = read_json_object(done) if done.is_file() else None
    why = "it holds no finished fold" if info is None else (
        "its fold was made with other settings or data" if info.get("fingerprint") != fingerprint else
        _windows_damage(rows, info))
    if why is None and (report_only or not overwrite):
        return info
    if report_only:
        raise RefusedError(f"--report-only: {folder} holds no fold finished with these settings and data ({why}); "
                           "run without --report-only (with --overwrite to redo folds of other settings)")
    if info is not None and info.get("fingerprint") != fingerprint and not overwrite:
        raise RefusedError(f"{folder} holds a finished fold made with other settings or data; pass "
                           "--overwrite to redo every fold, or choose another paths.base_dir")
    if overwrite and folder.exists():
        log.warning("--overwrite: replacing %s", folder)
        shutil.rmtree(folder)
    elif info is not None:
        log.warning("%s: %s; scoring the fold again", folder, why)
    return None


def _windows_damage(rows: Path, info: dict) -> str | None:
    """Why the fold's windows.csv is not the one its fold.json describes (None: it is): cut, edited, unreadable."""
    try:
        if info.get("windows_sha256") not in (None, sha256_file(rows)):  # by content: count and means miss a swap
            return "its windows.csv is not the file fold.json recorded (its sha256 differs: damaged or edited)"
        frame = pd.read_csv(rows)
        for candidate, scores in info.get("scores", {}).items():
            got = frame[frame["candidate"] == candidate]
            if len(got) != info["windows"]["test"] or not all(
                    np.isclose(got[s].mean(), v, rtol=1e-9, atol=0, equal_nan=True) for s, v in scores.items()):
                return f"its windows.csv does not hold the {candidate} rows fold.json recorded (damaged or edited)"
    except (OSError, ValueError, KeyError) as e:
        return f"its windows.csv is unreadable ({type(e).__name__}: {e})"
    return None

