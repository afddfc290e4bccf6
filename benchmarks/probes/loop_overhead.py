"""The training loop against the step alone: what the loop's own log reports, and what
benchmarks.bench times for the same compiled step, in one process.

    python -m benchmarks.probes.loop_overhead --model tiny --batch 128 --steps 240 --log-every 20
    python -m benchmarks.probes.loop_overhead --batch 4096 --dtype bf16 --steps 240 --log-every 20

The loop is `train_shardmap.main` with the headline command's shape (synthetic data, 10
steps an epoch, a validation pass after each: `--eval-every 0` leaves them out); its figure
is the median `images_per_s` of its JSON log, the first point (compiling) left out. The
step alone is `benchmarks.bench.measure_train_step` of the same settings. The two
alternate `--repeats` times, so drift on a shared machine falls on both; the last line
prints both medians and the ratio loop / step. The figures: docs/performance.md, "The
training loop against the step alone".
"""
from __future__ import annotations

import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import jax

import train_shardmap
from benchmarks import bench
from vit_pure.config import PRESETS
from vit_pure.policy import Policy
from vit_pure.run import cli, hostmem


def loop_rates(args, log: pathlib.Path) -> list[float]:
    """The training loop's logged img/s, after its first log point."""
    argv = ["--model", args.model, "--batch", str(args.batch), "--policy", args.dtype,
            "--dataset", "synthetic", "--synthetic-train", str(10 * args.batch),
            "--synthetic-val", str(args.synthetic_val), "--synthetic-test", "0",
            "--eval-every", str(args.eval_every), "--steps", str(args.steps),
            "--log-every", str(args.log_every), "--accum-steps", "1", "--no-progress",
            "--no-final-eval", "--log-json", str(log)]
    train_shardmap.main(argv)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r["images_per_s"] for r in records if "images_per_s" in r][1:]


def step_rates(args) -> list[float]:
    """benchmarks.bench's timing of the same step: img/s of each timed step."""
    sc, optimizer = bench.training_setup(args.model, args.batch, args.dtype,
                                         total_steps=args.steps)
    strategy = bench.make_strategy("shard_map", "", sc, optimizer, jax.devices())
    res = bench.measure_train_step(strategy, sc, optimizer, args.batch,
                                   steps=args.bench_steps, warmup=3)
    return [args.batch / s for s in res["step_s"]]


def main(argv=None) -> dict:
    p = cli.doc_parser(__doc__)
    p.add_argument("--model", default="vit-cifar", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--dtype", default="fp32", help="the scripts' --policy (fp32, bf16, ...)")
    p.add_argument("--steps", type=int, default=240, help="the loop's --steps (> 100, so "
                   "that --log-every applies)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument("--synthetic-val", type=int, default=None,
                   help="validation images (default: the headline's 5000 per 45000 training "
                        "images, i.e. two evaluation batches per validation pass)")
    p.add_argument("--bench-steps", type=int, default=40, help="timed steps of the step alone")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    cli.require_positive(p, args, "batch", "steps", "log_every", "bench_steps", "repeats")
    for name in ("eval_every", "synthetic_val"):
        if (getattr(args, name) or 0) < 0:
            p.error(f"{cli.flag_name(name)} must be >= 0, got {getattr(args, name)}")
    try:
        Policy.parse(args.dtype)
    except ValueError as e:
        p.error(f"--dtype: {e}")
    if args.synthetic_val is None:
        args.synthetic_val = -(-10 * args.batch * 5000 // 45000)
    print(f"{platform.processor() or platform.machine()}, jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind} x{len(jax.devices())}, {time.strftime('%Y-%m-%d')}")
    loop_all, step_all = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            s = step_rates(args)
            l_ = loop_rates(args, pathlib.Path(tmp) / f"log{i}.jsonl")
            print(f"repeat {i + 1}: step alone median {statistics.median(s):,.1f} img/s; "
                  f"loop log median {statistics.median(l_):,.1f} img/s "
                  f"({len(l_)} log points: {', '.join(f'{r:,.0f}' for r in l_)})", flush=True)
            step_all += s
            loop_all += l_
    step_med, loop_med = statistics.median(step_all), statistics.median(loop_all)
    print(f"{args.model} batch {args.batch} {args.dtype}, --log-every {args.log_every}, "
          f"--eval-every {args.eval_every}: step alone {step_med:,.1f} img/s, loop log "
          f"{loop_med:,.1f} img/s, loop / step {loop_med / step_med:.3f}")
    return {"step": step_med, "loop": loop_med, "ratio": loop_med / step_med}


if __name__ == "__main__":
    hostmem.use_huge_pages()  # as the training scripts do
    sys.exit(cli.main_guard(main))  # flags the training script refuses: one line, exit 2
