"""What every benchmark shares: the timing loops and one-call timers, the child-process
runner, synthetic host batches, the `--kit LABEL=FLAGS` grammar every tool takes a kit row
in, and the Markdown table.

Standard library and NumPy only, so that a child process that must not start JAX (the
PyTorch peer) can use it too. The pieces that build and time the kit's own training
step (its inputs, its strategy, its memory) are benchmarks/bench.py's helpers
(script_setup / training_setup, make_strategy, step_inputs, measure_train_step,
tree_bytes).
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from typing import Callable, Iterable

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULT_TAG = "BENCH_RESULT "


# ------------------------------------------------------------------------ timing loops
@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Seconds per timed step: wall-clock, and this process's CPU time (all threads)."""
    wall: list[float]
    cpu: list[float]


def time_steps(dispatch: Callable[[int], object], wait: Callable[[object], object],
               warmup: int, steps: int) -> StepTimes:
    """Time a training loop as the kit's loop drives it.

    dispatch(i) starts step i and returns something to wait() on. One step stays in
    flight while the next is dispatched, and a step's time is the interval between the
    completions of two consecutive steps. One step more than warmup + steps runs: where
    dispatch turns out synchronous (the call returns only when the step is done, as
    XLA:CPU may do), a step's completion is observed one call late, and the extra step
    keeps the last timed interval honest. Returns the intervals of steps
    warmup .. warmup + steps - 1.
    """
    finished, cpu, previous = [], [], None
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(warmup + steps + 1):
        handle = dispatch(i)
        if previous is not None:
            wait(previous)
            finished.append(time.perf_counter())
            cpu.append(time.process_time())
        previous = handle
    wait(previous)
    finished.append(time.perf_counter())
    cpu.append(time.process_time())
    wall = np.diff([start] + finished)[warmup:warmup + steps]
    cpu_s = np.diff([cpu_start] + cpu)[warmup:warmup + steps]
    return StepTimes(wall.tolist(), cpu_s.tolist())


def time_calls(call: Callable[[], object], wait: Callable[[object], object], runs: int, *,
               warmup: int = 1) -> StepTimes:
    """Time `runs` calls of call() one after the other, each waited for (wait(result))
    before the next starts, after `warmup` untimed ones (the first compiles)."""
    for _ in range(warmup):
        wait(call())
    wall, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        wait(call())
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return StepTimes(wall, cpu)


def median_seconds(call: Callable[[], object], wait: Callable[[object], object] = lambda r: r,
                   runs: int = 5, *, warmup: int = 1) -> float:
    """The median wall-clock seconds of `runs` calls, as time_calls times them."""
    return statistics.median(time_calls(call, wait, runs, warmup=warmup).wall)


def timed(call: Callable[[], object]) -> tuple[object, float, float]:
    """call() once: (its result, the wall-clock seconds, this process's CPU seconds); a
    compile's timing (`lowered.compile`)."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = call()
    return result, time.perf_counter() - t0, time.process_time() - c0


def first_and_median(call: Callable[[], object], wait: Callable[[object], object],
                     runs: int) -> tuple[float, float]:
    """(seconds of the first call, waited for: a jitted function's compile and first run;
    the median seconds of `runs` calls after it)."""
    _, first, _ = timed(lambda: wait(call()))
    return first, median_seconds(call, wait, runs, warmup=0)


# ------------------------------------------------------------------ synthetic batches
def host_batches(batch: int, n: int = 2, seed: int = 0, shape=(32, 32, 3), classes: int = 10):
    """n random CIFAR-shaped uint8 batches (NHWC) with int32 labels, on the host: for
    code that does not run the kit's training step (the peers, the probes). That step's
    inputs come from bench.step_inputs, which draws them as training does."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, (batch, *shape), dtype=np.uint8),
             rng.integers(0, classes, (batch,), dtype=np.int32)) for _ in range(n)]


