"""What a training run reports while it runs: the log, the loss check, profiles, memory.

* `Logger`: human lines on stdout (through tqdm when a progress bar is open), and the
  same events as JSON lines in `--log-json`.
* `LossWatch`: every step's loss and gradient norm, checked for NaN / inf at the loop's
  host syncs, without adding one.
* `Profiler`: a `jax.profiler` trace of the steps `--profile-steps` names.
* `log_memory`: device memory (where the backend reports it) and the host's peak RSS.
* `Throughput` and `progress_bar`: training images per second between log points, each
  figure taken once its step has finished, compile time left out; and the bar.

Nothing here decides what the run does, except that `LossWatch` stops it on a bad loss.
"""
from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm


class Logger:
    """Human lines on stdout (through tqdm when a bar is open), JSON lines to a file."""

    def __init__(self, path: str | None, enabled: bool = True):
        self.enabled = enabled
        self.file = open(path, "a", buffering=1) if (path and enabled) else None

    def __call__(self, text: str = "", **record):
        if not self.enabled:
            return
        if text:
            tqdm.write(text)  # above an open progress bar, not through it
        if record and self.file:
            self.file.write(json.dumps(record) + "\n")

    def close(self):
        if self.file:
            self.file.close()


# --------------------------------------------------------------------------- non-finite loss
class LossWatch:
    """Every step's loss and gradient norm, checked for NaN / inf at the loop's host syncs.

    The loop fetches metrics only every --log-every steps, so each step's two scalars stay
    on the device until the next log point or checkpoint and are checked then: the error
    names the first bad step exactly, and no per-step host sync is added.

    fp32 / bf16: any non-finite loss or gradient norm is a FloatingPointError.
    fp16 (dynamic loss scale): a step whose gradients were not finite was skipped by
    `step.apply_gradients` and the scale shrank; it is counted (`skipped`), whatever its
    loss. A non-finite *loss* with finite gradients is a FloatingPointError here too:
    that update was applied (the scale skips only non-finite gradients), so it is never
    passed over silently. And a run that cannot recover stops: `skips_at_min` skipped
    steps in a row ending with the scale at its minimum (`min_scale`, where halving does
    nothing) is a FloatingPointError: the scale halved on every one of those skips down to
    its floor, where the gradients overflow unscaled. The run has diverged, and every
    further step would be skipped too.
    """

    def __init__(self, strategy, loss_scaled: bool, min_scale: float = 1.0,
                 skips_at_min: int = 10):
        self.strategy, self.loss_scaled = strategy, loss_scaled  # strategy: metrics_to_host
        self.min_scale, self.skips_at_min = min_scale, skips_at_min
        self.pending: list[tuple[int, dict]] = []
        self.skipped = 0  # fp16: steps the loss scale skipped so far in this process
        self.skipped_in_a_row = 0
        self.last_loss_finite = True  # the newest step checked: may its state be saved?

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, {k: metrics[k] for k in ("loss", "grad_norm") if k in metrics}))

    def check(self, last_checkpoint: str, scale: float | None = None) -> None:
        """Fetch and check the pending steps: raise, or count the skipped ones (fp16).
        `last_checkpoint` describes the run's fallback for the error; `scale` is the loss
        scale now (fp16; None: not read here, so the unrecoverable rule waits)."""
        pending, self.pending = self.pending, []
        for step, scalars in pending:
            m = self.strategy.metrics_to_host(scalars)
            loss, norm = m["loss"], m.get("grad_norm", 0.0)
            self.last_loss_finite = bool(np.isfinite(loss))
            if np.isfinite(loss) and np.isfinite(norm):
                self.skipped_in_a_row = 0
                continue
            if self.loss_scaled and not np.isfinite(norm):
                self.skipped += 1  # the loss scale skipped this step
                self.skipped_in_a_row += 1
                continue
            what = (f"non-finite loss ({loss}) at step {step}" if not np.isfinite(loss) else
                    f"non-finite gradient norm ({norm}, loss {loss:.4f}) at step {step}")
            if self.loss_scaled:  # only a non-finite loss gets here
                what += (f" with a finite gradient norm ({norm:g}), so the loss scale did not "
                         "skip its update")
            raise FloatingPointError(
                f"{what}; stopped without saving it. Last checkpoint: {last_checkpoint}")
        if (self.loss_scaled and scale is not None and scale <= self.min_scale
                and self.skipped_in_a_row >= self.skips_at_min):
            raise FloatingPointError(
                f"the run cannot recover: the last {self.skipped_in_a_row} steps (to step "
                f"{pending[-1][0]}) had non-finite gradients and were skipped, and the loss "
                f"scale has reached its minimum ({scale:g}); stopped without saving. Last "
                f"checkpoint: {last_checkpoint}")


