r"""The pipeline schedules side by side: memory, compile time, modelled lockstep step time.

    python -m benchmarks.pipeline_schedules                      # ViT-B/16, pipe=4, H100
    python -m benchmarks.pipeline_schedules --stages 8 --json p8.json
    python -m benchmarks.pipeline_schedules --model tiny --batch 64 --stages 2 \
        --mult 1 2 --hardware cpu                                # a quick check

Each row is `train_shardmap.py --model M --batch B --dtype D --accum-steps 1 --mesh
data=1,pipe=P --microbatches K --pipeline-schedule S [--virtual-stages V] --remat R --plan P
--hardware H`, in a process of its own (benchmarks/harness.py's child runner): the plan's
compile of the whole training step, deviceless for a GPU target (JAX's CUDA plugin, no
GPU). The columns, per device: `table`; the F / B / I / W costs the modelled columns use:
`stage_costs`. Fake CPU devices share this machine's cores, so no step time is measured here.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

import train_shardmap  # imports jax, but starts no backend
from benchmarks import harness
from vit_pure import model
from vit_pure.config import PRESETS, Execution
from vit_pure.pipeline import schedules
from vit_pure.pipeline.split import Split
from vit_pure.run import backend

CHILD_ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
MIB = 2.0 ** 20


# ============================================================================= the child
def row_argv(job: dict) -> list[str]:
    flags = ["--pipeline-schedule", job["schedule"]]
    if job["schedule"] == "interleaved":
        flags += ["--virtual-stages", str(job["virtual"])]
    if job.get("image_size"):
        flags += ["--image-size", str(job["image_size"])]
    flags += ["--remat", job.get("remat", "none")]
    return ["--model", job["model"], "--batch", str(job["batch"]), "--dtype", job["dtype"],
            "--accum-steps", "1", "--mesh", f"data=1,pipe={job['stages']}", "--microbatches",
            str(job["microbatches"]), *flags, "--plan", str(job["stages"]),
            "--hardware", job["hardware"]]


def run_row(job: dict) -> dict:
    record = train_shardmap.main(row_argv(job))
    p2p = [c for c in record["collectives"] if c["kind"] == "collective-permute"]
    return {**job, "memory": record["memory"], "compile_s": record["compile_s"],
            "compiled_for": record["compiled_for"],
            "p2p_count": sum(c["count"] for c in p2p),
            "p2p_bytes": sum(c["count"] * c["bytes"] for c in p2p)}


# ==================================================================== the stage's costs
def stage_costs(cfg_name: str, stages: int, micro: int, dtype: str,
                hardware: str = "h100", image_size: int | None = None,
                remat: str = "none") -> dict:
    """FLOPs of one stage's F, B, I, W at `micro` examples, with the matmul output dtype
    the training script picks for `hardware`.

    The F / B / I / W costs of the model come from one compiled stage (depth/P blocks at the
    micro-batch's size, the matmul output dtype the script picks for --hardware, XLA:CPU
    `cost_analysis()` FLOPs): F its forward; B its whole pull-back and I zb-h1's input side
    (pipeline/split.py: the pull-back with the weight matmuls' weights held constant), each
    compiled with its forward and the forward's FLOPs taken off; W zb-h1's weight side
    compiled alone, from the activations and output cotangents F and I keep for it, as
    pipeline/tick.py runs them. Fake CPU devices share this machine's cores, so no step
    time is measured here.
    """
    cfg = PRESETS[cfg_name]
    cfg = cfg.replace(image_size=image_size) if image_size else cfg
    policy = backend.resolve(dtype, "default", None, "cpu" if hardware == "cpu" else "gpu",
                             flags=frozenset()).policy
    per = cfg.depth // stages
    blocks = jax.eval_shape(lambda: model.init_params(jax.random.key(0), cfg)["blocks"])
    blocks = jax.tree.map(lambda a: jax.ShapeDtypeStruct((per, *a.shape[1:]),
                                                         policy.compute_dtype), blocks)
    x = jax.ShapeDtypeStruct((micro, cfg.seq_len, cfg.width), policy.compute_dtype)

    def f(p, x):
        return model.encoder(p, x, cfg, policy, execution=Execution(remat=remat))

    def flops(fn, *args):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        return float(cost["flops"])

    def b(p, x):  # B: the whole pull-back
        y, pull = jax.vjp(f, p, x)
        return pull(jnp.ones_like(y))

    # I and W as pipeline/tick.py runs them (split.py): I is F's pull-back with the
    # weight matmuls' weights held constant; W compiled alone, from I's kept arrays.
    split = Split(f, blocks, x)

    def i(p, x):
        y, pull, acts = split.forward(p, x)
        return split.input_grads(pull(jnp.ones_like(y))), acts

    (_, _, dys), acts = jax.eval_shape(i, blocks, x)
    t_f = flops(f, blocks, x)
    return {"F": t_f, "B": flops(b, blocks, x) - t_f, "I": flops(i, blocks, x) - t_f,
            "W": flops(lambda p, a, d: split.weight_grads(p, a, d), blocks, acts, dys)}


def modelled(name: str, P: int, M: int, V: int, c: dict) -> tuple:
    """(lockstep time in FLOPs, bubble, residual sets the busiest stage holds, the
    pairwise time)."""
    s = schedules.build(name, P, M, V)  # the table the program runs
    costs = (c["F"], c["B"], c["W"], c["I"])
    t = schedules.lockstep_time(s, *costs)
    useful = M * (c["F"] + c["I"] + c["W"]) if s.split_backward else M * (c["F"] + c["B"])
    return (t, 1.0 - useful / t, int(schedules.in_flight(s).max()),
            schedules.pairwise_time(s, *costs))


# ============================================================================ the parent
def table(rows: list[dict]) -> str:
    """The rows as a Markdown table. Columns, per device:

        peak MiB    XLA's memory analysis of the compiled step: arguments + outputs -
                    aliased + temporaries; beside it, the share of GPipe's at the same K
        temp MiB    the temporaries alone: the activations (and the residual ring) live
                    here; beside it, the share of GPipe's
        compile s   the plan's lower + compile of the step
        p2p         the compiled program's collective-permutes over 'pipe': executions per
                    step and MiB per step (loop trip counts included)
        data        the sends that carry data, per stage and step (the table's 2 K V)
        held        residual sets (one micro-batch's activations through one chunk) the
                    busiest stage holds, from the schedule's table
        bubble      idle share of the stages' time in lockstep, from the table and the costs
        step / GPipe  the modelled lockstep step time (`schedules.lockstep_time`: each tick
                    as long as its busiest stage) over GPipe's at the same K
        pairwise    the same where a send waits only for its two stages
                    (`schedules.pairwise_time`, as NCCL's send / recv), over GPipe's
    """
    head = ["P", "K", "schedule", "peak MiB", "of GPipe", "temp MiB", "of GPipe", "compile s",
            "p2p (count, MiB)", "data", "held", "bubble", "step / GPipe", "pairwise"]
    gpipe = {(r["stages"], r["microbatches"]): r["memory"] for r in rows
             if r["schedule"] == "gpipe" and "memory" in r}
    out = []
    for r in rows:
        fixed = [r["stages"], r["microbatches"], r["label"]]
        if "error" in r:
            out.append(fixed + [f"failed: {r['error'][:80]}"])
            continue
        m = r["memory"]
        base = gpipe.get((r["stages"], r["microbatches"]))
        share = [f"{m[k] / base[k]:.3f}" if base else "" for k in ("total", "temp")]
        out.append(fixed + [f"{m['total'] / MIB:.1f}", share[0], f"{m['temp'] / MIB:.1f}",
                            share[1], f"{r['compile_s']:.1f}",
                            f"{r['p2p_count']}, {r['p2p_bytes'] / 2**20:.0f}",
                            r["data"], r["held"], f"{r['bubble']:.3f}", f"{r['relative']:.3f}",
                            f"{r['pairwise']:.3f}"])
    return harness.markdown_table(head, out,
                                  numeric=(0, 1, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--model", default="vit-b16", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=128, help="global batch (data=1)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--image-size", type=int, default=None, metavar="PX",
                   help="the model's resolution (default: the preset's)")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--remat", default="none", help="the training scripts' --remat")
    p.add_argument("--stages", type=int, nargs="+", default=[4], help="pipe sizes P")
    p.add_argument("--mult", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="micro-batch counts K = mult x P")
    p.add_argument("--schedules", nargs="+", default=list(schedules.SCHEDULES),
                   choices=schedules.SCHEDULES)
    p.add_argument("--virtual", type=int, default=2, help="interleaved: chunks per stage")
    p.add_argument("--no-compile", action="store_true",
                   help="only the table's model (no plan compiles)")
    p.add_argument("--row-timeout", type=float, default=1200.0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="print the table of saved --json runs (the model recomputed)")
    return p


def model_columns(row: dict, costs: dict) -> dict:
    """The table's columns of one row: held, bubble, step / GPipe."""
    P, M, V = row["stages"], row["microbatches"], row["virtual"]
    base = modelled("gpipe", P, M, 1, costs)[0]
    t, bub, held, pair = modelled(row["schedule"], P, M, V, costs)
    data = schedules.messages(schedules.build(row["schedule"], P, M, V))
    return {"label": row["schedule"] + (f" V={V}" if V > 1 else ""), "held": held,
            "bubble": bub, "relative": t / base, "data": data, "pairwise": pair / base}


def from_json(paths: list[str]) -> None:
    """Print the table of saved runs (their rows in order), the model recomputed."""
    rows = []
    for path in paths:
        with open(path) as f:
            saved = json.load(f)
        print(f"# {saved['command']}\n# {saved['machine']}")
        for row in saved["rows"]:
            rows.append({**row, **model_columns(row, saved["stage_costs"][str(row["stages"])])})
    rows.sort(key=lambda r: (r["stages"], r["microbatches"],
                             schedules.SCHEDULES.index(r["schedule"])))
    print(table(rows))


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.from_json:
        from_json(args.from_json)
        return {}
    record = {"command": harness.command_line("benchmarks.pipeline_schedules", argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": harness.machine_line(), "rows": []}
    print(f"# {record['command']}\n# {record['machine']}", flush=True)
    for P in args.stages:
        costs = stage_costs(args.model, P, max(1, args.batch // (8 * P)), args.dtype,
                            args.hardware, args.image_size, args.remat)
        record.setdefault("stage_costs", {})[P] = costs
        print(f"# P={P}: one stage's FLOPs at {max(1, args.batch // (8 * P))} examples: "
              + ", ".join(f"{k} {v / 1e9:.1f} G" for k, v in costs.items()), flush=True)
        for mult in args.mult:
            M = mult * P
            for name in args.schedules:
                V = args.virtual if name == "interleaved" else 1
                job = {"model": args.model, "batch": args.batch, "dtype": args.dtype,
                       "image_size": args.image_size, "remat": args.remat,
                       "hardware": args.hardware, "stages": P, "microbatches": M,
                       "schedule": name, "virtual": V}
                row = dict(job)
                if not args.no_compile:
                    row = harness.run_child("benchmarks.pipeline_schedules", job,
                                            timeout=args.row_timeout,
                                            env={**os.environ, **CHILD_ENV})
                    row = {**job, **row}
                row.update(model_columns(row, costs))
                if "memory" not in row and "error" not in row:
                    row["memory"] = {"total": float("nan"), "temp": float("nan")}
                    row.update(compile_s=float("nan"), p2p_count=0, p2p_bytes=0)
                record["rows"].append(row)
                print(f"# P={P} K={M} {row['label']}: "
                      + (row["error"] if "error" in row else "ok"), flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(record, f, indent=1, default=str)
    print()
    print(table(record["rows"]))
    return record


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.exit(harness.child_main(run_row, json.loads(sys.argv[sys.argv.index("--child") + 1])))
    main()
