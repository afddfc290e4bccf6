r"""The kit's training step compiled for a GPU without one, configurations side by side.

    python -m benchmarks.deviceless                       # the default rows (build_jobs)
    python -m benchmarks.deviceless --kit "as written=" --kit "einsum=--attention einsum" \
        --kit "save-dots=--remat block-save-dots" --json deviceless.json
    python -m benchmarks.deviceless --kit "headline=" --top 12   # where its traffic goes

Each row is `train_shardmap.py --model M --batch B --dtype D --accum-steps 1 [FLAGS] --plan
G --hardware H` (the plan's deviceless compile, vit_pure/run/planning.py) in a process of
its own; `--kit LABEL=FLAGS` gives a row's label and flags, after any NAME=VALUE words (that
row's environment). Nothing runs: XLA:GPU compiles for the described GPU
(vit_pure/plan/targets/) with JAX's CUDA plugin (`pip install -r requirements-gpu.txt`),
autotuning off, GEMMs to cuBLAS. The columns: `table`; `--program LABEL=FILE` rows from a
GPU's own module: `read_programs`. docs/performance.md compares them with measurements.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys

import train_shardmap  # imports jax, but starts no backend
from benchmarks import harness
from benchmarks.peers.driver import check_kit_flags, parse_kit_variant, versions, write_json
from vit_pure.config import PRESETS
from vit_pure.errors import UsageError
from vit_pure.plan import interconnect as ic
from vit_pure.plan import targets
from vit_pure.run import cli
from vit_pure.xla import hlo, kernels

DEFAULT_ROWS = ("headline=", "einsum=--attention einsum", "dropout 0=--dropout 0",
                "block-save-dots=--remat block-save-dots")
# The classes of vit_pure/xla/kernels.py shown as columns; the others are summed in "rest".
SHOWN = {"gemm": "GEMM", "attention": "attention", "norms/reductions": "norms",
         "elementwise": "elementwise", "transposes/copies": "transposes"}
# The children compile for the GPU on this machine's CPU: no GPU backend to start, and
# the plugin's start-up check (which needs a driver) skipped.
CHILD_ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


# ============================================================================= the child
def row_argv(job: dict) -> list[str]:
    """The training script's command line of a row: the plan's deviceless compile."""
    return ["--model", job["model"], "--batch", str(job["batch"]), "--dtype", job["dtype"],
            "--accum-steps", "1", *job["flags"], "--plan", str(job["gpus"]),
            "--hardware", job["hardware"]]


def run_row(job: dict) -> dict:
    """Compile one row for the GPU (train_shardmap's --plan) and keep the program's figures."""
    record = train_shardmap.main(row_argv(job))
    if record["compiled_for"] != "gpu":
        raise RuntimeError(f"compiled for {record['compiled_for']}, not the GPU: "
                           + "; ".join(n for n in record["notes"] if "compiled for" in n))
    return {"name": job["name"], "memory": record["memory"],
            "gpu_program": record["gpu_program"], "flops": record["flops"],
            "compile_s": record["compile_s"], "notes": record["notes"],
            "env": {k: os.environ.get(k) for k in job["env"]}}


# ============================================================================ the parent
def build_jobs(args) -> list[dict]:
    """One job per row, its flags checked by the training script's parser first. Without
    --kit, the rows are DEFAULT_ROWS:

        headline          no extra flags (cuDNN attention, unrolled layers, m=bf16: the GPU's
                          defaults, resolved for the target)
        einsum            --attention einsum
        dropout 0         --dropout 0
        block-save-dots   --remat block-save-dots
    """
    common = {"model": args.model, "batch": args.batch, "dtype": args.dtype,
              "gpus": args.gpus, "hardware": args.hardware}
    jobs = []
    for text in args.kit or DEFAULT_ROWS:
        label, env, flags = parse_kit_variant(text)
        check_kit_flags(row_argv({**common, "flags": flags}), text)
        jobs.append({**common, "name": label, "flags": flags, "env": env})
    return jobs


def program_row(text: str, hardware: str) -> dict:
    """A row from an optimised XLA:GPU module's text (`--program`): its kernels and their
    traffic, GEMM FLOPs (library calls and GEMM fusions: `hlo.computation_dot_flops`) and
    floor on the --hardware's bandwidth and peak. ValueError if it has no kernels."""
    module = hlo.parse_module(text)
    found = kernels.kernels(module, lambda comp: hlo.computation_dot_flops(module, comp))
    if not found:
        raise ValueError("no kernels in it")
    gpu = kernels.traffic(found, targets.memory_bandwidth(hardware),
                          ic.HARDWARE[hardware].peak_flops, kernels.RATES[hardware])
    return {"memory": None, "gpu_program": gpu, "flops": {"program_per_device": gpu["flops"]},
            "compile_s": None}


def read_programs(specs: list[str], hardware: str) -> list[dict]:
    """The `--program LABEL=FILE` rows; UsageError, naming the flag, for a bad one.

    `--program LABEL=FILE` (repeatable) adds a row read from an optimised XLA:GPU module that a
    GPU compiled itself, autotuned: the same kernels, traffic, TFLOP and floor (on
    --hardware's bandwidth and peak), no memory or compile time. It needs no plugin. On the
    GPU, dump the training step's program, then compare it with the deviceless one:

        XLA_FLAGS="--xla_dump_to=gpu-dump --xla_dump_hlo_as_text \\
            --xla_dump_hlo_module_re=jit_train_step" python -m benchmarks.peers --only kit \\
            --batch 4096 --dtype bf16 --steps 2 --warmup 1
        python -m benchmarks.deviceless --kit "headline=" \\
            --program "gpu=$(ls gpu-dump/*jit_train_step*gpu_after_optimizations.txt)"

    With only --program given, nothing compiles.
    """
    rows = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label.strip() or not path:
            raise UsageError(f"--program {spec!r}: give LABEL=FILE")
        try:
            row = program_row(pathlib.Path(path).read_text(), hardware)
        except OSError as e:
            raise UsageError(f"--program {spec!r}: {e.strerror or e}") from None
        except ValueError as e:
            raise UsageError(f"--program {spec!r}: not an optimised XLA:GPU module ({e})") \
                from None
        rows.append({"name": label.strip(), "source": path, **row})
    return rows


def _figure(x: float) -> str:
    """Two decimals from 1 up (the H100's sizes), three significant digits below (a tiny
    model's)."""
    return f"{x:.2f}" if x >= 1 or x == 0 else f"{x:.3g}"


def table(rows: list[dict]) -> str:
    """The Markdown table of the rows (a failed row shows its error).

    Columns, per device and per step, from the compiled program:

        peak GiB       XLA's memory analysis: arguments + outputs - aliased + temporaries
                       (vit_pure/run/accum.py's StepMemory, as the plan reports it)
        kernels        kernels launched (fusions, library calls, copies, collectives)
        GB by class    HBM traffic, each kernel's operand + output bytes (a kit Pallas kernel:
                       the blocks its grid loads and stores), by class
                       (vit_pure/xla/kernels.py): GEMM, attention, norms/reductions,
                       elementwise, transposes/copies; "rest" is collectives and other
        TFLOP          matmul FLOPs of the program (cuBLAS calls and any dot left)
        int Gop        integer arithmetic outside the GEMMs, instructions x elements (random
                       bits, mostly: dropout masks); not in the floor
        floor ms       each kernel max(bytes / bandwidth, FLOPs / the fastest GEMM rate
                       measured) + a launch, summed: a floor, not a prediction of the step
        pred ms        the predicted step: each kernel max(bytes / (bandwidth x e_mem of its
                       class), FLOPs / (peak x e of its GEMM shape class or attention pass))
                       + its integer work + a launch, the efficiencies fitted class by class
                       to an H100 profile (vit_pure/xla/kernels.py, H100_RATES;
                       `benchmarks.fit_step --profile`); the JSON also has it by class
                       (`predicted_s_by_class`)
        compile s      the deviceless compile

    Under the table, each compiled row's predicted step on every described GPU (the same
    program at each one's bandwidth, peak and rates: the H100's compile priced for an H200).
    `--top N` then lists each row's N kernels that move the most bytes (vit_pure/xla/kernels.py).
    """
    head = (["row", "peak GiB", "kernels"] + [f"{c} GB" for c in SHOWN.values()]
            + ["rest GB", "total GB", "TFLOP", "int Gop", "floor ms", "pred ms", "compile s"])
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["name"], f"failed: {r['error']}"])
            continue
        g = r["gpu_program"]
        by = {k: v["bytes"] for k, v in g["classes"].items()}
        rest = g["bytes"] - sum(by.get(k, 0) for k in SHOWN)
        memory, compile_s = r["memory"], r["compile_s"]
        lines.append([r["name"], _figure(memory["total"] / 2**30) if memory else "-",
                      f"{g['kernels']:,}", *(_figure(by.get(k, 0) / 1e9) for k in SHOWN),
                      _figure(rest / 1e9), _figure(g["bytes"] / 1e9),
                      _figure(r["flops"]["program_per_device"] / 1e12),
                      _figure(g["int_ops"] / 1e9), _figure(g["floor_s"] * 1e3),
                      _figure(g["predicted_s"] * 1e3) if "predicted_s" in g else "-",
                      "-" if compile_s is None else f"{compile_s:.1f}"])
    return harness.markdown_table(head, lines, numeric=range(1, len(head)))


