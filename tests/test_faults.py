"""Faults in a two-process job (loopback, tiny model): every process ends within seconds,
in one line that names the cause, with an exit code that is not a signal's.

    fault                                   process that failed     the other process
    a flag that differs (--lr)              2, names the flag       2, the same line
    a peer that never starts                3 (--init-timeout)      -
    kill -9 of process 1 mid-run            (killed)                3, "stopped responding"
      ... and then a C++ abort in process 0  (killed)                3, the same line
      ... as a runtime error in process 0    (killed)                3, the same line
    two SIGTERMs 20 ms apart to process 1   130                     3, names the cause
                                            (or both 143: stopped together, agreed)
    disk full at process 0's save (tmpfs)   2, one line             3, names the cause

The kill and the signals need a run that trains for a while: those are marked slow.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from test_multiprocess import REPO, _env, _free_port

# RandAugment off: the faults are not about the step, and it doubles its compile time.
BASE = ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "1600",
        "--synthetic-val", "32", "--synthetic-test", "32", "--batch", "16", "--no-progress",
        "--accum-steps", "1", "--eval-every", "0", "--cpu-devices", "2",
        "--heartbeat-timeout", "5", "--randaugment", "0"]
LIMIT_S = 30  # every process must be gone this long after the fault (the bound)
START_S = 300  # two jax processes starting and compiling on a loaded 2-core machine


def _start(out: pathlib.Path, flags: list[list[str]], n: int = 2) -> list:
    """Start process i of an n-process job with BASE + flags[i]: [(Popen, output file)]."""
    out.mkdir(exist_ok=True)
    port = _free_port()
    procs = []
    for pid, extra in enumerate(flags):
        cmd = [sys.executable, "-u", "train_shardmap.py", *BASE, *extra,
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n),
               "--process-id", str(pid), "--log-json", str(out / f"log{pid}.jsonl")]
        log = out / f"out{pid}.txt"
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=open(log, "w"),
                                       stderr=subprocess.STDOUT, start_new_session=True),
                      log))
    return procs


def _finish(procs, timeout: float) -> list:
    """Each process's exit code and its output's non-gloo lines; kills what is left."""
    results, deadline = [], time.monotonic() + timeout
    for proc, log in procs:
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "still running"
        lines = [ln for ln in log.read_text().splitlines() if not ln.startswith("[Gloo]")]
        results.append((code, lines))
    return results


def _errors(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith(("error:", "interrupted:"))]


def _wait_for_a_step(procs, out: pathlib.Path) -> None:
    """Until process 0 has logged a training step (both are then inside the step loop)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        log = out / "log0.jsonl"
        if log.exists() and any('"lr"' in line for line in log.read_text().splitlines()):
            return
        assert all(p.poll() is None for p, _ in procs), [p.poll() for p, _ in procs]
        time.sleep(0.2)
    pytest.fail("no training step within the start-up time")


def test_processes_with_different_flags_refuse_in_one_line(tmp_path):
    results = _finish(_start(tmp_path, [["--steps", "3"], ["--steps", "3", "--lr", "0.01"]]),
                      START_S)
    want = ("error: the processes disagree on the run: --lr differs (process 0 0.001, "
            "process 1 0.01); every process must be given the same flags")
    for code, lines in results:
        assert code == 2 and _errors(lines) == [want], lines
        assert not any("Traceback" in ln for ln in lines)


def test_a_peer_that_never_starts_is_one_line(tmp_path):
    """Process 0 of 2 alone: it stops after --init-timeout, in one line, exit 3."""
    t0 = time.monotonic()
    [(code, lines)] = _finish(_start(tmp_path, [["--steps", "3", "--init-timeout", "3"]]),
                              START_S)
    assert code == 3 and len(_errors(lines)) == 1, lines
    assert "did not all join within 3 s (--init-timeout)" in _errors(lines)[0]
    assert time.monotonic() - t0 < START_S


@pytest.mark.slow
@pytest.mark.parametrize("abort", [False, True], ids=["kill", "kill-then-abort"])
def test_a_killed_peer_stops_the_job(tmp_path, abort):
    """kill -9 of process 1 mid-run: process 0 names it in one line and exits 3. The death
    also breaks the collective process 0 is in, at once: that is a hang, an error or, in
    gloo's I/O thread, a C++ abort (GLOO_ENFORCE: "op.preamble.length <= op.nbytes"), the
    rarest, once in several CI runs. `abort` makes it certain: a SIGABRT to process 0 after
    the kill (a second later, when its main thread waits on the broken step) must end in
    the same line and exit, not in the abort's -6."""
    procs = _start(tmp_path, [["--steps", "5000"]] * 2)
    _wait_for_a_step(procs, tmp_path)
    procs[1][0].kill()
    killed = time.monotonic()
    if abort:
        time.sleep(1.0)
        procs[0][0].send_signal(signal.SIGABRT)
    [(code0, lines0), (code1, _)] = _finish(procs, LIMIT_S)
    assert time.monotonic() - killed < LIMIT_S
    assert code1 == -signal.SIGKILL
    assert code0 == 3 and _errors(lines0) == [
        "error: process 1 of 2 stopped responding (no heartbeat for 5 s: killed, crashed or "
        "hung); this process stops too"], lines0


