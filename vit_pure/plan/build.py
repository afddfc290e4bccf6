"""The communication plan: what a training step will cost on a mesh you do not have.

    python train_shardmap.py --model vit-b16 --batch 4096 --dtype bf16 \
        --mesh data=64,model=4 --plan 256 --hardware h100
    python train_pmap.py --model vit-b16 --batch 4096 --dtype bf16 --plan 64 --plan-json p.json

`--plan N` compiles the script's own training step for N fake CPU devices (one SPMD
program: its size barely depends on N) and trains nothing. It reads the plan out of the
compiled per-device program, not out of a description of the model:

1. Every collective the program runs (`read_collectives`): kind; mesh axes (its replica
   groups, which name mesh positions, mapped through the mesh's shape); dtype; bytes per
   device per execution (V, see vit_pure/plan/interconnect.py); executions per optimizer step
   (the product of the `known_trip_count`s of the while loops around it: `--scan`,
   `--accum-steps`); and the kit's file:line that wrote it (the op's metadata points into
   the stack-frame table at the top of the HLO text; the innermost frame in the kit).
2. Bytes as the target moves them. The step is built with the target's defaults
   (`hardware.resolve` for the target's platform: on a GPU the matmuls return bf16).
   Two XLA:CPU habits are undone: its all-reduce combiner is switched off for the compile
   (`cpu-all-reduce-combiner`), so every array keeps its own collective and its source
   line; XLA:GPU's combining (30 MiB buckets of independent collectives, XLA's
   kDefaultAllReduceCombineThreshold) is then modelled for the latency term. And XLA:CPU
   upcasts bf16 all-reduces to f32: where the lowered StableHLO (what JAX asked for) has
   another dtype than the compiled op at the same source line and size, the lowered dtype
   counts. The report lists each correction.
3. Time per mesh axis from the formulas in vit_pure/plan/interconnect.py and its cited table.
4. Compute: the matmul FLOPs of the per-device program, counted from its dot ops with loop
   trip counts, over peak x efficiency. Not `cost_analysis()`: XLA counts a while loop's
   body once (wrong under --scan / accumulation) and adds elementwise work, and on GPU it
   misses gemm fusions. Counting the compiled program keeps what only it knows: the
   pipeline's idle ticks, the embedding and head every tensor-parallel rank repeats.
5. Memory per device: XLA's memory analysis of the compiled step (arguments + outputs -
   aliased + temporaries). Of the CPU compile: XLA:GPU's buffer assignment differs.
6. The step with no overlap (compute + communication) and with full overlap (the larger
   of the two), MFU for both (model FLOPs, bench.py's count, over step x peak), and a
   verdict with the rule that gave it.

This module writes no collective: it compiles the scripts' steps and reads them.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import re
import time

import numpy as np

from vit_pure.run import cli  # (cli.build_parser calls add_flags: the module, not its names)
from vit_pure.plan import interconnect as ic

REPO = pathlib.Path(__file__).resolve().parents[2]
# XLA:GPU's default combine threshold for all-reduce, all-gather and reduce-scatter
# (xla/service/collective_utils.h: kDefaultAllReduceCombineThreshold = 30 MiB + 7).
GPU_COMBINE_BYTES = 30 * 2**20 + 7
# The CPU pass that would merge the per-array all-reduces (and lose their source lines).
CPU_COMBINER = "cpu-all-reduce-combiner"
DEFAULT_EFFICIENCY = 0.4
# The images the training loop feeds: CIFAR-10's (vit_pure/data/cifar10.py), whatever the model's
# input size; the step resizes them on the device (the 224-pixel presets).
DATASET_IMAGE_SHAPE = (32, 32, 3)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "token": 0}
_COLLECTIVE_OPS = {"all-reduce": ic.ALL_REDUCE, "all-reduce-start": ic.ALL_REDUCE,
                   "all-gather": ic.ALL_GATHER, "all-gather-start": ic.ALL_GATHER,
                   "reduce-scatter": ic.REDUCE_SCATTER, "collective-permute": ic.PERMUTE,
                   "collective-permute-start": ic.PERMUTE, "all-to-all": ic.ALL_TO_ALL}


# ------------------------------------------------------------------------------- flags
def add_flags(parser: argparse.ArgumentParser) -> None:
    """The planning flags (both scripts)."""
    g = parser.add_argument_group(
        "planning a run at scale (docs/planning.md)",
        "--plan N compiles the training step for N devices on fake CPU devices, trains "
        "nothing, and prints its collectives, their cost on --hardware, the compute, the "
        "memory, the predicted step and a verdict.")
    g.add_argument("--plan", type=int, default=None, metavar="N",
                   help="plan the step for N devices instead of training")
    g.add_argument("--hardware", default="h100", metavar="NAME",
                   help=f"target of the plan: {', '.join(ic.HARDWARE)}")
    g.add_argument("--plan-json", default=None, metavar="FILE",
                   help="also write the plan as JSON")
    g.add_argument("--gpus-per-node", type=int, default=None, metavar="P",
                   help="devices per node (fast links inside; default: the hardware's, 8 "
                        "for GPUs)")
    g.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY, metavar="E",
                   help="fraction of the peak the step's matmuls reach (measure it with "
                        "bench.py on one device: its 'MFU (datasheet)')")
    g.add_argument("--peak-tflops", type=float, default=None, help="override the peak")
    g.add_argument("--intra-gbps", type=float, default=None, metavar="GB/S",
                   help="override the bus bandwidth inside a node")
    g.add_argument("--inter-gbps", type=float, default=None, metavar="GB/S",
                   help="override the per-device bandwidth across nodes")
    g.add_argument("--latency-us", type=float, default=None, help="override the latency per call")


def target_hardware(args) -> ic.Hardware:
    """The --hardware entry with the flags' overrides; UsageError for bad values."""
    name = args.hardware.strip().lower()
    if name not in ic.HARDWARE:
        raise cli.UsageError(f"--hardware {args.hardware!r}: unknown; choose one of "
                         f"{', '.join(ic.HARDWARE)}")
    for flag in ("plan", "gpus_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise cli.UsageError(f"{cli.flag_name(flag)} must be >= 1, got {value}")
    for flag in ("peak_tflops", "intra_gbps", "inter_gbps"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise cli.UsageError(f"{cli.flag_name(flag)} must be positive, got {value}")
    if args.latency_us is not None and args.latency_us < 0:
        raise cli.UsageError(f"--latency-us must be >= 0, got {args.latency_us}")
    if not 0 < args.efficiency <= 1:
        raise cli.UsageError(f"--efficiency must be in (0, 1], got {args.efficiency}")
    return ic.with_overrides(ic.HARDWARE[name], peak_tflops=args.peak_tflops,
                             intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps,
                             devices_per_node=args.gpus_per_node, latency_us=args.latency_us)


# ------------------------------------------------------------------------- HLO reading
@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


@dataclasses.dataclass
class Module:
    """A compiled HLO module's text, parsed just enough: computations, their
    instructions, how often each computation runs per execution, the stack frames."""
    computations: dict[str, list[Instr]]
    entry: str
    runs: dict[str, int]          # computation -> executions per step (trip counts)
    unknown_trips: int            # while loops without a known trip count (counted once)
    frames: dict[int, tuple[str, int, str, int]]  # frame -> (file, line, function, parent)


_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"\b(calls|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse_instr(name: str, rest: str) -> Instr | None:
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.find(" ")
    shape, tail = rest[:end], rest[end:].lstrip()
    m = re.match(r"([\w\-]+)\(", tail)
    if not m:
        return None
    close = _balanced(tail, m.end() - 1)
    operands = re.findall(r"%([\w.\-]+)", tail[m.end():close - 1])
    return Instr(name, shape, m.group(1), operands, tail[close:])


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """'(f32[4,24]{1,0}, bf16[])' -> [('f32', (4, 24)), ('bf16', ())]."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(re.sub(r"\{[^}]*\}", "", shape))
            if dt in _DTYPE_BYTES]


def shape_bytes(shape: str) -> int:
    return sum(_DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in arrays(shape))


def parse_module(text: str) -> Module:
    computations, entry, current = {}, None, None
    frames_text = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    table = None
    for line in text.splitlines():
        if line in frames_text:
            table = frames_text[line]
            continue
        if table is not None:
            m = re.match(r"^(\d+)\s+(.*)$", line)
            if m:
                table[int(m.group(1))] = m.group(2)
                continue
            table = None
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            computations[current] = []
            if h.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            instr = _parse_instr(m.group(1), m.group(2))
            if instr is not None:
                computations[current].append(instr)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    runs, unknown = _executions(computations, entry)
    return Module(computations, entry, runs, unknown, _frames(frames_text))


def _executions(computations, entry) -> tuple[dict[str, int], int]:
    """How many times each computation runs per execution of the entry: a while body
    runs its known_trip_count times per run of its caller; fusions, calls and branches
    once (a conditional's branches are all counted: an upper bound)."""
    runs = collections.Counter()
    unknown = 0

    def visit(name, times):
        nonlocal unknown
        runs[name] += times
        for instr in computations.get(name, ()):
            for kind, callee in _CALLEE.findall(instr.attrs):
                if kind == "to_apply":  # reduction bodies: scalar adds
                    continue
                factor = 1
                if kind == "body":
                    trip = _TRIP.search(instr.attrs)
                    if trip is None:
                        unknown += 1
                    else:
                        factor = int(trip.group(1))
                visit(callee, times * factor)
            for group in _BRANCHES.findall(instr.attrs):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    visit(callee, times)

    visit(entry, 1)
    return dict(runs), unknown


def _frames(tables) -> dict[int, tuple[str, int, str, int]]:
    def quoted(s):
        return s.strip().strip('"')

    files = {k: quoted(v) for k, v in tables["FileNames"].items()}
    funcs = {k: quoted(v) for k, v in tables["FunctionNames"].items()}
    locs = {}
    for k, v in tables["FileLocations"].items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        locs[k] = (files.get(int(f.get("file_name_id", 0)), "?"), int(f.get("line", 0)),
                   funcs.get(int(f.get("function_name_id", 0)), "?"))
    frames = {}
    for k, v in tables["StackFrames"].items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        loc = locs.get(int(f.get("file_location_id", 0)), ("?", 0, "?"))
        frames[k] = (*loc, int(f.get("parent_frame_id", 0)))
    return frames


def kit_path(path: str) -> str | None:
    """`path` relative to the kit's root, or None outside it (site-packages, jax)."""
    try:
        rel = pathlib.Path(path).resolve().relative_to(REPO)
    except (ValueError, OSError):
        return None
    return None if rel.parts[0].startswith(".") else rel.as_posix()


def op_source(module: Module, attrs: str) -> str:
    """'vit_pure/model.py:198 (_reduce_from_tp)': the innermost frame of the op's stack
    that lies in the kit (a parent id equal to the frame's own marks the outermost)."""
    m = re.search(r"stack_frame_id=(\d+)", attrs)
    frame = int(m.group(1)) if m else 0
    seen = set()
    while frame in module.frames and frame not in seen:
        seen.add(frame)
        path, line, func, parent = module.frames[frame]
        rel = kit_path(path)
        if rel is not None:
            return f"{rel}:{line} ({func.rsplit('.', 1)[-1]})"
        frame = parent
    m = re.search(r'source_file="([^"]+)" source_line=(\d+)', attrs)
    if m and kit_path(m.group(1)):
        return f"{kit_path(m.group(1))}:{m.group(2)}"
    return "?"


# ------------------------------------------------------------------- the collectives
@dataclasses.dataclass
class Collective:
    """One collective op of the compiled program."""
    kind: str
    axes: str                # mesh axes, '+'-joined ('data', 'data+model', ...)
    dtype: str               # as the target moves it (after corrections)
    nbytes: int              # V: bytes per device per execution
    count: int               # executions per optimizer step
    source: str              # the kit's file:line that wrote it
    elements: int
    where: ic.Placement
    computation: str
    index: int               # position in its computation (schedule order)
    compiled_dtype: str = ""
    name: str = ""           # the HLO instruction's name

    def record(self) -> dict:
        return {"kind": self.kind, "axes": self.axes, "dtype": self.dtype,
                "bytes": self.nbytes, "count": self.count, "source": self.source}


def _replica_groups(attrs: str, n_devices: int) -> list[list[int]]:
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:  # iota form: arange(prod(dims)).reshape(dims).transpose(perm).reshape(groups)
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m and m.group(1):
        return [[int(x) for x in g.split(",") if x]
                for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [list(range(n_devices))]


def _pairs(attrs: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))] if m else []


def mesh_axes_of(ids: list[list[int]], mesh_shape: dict[str, int],
                 pairs: bool = False) -> str:
    """The mesh axes along which the positions in each group (or each source -> target
    pair) differ: the axes the collective runs over."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying = set()
    for group in ids:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T
        varying |= {names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1}
    axes = [a for a in names if a in varying]
    if not pairs and ids and math.prod(mesh_shape[a] for a in axes) != len(ids[0]):
        return "+".join(axes) + " (partial)"
    return "+".join(axes) or "-"


def read_collectives(module: Module, mesh_shape: dict[str, int],
                     devices_per_node: int) -> list[Collective]:
    n_devices = math.prod(mesh_shape.values())
    found = []
    for comp, instrs in module.computations.items():
        times = module.runs.get(comp, 0)
        if not times:
            continue
        shapes = {i.name: i.shape for i in instrs}
        for index, instr in enumerate(instrs):
            kind = _COLLECTIVE_OPS.get(instr.opcode)
            if kind is None:
                continue
            if kind == ic.PERMUTE:
                pairs = _pairs(instr.attrs)
                axes = mesh_axes_of([list(p) for p in pairs], mesh_shape, pairs=True)
                where = ic.placement([], devices_per_node, pairs)
                n = 2
            else:
                groups = _replica_groups(instr.attrs, n_devices)
                axes = mesh_axes_of(groups, mesh_shape)
                where = ic.placement(groups, devices_per_node)
                n = len(groups[0])
            # V from the operands: the buffer each device contributes (all-reduce,
            # reduce-scatter, permute), or for an all-gather n times its shard.
            operand_shape = " ".join(shapes.get(o, "") for o in instr.operands)
            if not operand_shape.strip():
                operand_shape = instr.shape
            nbytes = shape_bytes(operand_shape) * (n if kind == ic.ALL_GATHER else 1)
            parts = arrays(operand_shape)
            dtype = "/".join(sorted({dt for dt, _ in parts})) or "?"
            elements = sum(math.prod(d) for _, d in parts) * (n if kind == ic.ALL_GATHER else 1)
            found.append(Collective(kind, axes, dtype, nbytes, times,
                                    op_source(module, instr.attrs), elements, where, comp,
                                    index, dtype, instr.name))
    return found


# --------------------------------------------------- dtype corrections from StableHLO
_LOWERED_OP = re.compile(r'"stablehlo\.(all_reduce|all_gather|reduce_scatter|collective_permute)"')
_LOWERED_SIG = re.compile(r":\s*\((.*?)\)\s*->\s*(\(.*?\)|tensor<[^>]*>)\s+loc\((#loc\d+)\)")
_LOC_DEF = re.compile(r"^(#loc\d+) = loc\((.*)\)\s*$", re.M)
_TENSOR = re.compile(r"tensor<((?:\d+x)*)(\w+)>")


def _loc_file(locs: dict[str, str], ref: str, depth: int = 0) -> tuple[str, int] | None:
    """The innermost file:line of a StableHLO location (a callsite's callee first)."""
    if depth > 200 or ref not in locs:
        return None
    body = locs[ref]
    m = re.match(r'^"([^"]+)":(\d+):', body)
    if m:
        return m.group(1), int(m.group(2))
    for inner in re.findall(r"#loc\d+", body):
        found = _loc_file(locs, inner, depth + 1)
        if found is not None:
            return found
    return None


def lowered_collectives(text: str) -> list[tuple[str, str, int, str]]:
    """(kind, source 'path:line', elements, dtype) of each collective result in the lowered
    StableHLO (`lowered.as_text(debug_info=True)`): what JAX asked for, before XLA."""
    locs = dict(_LOC_DEF.findall(text))
    kinds = {"all_reduce": ic.ALL_REDUCE, "all_gather": ic.ALL_GATHER,
             "reduce_scatter": ic.REDUCE_SCATTER, "collective_permute": ic.PERMUTE}
    found = []
    for m in _LOWERED_OP.finditer(text):
        sig = _LOWERED_SIG.search(text, m.end())
        if sig is None:
            continue
        where = _loc_file(locs, sig.group(3))
        source = f"{kit_path(where[0]) or where[0]}:{where[1]}" if where else "?"
        # Sizes as read_collectives counts them: a reduce-scatter by its (whole) operand.
        types = sig.group(1) if m.group(1) == "reduce_scatter" else sig.group(2)
        for dims, dtype in _TENSOR.findall(types):
            elements = math.prod(int(d) for d in dims.split("x") if d)
            found.append((kinds[m.group(1)], source, elements, dtype))
    return found


_MLIR_TO_HLO = {"bf16": "bf16", "f16": "f16", "f32": "f32", "f64": "f64", "i32": "s32",
                "ui32": "u32", "i8": "s8", "ui8": "u8", "i1": "pred", "i64": "s64"}


def correct_dtypes(found: list[Collective], lowered: list[tuple[str, str, int, str]]) -> list[str]:
    """Where the compiled op's dtype differs from the lowered op's at the same source
    line, kind and size, take the lowered one (XLA:CPU upcasts bf16 all-reduces to f32;
    XLA:GPU reduces them in bf16). Returns one line per kind of correction."""
    asked = collections.defaultdict(set)
    for kind, source, elements, dtype in lowered:
        asked[(kind, source, elements)].add(_MLIR_TO_HLO.get(dtype, dtype))
    done = collections.Counter()
    for c in found:
        options = asked.get((c.kind, c.source.split(" ")[0], c.elements), set())
        if len(options) == 1 and c.dtype not in options:
            (want,) = options
            if want in _DTYPE_BYTES and "/" not in c.dtype:
                c.nbytes = c.nbytes * _DTYPE_BYTES[want] // _DTYPE_BYTES[c.dtype]
                done[(c.kind, c.dtype, want, c.source)] += 1
                c.dtype = want
    return [f"{n} {kind} op(s) at {source}: {old} in XLA:CPU's compiled program, {new} in "
            f"the lowered program; counted as {new}"
            for (kind, old, new, source), n in sorted(done.items())]


# ------------------------------------------------------- combining, as XLA:GPU would
def model_calls(module: Module, found: list[Collective],
                threshold: int = GPU_COMBINE_BYTES) -> dict[int, int]:
    """Calls per step for each collective, after modelling XLA:GPU's combiners: in
    schedule order, independent collectives of the same kind, axes and dtype in the same
    computation share a call until the bucket holds `threshold` bytes. Independent: no
    path from one to the other (read from the operands). Permutes are not combined.
    Returns {id(collective): calls per step it starts} (a bucket's call is charged to
    the collective that opens it)."""
    by_comp = collections.defaultdict(list)
    for c in found:
        by_comp[c.computation].append(c)
    calls = {}
    for comp, members in by_comp.items():
        bit = {m.index: 1 << k for k, m in enumerate(members)}
        ancestors = {}
        for i, instr in enumerate(module.computations[comp]):
            mask = bit.get(i, 0)
            for o in instr.operands:
                mask |= ancestors.get(o, 0)
            ancestors[instr.name] = mask
        names = {i: instr.name for i, instr in enumerate(module.computations[comp])}
        open_buckets = {}
        for c in sorted(members, key=lambda m: m.index):
            key = (c.kind, c.axes, c.dtype)
            mine = ancestors[names[c.index]] & ~bit[c.index]
            bucket = open_buckets.get(key)
            if (c.kind != ic.PERMUTE and bucket is not None and not (mine & bucket[0])
                    and bucket[1] + c.nbytes <= threshold):
                open_buckets[key] = (bucket[0] | bit[c.index], bucket[1] + c.nbytes)
                calls[id(c)] = 0
            else:
                open_buckets[key] = (bit[c.index], c.nbytes)
                calls[id(c)] = c.count
    return calls


# ------------------------------------------------------------------------- FLOPs
def dot_flops(module: Module) -> int:
    """Matmul FLOPs per step of the per-device program: 2 x output elements x the
    contracted size, for every dot, times its computation's executions."""
    total = 0
    for comp, instrs in module.computations.items():
        times = module.runs.get(comp, 0)
        if not times:
            continue
        shapes = {i.name: i.shape for i in instrs}
        for instr in instrs:
            if instr.opcode != "dot":
                continue
            lhs = arrays(shapes.get(instr.operands[0], ""))
            out = arrays(instr.shape)
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
            if not lhs or not out or m is None:
                continue
            contracted = math.prod(lhs[0][1][int(d)] for d in m.group(1).split(",") if d)
            total += times * 2 * math.prod(out[0][1]) * contracted
    return total


# ---------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Plan:
    script: str
    devices: int
    mesh: dict[str, int]
    hardware: ic.Hardware
    efficiency: float
    global_batch: int
    per_device_batch: int
    tokens_per_image: int
    params_per_device: int
    collectives: list[Collective]
    calls: dict[int, int]
    corrections: list[str]
    program_flops: int
    model_flops: float
    memory: dict[str, int]
    compile_s: float
    notes: list[str]
    compiled: object = None  # the executable the plan was read from (tests run it)

    # -- time
    def seconds(self, c: Collective) -> float:
        return (c.count * ic.transfer_seconds(c.kind, c.nbytes, c.where, self.hardware)
                + self.calls.get(id(c), c.count) * ic.latency_seconds(c.where, self.hardware))

    def per_axis(self) -> dict[str, dict]:
        out = {}
        for c in self.collectives:
            row = out.setdefault(c.axes, {"bytes": 0, "wire_bytes": 0.0, "calls": 0,
                                          "ops": 0, "seconds": 0.0})
            row["bytes"] += c.nbytes * c.count
            row["wire_bytes"] += c.count * ic.wire_bytes(c.kind, c.nbytes, c.where.n)
            row["calls"] += self.calls.get(id(c), c.count)
            row["ops"] += c.count
            row["seconds"] += self.seconds(c)
        return out

    @property
    def compute_s(self) -> float:
        return self.program_flops / (self.hardware.peak_flops * self.efficiency)

    @property
    def comm_s(self) -> float:
        return sum(self.seconds(c) for c in self.collectives)

    def mfu(self, step_s: float) -> float:
        return self.model_flops / (step_s * self.hardware.peak_flops) if step_s else 0.0

    @property
    def memory_bytes(self) -> int:
        from vit_pure.run.accum import StepMemory  # (accum imports cli, which imports this module)
        return StepMemory(1, **self.memory).total

    # -- verdict
    def verdict(self) -> tuple[str, str]:
        compute, comm = self.compute_s, self.comm_s
        axes = self.per_axis()
        rule = ("rule: ratio = communication / compute (no overlap); ratio > 1: "
                "communication-bound on the axis with the most time; else compute-bound. "
                "On 'data' the gradient collectives do not grow with the per-device batch "
                "and the compute does, so the balance batch is b x t_axis / t_compute")
        fits = self.memory_bytes <= self.hardware.memory_bytes
        memory = ("" if fits else
                  f"; does not fit: {self.memory_bytes / 2**30:.1f} GiB per device > "
                  f"{self.hardware.memory_bytes / 2**30:.0f} GiB (--accum-steps K or "
                  f"--remat block)")
        ratio = comm / compute if compute else math.inf
        if ratio <= 1 or not axes:
            return (f"compute-bound: communication is {ratio:.2f}x the compute "
                    f"({comm * 1e3:.2f} of {compute * 1e3:.2f} ms){memory}", rule)
        axis, row = max(axes.items(), key=lambda kv: kv[1]["seconds"])
        share = row["seconds"] / compute
        advice = self._advice(axis, row["seconds"], compute)
        return (f"communication-bound {ratio:.2f}x; '{axis}' alone {share:.1f}x the compute "
                f"({row['seconds'] * 1e3:.2f} vs {compute * 1e3:.2f} ms): {advice}{memory}", rule)

    def _advice(self, axis: str, axis_s: float, compute_s: float) -> str:
        b = self.per_device_batch
        if axis == "data" or axis.startswith("data"):
            need = math.ceil(b * axis_s / compute_s)
            return (f"raise the per-device batch from {b} to >= {need} images "
                    f"(>= {need * self.tokens_per_image:,} tokens), or fewer, larger "
                    f"devices on 'data'")
        if "model" in axis:
            return ("tensor parallelism's activation all-reduces grow with the batch: keep "
                    f"'model' inside a node (<= {self.hardware.devices_per_node}) or use a "
                    "smaller model= and more data=")
        if "pipe" in axis:
            return "fewer pipeline stages, or more micro-batches per stage"
        return "reduce the collectives on this axis"

    # -- output
    def record(self) -> dict:
        verdict, rule = self.verdict()
        no_overlap = self.compute_s + self.comm_s
        overlap = max(self.compute_s, self.comm_s)
        return {
            "devices": self.devices, "mesh": self.mesh, "script": self.script,
            "hardware": dataclasses.asdict(self.hardware) | {"efficiency": self.efficiency},
            "params_per_device": self.params_per_device,
            "global_batch": self.global_batch, "per_device_batch": self.per_device_batch,
            "collectives": [c.record() for c in self.collectives],
            "per_axis": self.per_axis(),
            "corrections": self.corrections,
            "flops": {"program_per_device": self.program_flops,
                      "model_per_device": self.model_flops},
            "memory": self.memory | {"total": self.memory_bytes},
            "predicted": {"compute_s": self.compute_s, "comm_s": self.comm_s,
                          "step_s": no_overlap, "mfu": self.mfu(no_overlap),
                          "step_overlap_s": overlap, "mfu_overlap": self.mfu(overlap)},
            "verdict": verdict, "rule": rule, "compile_s": self.compile_s, "notes": self.notes,
        }

    def report(self) -> str:
        hw = self.hardware
        lines = [f"plan: {self.script} for {self.devices} devices, mesh "
                 + " x ".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1 or k == "data")
                 + f"; global batch {self.global_batch} ({self.per_device_batch} per data "
                 f"rank); compiled on {self.devices} fake CPU devices in {self.compile_s:.1f} s",
                 f"hardware {hw.describe()}", f"  sources: {hw.sources}"]
        lines += [f"  {note}" for note in self.notes]
        lines.append("corrections for the target:")
        lines.append(f"  XLA:CPU's {CPU_COMBINER} switched off; XLA:GPU's combining "
                     f"({GPU_COMBINE_BYTES / 2**20:.0f} MiB buckets of independent "
                     "collectives) modelled for the latency term")
        lines += [f"  {c}" for c in self.corrections] or ["  dtypes: none needed"]
        lines.append("collectives per device (V = bytes per execution; count = executions "
                     "per optimizer step, loop trip counts included; calls = XLA:GPU calls "
                     "as modelled, a shared call counted on the row that opens it):")
        lines.append(f"  {'kind':<19}{'axes':<12}{'dtype':<6}{'ops':>5}{'V min..max':>22}"
                     f"{'count/step':>11}{'calls':>7}{'MB/step':>10}{'ms/step':>9}  source")
        groups = collections.defaultdict(list)
        for c in self.collectives:
            groups[(c.kind, c.axes, c.dtype, c.source)].append(c)
        for (kind, axes, dtype, source), cs in sorted(
                groups.items(), key=lambda kv: -sum(self.seconds(c) for c in kv[1])):
            sizes = [c.nbytes for c in cs]
            span = (_size(min(sizes)) if min(sizes) == max(sizes)
                    else f"{_size(min(sizes))}..{_size(max(sizes))}")
            lines.append(
                f"  {kind:<19}{axes:<12}{dtype:<6}{len(cs):>5}{span:>22}"
                f"{sum(c.count for c in cs):>11}"
                f"{sum(self.calls.get(id(c), c.count) for c in cs):>7}"
                f"{sum(c.nbytes * c.count for c in cs) / 1e6:>10.1f}"
                f"{sum(self.seconds(c) for c in cs) * 1e3:>9.3f}  {source}")
        lines.append("per mesh axis (per device per step):")
        for axis, row in sorted(self.per_axis().items(), key=lambda kv: -kv[1]["seconds"]):
            lines.append(f"  {axis:<12} V {row['bytes'] / 1e6:9.1f} MB, sent on the wire "
                         f"{row['wire_bytes'] / 1e6:9.1f} MB, {row['ops']} executions in "
                         f"{row['calls']} calls: {row['seconds'] * 1e3:.3f} ms")
        compute = self.compute_s
        lines.append(f"compute: {self.program_flops / 1e9:,.1f} GFLOP per device per step "
                     f"(dot ops of the compiled program, trip counts included; model "
                     f"{self.model_flops / 1e9:,.1f}) / ({hw.peak_flops / 1e12:.0f} TFLOP/s x "
                     f"{self.efficiency:.2f}) = {compute * 1e3:.2f} ms")
        m = self.memory
        lines.append(f"memory: {self.memory_bytes / 2**30:.2f} GiB per device (XLA's "
                     f"analysis of the CPU compile: arguments {_size(m['argument'])} + outputs "
                     f"{_size(m['output'])} - aliased {_size(m['alias'])} + temporaries "
                     f"{_size(m['temp'])}) of {hw.memory_bytes / 2**30:.0f} GiB; params "
                     f"{self.params_per_device:,} per device")
        no_overlap, overlap = compute + self.comm_s, max(compute, self.comm_s)
        lines.append(f"predicted step: {no_overlap * 1e3:.2f} ms with no overlap (MFU "
                     f"{self.mfu(no_overlap):.1%}), {overlap * 1e3:.2f} ms with full overlap "
                     f"(MFU {self.mfu(overlap):.1%}); communication {self.comm_s * 1e3:.2f} ms")
        verdict, rule = self.verdict()
        lines += [f"verdict: {verdict}", rule]
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------- building it
def abstract_inputs(strategy, sc, optimizer, global_batch: int) -> tuple:
    """ShapeDtypeStructs for the train step's inputs, laid out as the strategy places
    them (shard_map: NamedShardings over its mesh; pmap: a leading device axis)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from vit_pure.step import init_state

    shapes = jax.eval_shape(lambda: init_state(jax.random.key(0), sc.cfg, sc.policy, optimizer,
                                               ema=sc.ema_decay > 0))
    key = jax.eval_shape(lambda: jax.random.key(0))
    batch = [((global_batch, *DATASET_IMAGE_SHAPE), jnp.uint8),
             ((global_batch,), jnp.int32), ((global_batch,), jnp.int32)]
    mesh = getattr(strategy, "mesh", None)
    if mesh is not None:
        def place(spec, tree):
            sharding = NamedSharding(mesh, spec)
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=sharding), tree)
        state = jax.tree.map(place, strategy.state_specs, shapes,
                             is_leaf=lambda x: isinstance(x, P))
        data = NamedSharding(mesh, P("data"))
        return (state, *(jax.ShapeDtypeStruct(s, d, sharding=data) for s, d in batch),
                jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P())))
    n = strategy.n_devices
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), shapes)
    return (state, *(jax.ShapeDtypeStruct((n, s[0] // n, *s[1:]), d) for s, d in batch),
            jax.ShapeDtypeStruct(key.shape, key.dtype))


def mesh_of(strategy) -> dict[str, int]:
    mesh = getattr(strategy, "mesh", None)
    return dict(mesh.shape) if mesh is not None else {"data": strategy.n_devices}


def params_per_device(strategy, sc) -> int:
    """Parameter elements one device holds (its blocks of the sharded ones)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from vit_pure.model import init_params

    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), sc.cfg))
    specs = getattr(strategy, "param_specs", None)
    if specs is None:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    mesh = mesh_of(strategy)

    def local(spec, x):
        axes = [a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))]
        split = math.prod(mesh[a] for a in axes)
        return math.prod(x.shape) // split
    return sum(jax.tree.leaves(jax.tree.map(local, specs, shapes,
                                            is_leaf=lambda x: isinstance(x, P))))