# --------------------------------------------------------------------------- profiling
class Profiler:
    """A jax.profiler trace of steps first..last (as numbered in the log), if asked for."""

    def __init__(self, directory: str | None, step_range: tuple[int, int] | None, log: Logger):
        self.directory, self.log = directory, log
        self.first, self.last = step_range or (0, -1)
        self.started_at: int | None = None
        self.done = directory is None

    def before_step(self, step: int, state) -> None:
        if not self.done and self.started_at is None and self.first <= step <= self.last:
            jax.block_until_ready(state)  # keep the earlier steps out of the trace
            jax.profiler.start_trace(self.directory)
            self.started_at = step

    def after_step(self, step: int, state) -> None:
        if self.started_at is not None and step >= self.last:
            self.finish(step, state)

    def finish(self, step: int, state) -> None:
        """Stop the trace after `step` (the loop's end); say where it is."""
        if self.done:
            return
        self.done = True
        if self.started_at is None:
            self.log(f"--profile-steps {self.first}:{self.last}: no such step ran; no trace "
                     "written")
            return
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.log(f"profile of steps {self.started_at}-{step} in {self.directory} (TensorBoard's "
                 "profile plugin, or the trace.json.gz in ui.perfetto.dev)",
                 event="profile", first=self.started_at, last=step, dir=str(self.directory))
        log_memory(self.log, step)

    def close(self) -> None:
        """After an error: stop a trace still running."""
        if not self.done and self.started_at is not None:
            self.done = True
            jax.profiler.stop_trace()


# --------------------------------------------------------------------------- memory
def memory_figures() -> dict:
    """Device memory (where the backend reports it) and this process's peak host RSS."""
    figures: dict[str, Any] = {}
    stats = [d.memory_stats() for d in jax.local_devices()]
    if all(stats):
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            values = [s[key] for s in stats if key in s]
            if values:
                figures[f"device_{key}_max"] = max(values)  # the fullest device
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    figures["host_peak_rss_bytes"] = rss if sys.platform == "darwin" else rss * 1024  # KiB
    return figures


def log_memory(log: Logger, step: int) -> None:
    f = memory_figures()
    mib = lambda key: f"{f[key] / 2**20:,.1f} MiB"  # noqa: E731
    if "device_peak_bytes_in_use_max" in f:
        device = (f"device peak {mib('device_peak_bytes_in_use_max')} (fullest device"
                  + (f", limit {mib('device_bytes_limit_max')}"
                     if "device_bytes_limit_max" in f else "") + ")")
    else:
        device = f"device figures not reported by {jax.default_backend()}"
    log(f"memory after step {step}: {device}; host peak RSS {mib('host_peak_rss_bytes')}",
        event="memory", step=step, **f)


# --------------------------------------------------------------------------- progress
# The seconds JAX spends compiling (tracing, lowering, XLA's compile), summed over the
# process: one listener for the whole run of the interpreter (jax.monitoring's events).
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_seconds = [0.0]


