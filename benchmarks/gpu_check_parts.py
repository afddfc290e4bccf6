"""The parts of benchmarks/gpu_check.py that run in a child process of their own (they
start JAX): the environment, the profile, the GEMM shapes and the program. Each returns a
JSON-ready dict.

The profile and the GEMM shapes are what the predictor is fitted to (benchmarks/fit_step.py
--profile): the shipped step's device time per kernel of its own program, and each of its
distinct GEMMs timed alone at its shape, layout and dtypes. A dry run takes the tiny model
on this CPU's XLA, so the code runs everywhere; its figures mean nothing.
"""
from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import harness
from vit_pure.plan import targets

PROFILE_STEPS = 3
PIPELINED_STEPS = 10  # the timed run of the profile part
STEP_TEXT = "step.hlo.txt"  # the profiled step's program, as compiled here


def env(out: pathlib.Path, dry: bool) -> dict:
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", str(device))
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return {"status": "ok", "jax": jax.__version__, "python": platform.python_version(),
            "torch": torch_version, "platform": device.platform, "device": kind,
            "compute_capability": getattr(device, "compute_capability", None),
            "memory_limit": (stats or {}).get("bytes_limit"),
            "descriptions": {n: targets.device_description(n) for n in targets.GPU_TARGETS},
            "hardware": targets.target_for_device(kind)}


def _hardware(out: pathlib.Path) -> str:
    """The --hardware that describes the GPU at hand (the env part's finding), else h100."""
    import json
    found = out / "env.json"
    name = json.loads(found.read_text()).get("hardware") if found.exists() else None
    return name or "h100"


def _job(dry: bool) -> dict:
    """The shipped headline step (a dry run: the tiny model, batch 16)."""
    return {"model": "tiny" if dry else "vit-cifar", "batch": 16 if dry else 4096,
            "dtype": "bf16", "precision": "default", "kit_flags": [], "warmup": 2}


def profile(out: pathlib.Path, dry: bool) -> dict:
    """The shipped step compiled, timed and traced (PROFILE_STEPS steps, jax.profiler);
    each kernel of its program with its device time per step: the trace joined to the
    program (benchmarks.profile_breakdown.kernel_times), in DIR/kernel_times.json.

    The step time is pipelined, as the training loop runs it: PIPELINED_STEPS steps
    dispatched back to back on inputs staged on the device beforehand, their wall time
    over their number (median of 3); the profile's own (one execution's start to the
    next's) beside it."""
    import json

    from benchmarks import bench, profile_breakdown
    from benchmarks.peers import kit as kit_child
    from vit_pure import step
    from vit_pure.xla import hlo, kernels
    job = _job(dry)
    sc, optimizer, strategy = kit_child.build_kit(job)
    state = strategy.put_state(step.init_state(jax.random.key(0), sc.cfg, sc.policy, optimizer))
    inputs = bench.step_inputs(strategy, job["batch"])
    staged = [inputs(i) for i in range(PIPELINED_STEPS)]
    jax.block_until_ready(staged)
    compiled = strategy.train_step.lower(state, *staged[0]).compile()
    text = compiled.as_text()
    (out / STEP_TEXT).write_text(text)

    def steps(n):
        nonlocal state
        for i in range(n):
            state, metrics = compiled(state, *staged[i % len(staged)])
        return metrics

    jax.block_until_ready(steps(job["warmup"]))
    step_s = harness.median_seconds(lambda: steps(PIPELINED_STEPS), jax.block_until_ready,
                                    runs=3, warmup=0) / PIPELINED_STEPS
    trace_dir = out / "trace"
    jax.block_until_ready(state)
    jax.profiler.start_trace(str(trace_dir))
    metrics = steps(PROFILE_STEPS)
    jax.block_until_ready((state, metrics))
    jax.profiler.stop_trace()
    events, source = profile_breakdown.device_events(
        profile_breakdown.load_events(profile_breakdown.find_traces(str(trace_dir))))
    module = hlo.parse_module(text)
    found = kernels.kernels(module, lambda comp: hlo.computation_dot_flops(module, comp))
    hardware = _hardware(out)
    cpu = source.startswith(profile_breakdown.CPU_SOURCE)
    times = profile_breakdown.kernel_times(found, events, PROFILE_STEPS, nested=cpu,
                                           module=None if cpu else module)
    record = {"model": job["model"], "batch": job["batch"], "dtype": job["dtype"],
              "device": str(jax.devices()[0].device_kind), "hardware": hardware,
              "source": source, "step_ms": step_s * 1e3, **times}
    (out / "kernel_times.json").write_text(json.dumps(record, indent=1))
    trace_step = times.get("step_ms_trace")
    return {"status": "ok", "step_ms": round(step_s * 1e3, 2),
            "step_ms_trace": None if trace_step is None else round(trace_step, 2),
            "kernels_ms": round(times["total_us"] / 1e3, 2),
            "matched_fraction": round(times["matched_fraction"], 4),
            "classes_ms": {k: round(v / 1e3, 2) for k, v in times["classes_us"].items()},
            "unmatched_ms": round(times["unmatched_us"] / 1e3, 2), "source": source}


