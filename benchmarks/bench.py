r"""Benchmark the real training step: images/s, compile time, FLOPs, MFU and memory.

    python -m benchmarks.bench --cpu-devices 8 \
        --config "pmap:1:fp32" --config "shard_map:data=4,model=2:bf16"
    python -m benchmarks.bench --config "pmap:1:fp32; pmap:1:bf16; shard_map:data=2:bf16:scan=0"
    python -m benchmarks.bench --model tiny --batch 32 --kit "dp=--cpu-devices 2" \
        --kit "tp=--cpu-devices 2 --mesh data=1,model=2 --dtype bf16"

Each row is a --config (STRATEGY:LAYOUT:POLICY[:OPTIONS], below) or a `--kit LABEL=FLAGS`
(train_shardmap.py's step with --model, --batch and these flags, as in benchmarks.peers
and benchmarks.deviceless). What is timed: `run_config`; a fresh process per
configuration: `_child`; the columns: `markdown_table`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import train_pmap
import train_shardmap
from benchmarks import harness
from benchmarks.harness import device_peak_bytes
from benchmarks.rows import kit_args, kit_argv, layout_devices, parse_configs
from vit_pure import step
from vit_pure.config import PRESETS, get_preset
from vit_pure.data import cifar10 as data
from vit_pure.policy import Policy
from vit_pure.run import checks, cli, hostmem, settings
from vit_pure.run.accum import StepMemory
from vit_pure.run.settings import RunConfig
from vit_pure.xla.flops import train_flops_per_image

# Published dense (no sparsity) peak throughput in TFLOP/s, per device, by matmul input
# type. Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16/FP16 989, TF32 495,
# FP32 67; PCIe: 756, 378, 51), NVIDIA H200 Tensor Core GPU datasheet (as H100 SXM),
# NVIDIA A100 Tensor Core GPU datasheet (BF16/FP16 312, TF32 156, FP32 19.5). The
# datasheets print the sparse figures (2x) first; these are the dense ones.
PUBLISHED_PEAK_TFLOPS = {
    # device_kind substring: {"half": bf16/fp16, "tf32": f32 at default precision, "f32"}
    "H100 PCIe": {"half": 756.0, "tf32": 378.0, "f32": 51.0},
    "H100": {"half": 989.0, "tf32": 495.0, "f32": 67.0},
    "H200": {"half": 989.0, "tf32": 495.0, "f32": 67.0},
    "A100": {"half": 312.0, "tf32": 156.0, "f32": 19.5},
}


# ------------------------------------------------------------------ measuring, in-process
def matmul_ceiling(compute_dtype, precision, size: int, runs: int = 5, *,
                   out_dtype=jnp.float32, calls: int = 1) -> tuple[float, float]:
    """Throughput of one jitted size^3 matmul on the default device: compute-dtype inputs,
    a result in `out_dtype` (float32: float32 accumulation, as the model's matmuls run).
    Each of `runs` timings, after a warm-up, dispatches `calls` matmuls back to back and
    waits for them. Returns (FLOP per second of wall time, FLOP per second of this
    process's CPU time), from the median timing."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (size, size), jnp.float32).astype(compute_dtype)
    b = jax.random.normal(kb, (size, size), jnp.float32).astype(compute_dtype)
    f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision,
                                        preferred_element_type=out_dtype))
    times = harness.time_calls(lambda: [f(a, b) for _ in range(calls)], jax.block_until_ready,
                               runs)
    flops = 2 * size ** 3 * calls
    return flops / statistics.median(times.wall), flops / statistics.median(times.cpu)


def published_peak(device, policy: Policy) -> float | None:
    """The datasheet dense peak (FLOP/s, one device) for this policy's matmuls, if known."""
    kind = getattr(device, "device_kind", "")
    for name, peaks in PUBLISHED_PEAK_TFLOPS.items():  # "H100 PCIe" before "H100"
        if name in kind:
            if jnp.dtype(policy.compute_dtype).itemsize == 2:
                return peaks["half"] * 1e12
            # float32 matmuls use TF32 tensor cores unless the precision forbids it.
            return peaks["tf32" if policy.matmul_precision == "default" else "f32"] * 1e12
    return None


