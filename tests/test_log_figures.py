"""The figures the training log prints are the ones the run achieved.

A real run of train_shardmap.py as a child process, watched from outside: this process
stamps each line of the child's (unbuffered) stdout with its own clock as it arrives, and
reads the child's peak RSS from the operating system (`os.wait4`, the child's own rusage,
which is what `/usr/bin/time -v` prints as its maximum resident set size). The log's
img/s of steps 2..N must match the time between their lines, its first-step line the time
from the setup line to it, with the compile it states left out of step 1's img/s, its
compile figure the time from the "compiling the training step" line to the next line (in
the step or before the loop, with --accum-steps auto), and its last "host peak RSS" the
operating system's figure, each within 20%; a line comes before any compile.
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BATCH, STEPS = 1024, 3


def _env():
    """This environment, minus conftest's 8-device XLA_FLAGS: one CPU device."""
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_"))}
    return env | {"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


@pytest.mark.slow
@pytest.mark.parametrize("accum", ["auto", "1"])
def test_logged_rate_and_memory_agree_with_the_clock_and_the_os(tmp_path, accum):
    log = tmp_path / "log.jsonl"
    argv = [sys.executable, "train_shardmap.py", "--model", "tiny", "--batch", str(BATCH),
            "--dataset", "synthetic", "--synthetic-train", str(BATCH * (STEPS + 1)),
            "--synthetic-val", "8", "--synthetic-test", "8", "--steps", str(STEPS),
            "--eval-every", "0", "--no-final-eval", "--no-progress", "--randaugment", "0",
            "--accum-steps", accum, "--log-json", str(log)]
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    # "start" (the first line), "setup" (the last line before the loop: the config line or
    # the step's "compiled" line), "first", a step number -> this process's clock;
    # "compiling": each span from a "compiling the training step" line to the next line.
    arrived, compiling, opened = {}, [], None
    for line in proc.stdout:
        now = time.perf_counter()
        arrived.setdefault("start", now)
        if opened is not None:
            compiling.append(now - opened)
            opened = None
        if line.startswith("compiling the training step"):
            opened = now
        if line.startswith(("model tiny:", "compiled the training step")):
            arrived["setup"] = now  # the last line before the loop
        elif re.match(r"step 1 done in ", line):
            arrived["first"] = now
        elif m := re.match(r"step +(\d+) +loss ", line):
            arrived[int(m[1])] = now
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0
    records = [json.loads(x) for x in log.read_text().splitlines()]

    # Steps 2..N: the seconds their img/s figures stand for, and the clock between lines.
    rates = {r["step"]: r["images_per_s"] for r in records if "images_per_s" in r}
    assert sorted(rates) == list(range(1, STEPS + 1))
    logged = sum(BATCH / rates[s] for s in range(2, STEPS + 1))
    outside = arrived[STEPS] - arrived[1]
    assert abs(logged - outside) <= 0.2 * outside, (logged, outside)

    # A line before any compile: the data's.
    assert arrived["start"] < arrived["setup"]

    # Step 1: its time as logged (what it compiled itself included) against the clock; its
    # img/s leaves that compile out. The compile figure counts the step's compile wherever
    # it happened (before the loop, in --accum-steps auto or not), and matches the clock
    # from the "compiling the training step" line to the line after it.
    first = next(r for r in records if r.get("event") == "first_step")
    outside = arrived["first"] - arrived["setup"]
    assert abs(first["seconds"] - outside) <= 0.2 * outside, (first, outside)
    in_step = first["compile_s"] - first["compile_before_s"]
    assert 0 <= in_step < first["seconds"]
    assert first["compile_before_s"] > 0
    assert len(compiling) == 1
    assert abs(first["compile_s"] - compiling[0]) <= 0.2 * compiling[0], (first, compiling)
    # (Within the 20% the other figures are held to: the rate is taken at the log point,
    # a few host operations after the step's own clock stops; 6% apart was seen under load.)
    assert BATCH / rates[1] == pytest.approx(first["seconds"] - in_step, rel=0.2)

    # The last memory line against the operating system's peak of the whole process.
    memory = [r for r in records if r.get("event") == "memory"]
    assert [r["step"] for r in memory] == [1, STEPS]
    os_peak = usage.ru_maxrss * 1024  # KiB on Linux
    assert abs(memory[-1]["host_peak_rss_bytes"] - os_peak) <= 0.2 * os_peak
