"""Peer benchmark: this kit's training step against Flax NNX and PyTorch, same ViT, one device.

    python benchmarks/peers.py --batch 4096 --dtype bf16 \
        --kit "as written=" --kit "no-scan=--no-scan" --kit "nodrop=--no-scan --model-dropout 0"
    python benchmarks/peers.py --batch 4096 --dtype fp32 --matmul-precision highest --only kit,nnx
    python benchmarks/peers.py --model tiny --batch 16 --steps 2 --warmup 1     # a CPU smoke test

Times, in one run on one device, the same training step (forward, backward, AdamW update
of a ViT on random CIFAR-shaped uint8 batches, normalised on the device) written several
ways, and prints one markdown table:

    kit            this kit's real step, built exactly as `train_shardmap.py --batch B
                   --dtype D --dataset synthetic --accum-steps 1 [FLAGS]` builds it (its
                   parser, StepConfig.from_args, make_optimizer, ShardMapStrategy on one
                   device), timed by bench.py's measure_train_step, which drives the
                   compiled step as the training loop does. So the whole recipe is in:
                   flip + crop and RandAugment on the device, label smoothing, clipping.
                   `--kit LABEL=FLAGS` (repeatable) adds one row per set of extra flags;
                   FLAGS are the training script's flags, plus one of this script's own:
                   `--model-dropout RATE` replaces the model config's dropout rate (e.g.
                   "nodrop=--model-dropout 0"). Without --kit: one row, no extra flags.
                   `--accum-steps K|auto` in FLAGS overrides the default 1.
    nnx            a Flax NNX ViT written here to the same config (vit_pure.config.PRESETS
                   [--model]: pre-LN, class token, learned position embedding, tanh-GELU,
                   dropout after the embedding and on each residual branch),
                   `dtype=compute, param_dtype=float32`, optax AdamW, a jitted step with
                   the parameters and optimizer state donated.
    torch-eager    a PyTorch nn.Module of the same config (F.scaled_dot_product_attention,
                   bf16 autocast for bf16, fused AdamW on CUDA), eager.
    torch-compile  the same, its forward + loss wrapped in torch.compile (the backward
                   is compiled with it by AOTAutograd); the fused AdamW step stays eager.

Same for all: AdamW (lr 1e-3, betas 0.9/0.999, weight decay 0.05 on the weight matrices
only), global-norm gradient clipping at 1.0, softmax cross-entropy with label smoothing
0.1 in float32, dropout at the config's rate. Not the same: only the kit augments
(flip + crop, RandAugment 2x9 by default: try a variant with "--randaugment 0"), the kit
draws a dropout mask per example (fold_in of the example id; the peers one mask per
batch), the kit's learning rate follows its warm-up + cosine schedule (NNX: the same
schedule, torch: constant), and stochastic depth (drop_path, only the "tiny" preset has
it) exists in the kit only.

Columns:
    img/s, step ms   median over --steps timed steps after --warmup untimed ones; a step
                     is the interval between two consecutive steps' completions, one
                     step in flight while the next is dispatched (as the training loop)
    MFU              model FLOP/s (bench.train_flops_per_image: matmuls, training = 3 x
                     forward) over the FLOP/s of one large matmul measured by JAX in the
                     same run on the same device in the compute dtype (bf16: bf16 output;
                     fp32: at --matmul-precision); the "ceiling" line above the table
    peak GiB         device memory: JAX memory_stats()["peak_bytes_in_use"], torch
                     max_memory_allocated(); "n/a" on CPU
    compile s        JAX (kit, nnx): lowering + compilation of the step; torch: the
                     first step's wall time (compilation included for torch-compile)
    params, loss     parameter count (the same model?) and the loss after the last step

Each entry runs in its own Python process (JAX preallocates device memory; JAX and
torch never share a process), only if its package imports (else the row says
"skipped"), under --entry-timeout seconds; a failing entry shows its last error line.
--profile-kit DIR also traces 3 steps of the first kit row with jax.profiler and prints
benchmarks/profile_breakdown.py's breakdown of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

RESULT_TAG = "PEERS_RESULT "
PEERS = ("kit", "nnx", "torch-eager", "torch-compile")
NEEDS = {"nnx": "flax", "torch-eager": "torch", "torch-compile": "torch"}
LR, WEIGHT_DECAY, BETAS, CLIP, LABEL_SMOOTHING = 1e-3, 0.05, (0.9, 0.999), 1.0, 0.1
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # as vit_pure.data
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
PROFILE_STEPS = 3


class UsageError(ValueError):
    """Bad flags, reported as one line."""


# ============================================================================ the parent
def parse_kit_variant(text: str) -> tuple[str, list[str], dict]:
    """`LABEL=FLAGS` -> (label, the training script's flags, model-config changes)."""
    label, sep, flags = text.partition("=")
    if not sep or not label.strip():
        raise UsageError(f"--kit {text!r}: expected LABEL=FLAGS, e.g. 'no-scan=--no-scan'")
    try:
        words = shlex.split(flags)
    except ValueError as e:
        raise UsageError(f"--kit {text!r}: {e}") from None
    kit_flags, changes = [], {}
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        if name == "--model-dropout":
            if not eq:
                value = words[i + 1] if i + 1 < len(words) else ""
                i += 1
            try:
                changes["dropout"] = float(value)
            except ValueError:
                raise UsageError(f"--kit {text!r}: --model-dropout needs a rate") from None
            if not 0.0 <= changes["dropout"] < 1.0:
                raise UsageError(f"--kit {text!r}: --model-dropout must be in [0, 1)")
        else:
            kit_flags.append(word)
        i += 1
    return label.strip(), kit_flags, changes


def kit_argv(job: dict) -> list[str]:
    """The training script's command line of a kit row (the headline command's flags)."""
    return ["--model", job["model"], "--batch", str(job["batch"]), "--dtype", job["dtype"],
            "--matmul-precision", job["precision"], "--dataset", "synthetic",
            "--accum-steps", "1", *job["kit_flags"]]


def check_kit_flags(flags: list[str], text: str) -> None:
    """Refuse flags the training script would refuse, before any entry runs."""
    import train_shardmap  # imports jax, but starts no backend

    def refuse(message):
        raise UsageError(f"--kit {text!r}: the training script refuses it: {message}")

    parser = train_shardmap.build_parser()
    parser.error = refuse
    parser.parse_args(flags)


def build_jobs(args) -> list[dict]:
    """One job per table row, in the order they run."""
    from vit_pure.config import get_preset
    cfg = dataclasses.asdict(get_preset(args.model))
    common = {"model": args.model, "cfg": cfg, "batch": args.batch, "dtype": args.dtype,
              "precision": args.matmul_precision, "steps": args.steps,
              "warmup": args.warmup, "compile_mode": args.torch_compile_mode}
    jobs = []
    for entry in args.only:
        if entry != "kit":
            jobs.append({**common, "entry": entry, "name": entry})
            continue
        for text in args.kit or ["="]:
            label, flags, changes = ("", [], {}) if text == "=" else parse_kit_variant(text)
            check_kit_flags(kit_argv({**common, "kit_flags": flags}), text)
            jobs.append({**common, "entry": "kit", "name": f"kit: {label}" if label else "kit",
                         "kit_flags": flags, "cfg_changes": changes})
    return jobs


def run_child(job: dict, timeout: float) -> dict:
    """Run one job in a fresh interpreter (its own process group, killed at the
    timeout); its result, or {"error": last error line}."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=str(REPO))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nerror: timed out after {timeout:.0f} s (--entry-timeout)"
    except BaseException:  # Ctrl-C: take the child (and torch's compile workers) along
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    wall = time.perf_counter() - t0
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            return {**json.loads(line[len(RESULT_TAG):]), "wall_s": wall}
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return {"name": job["name"], "error": lines[-1] if lines else f"exit code {proc.returncode}",
            "stderr_tail": lines[-8:], "wall_s": wall}


def skipped(job: dict) -> dict | None:
    package = NEEDS.get(job["entry"])
    if package and importlib.util.find_spec(package) is None:
        return {"name": job["name"], "skipped": f"skipped: {package} not installed"}
    return None


def _cell(x, spec, scale=1.0):
    return "n/a" if x is None else format(x * scale, spec)


def markdown_table(results: list[dict], flops_per_image: float,
                   ceiling_flops: float | None) -> str:
    """The comparison table; MFU against `ceiling_flops` (n/a without one)."""
    head = ["entry", "img/s", "step ms", "MFU", "TFLOP/s", "peak GiB", "compile s",
            "params", "loss"]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in results:
        if "error" in r or "skipped" in r:
            what = r.get("skipped") or f"failed: {r['error']}"
            rows.append(f"| {r['name']} | {what.replace('|', '/')} |" + " |" * (len(head) - 2))
            continue
        ips = r["batch"] / statistics.median(r["step_s"])
        achieved = flops_per_image * ips
        mfu = achieved / ceiling_flops if ceiling_flops else None
        rows.append("| " + " | ".join([
            r["name"], f"{ips:,.0f}" if ips >= 100 else f"{ips:.1f}",
            f"{1e3 * statistics.median(r['step_s']):.1f}", _cell(mfu, ".1%"),
            f"{achieved / 1e12:.3g}", _cell(r["peak_bytes"], ".2f", 2.0 ** -30),
            f"{r['compile_s']:.1f}", f"{r['params']:,}", f"{r['loss']:.4f}"]) + " |")
    return "\n".join(rows)


def versions() -> dict:
    out = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "flax", "optax", "torch"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def write_json(path: str, record: dict) -> None:
    """A fresh file each time (written aside, then renamed over): a run cut short still
    leaves the entries finished so far."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    from vit_pure.config import PRESETS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="vit-cifar", choices=sorted(PRESETS), help="model preset (all rows)")
    a("--batch", type=int, default=4096, help="batch (one device)")
    a("--dtype", default="bf16", choices=["fp32", "bf16"], help="compute dtype; params f32")
    a("--matmul-precision", default="default", choices=["default", "highest"],
      help="float32 matmuls on GPU: default = TF32, highest = true float32")
    a("--steps", type=int, default=20, help="timed steps per entry (median reported)")
    a("--warmup", type=int, default=5, help="untimed steps after compilation")
    a("--only", default=",".join(PEERS), help=f"entries to run, comma-separated: {PEERS}")
    a("--kit", action="append", default=[], metavar="LABEL=FLAGS",
      help="a kit row with these extra training-script flags (repeatable)")
    a("--torch-compile-mode", default="default",
      help="torch.compile mode (default, max-autotune, ...)")
    a("--matmul-size", type=int, default=None,
      help="side of the ceiling matmul (default 8192 on accelerators, 1024 on CPU)")
    a("--entry-timeout", type=float, default=240.0, help="seconds per entry before it is killed")
    a("--profile-kit", default=None, metavar="DIR",
      help="also trace 3 steps of the first kit row into DIR and print the breakdown")
    a("--json", default=None, metavar="PATH", help="write every figure to this JSON file")
    a("--child", default=None, help=argparse.SUPPRESS)
    return p


def parse(argv) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("batch", "steps", "entry_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.matmul_size is not None and args.matmul_size < 1:
        p.error("--matmul-size must be positive")
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in args.only if s not in PEERS]
    if unknown or not args.only:
        p.error(f"--only {','.join(unknown)}: choose from {','.join(PEERS)}")
    if args.kit and "kit" not in args.only:
        p.error("--kit needs 'kit' in --only")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.child is not None:
        sys.exit(child_main(json.loads(args.child)))
    import bench  # FLOPs per image; imports jax without starting a backend
    from vit_pure.config import get_preset
    jobs = build_jobs(args)
    flops = bench.train_flops_per_image(get_preset(args.model))
    record = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "host": f"{platform.node()}, {os.cpu_count()} CPU cores",
              "versions": versions(), "model": args.model, "batch": args.batch,
              "dtype": args.dtype, "matmul_precision": args.matmul_precision,
              "gflop_per_image": flops / 1e9, "results": []}
    print(f"# peers: {args.model}, batch {args.batch}, {args.dtype}, matmul precision "
          f"{args.matmul_precision}, {args.warmup} warm-up + {args.steps} timed steps")
    print(f"# {record['date']}, {record['host']}; " + ", ".join(
        f"{k} {v}" for k, v in record["versions"].items() if v))
    print(f"# command: {record['command']}", flush=True)

    ceiling = run_child({**jobs[0], "entry": "ceiling", "name": "ceiling",
                         "matmul_size": args.matmul_size}, args.entry_timeout)
    record["ceiling"] = ceiling
    ceiling_flops = ceiling.get("flops_per_s")
    if ceiling_flops:
        print(f"# device: {ceiling['device']}; ceiling: {ceiling['what']} "
              f"{ceiling_flops / 1e12:.4g} TFLOP/s", flush=True)
    else:
        print(f"# ceiling matmul failed ({ceiling.get('error')}): MFU n/a", flush=True)
    for job in jobs:
        r = skipped(job) or run_child(job, args.entry_timeout)
        record["results"].append(r)
        _report(r)
        if args.json:
            write_json(args.json, record)
    print()
    print(markdown_table(record["results"], flops, ceiling_flops))
    print(f"\nGFLOP/img {flops / 1e9:.4g} (matmuls, training = 3 x forward)")
    if args.profile_kit:
        record["profile"] = profile_kit(args, jobs)
    if args.json:
        write_json(args.json, record)
    return record


