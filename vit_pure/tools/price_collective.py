r"""Price one collective as the plan does, to hold the model against your own cluster's
nccl-tests before trusting a plan:

    python -m vit_pure.tools.price_collective --op all-reduce --size 32MiB --nodes 8 \
        --gpus-per-node 8 --hardware h100 [--fabric NAME] [--algo auto|ring|tree|nvls|nvlstree]
    python -m vit_pure.tools.price_collective --published

It prints one call's predicted time, its bus bandwidth (nccl-tests' busbw, to read against
all_reduce_perf's column) and the algorithm chosen, then each algorithm NCCL has for it
(--json: one line). --size is the buffer per GPU as nccl-tests counts it, in bytes or with
K/KiB, M/MiB, G/GiB (powers of 2) or KB, MB, GB (powers of 10). The formulas:
vit_pure/plan/nccl.py; the fabrics: vit_pure/plan/fabrics.py. --published prints the model
against every published run the fabrics were fitted to or checked on, as a markdown table.
"""
from __future__ import annotations

import json
import pathlib
import re
import sys

from vit_pure.errors import UsageError
from vit_pure.plan import fabrics, nccl
from vit_pure.plan import interconnect as ic
from vit_pure.run import cli

OPS = {"all-reduce": ic.ALL_REDUCE, "all-gather": ic.ALL_GATHER,
       "reduce-scatter": ic.REDUCE_SCATTER, "permute": ic.PERMUTE,
       "collective-permute": ic.PERMUTE, "sendrecv": ic.PERMUTE}
UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30,
         "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """Bytes from '32MiB', '8G', '1.5 GB', '4096'; UsageError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS:
        raise UsageError(f"--size {text!r}: give bytes, or a number with K/KiB, M/MiB, "
                         "G/GiB (powers of 2) or KB/MB/GB (powers of 10), e.g. 32MiB")
    size = float(match.group(1)) * UNITS[unit]
    if size < 1:
        raise UsageError(f"--size {text!r}: must be at least 1 byte")
    return int(size)