# ----------------------------------------------------------------------- child processes
def run_child(module: str, job: dict, *, timeout: float | None = None,
              env: dict | None = None) -> dict:
    """Run `python -m module --child JOB` in a fresh interpreter (its own process group,
    killed at the timeout or on Ctrl-C, with whatever it started) from the repository
    root. Returns the dict the child printed after RESULT_TAG, with "wall_s"; or
    {"error": the last line of its stderr, "stderr_tail": its last lines, "wall_s"}."""
    cmd = [sys.executable, "-m", module, "--child", json.dumps(job)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=str(REPO), env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nerror: timed out after {timeout:.0f} s"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    wall = time.perf_counter() - t0
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            return {**json.loads(line[len(RESULT_TAG):]), "wall_s": wall}
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return {"error": lines[-1] if lines else f"exit code {proc.returncode}",
            "stderr_tail": lines[-8:], "wall_s": wall}


def child_main(run: Callable[[dict], dict], job: dict) -> int:
    """The child's side of run_child: run(job) in this process and print its result
    after RESULT_TAG. A failure prints its traceback and, last, one line
    "error: Type: message" (the line run_child reports); returns the exit code."""
    try:
        result = run(job)
    except SystemExit as e:  # argparse has printed why
        return e.code if isinstance(e.code, int) else 2
    except Exception as e:  # noqa: BLE001 - one configuration's failure, reported by the parent
        traceback.print_exc()
        message = " ".join(str(e).split())[:300]
        print(f"error: {type(e).__name__}: {message}", file=sys.stderr, flush=True)
        return 1
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------- a row of the kit
_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def parse_kit_row(text: str) -> tuple[str, dict[str, str], list[str]]:
    """`--kit LABEL=[NAME=VALUE ...] FLAGS`, the benchmarks' one grammar for a row of the
    kit (benchmarks.bench, .peers, .deviceless): -> (label, the row's environment
    variables, the training script's flags). ValueError says what is wrong."""
    label, sep, rest = text.partition("=")
    if not sep or not label.strip():
        raise ValueError(f"--kit {text!r}: expected LABEL=FLAGS, e.g. 'no-scan=--no-scan'")
    try:
        words = shlex.split(rest)
    except ValueError as e:
        raise ValueError(f"--kit {text!r}: {e}") from None
    env = {}
    while words and _ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return label.strip(), env, words


# --------------------------------------------------------------------------- the table
def markdown_table(head: list[str], rows: Iterable[list[str]],
                   numeric: Iterable[int] = ()) -> str:
    """A Markdown table: `head`, then one line per row, a row being a list of cells. A row
    shorter than the head (e.g. [label, "failed: why"]) ends in empty cells; a "|" in a
    cell becomes "/". Columns whose index is in `numeric` are right-aligned."""
    numeric = set(numeric)
    lines = ["| " + " | ".join(head) + " |",
             "|" + "".join("---:|" if i in numeric else "---|" for i in range(len(head)))]
    for row in rows:
        cells = [str(c).replace("|", "/") for c in row]
        cells += [""] * (len(head) - len(cells))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cell(x, spec: str, scale: float = 1.0) -> str:
    """format(x * scale, spec), or "n/a" for None."""
    return "n/a" if x is None else format(x * scale, spec)


# ------------------------------------------------------------------------ the machine
def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_line() -> str:
    """When and where: date, processor, cores, jax's version, the load."""
    return (f"{datetime.datetime.now().isoformat(timespec='minutes')}, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
            f"jax {package_version('jax')}, load {os.getloadavg()[0]:.2f} at start")


def device_info(device, framework: str) -> dict:
    """{"device": "KIND (PLATFORM, FRAMEWORK)", "platform": ...} of a JAX device."""
    return {"device": f"{device.device_kind} ({device.platform}, {framework})",
            "platform": device.platform}


def device_peak_bytes(device) -> int | None:
    """A JAX device's peak bytes in use (None where the backend keeps no such figure)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def command_line(module: str, argv: list[str] | None) -> str:
    """`python -m MODULE ARGS` as it can be typed again: `argv`, or this process's
    arguments when None."""
    words = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", module, *(shlex.quote(w) for w in words)])
