"""`kronos tune` / `kronos qlib-tune`: the study engine, blind to the pipeline, which passes `objective(settings,
trial number) -> {date: score}` (lower = better) scored on inner folds before the walk-forward's judged blocks; only
the selected setting is judged there (the best of 20 no-effect settings judged on its own dates says "helps" ~40% of
the time: tests/test_tune.py). Optuna on a journal file with a heartbeat; trial 0 = the config as given; PBO by CSCV
(Bailey, Borwein, Lopez de Prado & Zhu 2017); units (a trial on a fold) named by `unit_fingerprint`."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
from filelock import FileLock

from finetune.utils.config_utils import Problems, get_dotted, plain
from finetune.utils.errors import require_extra
from finetune.utils.fingerprint import digest
from model.errors import ConfigError, RefusedError, UserError
from model.fileio import atomic_write, read_json_object, write_json

log = logging.getLogger("finetune.tune")
FORECAST_ONLY = ("forecast.temperature", "forecast.top_k", "forecast.top_p", "forecast.sample_count",
                 "forecast.calibrate")
"""Keys that change only how a trained unit forecasts: a trial that changes only these re-scores, never trains."""


@dataclass
class TuneConfig:
    """`kronos tune` / `kronos qlib-tune` (finetune/utils/tune.py): which settings pay, judged on unseen dates."""

    n_trials: int = 20
    """Complete trials of the study, trial 0 (the config as given) included."""
    space: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Settings key -> {low, high[, log, step]} or {choices: [...]}; `when: {key: value(s)}`: only under those."""
    inner_folds: int = 2
    """Inner folds (walk-forward test blocks / periods) before the first judged one, less purge and embargo."""
    mode: Literal["holdout", "nested"] = "holdout"
    """holdout: one search before the first judged block; nested: one search per judged fold on the inner folds before
    it, its selection judged on that fold alone (kronos tune only)."""
    storage: str | None = None
    """Optuna storage: null = <output folder>/tune/journal.log; postgresql://... for clusters (sqlite: one worker)."""
    seed: int = 0
    """Seed of the sampler (TPE, reseeded per trial with seed + live trials so a resumed study draws the same)."""
    heartbeat_seconds: float = 30.0
    """A running trial silent for 3x this (or whose local process is gone) is failed and re-run with its settings."""


def check_space(tc: TuneConfig, build: Callable[[dict[str, Any]], Any]) -> None:
    """Raise one ConfigError listing every problem of `tune:`: each space entry's form, and each key and value as the
    pipeline's settings schema sees it (`build({key: value})` raises ConfigError)."""
    require_extra("optuna")  # exit 6 with the install line, before any work
    p = Problems("Invalid tune: settings")
    for key in ("n_trials", "inner_folds", "heartbeat_seconds"):
        p.check(getattr(tc, key) > 0, f"tune.{key}", f"must be > 0 (got {getattr(tc, key)})")
    p.check(bool(tc.space), "tune.space", "is empty: map at least one settings key to {low, high} or {choices}")
    for key, spec in tc.space.items():
        where = f"tune.space.{key}"
        extra = set(spec) - {"low", "high", "log", "step", "choices", "when"}
        if extra or ("choices" in spec) == ("low" in spec or "high" in spec):
            p.add(where, f"needs either low + high (optional log, step) or choices, got {sorted(spec)}")
            continue
        if key.startswith(("tune.", "paths.", "walk_forward.")):
            p.add(where, "tune, paths and walk_forward settings decide the study, not a trial; tune another key")
        values = list(spec["choices"]) if "choices" in spec else [spec.get("low"), spec.get("high")]
        if "choices" not in spec and not (isinstance(values[0], (int, float)) and isinstance(values[1], (int, float))
                                          and values[0] < values[1]):
            p.add(where, f"low < high, both numbers, got {values}")
            continue
        for v in values or [None]:
            try:
                build({key: v})
            except ConfigError as err:
                for line in err.problems:
                    p.add(where, f"value {v!r}: {line}")
        for k in spec.get("when") or {}:
            p.check(k in tc.space or "." in k, f"{where}.when", f"{k!r} is not a settings key")
    p.raise_if_any()


