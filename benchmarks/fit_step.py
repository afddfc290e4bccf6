"""Fit the predicted step's efficiencies to GPU steps measured, and say how well they fit.

    python -m benchmarks.fit_step --row "cudnn=104.1=DUMP.txt" ... --save rows.json
    python -m benchmarks.fit_step --rows benchmarks/data/h100-2026-11-23.json

A row is a measured step (LABEL=MS=FILE: the step's milliseconds on the GPU and its
program, an optimised XLA:GPU module, compiled deviceless for the GPU from the kit that
was measured). Its kernels are read with vit_pure/xla/kernels.py and kept, alike kernels
together, in --save's JSON (the compiles take minutes on a small CPU; the JSON is the
cache). The fit: e_mem, e_gemm and e_attention of `kernels.Rates` on a grid (0.01 steps),
minimising the squared relative errors of the predicted steps (`kernels.predicted_s`;
the INT32 rate and launch cost as `kernels.H100_RATES`), then each row's error
at the fit and left out of it (fitted on the others, predicted). Prints a Markdown table.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import numpy as np

from benchmarks import harness
from vit_pure.errors import UsageError
from vit_pure.plan import interconnect as ic
from vit_pure.plan import targets
from vit_pure.run import cli
from vit_pure.xla import hlo, kernels

E_MEM = np.arange(0.40, 1.0001, 0.01)
E_GEMM = np.arange(0.20, 1.0001, 0.01)
E_ATTENTION = np.arange(0.02, 1.0001, 0.01)


def summarise(found: list[kernels.Kernel]) -> list[dict]:
    """Alike kernels together (every field but name, shape and op; runs added)."""
    groups: dict[tuple, dict] = {}
    for k in found:
        key = (k.kind, k.bytes, k.flops, k.int_ops, k.attention_flops)
        row = groups.setdefault(key, {"kind": k.kind, "bytes": k.bytes, "flops": k.flops,
                                      "int_ops": k.int_ops,
                                      "attention_flops": k.attention_flops, "runs": 0})
        row["runs"] += k.runs
    return list(groups.values())


def as_kernels(summary: list[dict]) -> list[kernels.Kernel]:
    return [kernels.Kernel(name="", kind=g["kind"], bytes=g["bytes"], flops=g["flops"],
                           runs=g["runs"], int_ops=g["int_ops"],
                           attention_flops=g["attention_flops"]) for g in summary]


def _grid(summary: list[dict], bandwidth: float, peak: float, rates: kernels.Rates):
    """The predicted step (s) over the grid: an array (E_MEM, E_GEMM, E_ATTENTION)."""
    mem = np.zeros((len(E_MEM), 1, 1))
    gemm = np.zeros((len(E_MEM), len(E_GEMM), 1))
    attention = np.zeros((len(E_MEM), 1, len(E_ATTENTION)))
    em = E_MEM[:, None]
    for g in summary:
        t_mem = g["bytes"] / (bandwidth * em)  # (E_MEM, 1)
        fixed = g["runs"] * (g["int_ops"] / rates.int_per_s + rates.launch_s)
        flops = g["flops"] + g["attention_flops"]
        if g["kind"] == "gemm":
            gemm += (g["runs"] * np.maximum(t_mem, flops / (peak * E_GEMM[None, :])))[:, :, None]
        elif g["kind"] == "attention":
            attention += (g["runs"] * np.maximum(t_mem, flops / (peak * E_ATTENTION[None, :]))
                          )[:, None, :]
        else:
            mem += (g["runs"] * t_mem)[:, :, None]
        mem += fixed
    return mem + gemm + attention


def fit(rows: list[dict], bandwidth: float, peak: float,
        rates: kernels.Rates = kernels.H100_RATES) -> kernels.Rates:
    """The rates minimising the rows' squared relative errors."""
    loss = sum((_grid(r["kernels"], bandwidth, peak, rates) / (r["measured_ms"] / 1e3) - 1) ** 2
               for r in rows)
    i, j, k = np.unravel_index(np.argmin(loss), loss.shape)
    return dataclasses.replace(rates, e_mem=round(float(E_MEM[i]), 2),
                               e_gemm=round(float(E_GEMM[j]), 2),
                               e_attention=round(float(E_ATTENTION[k]), 2))


def predict_ms(row: dict, bandwidth: float, peak: float, rates: kernels.Rates) -> float:
    return kernels.predicted_s(as_kernels(row["kernels"]), bandwidth, peak, rates) * 1e3


def report(rows: list[dict], bandwidth: float, peak: float) -> str:
    """The fit, then per row: measured, predicted at the fit, error; left out: the rates
    fitted on the others, the prediction, error."""
    rates = fit(rows, bandwidth, peak)
    lines = [f"fit on {len(rows)} rows: e_mem {rates.e_mem:.2f}, e_gemm {rates.e_gemm:.2f}, "
             f"e_attention {rates.e_attention:.2f} (INT32 "
             f"{rates.int_per_s / 1e12:.1f} T/s, launch {rates.launch_s * 1e6:.0f} us: fixed)",
             ""]
    table = []
    for i, row in enumerate(rows):
        at_fit = predict_ms(row, bandwidth, peak, rates)
        others = fit(rows[:i] + rows[i + 1:], bandwidth, peak)
        left_out = predict_ms(row, bandwidth, peak, others)
        m = row["measured_ms"]
        table.append([row["label"], f"{m:.1f}", f"{at_fit:.1f}", f"{100 * (at_fit / m - 1):+.1f}%",
                      f"{others.e_mem:.2f} / {others.e_gemm:.2f} / {others.e_attention:.2f}",
                      f"{left_out:.1f}", f"{100 * (left_out / m - 1):+.1f}%"])
    head = ["row", "measured ms", "predicted ms", "error", "left out: e_mem / e_gemm / e_attn",
            "left-out ms", "left-out error"]
    return "\n".join(lines) + harness.markdown_table(head, table, numeric=range(1, len(head)))


def read_row(spec: str, hardware: str) -> dict:
    label, ms, path = (spec.split("=", 2) + ["", ""])[:3]
    try:
        measured = float(ms)
        module = hlo.parse_module(pathlib.Path(path).read_text())
    except (ValueError, OSError) as e:
        raise UsageError(f"--row {spec!r}: give LABEL=MS=FILE ({e})") from None
    found = kernels.kernels(module, lambda comp: hlo.computation_dot_flops(module, comp))
    return {"label": label, "measured_ms": measured, "source": path,
            "kernels": summarise(found)}


def main(argv=None) -> int:
    p = cli.doc_parser(__doc__)
    p.prog = "python -m benchmarks.fit_step"
    p.add_argument("--row", action="append", default=[], metavar="LABEL=MS=FILE")
    p.add_argument("--rows", help="a JSON of rows saved by --save (instead of --row)")
    p.add_argument("--save", help="write the rows' kernels here (JSON)")
    p.add_argument("--hardware", default="h100", choices=sorted(targets.GPU_TARGETS))
    args = p.parse_args(argv)
    if args.rows:
        rows = json.loads(pathlib.Path(args.rows).read_text())["rows"]
    else:
        rows = [read_row(spec, args.hardware) for spec in args.row]
    if len(rows) < 2:
        raise UsageError("give two rows or more (--row, or --rows)")
    if args.save:
        pathlib.Path(args.save).write_text(json.dumps({"hardware": args.hardware,
                                                       "rows": rows}, indent=1))
    bandwidth = targets.memory_bandwidth(args.hardware)
    print(report(rows, bandwidth, ic.HARDWARE[args.hardware].peak_flops))
    return 0


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