def training_setup(model: str, batch: int, policy: str, *, precision: str = "default",
                   scan: bool | None = None, remat: str = "none", accum: int = 1,
                   total_steps: int = 1000) -> tuple[step.StepConfig, object]:
    """The step's settings and the optimizer exactly as the training scripts build them:
    their own parser, so every default of the real recipe (augmentation, RandAugment,
    label smoothing, clipping, AdamW and its schedule) is in, plus these flags. `scan`
    None leaves the layer loop to the backend, as the scripts do (vit_pure/run/backend.py)."""
    argv = ["--model", model, "--batch", str(batch), "--policy", policy,
            "--matmul-precision", precision,
            *([] if scan is None else ["--scan" if scan else "--no-scan"]),
            "--remat", remat, "--accum-steps", str(accum), "--dataset", "synthetic"]
    try:
        sc, optimizer = script_setup(argv, total_steps)
    except SystemExit:  # argparse has printed why
        raise cli.UsageError(f"the training scripts refuse {' '.join(argv)}") from None
    return dataclasses.replace(sc, accum_steps=accum), optimizer


def script_setup(argv: list[str] | None = None, total_steps: int = 1000,
                 parser: argparse.ArgumentParser | None = None, args=None):
    """(StepConfig, optimizer) as a training script builds them from `argv`, parsed by
    `parser` (default: the flags both scripts share), or from parsed `args`, with the
    backend's defaults."""
    if args is None:
        args = cli.parse_args(parser or cli.build_parser("bench"), argv)
    optimizer, _ = step.make_optimizer(RunConfig.from_args(args).schedule.optim, total_steps)
    return settings.step_config(args), optimizer


def make_strategy(name: str, layout: str, sc: step.StepConfig, optimizer, devices, *,
                  fsdp: bool = False, microbatches: int | None = None):
    """The training script's own strategy over `devices` (fsdp / microbatches: as the
    script's --fsdp / --microbatches; shard_map only)."""
    if name == "pmap":
        if len(devices) == len(jax.local_devices()):
            return train_pmap.PmapStrategy(sc, optimizer)
        return train_pmap.PmapStrategy(sc, optimizer, devices=devices)
    mesh = f"data={layout}" if layout.isdigit() else (layout or None)
    return train_shardmap.ShardMapStrategy(sc, optimizer, mesh, devices=devices, fsdp=fsdp,
                                           microbatches=microbatches)


def _host_batches(batch: int, seed: int):
    """Global batches (uint8 images, int32 labels) from a synthetic CIFAR-shaped split,
    through data.train_batches exactly as training draws them, epoch after epoch."""
    split = data.synthetic_cifar10(n_train=2 * batch, n_val=0, n_test=0, seed=seed)["train"]
    epoch = 0
    while True:
        yield from data.train_batches(split, batch, seed=seed, epoch=epoch)
        epoch += 1


def step_inputs(strategy, batch: int, seed: int = 0):
    """The training step's inputs after the state, placed as loop.run places them: a
    function of the step index i -> (images, labels, example ids, step key) on the
    strategy's devices, the images from `_host_batches`."""
    batches = _host_batches(batch, seed)
    example_ids = np.arange(batch, dtype=np.int32)

    def inputs(i):
        images, labels = next(batches)
        return (*strategy.put_batch(images, labels, example_ids),
                strategy.put_replicated(step.step_key(seed, 0, i)))
    return inputs


