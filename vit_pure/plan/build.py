"""The communication plan: what a training step will cost on a mesh you do not have.

    python train_shardmap.py --model vit-b16 --batch 4096 --dtype bf16 \
        --mesh data=64,model=4 --plan 256 --hardware h100
    python train_pmap.py --model vit-b16 --batch 4096 --dtype bf16 --plan 64 --plan-json p.json

`--plan N` compiles the script's own training step for N fake CPU devices (one SPMD
program: its size barely depends on N) and trains nothing. It reads the plan out of the
compiled per-device program, not out of a description of the model; what it reads, step
by step (collectives, bytes and counts as the target moves them, time per mesh axis,
compute, memory, the step and its verdict), is in `build_plan`'s docstring.

This module writes no collective: it compiles the scripts' steps and reads them.
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
from vit_pure.model import init_params
from vit_pure.pipeline import schedules
from vit_pure.plan import fabrics, nccl, targets
from vit_pure.plan import interconnect as ic
from vit_pure.plan.collectives import (
    CPU_BARRIER_EXPANDER,
    CPU_COMBINER,
    correct_counts,
    correct_dtypes,
    lowered_collectives,
    model_calls,
    read_collectives,
)
from vit_pure.plan.overlap import classify_overlap
from vit_pure.plan.report import Plan
from vit_pure.run import cli
from vit_pure.run.accum import StepMemory
from vit_pure.run.monitor import compiling
from vit_pure.run.settings import PlanConfig
from vit_pure.xla import kernels
from vit_pure.xla.flops import train_flops_per_image  # the kit's one FLOP convention
from vit_pure.xla.hlo import dot_flops, parse_module

# The images the training loop feeds: CIFAR-10's (vit_pure/data/cifar10.py), whatever the model's
# input size; the step resizes them on the device (the 224-pixel presets).
DATASET_IMAGE_SHAPE = (32, 32, 3)


# ------------------------------------------------------------------------------ target
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


# ------------------------------------------------------------------- building it
def abstract_inputs(strategy, sc, optimizer, global_batch: int) -> tuple:
    """ShapeDtypeStructs for the train step's inputs, laid out as the strategy places
    them (shard_map: NamedShardings over its mesh; pmap: a leading device axis)."""

    shapes, *batch, key = step.step_input_shapes(sc, optimizer, global_batch,
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


def strategy_platform(strategy) -> str:
    """The platform of the devices a strategy was built over ("gpu" for a deviceless
    target, "cpu" for fake CPU devices)."""
    mesh = getattr(strategy, "mesh", None)
    devices = mesh.devices.flat if mesh is not None else strategy.devices
    return next(iter(devices)).platform


def mesh_of(strategy) -> dict[str, int]:
    mesh = getattr(strategy, "mesh", None)
    return dict(mesh.shape) if mesh is not None else {"data": strategy.n_devices}


def params_per_device(strategy, sc) -> int:
    """Parameter elements one device holds (its blocks of the sharded ones)."""
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), sc.cfg))
    specs = getattr(strategy, "param_specs", None)
    if specs is None:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    mesh = mesh_of(strategy)

    def local(spec, x):
        axes = [a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))]
        split = math.prod(mesh[a] for a in axes)
        return math.prod(x.shape) // split
    return sum(jax.tree.leaves(jax.tree.map(local, specs, shapes,
                                            is_leaf=lambda x: isinstance(x, P))))


def model_flops_per_device(sc, global_batch: int, devices: int) -> float:
    """bench.py's count (matmuls, training = 3 x forward) for this device's share, of the
    program `sc` runs (its `execution`: the last block on the class token or not)."""
    return train_flops_per_image(sc.cfg, sc.execution) * global_batch / devices


def build_plan(strategy, sc, optimizer, global_batch: int, hw: ic.Hardware, *,
               script: str, efficiency: float = cli.DEFAULT_EFFICIENCY,
               notes: tuple[str, ...] = (), compiled_for: str = "",
               algorithm: str = nccl.AUTO) -> Plan:
    """Compile `strategy.train_step` for its devices and read the plan out of it. On GPU
    devices (a deviceless target) the program is XLA:GPU's as it would run: its collectives
    async and combined, their dtypes as asked; on CPU devices XLA:CPU's combiner is off and
    XLA:GPU's combining and dtypes are modelled. What the plan reads out of the
    compiled per-device program:

    1. Every collective the program runs (`read_collectives`): kind; mesh axes (its replica
       groups, which name mesh positions, mapped through the mesh's shape); dtype; bytes per
       device per execution (V, see vit_pure/plan/interconnect.py); executions per optimizer step
       (the product of the `known_trip_count`s of the while loops around it: `--scan`,
       `--accum-steps`); and the kit's file:line that wrote it (the op's metadata points into
       the stack-frame table at the top of the HLO text; the innermost frame in the kit).
    2. Bytes and counts as the target moves them. The step is built with the target's
       defaults (`hardware.resolve` for the target's platform: on a GPU the matmuls return
       bf16). Three XLA:CPU habits are undone. Its all-reduce combiner is switched off for the
       compile (`cpu-all-reduce-combiner`), so every array keeps its own collective and its
       source line; XLA:GPU's combining (30 MiB buckets of independent collectives, XLA's
       kDefaultAllReduceCombineThreshold) is then modelled: a bucket is one call, priced at
       its size. Its `cse_barrier_expander` is switched off too, so remat's barriers survive
       and the program recomputes (FSDP's re-gathers included) as XLA:GPU's does. And XLA:CPU
       upcasts bf16 all-reduces to f32: where the lowered StableHLO (what JAX asked for) has
       another dtype than the compiled op at the same source line and size, the lowered dtype
       counts; where it has more ops at one line and size, the missing ones count. The
       report lists each correction.
    3. Time per mesh axis: each collective priced by its slowest group, as NCCL runs it
       (vit_pure/plan/nccl.py: ring, tree, NVLS, NVLS-tree, the fastest or the one --algo
       forces) over the target's links (interconnect.py) and fabric (fabrics.py); each
       collective marked critical-path or overlappable from the program's data flow
       (vit_pure/plan/overlap.py).
    4. Compute: the matmul FLOPs of the per-device program, counted from its dot ops with loop
       trip counts, over peak x efficiency. Not `cost_analysis()`: XLA counts a while loop's
       body once (wrong under --scan / accumulation) and adds elementwise work, and on GPU it
       misses gemm fusions. Counting the compiled program keeps what only it knows: the
       pipeline's idle ticks, the embedding and head every tensor-parallel rank repeats.
    5. Memory per device: XLA's memory analysis of the compiled step (arguments + outputs -
       aliased + temporaries). Of the CPU compile: XLA:GPU's buffer assignment differs.
    6. The step with no overlap (compute + communication) and its floor with overlap by
       dependency (compute + critical-path collectives, the overlappable ones hidden up to the
       compute: critical + max(compute, overlappable)), MFU for both (model FLOPs, bench.py's
       count, over step x peak), at the given efficiency and at the measured one where the
       hardware table has one; and a verdict with the rule that gave it.
    """
    t0 = time.perf_counter()
    gpu = strategy_platform(strategy) == "gpu"
    with compiling(_print, f"the training step for {sc.cfg.name}, global batch {global_batch}, "
                           f"on {math.prod(mesh_of(strategy).values())} {'GPU' if gpu else 'CPU'} "
                           f"devices"):
        lowered = strategy.train_step.lower(*abstract_inputs(strategy, sc, optimizer,
                                                             global_batch))
        # GPU: GEMMs to cuBLAS, since without a device to autotune on Triton's default
        # tiles fail for some shapes ("Couldn't find output tile sizes").
        compiled = lowered.compile(
            compiler_options={"xla_gpu_enable_triton_gemm": False} if gpu
            else {"xla_disable_hlo_passes": f"{CPU_COMBINER},{CPU_BARRIER_EXPANDER}"})
    compile_s = time.perf_counter() - t0
    module = parse_module(compiled.as_text())
    mesh = mesh_of(strategy)
    devices = math.prod(mesh.values())
    found = read_collectives(module, mesh, hw.devices_per_node)
    classify_overlap(module, found)
    if gpu:  # XLA:GPU's own calls, each its own message
        calls, corrections = {id(c): c.count for c in found}, []
    else:
        asked = lowered_collectives(lowered.as_text(debug_info=True))
        corrections = correct_dtypes(found, asked)
        calls = model_calls(module, found)
        merged, merged_lines = correct_counts(found, asked)
        found += merged
        calls |= {id(c): c.count for c in merged}
        corrections += merged_lines
    notes = ([f"compiled for {compiled_for}"] if compiled_for else []) + list(notes)
    if module.unknown_trips:
        notes.append(f"{module.unknown_trips} while loop(s) without a known trip count: "
                     "their collectives are counted once")
    program_flops, gpu_program = dot_flops(module), None
    if gpu:  # cuBLAS calls carry their GEMMs (no dot op left in the program)
        found_kernels = kernels.kernels(module)
        gpu_program = kernels.traffic(found_kernels, targets.memory_bandwidth(hw.name),
                                      hw.peak_flops,
                                      kernels.RATES.get(hw.name, kernels.H100_RATES))
        # The same program priced on each described GPU (what it would take on an H200).
        gpu_program["predicted_s_on"] = {
            name: kernels.predicted_s(found_kernels, targets.memory_bandwidth(name),
                                      ic.HARDWARE[name].peak_flops, rates)
            for name, rates in kernels.RATES.items()}
        program_flops += gpu_program["flops"]
    m = StepMemory.of(compiled)
    memory = {"argument": m.argument, "output": m.output, "alias": m.alias, "temp": m.temp}
    per_device_batch = global_batch // mesh.get("data", 1)
    return Plan(script, devices, mesh, hw, efficiency, global_batch, per_device_batch,
                sc.cfg.seq_len, params_per_device(strategy, sc), found,
                calls, corrections, program_flops,
                model_flops_per_device(strategy.sc, global_batch, devices),
                memory, compile_s, notes,
                compiled, platform="gpu" if gpu else "cpu", gpu_program=gpu_program,
                algorithm=algorithm, pipeline=pipeline_summary(strategy))


def pipeline_summary(strategy) -> dict | None:
    """The strategy's pipeline schedule, read off its table (None without a pipeline)."""
    stages = getattr(strategy, "stages", 1)
    if stages <= 1:
        return None
    return schedules.summary(strategy.schedule, stages, strategy.microbatches,
                             strategy.virtual_stages)


def run(pc: PlanConfig, step_config, make_strategy, script: str) -> dict:
    """`--plan N` for a training script: fake CPU devices, the step built with the
    target's defaults, compiled, planned, printed (and written to --plan-json).
    `pc` is the plan's frozen settings (run/settings.py); `step_config(platform,
    device)` the step's settings for the target (backend.step_config of the flags, bound
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
    plan = build_plan(strategy, sc, optimizer, pc.batch, hw, script=script,
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