def _report(r: dict) -> None:
    """One progress line per finished entry (and a failed entry's last stderr lines)."""
    if "skipped" in r:
        print(f"# {r['name']}: {r['skipped']}", flush=True)
    elif "error" in r:
        print(f"# {r['name']}: failed after {r['wall_s']:.0f} s: {r['error']}")
        for line in r.get("stderr_tail", [])[:-1]:
            print(f"#     {line}")
    else:
        ms = ", ".join(f"{1e3 * s:.1f}" for s in r["step_s"])
        print(f"# {r['name']}: {r['wall_s']:.0f} s in all; device {r['device']}; "
              f"steps (ms) {ms}; loss {r['loss']:.4f}", flush=True)
        if "policy" in r:  # a kit row: what its flags and the hardware defaults chose
            print(f"#     policy {r['policy']}, scan {r['scan']}, accum {r['accum_steps']}"
                  + "".join(f"; {n}" for n in r["notes"]))
    sys.stdout.flush()


def profile_kit(args, jobs: list[dict]) -> dict:
    """Trace a few steps of the first kit row (in a child) and print the breakdown."""
    import profile_breakdown
    kit = next((j for j in jobs if j["entry"] == "kit"), None)
    if kit is None:
        from vit_pure.config import get_preset
        kit = {**jobs[0], "entry": "kit", "name": "kit", "kit_flags": [], "cfg_changes": {},
               "cfg": dataclasses.asdict(get_preset(args.model))}
    r = run_child({**kit, "entry": "profile-kit", "profile_dir": args.profile_kit},
                  args.entry_timeout)
    if "error" in r:
        print(f"\n# profile of {kit['name']}: failed: {r['error']}", flush=True)
        return r
    try:
        result, source, files = profile_breakdown.analyse(args.profile_kit)
    except profile_breakdown.TraceError as e:
        print(f"\n# profile of {kit['name']}: {e}", flush=True)
        return {"error": str(e)}
    print(f"\n# profile of {kit['name']}, {PROFILE_STEPS} steps: {', '.join(files)}")
    print(profile_breakdown.format_breakdown(result, source), flush=True)
    return {"files": files, "source": source, **result}