def measure_train_step(strategy, sc: step.StepConfig, optimizer, batch: int, *,
                       steps: int, warmup: int, seed: int = 0) -> dict:
    """Compile the strategy's train_step and time it as loop.run drives it.

    Returns compile_s, step_s (the timed steps' intervals), step_cpu_s (the CPU time
    this process used in each of them, all threads), loss (after all
    warmup + steps + 1 steps), lowered, compiled, param_bytes, opt_state_bytes.
    """
    host_state = step.init_state(jax.random.key(seed), sc.cfg, sc.policy, optimizer)
    param_bytes = tree_bytes(host_state["params"])
    opt_state_bytes = tree_bytes(host_state["opt_state"])
    # (put_state may reuse host_state's buffers, which donation then deletes.)
    state = strategy.put_state(host_state)
    inputs = step_inputs(strategy, batch, seed)

    (lowered, compiled), compile_s, compile_cpu_s = harness.timed(
        lambda: (lowered := strategy.train_step.lower(state, *inputs(0)), lowered.compile()))

    metrics = None

    def dispatch(i):
        nonlocal state, metrics
        # The state is donated: each call consumes the last state's buffers.
        state, metrics = compiled(state, *inputs(i))
        return metrics

    times = harness.time_steps(dispatch, jax.block_until_ready, warmup, steps)
    return {"compile_s": compile_s, "compile_cpu_s": compile_cpu_s,
            "step_s": times.wall, "step_cpu_s": times.cpu,
            "loss": float(strategy.metrics_to_host(metrics)["loss"]), "compiled": compiled,
            "lowered": lowered,
            "param_bytes": param_bytes, "opt_state_bytes": opt_state_bytes}


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of `tree`."""
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def xla_flops_per_image(compiled, n_devices: int, batch: int) -> float:
    """XLA's flop count of a compiled step, per image (its count is per device)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]) * n_devices / batch


def row_setup(job: dict, devices, unrolled: bool = False):
    """(StepConfig, optimizer, strategy) of a row over `devices`: a `--config` row's, or a
    `--kit` row's as train_shardmap.main builds them. `unrolled`: its twin without the
    layer scan and accumulation (for XLA's flop count, which counts a loop body once)."""
    if "kit_flags" in job:
        extra = ["--no-scan", "--accum-steps", "1"] if unrolled else []
        args = kit_args(kit_argv(job["model"], job["batch"], job["kit_flags"] + extra),
                        job["label"])
        sc, optimizer = script_setup(args=args)
        sc = dataclasses.replace(sc, accum_steps=args.accum_steps)
        return sc, optimizer, train_shardmap.ShardMapStrategy(
            sc, optimizer, args.mesh, devices=devices, fsdp=args.fsdp,
            microbatches=args.microbatches)
    opts = job["options"]
    scan = {"1": True, "true": True, "0": False, "false": False}.get(str(opts["scan"]).lower())
    sc, optimizer = training_setup(job["model"], job["batch"], job["policy"],
                                   precision=opts["precision"],
                                   scan=False if unrolled else scan, remat=opts["remat"],
                                   accum=1 if unrolled else int(opts["accum"]))
    strategy = make_strategy(job["strategy"], job["layout"], sc, optimizer, devices,
                             fsdp=opts.get("fsdp", "0") in ("1", "true"),
                             microbatches=int(opts["mb"]) if opts.get("mb") else None)
    return sc, optimizer, strategy


