"""How long does a fresh start's random initialisation take, compiling included?

    python -m benchmarks.probes.init_time                          # vit-cifar, cpu-quick's, tiny
    python -m benchmarks.probes.init_time --models vit-b16 --ema

Each figure in a fresh interpreter (nothing compiled yet, as at a run's start), timed once:

    init_params  `model.init_params(key, cfg)`, waited for: the parameters alone
    init_state   `step.init_state` with AdamW, as the training loop builds it: the
                 parameters and the optimizer's state, what a fresh run waits for after
                 its line "initialising the ... state"

A first call is what a run pays, so no repeats and no median: run the probe twice to see
the spread. docs/performance.md, "Starting a run", has the figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax

from benchmarks import harness
from vit_pure.config import PRESETS, get_preset
from vit_pure.model import init_params
from vit_pure.policy import Policy
from vit_pure.run import cli
from vit_pure.step import OptimConfig, init_state, make_optimizer

MODULE = "benchmarks.probes.init_time"


def build_parser() -> argparse.ArgumentParser:
    p = cli.doc_parser(__doc__)
    p.add_argument("--models", default="vit-cifar,vit-cifar-conv-lsa,tiny",
                   help="comma-separated presets, each timed in its own process")
    p.add_argument("--ema", action="store_true", help="the state holds an EMA of the params")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def measure(job: dict) -> dict:
    """One model's times, in this (fresh) process."""
    cfg = get_preset(job["model"])
    optimizer, _ = make_optimizer(OptimConfig(), 1000)
    start = time.perf_counter()
    if job["what"] == "init_params":
        jax.block_until_ready(init_params(jax.random.key(0), cfg))
    else:
        jax.block_until_ready(init_state(jax.random.key(0), cfg, Policy.parse("fp32"),
                                         optimizer, ema=job["ema"]))
    return {"seconds": time.perf_counter() - start}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return harness.child_main(measure, json.loads(args.child))
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in PRESETS]
    if unknown or not models:
        print(f"error: --models: unknown preset(s) {', '.join(unknown) or '(none)'}; choose "
              f"from {', '.join(sorted(PRESETS))}", file=sys.stderr)
        return 2
    print(harness.command_line(MODULE, argv))
    print(harness.machine_line())
    rows = []
    for model in models:
        row = [model]
        for what in ("init_params", "init_state"):
            r = harness.run_child(MODULE, {"model": model, "ema": args.ema, "what": what},
                                  timeout=600)
            row += [r["error"] if "error" in r else f"{r['seconds']:.2f}", f"{r['wall_s']:.1f}"]
        rows.append(row)
    print(harness.markdown_table(["model", "init_params s", "its process s", "init_state s",
                                  "its process s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