def suggest(trial: Any, tc: TuneConfig, given: Mapping[str, Any]) -> dict[str, Any]:
    """The trial's settings {dotted key: value}, sampled in space order; a key whose `when` does not match the
    settings so far (`given`: the config as given, as a nested dict) is left at its given value."""
    params: dict[str, Any] = {}
    for key, spec in tc.space.items():
        now = lambda k: params[k] if k in params else get_dotted(given, k)
        if any(now(k) not in (v if isinstance(v, list) else [v]) for k, v in (spec.get("when") or {}).items()):
            continue
        ints = all(type(spec.get(b)) is int for b in ("low", "high"))
        params[key] = trial.suggest_categorical(key, list(spec["choices"])) if "choices" in spec else getattr(
            trial, "suggest_int" if ints else "suggest_float")(key, spec["low"], spec["high"], log=bool(
                spec.get("log")), step=spec.get("step") or (1 if ints else None))
    return params


def unit_fingerprint(settings: Mapping[str, Any], dates: Any, data: Any) -> str:
    """A unit's identity (one trial's training on one fold): the settings that change training (forecast-only keys
    removed here), the fold's dates and the data's hash."""
    kept = plain(settings)
    for key in FORECAST_ONLY:
        section, _, name = key.partition(".")
        (kept.get(section) or {}).pop(name, None)
    return digest([kept, dates, data])[:16]


# ---- selection and diagnostics on an inner score matrix (trials x dates, lower = better) -------------------------