def run_config(job: dict) -> dict:
    """Measure one row in this process (the devices are already set up).

    What is timed is what training runs. Each configuration parses its settings with the
    training scripts' own parser (vit_pure.run.cli), so every default of the recipe is in
    (augmentation and RandAugment, label smoothing, clipping, AdamW and its schedule), builds
    the script's own strategy (train_pmap.PmapStrategy or train_shardmap.ShardMapStrategy)
    and drives its compiled `train_step` as vit_pure.run.loop.run does: host batches cut from a
    synthetic CIFAR-shaped uint8 split by data.train_batches and put on the devices every
    step, the state donated, dropout, the gradient all-reduce and the metric reductions
    included, one step in flight while the next is dispatched. A step's time is the
    interval between the completions of two consecutive steps; the table shows the median
    over --steps timed steps after --warmup steps (and one untimed step at the end).
    """
    cfg = get_preset(job["model"])
    n = job["devices"] or len(jax.devices())
    if n > len(jax.devices()):
        raise cli.UsageError(f"{job['label']}: needs {n} devices, {len(jax.devices())} visible")
    devices = jax.devices()[:n]
    platform_name = devices[0].platform
    sc, optimizer, strategy = row_setup(job, devices)
    policy, accum = sc.policy, sc.accum_steps
    strategy.check_batch(job["batch"], accum_steps=accum)

    # The ceiling just before and just after the timed steps (their mean): on a shared
    # machine whose load drifts, this keeps the ceiling and the step under the same load.
    size = job["matmul_size"] or (2048 if platform_name == "cpu" else 8192)
    load_start = os.getloadavg()[0]
    before = matmul_ceiling(policy.compute_dtype, policy.precision, size)
    res = measure_train_step(strategy, sc, optimizer, job["batch"], steps=job["steps"],
                             warmup=job["warmup"])
    after = matmul_ceiling(policy.compute_dtype, policy.precision, size)
    ceiling = (before[0] + after[0]) / 2
    ceiling_total = ceiling * (1 if platform_name == "cpu" else n)
    ceiling_cpu = (before[1] + after[1]) / 2
    compiled = res.pop("compiled")
    step_s = statistics.median(res["step_s"])
    ips = job["batch"] / step_s
    ips_cpu = job["batch"] / statistics.median(res["step_cpu_s"])
    flops = train_flops_per_image(cfg, strategy.sc.execution)
    achieved = flops * ips

    xla_flops = None
    if job["xla_check"]:
        if sc.execution.scan or accum != 1:
            # XLA counts a while-loop body once: count an unrolled twin (compiled, not run).
            _, _, twin = row_setup(job, devices, unrolled=True)
            twin_state = step.init_state(jax.random.key(0), cfg, policy, optimizer)
            args = (twin.put_state(twin_state), *step_inputs(twin, job["batch"])(0))
            xla_flops = xla_flops_per_image(twin.train_step.lower(*args).compile(), n,
                                            job["batch"])
        else:
            xla_flops = xla_flops_per_image(compiled, n, job["batch"])

    peak = published_peak(devices[0], policy)
    dev_bytes = device_peak_bytes(devices[0])
    return {
        "label": job["label"], "devices": n, "platform": platform_name,
        "device_kind": devices[0].device_kind, "policy": str(policy),
        "images_per_s": ips, "step_ms": 1e3 * step_s,
        "step_ms_all": [1e3 * s for s in res["step_s"]], "compile_s": res["compile_s"],
        "compile_cpu_s": res["compile_cpu_s"],
        "gflop_per_image": flops / 1e9,
        "xla_gflop_per_image": None if xla_flops is None else xla_flops / 1e9,
        "tflops": achieved / 1e12, "ceiling_tflops": ceiling_total / 1e12,
        "mfu": achieved / ceiling_total,
        # The same ratio in CPU time (images and ceiling FLOPs per CPU-second of this
        # process): insensitive to other processes taking the cores. CPU backend only.
        "images_per_cpu_s": ips_cpu if platform_name == "cpu" else None,
        "mfu_cpu_time": flops * ips_cpu / ceiling_cpu if platform_name == "cpu" else None,
        "mfu_datasheet": None if peak is None else achieved / (peak * n),
        "mem_per_device": (dev_bytes if dev_bytes is not None
                           else StepMemory.of(compiled).total),
        "mem_source": "memory_stats" if dev_bytes is not None else "memory_analysis",
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loss": res["loss"], "load_start": load_start, "load": os.getloadavg()[0],
        "ceiling_before_after_tflops": [before[0] / 1e12, after[0] / 1e12],
    }


# -------------------------------------------------------------------------- the driver
def _child(job: dict) -> int:
    """Each configuration runs in a fresh Python process, given exactly as many fake CPU
    devices as its layout needs (XLA_FLAGS is set there before jax starts its backend), so
    configurations do not share memory, caches or a process-wide peak RSS.
    """
    if job["devices"]:
        cli.use_cpu_devices(job["devices"])  # only the CPU backend reads this
    if job["cpu"]:
        os.environ["JAX_PLATFORMS"] = "cpu"
    return harness.child_main(run_config, job)


def _mib(n):
    return "" if n is None else f"{n / 2**20:,.0f} MiB"


