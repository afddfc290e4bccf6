"""The one prepared GPU check: everything a short GPU loan should measure, in one command.

    python -m benchmarks.gpu_check --out gpu-check            # on the GPU: about 8 minutes
    python -m benchmarks.gpu_check --out /tmp/c --dry-run     # on a CPU: all but the timing

Parts, in order, each in a process of its own with its own time limit (seconds), each
writing what it has as it goes: DIR/gpu_check.json (every figure) and DIR/summary.md
(the tables), rewritten after every part, so a loan cut short keeps what was done.

    env      45   jax and torch versions, the device, and whether it is the GPU that
                  `--hardware h100` describes (vit_pure/plan/targets/)
    steps   200   benchmarks.peers, one fresh process per row, one run: the headline as
                  shipped, `--dropout-masks bernoulli` (against
                  the shipped threefry16), `--attention einsum`, and torch.compile:
                  img/s, step ms, peak GiB (DIR/steps.json, DIR/steps.md)
    log      45   the headline command itself (`train_shardmap.py --batch 4096 --dtype
                  bf16 --dataset synthetic`), its own log (DIR/headline.log)
    program 100   the headline's program as the GPU compiled it (XLA's dump), read by
                  `benchmarks.deviceless --program`, beside the deviceless compile of the
                  same flags: peak, kernels, traffic, floor, predicted step
                  (DIR/program.md)

`--dry-run` (any machine; the limits x4): env as it is; steps and log: their flags
checked by the training script's parser, nothing run; program: a deviceless compile of the
tiny model (where JAX's CUDA plugin is installed, else skipped). It uses only APIs present
in jax 0.10 and 0.11.
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

LIMITS = {"env": 45, "steps": 200, "log": 45, "program": 100}
DRY_SCALE = 4  # a dry run's limits: a small shared CPU
STEP_ROWS = ("as shipped=", "bernoulli=--dropout-masks bernoulli", "einsum=--attention einsum")
HEADLINE = ["--batch", "4096", "--dtype", "bf16", "--dataset", "synthetic", "--steps", "30",
            "--log-every", "10", "--eval-every", "0", "--no-progress"]


def _run(argv: list[str], limit: float, log: pathlib.Path, env: dict | None = None) -> dict:
    """A child process under a time limit; its output to `log`."""
    start = time.monotonic()
    with open(log, "w") as f:
        try:
            code = subprocess.run(argv, cwd=harness.REPO, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=limit, env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return {"status": "ok" if code == 0 else f"failed ({code})",
            "seconds": round(time.monotonic() - start, 1), "log": str(log)}


def _part(name: str, out: pathlib.Path, dry: bool) -> dict:
    """Run `--part NAME` in a child; its JSON result, or its failure."""
    result = out / f"{name}.json"
    argv = [sys.executable, "-m", "benchmarks.gpu_check", "--part", name, "--out", str(out)]
    run = _run(argv + (["--dry-run"] if dry else []), LIMITS[name] * (DRY_SCALE if dry else 1),
               out / f"{name}.log")
    if run["status"] == "ok" and result.exists():
        return {**json.loads(result.read_text()), "seconds": run["seconds"]}
    return run


def _steps(out: pathlib.Path, dry: bool) -> dict:
    from benchmarks.peers.driver import check_kit_flags, parse_kit_variant
    argv = [sys.executable, "-m", "benchmarks.peers", "--batch", "4096", "--dtype", "bf16",
            "--steps", "8", "--warmup", "3", "--only", "kit,torch-compile",
            "--entry-timeout", "60", "--json", str(out / "steps.json")]
    for row in STEP_ROWS:
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


def summary(record: dict) -> str:
    """The Markdown summary of what the record holds so far."""
    kind = "dry run" if record["dry_run"] else "timed"
    lines = ["# GPU check", "", f"{record['started']}, {kind}", ""]
    env = record["parts"].get("env", {})
    if env.get("status") == "ok":
        lines += [f"device: {env['device']} ({env['platform']}), jax {env['jax']}, torch "
                  f"{env.get('torch')}, Python {env['python']}; `--hardware h100` "
                  f"describes {env['h100_description']!r}: "
                  f"{'the same GPU' if env['is_h100'] else 'another GPU'}", ""]
    for name in ("steps", "log", "program"):
        part = record["parts"].get(name)
        if part:
            lines.append(f"- {name}: {part.get('status')}"
                         + (f", {part['seconds']} s" if "seconds" in part else "")
                         + (f" ({part['log']})" if "log" in part else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = cli.doc_parser(__doc__)
    p.prog = "python -m benchmarks.gpu_check"
    p.add_argument("--out", required=True, help="folder for the results")
    p.add_argument("--dry-run", action="store_true", help="all but the timing (any machine)")
    p.add_argument("--part", choices=["env", "program"], help=argparse_hidden())
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part:  # a child: one part, its JSON
        from benchmarks import gpu_check_parts
        result = getattr(gpu_check_parts, args.part)(out, args.dry_run)
        (out / f"{args.part}.json").write_text(json.dumps(result, indent=1))
        return 0
    record = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.dry_run,
              "limits_s": LIMITS, "parts": {}}
    for name in LIMITS:
        try:
            part = (_steps(out, args.dry_run) if name == "steps" else
                    _log(out, args.dry_run) if name == "log" else
                    _part(name, out, args.dry_run))
        except UsageError as e:
            part = {"status": f"refused: {e}"}
        record["parts"][name] = part
        harness_write(out / "gpu_check.json", record)
        (out / "summary.md").write_text(summary(record))
        print(f"{name}: {part.get('status')}", flush=True)
    return 0


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