# ============================================================================ the children
def child_main(job: dict) -> int:
    """Run one job in this process; print its result after RESULT_TAG."""
    runners = {"ceiling": run_ceiling, "kit": run_kit, "profile-kit": run_profile_kit,
               "nnx": run_nnx, "torch-eager": run_torch, "torch-compile": run_torch}
    try:
        result = runners[job["entry"]](job)
    except SystemExit as e:  # argparse has printed why
        return e.code if isinstance(e.code, int) else 2
    except Exception as e:  # noqa: BLE001 - one row's failure, reported in its row
        import traceback
        traceback.print_exc()
        msg = " ".join(str(e).split())[:300]
        print(f"error: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    print(RESULT_TAG + json.dumps({"name": job["name"], "batch": job["batch"], **result}),
          flush=True)
    return 0


def time_steps(dispatch, wait, warmup: int, steps: int) -> list[float]:
    """As bench.measure_train_step: dispatch(i) starts step i and returns something to
    wait() on; one step stays in flight while the next is dispatched, and a step's time
    is the interval between two consecutive completions. Returns the timed intervals."""
    finished, previous = [], None
    start = time.perf_counter()
    for i in range(warmup + steps + 1):  # one more: see bench.measure_train_step
        handle = dispatch(i)
        if previous is not None:
            wait(previous)
            finished.append(time.perf_counter())
        previous = handle
    wait(previous)
    finished.append(time.perf_counter())
    intervals = [b - a for a, b in zip([start] + finished, finished)]
    return intervals[warmup:warmup + steps]


