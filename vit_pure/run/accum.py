"""How the global batch is cut, and how many micro-batches per optimizer step
(`--accum-steps K|auto`).

Gradient accumulation itself is `step.accumulate` (a `lax.scan` over K micro-batches of
each device's slice, one all-reduce per step written by the script). This module decides K
(`--accum-steps auto`: the search, above `build_strategy`) and builds the script's strategy
with it: `build_strategy(rc, sc, make_strategy, optimizer, image_shape=..., log=...)`
returns the strategy and `sc` with the chosen K. The batch rules, each a one-line
`UsageError`, are checked before anything compiles: `per_device_batch` (the global batch
over the processes and data-parallel devices) and `check_accum_steps` (each slice into K).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from vit_pure.errors import UsageError
from vit_pure.run import distributed
from vit_pure.run.monitor import compiling
from vit_pure.run.settings import RunConfig
from vit_pure.step import StepConfig, step_input_shapes

# Use at most this fraction of the memory the device (or host) reports as available.
SAFETY = 0.8
# Skip a candidate K without compiling it when bytes(K) = a + b / K, fitted to the last two
# measured candidates, predicts more than this many times the budget.
SKIP_IF_PREDICTED_OVER = 1.1

GiB = 2.0 ** 30


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class Budget:
    """The memory one device may use for the training step, and where the figure came from."""
    bytes_per_device: float
    source: str


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """XLA's memory analysis of one compiled training step, per device."""
    accum_steps: int
    argument: int
    output: int
    alias: int
    temp: int

    @classmethod
    def of(cls, compiled, accum_steps: int = 1) -> "StepMemory":
        """XLA's memory analysis of a compiled program (`jitted.lower(...).compile()`)."""
        m = compiled.memory_analysis()
        return cls(accum_steps, m.argument_size_in_bytes, m.output_size_in_bytes,
                   m.alias_size_in_bytes, m.temp_size_in_bytes)

    @property
    def total(self) -> int:
        # Donated outputs reuse their argument's buffer (alias); the rest is live at once.
        return self.argument + self.output - self.alias + self.temp

    def __str__(self) -> str:
        return (f"K={self.accum_steps}: {_size(self.total)} per device (temp "
                f"{_size(self.temp)}, arguments {_size(self.argument)}, outputs "
                f"{_size(self.output)}, aliased {_size(self.alias)})")


# ----------------------------------------------------------------------------- budget
def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The host's available RAM (MemAvailable, which counts reclaimable caches)."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the figure is in kB
    raise OSError(f"no MemAvailable line in {meminfo}")


def device_budget(devices=None, safety: float = SAFETY, meminfo: str = "/proc/meminfo") -> Budget:
    """The memory a training step may use on each of `devices` (default: the local ones).

    Device memory is `memory_stats()["bytes_limit"]` less what is in use (GPU, TPU). The
    CPU backend reports none, so there it is the host's available RAM (MemAvailable),
    shared by all the local (fake) devices. `safety` (SAFETY) leaves room for what XLA's
    analysis does not see: the host's copy of the data, the runtime's buffers, the next
    batch in flight, fragmentation. On a machine shared with other jobs, `--memory-budget
    GIB` sets the budget instead (`resolve_budget`)."""
    devices = jax.local_devices() if devices is None else list(devices)
    limits = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" in stats:
            limits.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    if len(limits) == len(devices):
        return Budget(safety * min(limits),
                      f"{safety:.0%} of the smallest free device memory, {_size(min(limits))}")
    # CPU: every local (fake) device lives in the same host RAM.
    available = mem_available_bytes(meminfo)
    return Budget(safety * available / len(devices),
                  f"{safety:.0%} of the host's {_size(available)} available RAM, "
                  f"shared by {len(devices)} local devices")


def resolve_budget(memory_budget: float | None, budget: Budget | None = None) -> Budget:
    """`budget` if given, else `--memory-budget` (GiB for all local devices together, for a
    shared machine), else the measured `device_budget()`."""
    if budget is not None:
        return budget
    if memory_budget:
        n_local = len(jax.local_devices())
        return Budget(memory_budget * GiB / n_local,
                      f"--memory-budget {memory_budget:g} GiB over {n_local} local devices")
    return device_budget()


