"""How many micro-batches per optimizer step: `--accum-steps K|auto`.

Gradient accumulation itself is a dozen lines in `step.local_grads` (a `lax.scan` over K
micro-batches of each device's slice, the gradients summed, one all-reduce per step
written by the script). This module decides K and builds the script's strategy with it:

    strategy = build_strategy(args, make_strategy, optimizer, log=log)

* `--accum-steps K`: K must divide the per-device batch (global batch / data-parallel
  degree); anything else is a one-line UsageError before anything compiles.
* `--accum-steps auto` (the default): the smallest K whose compiled training step fits in
  device memory. The estimate is XLA's own: `train_step.lower(...).compile()
  .memory_analysis()` gives, per device, the bytes of the step's arguments (state and
  batch), outputs and temporaries (activations, gradients, optimizer scratch). Candidate
  K are the divisors of the per-device batch, tried in increasing order; the first that
  fits wins. Compiling is not free (tens of seconds per candidate for vit-cifar on a
  2-core CPU), so once two candidates are measured the rest are predicted with
  bytes(K) = a + b / K (the activations shrink with the micro-batch, the rest does not)
  and skipped while the prediction is clearly over budget; the answer is always a
  compiled, measured K, and that compilation is not wasted: jit caches it, and the
  loop's first step reuses it.

Device memory: `device.memory_stats()["bytes_limit"]` (GPU, TPU). The CPU backend reports
none, so there the budget is the host's available RAM (/proc/meminfo MemAvailable),
shared by all the local (fake) devices: each one's estimate is multiplied by their count.
A safety margin (`SAFETY`) leaves room for what XLA's analysis does not see: the host's
copy of the data, the runtime's own buffers, the next batch in flight, fragmentation.
On a machine shared with other jobs, `--memory-budget GIB` sets the budget instead. With
several processes each measures its own memory, and all take the largest K any chose.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from vit_pure import data as data_lib
from vit_pure import distributed
from vit_pure.cli import UsageError
from vit_pure.step import init_state

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
    """The memory a training step may use on each of `devices` (default: the local ones)."""
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


def resolve_budget(args, budget: Budget | None = None) -> Budget:
    """`budget` if given, else `--memory-budget` (GiB for all local devices together, for a
    shared machine), else the measured `device_budget()`."""
    if budget is not None:
        return budget
    if getattr(args, "memory_budget", None):
        n_local = len(jax.local_devices())
        return Budget(args.memory_budget * GiB / n_local,
                      f"--memory-budget {args.memory_budget:g} GiB over {n_local} local devices")
    return device_budget()


# --------------------------------------------------------------------------- measuring
def candidates(per_device_batch: int) -> list[int]:
    """The possible K: the divisors of the per-device batch, smallest first."""
    return [k for k in range(1, per_device_batch + 1) if per_device_batch % k == 0]


def train_step_inputs(strategy, args, optimizer) -> tuple:
    """Stand-ins for the train step's inputs, laid out as `strategy` lays out the real ones.

    Only shapes, dtypes and shardings matter to the compiler, so the strategy places
    zeros (the same bytes the real state will take, freed again on return) and this
    returns their `ShapeDtypeStruct`s.
    """
    shapes = jax.eval_shape(
        lambda: init_state(jax.random.key(0), args.cfg, args.policy_obj, optimizer))
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    size = args.cfg.image_size
    batch = (np.zeros((args.batch, size, size, args.cfg.channels), np.uint8),
             np.zeros((args.batch,), np.int32), np.zeros((args.batch,), np.int32))
    # As in the loop: each process feeds its own rows of the global batch.
    placed = (strategy.put_state(zeros), *strategy.put_batch(*distributed.local_rows(*batch)),
              strategy.put_replicated(jax.random.key(0)))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        placed)


def step_memory(strategy, inputs, accum_steps: int) -> StepMemory:
    """Compile `strategy.train_step` for `inputs` and read XLA's per-device memory use."""
    m = strategy.train_step.lower(*inputs).compile().memory_analysis()
    return StepMemory(accum_steps, m.argument_size_in_bytes, m.output_size_in_bytes,
                      m.alias_size_in_bytes, m.temp_size_in_bytes)