def host_batches(batch: int, n: int = 2, seed: int = 0):
    """n random CIFAR-shaped uint8 batches (NHWC) and int32 labels, on the host."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, (batch, 32, 32, 3), dtype=np.uint8),
             rng.integers(0, 10, (batch,), dtype=np.int32)) for _ in range(n)]


def _jax_device_info() -> dict:
    import jax
    d = jax.devices()[0]
    return {"device": f"{d.device_kind} ({d.platform}, jax {jax.__version__})",
            "platform": d.platform}


def _jax_peak_bytes():
    """Peak device memory of the first JAX device (None where the backend has no figure)."""
    import jax

    import bench
    return bench.device_peak_bytes(jax.devices()[0])


def run_ceiling(job: dict) -> dict:
    """FLOP/s of a size^3 matmul in the compute dtype (bf16 out for bf16), median of 5
    timings of 10 back-to-back calls."""
    import jax
    import jax.numpy as jnp
    info = _jax_device_info()
    size = job.get("matmul_size") or (1024 if info["platform"] == "cpu" else 8192)
    dtype = jnp.bfloat16 if job["dtype"] == "bf16" else jnp.float32
    precision = {"default": None, "highest": jax.lax.Precision.HIGHEST}[job["precision"]]
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (size, size), dtype)
    b = jax.random.normal(kb, (size, size), dtype)
    f = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision))
    jax.block_until_ready(f(a, b))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        outs = [f(a, b) for _ in range(10)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) / 10)
    what = (f"{size}^3 {job['dtype']} matmul"
            + (f", precision {job['precision']}" if job["dtype"] == "fp32" else ", bf16 out"))
    return {**info, "flops_per_s": 2 * size ** 3 / statistics.median(times), "what": what}


# ------------------------------------------------------------------------------ the kit
def build_kit(job: dict):
    """The kit's strategy as train_shardmap.main builds it, on one device: (sc,
    optimizer, strategy)."""
    import jax

    import train_shardmap
    from vit_pure import accum, cli, data, step
    args = cli.parse_args(train_shardmap.build_parser(), kit_argv(job))
    cli.start_runtime(args)
    sc = step.StepConfig.from_args(args)
    if job["cfg_changes"]:  # a peers.py-only flag (--model-dropout): the model config
        sc = dataclasses.replace(sc, cfg=dataclasses.replace(sc.cfg, **job["cfg_changes"]))
    optimizer, _ = step.make_optimizer(args, 1000)
    devices = jax.devices()[:1]

    def make_strategy(sc, optimizer):
        return train_shardmap.ShardMapStrategy(sc, optimizer, args.mesh, devices=devices,
                                               fsdp=args.fsdp, microbatches=args.microbatches)

    # --accum-steps K or auto (this resolves and checks it, as in training).
    strategy, sc = accum.build_strategy(args, sc, make_strategy, optimizer,
                                        image_shape=(data.HEIGHT, data.WIDTH, data.CHANNELS))
    print(f"kit: {' '.join(kit_argv(job))}; {sc}", file=sys.stderr, flush=True)
    return sc, optimizer, strategy


def run_kit(job: dict) -> dict:
    import jax

    import bench
    from vit_pure.model import count_params, init_params
    sc, optimizer, strategy = build_kit(job)
    res = bench.measure_train_step(strategy, sc, optimizer, job["batch"],
                                   steps=job["steps"], warmup=job["warmup"])
    params = count_params(jax.eval_shape(lambda: init_params(jax.random.key(0), sc.cfg)))
    return {**_jax_device_info(), "step_s": res["step_s"], "compile_s": res["compile_s"],
            "loss": res["loss"], "peak_bytes": _jax_peak_bytes(), "params": params,
            "step_config": repr(sc), "policy": str(sc.policy), "scan": sc.scan,
            "accum_steps": sc.accum_steps, "notes": list(getattr(sc, "notes", ()))}


def run_profile_kit(job: dict) -> dict:
    """Compile the kit's step, run --warmup steps, then trace PROFILE_STEPS steps."""
    import jax
    import numpy as np
    from vit_pure import data, step
    sc, optimizer, strategy = build_kit(job)
    state = strategy.put_state(step.init_state(jax.random.key(0), sc.cfg, sc.policy, optimizer))
    split = data.synthetic_cifar10(n_train=2 * job["batch"], n_val=0, n_test=0)["train"]
    batches = [b for epoch in range(2)
               for b in data.train_batches(split, job["batch"], seed=0, epoch=epoch)]
    ids = np.arange(job["batch"], dtype=np.int32)
    metrics = None
    for i in range(max(job["warmup"], 2) + PROFILE_STEPS):
        if i == max(job["warmup"], 2):
            jax.block_until_ready(state)
            jax.profiler.start_trace(job["profile_dir"])
        images, labels = batches[i % len(batches)]
        state, metrics = strategy.train_step(
            state, *strategy.put_batch(images, labels, ids),
            strategy.put_replicated(step.step_key(0, 0, i)))
    jax.block_until_ready((state, metrics))
    jax.profiler.stop_trace()
    return {**_jax_device_info(), "profile_dir": job["profile_dir"]}


