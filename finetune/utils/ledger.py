"""The ledger: every reuse decision, in one place (after DVC's dvc.lock and torchtitan's checkpointer). "Is this
artifact current for these inputs?": reuse; rebuild (the log says which input changed); refuse (damaged, or a change
only the user may accept). Asked of it: a stage folder (`open_stage`: fresh / resume / reuse / rebuild / refuse,
from the Trainer's `StageInputs`), a file such as Qlib's signals.csv (`check_record` against its `write_record`).
What it compares is fingerprinted by finetune/utils/fingerprint.py."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import finetune.utils.checkpoint as checkpoint_store
from finetune.utils.config_utils import Problems, config_to_dict, plain
from finetune.utils.distributed import DistInfo, all_gather_object
from finetune.utils.errors import StageFolderError
from finetune.utils.fingerprint import data_fingerprint, without_places
from finetune.utils.metrics import flatten_params
from finetune.utils.schema import RESUME_CLASS, TrainingConfig, stage_key
from model.config import Window
from model.errors import ConfigError, DataError
from model.fileio import read_json_or_empty, sha256_file, write_json

log = logging.getLogger(__name__)
T = TypeVar("T")

RUN_OUTPUTS = ("checkpoints", "best_model", "metrics.jsonl", "loss_curve.png", "run_info.json", "tensorboard")
"""What a run writes into its stage folder (what training.overwrite deletes); nothing else is touched."""

Status = Literal["empty", "unfinished", "finished"]


def _has_checkpoint(folder: Path) -> bool:
    ckpt = folder / "checkpoints"
    return bool(checkpoint_store.list_checkpoints(ckpt)) or (ckpt / checkpoint_store.LAST_NAME).is_file()


def stage_status(folder: str | Path) -> Status:
    """"finished" when run_info.json records a finished run, "unfinished" when the folder holds any run output
    (a checkpoint, best_model/, metrics.jsonl, run_info.json), else "empty" (also for a missing folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return "empty"
    info = read_json_or_empty(folder / "run_info.json")
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

@dataclass(frozen=True)
class StageInputs:
    """What a stage's run is made from, as the Trainer gives it: what each checkpoint records (`record`) and what
    the ledger compares with it. Fingerprints are `finetune/utils/fingerprint.py`'s (content, not place)."""

    stage: str
    out: Path  # the stage's output folder
    cfg: TrainingConfig  # the stage's resolved loop settings
    run_config: dict[str, Any]  # the pipeline's resolved config (names a setting by the key that sets it)
    model_args: dict[str, Any]  # the trained model's constructor arguments
    world_size: int
    window: Window | None = None  # how the windows are cut and normalised (not in data_info: the same rows)
    data_info: dict[str, Any] | None = None  # what defines the data
    frozen: str | None = None  # weights_fingerprint of the frozen model the loss depends on (predictor: tokenizer)
    start: str | None = None  # weights_fingerprint of the model before its first step (model.pretrained_<stage>)

    def record(self) -> dict[str, Any]:
        """The checkpoint's entries that describe these inputs."""
        return {"stage": self.stage, "model_args": self.model_args, "world_size": self.world_size,
                "training_config": config_to_dict(self.cfg), "run_config": plain(self.run_config),
                "data_info": plain(self.data_info), "data_fingerprint": data_fingerprint(plain(self.data_info)),
                "frozen_fingerprint": self.frozen, "start_fingerprint": self.start,
                "window": None if self.window is None else self.window.info()}

    def key(self, name: str) -> str:
        return stage_key(self.run_config, self.stage, name)


def setting_changes(saved: checkpoint_store.Checkpoint, inputs: StageInputs
                    ) -> tuple[Problems, list[tuple[str, Any, Any]]]:
    """What differs between the settings `saved` was made with and `inputs`': (one problem per setting a resume
    cannot change: schema.RESUME_CLASS "match", the model, the windows, the stage, the world size; (key, old, new)
    for each "may_change" setting that changed). A setting the checkpoint lacks (an older file) is not compared."""
    problems, changed, stage = Problems(), [], inputs.stage
    if saved.get("stage") != stage:
        problems.add("training.resume", f"the checkpoint is from the {saved.get('stage')} stage, not {stage}")
    old_args, new_args = saved.get("model_args", {}), inputs.model_args
    for key in sorted(set(new_args) | set(old_args)):
        problems.check(old_args.get(key) == new_args.get(key), f"model.{key}",
                       f"the checkpoint's model has {old_args.get(key)!r}, this one {new_args.get(key)!r}")
    old = saved.get("training_config", {})
    for key, kind in RESUME_CLASS.items():
        now = config_to_dict(getattr(inputs.cfg, key))
        if kind == "irrelevant" or key not in old or plain(old[key]) == plain(now):
            continue
        if kind == "match":
            problems.add(inputs.key(key), f"the checkpoint was made with {old[key]!r}, the config now says {now!r}")
        else:
            changed.append((inputs.key(key), old[key], now))
    if inputs.window is not None:
        for key, was, now in inputs.window.differences(Window.from_saved(saved.get("window"))):
            problems.add(key, f"the checkpoint's windows were made with {was!r}, the config now says {now!r}")
    if saved.get("world_size") != inputs.world_size:
        problems.add("(torchrun --nproc_per_node)",
                     f"the checkpoint was made with {saved.get('world_size')} processes, now {inputs.world_size}")
    return problems, changed


def input_changes(saved: checkpoint_store.Checkpoint, inputs: StageInputs, compare_data: bool = True) -> list[str]:
    """What changed among the inputs that are not loop settings: the data (`data_info` without its paths: a moved
    but identical folder is the same data) and the `data:` settings, the frozen model, the starting weights. Empty
    when none did, or when the checkpoint predates what it would compare."""
    changes = []
    if compare_data and saved.get("data_fingerprint") is not None \
            and data_fingerprint(saved.get("data_info")) != data_fingerprint(inputs.data_info):
        diff = describe_changes(without_places(saved.get("data_info")), without_places(inputs.data_info))
        changes.append("the training data changed: " + "; ".join(diff or ["(the data description differs)"]))
    # How the data is read (column mapping, adjustment, candle rules): the same files may give other values.
    old_data, new_data = (without_places((c or {}).get("data")) for c in (saved.get("run_config"), inputs.run_config))
    if compare_data and old_data and new_data and old_data != new_data:
        changes.append("the data settings changed: " + "; ".join(describe_changes(old_data, new_data)))
    old_frozen = saved.get("frozen_fingerprint")
    if old_frozen is not None and old_frozen != inputs.frozen:
        changes.append(f"the frozen tokenizer's weights changed (or, in lora / freeze, the base predictor's; sha256 "
                       f"{old_frozen[:12]} -> {str(inputs.frozen)[:12]})")
    old_start = saved.get("start_fingerprint")
    if old_start is not None and old_start != inputs.start:
        changes.append(f"the starting weights changed (model.pretrained_{inputs.stage} or its content; sha256 "
                       f"{old_start[:12]} -> {str(inputs.start)[:12]})")
    return changes


def describe_changes(old: dict[str, Any] | None, new: dict[str, Any] | None, limit: int = 8) -> list[str]:
    """'key: old -> new' for each differing leaf of two nested dicts (data_info), at most `limit` plus a count."""
    a, b = flatten_params(old or {}, lists=True), flatten_params(new or {}, lists=True)
    diffs = [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in sorted(set(a) | set(b))
             if a.get(k, "(absent)") != b.get(k, "(absent)")]
    return diffs[:limit] + ([f"... and {len(diffs) - limit} more"] if len(diffs) > limit else [])


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


def open_stage(inputs: StageInputs, lock: Any, dist: DistInfo, rebuild_changed: bool = False) -> RunPlan:
    """Take the stage folder `inputs.out` (rank 0 takes `lock`, deletes replaced outputs and leftovers of killed
    writes) and decide, on every rank: fresh, resume, or a finished run reused. The one rule for every path: a
    checkpoint is current while every setting, the data, the frozen and the starting weights are the ones it was
    made with. A resume continues with changed "may_change" settings (named); a run that is not current is trained
    again with one warning naming what changed when `rebuild_changed` (--skip-existing, walk-forward folds and
    periods), else refused naming it (StageFolderError / ConfigError), so a plain run never reuses it silently and
    never deletes it unasked. training.accept_changed_data keeps it although its data or weights changed."""
    cfg, out, stage = inputs.cfg, inputs.out, inputs.stage

    def decide() -> RunPlan:
        lock.acquire()
        plan = plan_run(out, cfg.resume, cfg.overwrite, stage)
        if plan.message and plan.action != "skip":  # a skip is announced once its inputs are checked
            log.info("%s", plan.message)
        remove_outputs(out, plan.remove)
        checkpoint_store.prepare_folder(out, log=log.warning)
        checkpoint_store.prepare_folder(out / "checkpoints", log=log.warning)
        return plan

    plan = on_main(decide, dist)
    found = load_for_resume(plan, dist, log.warning) if plan.action != "fresh" else None
    if found is None and plan.action == "skip":
        raise DataError(f"{out}: run_info.json says finished but no checkpoint is left")
    if found is None:
        return plan
    path, saved = found
    finished = plan.action == "skip"
    problems, changed = setting_changes(saved, inputs)
    # A finished run was not asked for data: it is compared only when this run describes its data.
    inputs_changed = input_changes(saved, inputs, compare_data=not finished or inputs.data_info is not None)
    if rebuild_changed and (problems or changed or inputs_changed):
        def rebuild() -> RunPlan:
            what = "; ".join(problems.items + [f"{k}: {a!r} -> {b!r}" for k, a, b in changed] + inputs_changed)
            log.warning("[%s] %s holds a%s run that is no longer current (%s): training it again", stage, out,
                        " finished" if finished else "n unfinished", what)
            remove_outputs(out, tuple(n for n in RUN_OUTPUTS if (out / n).exists()))
            checkpoint_store.prepare_folder(out / "checkpoints")
            return RunPlan("fresh")

        return on_main(rebuild, dist)
    if finished:  # every setting that shapes the weights must be the one the run was made with
        for key, was, now in changed:
            problems.add(key, f"the run was made with {was!r}, the config now says {now!r}")
    if problems:
        problems.title = (f"{out} holds a finished {stage} run made with other settings; nothing was trained"
                          if finished else f"Cannot resume from {path}")
        problems.add("training.overwrite", "set it to true (--overwrite) to train this stage again from the start "
                                           "with the new settings, or use a new output folder")
        problems.raise_if_any()
    if inputs_changed and not cfg.accept_changed_data:
        if finished:
            raise StageFolderError(
                f"[{stage}] {out} holds a finished run, but {'; '.join(inputs_changed)}; set training.overwrite=true "
                "(--overwrite) to retrain it on what the run now uses, or training.accept_changed_data=true to keep "
                "it as it is")
        raise ConfigError([f"training.accept_changed_data: {c}; set it to true to resume anyway (recorded in "
                           "run_info.json), or training.overwrite=true to start over" for c in inputs_changed],
                          title=f"Cannot resume from {path}")
    if finished:
        if dist.is_main:
            for text in inputs_changed:
                log.warning("[%s] training.accept_changed_data=true: keeping the finished run although %s", stage,
                            text)
            log.info("%s", plan.message)
        return dataclasses.replace(plan, path=path, saved=saved)
    return dataclasses.replace(plan, path=path, saved=saved, accepted=tuple(inputs_changed),
                               changed=tuple(f"{k}: {a!r} -> {b!r}" for k, a, b in changed))


# Records of file artifacts: `<file>.record.json` = {"sha256": of the file's bytes, "inputs": what made it}.

def write_record(path: Path, inputs: Mapping[str, Any]) -> None:
    """Record beside the complete file `path` (<name>.record.json, atomically) its sha256 and what made it
    (`inputs`: hashes of upstream artifacts, settings)."""
    record = {"sha256": sha256_file(path), "inputs": plain(dict(inputs))}
    write_json(path.with_name(path.name + ".record.json"), record)


def check_record(path: Path, inputs: Mapping[str, Any]) -> Literal["reuse", "rebuild"]:
    """Is the file `path` current for `inputs`? "reuse" when its bytes and inputs are the recorded ones; else
    "rebuild", logged with why: missing, no record, damaged (a kill mid-write, an edit), made from other inputs."""
    try:
        digest = sha256_file(path)
    except OSError:
        return "rebuild"  # not there yet
    record = read_json_or_empty(path.with_name(path.name + ".record.json"))
    changed = describe_changes(record.get("inputs"), plain(dict(inputs)))
    why = ("it has no record of what made it (an older version wrote it)" if not record else
           "its bytes are not the ones recorded (damaged or edited)" if record.get("sha256") != digest else
           "what made it changed: " + "; ".join(changed) if changed else None)
    if why is not None:
        log.warning("%s is not current (%s): building it again", path, why)
    return "rebuild" if why else "reuse"