def _on_duration(event: str, seconds: float, **_) -> None:
    if event in _COMPILE_EVENTS:
        _compile_seconds[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds() -> float:
    """The seconds this process has spent compiling so far (JAX's own events)."""
    return _compile_seconds[0]


@contextlib.contextmanager
def compiling(log, what: str, **record):
    """A line before a compile that takes time ("compiling the training step for ..."),
    and one with its time once it is done: the seconds JAX's compile events counted inside
    the block (yielded as `done["seconds"]`)."""
    log(f"compiling {what} ...", event="compiling", what=what, **record)
    done, start = {}, compile_seconds()
    yield done
    done["seconds"] = compile_seconds() - start
    log(f"compiled {what} in {done['seconds']:.1f} s", event="compiled", what=what,
        compile_s=done["seconds"], **record)


class Throughput:
    """Images per second of the training steps between two log points.

    Each figure is taken once the log point's step has finished (the caller blocks on its
    result first: `rate` is read then), over the wall-clock time since the previous
    figure, less the time spent `paused` (evaluation, checkpoints) and compiling (JAX's
    compile events: the first step's compile, a second variant's), so it is the rate the
    steps achieved. `first_step` says the first step's time and its compile apart;
    `compiled_before` is the seconds the same step spent compiling before the loop (in
    `--accum-steps auto`), which its compile figure counts too.
    """

    def __init__(self, images_per_step: int, step: int, compiled_before: float = 0.0):
        self.images_per_step, self.step = images_per_step, step
        self.compiled_before = compiled_before
        self.since, self.compiled = time.perf_counter(), compile_seconds()
        self.excluded = 0.0  # paused seconds since `since`
        self._pause: tuple[float, float] | None = None  # (start, compile seconds then)

    def _now(self) -> tuple[float, float]:
        return self._pause or (time.perf_counter(), compile_seconds())

    def first_step(self) -> tuple[float, float]:
        """(seconds, of which compiling) since the start: call once the first step has
        finished (the rate of its log point leaves the compiling out). The compile figure
        does not count `compiled_before`, which happened before the start."""
        now, compiled = self._now()
        return now - self.since - self.excluded, compiled - self.compiled

    @contextlib.contextmanager
    def paused(self, in_flight=None):
        """Leave the block's time out (an evaluation, a checkpoint). It starts once
        `in_flight` (the step the device runs) is done: that step's time still counts."""
        if in_flight is not None:
            jax.block_until_ready(in_flight)
        self._pause = start, compiled = time.perf_counter(), compile_seconds()
        try:
            yield
        finally:
            self._pause = None
            # A `rate` inside the block restarted the count at `start`.
            self.excluded += time.perf_counter() - max(start, self.since)
            self.compiled += compile_seconds() - max(compiled, self.compiled)

    def rate(self, step: int) -> float:
        """Images per second of the steps after the last figure up to `step`, which has
        finished; start counting anew."""
        now, compiled = self._now()
        seconds = now - self.since - self.excluded - (compiled - self.compiled)
        images = (step - self.step) * self.images_per_step
        self.step, self.since, self.compiled, self.excluded = step, now, compiled, 0.0
        return images / max(seconds, 1e-9)


class Heartbeat:
    """A line at least every `every_s` seconds of long work that shows no progress bar
    (evaluation; feature extraction under --no-progress): "final test: evaluating: 4,096
    of 10,000 images (41%), 62 s". Silent for work shorter than that, and without a `log`."""

    def __init__(self, log, what: str, total: int, unit: str, every_s: float = 60.0):
        self.log, self.what, self.total, self.unit = log, what, total, unit
        self.every_s = every_s
        self.start = self.last = time.monotonic()

    def update(self, done: int) -> None:
        """`done` of the total are done: a line if the last one is `every_s` old."""
        now = time.monotonic()
        if self.log is None or now - self.last < self.every_s:
            return
        self.last = now
        self.log(f"{self.what}: {done:,} of {self.total:,} {self.unit} "
                 f"({100 * done / max(self.total, 1):.0f}%), {now - self.start:.0f} s",
                 event="progress", what=self.what, done=done, total=self.total)


class NoBar:
    """The progress bar when there is none (--no-progress, or not the main process)."""
    disable = True  # as a closed tqdm bar: it shows nothing

    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, **values) -> None: ...
    def close(self) -> None: ...


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar on stderr, or a `NoBar` when disabled."""
    if not enabled:
        return NoBar()
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)