# ------------------------------------------------------------------------------ Flax NNX
def make_nnx_vit(cfg: dict, dtype, precision, seed: int = 0):
    """A ViT in Flax NNX, to the kit's config: returns the module. The dropout masks come
    from an explicit key passed to __call__ (one mask per site for the whole batch)."""
    import jax
    import jax.numpy as jnp
    from einops import rearrange
    from flax import nnx
    F32 = jnp.float32
    E, M, T = cfg["width"], cfg["mlp_dim"], (cfg["image_size"] // cfg["patch_size"]) ** 2 + 1
    init = jax.nn.initializers.truncated_normal(0.02)
    dense = dict(dtype=dtype, param_dtype=F32, precision=precision, kernel_init=init)
    norm = dict(epsilon=cfg["ln_eps"], dtype=dtype, param_dtype=F32)

    def dropout(x, key):
        rate = cfg["dropout"]
        if not rate:
            return x
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
        return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(E, rngs=rngs, **norm)
            self.attn = nnx.MultiHeadAttention(
                num_heads=cfg["heads"], in_features=E, qkv_features=E, out_features=E,
                decode=False, rngs=rngs, **dense)
            self.ln2 = nnx.LayerNorm(E, rngs=rngs, **norm)
            self.fc1 = nnx.Linear(E, M, rngs=rngs, **dense)
            self.fc2 = nnx.Linear(M, E, rngs=rngs, **dense)

        def __call__(self, x, key):
            k1, k2 = jax.random.split(key)
            x = x + dropout(self.attn(self.ln1(x), deterministic=True), k1)
            return x + dropout(self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)))), k2)

    class ViT(nnx.Module):
        def __init__(self, rngs):
            p = cfg["patch_size"]
            self.patch = nnx.Linear(p * p * cfg["channels"], E, rngs=rngs, **dense)
            self.cls = nnx.Param(jnp.zeros((1, 1, E), F32))
            self.pos = nnx.Param(init(rngs.params(), (1, T, E), F32))
            for i in range(cfg["depth"]):  # attributes, not a list: any flax version
                setattr(self, f"block{i}", Block(rngs))
            self.final_ln = nnx.LayerNorm(E, rngs=rngs, **norm)
            self.head = nnx.Linear(E, cfg["num_classes"], rngs=rngs, **dense)

        def __call__(self, images, key):  # images: (B, H, W, C) float32, normalised
            p = cfg["patch_size"]
            x = self.patch(rearrange(images, "b (h p) (w q) c -> b (h w) (p q c)", p=p, q=p))
            cls = jnp.broadcast_to(self.cls[...].astype(x.dtype), (x.shape[0], 1, E))
            x = jnp.concatenate([cls, x], axis=1) + self.pos[...].astype(x.dtype)
            keys = jax.random.split(key, cfg["depth"] + 1)
            x = dropout(x, keys[0])
            for i in range(cfg["depth"]):
                x = getattr(self, f"block{i}")(x, keys[i + 1])
            return self.head(self.final_ln(x[:, 0])).astype(F32)

    return ViT(nnx.Rngs(seed))