# A JaxRuntimeError in a job whose Watch names process 1 half a second later (played by a
# thread: a real job needs a peer to die in its collective, which a kill only sometimes hits).
RUNTIME_ERROR_THEN_VERDICT = """
import threading, time
import jax
from vit_pure.run import cli, distributed
distributed.Watch._thread = threading.current_thread()  # a job's Watch, to main_guard
distributed.Watch.heartbeat_timeout, distributed.Watch.in_touch_at = 5.0, time.monotonic()
def watch():  # as Watch._run: no verdict once this process has reported its own failure
    time.sleep(0.5)
    if not distributed.Watch._stopped.is_set():
        distributed._die("process 1 of 2 stopped responding (a dead peer); this process stops too")
def step():
    raise jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: Connection reset by peer")
threading.Thread(target=watch, daemon=True).start()
raise SystemExit(cli.main_guard(step))
"""


def test_a_runtime_error_waits_for_the_watch_to_name_a_dead_peer():
    """The other side of a peer's death mid-step: gloo's "Connection reset by peer" as a
    JaxRuntimeError in the surviving process, before its Watch misses the heartbeat.
    main_guard holds it until the Watch has named the dead process (exit 3, its line), not
    exit 1 with a traceback as this process's own failure."""
    done = subprocess.run([sys.executable, "-c", RUNTIME_ERROR_THEN_VERDICT], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=START_S)
    lines = done.stderr.splitlines()
    assert done.returncode == 3 and _errors(lines) == [
        "error: process 1 of 2 stopped responding (a dead peer); this process stops too"], lines
    assert not any("Traceback" in ln for ln in lines)


@pytest.mark.slow
def test_a_second_signal_stops_every_process_at_once(tmp_path):
    """Two SIGTERMs 20 ms apart to process 1. The first asks for the agreed stop (the
    processes agree every 10 steps); the second stops process 1 at once (130) and process 0
    with it (3). Where the agreement came between the two, both stopped together at the
    agreed step instead (143: SIGTERM without --ckpt-dir): either way, promptly, one line."""
    procs = _start(tmp_path, [["--steps", "5000"]] * 2)
    _wait_for_a_step(procs, tmp_path)
    procs[1][0].send_signal(signal.SIGTERM)
    time.sleep(0.02)
    procs[1][0].send_signal(signal.SIGTERM)
    sent = time.monotonic()
    [(code0, lines0), (code1, lines1)] = _finish(procs, LIMIT_S)
    assert time.monotonic() - sent < LIMIT_S
    if code1 == 130:
        assert _errors(lines1) == [
            "interrupted: stopped at once; nothing saved since the last checkpoint"], lines1
        assert code0 == 3 and _errors(lines0) == [
            "error: process 1 of 2 stopped (interrupted by a second signal); this process "
            "stops too"], lines0
    else:
        for code, lines in ((code0, lines0), (code1, lines1)):
            assert code == 128 + signal.SIGTERM, (code, lines)
            assert [ln for ln in lines if ln.startswith("interrupted by SIGTERM at step ")], lines
            assert not any("Traceback" in ln for ln in lines)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs: the tiny model's first checkpoint does not fit."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a small tmpfs here ({e}); the single-process disk-full "
                    f"test (test_cli_errors) injects the fault instead")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.slow
def test_disk_full_at_a_save_stops_every_process(tmp_path, small_disk):
    ckpt = ["--steps", "3", "--ckpt-every", "2", "--ckpt-dir", str(small_disk / "ck")]
    [(code0, lines0), (code1, lines1)] = _finish(_start(tmp_path, [ckpt, ckpt]), START_S)
    cause = (f"cannot write the step-2 checkpoint in {small_disk / 'ck'} (No space left on "
             f"device); the checkpoints written before are intact")
    assert code0 == 2 and _errors(lines0) == [f"error: {cause}"], lines0
    assert code1 == 3 and _errors(lines1) == [
        f"error: process 0 of 2 stopped ({cause}); this process stops too"], lines1
    assert os.listdir(small_disk / "ck") == []  # the partial save removed
    records = [json.loads(ln) for ln in (tmp_path / "log0.jsonl").read_text().splitlines()]
    assert max(r.get("step", 0) for r in records) == 2  # it stopped at the failed save
