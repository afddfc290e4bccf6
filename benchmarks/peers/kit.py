"""The JAX children of benchmarks.peers: the ceiling matmul, the kit's rows and the
kit's profile. The driver runs each in a process of its own
(`python -m benchmarks.peers.kit --child JOB`).
"""
from __future__ import annotations

import gzip
import pathlib
import sys

import jax
import jax.numpy as jnp

import train_shardmap
from benchmarks import bench, harness
from benchmarks.peers.common import child
from vit_pure import step
from vit_pure.data import cifar10 as data
from vit_pure.model import count_params, init_params
from vit_pure.run import accum, cli, settings
from vit_pure.run.settings import RunConfig

PROFILE_STEPS = 3


def kit_argv(job: dict) -> list[str]:
    """The training script's command line of a kit row (the headline command's flags)."""
    return ["--model", job["model"], "--batch", str(job["batch"]), "--dtype", job["dtype"],
            "--matmul-precision", job["precision"], "--dataset", "synthetic",
            "--accum-steps", "1", *job["kit_flags"]]


def _device_info() -> dict:
    return harness.device_info(jax.devices()[0], f"jax {jax.__version__}")


def run_ceiling(job: dict) -> dict:
    """FLOP/s of a size^3 matmul in the compute dtype (bf16 out for bf16), median of 5
    timings of 10 back-to-back calls."""
    info = _device_info()
    size = job.get("matmul_size") or (1024 if info["platform"] == "cpu" else 8192)
    dtype = jnp.bfloat16 if job["dtype"] == "bf16" else jnp.float32
    precision = {"default": None, "highest": jax.lax.Precision.HIGHEST}[job["precision"]]
    flops_per_s, _ = bench.matmul_ceiling(dtype, precision, size, out_dtype=dtype, calls=10)
    what = (f"{size}^3 {job['dtype']} matmul"
            + (f", precision {job['precision']}" if job["dtype"] == "fp32" else ", bf16 out"))
    return {**info, "flops_per_s": flops_per_s, "what": what}


def build_kit(job: dict):
    """The kit's strategy as train_shardmap.main builds it, on one device: (sc,
    optimizer, strategy)."""
    args = cli.parse_args(train_shardmap.build_parser(), kit_argv(job))
    cli.start_runtime(args)
    sc = settings.step_config(args)
    rc = RunConfig.from_args(args)
    optimizer, _ = step.make_optimizer(rc.schedule.optim, 1000)
    devices = jax.devices()[:1]

    def make_strategy(sc, optimizer):
        return train_shardmap.ShardMapStrategy(sc, optimizer, args.mesh, devices=devices,
                                               fsdp=args.fsdp, microbatches=args.microbatches)

    # --accum-steps K or auto (this resolves and checks it, as in training).
    strategy, sc = accum.build_strategy(rc, sc, make_strategy, optimizer,
                                        image_shape=(data.HEIGHT, data.WIDTH, data.CHANNELS))
    print(f"kit: {' '.join(kit_argv(job))}; {sc}", file=sys.stderr, flush=True)
    return sc, optimizer, strategy


def run_kit(job: dict) -> dict:
    sc, optimizer, strategy = build_kit(job)
    res = bench.measure_train_step(strategy, sc, optimizer, job["batch"],
                                   steps=job["steps"], warmup=job["warmup"])
    params = count_params(jax.eval_shape(lambda: init_params(jax.random.key(0), sc.cfg)))
    program = job.get("program_path")
    if program:  # the step as XLA compiled it here (--programs)
        pathlib.Path(program).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(program).write_bytes(gzip.compress(res["compiled"].as_text().encode()))
    return {**_device_info(), "step_s": res["step_s"], "compile_s": res["compile_s"],
            "program": program,
            "loss": res["loss"], "peak_bytes": harness.device_peak_bytes(jax.devices()[0]),
            "params": params, "step_config": repr(sc), "policy": str(sc.policy),
            "scan": sc.execution.scan, "accum_steps": sc.accum_steps,
            "notes": list(getattr(sc, "notes", ()))}


def run_profile_kit(job: dict) -> dict:
    """Compile the kit's step, run --warmup steps, then trace PROFILE_STEPS steps."""
    sc, optimizer, strategy = build_kit(job)
    state = strategy.put_state(step.init_state(jax.random.key(0), sc.cfg, sc.policy, optimizer))
    inputs = bench.step_inputs(strategy, job["batch"])
    metrics = None
    for i in range(max(job["warmup"], 2) + PROFILE_STEPS):
        if i == max(job["warmup"], 2):
            jax.block_until_ready(state)
            jax.profiler.start_trace(job["profile_dir"])
        state, metrics = strategy.train_step(state, *inputs(i))
    jax.block_until_ready((state, metrics))
    jax.profiler.stop_trace()
    return {**_device_info(), "profile_dir": job["profile_dir"]}


RUNS = {"ceiling": run_ceiling, "kit": run_kit, "profile-kit": run_profile_kit}

if __name__ == "__main__":
    sys.exit(child(lambda job: RUNS[job["entry"]](job), sys.argv))
