"""The one prepared GPU check: everything a short GPU loan should measure, in one command.

    python -m benchmarks.gpu_check --out gpu-check            # on the GPU: at most 8 minutes
    python -m benchmarks.gpu_check --out /tmp/c --dry-run     # on a CPU: all but the timing (_part)

Parts, in order, each in a process of its own with its own time limit: env (versions, the
device), steps (benchmarks.peers rows), log (the headline command's own log), profile (the
shipped step's program and kernel times), gemms (each GEMM timed alone), program (that
program read by benchmarks.deviceless) and attention (the Pallas kernel's gradients); what
each writes: the comment above LIMITS.
DIR/gpu_check.json (every figure) and DIR/summary.md (the tables) are rewritten after
every part, so a loan cut short keeps what was done.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

from benchmarks import harness
from vit_pure.errors import UsageError
from vit_pure.run import cli

# The parts, in order, with their time limits in seconds (LIMITS):
#   env      jax and torch versions, the device, and which `--hardware` describes it
#            (vit_pure/plan/targets/: h100, h200), used by the parts below
#   steps    benchmarks.peers, one fresh process per row, one run: torch.compile first,
#            then the headline as shipped, `--last-block all` (the last block on every
#            token: torch.compile's work), the untimed opt-in and A/B rows (STEP_ROWS),
#            the GELU-epilogue candidates (GELU_ROWS: XLA settings) and the headline
#            again (LAST_ROWS): img/s, step ms, peak GiB (DIR/steps.json, .md); each
#            kit row's program as compiled there (DIR/programs/: what the predictor's
#            test reads)
#   log      the headline command itself (`train_shardmap.py --batch 4096 --dtype bf16
#            --dataset synthetic`), its own log (DIR/headline.log)
#   profile  the shipped step: its program (DIR/step.hlo.txt), step ms (pipelined, on
#            inputs staged beforehand), and each kernel's device time from a
#            jax.profiler trace joined to that program, by the predictor's classes
#            (DIR/kernel_times.json: what `benchmarks.fit_step --profile` fits)
#   gemms    each distinct GEMM of that program timed alone at its shape, layout and
#            dtypes: TFLOP/s per shape (DIR/gemm_shapes.json)
#   program  that program read by `benchmarks.deviceless --program`, beside the
#            deviceless compile of the same flags where the CUDA 12 plugin is: kernels,
#            traffic, floor, predicted step (DIR/program.md)
#   attention the Pallas kernel's gradients against the einsum path's on that GPU
#            (`benchmarks.probes.attention_check`, ATTENTION_CHECK; DIR/attention.log),
#            its three compiles without GEMM autotuning (ATTENTION_ENV: the algorithms
#            change the rounding, not what is compared)
LIMITS = {"env": 15, "steps": 265, "log": 40, "profile": 45, "gemms": 25, "program": 15,
          "attention": 75}
CHILD_PARTS = ("env", "profile", "gemms", "program")  # run by gpu_check_parts
# A dry run's limit for each part: the limits above are the GPU's; a small CPU that another
# job shares compiles even the tiny model's programs for a minute or more.
DRY_LIMIT_S = 240
# The rows no GPU has settled: the Pallas attention (opt-in until measured), the folded
# LayerNorms (faster in one round: a second before it ships), and the shipped step again
# last, the run's own drift. Settled and left out: q, k, v's data gradients summed by JAX
# (as fast as the shipped chain), `--remat gelu` (docs/performance.md).
STEP_ROWS = ("as shipped=", "every row=--last-block all", "layer norm fold=--layer-norm fold",
             "pallas attention=--attention pallas")
# The GELU back in fc1's GEMM epilogue (docs/performance.md, "The GELU epilogue"): without
# Triton GEMMs the GPU's compile fuses it (GELU_AUX and BIAS epilogues), a program the
# predictor prices well under the shipped one; the row that showed it also set autotuning
# off, which left cuBLAS its untuned algorithms and the step slower. So: the setting alone,
# then with the folded LayerNorms. The code forms of fc1 (`--fc1-output float32`, `--biases
# fc1-epilogue`) fused nothing and left the check.
GELU_ROWS = ("gelu: no triton gemm=XLA_FLAGS=--xla_gpu_enable_triton_gemm=false",
             "gelu: no triton gemm, layer norm fold=XLA_FLAGS=--xla_gpu_enable_triton_gemm=false"
             " --layer-norm fold")
LAST_ROWS = ("as shipped, again=",)
ATTENTION_CHECK = ["--attention", "pallas", "--check-batch", "32", "--steps", "0"]
ATTENTION_ENV = {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
HEADLINE = ["--batch", "4096", "--dtype", "bf16", "--dataset", "synthetic", "--steps", "30",
            "--log-every", "10", "--eval-every", "0", "--no-progress"]


def _run(argv: list[str], limit: float, log: pathlib.Path, env: dict | None = None) -> dict:
    """A child process under a time limit; its output to `log`, unbuffered (a child cut
    at its limit keeps what it printed)."""
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            code = subprocess.run(argv, cwd=harness.REPO, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=limit,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
                                  ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return {"status": "ok" if code == 0 else f"failed ({code})",
            "seconds": round(time.monotonic() - start, 1), "log": str(log)}


def part_limit(name: str, dry: bool) -> float:
    """A part's time limit in seconds: LIMITS on a GPU, DRY_LIMIT_S in a dry run."""
    return DRY_LIMIT_S if dry else LIMITS[name]