def _decay_mask(params):
    """Weight decay on the weight matrices ("kernel") only, as the kit."""
    import jax
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "kernel" in jax.tree_util.keystr(path), params)


def run_nnx(job: dict) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    F32 = jnp.float32
    dtype = jnp.bfloat16 if job["dtype"] == "bf16" else F32
    precision = {"default": None, "highest": jax.lax.Precision.HIGHEST}[job["precision"]]
    if job["cfg"]["image_size"] != 32:  # the batches are CIFAR-shaped
        raise UsageError("the peers take 32 px images (the kit resizes; they do not)")
    model = make_nnx_vit(job["cfg"], dtype, precision)
    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, 50, 1000)  # the kit's, 1000 steps
    tx = optax.chain(optax.clip_by_global_norm(CLIP),
                     optax.adamw(schedule, *BETAS, weight_decay=WEIGHT_DECAY, mask=_decay_mask))
    opt_state = tx.init(params)
    mean, std = jnp.asarray(CIFAR10_MEAN, F32), jnp.asarray(CIFAR10_STD, F32)

    def loss_fn(params, images, labels, key):
        logits = nnx.merge(graphdef, params)(images, key)
        targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), LABEL_SMOOTHING)
        return optax.softmax_cross_entropy(logits, targets).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, images_u8, labels, i):
        images = (images_u8.astype(F32) / 255.0 - mean) / std
        loss, grads = jax.value_and_grad(loss_fn)(params, images, labels,
                                                  jax.random.fold_in(jax.random.key(1), i))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batches = host_batches(job["batch"])
    t0 = time.perf_counter()
    compiled = train_step.lower(params, opt_state, *batches[0], jnp.int32(0)).compile()
    compile_s = time.perf_counter() - t0
    n_params = sum(x.size for x in jax.tree.leaves(params))
    state = {"params": params, "opt": opt_state, "loss": None}

    def dispatch(i):
        images, labels = batches[i % len(batches)]
        state["params"], state["opt"], state["loss"] = compiled(
            state["params"], state["opt"], jax.device_put(images), jax.device_put(labels),
            jnp.int32(i))
        return state["loss"]

    step_s = time_steps(dispatch, jax.block_until_ready, job["warmup"], job["steps"])
    return {**_jax_device_info(), "step_s": step_s, "compile_s": compile_s,
            "loss": float(state["loss"]), "peak_bytes": _jax_peak_bytes(), "params": n_params}


