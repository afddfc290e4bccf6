r"""Device time of a jax.profiler trace, split by kind of kernel.

    python -m benchmarks.profile_breakdown /tmp/prof             # newest run under it
    python -m benchmarks.profile_breakdown /tmp/prof/plugins/profile/RUN/host.trace.json.gz
    python train_shardmap.py --model tiny --dataset synthetic --steps 6 --batch 16 \
        --cpu-devices 1 --profile /tmp/prof --profile-steps 3:4 --no-progress

Reads the `*.trace.json.gz` that `jax.profiler` writes (the scripts' `--profile DIR`, or
`benchmarks.peers --profile-kit DIR`) under DIR/plugins/profile/<run>/; a directory means
its newest run. What counts as device time: `device_events` and `self_times`. Categories
are assigned by name, first match wins (`CATEGORIES`; a nameless kernel by its `hlo_op`):
only a hint, since XLA names a fusion after its root op. `kernel_times` instead joins each
event to the program's own kernel and groups the times by the predictor's classes
(vit_pure/xla/kernels.py): what benchmarks.fit_step fits the efficiencies to.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys

from benchmarks import harness
from vit_pure.run import cli

# (category, pattern), first match wins: the order resolves names that match several
# (a "gemm_fusion_dot" is a gemm; a threefry "shift-right-logical_convert_fusion" is random).
CATEGORIES = [
    ("attention", r"fmha|flash|attention|sdpa|scaled_dot_product|cudnn.*mha"),
    ("collective", r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]scatter|all[-_]to[-_]all"
                   r"|collective[-_]permute|ppermute"),
    ("memcpy", r"memcpy|memset|\b[dh]2[dh]\b|[dh]to[dh]\b"),
    # (XLA:CPU runs its dots as YNNPACK / XNNPACK / oneDNN fusions.)
    ("gemm/matmul", r"gemm|matmul|dot|cublas|cutlass|nvjet|xmma|wgmma|gemv|convolution"
                    r"|ynn_fusion|xnn_fusion|onednn"),
    ("dynamic-update-slice", r"dynamic[-_]update[-_]slice"),
    ("random", r"threefry|philox|\brng|rng[-_]|random|shift[-_](right|left)|xor"),
    ("reduction", r"reduce|reduction|triton_red|triton_per|softmax|layer_?norm"),
    ("transpose/copy", r"transpose|copy|dynamic[-_]slice|concatenate|gather|scatter|pad\b"
                       r"|slice|permute"),
    ("convert", r"convert|\bcast"),
    ("fusion", r"fusion|fused|elementwise|triton_poi|loop_|vectorized|broadcast|add|multiply"
               r"|subtract|divide|exp|tanh|select|maximum|minimum|negate|compare|sqrt"),
]
OTHER = "other"
CPU_SOURCE = "XLA:CPU op events"
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CATEGORIES]
# Threads of a device process that restate the kernels (summing them would count twice).
_DERIVED = re.compile(r"XLA Modules|XLA Ops|Steps|Name Scope|Framework|Source|TensorFlow|"
                      r"Launch|Host Offload|SparseCore", re.IGNORECASE)


class TraceError(ValueError):
    """No usable trace at the given path; reported as one line."""


def classify(name: str, hlo_op: str | None = None) -> str:
    """The category of one kernel / op name (see CATEGORIES)."""
    for category, pattern in _COMPILED:
        if pattern.search(name):
            return category
    return classify(hlo_op) if hlo_op and hlo_op != name else OTHER


def find_traces(path: str) -> list[str]:
    """The trace files at `path`: the file itself, or the newest run's files under a dir."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise TraceError(f"{path}: no such file or directory")
    files = glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True)
    files += glob.glob(os.path.join(path, "**", "*.trace.json"), recursive=True)
    if not files:
        raise TraceError(f"{path}: no *.trace.json.gz under it (write one with --profile DIR)")
    newest = max({os.path.dirname(f) for f in files}, key=os.path.getmtime)
    return sorted(f for f in files if os.path.dirname(f) == newest)


