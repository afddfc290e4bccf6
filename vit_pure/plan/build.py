r"""The communication plan read out of a compiled training step: what the step will cost on a
mesh you do not have.

    python train_shardmap.py --model vit-b16 --batch 4096 --dtype bf16 \
        --mesh data=64,model=4 --plan 256 --hardware h100

`build_plan` receives the step the script compiled for N devices (vit_pure/run/planning.py
builds and compiles it) and reads the plan out of the per-device program, not out of a
description of the model; what it reads, step by step, is in its docstring. This module
writes no collective and drives nothing: it reads.
"""
from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from vit_pure.model import init_params
from vit_pure.pipeline import schedules
from vit_pure.plan import interconnect as ic
from vit_pure.plan import nccl, targets
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
from vit_pure.xla import kernels
from vit_pure.xla.flops import train_flops_per_image  # the kit's one FLOP convention
from vit_pure.xla.hlo import dot_flops, parse_module


def compiler_options(platform: str) -> dict[str, str | bool]:
    """The options the plan's compile needs. XLA:CPU: its all-reduce combiner and its
    `cse_barrier_expander` off, so every array keeps its own collective and source line and
    remat's barriers survive (`build_plan` models XLA:GPU's combining instead). XLA:GPU:
    GEMMs to cuBLAS, since without a device to autotune on Triton's default tiles fail for
    some shapes ("Couldn't find output tile sizes")."""
    if platform == "gpu":
        return {"xla_gpu_enable_triton_gemm": False}
    return {"xla_disable_hlo_passes": f"{CPU_COMBINER},{CPU_BARRIER_EXPANDER}"}


# ------------------------------------------------------------------- building it
def strategy_platform(strategy) -> str:
    """The platform of the devices a strategy was built over ("gpu" for a deviceless
    target, "cpu" for fake CPU devices)."""
    mesh = getattr(strategy, "mesh", None)
    devices = mesh.devices.flat if mesh is not None else strategy.devices
    return next(iter(devices)).platform


def mesh_of(strategy) -> dict[str, int]:
    mesh = getattr(strategy, "mesh", None)
    return dict(mesh.shape) if mesh is not None else {"data": strategy.n_devices}


def params_per_device(strategy) -> int:
    """Parameter elements one device holds (its blocks of the sharded ones)."""
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), strategy.sc.cfg))
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


def build_plan(lowered, compiled, strategy, global_batch: int, hw: ic.Hardware, *,
               script: str, efficiency: float, compile_s: float = 0.0,
               notes: tuple[str, ...] = (), compiled_for: str = "",
               algorithm: str = nccl.AUTO) -> Plan:
    """The plan of `strategy.train_step` as `lowered` and `compiled` (with
    `compiler_options`) for the strategy's devices; `strategy` tells the layout (its mesh,
    parameter specs, step settings `sc` and pipeline). On GPU
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
       compile (`compiler_options`), so every array keeps its own collective and its
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
    gpu = strategy_platform(strategy) == "gpu"
    module = parse_module(compiled.as_text())
    mesh = mesh_of(strategy)
    devices = math.prod(mesh.values())
    found = read_collectives(module, mesh, hw.devices_per_node)
    classify_overlap(module, found)
    if gpu:  # XLA:GPU's own calls, each its own message
        calls, corrections = {id(c): c.count for c in found}, []
    else:
        calls, corrections = _as_xla_gpu_would(module, lowered, found)
    notes = _program_notes(module, notes, compiled_for)
    program_flops, gpu_program = dot_flops(module), None
    if gpu:  # cuBLAS calls carry their GEMMs (no dot op left in the program)
        gpu_program = _gpu_program(module, hw)
        program_flops += gpu_program["flops"]
    memory = _memory(compiled)
    return Plan(
        script=script, devices=devices, mesh=mesh, hardware=hw, efficiency=efficiency,
        global_batch=global_batch, per_device_batch=global_batch // mesh.get("data", 1),
        tokens_per_image=strategy.sc.cfg.seq_len, params_per_device=params_per_device(strategy),
        collectives=found, calls=calls, corrections=corrections, program_flops=program_flops,
        model_flops=model_flops_per_device(strategy.sc, global_batch, devices), memory=memory,
        compile_s=compile_s, notes=notes, compiled=compiled, platform="gpu" if gpu else "cpu",
        gpu_program=gpu_program, algorithm=algorithm, pipeline=pipeline_summary(strategy))


def _as_xla_gpu_would(module, lowered, found: list) -> tuple[dict[int, int], list[str]]:
    """(calls per collective, the corrections made) of XLA:CPU's program as XLA:GPU would
    run it: dtypes as JAX asked for them (the lowered StableHLO), XLA:GPU's combining
    modelled, and the collectives XLA:CPU merged that the target keeps appended to `found`."""
    asked = lowered_collectives(lowered.as_text(debug_info=True))
    corrections = correct_dtypes(found, asked)
    calls = model_calls(module, found)
    merged, merged_lines = correct_counts(found, asked)
    found += merged
    calls |= {id(c): c.count for c in merged}
    return calls, corrections + merged_lines


def _program_notes(module, notes: tuple[str, ...], compiled_for: str) -> list[str]:
    """The caller's notes, after what the program was compiled for, and a warning for
    while loops whose collectives are counted once (no known trip count)."""
    out = ([f"compiled for {compiled_for}"] if compiled_for else []) + list(notes)
    if module.unknown_trips:
        out.append(f"{module.unknown_trips} while loop(s) without a known trip count: "
                   "their collectives are counted once")
    return out


def _gpu_program(module, hw: ic.Hardware) -> dict:
    """XLA:GPU's kernels and their HBM traffic on `hw`, and the same program priced on
    each described GPU (what it would take on an H200)."""
    found_kernels = kernels.kernels(module)
    program = kernels.traffic(found_kernels, targets.memory_bandwidth(hw.name), hw.peak_flops,
                              kernels.RATES.get(hw.name, kernels.H100_RATES))
    program["predicted_s_on"] = {
        name: kernels.predicted_s(found_kernels, targets.memory_bandwidth(name),
                                  ic.HARDWARE[name].peak_flops, rates)
        for name, rates in kernels.RATES.items()}
    return program


def _memory(compiled) -> dict[str, int]:
    """XLA's memory analysis of the compiled step, in bytes per device."""
    m = compiled.memory_analysis()
    return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
            "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes}


def pipeline_summary(strategy) -> dict | None:
    """The strategy's pipeline schedule, read off its table (None without a pipeline)."""
    stages = getattr(strategy, "stages", 1)
    if stages <= 1:
        return None
    return schedules.summary(strategy.schedule, stages, strategy.microbatches,
                             strategy.virtual_stages)