_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
GEMM_CALLS = 3  # back-to-back calls a timing run makes, each its own execution


def gemm_call(g):
    """(f, a, b): the jitted product of one GEMM `g` of a program (`kernels.Gemm`): operands
    laid out as the step's kernel reads them, normal random values, the same contraction and
    result dtype. One product per call: several identical products in one jit are one after
    XLA's common-subexpression elimination, so copies of it cannot be timed in one call."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, g.lhs, getattr(jnp, _DTYPES[g.lhs_dtype]))
    b = jax.random.normal(kb, g.rhs, getattr(jnp, _DTYPES[g.rhs_dtype]))
    dims = ((g.lhs_contracting, g.rhs_contracting), (g.lhs_batch, g.rhs_batch))
    return jax.jit(lambda a, b: lax.dot_general(
        a, b, dims, preferred_element_type=getattr(jnp, _DTYPES[g.out_dtype]))), a, b


def gemm_shapes(out: pathlib.Path, dry: bool, budget_s: float = 60.0) -> dict:
    """Each distinct GEMM of the profiled step (`vit_pure.xla.kernels.gemms` of
    DIR/step.hlo.txt) timed alone (`gemm_call`): median of 5 runs of `GEMM_CALLS`
    back-to-back calls. Stops starting new shapes past 80% of `budget_s`;
    DIR/gemm_shapes.json rewritten after each."""
    import json

    from vit_pure.plan import interconnect as ic
    from vit_pure.xla import hlo, kernels
    start = time.monotonic()
    text_path = out / STEP_TEXT
    if not text_path.exists():
        return {"status": "skipped: no profiled program (the profile part did not finish)"}
    found = kernels.gemms(hlo.parse_module(text_path.read_text()))
    peak = ic.HARDWARE[_hardware(out)].peak_flops
    rows = []
    for g in found:
        if time.monotonic() - start > 0.8 * budget_s:
            break
        if not {g.lhs_dtype, g.rhs_dtype, g.out_dtype} <= set(_DTYPES):
            continue
        f, a, b = gemm_call(g)
        s = harness.median_seconds(lambda: [f(a, b) for _ in range(GEMM_CALLS)],
                                   jax.block_until_ready, runs=5) / GEMM_CALLS
        rows.append({"gemm": g.label(), "runs": g.runs, "gflop": g.flops / 1e9,
                     "ms": s * 1e3, "tflop_per_s": g.flops / s / 1e12,
                     "of_peak": g.flops / s / peak})
        (out / "gemm_shapes.json").write_text(json.dumps(rows, indent=1))
    step_ms = sum(r["ms"] * r["runs"] for r in rows)
    return {"status": "ok" if len(rows) == len(found) else
            f"partial: {len(rows)} of {len(found)} shapes", "shapes": rows,
            "gemm_ms_per_step": round(step_ms, 2)}


def program(out: pathlib.Path, dry: bool) -> dict:
    """The headline's program as the GPU compiled it (the profile part's, else XLA's dump
    of a short run), read beside the deviceless compile for the GPU's description (a dry
    run: the tiny model's deviceless compile alone, where the plugin is)."""
    env = {**os.environ}
    hardware = _hardware(out)
    if dry:
        if not targets.cuda_plugin_installed():
            return {"status": "skipped: no JAX CUDA plugin for the deviceless compile"}
        argv = ["--model", "tiny", "--batch", "64", "--kit", "tiny="]
        env.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    else:
        gpu = out / STEP_TEXT
        if not gpu.exists():
            dump = out / "dump"
            subprocess.run([sys.executable, "-m", "benchmarks.peers", "--only", "kit",
                            "--batch", "4096", "--dtype", "bf16", "--steps", "2", "--warmup",
                            "1"], cwd=harness.REPO, check=True, capture_output=True,
                           timeout=60,
                           env={**env, "XLA_FLAGS": f"--xla_dump_to={dump} "
                                "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"})
            [gpu] = sorted(dump.glob("*train_step*gpu_after_optimizations.txt"))[-1:]
        argv = ["--program", f"gpu={gpu}"]
        if targets.cuda_plugin_installed():  # the deviceless compile beside it
            argv = ["--kit", "as shipped=", *argv]
    run = subprocess.run([sys.executable, "-m", "benchmarks.deviceless", *argv, "--hardware",
                          hardware, "--json", str(out / "program-rows.json")],
                         cwd=harness.REPO, capture_output=True, text=True,
                         timeout=65 * (4 if dry else 1), env=env)
    (out / "program.md").write_text(run.stdout + run.stderr[-3000:])
    return {"status": "ok" if run.returncode == 0 else f"failed ({run.returncode})",
            "hardware": hardware, "table": run.stdout}