def model_flops_per_device(cfg, global_batch: int, devices: int) -> float:
    """bench.py's count (matmuls, training = 3 x forward) for this device's share."""
    from vit_pure.xla.flops import train_flops_per_image  # the kit's one FLOP convention
    return train_flops_per_image(cfg) * global_batch / devices


def build_plan(strategy, sc, optimizer, global_batch: int, hw: ic.Hardware, *,
               script: str, efficiency: float = DEFAULT_EFFICIENCY,
               notes: tuple[str, ...] = ()) -> Plan:
    """Compile `strategy.train_step` for its devices and read the plan out of it."""
    t0 = time.perf_counter()
    lowered = strategy.train_step.lower(*abstract_inputs(strategy, sc, optimizer, global_batch))
    compiled = lowered.compile(compiler_options={"xla_disable_hlo_passes": CPU_COMBINER})
    compile_s = time.perf_counter() - t0
    module = parse_module(compiled.as_text())
    mesh = mesh_of(strategy)
    devices = math.prod(mesh.values())
    found = read_collectives(module, mesh, hw.devices_per_node)
    corrections = correct_dtypes(found, lowered_collectives(lowered.as_text(debug_info=True)))
    notes = list(notes)
    if module.unknown_trips:
        notes.append(f"{module.unknown_trips} while loop(s) without a known trip count: "
                     "their collectives are counted once")
    from vit_pure.run.accum import StepMemory  # (accum imports cli, which imports this module)
    m = StepMemory.of(compiled)
    memory = {"argument": m.argument, "output": m.output, "alias": m.alias, "temp": m.temp}
    per_device_batch = global_batch // mesh.get("data", 1)
    return Plan(script, devices, mesh, hw, efficiency, global_batch, per_device_batch,
                sc.cfg.seq_len, params_per_device(strategy, sc), found,
                model_calls(module, found), corrections, dot_flops(module),
                model_flops_per_device(sc.cfg, global_batch, devices), memory, compile_s, notes,
                compiled)