def load_events(files: list[str]) -> list[dict]:
    events = []
    for f in files:
        opener = gzip.open if f.endswith(".gz") else open
        try:
            with opener(f, "rt") as fh:
                trace = json.load(fh)
        except (OSError, ValueError) as e:
            raise TraceError(f"{f}: not a readable trace ({e})") from None
        events += trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return events


def device_events(events: list[dict]) -> tuple[list[dict], str]:
    """The complete ("X") events that are device work, and a phrase saying which.

    Which events count as device time:
    * GPU / TPU: the processes named "/device:GPU:N" (or TPU). Of their threads, the CUDA
      streams ("Stream #..."), which carry one event per kernel and per memcpy/memset; where
      there are none (TPU), the "XLA Ops" line. The derived lines ("XLA Modules", "Steps",
      name scopes, ...) overlap the kernels and are left out.
    * CPU (no device process): the XLA:CPU backend runs each HLO op as a host event with
      `args.hlo_op`; those are summed (over all threads: CPU time of the ops).
    """
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    devices = {pid for pid, name in procs.items() if re.match(r"/device:(GPU|TPU)", name)}
    if devices:
        keep = set()
        for pid in devices:
            mine = {k: v for k, v in threads.items() if k[0] == pid}
            streams = {k for k, v in mine.items() if v.startswith("Stream")}
            ops = {k for k, v in mine.items() if v.strip() == "XLA Ops"}
            keep |= streams or ops or {k for k, v in mine.items() if not _DERIVED.search(v)}
        chosen = [e for e in complete if (e.get("pid"), e.get("tid")) in keep]
        kinds = sorted({procs[p].split(":")[1] for p in devices})
        return chosen, f"kernels on {len(devices)} {'/'.join(kinds)} device(s)"
    chosen = [e for e in complete if (e.get("args") or {}).get("hlo_op")]
    return chosen, CPU_SOURCE + " on the host (no device process in the trace)"


def self_times(events: list[dict]) -> list[float]:
    """Each event's duration minus that of the events nested inside it (same process and
    thread, wholly inside its time span); events that merely overlap are left alone.

    Device time is the sum of the events' durations. On CPU an op event can enclose others
    on its thread (XLA:CPU's `while` runs a scan's body ops inside its own event): there each
    event counts only its self time, the time not spent in events nested inside it, so
    nothing is counted twice. GPU kernels are not nested but may overlap (on one stream with
    programmatic dependent launch, or on several streams); they count in full, so the
    total can exceed the wall time.
    """
    selfs = [float(e["dur"]) for e in events]
    by_thread = collections.defaultdict(list)
    for i, e in enumerate(events):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (float(events[i]["ts"]), -float(events[i]["dur"])))
        stack: list[tuple[int, float]] = []  # (event, its end): enclosing, innermost last
        for i in idx:
            start = float(events[i]["ts"])
            end = start + float(events[i]["dur"])
            while stack and start >= stack[-1][1]:
                stack.pop()
            if stack and end <= stack[-1][1]:
                selfs[stack[-1][0]] -= float(events[i]["dur"])
                stack.append((i, end))
            elif not stack:
                stack.append((i, end))
    return [max(s, 0.0) for s in selfs]