def target(args) -> ic.Hardware:
    name = args.hardware.strip().lower()
    if name not in ic.HARDWARE:
        raise UsageError(f"--hardware {args.hardware!r}: unknown; choose one of "
                         f"{', '.join(ic.HARDWARE)}")
    hw = ic.HARDWARE[name]
    if args.fabric is not None and args.fabric not in fabrics.FABRICS:
        raise UsageError(f"--fabric {args.fabric!r}: unknown; choose one of "
                         f"{', '.join(fabrics.FABRICS)}")
    if args.fabric is not None and hw.platform != "gpu":
        raise UsageError(f"--fabric: {hw.name} is not a GPU; its network is the table's")
    for flag in ("nodes", "gpus_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"{cli.flag_name(flag)} must be >= 1, got {value}")
    if args.inter_gbps is not None and not args.inter_gbps > 0:
        raise UsageError(f"--inter-gbps must be positive, got {args.inter_gbps}")
    if args.latency_us is not None and args.latency_us < 0:
        raise UsageError(f"--latency-us must be >= 0, got {args.latency_us}")
    return ic.with_overrides(hw, inter_gbps=args.inter_gbps, latency_us=args.latency_us,
                             devices_per_node=args.gpus_per_node, fabric=args.fabric)


def price(args) -> dict:
    """The prediction for the parsed flags: the chosen call and every candidate."""
    kind = OPS.get(args.op)
    if kind is None:
        raise UsageError(f"--op {args.op!r}: choose one of {', '.join(OPS)}")
    size = parse_size(args.size)
    hw = target(args)
    p = hw.devices_per_node
    n = 2 if kind == ic.PERMUTE else args.nodes * p
    where = (ic.Placement(2, 2 if args.nodes > 1 else 1, 1, 1) if kind == ic.PERMUTE
             else ic.Placement(n, args.nodes, p, p))
    options = nccl.candidates(kind, where, hw)
    if args.algo not in (nccl.AUTO, *options) and not (
            args.algo in (nccl.TREE, nccl.NVLS) and nccl.NVLS_TREE in options):
        raise UsageError(f"--algo {args.algo}: NCCL has no {args.algo} for {args.op} on "
                         f"{args.nodes} node(s) of {hw.name}; choose from auto, "
                         f"{', '.join(options)}")
    cost = nccl.best_cost(kind, size, where, hw, args.algo)
    t = cost.seconds(size)
    each = {a: nccl.call_cost(kind, size, where, hw, a).seconds(size) for a in options}
    return {"seconds": t, "busbw_gbps": nccl.bus_bandwidth(kind, size, n, t) / 1e9,
            "algorithm": cost.algorithm, "op": args.op, "bytes": size, "gpus": n,
            "nodes": args.nodes, "gpus_per_node": p, "hardware": hw.name,
            "fabric": hw.fabric.name if hw.fabric else None,
            "algorithms": each, "describe": hw.describe()}


def report(r: dict) -> str:
    lines = [f"{r['op']} of {r['bytes']:,} bytes per GPU on {r['gpus']} GPUs "
             f"({r['nodes']} node(s) of {r['gpus_per_node']}), {r['hardware']}",
             f"  {r['describe']}",
             f"predicted: {r['seconds'] * 1e6:,.1f} us, busbw {r['busbw_gbps']:.2f} GB/s, "
             f"algorithm {r['algorithm']}"]
    if len(r["algorithms"]) > 1:
        lines.append("  each algorithm: " + ", ".join(
            f"{a} {t * 1e6:,.1f} us" for a, t in sorted(r["algorithms"].items(),
                                                       key=lambda kv: kv[1])))
    return "\n".join(lines)


MEASUREMENTS = pathlib.Path(__file__).parent / "measurements" / "nccl_all_reduce.json"


def published_rows() -> list[dict]:
    """Every published all-reduce point against the model (the default h100 node with
    the table's fabric): one dict a point."""
    rows = []
    for t in json.loads(MEASUREMENTS.read_text())["tables"]:
        hw = ic.with_overrides(ic.HARDWARE["h100"], fabric=t["fabric"],
                               devices_per_node=t["gpus_per_node"])
        n = t["nodes"] * t["gpus_per_node"]
        where = ic.Placement(n, t["nodes"])
        for q in t["points"]:
            size = q["bytes"]
            measured = (q["time_us"] * 1e-6 if "time_us" in q
                        else size / (q["algbw_gbps"] * 1e9))
            cost = nccl.best_cost(ic.ALL_REDUCE, size, where, hw)
            rows.append({"table": t["id"], "fabric": t["fabric"], "nodes": t["nodes"],
                         "role": t["role"], "bytes": size, "measured_s": measured,
                         "model_s": cost.seconds(size), "algorithm": cost.algorithm})
    return rows


def published_table() -> str:
    lines = ["| fabric | nodes | fitted or checked | size | measured | model | model / "
             "measured | algorithm |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in published_rows():
        size = (f"{r['bytes'] / 2**30:g} GiB" if r["bytes"] >= 2**30
                else f"{r['bytes'] / 2**20:g} MiB")
        lines.append(f"| {r['fabric']} | {r['nodes']} | {r['role']} | {size} | "
                     f"{_us(r['measured_s'])} | {_us(r['model_s'])} | "
                     f"{r['model_s'] / r['measured_s']:.2f} | {r['algorithm']} |")
    return "\n".join(lines)


def _us(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.0f} us"


def main(argv=None) -> int:
    parser = cli.doc_parser(__doc__)
    parser.add_argument("--op", default="all-reduce", metavar="OP",
                        help=f"the collective: {', '.join(OPS)} (default all-reduce)")
    parser.add_argument("--size", default=None, metavar="BYTES",
                        help="buffer per GPU, e.g. 32MiB (as nccl-tests' size column)")
    parser.add_argument("--nodes", type=int, default=1, metavar="M",
                        help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="P",
                        help="GPUs per node taking part (default: the hardware's, 8)")
    parser.add_argument("--hardware", default="h100", metavar="NAME",
                        help=f"one of {', '.join(ic.HARDWARE)} (default h100)")
    parser.add_argument("--fabric", default=None, metavar="NAME",
                        help=f"the network between nodes: {', '.join(fabrics.FABRICS)} "
                             "(default: the hardware's, ib-400 for h100 / h200)")
    parser.add_argument("--inter-gbps", type=float, default=None, metavar="GB/S",
                        help="override the fabric's NIC bandwidth per GPU, GB/s")
    parser.add_argument("--latency-us", type=float, default=None, metavar="US",
                        help="override the fabric's latency: a two-node call's, in us")
    parser.add_argument("--algo", default=nccl.AUTO, choices=nccl.CHOICES,
                        help="force an algorithm as NCCL_ALGO does (default auto: the "
                             "fastest, as NCCL's tuner picks; tree means nvlstree where "
                             "the node has NVSwitch and it is faster)")
    parser.add_argument("--json", action="store_true",
                        help='print one line {"seconds", "busbw_gbps", "algorithm"}')
    parser.add_argument("--published", action="store_true",
                        help="print the model against every published run the fabrics "
                             "were fitted to or checked on (a markdown table)")
    args = parser.parse_args(argv)

    def run() -> None:
        if args.published:
            print(published_table())
            return
        if args.size is None:
            raise UsageError("--size is required (or --published)")
        r = price(args)
        if args.json:
            print(json.dumps({k: r[k] for k in ("seconds", "busbw_gbps", "algorithm")}))
        else:
            print(report(r))
    return cli.main_guard(run)


if __name__ == "__main__":
    sys.exit(main())
