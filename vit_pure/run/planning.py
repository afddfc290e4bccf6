"""`--plan N` for a training script: the target's devices (deviceless GPUs or fake CPUs),
the script's step built with the target's defaults and compiled for them, and the plan
that vit_pure/plan/build.py reads out of the compiled program, printed (and written to
--plan-json). Nothing is trained.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time

import jax
from jax._src import xla_bridge  # no public "have the backends started?"
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vit_pure import quiet, step
from vit_pure.plan import build, fabrics, nccl, targets
from vit_pure.plan import interconnect as ic
from vit_pure.plan.report import Plan
from vit_pure.run import cli
from vit_pure.run.monitor import compiling
from vit_pure.run.settings import PlanConfig

# The images the training loop feeds: CIFAR-10's (vit_pure/data/cifar10.py), whatever the model's
# input size; the step resizes them on the device (the 224-pixel presets).
DATASET_IMAGE_SHAPE = (32, 32, 3)


def target_hardware(pc: PlanConfig) -> ic.Hardware:
    """The --hardware entry with the flags' overrides; UsageError for bad values."""
    name = pc.hardware.strip().lower()
    if name not in ic.HARDWARE:
        raise cli.UsageError(f"--hardware {pc.hardware!r}: unknown; choose one of "
                             f"{', '.join(ic.HARDWARE)}")
    for flag in ("plan", "gpus_per_node"):
        value = getattr(pc, flag)
        if value is not None and value < 1:
            raise cli.UsageError(f"{cli.flag_name(flag)} must be >= 1, got {value}")
    for flag in ("peak_tflops", "intra_gbps", "inter_gbps"):
        value = getattr(pc, flag)
        if value is not None and not value > 0:
            raise cli.UsageError(f"{cli.flag_name(flag)} must be positive, got {value}")
    if pc.latency_us is not None and pc.latency_us < 0:
        raise cli.UsageError(f"--latency-us must be >= 0, got {pc.latency_us}")
    if not 0 < pc.efficiency <= 1:
        raise cli.UsageError(f"--efficiency must be in (0, 1], got {pc.efficiency}")
    if pc.fabric is not None and pc.fabric not in fabrics.FABRICS:
        raise cli.UsageError(f"--fabric {pc.fabric!r}: unknown; choose one of "
                             f"{', '.join(fabrics.FABRICS)}")
    if pc.fabric is not None and ic.HARDWARE[name].platform != "gpu":
        raise cli.UsageError(f"--fabric: {name} is not a GPU; its network is the table's")
    return ic.with_overrides(ic.HARDWARE[name], peak_tflops=pc.peak_tflops,
                             intra_gbps=pc.intra_gbps, inter_gbps=pc.inter_gbps,
                             devices_per_node=pc.gpus_per_node, latency_us=pc.latency_us,
                             fabric=pc.fabric)