# --------------------------------------------------------------------------- measuring
def candidates(per_device_batch: int) -> list[int]:
    """The possible K: the divisors of the per-device batch, smallest first."""
    return [k for k in range(1, per_device_batch + 1) if per_device_batch % k == 0]


def train_step_inputs(strategy, sc, optimizer, global_batch: int,
                      image_shape: tuple[int, int, int]) -> tuple:
    """Zeros in place of the train step's inputs, placed exactly as `strategy` places the
    real ones (state, this process's rows of a global batch, the step key).

    `image_shape` (h, w, C) is the shape of the images the loop feeds: the dataset's
    (CIFAR-10's 32x32x3), not the model's input size; the step resizes them on the device
    (the 224-pixel presets), so the compiled program is the one the loop runs.

    Real placed arrays, not `ShapeDtypeStruct`s: with several processes a pmap'd step,
    even to be lowered, turns each process's local per-device arrays into global ones,
    which needs arrays (a stand-in without data fails inside jax). They take the bytes
    the real state will take; `free` them once the compiles are done.
    """
    *shapes, _key = step_input_shapes(sc, optimizer, global_batch, image_shape)
    state, *batch = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    # As in the loop: each process feeds its own rows of the global batch.
    return (strategy.put_state(state), *strategy.put_batch(*distributed.local_rows(*batch)),
            strategy.put_replicated(jax.random.key(0)))


def free(inputs) -> None:
    """Release the device buffers of `train_step_inputs`."""
    for x in jax.tree.leaves(inputs):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def step_memory(strategy, inputs, accum_steps: int) -> StepMemory:
    """Compile `strategy.train_step` for `inputs` and read XLA's per-device memory use."""
    return StepMemory.of(strategy.train_step.lower(*inputs).compile(), accum_steps)


# ------------------------------------------------------------------------- batch rules
def per_device_batch(global_batch: int, data_parallel: int, flag: str = "--batch") -> int:
    """Each data-parallel device's share of the global batch.

    UsageError unless the batch is positive and splits evenly over the processes (each
    loads an equal share of every batch) and over the `data_parallel` devices.
    """
    if global_batch <= 0:
        raise UsageError(f"{flag} must be positive, got {global_batch}")
    for n, what in ((jax.process_count(), "processes"), (data_parallel, "data-parallel devices")):
        if global_batch % n:
            lo = global_batch // n * n
            hint = f"{lo} or {lo + n}" if lo else f"{n}"
            raise UsageError(f"{flag} {global_batch} is not divisible by the {n} {what}; "
                             f"use a multiple of {n} (e.g. {hint})")
    return global_batch // data_parallel


def check_accum_steps(accum_steps: int, global_batch: int, data_parallel: int,
                      flag: str = "--batch") -> int:
    """The per-device batch (`per_device_batch`); UsageError unless it also divides into
    `accum_steps` micro-batches."""
    per_device = per_device_batch(global_batch, data_parallel, flag)
    if per_device % accum_steps:
        raise UsageError(
            f"--accum-steps {accum_steps} does not divide the per-device batch {per_device} "
            f"({flag} {global_batch} over {data_parallel} data-parallel devices); use one of "
            f"{', '.join(map(str, candidates(per_device)))}")
    return per_device


def _allows(strategy, global_batch: int, accum_steps: int) -> bool:
    """Whether `strategy` can run the global batch as `accum_steps` micro-batches."""
    try:
        strategy.check_batch(global_batch, accum_steps=accum_steps)
    except UsageError:
        return False
    return True


# ----------------------------------------------------------------------------- choosing


def _print(text: str, **_record):
    print(text, flush=True)