def _part(name: str, out: pathlib.Path, dry: bool) -> dict:
    """Run `--part NAME` in a child; its JSON result, or its failure.

    `--dry-run` (any machine; DRY_LIMIT_S each): env as it is; steps and log: their flags
    checked by the training script's parser, nothing run; profile and gemms: the tiny model on
    this machine's XLA (the code runs, the figures mean nothing); program: a deviceless compile
    of the tiny model (where JAX's CUDA plugin is installed, else skipped). It uses only APIs
    present in jax 0.10 and 0.11.
    """
    result = out / f"{name}.json"
    argv = [sys.executable, "-m", "benchmarks.gpu_check", "--part", name, "--out", str(out)]
    run = _run(argv + (["--dry-run"] if dry else []), part_limit(name, dry),
               out / f"{name}.log")
    if run["status"] == "ok" and result.exists():
        return {**json.loads(result.read_text()), "seconds": run["seconds"]}
    return run


def _steps(out: pathlib.Path, dry: bool) -> dict:
    from benchmarks.peers.driver import check_kit_flags, parse_kit_variant
    argv = [sys.executable, "-m", "benchmarks.peers", "--batch", "4096", "--dtype", "bf16",
            "--steps", "8", "--warmup", "3", "--only", "torch-compile,kit",
            "--entry-timeout", "60", "--json", str(out / "steps.json"),
            "--programs", str(out / "programs")]
    for row in STEP_ROWS + GELU_ROWS + LAST_ROWS:
        check_kit_flags(parse_kit_variant(row)[2], row)
        argv += ["--kit", row]
    if dry:
        return {"status": "dry run: flags checked", "command": argv}
    run = _run(argv, LIMITS["steps"], out / "steps.md")
    return {**run, "command": argv}


def _log(out: pathlib.Path, dry: bool) -> dict:
    import train_shardmap
    argv = [sys.executable, "train_shardmap.py", *HEADLINE]
    cli.parse_args(train_shardmap.build_parser(), HEADLINE)  # the flags parse
    if dry:
        return {"status": "dry run: flags checked", "command": argv}
    return {**_run(argv, LIMITS["log"], out / "headline.log"), "command": argv}


def _attention(out: pathlib.Path, dry: bool) -> dict:
    from benchmarks.probes import attention_check
    argv = [sys.executable, "-m", "benchmarks.probes.attention_check", *ATTENTION_CHECK]
    attention_check.build_parser().parse_args(ATTENTION_CHECK)  # the flags parse
    if dry:
        return {"status": "dry run: flags checked", "command": argv}
    return {**_run(argv, LIMITS["attention"], out / "attention.log", ATTENTION_ENV),
            "command": argv}


