"""How long does train_shardmap.py's training step take to trace and lower, before XLA
compiles it?

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.probes.trace_time --model vit-cifar --mesh data=4,pipe=2

Every flag but --repeats is train_shardmap.py's and sets the step as a run would. Each
repeat builds a fresh strategy (nothing reused from jit's caches), traces its training step
on abstract inputs (`planning.abstract_inputs`: no state is built) and lowers it to
StableHLO. Prints the median of each phase, and the StableHLO's size: the program handed
to XLA, whose compile the probe does not time. A pipeline's ticks are traced in Python,
so this is where its schedule's bookkeeping shows.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import train_shardmap
from benchmarks import bench, harness
from vit_pure.run import cli
from vit_pure.run.planning import abstract_inputs

MODULE = "benchmarks.probes.trace_time"


def build_parser() -> argparse.ArgumentParser:
    p = cli.doc_parser(__doc__)
    p.add_argument("--repeats", type=int, default=5, help="fresh traces timed (median)")
    return p


def measure(script_args: argparse.Namespace) -> dict:
    """One fresh strategy's trace and lower times, and its StableHLO's line count."""
    sc, optimizer = bench.script_setup(args=script_args)
    strategy = train_shardmap.strategy_from_args(script_args, sc, optimizer)
    inputs = abstract_inputs(strategy, optimizer, script_args.batch)
    start = time.perf_counter()
    traced = strategy.train_step.trace(*inputs)
    traced_at = time.perf_counter()
    text = traced.lower().as_text()
    return {"trace_s": traced_at - start, "lower_s": time.perf_counter() - traced_at,
            "lines": text.count("\n")}


def main(argv=None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be positive, got {args.repeats}")
    script_args = cli.parse_args(train_shardmap.build_parser(), rest)
    print(harness.command_line(MODULE, argv))
    print(harness.machine_line())
    runs = []
    for i in range(args.repeats):
        runs.append(measure(script_args))
        print(f"repeat {i + 1}/{args.repeats}: trace {runs[-1]['trace_s']:.2f} s, "
              f"lower {runs[-1]['lower_s']:.2f} s", flush=True)
    trace = statistics.median(r["trace_s"] for r in runs)
    lower = statistics.median(r["lower_s"] for r in runs)
    print(harness.markdown_table(
        ["step", "trace s (median)", "lower s (median)", "StableHLO lines"],
        [[f"{script_args.cfg.name}, --mesh {script_args.mesh}", f"{trace:.2f}",
          f"{lower:.2f}", str(runs[0]["lines"])]]))
    return 0


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