# `--accum-steps auto` (the default) takes the smallest K whose compiled training step fits
# in device memory by XLA's own estimate (`memory_analysis()`: arguments, outputs and
# temporaries per device), the divisors of the per-device batch tried in increasing order,
# each compile said in the log. Once two are measured the rest are predicted with bytes(K) =
# a + b / K and skipped while clearly over budget; the answer is always a compiled, measured
# K, and jit's cache hands that compile to the loop's first step. The budget: `device_budget`.
# With several processes each measures its own memory, and all take the largest K any chose.
def build_strategy(rc: RunConfig, sc: StepConfig, make_strategy: Callable, optimizer, *,
                   image_shape: tuple[int, int, int], log: Callable = _print,
                   budget: Budget | None = None):
    """(strategy, sc): the script's strategy, built with K micro-batches per step, and the
    StepConfig it was built with (`sc.accum_steps` = K).

    `make_strategy(sc, optimizer)` is the script's factory; K reaches it as
    `dataclasses.replace(sc, accum_steps=K)`: `--accum-steps K` as given, `auto` each
    candidate K in turn until one fits. The batch rules (`--batch` with K, `--eval-batch`
    without accumulation) are checked here, before anything compiles. `budget` overrides
    the measured device memory (tests pass a small one), as does `--memory-budget` (GiB
    for all local devices together: on a shared machine). `image_shape`: one training
    image as the loop will feed it (see `train_step_inputs`).
    """
    requested = rc.schedule.accum_steps
    k = 1 if requested == "auto" else requested
    strategy = make_strategy(dataclasses.replace(sc, accum_steps=k), optimizer)
    strategy.check_batch(rc.schedule.batch, accum_steps=k)
    strategy.check_batch(rc.data.eval_batch, "--eval-batch")
    if requested != "auto":
        return strategy, strategy.sc
    if sc.trainable == "head" and strategy.features_step is not None:
        # The probe (run/probe.py) never runs the training step: nothing to measure.
        log("--accum-steps auto: K=1; --trainable head trains the head on cached features "
            "and never runs the full training step, so its memory is not measured")
        return strategy, strategy.sc

    per_device = rc.schedule.batch // strategy.batch_divisor
    budget = resolve_budget(rc.schedule.memory_budget, budget)
    inputs = train_step_inputs(strategy, strategy.sc, optimizer, rc.schedule.batch, image_shape)
    measured: list[StepMemory] = []
    ks = [k for k in candidates(per_device) if _allows(strategy, rc.schedule.batch, k)]
    for k in ks:
        if k > 1:
            if (k != ks[-1] and len(measured) >= 2
                    and _predict(measured, k) > SKIP_IF_PREDICTED_OVER * budget.bytes_per_device):
                continue  # clearly too big: not worth a compile
            strategy = make_strategy(dataclasses.replace(sc, accum_steps=k), optimizer)
        what = (f"the training step for {sc.cfg.name}, global batch {rc.schedule.batch}, K={k} "
                f"micro-batches per device (--accum-steps auto measures its memory)")
        with compiling(log, what, accum_steps=k):
            mem = step_memory(strategy, inputs, k)
        measured.append(mem)
        if mem.total <= budget.bytes_per_device:
            break
    else:
        log(f"--accum-steps auto: even K={ks[-1]} (the most micro-batches the batch allows) "
            f"needs more than the budget; running with it anyway (try --remat block)")
    free(inputs)
    # With several processes, each measured its own memory, but all must run the same
    # program: they take the largest K any of them chose (an all-gather of one number).
    agreed = distributed.agree_max(k)
    if agreed != k:
        log(f"--accum-steps auto: this process chose K={k}, another needs K={agreed}; "
            f"using K={agreed}")
        k = agreed
        strategy = make_strategy(dataclasses.replace(sc, accum_steps=k), optimizer)
    _log_choice(log, k, per_device, measured, budget)
    return strategy, strategy.sc


def _log_choice(log: Callable, k: int, per_device: int, measured: list[StepMemory],
                budget: Budget) -> None:
    n_local = len(jax.local_devices())
    log(f"--accum-steps auto: K={k} micro-batches of {per_device // k} per device per step; "
        f"XLA's estimate {measured[-1]}, x {n_local} local devices = "
        f"{_size(n_local * measured[-1].total)}; budget {_size(budget.bytes_per_device)} per "
        f"device ({budget.source}); compiled: "
        f"{', '.join(f'K={m.accum_steps} {_size(m.total)}' for m in measured)}",
        event="accum_steps", accum_steps=k, estimate_bytes_per_device=measured[-1].total,
        budget_bytes_per_device=budget.bytes_per_device,
        compiled=[m.accum_steps for m in measured],
        compiled_bytes_per_device=[m.total for m in measured])


def _predict(measured: list[StepMemory], k: int) -> float:
    """bytes(k) from the line a + b / K through the last two measurements."""
    m1, m2 = measured[-2], measured[-1]
    x1, x2 = 1 / m1.accum_steps, 1 / m2.accum_steps
    b = (m1.total - m2.total) / (x1 - x2)
    a = m2.total - b * x2
    return a + b / k