# ------------------------------------------------------------------------------- PyTorch
def make_torch_vit(cfg: dict):
    """The same ViT as a torch nn.Module (weights std 0.02 truncated normal)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    E, H, M = cfg["width"], cfg["heads"], cfg["mlp_dim"]
    S, p = cfg["image_size"], cfg["patch_size"]
    T = (S // p) ** 2 + 1

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(E, eps=cfg["ln_eps"])
            self.ln2 = nn.LayerNorm(E, eps=cfg["ln_eps"])
            self.qkv, self.out = nn.Linear(E, 3 * E), nn.Linear(E, E)
            self.fc1, self.fc2 = nn.Linear(E, M), nn.Linear(M, E)
            self.drop = nn.Dropout(cfg["dropout"])

        def forward(self, x):  # (B, T, E)
            B = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, H, E // H).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, D)
            x = x + self.drop(self.out(a.transpose(1, 2).reshape(B, T, E)))
            return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Linear(p * p * cfg["channels"], E)
            self.cls = nn.Parameter(torch.zeros(1, 1, E))
            self.pos = nn.Parameter(torch.zeros(1, T, E))
            self.drop = nn.Dropout(cfg["dropout"])
            self.blocks = nn.Sequential(*[Block() for _ in range(cfg["depth"])])
            self.final_ln = nn.LayerNorm(E, eps=cfg["ln_eps"])
            self.head = nn.Linear(E, cfg["num_classes"])
            for name, w in self.named_parameters():
                if (name.endswith("weight") and w.ndim == 2) or name == "pos":
                    nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04)
                elif name.endswith("bias"):
                    nn.init.zeros_(w)

        def forward(self, images):  # (B, H, W, C) float32, normalised
            B, C = images.shape[0], images.shape[-1]
            x = images.reshape(B, S // p, p, S // p, p, C).permute(0, 1, 3, 2, 4, 5)
            x = self.patch(x.reshape(B, T - 1, p * p * C))
            x = torch.cat([self.cls.expand(B, -1, -1).to(x.dtype), x], 1) + self.pos
            x = self.blocks(self.drop(x))
            return self.head(self.final_ln(x[:, 0]))

    return ViT()


def run_torch(job: dict) -> dict:
    import torch
    import torch.nn.functional as F
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:  # float32 matmuls: TF32 unless --matmul-precision highest
        tf32 = job["precision"] == "default"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    if job["cfg"]["image_size"] != 32:  # the batches are CIFAR-shaped
        raise UsageError("the peers take 32 px images (the kit resizes; they do not)")
    torch.manual_seed(0)
    model = make_torch_vit(job["cfg"]).to(dev).train()
    named = list(model.named_parameters())
    decay = [w for n, w in named if n.endswith("weight") and w.ndim == 2]
    rest = [w for n, w in named if not (n.endswith("weight") and w.ndim == 2)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, fused=cuda)
    mean = torch.tensor(CIFAR10_MEAN, device=dev)
    std = torch.tensor(CIFAR10_STD, device=dev)
    bf16 = job["dtype"] == "bf16"

    def loss_fn(images_u8, labels):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model((images_u8.float() / 255.0 - mean) / std)
        return F.cross_entropy(logits.float(), labels, label_smoothing=LABEL_SMOOTHING)

    if job["entry"] == "torch-compile":
        loss_fn = torch.compile(loss_fn, mode=job["compile_mode"])
    batches = [(torch.from_numpy(x), torch.from_numpy(y).long())
               for x, y in host_batches(job["batch"])]
    if cuda:
        batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
        torch.cuda.reset_peak_memory_stats()

    def dispatch(i):
        images, labels = (t.to(dev, non_blocking=True) for t in batches[i % len(batches)])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(images, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        return loss.detach()

    t0 = time.perf_counter()
    first = dispatch(0).item()  # compilation, cuBLAS / autotuning set-up
    compile_s = time.perf_counter() - t0
    losses = []
    step_s = time_steps(dispatch, lambda t: losses.append(t.item()), job["warmup"], job["steps"])
    name = torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu"
    return {"device": f"{name} ({dev.type}, torch {torch.__version__})", "step_s": step_s,
            "compile_s": compile_s, "loss": losses[-1] if losses else first,
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
            "params": sum(w.numel() for w in model.parameters())}


if __name__ == "__main__":
    try:
        main()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