def markdown_table(results: list[dict]) -> str:
    """The results as a Markdown table, one row per configuration.

    Columns:
        img/s, step ms      median step, as above
        img/CPU-s           images per second of CPU time this process used (all threads),
                            median step: on a shared machine, the figure other processes'
                            load disturbs least (an idle host with C cores reaches at most
                            C x this)
        compile s (CPU s)   lowering + XLA compilation of the train step, wall-clock (and
                            this process's CPU time, which other processes disturb less)
        GFLOP/img           model FLOPs per training image, counted from the config
                            (`train_flops_per_image`): matmuls only, training = 3 x forward
        XLA GFLOP/img       the compiled program's own count (`cost_analysis()['flops']`, per
                            device, x devices / batch). It also counts elementwise work
                            (LayerNorm, softmax, GELU, augmentation, AdamW), so it is a little
                            higher. XLA counts a while loop's body once, so for a step with
                            lax.scan (over layers or accumulation micro-batches) the figure
                            comes from compiling an unrolled twin of the step (not timed).
        TFLOP/s             GFLOP/img x img/s: achieved model FLOP/s of the whole step
        ceiling TFLOP/s     a large jitted matmul measured in the same process just before
                            and just after the timed steps (mean of the two medians of 5
                            runs; compute-dtype inputs, float32 accumulation, the
                            policy's precision). On CPU the fake devices share
                            the host's cores, so this is the whole host's ceiling; on an
                            accelerator it is one device's, times the device count.
        MFU                 TFLOP/s / ceiling
        MFU (CPU time)      the same ratio with both sides per CPU-second instead of per
                            wall-second (CPU backend: robust to load from other processes)
        MFU (datasheet)     TFLOP/s / (published dense peak x devices) on known accelerators
        mem/dev             peak bytes per device: device.memory_stats() where the backend
                            has it (GPU, TPU), else the compiled step's memory_analysis():
                            arguments + outputs - donated aliases + temporaries
        peak RSS            the process's peak resident set (host memory), all devices
        load                1-minute load average of the host when the configuration
                            started - when it ended
    """
    head = ["config", "dev", "img/s", "step ms", "img/CPU-s", "compile s (CPU s)", "GFLOP/img",
            "XLA GFLOP/img", "TFLOP/s", "ceiling TFLOP/s", "MFU", "MFU (CPU time)",
            "MFU (datasheet)", "mem/dev", "peak RSS", "load"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["label"], f"failed: {r['error']}"])
            continue
        rows.append([
            r["label"], str(r["devices"]), f"{r['images_per_s']:.1f}", f"{r['step_ms']:.0f}",
            harness.cell(r["images_per_cpu_s"], ".1f"),
            f"{r['compile_s']:.1f} ({r['compile_cpu_s']:.1f})", f"{r['gflop_per_image']:.4g}",
            harness.cell(r["xla_gflop_per_image"], ".4g"), f"{r['tflops']:.3g}",
            f"{r['ceiling_tflops']:.3g}", f"{100 * r['mfu']:.0f}%",
            harness.cell(r["mfu_cpu_time"], ".0%"), harness.cell(r["mfu_datasheet"], ".1%"),
            _mib(r["mem_per_device"]), _mib(r["peak_rss"]),
            f"{r['load_start']:.1f}-{r['load']:.1f}"])
    return harness.markdown_table(head, rows)


# What --help prints after the usage lines: the grammar of --config (rows.py reads it).
CONFIG_GRAMMAR = """A configuration is STRATEGY:LAYOUT:POLICY[:OPTIONS]
    STRATEGY  pmap | shard_map
    LAYOUT    a device count N (shard_map: the mesh data=N) or a mesh data=D,model=M;
              empty means every device (with --cpu-devices N: N)
    POLICY    fp32 | bf16 | fp16 | p=DTYPE,c=DTYPE,o=DTYPE (as --policy in the scripts)
    OPTIONS   key=value pairs, comma-separated, overriding the global flags for this
              configuration: scan=0|1|auto, remat=NAME, accum=K, precision=default|high|highest,
              fsdp=0|1 (ZeRO-3 over 'data'), mb=K (pipeline micro-batches; layout pipe=S)
Give several with repeated --config flags or separated by ';' (or both)."""


