"""Fit the predicted step's efficiencies to GPU steps measured, and say how well they fit.

    python -m benchmarks.fit_step --row "cudnn=104.1=DUMP.txt" ... --save rows.json
    python -m benchmarks.fit_step --rows benchmarks/data/h100-2026-11-23.json
    python -m benchmarks.fit_step --profile gpu-check/kernel_times.json --hardware h200

A row is a measured step, LABEL=MS=FILE: its milliseconds on the GPU and its program (an
optimised XLA:GPU module compiled deviceless from the kit measured), whose kernels are read
with vit_pure/xla/kernels.py and kept in --save's JSON (the cache of slow compiles). `fit`:
e_mem, e_gemm and e_attention of `kernels.Rates` on a 0.01 grid, minimising the squared
relative errors of `kernels.predicted_s`; then each row's error at the fit and left out of
it; and the terms the rows cannot separate (`unseparable`). `--profile` fits from kernel
times instead (benchmarks.gpu_check's profile part: `fit_profile`).
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
        key = (k.kind, k.bytes, k.flops, k.int_ops, k.attention_flops, k.variant)
        row = groups.setdefault(key, {"kind": k.kind, "bytes": k.bytes, "flops": k.flops,
                                      "int_ops": k.int_ops,
                                      "attention_flops": k.attention_flops,
                                      "variant": k.variant, "runs": 0})
        row["runs"] += k.runs
    return list(groups.values())


def as_kernels(summary: list[dict]) -> list[kernels.Kernel]:
    return [kernels.Kernel(name="", kind=g["kind"], bytes=g["bytes"], flops=g["flops"],
                           runs=g["runs"], int_ops=g["int_ops"],
                           attention_flops=g["attention_flops"],
                           variant=g.get("variant", "")) for g in summary]


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
    """The rates minimising the rows' squared relative errors: one efficiency each for
    memory, GEMMs and attention (`rates`' INT32 rate and launch kept)."""
    loss = sum((_grid(r["kernels"], bandwidth, peak, rates) / (r["measured_ms"] / 1e3) - 1) ** 2
               for r in rows)
    i, j, k = np.unravel_index(np.argmin(loss), loss.shape)
    # one efficiency per term: the class-by-class ones of a profile fit do not apply
    return dataclasses.replace(rates, e_mem_by_class=(), e_gemm_by_shape=(),
                               e_attention_by_pass=(), e_mem=round(float(E_MEM[i]), 2),
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


def unseparable(rows: list[dict]) -> list[str]:
    """The terms the rows cannot separate: each whose work (bytes, GEMM FLOPs, attention
    FLOPs, integer operations) varies by under 5% from row to row (less than the rows'
    errors move it: it cannot be told from a constant), one line each."""
    def work(row, what):
        ks = row["kernels"]
        if what == "memory bytes":
            return sum(g["runs"] * g["bytes"] for g in ks if g["kind"] not in ("gemm", "attention"))
        if what == "GEMM FLOPs (e_gemm)":
            return sum(g["runs"] * g["flops"] for g in ks if g["kind"] == "gemm")
        if what == "attention FLOPs (e_attention)":
            return sum(g["runs"] * g["attention_flops"] for g in ks)
        return sum(g["runs"] * g["int_ops"] for g in ks)
    lines = []
    for what in ("memory bytes", "GEMM FLOPs (e_gemm)", "attention FLOPs (e_attention)",
                 "integer operations (INT32 rate, fixed)"):
        values = [work(r, what) for r in rows]
        nonzero = [v for v in values if v]
        if len(nonzero) > 1 and (max(nonzero) - min(nonzero)) <= 0.05 * max(nonzero):
            lines.append(f"{what}: {min(nonzero):.4g} to {max(nonzero):.4g} in the rows "
                         f"(+{100 * (max(nonzero) / min(nonzero) - 1):.1f}%): the fit cannot "
                         "tell it from a constant; its efficiency absorbs what the others miss")
        elif 0 < len(nonzero) < 2:
            lines.append(f"{what}: in one row only: fitted to that row alone")
    return lines


MATCHED_AT_LEAST = 0.8  # of the kernels' device time, for a profile fit (XLA:CPU: 88%, its loops)


class ProfileError(UsageError):
    """A profile that attributes too little of its device time to the program's kernels."""


def _matched_fraction(record: dict) -> float:
    """The share of the profile's device time that the join gave to the program's kernels
    (a record written before the join kept it: from its classes and unmatched time)."""
    if "matched_fraction" in record:
        return record["matched_fraction"]
    matched = sum(record.get("classes_us", {}).values())
    total = matched + record.get("unmatched_us", 0.0)
    return matched / total if total else 0.0


def check_profile(record: dict) -> None:
    """ProfileError (one line, naming the largest unmatched names) unless the profile
    gives at least MATCHED_AT_LEAST of its device time to the program's kernels: a fit
    on less would price each class on a part of its time."""
    matched = _matched_fraction(record)
    if matched >= MATCHED_AT_LEAST:
        return
    top = ", ".join(f"{name} {us / 1e3:.2f} ms" for name, us in record.get("unmatched_top", [])[:4])
    raise ProfileError(
        f"the profile attributes {100 * matched:.1f}% of its kernels' device time to the "
        f"program (at least {100 * MATCHED_AT_LEAST:.0f}% needed); unmatched per step: "
        f"{top or 'nothing named'}: profile with benchmarks.gpu_check (the trace joined to "
        "the program by benchmarks.profile_breakdown)")


def fit_profile(record: dict, bandwidth: float, peak: float,
                rates: kernels.Rates = kernels.H100_RATES
                ) -> tuple[kernels.Rates, list[dict], list[str]]:
    """The rates, class by class, from a profile's kernel times
    (`profile_breakdown.kernel_times`), each class's kernels' time less a launch each:

        launch             the idle time inside the step per kernel (where the record has it)
        e_mem by class     each memory-bound class's bytes at the bandwidth over its time
                           (less its integer work at the INT32 rate)
        INT32 rate         the rng kernels' integer operations over their time less their
                           memory time
        e_gemm by shape    each GEMM shape class's FLOPs at the peak over its time
        e_attention        each cuDNN pass's tile FLOPs at the peak over its time

    Also the GEMMs per output shape ([{shape, class, runs, tflop, ms, e}]) and the rates it
    could not fit (no kernel of theirs ran): those keep `rates`' values, named in the
    list (as "e_gemm narrow", "e_mem elementwise", "INT32 rate", "launch")."""
    ks = [k for k in record["kernels"] if k["us"] > 0]
    launches = sum(k["runs"] for k in ks)
    launch = (record["idle_ms"] * 1e-3 / launches if record.get("idle_ms") is not None
              and launches else rates.launch_s)
    defaults = [] if record.get("idle_ms") is not None else ["launch"]

    def seconds(group):
        return max(sum(k["us"] * 1e-6 - k["runs"] * launch for k in group), 1e-12)

    def kind(k):
        return k["kind"] if k["kind"] in kernels.CLASSES else "other"

    rng = [k for k in ks if kind(k) == "rng"]
    int_per_s = rates.int_per_s
    memory_classes = [c for c in kernels.CLASSES if c not in ("gemm", "attention", "rng")]
    e_mem_by = {}
    for c in memory_classes:
        group = [k for k in ks if kind(k) == c]
        nbytes = sum(k["runs"] * k["bytes"] for k in group)
        ints = sum(k["runs"] * k["int_ops"] for k in group)
        if nbytes:
            e_mem_by[c] = nbytes / bandwidth / max(seconds(group) - ints / int_per_s, 1e-12)
    plain = [k for c in ("elementwise", "norms/reductions", "transposes/copies")
             for k in ks if kind(k) == c]
    e_mem = (sum(k["runs"] * k["bytes"] for k in plain) / bandwidth / seconds(plain)
             if plain else rates.e_mem)
    if rng:
        mem_s = sum(k["runs"] * k["bytes"] for k in rng) / (bandwidth * e_mem)
        int_per_s = sum(k["runs"] * k["int_ops"] for k in rng) / max(seconds(rng) - mem_s,
                                                                      1e-12)
    else:
        defaults.append("INT32 rate")
    for c in memory_classes:
        if c not in e_mem_by and c in dict(rates.e_mem_by_class):
            defaults.append(f"e_mem {c}")

    def efficiency(group, key):
        flops = sum(k["runs"] * k[key] for k in group)
        return flops / peak / seconds(group) if flops else None

    # The library kernels' bytes at the full bandwidth: a floor under their time, which
    # their fitted compute efficiencies carry.
    e_mem_by.update(gemm=1.0, attention=1.0)

    def by_variant(kind: str, variants, key: str) -> dict:
        """Each variant's efficiency where its kernels give one; the rest named as
        defaults."""
        found = {}
        for variant in variants:
            e = efficiency([k for k in ks if k["kind"] == kind
                            and k.get("variant") == variant], key)
            if e is None:
                defaults.append(f"e_{kind} {variant}")
            else:
                found[variant] = e
        return found

    gemm = [k for k in ks if k["kind"] == "gemm"]
    e_gemm_by = by_variant("gemm", kernels.GEMM_SHAPES, "flops")
    e_gemm = efficiency(gemm, "flops")  # for GEMMs of no shape class: all of them together
    e_attention_by = by_variant("attention", kernels.ATTENTION_PASSES, "attention_flops")
    e_attention = efficiency([k for k in ks if k["kind"] == "attention"], "attention_flops")
    if e_gemm is None:
        defaults.append("e_gemm")
    if e_attention is None:
        defaults.append("e_attention")
    shapes = {}
    for k in gemm:
        shapes.setdefault((k["shape"], k["flops"]), []).append(k)
    by_shape = [{"shape": shape, "class": group[0].get("variant", ""),
                 "runs": sum(k["runs"] for k in group),
                 "tflop": sum(k["runs"] * k["flops"] for k in group) / 1e12,
                 "ms": sum(k["us"] for k in group) / 1e3, "e": efficiency(group, "flops")}
                for (shape, _), group in shapes.items()]
    fitted = dataclasses.replace(
        rates, e_mem=e_mem, int_per_s=int_per_s, launch_s=launch,
        e_gemm=e_gemm or rates.e_gemm, e_attention=e_attention or rates.e_attention,
        e_mem_by_class=tuple((dict(rates.e_mem_by_class) | e_mem_by).items()),
        e_gemm_by_shape=tuple((dict(rates.e_gemm_by_shape) | e_gemm_by).items()),
        e_attention_by_pass=tuple((dict(rates.e_attention_by_pass) | e_attention_by).items()))
    return fitted, sorted(by_shape, key=lambda g: -g["ms"]), defaults


def profile_report(record: dict, bandwidth: float, peak: float) -> str:
    """The rates fitted to a profile class by class (defaults marked), the GEMMs per
    shape, and each class's predicted time at those rates against its measured time."""
    check_profile(record)
    rates, by_shape, defaults = fit_profile(record, bandwidth, peak)
    found = as_kernels(record["kernels"])
    predicted = kernels.predicted_s(found, bandwidth, peak, rates) * 1e3
    by_class = kernels.predicted_by_class(found, bandwidth, peak, rates)
    measured, summed = record["step_ms"], record["total_us"] / 1e3

    def mark(name):
        return " (default: not in the profile)" if name in defaults else ""

    def pairs(items, prefix):
        return ", ".join(f"{n} {e:.3g}{mark(f'{prefix} {n}')}" for n, e in items)

    lines = [f"fit on the profile of {record.get('model')} batch {record.get('batch')} "
             f"({record.get('device')}, {record['steps']} steps, "
             f"{100 * _matched_fraction(record):.1f}% of the device time matched):",
             f"  e_mem by class: {pairs(rates.e_mem_by_class, 'e_mem')}",
             f"  e_gemm by shape class: {pairs(rates.e_gemm_by_shape, 'e_gemm')}",
             f"  e_attention by pass: {pairs(rates.e_attention_by_pass, 'e_attention')}",
             f"  INT32 {rates.int_per_s / 1e12:.1f} T/s{mark('INT32 rate')}, launch "
             f"{rates.launch_s * 1e6:.2f} us{mark('launch')}",
             f"predicted step at these rates {predicted:.1f} ms; measured {measured:.1f} ms "
             f"({100 * (predicted / measured - 1):+.1f}%); the kernels' device time "
             f"{summed:.1f} ms", ""]
    rows = [[c, f"{record['classes_us'].get(c, 0.0) / 1e3:.2f}", f"{by_class[c] * 1e3:.2f}"]
            for c in by_class]
    lines.append(harness.markdown_table(["class", "measured ms", "predicted ms"], rows,
                                        numeric=(1, 2)))
    table = [[g["shape"][:48], g["class"], str(g["runs"]), f"{g['tflop']:.3f}",
              f"{g['ms']:.2f}", "-" if g["e"] is None else f"{g['e']:.2f}"] for g in by_shape]
    return "\n".join(lines) + "\n\n" + harness.markdown_table(
        ["GEMM output", "class", "per step", "TFLOP", "ms", "e_gemm"], table,
        numeric=range(2, 6))


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


def profile_hardware(record: dict, given: str | None) -> str:
    """The --hardware a profile's rates are shares of: the one its record names (gpu_check
    writes the GPU's), which a --hardware naming another GPU contradicts; h100 for a
    record that names none."""
    own = record.get("hardware")
    if given and own and given != own:
        raise UsageError(f"--hardware {given}: the profile was taken on {own} "
                         f"({record.get('device')}); its rates are shares of {own}'s peaks")
    return given or own or "h100"


def main(argv=None) -> int:
    p = cli.doc_parser(__doc__)
    p.prog = "python -m benchmarks.fit_step"
    p.add_argument("--row", action="append", default=[], metavar="LABEL=MS=FILE")
    p.add_argument("--rows", help="a JSON of rows saved by --save (instead of --row)")
    p.add_argument("--save", help="write the rows' kernels here (JSON)")
    p.add_argument("--profile", help="a profile's kernel times (benchmarks.gpu_check's "
                   "DIR/kernel_times.json): fit from them instead of whole steps")
    p.add_argument("--hardware", default=None, choices=sorted(targets.GPU_TARGETS),
                   help="the GPU the steps ran on (default: a profile's own, else h100)")
    args = p.parse_args(argv)
    if args.profile:
        try:
            record = json.loads(pathlib.Path(args.profile).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--profile {args.profile}: {e}") from None
        hardware = profile_hardware(record, args.hardware)
        print(profile_report(record, targets.memory_bandwidth(hardware),
                             ic.HARDWARE[hardware].peak_flops))
        return 0
    hardware = args.hardware or "h100"
    bandwidth = targets.memory_bandwidth(hardware)
    peak = ic.HARDWARE[hardware].peak_flops
    if args.rows:
        rows = json.loads(pathlib.Path(args.rows).read_text())["rows"]
    else:
        rows = [read_row(spec, hardware) for spec in args.row]
    if len(rows) < 2:
        raise UsageError("give two rows or more (--row, or --rows)")
    if args.save:
        pathlib.Path(args.save).write_text(json.dumps({"hardware": hardware,
                                                       "rows": rows}, indent=1))
    print(report(rows, bandwidth, peak))
    lines = unseparable(rows)
    print("\nwhat these rows cannot separate (a profile can: --profile):" if lines else
          "\nevery term's work differs between the rows")
    for line in lines:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