def breakdown(events: list[dict], top: int = 15, nested: bool = False) -> dict:
    """Device time per category and the `top` kernels by total time (microseconds);
    `nested`: count self times (see `self_times`)."""
    by_cat = collections.Counter()
    by_name = collections.defaultdict(lambda: [0.0, 0, ""])  # total us, calls, category
    durations = self_times(events) if nested else [float(e["dur"]) for e in events]
    for e, dur in zip(events, durations):
        name = str(e.get("name", ""))
        category = classify(name, (e.get("args") or {}).get("hlo_op"))
        by_cat[category] += dur
        entry = by_name[name]
        entry[0] += dur
        entry[1] += 1
        entry[2] = category
    total = sum(by_cat.values())
    order = [c for c, _ in CATEGORIES] + [OTHER]
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "total_us": total, "events": len(events),
        "categories": [{"category": c, "us": by_cat[c],
                        "percent": 100 * by_cat[c] / total if total else 0.0}
                       for c in order if by_cat[c]],
        "top": [{"name": n, "us": t, "calls": k, "category": c,
                 "percent": 100 * t / total if total else 0.0}
                for n, (t, k, c) in kernels],
    }


def kernel_times(found: list, events: list[dict], steps: int, nested: bool = False) -> dict:
    """Each kernel of the program (`vit_pure.xla.kernels.kernels`) with its device time per
    step from the trace's events (joined on their `hlo_op`, every event of one kernel
    added), and the time per step by the predictor's classes; events naming no kernel of
    the program count as "unmatched". JSON-ready: what benchmarks.fit_step --profile reads."""
    by_op = collections.Counter()
    durations = self_times(events) if nested else [float(e["dur"]) for e in events]
    for e, dur in zip(events, durations):
        by_op[str((e.get("args") or {}).get("hlo_op") or e.get("name", ""))] += dur
    rows, classes = [], collections.Counter()
    for k in found:
        us = by_op.pop(k.name, 0.0) / steps
        classes[k.kind] += us
        rows.append({"name": k.name, "kind": k.kind, "bytes": k.bytes, "flops": k.flops,
                     "int_ops": k.int_ops, "attention_flops": k.attention_flops,
                     "runs": k.runs, "shape": k.shape, "op": k.op, "us": us})
    unmatched = sum(by_op.values()) / steps
    return {"steps": steps, "total_us": sum(classes.values()) + unmatched,
            "classes_us": dict(classes), "unmatched_us": unmatched,
            "unmatched_top": [[n, t / steps] for n, t in by_op.most_common(8)],
            "kernels": rows}


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def format_breakdown(result: dict, source: str = "") -> str:
    categories = harness.markdown_table(
        ["category", "ms", "%"],
        [[c["category"], f"{c['us'] / 1e3:,.2f}", f"{c['percent']:.1f}"]
         for c in result["categories"]], numeric=(1, 2))
    kernels = harness.markdown_table(
        ["kernel", "category", "calls", "ms", "%"],
        [[_short(k["name"]), k["category"], k["calls"], f"{k['us'] / 1e3:,.2f}",
          f"{k['percent']:.1f}"] for k in result["top"]], numeric=(2, 3, 4))
    return "\n".join([
        f"device time {result['total_us'] / 1e3:,.2f} ms in {result['events']:,} events"
        + (f" ({source})" if source else ""), "", categories, "",
        f"top {len(result['top'])} kernels by time:", "", kernels])


def analyse(path: str, top: int = 15) -> tuple[dict, str, list[str]]:
    """Trace at `path` -> (breakdown, source phrase, files read)."""
    files = find_traces(path)
    events, source = device_events(load_events(files))
    if not events:
        raise TraceError(f"{path}: the trace has no device or XLA op events")
    return breakdown(events, top, nested=source.startswith(CPU_SOURCE)), source, files


def main(argv=None) -> int:
    p = cli.doc_parser(__doc__)
    p.add_argument("trace", help="a *.trace.json.gz, or a --profile directory (newest run)")
    p.add_argument("--top", type=int, default=15, help="how many kernels to list")
    p.add_argument("--json", default=None, help="also write the breakdown to this JSON file")
    args = p.parse_args(argv)
    if args.top < 0:
        p.error("--top must be >= 0")
    try:
        result, source, files = analyse(args.trace, args.top)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# trace: {', '.join(files)}")
    print(format_breakdown(result, source))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": files, "source": source, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
