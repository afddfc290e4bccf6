"""One reader of XLA's HLO text (`compiled.as_text()`): computations, instructions, how
many times each computation runs per step (the `known_trip_count`s of the while loops
around it), the kit's file:line behind an op, and the matmul FLOPs of a program; and two
readings of the lowered StableHLO (`lowered.as_text()`): its matmul FLOPs as written and
the precision each matmul asks for.

Both text forms of a tuple's element are read: jax 0.10's `get-tuple-element(%t),
index=i` and jax 0.11's operand `%t#i`, which `Instr.operand_shapes` resolves to the i-th
array of the tuple (not the whole tuple).

Pure text: nothing here compiles or runs. The communication plan (vit_pure/plan/) reads
its collectives through it, the benchmarks their programs.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "token": 0}


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    index: int | None = None  # parameter(i)'s i; a get-tuple-element's index=i
    elements: list[int | None] = dataclasses.field(default_factory=list)  # `%t#i`'s i

    def operand_shapes(self, shapes: dict[str, str]) -> list[str]:
        """Each operand's shape: a tuple element written `%t#i` (jax 0.11) is the i-th
        array of t's tuple, any other operand its producer's whole shape."""
        elements = self.elements or [None] * len(self.operands)
        return [shapes.get(o, "") if i is None else tuple_element(shapes.get(o, ""), i)
                for o, i in zip(self.operands, elements)]

    @property
    def dtype(self) -> str:
        """The element type of a single-array result ('' for a tuple)."""
        found = arrays(self.shape)
        return found[0][0] if len(found) == 1 and not self.shape.startswith("(") else ""

    @property
    def callees(self) -> list[str]:
        """The computations it runs (reduction bodies and a while's condition left out):
        a fusion's or call's computation, a while's body, a conditional's branches."""
        branches = [c for group in _BRANCHES.findall(self.attrs)
                    for c in re.findall(r"%([\w.\-]+)", group)]
        return [c for kind, c in _CALLEE.findall(self.attrs) if kind != "to_apply"] + branches


@dataclasses.dataclass
class Module:
    """A compiled HLO module's text, parsed just enough: computations, their
    instructions, how often each computation runs per execution, the stack frames."""
    computations: dict[str, list[Instr]]
    entry: str
    runs: dict[str, int]          # computation -> executions per step (trip counts)
    unknown_trips: int            # while loops without a known trip count (counted once)
    frames: dict[int, tuple[str, int, str, int]]  # frame -> (file, line, function, parent)
    name: str = ""                # the HloModule line's name (a trace's `hlo_module`)


_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(r"\b(calls|body|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)(?:#(\d+))?")


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
    inside, attrs = tail[m.end():close - 1], tail[close:]
    found = _OPERAND.findall(inside)
    operands = [name for name, _ in found]
    elements = [int(i) if i else None for _, i in found]
    index = re.search(r"\bindex=(\d+)", attrs)
    if m.group(1) == "parameter" and inside.strip().isdigit():
        index = int(inside)
    elif index is not None:
        index = int(index.group(1))
    return Instr(name, shape, m.group(1), operands, attrs, index, elements)


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """'(f32[4,24]{1,0}, bf16[])' -> [('f32', (4, 24)), ('bf16', ())]."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(re.sub(r"\{[^}]*\}", "", shape))
            if dt in DTYPE_BYTES]


def tuple_element(shape: str, i: int) -> str:
    """'(f32[4]{0}, (s8[2], u8[1]))', 1 -> '(s8[2], u8[1])': the i-th top-level element of
    a tuple shape ('' past its end); a shape that is not a tuple is its own element 0."""
    shape = re.sub(r"/\*[^*]*\*/", "", shape).strip()
    if not shape.startswith("("):
        return shape if i == 0 else ""
    parts, depth, start = [], 0, 1
    for k, ch in enumerate(shape):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                parts.append(shape[start:k])
                break
        elif ch == "," and depth == 1:
            parts.append(shape[start:k])
            start = k + 1
    return parts[i].strip() if i < len(parts) else ""


def shape_bytes(shape: str) -> int:
    return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in arrays(shape))


def parse_module(text: str) -> Module:
    computations, entry, current = {}, None, None
    named = re.match(r"HloModule\s+([\w.\-]+)", text)
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
    return Module(computations, entry, runs, unknown, _frames(frames_text),
                  named.group(1) if named else "")


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


def computation_dot_flops(module: Module, comp: str) -> int:
    """Matmul FLOPs of one run of a computation's own dots (not of those it calls):
    2 x output elements x the contracted size each. For a GEMM fusion's computation,
    the FLOPs of the kernel."""
    total = 0
    instrs = module.computations.get(comp, [])
    shapes = {i.name: i.shape for i in instrs}
    for instr in instrs:
        if instr.opcode != "dot":
            continue
        lhs = arrays(instr.operand_shapes(shapes)[0])
        out = arrays(instr.shape)
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
        if not lhs or not out or m is None:
            continue
        contracted = math.prod(lhs[0][1][int(d)] for d in m.group(1).split(",") if d)
        total += 2 * math.prod(out[0][1]) * contracted
    return total


def dot_flops(module: Module) -> int:
    """Matmul FLOPs per step of the per-device program: every dot's
    (`computation_dot_flops`), times its computation's executions."""
    return sum(module.runs.get(comp, 0) * computation_dot_flops(module, comp)
               for comp in module.computations)


# ------------------------------------------------------- the lowered program (StableHLO)
_STABLEHLO_DOT = re.compile(r"stablehlo\.dot_general.*?contracting_dims = \[([\d, ]*)\] x .*?"
                            r": \(tensor<([^>]*)>, tensor<[^>]*>\) -> tensor<([^>]*)>")


def _tensor_dims(tensor_type: str) -> list[int]:
    """'2x17x24xf32' -> [2, 17, 24]."""
    return [int(d) for d in tensor_type.split("x")[:-1]]


def stablehlo_dot_flops(text: str) -> int:
    """FLOPs of every dot_general in a lowered StableHLO module (jitted.lower().as_text()):
    2 x output elements x contracted elements. Each dot is counted once as written, so
    a loop body (lax.scan) counts once: use it on unrolled programs."""
    total = 0
    for lhs_contract, lhs, out in _STABLEHLO_DOT.findall(text):
        lhs_dims = _tensor_dims(lhs)
        contracted = math.prod(lhs_dims[int(i)] for i in lhs_contract.split(",") if i.strip())
        total += 2 * math.prod(_tensor_dims(out)) * contracted
    return total


def dot_precisions(lowered_text: str) -> collections.Counter:
    """Precision attributes of the dot_generals in lowered StableHLO (lowered.as_text()):
    Counter({'HIGHEST': 54}) means all 54 matmuls run at HIGHEST; 'none' counts dots
    with no precision attribute (they get the backend default)."""
    found = collections.Counter()
    for line in lowered_text.splitlines():
        if "stablehlo.dot_general" in line:
            m = re.search(r"precision = \[(\w+), (\w+)\]", line)
            found["none" if m is None else
                  m.group(1) if m.group(1) == m.group(2) else f"{m.group(1)},{m.group(2)}"] += 1
    return found
