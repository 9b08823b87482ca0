"""Graceful stop: SIGTERM/SIGINT finish the step, save, print one line, exit 75; a second signal exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from finetune.utils.errors import TrainingStopped
from finetune.utils.safety import STOPPED_EXIT_CODE, GracefulStop, check_step, raise_if_stop_requested
from tests.conftest import cpu_env

ROOT = Path(__file__).resolve().parents[1]

# A dummy training loop: each "step" logs start/end around a sleep; after each step it checks for a stop request,
# "saves" (writes the step number, slowly when asked, to give the test time for a second signal) and exits.
LOOP = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from finetune.utils.safety import GracefulStop, check_step
    from finetune.utils.errors import TrainingStopped
    out, save_seconds = Path(sys.argv[1]), float(sys.argv[2])
    log = open(out / "steps.log", "w", buffering=1)
    try:
        with GracefulStop() as stopper:
            step = 0
            while True:
                step += 1
                log.write(f"start {step}\\n"); print(f"start {step}", flush=True)
                time.sleep(0.3)                     # the optimizer step
                log.write(f"end {step}\\n")
                if check_step(0.0, stop=stopper.requested)[1]:  # the loop's per-step agreement
                    time.sleep(save_seconds)
                    (out / "saved.txt").write_text(str(step))
                    raise TrainingStopped(stopper.signal_name, out / "saved.txt", step)
    except TrainingStopped as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)
""")


def start_loop(tmp_path: Path, save_seconds: float = 0.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(tmp_path), str(save_seconds)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "start 1", proc.stderr.read()
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_current_step_saves_and_exits_with_one_line(tmp_path, sig):
    proc = start_loop(tmp_path)
    time.sleep(0.1)  # inside step 1's sleep
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == STOPPED_EXIT_CODE == 75
    assert (tmp_path / "saved.txt").read_text() == "1"
    assert (tmp_path / "steps.log").read_text().split("\n")[:2] == ["start 1", "end 1"]  # the step completed
    lines = err.strip().splitlines()
    name = signal.Signals(sig).name
    assert len(lines) == 2 and "Traceback" not in err, err
    assert lines[0].startswith(f"received {name}: finishing the current step")
    assert lines[1] == f"stopped on {name} at step 1; saved {tmp_path / 'saved.txt'}; run the same " \
                       "command again to resume from there"


def test_second_sigint_exits_immediately_with_one_line(tmp_path):
    proc = start_loop(tmp_path, save_seconds=30.0)
    proc.send_signal(signal.SIGINT)
    assert proc.stderr.readline().startswith("received SIGINT: finishing")
    time.sleep(0.6)  # now in the slow "save"
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert time.monotonic() - began < 10
    assert proc.returncode == 130
    assert err.strip() == "received SIGINT again: quitting now without saving"
    assert not (tmp_path / "saved.txt").exists()


@pytest.mark.parametrize("second", ["sigterm", "forwarded"])
def test_repeated_sigterm_or_a_forwarded_copy_keeps_stopping_gracefully(tmp_path, second):
    # torchrun's agent forwards the signal the workers already got; a scheduler repeats SIGTERM: neither may turn a
    # graceful stop into a quit without saving.
    proc = start_loop(tmp_path, save_seconds=1.0)
    first = signal.SIGTERM if second == "sigterm" else signal.SIGINT
    proc.send_signal(first)
    if second == "sigterm":
        assert proc.stderr.readline().startswith("received SIGTERM: finishing")
        time.sleep(0.6)
    proc.send_signal(first)  # "forwarded": within FORWARD_GRACE_S of the first
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == STOPPED_EXIT_CODE, err
    assert (tmp_path / "saved.txt").read_text() == "1"
    assert "quitting now" not in err


def test_handlers_are_restored_and_flag_is_per_context():
    before_int, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with GracefulStop() as stopper:
        assert signal.getsignal(signal.SIGINT) == stopper._handle
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stopper.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stopper.signal_name == "SIGTERM" and stopper.requested
        assert check_step(0.0, stop=stopper.requested) == (True, True)  # no process group: the flag itself
    assert signal.getsignal(signal.SIGINT) == before_int and signal.getsignal(signal.SIGTERM) == before_term
    with GracefulStop(enabled=False):
        assert signal.getsignal(signal.SIGINT) == before_int
    assert check_step(0.0, stop=False) == (True, False)


def test_a_nested_stop_shares_the_runs_request_and_the_safe_point_raises_after_it():
    raise_if_stop_requested("between stages")  # no run holds the handlers: nothing to honour
    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop() as run:
        with GracefulStop() as stage:  # a stage's loop inside the run: the same request
            assert stage is run
        assert signal.getsignal(signal.SIGTERM) == run._handle  # the stage's exit kept the run's handlers
        raise_if_stop_requested("between stages")
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. right after the stage's last epoch
        deadline = time.monotonic() + 5
        while not run.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(TrainingStopped) as stopped:
            raise_if_stop_requested("after the tokenizer stage")
    assert str(stopped.value) == ("stopped on SIGTERM after the tokenizer stage; run the same command again to "
                                  "resume from there") and stopped.value.exit_code == 75
    assert signal.getsignal(signal.SIGTERM) == before and GracefulStop.active is None


def test_training_stopped_message_without_checkpoint():
    e = TrainingStopped("SIGTERM")
    assert str(e) == "stopped on SIGTERM; run the same command again to resume from there" and e.exit_code == 75


AGREE = textwrap.dedent("""
    import sys, torch.distributed as tdist
    from finetune.utils.safety import check_step
    rank = int(sys.argv[2])
    tdist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=2)
    print(check_step(0.0, stop=rank == 1)[1], check_step(0.0, stop=False)[1])
    tdist.destroy_process_group()
""")


@pytest.mark.slow
def test_ranks_agree_to_stop_when_any_rank_was_signalled(tmp_path):
    env = cpu_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", AGREE, str(tmp_path / "rdv"), str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip() for o, _ in outs] == ["True False", "True False"]
