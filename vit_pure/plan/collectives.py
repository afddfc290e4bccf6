"""The collectives of a compiled training step: read from its HLO (kind, mesh axes, dtype,
bytes, executions per step, the kit's line that wrote it), with the dtypes that JAX asked
for (the lowered StableHLO), and grouped into calls as XLA:GPU would combine them.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

from vit_pure.plan import interconnect as ic
from vit_pure.xla.hlo import DTYPE_BYTES, Module, arrays, kit_path, op_source, shape_bytes

# XLA:GPU's default combine threshold for all-reduce, all-gather and reduce-scatter
# (xla/service/collective_utils.h: kDefaultAllReduceCombineThreshold = 30 MiB + 7).
GPU_COMBINE_BYTES = 30 * 2**20 + 7
# The CPU pass that would merge the per-array all-reduces (and lose their source lines).
CPU_COMBINER = "cpu-all-reduce-combiner"
# The pass that drops remat's optimization barriers before CSE; without them XLA:CPU merges
# each recomputed value (FSDP's re-gathers included) into its forward copy, which XLA:GPU
# does not. Kept off, so the CPU program recomputes (and holds memory) as the GPU's does.
CPU_BARRIER_EXPANDER = "cse_barrier_expander"
_COLLECTIVE_OPS = {"all-reduce": ic.ALL_REDUCE, "all-reduce-start": ic.ALL_REDUCE,
                   "all-gather": ic.ALL_GATHER, "all-gather-start": ic.ALL_GATHER,
                   "reduce-scatter": ic.REDUCE_SCATTER, "collective-permute": ic.PERMUTE,
                   "collective-permute-start": ic.PERMUTE, "all-to-all": ic.ALL_TO_ALL}


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
    message: int = 0         # bytes of the call that carries it (its bucket); 0: nbytes
    overlap: str = ""        # CRITICAL or OVERLAPPABLE (classify_overlap)
    reason: str = ""         # why: what it waits for, what waits for it

    def record(self) -> dict:
        return {"kind": self.kind, "axes": self.axes, "dtype": self.dtype,
                "bytes": self.nbytes, "count": self.count, "source": self.source,
                "overlap": self.overlap}


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
            operand_shape = " ".join(instr.operand_shapes(shapes))
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
            if want in DTYPE_BYTES and "/" not in c.dtype:
                c.nbytes = c.nbytes * DTYPE_BYTES[want] // DTYPE_BYTES[c.dtype]
                done[(c.kind, c.dtype, want, c.source)] += 1
                c.dtype = want
    return [f"{n} {kind} op(s) at {source}: {old} in XLA:CPU's compiled program, {new} in "
            f"the lowered program; counted as {new}"
            for (kind, old, new, source), n in sorted(done.items())]


def correct_counts(found: list[Collective],
                   lowered: list[tuple[str, str, int, str]]) -> tuple[list[Collective], list[str]]:
    """Where the lowered program has more collectives of one kind, source line and size than
    the compiled one, the compiled program merged some that the target keeps (XLA:CPU folds
    a re-gather into its forward copy once remat's barrier is gone; XLA:GPU keeps the
    barrier). Returns the missing ones (copies of a compiled op with that key: same count,
    placement and overlap) and one line per source."""
    asked = collections.Counter((kind, source, elements) for kind, source, elements, _ in lowered)
    have = collections.defaultdict(list)
    for c in found:
        have[(c.kind, c.source.split(" ")[0], c.elements)].append(c)
    added, lines = [], []
    for (kind, source, elements), cs in sorted(have.items()):
        missing = asked.get((kind, source, elements), 0) - len(cs)
        for k in range(max(missing, 0)):
            added.append(dataclasses.replace(cs[0], name=f"{cs[0].name}.lowered{k}"))
        if missing > 0:
            lines.append(f"{missing} {kind} op(s) at {source} ({elements:,} elements): in the "
                         f"lowered program, merged by XLA:CPU's compile; counted")
    return added, lines


# ------------------------------------------------------- combining, as XLA:GPU would
def model_calls(module: Module, found: list[Collective],
                threshold: int = GPU_COMBINE_BYTES) -> dict[int, int]:
    """Calls per step for each collective, after modelling XLA:GPU's combiners: in
    schedule order, independent collectives of the same kind, axes and dtype in the same
    computation share a call until the bucket holds `threshold` bytes. Independent: no
    path from one to the other (read from the operands). Permutes are not combined.
    Returns {id(collective): calls per step it starts} (a bucket's call is charged to
    the collective that opens it), and sets each collective's `message` to its bucket's
    bytes."""
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
                open_buckets[key] = (bucket[0] | bit[c.index], bucket[1] + c.nbytes,
                                     bucket[2] + [c])
                calls[id(c)] = 0
            else:
                open_buckets[key] = (bit[c.index], c.nbytes, [c])
                calls[id(c)] = c.count
            for member in open_buckets[key][2]:  # the call's size sets its bandwidth
                member.message = open_buckets[key][1]
    return calls