def build_parser() -> argparse.ArgumentParser:
    p = cli.doc_parser(__doc__)
    p.epilog = f"{p.epilog}\n\n{CONFIG_GRAMMAR}"
    a = p.add_argument
    a("--config", action="append", default=[], metavar="STRATEGY:LAYOUT:POLICY[:OPTIONS]",
      help="a configuration to measure (repeatable; ';' separates several)")
    a("--kit", action="append", default=[], metavar="LABEL=FLAGS",
      help="a row of train_shardmap.py's own flags on top of --model/--batch (repeatable), "
           "as benchmarks.peers and benchmarks.deviceless take it; NAME=VALUE words "
           "before the flags set that row's environment")
    a("--model", default="vit-cifar", choices=sorted(PRESETS))
    a("--batch", type=int, default=128, help="global batch")
    a("--steps", type=int, default=5, help="timed steps per configuration (median reported)")
    a("--warmup", type=int, default=2, help="untimed steps after compilation")
    a("--scan", action=argparse.BooleanOptionalAction, default=None,
      help="lax.scan over the encoder layers (default: as the training scripts choose "
           "per backend, vit_pure/run/backend.py: unrolled on CPU and GPU)")
    a("--remat", default="none", help="rematerialisation policy (as the scripts' --remat)")
    a("--accum-steps", type=int, default=1, help="gradient accumulation micro-batches")
    a("--matmul-precision", default="default", choices=["default", "high", "highest"])
    a("--cpu-devices", type=int, default=None,
      help="run on the CPU backend; N fake devices for configurations with an empty layout")
    a("--matmul-size", type=int, default=None,
      help="side of the ceiling matmul (default 2048 on CPU, 8192 on accelerators)")
    a("--no-xla-check", dest="xla_check", action="store_false",
      help="skip XLA's flop count (saves the unrolled twin's compile for scan steps)")
    a("--json", default=None, help="also write the results to this JSON file")
    a("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> list[dict]:
    p = build_parser()
    args = p.parse_args(argv)
    if args.child is not None:
        sys.exit(_child(json.loads(args.child)))
    cli.require_positive(p, args, "batch", "steps", "accum_steps")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    checks.check_device_counts(p, args)  # --cpu-devices: what this host's memory holds
    defaults = {"scan": {None: "auto", True: "1", False: "0"}[args.scan], "remat": args.remat,
                "accum": str(args.accum_steps), "precision": args.matmul_precision}
    jobs = []
    for c in parse_configs(args.config) if args.config or not args.kit else []:
        options = {**defaults, **c.options}
        jobs.append({
            "label": c.label, "strategy": c.strategy, "layout": c.layout, "policy": c.policy,
            "options": options, "devices": layout_devices(c.layout, args.cpu_devices),
            "cpu": args.cpu_devices is not None, "model": args.model, "batch": args.batch,
            "steps": args.steps, "warmup": args.warmup, "matmul_size": args.matmul_size,
            "xla_check": args.xla_check})
    for text in args.kit:
        try:
            label, env, flags = harness.parse_kit_row(text)
        except ValueError as e:
            raise cli.UsageError(str(e)) from None
        kit = kit_args(kit_argv(args.model, args.batch, flags), text)
        if kit.accum_steps == "auto":
            raise cli.UsageError(f"--kit {text!r}: --accum-steps auto is decided by training; "
                                 f"give a number")
        devices = kit.cpu_devices or args.cpu_devices
        jobs.append({
            "label": label, "kit_flags": flags, "env": env, "devices": devices,
            "cpu": devices is not None, "model": args.model, "batch": args.batch,
            "steps": args.steps, "warmup": args.warmup, "matmul_size": args.matmul_size,
            "xla_check": args.xla_check})

    print(f"# bench: {args.model}, global batch {args.batch}, {args.warmup} warm-up + "
          f"{args.steps} timed steps; defaults {defaults}")
    print(f"# {harness.machine_line()}")
    print(f"# command: {harness.command_line('benchmarks.bench', argv)}", flush=True)
    results = []
    for job in jobs:
        env = {**os.environ, **job["env"]} if job.get("env") else None
        r = {"label": job["label"], **harness.run_child("benchmarks.bench", job, env=env)}
        results.append(r)
        if "error" in r:
            print(f"# {job['label']}: failed: {r['error']}", flush=True)
        else:
            print(f"# {job['label']}: {r['images_per_s']:.1f} img/s, steps (ms) "
                  f"{', '.join(f'{s:.0f}' for s in r['step_ms_all'])}, loss {r['loss']:.4f}, "
                  f"load {r['load']:.2f}", flush=True)
    print()
    print(markdown_table(results))
    first = next((r for r in results if "error" not in r), None)
    if first:
        print(f"\nmachine: {first['device_kind']} ({first['platform']}); memory: "
              f"{first['mem_source']}; GFLOP/img from the config, training = 3 x forward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    hostmem.use_huge_pages()  # restarts once; see vit_pure/run/hostmem.py
    sys.exit(cli.main_guard(main))
