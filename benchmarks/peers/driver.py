r"""Peer benchmark: this kit's training step against Flax NNX and PyTorch, same ViT, one device.

    python -m benchmarks.peers --batch 4096 --dtype bf16 \
        --kit "as written=" --kit "no-scan=--no-scan" --kit "nodrop=--no-scan --dropout 0"
    python -m benchmarks.peers --only kit --kit "cublaslt=XLA_FLAGS=--xla_gpu_enable_cublaslt=true"
    python -m benchmarks.peers --model tiny --batch 16 --steps 2 --warmup 1     # a CPU smoke test

Times, in one run on one device, the same training step (forward, backward, AdamW update
of a ViT on random CIFAR-shaped uint8 batches, normalised on the device) written several
ways, and prints one markdown table. The entries (kit, nnx, torch-eager, torch-compile)
and what is and is not the same for all: `build_jobs`; the columns: `markdown_table`;
each entry's process and environment: `run_child`; `--kit LABEL=FLAGS` rows: above
`parse_kit_variant`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import re
import statistics
import sys

import train_shardmap  # imports jax, but starts no backend (nor do the three below)
from benchmarks import harness, profile_breakdown
from benchmarks.peers import kit as kit_child
from vit_pure.config import PRESETS, get_preset
from vit_pure.data.cifar10 import CIFAR10_MEAN, CIFAR10_STD
from vit_pure.errors import UsageError
from vit_pure.run import cli, hostmem
from vit_pure.xla.flops import train_flops_per_image

PEERS = ("kit", "nnx", "torch-eager", "torch-compile")
NEEDS = {"nnx": "flax", "torch-eager": "torch", "torch-compile": "torch"}
# The module each entry's child runs: a peer's child imports its framework only.
CHILD = {"ceiling": "benchmarks.peers.kit", "kit": "benchmarks.peers.kit",
         "profile-kit": "benchmarks.peers.kit", "nnx": "benchmarks.peers.flax_nnx",
         "torch-eager": "benchmarks.peers.pytorch", "torch-compile": "benchmarks.peers.pytorch"}


# ============================================================================ the parent
# `--kit LABEL=FLAGS` (repeatable) adds one row per set of extra flags; FLAGS are the
# training script's flags, after any NAME=VALUE words, which set environment variables for
# that row's process only. Without --kit: one row, no extra flags. --profile-kit DIR also
# traces 3 steps of the first kit row with jax.profiler and prints
# benchmarks/profile_breakdown.py's breakdown of it (`profile_kit`).
def parse_kit_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    """`LABEL=[NAME=VALUE ...] FLAGS` -> (label, the row's environment variables, the
    training script's flags): harness.parse_kit_row, as a UsageError."""
    try:
        return harness.parse_kit_row(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check_kit_flags(flags: list[str], text: str) -> None:
    """Refuse flags the training script would refuse, before any entry runs."""
    def refuse(message):
        raise UsageError(f"--kit {text!r}: the training script refuses it: {message}")

    parser = train_shardmap.build_parser()
    parser.error = refuse
    parser.parse_args(flags)


def build_jobs(args) -> list[dict]:
    """One job per table row, in the order they run. The entries:

        kit            this kit's real step, built exactly as `train_shardmap.py --batch B
                       --dtype D --dataset synthetic --accum-steps 1 [FLAGS]` builds it (its
                       parser, settings.step_config, make_optimizer, ShardMapStrategy on one
                       device), timed by benchmarks/bench.py's measure_train_step, which drives the
                       compiled step as the training loop does. So the whole recipe is in:
                       flip + crop and RandAugment on the device, label smoothing, clipping.
                       `--kit LABEL=FLAGS` (repeatable) adds one row per set of extra flags;
                       FLAGS are the training script's flags (e.g. "nodrop=--dropout 0"),
                       after any NAME=VALUE words, which set environment variables for that
                       row's process only, as in a shell (e.g. "cublaslt=XLA_FLAGS=
                       --xla_gpu_enable_cublaslt=true": an XLA or JAX setting A/B'd in
                       one run; the row's JSON records the values its process saw).
                       Without --kit: one row, no extra flags.
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
    """
    cfg = dataclasses.asdict(get_preset(args.model))
    common = {"model": args.model, "cfg": cfg, "batch": args.batch, "dtype": args.dtype,
              "precision": args.matmul_precision, "steps": args.steps,
              "warmup": args.warmup, "compile_mode": args.torch_compile_mode,
              "mean": list(CIFAR10_MEAN), "std": list(CIFAR10_STD)}
    jobs = []
    for entry in args.only:
        if entry != "kit":
            jobs.append({**common, "entry": entry, "name": entry})
            continue
        for text in args.kit or ["="]:
            label, env, flags = ("", {}, []) if text == "=" else parse_kit_variant(text)
            check_kit_flags(kit_child.kit_argv({**common, "kit_flags": flags}), text)
            jobs.append({**common, "entry": "kit", "name": f"kit: {label}" if label else "kit",
                         "kit_flags": flags, "kit_env": env})
            if args.programs:
                jobs[-1]["program_path"] = str(pathlib.Path(args.programs)
                                               / f"{program_name(label)}.hlo.txt.gz")
    return jobs


def program_name(label: str) -> str:
    """A kit row's label as a file name: "kit" for the unlabelled row, else the label's
    letters and digits, the rest as one "-" ("every row" -> "kit-every-row")."""
    words = re.findall(r"[a-z0-9]+", label.lower())
    return "-".join(["kit", *words])


def run_child(job: dict, timeout: float) -> dict:
    """Run one job in a fresh interpreter (harness.run_child, killed at the timeout); its
    row, or {"name", "error": its last error line, ...}.

    Each entry runs in its own Python process (JAX preallocates device memory; JAX and
    torch never share a process), only if its package imports (else the row says
    "skipped"), under --entry-timeout seconds; a failing entry shows its last error line.
    Each entry runs as its users run it: the kit's rows with the huge-page malloc tunable
    that its training scripts set (vit_pure/run/hostmem.py; VIT_PURE_HUGEPAGES=0 turns it off),
    the ceiling and the peers in the environment as given (on a CPU the tunable makes the
    kit's step ~20% faster and did not speed up the peers: docs/performance.md; the header
    prints both settings).
    """
    # The kit's rows run with the host malloc setting its training scripts choose (huge
    # pages, vit_pure/run/hostmem.py) and the row's own NAME=VALUE words (its profile too); the
    # ceiling and the peers with the environment as given.
    env = ({**hostmem.environ(), **job.get("kit_env", {})}
           if job["entry"] in ("kit", "profile-kit") else None)
    row = harness.run_child(CHILD[job["entry"]], job, timeout=timeout, env=env)
    if "error" in row and "timed out" in row["error"]:
        row["error"] += " (--entry-timeout)"
    return {"name": job["name"], **row}


def skipped(job: dict) -> dict | None:
    """The row of a peer that cannot run here, without starting its child."""
    package = NEEDS.get(job["entry"])
    if package and importlib.util.find_spec(package) is None:
        return {"name": job["name"], "skipped": f"skipped: {package} not installed"}
    if package and job["cfg"]["image_size"] != 32:  # the batches are CIFAR-shaped
        return {"name": job["name"],
                "error": "the peers take 32 px images (the kit resizes; they do not)"}
    return None


def markdown_table(results: list[dict], flops_per_image: float,
                   ceiling_flops: float | None) -> str:
    """The comparison table; MFU against `ceiling_flops` (n/a without one).

    Columns:
        img/s, step ms   median over --steps timed steps after --warmup untimed ones; a step
                         is the interval between two consecutive steps' completions, one
                         step in flight while the next is dispatched (as the training loop).
                         With --rounds N every entry runs N times, the rounds in the given
                         order and reversed alternately (A B, B A, ...: a machine that speeds
                         up or slows down during the run favours no row), and the figure is
                         the median of the rounds' medians; each round's img/s is printed
                         below the table
        MFU              model FLOP/s (xla.flops.train_flops_per_image: matmuls, training = 3 x
                         forward) over the FLOP/s of one large matmul measured by JAX in the
                         same run on the same device in the compute dtype (bf16: bf16 output;
                         fp32: at --matmul-precision); the "ceiling" line above the table.
                         The whole model's count for every row, so MFU is img/s times one
                         constant: a kit row with --last-block class-token (its default)
                         does 13.7% fewer matmul FLOPs for vit-cifar than the peers
        peak GiB         device memory: JAX memory_stats()["peak_bytes_in_use"], torch
                         max_memory_allocated(); "n/a" on CPU
        compile s        JAX (kit, nnx): lowering + compilation of the step; torch: the
                         first step's wall time (compilation included for torch-compile)
        params, loss     parameter count (the same model?) and the loss after the last step
    """
    head = ["entry", "img/s", "step ms", "MFU", "TFLOP/s", "peak GiB", "compile s",
            "params", "loss"]
    rows = []
    for r in results:
        if "error" in r or "skipped" in r:
            rows.append([r["name"], r.get("skipped") or f"failed: {r['error']}"])
            continue
        ips = r["batch"] / statistics.median(r["step_s"])
        achieved = flops_per_image * ips
        mfu = achieved / ceiling_flops if ceiling_flops else None
        rows.append([
            r["name"], f"{ips:,.0f}" if ips >= 100 else f"{ips:.1f}",
            f"{1e3 * statistics.median(r['step_s']):.1f}", harness.cell(mfu, ".1%"),
            f"{achieved / 1e12:.3g}", harness.cell(r["peak_bytes"], ".2f", 2.0 ** -30),
            f"{r['compile_s']:.1f}", f"{r['params']:,}", f"{r['loss']:.4f}"])
    return harness.markdown_table(head, rows, numeric=range(1, len(head)))


def versions() -> dict:
    return {"python": platform.python_version(),
            **{p: harness.package_version(p) for p in ("jax", "jaxlib", "flax", "optax",
                                                       "torch")}}


def write_json(path: str, record: dict) -> None:
    """A fresh file each time (written aside, then renamed over): a run cut short still
    leaves the entries finished so far."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    p = cli.doc_parser(__doc__)
    p.prog = "python -m benchmarks.peers"
    a = p.add_argument
    a("--model", default="vit-cifar", choices=sorted(PRESETS), help="model preset (all rows)")
    a("--batch", type=int, default=4096, help="batch (one device)")
    a("--dtype", default="bf16", choices=["fp32", "bf16"], help="compute dtype; params f32")
    a("--matmul-precision", default="default", choices=["default", "highest"],
      help="float32 matmuls on GPU: default = TF32, highest = true float32")
    a("--steps", type=int, default=20, help="timed steps per entry (median reported)")
    a("--warmup", type=int, default=5, help="untimed steps after compilation")
    a("--rounds", type=int, default=1,
      help="run every entry this many times, in the given order and then reversed, "
           "alternately; the table shows the median over rounds")
    a("--only", default=",".join(PEERS), help=f"entries to run, comma-separated: {PEERS}")
    a("--kit", action="append", default=[], metavar="LABEL=FLAGS",
      help="a kit row with these extra training-script flags, after any NAME=VALUE "
           "environment variables for that row only (repeatable)")
    a("--torch-compile-mode", default="default",
      help="torch.compile mode (default, max-autotune, ...)")
    a("--matmul-size", type=int, default=None,
      help="side of the ceiling matmul (default 8192 on accelerators, 1024 on CPU)")
    a("--entry-timeout", type=float, default=240.0, help="seconds per entry before it is killed")
    a("--profile-kit", default=None, metavar="DIR",
      help="also trace 3 steps of the first kit row into DIR and print the breakdown")
    a("--programs", default=None, metavar="DIR",
      help="write each kit row's step as XLA compiled it (the optimised module's text, "
           "gzipped) to DIR/LABEL.hlo.txt.gz, for `benchmarks.deviceless --program`")
    a("--json", default=None, metavar="PATH", help="write every figure to this JSON file")
    return p


def parse(argv) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    cli.require_positive(p, args, "batch", "steps", "rounds", "entry_timeout")
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
    jobs = build_jobs(args)
    flops = train_flops_per_image(get_preset(args.model))
    record = {"command": harness.command_line("benchmarks.peers", argv),
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
    kit_tunables = hostmem.environ().get("GLIBC_TUNABLES", "")
    peer_tunables = os.environ.get("GLIBC_TUNABLES", "")
    record["glibc_tunables"] = {"kit": kit_tunables, "peers": peer_tunables}
    print(f"# GLIBC_TUNABLES: kit rows {kit_tunables or '(unset)'} (as its training scripts "
          f"set it), ceiling and peers {peer_tunables or '(unset)'}", flush=True)

    ceiling = run_child({**jobs[0], "entry": "ceiling", "name": "ceiling",
                         "matmul_size": args.matmul_size}, args.entry_timeout)
    record["ceiling"] = ceiling
    ceiling_flops = ceiling.get("flops_per_s")
    if ceiling_flops:
        print(f"# device: {ceiling['device']}; ceiling: {ceiling['what']} "
              f"{ceiling_flops / 1e12:.4g} TFLOP/s", flush=True)
    else:
        print(f"# ceiling matmul failed ({ceiling.get('error')}): MFU n/a", flush=True)
    rounds = []  # rounds[k][i]: job i's row in round k + 1
    for k in range(args.rounds):
        rows = [None] * len(jobs)
        order = round_order(len(jobs), k)
        if args.rounds > 1:
            print(f"# round {k + 1}/{args.rounds}: "
                  + ", ".join(jobs[i]["name"] for i in order), flush=True)
        for i in order:
            rows[i] = skipped(jobs[i]) or run_child(jobs[i], args.entry_timeout)
            _report(rows[i])
            if k == 0:  # a run cut short keeps the rows finished so far
                record["results"] = [r for r in rows if r is not None]
            if args.rounds > 1:
                record["rounds"] = rounds + [rows]  # null: not run yet
            if args.json:
                write_json(args.json, record)
        rounds.append(rows)
        record["results"] = combine_rounds(rounds)
        if args.json:
            write_json(args.json, record)
    print()
    print(markdown_table(record["results"], flops, ceiling_flops))
    if args.rounds > 1:
        print(f"\nimg/s in each round (rounds {args.rounds}; the table: their median)")
        for r in record["results"]:
            if "round_img_s" in r:
                print(f"  {r['name']}: " + ", ".join(f"{x:,.1f}" for x in r["round_img_s"]))
    print(f"\nGFLOP/img {flops / 1e9:.4g} (matmuls, training = 3 x forward)")
    if args.profile_kit:
        record["profile"] = profile_kit(args, jobs)
    if args.json:
        write_json(args.json, record)
    return record


def round_order(n_jobs: int, k: int) -> list[int]:
    """The jobs' order in round k + 1: as given, then reversed, alternately (A B, B A,
    A B, ...), so that a machine that speeds up or slows down over a run favours no row."""
    return list(range(n_jobs)) if k % 2 == 0 else list(range(n_jobs))[::-1]


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Each job's row over the rounds (rounds[k][i]: job i in round k + 1). One round: the
    rows as they are. Several: `step_s` holds each round's median step time (so the
    table's median is the median over rounds), `round_img_s` each round's img/s, compile
    time their median, peak memory their maximum; loss and the rest are the first round's.
    A row that failed or was skipped in some round is shown as it was there."""
    if len(rounds) == 1:
        return rounds[0]
    combined = []
    for runs in zip(*rounds):
        bad = next((r for r in runs if "error" in r or "skipped" in r), None)
        if bad is not None:
            combined.append(bad)
            continue
        medians = [statistics.median(r["step_s"]) for r in runs]
        peaks = [r["peak_bytes"] for r in runs if r.get("peak_bytes") is not None]
        combined.append({**runs[0], "step_s": medians,
                         "round_img_s": [runs[0]["batch"] / m for m in medians],
                         "compile_s": statistics.median(r["compile_s"] for r in runs),
                         "peak_bytes": max(peaks) if peaks else None})
    return combined


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
        if r.get("env"):
            print("#     environment: " + " ".join(f"{k}={v}" for k, v in r["env"].items()))
    sys.stdout.flush()


def profile_kit(args, jobs: list[dict]) -> dict:
    """Trace a few steps of the first kit row (in a child) and print the breakdown."""
    kit = next((j for j in jobs if j["entry"] == "kit"), None)
    if kit is None:
        kit = {**jobs[0], "entry": "kit", "name": "kit", "kit_flags": [],
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
    print(f"\n# profile of {kit['name']}, {kit_child.PROFILE_STEPS} steps: {', '.join(files)}")
    print(profile_breakdown.format_breakdown(result, source), flush=True)
    return {"files": files, "source": source, **result}