# ----------------------------------------------------------------------------- choosing
def check_accum_steps(accum_steps: int, global_batch: int, data_parallel: int) -> int:
    """The per-device batch; UsageError unless it divides into `accum_steps` micro-batches."""
    data_lib.check_batch(global_batch, data_parallel)
    per_device = global_batch // data_parallel
    if per_device % accum_steps:
        raise UsageError(
            f"--accum-steps {accum_steps} does not divide the per-device batch {per_device} "
            f"(--batch {global_batch} over {data_parallel} data-parallel devices); use one of "
            f"{', '.join(map(str, candidates(per_device)))}")
    return per_device


def _print(text: str, **_record):
    print(text, flush=True)


def build_strategy(args, make_strategy: Callable, optimizer, *, log: Callable = _print,
                   budget: Budget | None = None):
    """The script's strategy, built with `args.accum_steps` micro-batches per step.

    `make_strategy(optimizer)` is the script's factory; it reads the step's settings from
    `args` (`StepConfig.from_args`), so for `--accum-steps auto` each candidate K is
    written into `args.accum_steps` before building, and the chosen K stays there.
    `budget` overrides the measured device memory (tests pass a small one), as does
    `--memory-budget` (GiB for all local devices together: on a shared machine).
    """
    requested = args.accum_steps
    if requested != "auto":
        strategy = make_strategy(optimizer)
        check_accum_steps(requested, args.batch, strategy.batch_divisor)
        return strategy

    args.accum_steps = 1
    strategy = make_strategy(optimizer)
    per_device = check_accum_steps(1, args.batch, strategy.batch_divisor)
    budget = resolve_budget(args, budget)
    inputs = train_step_inputs(strategy, args, optimizer)
    measured: list[StepMemory] = []
    ks = candidates(per_device)
    for k in ks:
        if k > 1:
            if (k != ks[-1] and len(measured) >= 2
                    and _predict(measured, k) > SKIP_IF_PREDICTED_OVER * budget.bytes_per_device):
                continue  # clearly too big: not worth a compile
            args.accum_steps = k
            strategy = make_strategy(optimizer)
        mem = step_memory(strategy, inputs, k)
        measured.append(mem)
        if mem.total <= budget.bytes_per_device:
            break
    else:
        log(f"--accum-steps auto: even K={per_device} (one example per micro-batch) needs "
            f"more than the budget; running with it anyway (try --remat block)")
    # With several processes, each measured its own memory, but all must run the same
    # program: they take the largest K any of them chose (an all-gather of one number).
    agreed = distributed.agree_max(args.accum_steps)
    if agreed != args.accum_steps:
        log(f"--accum-steps auto: this process chose K={args.accum_steps}, another needs "
            f"K={agreed}; using K={agreed}")
        args.accum_steps = agreed
        strategy = make_strategy(optimizer)
    n_local = len(jax.local_devices())
    log(f"--accum-steps auto: K={args.accum_steps} micro-batches of "
        f"{per_device // args.accum_steps} per device per step; XLA's estimate {measured[-1]}, "
        f"x {n_local} local devices = {_size(n_local * measured[-1].total)}; budget "
        f"{_size(budget.bytes_per_device)} per device ({budget.source}); compiled: "
        f"{', '.join(f'K={m.accum_steps} {_size(m.total)}' for m in measured)}",
        event="accum_steps", accum_steps=args.accum_steps,
        estimate_bytes_per_device=measured[-1].total,
        budget_bytes_per_device=budget.bytes_per_device,
        compiled=[m.accum_steps for m in measured],
        compiled_bytes_per_device=[m.total for m in measured])
    return strategy


def _predict(measured: list[StepMemory], k: int) -> float:
    """bytes(k) from the line a + b / K through the last two measurements."""
    m1, m2 = measured[-2], measured[-1]
    x1, x2 = 1 / m1.accum_steps, 1 / m2.accum_steps
    b = (m1.total - m2.total) / (x1 - x2)
    a = m2.total - b * x2
    return a + b / k