def abstract_inputs(strategy, optimizer, global_batch: int) -> tuple:
    """ShapeDtypeStructs for the train step's inputs, laid out as the strategy places
    them (shard_map: NamedShardings over its mesh; pmap: a leading device axis)."""
    shapes, *batch, key = step.step_input_shapes(strategy.sc, optimizer, global_batch,
                                                 DATASET_IMAGE_SHAPE)
    batch = [(x.shape, x.dtype) for x in batch]
    mesh = getattr(strategy, "mesh", None)
    if mesh is not None:
        def place(spec, tree):
            sharding = NamedSharding(mesh, spec)
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=sharding), tree)
        state = jax.tree.map(place, strategy.state_specs, shapes,
                             is_leaf=lambda x: isinstance(x, P))
        data = NamedSharding(mesh, P("data"))
        return (state, *(jax.ShapeDtypeStruct(s, d, sharding=data) for s, d in batch),
                jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P())))
    n = strategy.n_devices
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), shapes)
    return (state, *(jax.ShapeDtypeStruct((n, s[0] // n, *s[1:]), d) for s, d in batch),
            jax.ShapeDtypeStruct(key.shape, key.dtype))


def plan_step(strategy, optimizer, global_batch: int, hw: ic.Hardware, *, script: str,
              efficiency: float = cli.DEFAULT_EFFICIENCY, **plan_notes) -> Plan:
    """Lower and compile `strategy.train_step` for its devices (with the plan's compiler
    options) and read the plan out of it (`build.build_plan`; `plan_notes`: its notes,
    compiled_for and algorithm)."""
    t0 = time.perf_counter()
    platform = build.strategy_platform(strategy)
    devices = math.prod(build.mesh_of(strategy).values())
    with compiling(_print, f"the training step for {strategy.sc.cfg.name}, global batch "
                           f"{global_batch}, on {devices} {platform.upper()} devices"):
        lowered = strategy.train_step.lower(*abstract_inputs(strategy, optimizer, global_batch))
        compiled = lowered.compile(compiler_options=build.compiler_options(platform))
    return build.build_plan(lowered, compiled, strategy, global_batch, hw, script=script,
                            efficiency=efficiency, compile_s=time.perf_counter() - t0,
                            **plan_notes)


def run(pc: PlanConfig, step_config, make_strategy, script: str) -> dict:
    """`--plan N` for a training script: fake CPU devices, the step built with the
    target's defaults, compiled, planned, printed (and written to --plan-json).
    `pc` is the plan's frozen settings (settings.py); `step_config(platform,
    device)` the step's settings for the target (settings.step_config of the flags, bound
    at the entry); `make_strategy(sc, optimizer, devices)` the script's strategy factory."""
    hw = target_hardware(pc)
    n = pc.plan
    if pc.multi_process:
        raise cli.UsageError("--plan compiles on this machine alone: drop the multi-process flags")
    # The GPU's own compiler where the kit has the GPU's description and JAX's CUDA plugin
    # is installed (deviceless: no GPU needed); else XLA:CPU on fake CPU devices.
    target = targets.gpu_target(hw.name) if hw.platform == "gpu" else None
    if target is not None:
        with quiet.filtered():  # the plugin's start-up lines where no GPU is (quiet.py)
            devices = targets.gpu_devices(target, n, hw.devices_per_node)
        compiled_for = (f"{hw.name}: XLA:GPU for {devices[0].device_kind}, deviceless "
                        f"(vit_pure/plan/targets/{targets.GPU_TARGETS[hw.name]})")
    else:
        devices = _fake_devices(n)
        why = ("" if hw.platform != "gpu" else
               "; for the GPU's own program: pip install -r requirements-gpu.txt"
               if hw.name in targets.GPU_TARGETS else f"; the kit has no {hw.name} description")
        compiled_for = f"XLA:CPU on {n} fake CPU devices{why}"
    sc = step_config(platform=hw.platform, device=devices[0])
    notes = [f"target defaults ({hw.platform}): " + "; ".join(sc.notes)] if sc.notes else []
    k = pc.accum_steps
    if k == "auto":
        k = 1
        notes.append("--accum-steps auto is decided on the device; planned with 1 (give "
                     "--accum-steps K to plan another)")
    sc = dataclasses.replace(sc, accum_steps=k)
    optimizer, _ = step.make_optimizer(pc.optim, 1000)
    strategy = make_strategy(sc, optimizer, devices)
    strategy.check_batch(pc.batch, accum_steps=k)
    stages = getattr(strategy, "stages", 1)
    if stages > 1 and strategy.microbatches < stages:  # most of the pipeline's ticks idle
        notes.append(f"warning: --microbatches {strategy.microbatches} is fewer than the "
                     f"{stages} pipeline stages; give --microbatches {stages} or more")
    notes.append(f"policy {sc.policy}, layers {'scanned' if sc.execution.scan else 'unrolled'}, "
                 f"remat {sc.execution.remat}, accumulation {k}")
    plan = plan_step(strategy, optimizer, pc.batch, hw, script=script,
                     efficiency=pc.efficiency, notes=tuple(notes), compiled_for=compiled_for,
                     algorithm=pc.algo or nccl.AUTO)
    print(plan.report(), flush=True)
    record = plan.record()
    if pc.plan_json:
        with open(pc.plan_json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def _print(text: str, **_record) -> None:
    print(text, flush=True)


def _fake_devices(n: int) -> list:
    """n CPU devices: fake ones, asked for before JAX starts its backends. A process that
    has already started them (a test session) must have at least n."""
    if not xla_bridge.backends_are_initialized():
        cli.use_cpu_devices(n)
        jax.config.update("jax_platforms", "cpu")
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise cli.UsageError(f"--plan {n}: this process already runs JAX with {len(cpus)} "
                             "CPU devices; run the plan in a fresh process")
    return cpus[:n]
