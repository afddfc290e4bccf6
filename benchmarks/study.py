r"""Dtype and precision study: what parameter dtype, compute dtype, batch and matmul
precision do to memory, speed and the loss, measured on the real training step.

    python -m benchmarks.study --model vit-cifar --steps 3 --out study.md --png study.png
    python -m benchmarks.study --model tiny --param-dtypes f32,bf16 --compute-dtypes f32,f16 \
        --batches 32 --precisions default --steps 2 --out /tmp/study.md

For every combination of --param-dtypes x --compute-dtypes x --batches x --precisions it
builds train_shardmap.py's strategy over the current devices (all on 'data'), compiles
its train_step and times --warmup + --steps steps on the same synthetic data
(bench.measure_train_step); the Markdown table (--out) has one row each (`markdown`).
float16 anywhere brings the dynamic `LossScale`; a batch too big for memory runs as
micro-batches with gradient accumulation (--micro-batch; 0 turns it off). With --png (and
matplotlib) a bar chart of images/s and peak memory is written too.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import numpy as np

import train_shardmap
from benchmarks import bench, harness
from vit_pure.config import PRESETS, get_preset
from vit_pure.run import cli, hostmem
from vit_pure.run.accum import StepMemory
from vit_pure.xla import hlo

_SHORT = {"f32": "f32", "fp32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16",
          "f16": "f16", "fp16": "f16", "float16": "f16"}


# ------------------------------------------------------------------ reading the programs
_FLOATS = {"f32", "bf16", "f16", "f64"}


def batch_converts(hlo_text: str) -> list[str]:
    """The dtype conversions the input batch goes through before its first matmul.

    Follows the data flow of the step's uint8 image parameter through the optimized
    program (compiled.as_text()), into fusions and loop bodies, and lists every
    `convert` on the way to a floating dtype from uint8 or another floating dtype,
    stopping at matmuls (dot, convolution, custom calls). (Integer round trips inside
    the augmentation, such as RandAugment's posterize, are arithmetic, not dtype
    changes of the batch, and are left out.)

    What the count means. The batch crosses from host to device as uint8 (a quarter of
    float32's bytes), so one convert is unavoidable: normalisation's uint8 -> float32.
    The policy then casts the (augmented) images to the compute dtype exactly once, in
    `model.embed`, just before the patch-embedding matmul: a second convert,
    float32 -> bf16/f16, for low-precision compute, none for float32. Parameters are cast
    separately (Policy.cast_to_compute), so no matmul ever sees mixed operand dtypes and
    nothing promotes the batch again, whatever the parameter dtype: the kit's own code
    accounts for 1 (c=f32) or 2 (c=bf16/f16) converts. XLA fuses them with the
    normalisation and the augmentation into loops, so they are no extra passes over
    memory; it may repeat the uint8 -> f32 one in two fusions (recomputing is cheaper
    than storing), which shows as two u8->f32. Anything else is the compiler's doing:
    XLA:CPU's fast matmul kernels (YNNPACK) take bf16 but not a transposed left operand,
    and no f16 at all, so it converts the operands of such matmuls to float32 first;
    the patch embedding's weight gradient (patches^T @ grad) is one, hence a last
    bf16 -> f32 (or f16 -> f32) on the batch's path.
    """
    module = hlo.parse_module(hlo_text)
    comps, entry = module.computations, module.entry
    params = [i for i in comps[entry] if i.opcode == "parameter" and i.dtype == "u8"]
    if len(params) != 1:
        raise ValueError(f"expected one uint8 (image) parameter, found {len(params)}")
    found = []

    def walk(comp: str, tainted: set[str], tainted_elements: set[int] = frozenset()) -> bool:
        """Mark what depends on the batch in `comp`; True if its root does."""
        dtypes = {}
        last = None
        for inst in comps[comp]:
            dtypes[inst.name] = inst.dtype
            last = inst
            if inst.opcode == "get-tuple-element" and inst.index in tainted_elements \
                    and inst.operands and inst.operands[0] in tainted_params:
                tainted.add(inst.name)
                continue
            hit = [k for k, op in enumerate(inst.operands) if op in tainted]
            if not hit or inst.opcode in ("dot", "convolution", "custom-call"):
                continue
            if inst.opcode == "convert" and inst.dtype in _FLOATS \
                    and dtypes.get(inst.operands[0]) in _FLOATS | {"u8"}:
                found.append(f"{dtypes[inst.operands[0]]}->{inst.dtype}")
            if inst.opcode in ("fusion", "call") and inst.callees:
                callee = inst.callees[0]
                inner = {i.name for i in comps[callee]
                         if i.opcode == "parameter" and i.index in hit}
                if not walk(callee, inner):
                    continue
            elif inst.opcode == "while" and inst.callees:
                # The loop state is one tuple; find which of its elements carry the batch.
                producer = next((i for i in comps[comp] if i.name == inst.operands[0]), None)
                elements = ({k for k, op in enumerate(producer.operands) if op in tainted}
                            if producer is not None and producer.opcode == "tuple" else set())
                body = inst.callees[-1]
                body_params = {i.name for i in comps[body] if i.opcode == "parameter"}
                tainted_params.update(body_params)
                walk(body, set(), elements)
                continue  # what leaves the loop is gradients, not the batch
            tainted.add(inst.name)
        return last is not None and last.name in tainted

    tainted_params: set[str] = set()
    walk(entry, {params[0].name})
    return found


# ------------------------------------------------------------------------- one config
def accumulation(batch: int, n_devices: int, micro_batch: int) -> int:
    """Micro-batches per device so that each holds at most `micro_batch` examples."""
    per_device = batch // n_devices
    if not micro_batch or per_device <= micro_batch:
        return 1
    if per_device % micro_batch:
        raise cli.UsageError(f"batch {batch} on {n_devices} devices ({per_device} each) does "
                             f"not divide into micro-batches of {micro_batch}")
    return per_device // micro_batch


def run_one(cfg, param_dtype: str, compute_dtype: str, batch: int, precision: str, *,
            steps: int, warmup: int, micro_batch: int, devices) -> dict:
    policy = f"p={param_dtype},c={compute_dtype},o=f32"
    accum = accumulation(batch, len(devices), micro_batch)
    sc, optimizer = bench.training_setup(cfg.name, batch, policy, precision=precision,
                                         accum=accum, total_steps=warmup + steps + 1)
    strategy = train_shardmap.ShardMapStrategy(sc, optimizer, None, devices=devices)
    strategy.check_batch(batch, accum_steps=sc.accum_steps)
    res = bench.measure_train_step(strategy, sc, optimizer, batch, steps=steps, warmup=warmup)
    compiled = res["compiled"]
    # The lowered (pre-optimisation) program for the precision check: each dot as written.
    precisions = hlo.dot_precisions(res["lowered"].as_text())
    step_s = float(np.median(res["step_s"]))
    return {
        "param_dtype": param_dtype, "compute_dtype": compute_dtype, "batch": batch,
        "accum": accum, "precision": precision, "param_bytes": res["param_bytes"],
        "opt_state_bytes": res["opt_state_bytes"],
        "peak_bytes": StepMemory.of(compiled).total,
        "step_s": step_s, "images_per_s": batch / step_s,
        "images_per_cpu_s": (batch / float(np.median(res["step_cpu_s"]))
                             if devices[0].platform == "cpu" else None),
        "loss": res["loss"],
        "loss_steps": warmup + steps + 1, "converts": batch_converts(compiled.as_text()),
        "dots_at_precision": precisions.get(precision.upper(), 0),
        "dots": sum(precisions.values()), "compile_s": res["compile_s"],
    }


# ---------------------------------------------------------------------------- output
def markdown(rows: list[dict]) -> str:
    """The Markdown table, one row per configuration. Its columns besides the
    configuration's own:

        param bytes        the parameters, in the parameter dtype
        opt-state bytes    AdamW's two moments (they take the parameter dtype) and counters
        peak mem/dev       the compiled step's memory_analysis(), per device: arguments +
                           outputs - donated aliases + temporaries (comparable across the
                           configurations of one process, unlike a device's running peak)
        step s, img/s      median over the timed steps (wall clock)
        img/CPU-s          images per second of this process's CPU time (all threads): on a
                           shared machine, the speed figure other processes disturb least
                           (CPU backend only)
        loss@N             the training loss of the N-th (last) step, N = warmup + steps + 1
                           (bench.measure_train_step runs one untimed step at the end);
                           "nan"/"inf" flags a configuration that diverged
        batch converts     see `batch_converts`: the dtype conversions the input batch goes
                           through before it reaches the first matmul
        dots @precision    how many of the lowered step's dot_generals carry the policy's
                           matmul precision (vit_pure/xla/hlo.py, `dot_precisions`), out of all
    """
    head = ["params", "compute", "batch", "precision", "param bytes", "opt-state bytes",
            "peak mem/dev", "step s", "img/s", "img/CPU-s", "loss@N", "batch converts",
            "dots @precision"]
    lines = []
    for r in rows:
        batch = f"{r['batch']}" + (f" ({r['accum']}x{r['batch'] // r['accum']})"
                                   if r.get("accum", 1) > 1 else "")
        if "error" in r:
            lines.append([r["param_dtype"], r["compute_dtype"], batch, r["precision"],
                          f"failed: {r['error']}"])
            continue
        lines.append([
            r["param_dtype"], r["compute_dtype"], batch, r["precision"],
            f"{r['param_bytes'] / 2**20:.1f} MiB", f"{r['opt_state_bytes'] / 2**20:.1f} MiB",
            f"{r['peak_bytes'] / 2**20:,.0f} MiB", f"{r['step_s']:.2f}",
            f"{r['images_per_s']:.1f}", harness.cell(r["images_per_cpu_s"], ".1f"),
            f"{r['loss']:.4f}",
            f"{len(r['converts'])} ({', '.join(r['converts'])})",
            f"{r['dots_at_precision']}/{r['dots']}"])
    return harness.markdown_table(head, lines)


def write_png(rows: list[dict], path: str) -> str:
    """A bar chart of images/s and peak memory per configuration; a note if it can't."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"(no chart: matplotlib is not installed; `pip install matplotlib` for {path})"
    ok = [r for r in rows if "error" not in r]
    labels = [f"p={r['param_dtype']} c={r['compute_dtype']}\nB={r['batch']} {r['precision']}"
              for r in ok]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.6 * len(ok)), 8), sharex=True)
    axes[0].bar(range(len(ok)), [r["images_per_s"] for r in ok])
    axes[0].set_ylabel("images/s")
    axes[1].bar(range(len(ok)), [r["peak_bytes"] / 2**30 for r in ok], color="tab:orange")
    axes[1].set_ylabel("peak memory / device (GiB)")
    axes[1].set_xticks(range(len(ok)), labels, rotation=90, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart: {path}"


def _dtype_list(text: str, flag: str) -> list[str]:
    out = []
    for name in text.split(","):
        if name.strip().lower() not in _SHORT:
            raise cli.UsageError(f"{flag}: unknown dtype {name!r}; use f32, bf16, f16")
        out.append(_SHORT[name.strip().lower()])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = cli.doc_parser(__doc__)
    a = p.add_argument
    a("--param-dtypes", default="f32,bf16,f16")
    a("--compute-dtypes", default="f32,bf16,f16")
    a("--batches", default="128,4096", help="global batches, comma-separated")
    a("--precisions", default="default,highest", help="matmul precisions, comma-separated")
    a("--model", default="vit-cifar", choices=sorted(PRESETS))
    a("--steps", type=int, default=3, help="timed steps per configuration")
    a("--warmup", type=int, default=1, help="untimed steps after compilation")
    a("--micro-batch", type=int, default=256,
      help="largest per-device micro-batch; bigger batches accumulate gradients (0: never)")
    a("--cpu-devices", type=int, default=None, help="run on N fake CPU devices")
    a("--out", default="study.md", help="Markdown table (rewritten after every row)")
    a("--png", default=None, help="also draw a chart here (needs matplotlib)")
    return p


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.cpu_devices is not None:
        if args.cpu_devices < 1:
            raise cli.UsageError("--cpu-devices must be >= 1")
        cli.use_cpu_devices(args.cpu_devices)  # before jax's first device query
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.steps <= 0 or args.warmup < 0 or args.micro_batch < 0:
        raise cli.UsageError("--steps must be positive, --warmup and --micro-batch >= 0")
    pds = _dtype_list(args.param_dtypes, "--param-dtypes")
    cds = _dtype_list(args.compute_dtypes, "--compute-dtypes")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise cli.UsageError(f"--batches {args.batches!r}: comma-separated integers") from None
    if any(b <= 0 for b in batches):
        raise cli.UsageError("--batches must be positive")
    precisions = [s.strip() for s in args.precisions.split(",")]
    for prec in precisions:
        if prec not in ("default", "high", "highest"):
            raise cli.UsageError(f"--precisions: {prec!r} is not default, high or highest")
    cfg = get_preset(args.model)

    devices = jax.devices()
    header = (f"Model {cfg.name}, shard_map over {len(devices)} {devices[0].device_kind} "
              f"device(s), {args.warmup} warm-up + {args.steps} timed steps (loss@N: N = "
              f"{args.warmup + args.steps + 1}), synthetic data, {harness.machine_line()}.\n"
              f"Command: {harness.command_line('benchmarks.study', argv)}\n")
    rows = []
    grid = list(itertools.product(batches, pds, cds, precisions))
    for batch, pd, cd, prec in grid:
        print(f"[{len(rows) + 1}/{len(grid)}] p={pd} c={cd} batch {batch} {prec} ...",
              end=" ", flush=True)
        try:
            row = run_one(cfg, pd, cd, batch, prec, steps=args.steps, warmup=args.warmup,
                          micro_batch=args.micro_batch, devices=devices)
            print(f"{row['images_per_s']:.1f} img/s, loss {row['loss']:.4f}, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
        except cli.UsageError:
            raise
        except Exception as e:  # a configuration that fails is a finding, not the end
            row = {"param_dtype": pd, "compute_dtype": cd, "batch": batch, "precision": prec,
                   "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
            print(row["error"], flush=True)
        rows.append(row)
        with open(args.out, "w") as f:
            f.write(header + "\n" + markdown(rows) + "\n")
    note = write_png(rows, args.png) if args.png else ""
    with open(args.out, "w") as f:
        f.write(header + "\n" + markdown(rows) + "\n" + (f"\n{note}\n" if note else ""))
    print(markdown(rows))
    if note:
        print(note)
    return rows


if __name__ == "__main__":
    hostmem.use_huge_pages()  # restarts once; see vit_pure/run/hostmem.py
    sys.exit(cli.main_guard(main))