def build_parser() -> argparse.ArgumentParser:
    p = cli.doc_parser(__doc__)
    p.prog = "python -m benchmarks.deviceless"
    a = p.add_argument
    a("--model", default="vit-cifar", choices=sorted(PRESETS), help="model preset (all rows)")
    a("--batch", type=int, default=4096, help="global batch (all rows)")
    a("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="compute dtype")
    a("--gpus", type=int, default=1,
      help="GPUs to compile for (the plan's N; a row's --mesh lays them out)")
    a("--hardware", default="h100", choices=sorted(targets.GPU_TARGETS),
      help="the GPU described in vit_pure/plan/targets/")
    a("--kit", action="append", default=[], metavar="LABEL=FLAGS",
      help="a row with these extra training-script flags, after any NAME=VALUE environment "
           "variables for that row only (repeatable; default: the rows above)")
    a("--entry-timeout", type=float, default=600.0, help="seconds per row before it is killed")
    a("--top", type=int, default=0, metavar="N",
      help=f"after the table, each row's N kernels with the most traffic (at most "
           f"{kernels.LARGEST}: their class, output shape as laid out, JAX operation)")
    a("--program", action="append", default=[], metavar="LABEL=FILE",
      help="a row read from an optimised XLA:GPU module a GPU compiled (its "
           "*gpu_after_optimizations.txt dump; repeatable; see above)")
    a("--json", default=None, metavar="PATH", help="write every figure to this JSON file")
    return p


def parse(argv) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    cli.require_positive(p, args, "batch", "gpus", "entry_timeout")
    if not 0 <= args.top <= kernels.LARGEST:
        p.error(f"--top must be 0 to {kernels.LARGEST}, got {args.top}")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    programs = read_programs(args.program, args.hardware)
    jobs = build_jobs(args) if args.kit or not programs else []
    if jobs and not targets.cuda_plugin_installed():
        raise UsageError("JAX's CUDA plugin is not installed, so nothing can compile for the "
                         "GPU: pip install -r requirements-gpu.txt")
    record = {"command": harness.command_line("benchmarks.deviceless", argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "host": f"{platform.node()}, {os.cpu_count()} CPU cores",
              "versions": versions() | {"jax-cuda12-plugin":
                                        harness.package_version("jax-cuda12-plugin")},
              "model": args.model, "batch": args.batch, "dtype": args.dtype,
              "gpus": args.gpus, "hardware": args.hardware, "results": []}
    print(f"# deviceless {args.hardware} x {args.gpus}: {args.model}, batch {args.batch}, "
          f"{args.dtype}; {harness.machine_line()}")
    print(f"# command: {record['command']}", flush=True)
    for job in jobs:
        env = {**os.environ, **CHILD_ENV, **job["env"]}
        row = harness.run_child("benchmarks.deviceless", job, timeout=args.entry_timeout,
                                env=env)
        row.setdefault("name", job["name"])
        record["results"].append(row)
        print(f"# {row['name']}: " + (f"failed after {row['wall_s']:.0f} s: {row['error']}"
                                      if "error" in row else f"{row['wall_s']:.0f} s"),
              flush=True)
        if args.json:
            write_json(args.json, record)
    record["results"] += programs
    if args.json and programs:
        write_json(args.json, record)
    print()
    print(table(record["results"]))
    for row in record["results"]:
        on = (row.get("gpu_program") or {}).get("predicted_s_on")
        if on:
            print(f"{row['name']}: predicted step on " + ", ".join(
                f"{name} {s * 1e3:.1f} ms" for name, s in on.items())
                + " (this program, each GPU's bandwidth, peak and rates)")
    for row in record["results"] if args.top else ():
        if "error" not in row:
            print(f"\n{row['name']}: {kernels.largest_report(row['gpu_program'], args.top)}")
    return record


if __name__ == "__main__":
    if "--child" in sys.argv:
        job = json.loads(sys.argv[sys.argv.index("--child") + 1])
        sys.exit(harness.child_main(run_row, job))
    try:
        main()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