def run(args, make_strategy, script: str) -> dict:
    """`--plan N` for a training script: fake CPU devices, the step built with the
    target's defaults, compiled, planned, printed (and written to --plan-json).
    `make_strategy(sc, optimizer, devices)` is the script's strategy factory."""
    hw = target_hardware(args)
    n = args.plan
    if args.distributed or args.coordinator is not None:
        raise cli.UsageError("--plan compiles on this machine alone: drop the multi-process flags")
    devices = _fake_devices(n)

    import dataclasses as dc

    from vit_pure import step

    sc = step.StepConfig.from_args(args, platform=hw.platform)
    notes = [f"target defaults ({hw.platform}): " + "; ".join(sc.notes)] if sc.notes else []
    k = args.accum_steps
    if k == "auto":
        k = 1
        notes.append("--accum-steps auto is decided on the device; planned with 1 (give "
                     "--accum-steps K to plan another)")
    sc = dc.replace(sc, accum_steps=k)
    optimizer, _ = step.make_optimizer(args, 1000)
    strategy = make_strategy(sc, optimizer, devices)
    strategy.check_batch(args.batch, accum_steps=k)
    notes.append(f"policy {sc.policy}, layers {'scanned' if sc.scan else 'unrolled'}, remat "
                 f"{sc.remat}, accumulation {k}")
    plan = build_plan(strategy, sc, optimizer, args.batch, hw, script=script,
                      efficiency=args.efficiency, notes=tuple(notes))
    print(plan.report(), flush=True)
    record = plan.record()
    if args.plan_json:
        with open(args.plan_json, "w") as f:
            json.dump(record, f, indent=1)
    return record


def _fake_devices(n: int) -> list:
    """n CPU devices: fake ones, asked for before JAX starts its backends. A process that
    has already started them (a test session) must have at least n."""
    import jax
    from jax._src import xla_bridge  # no public "have the backends started?"

    if not xla_bridge.backends_are_initialized():
        cli.use_cpu_devices(n)
        jax.config.update("jax_platforms", "cpu")
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise cli.UsageError(f"--plan {n}: this process already runs JAX with {len(cpus)} "
                             "CPU devices; run the plan in a fresh process")
    return cpus[:n]