def summary(record: dict) -> str:
    """The Markdown summary of what the record holds so far."""
    kind = "dry run" if record["dry_run"] else "timed"
    lines = ["# GPU check", "", f"{record['started']}, {kind}", ""]
    env = record["parts"].get("env", {})
    if env.get("status") == "ok":
        hardware = env.get("hardware")
        lines += [f"device: {env['device']} ({env['platform']}), jax {env['jax']}, torch "
                  f"{env.get('torch')}, Python {env['python']}; "
                  + (f"described by `--hardware {hardware}`" if hardware else
                     "no `--hardware` describes it (h100's figures used)"), ""]
    for name in LIMITS:
        if name == "env":
            continue
        part = record["parts"].get(name)
        if part:
            lines.append(f"- {name}: {part.get('status')}"
                         + (f", {part['seconds']} s" if "seconds" in part else "")
                         + (f" ({part['log']})" if "log" in part else ""))
    for name in ("profile", "gemms"):
        part = record["parts"].get(name, {})
        if part.get("table"):
            lines += ["", f"## {name}", "", part["table"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = cli.doc_parser(__doc__)
    p.prog = "python -m benchmarks.gpu_check"
    p.add_argument("--out", required=True, help="folder for the results")
    p.add_argument("--dry-run", action="store_true", help="all but the timing (any machine)")
    p.add_argument("--part", choices=CHILD_PARTS, help=argparse_hidden())
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part:  # a child: one part, its JSON
        from benchmarks import gpu_check_parts
        if args.part == "gemms":
            result = gpu_check_parts.gemm_shapes(out, args.dry_run,
                                                 part_limit("gemms", args.dry_run))
        else:
            result = getattr(gpu_check_parts, args.part)(out, args.dry_run)
        (out / f"{args.part}.json").write_text(json.dumps(result, indent=1))
        return 0
    record = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.dry_run,
              "limits_s": LIMITS, "parts": {}}
    for name in LIMITS:
        try:
            part = (_steps(out, args.dry_run) if name == "steps" else
                    _log(out, args.dry_run) if name == "log" else
                    _attention(out, args.dry_run) if name == "attention" else
                    _part(name, out, args.dry_run))
            if name in ("profile", "gemms") and part.get("status") == "ok":
                part["table"] = part_table(name, part)
        except UsageError as e:
            part = {"status": f"refused: {e}"}
        record["parts"][name] = part
        harness_write(out / "gpu_check.json", record)
        (out / "summary.md").write_text(summary(record))
        print(f"{name}: {part.get('status')}", flush=True)
    return 0


def part_table(name: str, part: dict) -> str:
    """The profile's time per class, or the GEMM shapes' TFLOP/s, as Markdown."""
    if name == "profile":
        rows = [[k, f"{v:.2f}"] for k, v in part["classes_ms"].items()]
        rows += [["(no kernel of the program)", f"{part['unmatched_ms']:.2f}"],
                 ["kernels, all", f"{part['kernels_ms']:.2f}"],
                 ["step (pipelined, inputs staged)", f"{part['step_ms']:.2f}"]]
        if part.get("step_ms_trace") is not None:
            rows.append(["step in the trace (start to start)", f"{part['step_ms_trace']:.2f}"])
        return harness.markdown_table(["class", "ms per step"], rows, numeric=[1])
    rows = [[r["gemm"], str(r["runs"]), f"{r['gflop']:.1f}", f"{r['ms']:.3f}",
             f"{r['tflop_per_s']:.0f}", f"{100 * r['of_peak']:.0f}%"] for r in part["shapes"]]
    return harness.markdown_table(["GEMM", "per step", "GFLOP", "ms", "TFLOP/s", "of peak"],
                                  rows, numeric=range(1, 6))


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


def harness_write(path: pathlib.Path, record: dict) -> None:
    """Written aside, then renamed over: a check cut short leaves a whole file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