def pbo(inner: pd.DataFrame, blocks: int = 8) -> float | None:
    """Probability of backtest overfitting by CSCV: the T dates (columns, time order) cut into S even blocks; for
    every half of them as in-sample, the in-sample best trial's rank among all on the other half; PBO = share of
    splits where it falls below the median (logit < 0; exactly at it, as with an odd N, counts half; a trial tied
    with it out of sample ranks below it, as the issue's rule asks: a dominating setting with an exact duplicate
    scores 0, not 0.5): 0.5 when no trial is really better, whatever N; None for fewer
    than 2 trials or dates, and when the blocks are not independent (`pbo_blocks` below PBO_MIN_SHARE of S):
    persistent luck carries from an in-sample block to the next, and PBO then reads 0.25-0.3 with no effect."""
    m = inner.to_numpy(dtype=np.float64)  # (N, T)
    n, t = m.shape
    s = min(blocks, t) // 2 * 2
    if n < 2 or s < 2 or pbo_blocks(inner, blocks) < PBO_MIN_SHARE * s:
        return None
    parts = np.array_split(np.arange(t), s)
    sums = np.stack([m[:, p].sum(axis=1) for p in parts], axis=1)  # (N, S) score sums per block
    sizes = np.array([len(p) for p in parts])
    below = []
    for half in combinations(range(s), s // 2):
        other = [b for b in range(s) if b not in half]
        is_, oos = sums[:, half].sum(1) / sizes[list(half)].sum(), sums[:, other].sum(1) / sizes[other].sum()
        best = int(np.argmin(is_))
        omega = np.sum(oos >= oos[best]) / (n + 1)  # relative rank out of sample (a tie ranks below it)
        below.append(1.0 if omega < 0.5 else 0.5 if omega == 0.5 else 0.0)
    return float(np.mean(below))


PBO_MIN_SHARE = 0.8  # independent blocks / S below which PBO is not stated (adjacent-block correlation > 0.11)


def pbo_blocks(inner: pd.DataFrame, blocks: int = 8) -> float:
    """How many independent blocks PBO's S rest on: S (1 - c) / (1 + c), c the correlation of adjacent blocks' mean
    scores under an AR(1) with the trials' pooled lag-1 autocorrelation of their luck (each trial's scores less the
    date's mean over trials, which the ranking ignores); S for fewer than 2 trials or 3 dates."""
    m = inner.to_numpy(dtype=np.float64)  # (N, T)
    n, t = m.shape
    s = min(blocks, t) // 2 * 2
    if n < 2 or t < 3:
        return float(s)
    luck = m - m.mean(axis=0)
    luck = luck - luck.mean(axis=1, keepdims=True)
    den = (luck[:, :-1] ** 2).sum()
    rho = float(np.clip((luck[:, 1:] * luck[:, :-1]).sum() / den if den > 0 else 0.0, 0.0, 0.999))
    size = t / max(s, 1)  # dates per block
    cov = rho * (1 - rho**size) ** 2 / (1 - rho) ** 2  # AR(1), unit variance: adjacent block sums
    var = size * (1 + rho) / (1 - rho) - 2 * rho * (1 - rho**size) / (1 - rho) ** 2
    c = min(max(cov / var, 0.0), 1.0) if var > 0 else 1.0
    return float(s * (1 - c) / (1 + c))


def expected_best_null(n: int) -> float:
    """E[max of n standard normals]: how many standard errors the best of n no-effect trials beats the truth by."""
    from scipy import stats as sps

    x = np.linspace(-8, 8, 4001)
    return float(np.trapezoid(x * n * sps.norm.pdf(x) * sps.norm.cdf(x) ** (n - 1), x))


def in_sample(inner: pd.DataFrame, test: Callable[..., dict]) -> dict:
    """Selection and diagnostics on `inner` (trials x dates): the selected trial (lowest mean), its optimistic
    in-sample `test` (the project's interval rule, on the dates it was selected on), trial 0's, PBO, the null's."""
    sel, n = int(inner.mean(axis=1).idxmin()), len(inner)
    sd = float(inner.to_numpy().std(ddof=1)) if inner.size > 1 else 0.0
    return {"selected": sel, "trials": n, "dates": inner.shape[1], "mean": float(inner.loc[sel].mean()),
            "default_mean": float(inner.iloc[0].mean()), "pbo": pbo(inner), "pbo_blocks": pbo_blocks(inner),
            "expected_best_null": -expected_best_null(n) * sd / math.sqrt(max(inner.shape[1], 1)),
            "optimistic": test(inner.loc[sel].to_numpy(), np.asarray(inner.columns),
                               what="in-sample (optimistic) selected - zero_shot")}


# ---- the study: Optuna on a journal with a heartbeat, n_trials complete across any number of workers -------------

def _optuna():
    require_extra("optuna")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def open_study(folder: Path, tc: TuneConfig, identity: dict, holdout: Any, workers: int) -> Any:
    """The study named by `identity` (settings, data, folds, space), created or loaded; a change from the last study
    in `folder` is named in the log and starts a new study: trials of two setups are never mixed."""
    from finetune.utils.ledger import describe_changes  # (torch) not for loading settings

    name = "tune-" + digest(identity)[:12]
    path = folder / "study.json"
    old = read_json_object(path) if path.is_file() else {}
    if old.get("name") not in (None, name):
        log.warning("tune: the setup changed since study %s (%s): starting study %s", old["name"],
                    "; ".join(describe_changes(old.get("identity"), identity)), name)
    seen = {**old.get("studies", {}), name: holdout}  # every study of this folder: the blocks it is judged on
    write_json(path, {"name": name, "identity": identity, "studies": seen})
    optuna, url = _optuna(), tc.storage
    if url and url.startswith("sqlite") and workers > 1:
        raise ConfigError([f"tune.storage: sqlite ({url}) cannot serve {workers} workers (locking); use the journal "
                           "file (null) or postgresql://..."], "Invalid tune: settings")
    if url is None:
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        _repair_journal(folder / "journal.log", folder / "heartbeats", tc.heartbeat_seconds)
        url = JournalStorage(JournalFileBackend(str(folder / "journal.log")))
    return optuna.create_study(study_name=name, storage=url, direction="minimize", load_if_exists=True)


def _repair_journal(path: Path, beats: Path, every: float) -> None:
    """A journal whose last record is partial or garbled (a kill mid-write, a truncated copy) is cut back to its
    last whole record, said in the log, so the study goes on from there and appends after a whole line; a garbled
    record before the last one is refused naming the file. While another worker's heartbeat is fresh its partial
    last line may be a write in progress: left alone (cutting it would drop that worker's record)."""
    if any(_other_worker(b, every) for b in beats.glob("*") if b.suffix != ".tmp"):
        return
    lines = path.read_bytes().split(b"\n") if path.is_file() else [b""]
    *whole, tail = lines  # `tail`: what follows the last newline (b"" when the file ends with one)
    bad = [i for i, line in enumerate(whole) if not _json_line(line)]
    if bad and bad != [len(whole) - 1]:
        raise RefusedError(f"{path}: record {bad[0] + 1} is garbled, not only the last; restore the file from a "
                           "copy, or delete it (and tune/units/ stays: the study re-runs, reusing every unit)")
    keep = whole[:-1] if bad else whole
    if tail or bad:
        log.warning("tune: %s ends in a partial or garbled record (a kill mid-write or a truncated copy): cut back "
                    "to its last whole record (%d); the trials after it re-run", path, len(keep))
        atomic_write(path, lambda p: Path(p).write_bytes(b"".join(line + b"\n" for line in keep)))


def _other_worker(beat: Path, every: float) -> bool:
    """A fresh heartbeat of a worker other than this process."""
    with suppress(OSError, ValueError, KeyError):
        info = json.loads(beat.read_text())
        if info.get("host") == socket.gethostname() and int(info["pid"]) == os.getpid():
            return False
    return not _stale(beat, every)


def _json_line(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _beat(path: Path, stop: threading.Event | None = None, every: float = 0) -> None:
    while True:  # written aside and renamed: a reader never sees half a file (and takes it for a dead worker)
        path.with_suffix(".tmp").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        os.replace(path.with_suffix(".tmp"), path)
        if stop is None or stop.wait(every):
            return


def _stale(path: Path, every: float) -> bool:
    """A heartbeat older than 3 beats, or one written on this host by a process that is gone."""
    try:
        info, age = json.loads(path.read_text()), time.time() - path.stat().st_mtime
        if info.get("host") == socket.gethostname():
            os.kill(int(info["pid"]), 0)  # ProcessLookupError: gone (PermissionError: alive, another user's)
    except (OSError, ValueError) as err:
        return not isinstance(err, PermissionError)
    return age > 3 * every


def work(study: Any, tc: TuneConfig, folder: Path, given: Mapping[str, Any], defaults: dict[str, Any],
         objective: Callable[[dict, int], dict], progress: Callable[[Any], None] = lambda s: None) -> None:
    """Run trials until `tc.n_trials` are complete in the study (other workers count too). Under one lock per study
    folder: stale running trials are failed and re-queued with their settings, the next trial is drawn by a sampler
    seeded with seed + complete + running trials (concurrent workers draw distinct settings; a resumed single
    worker draws what an uninterrupted one would)."""
    optuna = _optuna()
    TrialState = optuna.trial.TrialState
    from finetune.utils.safety import TrainingStopped  # (torch) not when loading settings

    beats, finished = folder / "heartbeats", (ValueError, optuna.exceptions.UpdateFinishedTrialError)
    beats.mkdir(parents=True, exist_ok=True)
    while True:
        with FileLock(str(folder / "study.lock")):
            trials = study.get_trials(deepcopy=False)
            for t in trials:
                if t.state == TrialState.RUNNING and _stale(beats / f"{study.study_name}-{t.number}",
                                                            tc.heartbeat_seconds):
                    study.tell(t.number, state=TrialState.FAIL)
                    # its heartbeat is written only once its settings are drawn (old journals' trials too)
                    if (beats / f"{study.study_name}-{t.number}").is_file() or t.user_attrs.get("role") == "defaults":
                        log.warning("tune: trial %d's worker is gone: failed, re-queued with its settings", t.number)
                        study.enqueue_trial(t.params, user_attrs=t.user_attrs)
                    else:  # killed while drawing: its partial settings would fix some keys and redraw the rest
                        # apart; failed alone, the next draw (same seed, same history) is the one it was making
                        log.warning("tune: trial %d's worker is gone before its settings were drawn: drawn again",
                                    t.number)
            if not trials:  # trial 0: the config as given
                study.enqueue_trial({}, user_attrs={"role": "defaults"})
            trials = study.get_trials(deepcopy=False)
            done = sum(t.state == TrialState.COMPLETE for t in trials)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            errors = sum("error" in t.user_attrs for t in trials if t.state == TrialState.FAIL)
            if done >= tc.n_trials:
                return
            trial = None
            if done + running < tc.n_trials:
                # Seeded by the new trial's place among the live ones: concurrent asks draw apart, a resumed
                # worker draws what an uninterrupted one would; constant liar: TPE avoids the running settings.
                study.sampler = optuna.samplers.TPESampler(seed=tc.seed + done + running, constant_liar=True)
                trial = study.ask()
                params = defaults if trial.user_attrs.get("role") == "defaults" else suggest(trial, tc, given)
                stop, beat = threading.Event(), beats / f"{study.study_name}-{trial.number}"
                _beat(beat)  # before the unlock, after the draw: a stale trial with a heartbeat is re-queued whole
                threading.Thread(target=_beat, args=(beat, stop, tc.heartbeat_seconds), daemon=True).start()
        if trial is None:  # the rest are running elsewhere: wait for them (or for their heartbeat to stop)
            time.sleep(min(tc.heartbeat_seconds, 2.0))
            continue
        try:
            scores = objective(params, trial.number)
        except BaseException as exc:
            stop.set()
            again = isinstance(exc, TrainingStopped) or not isinstance(exc, Exception)  # SIGTERM / Ctrl-C: re-run
            with suppress(*finished):  # another worker may have failed it (and re-queued it) meanwhile
                trial.set_user_attr("error", str(exc).splitlines()[0])
                study.tell(trial, state=TrialState.FAIL)
                if again:
                    study.enqueue_trial(trial.params, user_attrs={k: v for k, v in trial.user_attrs.items()
                                                                  if k != "error"})
            if again or not isinstance(exc, UserError) or errors + 1 >= tc.n_trials:
                raise
            log.warning("tune: trial %d failed, the study goes on: %s", trial.number, exc)  # e.g. a lookback too long
            continue
        stop.set()
        with suppress(*finished):  # failed by another worker as stale: its re-queued copy reuses these units
            trial.set_user_attr("scores", {str(k): float(v) for k, v in scores.items()})
            trial.set_user_attr("settings", params)
            study.tell(trial, float(np.mean(list(scores.values()))))
        progress(study)


def check_recorded(study: Any, defaults: dict[str, Any], objective: Callable[[dict, int], dict], where: str) -> None:
    """Each complete trial's recorded settings, value and inner scores against what its units' files give now
    (`objective` reuses them: hash-checked, rescored when edited): a study record that was edited or damaged is
    refused naming `where`, never reported (its best and its selection would disagree)."""
    for t in study.get_trials(deepcopy=False, states=(_optuna().trial.TrialState.COMPLETE,)):
        settings, scores = t.user_attrs.get("settings"), t.user_attrs.get("scores") or {}
        drawn = json.loads(json.dumps(defaults if t.user_attrs.get("role") == "defaults" else t.params, default=str))
        fresh = {str(k): float(v) for k, v in objective(settings, t.number).items()} if settings == drawn else {}
        if fresh.keys() != scores.keys() or not np.allclose(
                [t.value, *scores.values()], [np.mean(list(fresh.values())), *(fresh[k] for k in scores)],
                rtol=1e-9, atol=0, equal_nan=True):
            raise RefusedError(f"{where}: trial {t.number}'s recorded settings or scores (value {t.value}) are not "
                               "what its units' files give: the study record was edited or damaged; delete it (or "
                               "restore a copy) and rerun: tune/units/ stays, so the study re-runs reusing every unit")


def spawn_workers(n: int, argv: list[str]) -> list[subprocess.Popen]:
    """n - 1 more local workers (`kronos ... --worker`), each with its share of the CPU threads or one GPU."""
    import torch

    gpus, threads = torch.cuda.device_count(), max(1, (os.cpu_count() or 1) // n)
    out = [subprocess.Popen([sys.executable, "-m", "finetune.cli", *argv, "--worker"], env={
        **os.environ, "OMP_NUM_THREADS": str(threads), **({"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus else {})})
        for i in range(1, n)]
    if not gpus:  # this process keeps cuda:0
        torch.set_num_threads(threads)
    return out


def trial_table(study: Any) -> tuple[dict, pd.DataFrame]:
    """(counts and rows of every trial, the inner matrix: complete trials x dates scored by all of them)."""
    trials = study.get_trials(deepcopy=False)
    rows = [{"number": t.number, "state": t.state.name.lower(), "value": t.value,
             "settings": t.user_attrs.get("settings", t.params), "defaults": t.user_attrs.get("role") == "defaults",
             "error": t.user_attrs.get("error")}
            for t in trials]
    counts = {k: [r["state"] for r in rows].count(s) for k, s in (("complete", "complete"), ("pruned", "pruned"),
                                                                  ("failed", "fail"))}
    done = [t for t in trials if t.state.name == "COMPLETE"]
    done.sort(key=lambda t: (t.user_attrs.get("role") != "defaults", t.number))  # row 0: the config as given
    inner = pd.DataFrame({t.number: pd.Series(t.user_attrs["scores"]) for t in done}).T.dropna(axis=1)
    return {**counts, "list": rows}, inner.reindex(sorted(inner.columns), axis=1)


def add_worker_args(parser: Any) -> Any:
    parser.add_argument("--workers", type=int, default=1, help="local worker processes (a share of the CPU threads "
                        "or one GPU each)")
    parser.add_argument("--worker", action="store_true", help="join this config's study as one more worker (e.g. a "
                        "Slurm array task); the run without it writes the report")
    return parser


def run(folder: Path, tc: TuneConfig, identity: dict, holdout: Any, given: Mapping[str, Any], objective: Callable,
        args: Any, command: str, test: Callable[..., dict]) -> dict | None:
    """Open (or join) the study and work until it has tc.n_trials complete trials; None for a `--worker`, else
    {trials, inner (`in_sample` with the pipeline's `test`), selected trial, study: name, storage, studies this
    holdout has judged}. `args`: the command's parsed flags (config, set, workers, worker)."""
    worker, workers = args.worker, args.workers
    if not 1 <= workers <= 1024:
        raise ConfigError([f"--workers: must be in [1, 1024], got {workers}"], "Invalid tune: settings")
    argv = [command, "--config", args.config, *(x for s in args.set for x in ("--set", s))]
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / "study.lock")):
        study = open_study(folder, tc, identity, holdout, workers + worker)
    defaults = {k: get_dotted(given, k) for k in tc.space}
    if not worker:  # before any work: the journal's values must not steer the sampler or the report
        check_recorded(study, defaults, objective, tc.storage or str(folder / "journal.log"))
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    extra = spawn_workers(workers, argv) if workers > 1 else []
    bar = tqdm(total=tc.n_trials, desc=f"tune {study.study_name}", disable=worker)

    def progress(s: Any) -> None:
        bar.n = sum(t.state.name == "COMPLETE" for t in s.get_trials(deepcopy=False))
        bar.set_postfix(best=f"{s.best_value:+.5f} (trial {s.best_trial.number})")
    try:
        with logging_redirect_tqdm(tqdm_class=tqdm):  # a log line while the bar is drawn goes above it, on its own line
            work(study, tc, folder, given, defaults, objective, progress)
    finally:
        for p in extra:
            if p.wait() != 0:
                raise UserError(f"tune: a local worker (pid {p.pid}) ended with exit {p.returncode}; see its log above")
        bar.close()
    if worker:
        return None
    trials, inner = trial_table(study)
    seen, ins = read_json_object(folder / "study.json")["studies"].values(), in_sample(inner, test)
    return {"study": {"name": study.study_name, "storage": tc.storage or str(folder / "journal.log"),
                      "studies_judged_on_this_holdout": sum(json.dumps(h) == json.dumps(holdout) for h in seen)},
            "trials": trials, "selected": next(r for r in trials["list"] if r["number"] == ins["selected"]),
            "inner": {k: v for k, v in ins.items() if k != "pbo"}, "pbo": ins["pbo"]}


def pool(found: list[dict]) -> dict:
    """The nested mode's studies (one per judged fold) as one: trial counts summed, inner means and PBO averaged over
    folds, `selected` = the most frequent selection, `folds` = each fold's study, selection, inner scores, PBO."""
    keys = [json.dumps(f["selected"]["settings"], sort_keys=True, default=str) for f in found]
    mean, seen = lambda xs: float(np.mean(xs)) if xs else None, "studies_judged_on_this_holdout"
    return {"study": {"name": ", ".join(f["study"]["name"] for f in found), "storage": "one per fold",
                      seen: max(f["study"][seen] for f in found)},
            "trials": {k: sum(f["trials"][k] for f in found) for k in ("complete", "pruned", "failed")},
            "selected": found[max(range(len(found)), key=lambda i: keys.count(keys[i]))]["selected"],
            "inner": {"trials": found[0]["inner"]["trials"], **{k: mean([f["inner"][k] for f in found]) for k in (
                "mean", "default_mean", "expected_best_null")}},
            "pbo": mean([f["pbo"] for f in found if f["pbo"] is not None]),
            "folds": [{"fold": k, **{x: f[x] for x in ("study", "trials", "selected", "inner", "pbo")}}
                      for k, f in enumerate(found)]}


def write_report(folder: Path, found: dict, outer: dict[str, dict], best: dict, **extra: Any) -> dict:
    """report.json: the study's `found` with the judged comparisons `outer` (tuned_vs_zero_shot decides the verdict,
    tuned_vs_default) and `best` (candidates ranked on the judged blocks); printed in words."""
    v = outer["tuned_vs_zero_shot"]
    report = {**found, "outer": outer, "verdict": v["verdict"], "verdict_reason": v["reason"], "best": best, **extra}
    write_json(folder / "report.json", report)
    t, i, sel = found["trials"], found["inner"], found["selected"]
    print("\n".join([
        f"tune: study {found['study']['name']}: {t['complete']} complete, {t['pruned']} pruned, {t['failed']} failed "
        f"trials ({found['study']['studies_judged_on_this_holdout']} studies judged on these blocks so far)",
        f"selected trial {sel['number']}: " + ", ".join(f"{k}={v}" for k, v in sel["settings"].items()),
        f"inner (optimistic: the dates it was selected on): {i['mean']:+.5f}, the config as given "
        f"{i['default_mean']:+.5f}; the best of {i['trials']} no-effect trials would show "
        f"{i['expected_best_null']:+.5f}; PBO {found['pbo']}",
        *(f"outer {k}: {r['reason']}" for k, r in outer.items()), f"verdict: {v['verdict']}",
        best.get("line", f"best: {best['candidate']}"), f"written: {folder / 'report.json'}"]))
    return report
