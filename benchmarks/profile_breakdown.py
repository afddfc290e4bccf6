r"""Device time of a jax.profiler trace, by kind of kernel, or joined to its program.

    python -m benchmarks.profile_breakdown /tmp/prof             # newest run under it
    python -m benchmarks.profile_breakdown TRACE --program step.hlo.txt.gz --json out.json
    python -m benchmarks.profile_breakdown /tmp/prof/plugins/profile/RUN/host.trace.json.gz
    python train_shardmap.py --model tiny --dataset synthetic --steps 6 --batch 16 \
        --cpu-devices 1 --profile /tmp/prof --profile-steps 3:4 --no-progress

Reads the `*.trace.json.gz` that `jax.profiler` writes (the scripts' `--profile DIR`, or
`benchmarks.peers --profile-kit DIR`) under DIR/plugins/profile/<run>/; a directory means
its newest run. Categories by name, first match wins (`CATEGORIES`): only a hint. With
`--program HLO` (`kernel_times`, `join`) each event goes to the program's own kernel and
the times per step to the predictor's classes (vit_pure/xla/kernels.py): the JSON holds
`matched_fraction`, `classes_ms`, each kernel's time and `step_ms_trace` (`join` says how).
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
from vit_pure.xla import hlo, kernels
from vit_pure.xla.hlo import Instr, Module

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


def kernel_times(found: list, events: list[dict], steps: int, nested: bool = False,
                 module: Module | None = None) -> dict:
    """Each kernel of the program (`vit_pure.xla.kernels.kernels`) with its device time per
    step from the trace's events, and the time per step by the predictor's classes; what
    no kernel of the program takes counts as "unmatched". JSON-ready: what
    benchmarks.fit_step --profile reads.

    Given the program (`module`) and a GPU trace whose events name their module
    (`args.hlo_module`), the events are joined to it by `join` (a step run as one CUDA graph
    names only the graph in `hlo_op`); otherwise on each event's `hlo_op` (XLA:CPU's op
    events, a GPU step run kernel by kernel), every event of one kernel added."""
    if module is not None and any((e.get("args") or {}).get("hlo_module") for e in events):
        joined = join(module, events)
        by_op = collections.Counter({n: us * joined["executions"] for n, us in
                                     joined["us_per_step"].items()})
        steps = joined["executions"] or steps
        unmatched = joined["unmatched_us"] * steps
        extra = {"matched_fraction": joined["matched_fraction"],
                 "failed_name_checks": joined["failed_name_checks"],
                 "step_ms_trace": joined["step_ms"], "idle_ms": joined["idle_ms"],
                 "unmatched_top": joined["unmatched_top"]}
    else:
        by_op = collections.Counter()
        durations = self_times(events) if nested else [float(e["dur"]) for e in events]
        for e, dur in zip(events, durations):
            by_op[str((e.get("args") or {}).get("hlo_op") or e.get("name", ""))] += dur
        unmatched, extra = None, {}
    rows, classes = [], collections.Counter()
    for k in found:
        us = by_op.pop(k.name, 0.0) / steps
        classes[k.kind] += us
        rows.append({"name": k.name, "kind": k.kind, "bytes": k.bytes, "flops": k.flops,
                     "int_ops": k.int_ops, "attention_flops": k.attention_flops,
                     "variant": k.variant, "runs": k.runs, "shape": k.shape, "op": k.op, "us": us})
    if unmatched is None:
        unmatched = sum(by_op.values())
        extra = {"unmatched_top": [[n, t / steps] for n, t in by_op.most_common(8)]}
        matched = sum(classes.values())
        extra["matched_fraction"] = matched / (matched + unmatched / steps) if matched else 0.0
    else:
        unmatched += sum(by_op.values())
    unmatched /= steps
    return {"steps": steps, "total_us": sum(classes.values()) + unmatched,
            "classes_us": dict(classes), "unmatched_us": unmatched,
            "classes_ms": {k: v / 1e3 for k, v in classes.items()}, **extra,
            "kernels": rows}


# ------------------------------------------------ the trace joined to the program (GPU)
_MEMSET = re.compile(r"^Memset", re.IGNORECASE)
_LIBRARY_GEMM = re.compile(r"nvjet|gemm|cutlass|xmma|cublas|sm\d\d_", re.IGNORECASE)
_METADATA = re.compile(r"(metadata|backend_config|frontend_attributes)=\{.*$")


def _trace_name(name: str) -> str:
    """The kernel name a trace gives an instruction: its `.` written `_`."""
    return name.replace(".", "_")


def _signature(module: Module, instr: Instr) -> tuple:
    """What makes two fusions one compiled kernel: their kind, result and operands'
    shapes and fused computations, instruction by instruction, names left out."""
    def body(comp):
        instrs = module.computations.get(comp, [])
        pos = {i.name: k for k, i in enumerate(instrs)}
        return tuple((i.opcode, i.shape, i.index, tuple(pos.get(o, -1) for o in i.operands),
                      re.sub(r"%[\w.\-]+", "%", _METADATA.sub("", i.attrs)))
                     for i in instrs)
    kind = re.search(r"kind=(\w+)", instr.attrs)
    return (instr.opcode, instr.shape, kind and kind.group(1),
            tuple(body(c) for c in instr.callees))


def launches(module: Module) -> list[tuple[Instr, set[str]]]:
    """The entry computation's kernel-launching instructions in schedule order, each with
    the trace names it may run under: its own, its `deduplicated_name` (identical fusions
    share one compiled kernel, named after the first of the group in schedule order), and
    the first earlier fusion of the same signature (`_signature`: XLA de-duplicates some
    fusions without marking them)."""
    out, first = [], {}
    for instr in module.computations[module.entry]:
        if not kernels.launches_kernel(instr):
            continue
        names = {_trace_name(instr.name)}
        dedup = re.search(r'deduplicated_name="([^"]+)"', instr.attrs)
        if dedup:
            names.add(_trace_name(dedup.group(1)))
        if instr.opcode == "fusion":
            names.add(first.setdefault(_signature(module, instr), _trace_name(instr.name)))
        out.append((instr, names))
    return out


def _executions(module: Module, events: list[dict]) -> list[list[dict]]:
    """The program's executions in the trace: its module's device events (`args.hlo_module`
    the module's name; host-to-device copies and other jitted functions left out), grouped
    by `correlation_id` (one launch of the program, a CUDA graph or not), each in timestamp
    order, the executions in time order."""
    name = module.name
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if args.get("hlo_module") == name:
            groups[str(args.get("correlation_id"))].append(e)
    runs = [sorted(g, key=lambda e: float(e["ts"])) for g in groups.values()]
    return sorted(runs, key=lambda g: float(g[0]["ts"]))


def _walk(program: list[tuple[Instr, set[str]]], xla_names: set[str],
          run: list[dict]) -> tuple[list[float], list[tuple[str, float]], int]:
    """One execution's events walked beside the program's launches: per launch its
    microseconds, the events matched to none (name, us) and the failed name checks.

    An event named after an XLA kernel is the next fusion or copy (custom calls that
    launched nothing are passed over); if the next one runs under another name, the walk
    looks ahead for the launch it names (a failed check: those passed over stay at 0).
    Any other event (cuBLAS, cuDNN, a Memset) is a library call's: the current custom
    call's, until one starts the next call: a Memset after the call's kernels, a kernel
    it already ran, a second GEMM kernel in a cuBLAS call, or the other library."""
    times = [0.0] * len(program)
    unmatched, failed = [], 0
    pos, current, seen = 0, None, []  # next launch; the custom call being credited

    def starts_next(name: str) -> bool:
        if current is None:
            return True
        target = program[current][0].attrs
        kernels_run = [n for n in seen if not _MEMSET.match(n)]
        if _MEMSET.match(name):
            return bool(kernels_run)
        cudnn = "cudnn" in name.lower()
        if cudnn != ("cudnn" in target) or name in kernels_run:
            return True
        return (not cudnn and any(_LIBRARY_GEMM.search(n) for n in kernels_run)
                and bool(_LIBRARY_GEMM.search(name)))

    for e in run:
        name, us = str(e.get("name", "")), float(e["dur"])
        if name in xla_names:
            current, seen = None, []
            j = pos
            while j < len(program) and program[j][0].opcode == "custom-call":
                j += 1
            if j < len(program) and name in program[j][1]:
                times[j] += us
                pos = j + 1
                continue
            failed += 1
            ahead = next((k for k in range(j, len(program)) if name in program[k][1]), None)
            if ahead is None:
                unmatched.append((name, us))
            else:
                times[ahead] += us
                pos = ahead + 1
            continue
        if current is not None and not starts_next(name):
            times[current] += us
            seen.append(name)
            continue
        j = pos
        if j < len(program) and program[j][0].opcode != "fusion":
            # a custom call, or a copy run as a library memcpy kernel
            times[j] += us
            pos = j + 1
            current, seen = (j, [name]) if program[j][0].opcode == "custom-call" else (None, [])
        else:
            unmatched.append((name, us))
    return times, unmatched, failed


def join(module: Module, events: list[dict]) -> dict:
    """The trace's events joined to the program's kernels: per instruction its device
    microseconds per execution (`us_per_step`), `matched_fraction` (of the program's
    device time in the trace), the unmatched time per execution and its largest names,
    the failed name checks, and the pipelined step time (`step_ms`: from one execution's
    first kernel to the next's, averaged) with the idle time inside an execution.

    Needs the events' `args.hlo_module` and `correlation_id` (GPU traces). See `launches`
    and `_walk` for how each event finds its instruction."""
    runs = _executions(module, events)
    program = launches(module)
    xla_names = set().union(*(names for i, names in program if i.opcode == "fusion")) \
        if program else set()
    per = collections.Counter()
    missed = collections.Counter()
    failed, total = 0, 0.0
    idle = 0.0
    for run in runs:
        times, unmatched, bad = _walk(program, xla_names, run)
        for (instr, _), us in zip(program, times):
            per[instr.name] += us
        for name, us in unmatched:
            missed[name] += us
        failed += bad
        total += sum(float(e["dur"]) for e in run)
        end = float(run[0]["ts"])
        for e in run:
            idle += max(float(e["ts"]) - end, 0.0)
            end = max(end, float(e["ts"]) + float(e["dur"]))
    n = len(runs)
    starts = [float(r[0]["ts"]) for r in runs]
    step_ms = (starts[-1] - starts[0]) / (n - 1) / 1e3 if n > 1 else None
    matched = sum(per.values())
    return {"executions": n, "us_per_step": {k: v / n for k, v in per.items()} if n else {},
            "matched_fraction": matched / total if total else 0.0,
            "unmatched_us": sum(missed.values()) / n if n else 0.0,
            "unmatched_top": [[k, v / n] for k, v in missed.most_common(8)],
            "failed_name_checks": failed, "step_ms": step_ms,
            "idle_ms": idle / n / 1e3 if n else None}


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


def read_program(path: str) -> Module:
    """An optimised HLO module's text (`compiled.as_text()`, XLA's
    *gpu_after_optimizations.txt dump; gzipped or not); TraceError if unreadable."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as fh:
            return hlo.parse_module(fh.read())
    except (OSError, ValueError) as e:
        raise TraceError(f"--program {path}: not a readable HLO module ({e})") from None


def program_times(path: str, program: str) -> tuple[dict, list[str]]:
    """The trace at `path` joined to the program at `program` (`kernel_times`): per
    step, each kernel's time and the time by the predictor's classes."""
    files = find_traces(path)
    events, source = device_events(load_events(files))
    if not events:
        raise TraceError(f"{path}: the trace has no device or XLA op events")
    module = read_program(program)
    found = kernels.kernels(module, lambda comp: hlo.computation_dot_flops(module, comp))
    cpu = source.startswith(CPU_SOURCE)
    steps = max(len(_executions(module, events)), 1)
    times = kernel_times(found, events, steps, nested=cpu, module=None if cpu else module)
    return {"source": source, **times}, files


def format_program_times(times: dict) -> str:
    """The time per class (ms per step) and what was left unmatched, as Markdown."""
    rows = [[k, f"{v:.2f}"] for k, v in sorted(times["classes_ms"].items(),
                                                key=lambda kv: -kv[1])]
    rows.append(["(no kernel of the program)", f"{times['unmatched_us'] / 1e3:.2f}"])
    step = times.get("step_ms_trace")
    lines = [f"{times['steps']} executions of the program; "
             f"{100 * times['matched_fraction']:.1f}% of their device time matched to its "
             f"kernels ({times.get('failed_name_checks', 0)} failed name checks)"
             + (f"; step {step:.2f} ms from one execution's start to the next, "
                f"{times['idle_ms']:.2f} ms idle inside one" if step else ""), "",
             harness.markdown_table(["class", "ms per step"], rows, numeric=[1])]
    if times.get("unmatched_top"):
        lines += ["", "unmatched (ms per step): " + ", ".join(
            f"{_short(n, 40)} {us / 1e3:.2f}" for n, us in times["unmatched_top"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = cli.doc_parser(__doc__)
    p.add_argument("trace", help="a *.trace.json.gz, or a --profile directory (newest run)")
    p.add_argument("--top", type=int, default=15, help="how many kernels to list")
    p.add_argument("--program", default=None, metavar="HLO",
                   help="the traced program's optimised HLO text (.txt or .txt.gz): join "
                        "the trace to its kernels and give the time by the predictor's classes")
    p.add_argument("--json", default=None, help="also write the breakdown to this JSON file")
    args = p.parse_args(argv)
    if args.top < 0:
        p.error("--top must be >= 0")
    try:
        if args.program:
            result, files = program_times(args.trace, args.program)
        else:
            result, source, files = analyse(args.trace, args.top)
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# trace: {', '.join(files)}")
    if args.program:
        print(f"# program: {args.program}")
        print(format_program_times(result))
    else:
        print(format_breakdown(result, source))
        result = {"source": source, **result}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"files": files, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
