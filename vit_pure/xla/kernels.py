"""The kernels of a program compiled for a GPU (XLA:GPU's HLO text) and the HBM traffic
each one makes, by class, with the step's bandwidth / compute floor and predicted time.

A kernel is an instruction that runs on its own (in the entry or a while body, not inside
a fusion): a fusion, a library call (cuBLAS GEMM, cuDNN attention, the kit's Pallas
attention), a copy, a collective.
Its traffic is operand plus output bytes (a cuBLAS workspace left out): a floor. The
step's floor: per kernel max(bytes / bandwidth, FLOPs / the fastest GEMM rate measured)
plus a launch. The predicted step (`predicted_s`) prices each kernel at efficiencies
fitted class by class to a profile (`Rates`, `CLASSES`; benchmarks/fit_step.py --profile).
`traffic` lists the kernels that move the most bytes; `gemms` the distinct GEMMs.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

from vit_pure.xla.hlo import Instr, Module, arrays, shape_bytes, tuple_element

CLASSES = ("gemm", "attention", "rng", "norms/reductions", "elementwise",
           "transposes/copies", "collectives", "other")
GEMM_SHAPES = ("wide", "narrow", "ragged")  # `gemm_shape_class`
ATTENTION_PASSES = ("forward", "backward")
LAUNCH_S = 3e-6
# A kernel doing this many integer operations per byte it moves hashes random bits
# (Threefry: ~250 for a u8 dropout mask); indexing and masks elsewhere do under 25.
RNG_INT_OPS_PER_BYTE = 32
# cuDNN's flash attention computes whole tiles of the score matrix (its fprop and bprop
# kernels on sm90: 64 or 128 query rows by 128 keys): at short sequences the padding is
# most of the work.
ATTENTION_TILE = 128
# The kit's Pallas attention (layers/attention_pallas.py): its kernel bodies' names, which
# the compiled program's custom calls carry in their op_name. Priced as an attention pass
# at cuDNN's fitted shares of its padded tiles' FLOPs until a profile fits its own.
PALLAS_ATTENTION = ("attention_pallas_forward", "attention_pallas_backward")
LARGEST = 12  # groups of alike kernels listed by `traffic`
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                "all-to-all")
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                "conditional", "call", "after-all", "partition-id", "replica-id",
                "opt-barrier", "add-dependency", "domain"}
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# jax 0.10 writes the fusion's kind first in its backend config; jax 0.11 may put a
# `block_level_fusion_config` (Triton tiling) before it.
_FUSION_KIND = re.compile(r'"fusion_backend_config":\{(?:[^"]|"(?!kind"))*?"kind":"([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_INT_DTYPES = {"s8", "s16", "s32", "s64", "u8", "u16", "u32", "u64"}
_INT_OPS = {"add", "subtract", "multiply", "divide", "remainder", "and", "or", "xor", "not",
            "shift-left", "shift-right-logical", "shift-right-arithmetic", "maximum",
            "minimum", "negate"}


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    kind: str      # one of CLASSES
    bytes: int     # operands + outputs, per execution
    flops: int     # matmul FLOPs, per execution (GEMMs only)
    runs: int      # executions per step
    shape: str = ""  # its output, physical layout (XLA:GPU's shapes are major to minor)
    op: str = ""     # the JAX operation it came from: its op_name's last two parts
    int_ops: int = 0  # integer arithmetic (`int_ops`), per execution
    attention_flops: int = 0  # cuDNN attention's matmul FLOPs as its tiles run, per execution
    variant: str = ""  # a GEMM's shape class (GEMM_SHAPES); attention's pass (forward, backward)


@dataclasses.dataclass(frozen=True)
class Rates:
    """What `predicted_s` prices a kernel at, besides the GPU's bandwidth and peak: the
    fraction of each reached, INT32 operations a second and a launch's cost.

    e_mem, e_gemm and e_attention hold for every class, GEMM shape class and attention
    pass that the `*_by_*` pairs (name, fraction) do not name: a class's memory-bound
    kernels at their share of HBM, GEMMs by shape class at their share of the peak,
    cuDNN's forward and backward attention at theirs (of its tiles' FLOPs)."""
    e_mem: float
    e_gemm: float
    e_attention: float
    int_per_s: float
    launch_s: float = LAUNCH_S
    e_mem_by_class: tuple[tuple[str, float], ...] = ()
    e_gemm_by_shape: tuple[tuple[str, float], ...] = ()
    e_attention_by_pass: tuple[tuple[str, float], ...] = ()

    def mem(self, kind: str) -> float:
        """The share of HBM bandwidth a kernel of class `kind` reaches."""
        return dict(self.e_mem_by_class).get(kind, self.e_mem)

    def compute(self, kind: str, variant: str) -> float:
        """The share of the peak a GEMM (by shape class) or an attention pass reaches."""
        if kind == "attention":
            return dict(self.e_attention_by_pass).get(variant, self.e_attention)
        return dict(self.e_gemm_by_shape).get(variant, self.e_gemm)

    def fastest_gemm(self) -> float:
        """The highest share of the peak any GEMM class reaches: the measured ceiling."""
        return max([self.e_gemm, *dict(self.e_gemm_by_shape).values()])


# The H100 SXM, fitted class by class (benchmarks/fit_step.py --profile) to a profile of
# the shipped program's steps on one H100 joined to that GPU's own program (the run's
# files, the figures and their command: docs/performance.md). The GEMM shape classes at
# their measured share of the 989 TFLOP/s datasheet peak; cuDNN's passes at theirs of
# its tiles' FLOPs; the memory-bound classes at their measured share of 3.35 TB/s; the
# random-bit hashes on their measured INT32 rate; a launch the idle time per kernel.
H100_RATES = Rates(
    e_mem=0.78, e_gemm=0.73, e_attention=0.167, int_per_s=21.1e12, launch_s=0.62e-6,
    e_mem_by_class=(("norms/reductions", 0.78), ("elementwise", 0.82),
                    ("transposes/copies", 0.55), ("gemm", 1.0), ("attention", 1.0)),
    e_gemm_by_shape=(("wide", 0.73), ("narrow", 0.54), ("ragged", 0.52)),
    e_attention_by_pass=(("forward", 0.167), ("backward", 0.114)))
# The H200, fitted the same way to a profile of the same program's steps on one H200
# (docs/gpu-runs/). The same die as the H100 (132 SMs at 1.98 GHz) with faster memory:
# its GEMMs reach a larger share of the peak, its memory-bound kernels a smaller share of
# 4.8 TB/s (about the bytes per second they reach on an H100).
H200_RATES = Rates(
    e_mem=0.61, e_gemm=0.66, e_attention=0.132, int_per_s=19.2e12, launch_s=0.70e-6,
    e_mem_by_class=(("norms/reductions", 0.65), ("elementwise", 0.625),
                    ("transposes/copies", 0.39), ("gemm", 1.0), ("attention", 1.0)),
    e_gemm_by_shape=(("wide", 0.78), ("narrow", 0.66), ("ragged", 0.57)),
    e_attention_by_pass=(("forward", 0.152), ("backward", 0.125)))
RATES = {"h100": H100_RATES, "h200": H200_RATES}  # --hardware name -> its rates


def launches_kernel(instr: Instr) -> bool:
    """Whether an instruction of a computation that runs (not a fused one) is a kernel:
    not a parameter, tuple, bitcast, control flow or an async operation's `-done`."""
    return instr.opcode not in _NOT_KERNELS and not instr.opcode.endswith("-done")


def classify(instr: Instr) -> str:
    """The class of a kernel, from its opcode, library target, fusion kind and name."""
    op = instr.opcode.removesuffix("-start")
    if op in _COLLECTIVES:
        return "collectives"
    if instr.opcode == "custom-call":
        target = (_TARGET.search(instr.attrs) or [None, ""])[1]
        if "cublas" in target or "gemm" in target.lower():
            return "gemm"
        if "cudnn$fmha" in target or "fmha" in target or _pallas_pass(instr):
            return "attention"
        return "other"
    fusion_kind = (_FUSION_KIND.search(instr.attrs) or [None, ""])[1]
    gemm_fusion = any(k in fusion_kind for k in ("gemm", "cublas", "cudnn"))
    if gemm_fusion or op in ("dot", "convolution"):
        return "gemm"
    if op in ("copy", "transpose") or "transpose" in instr.name or "copy" in instr.name:
        return "transposes/copies"
    if "reduce" in instr.name or op == "reduce" or "kind=kInput" in instr.attrs:
        return "norms/reductions"
    if op == "fusion" or op in ("add", "multiply", "select", "convert", "broadcast"):
        return "elementwise"
    return "other"


def _gemm_flops(instr: Instr, shapes: dict[str, str]) -> int:
    """2 x output elements x contracted size, for a library GEMM call or a bare dot: its
    lhs the operand it names (a tuple's element resolved), its output the result, not the
    workspace."""
    lhs = arrays(instr.operand_shapes(shapes)[0]) if instr.operands else []
    out = arrays(_results(instr))
    dims = _dims(instr.attrs, "lhs_contracting")
    if not dims or not lhs or not out:
        return 0
    return 2 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in dims)


def _gemm_mnk(instr: Instr, shapes: dict[str, str]) -> tuple[int, int, int] | None:
    """A GEMM's (M, N, K): the lhs's and rhs's free sizes and the contracted size, batch
    dimensions left out; None where the operands or dimensions cannot be read."""
    operands = [arrays(s) for s in instr.operand_shapes(shapes)[:2]]
    if len(operands) < 2 or not all(operands):
        return None
    (_, lhs), (_, rhs) = operands[0][0], operands[1][0]
    lc, rc = _dims(instr.attrs, "lhs_contracting"), _dims(instr.attrs, "rhs_contracting")
    lb, rb = _dims(instr.attrs, "lhs_batch"), _dims(instr.attrs, "rhs_batch")
    if not lc or max(lc + lb, default=0) >= len(lhs) or max(rc + rb, default=0) >= len(rhs):
        return None
    m = math.prod(d for i, d in enumerate(lhs) if i not in lc + lb)
    n = math.prod(d for i, d in enumerate(rhs) if i not in rc + rb)
    return m, n, math.prod(lhs[i] for i in lc)


def gemm_shape_class(mnk: tuple[int, int, int] | None) -> str:
    """A GEMM's shape class, what its efficiency depends on (the H100 profile in
    docs/performance.md):

        ragged   a size not a multiple of 64 (the ones column's K = 392, a 10-class head):
                 the tiles run part empty
        narrow   the two smaller sizes both <= 384 (q, k, v and out projections, their
                 weight gradients): too little work per byte read to reach the peak
        wide     the rest (the MLP's GEMMs: K or N of 1536)
    """
    if mnk is None:
        return "ragged"
    if any(d % 64 for d in mnk):
        return "ragged"
    return "narrow" if sorted(mnk)[1] <= 384 else "wide"


def _fusion_gemm_class(module: Module, instr: Instr) -> str:
    """The shape class of the first dot inside a GEMM fusion."""
    for comp in instr.callees:
        body = module.computations.get(comp, [])
        shapes = {i.name: i.shape for i in body}
        for i in body:
            if i.opcode == "dot":
                return gemm_shape_class(_gemm_mnk(i, shapes))
    return "ragged"


def _pallas_pass(instr: Instr) -> str:
    """"forward" or "backward" for a custom call of the kit's Pallas attention, else ""."""
    op = (_OP_NAME.search(instr.attrs) or [None, ""])[1]
    return next((name.rsplit("_", 1)[1] for name in PALLAS_ATTENTION if name in op), "")


def _attention_pass(instr: Instr) -> str:
    """An attention kernel's pass, "forward" or "backward" (cuDNN's or the Pallas one's)."""
    return _pallas_pass(instr) or ("backward" if "Backward" in instr.attrs else "forward")


def _pallas_attention_flops(instr: Instr, shapes: dict[str, str], backward: bool) -> int:
    """The Pallas attention's FLOPs as issued: its log-sum-exp (B, H, Rp) float32 (the
    forward's second output, the backward's second operand) gives the pairs and the padded
    length of the tokens after the first, and with it the width of its (B*T, H*D) context
    (forward) or (B*T, 3*H*D) gradient (backward) the head size; per product an (Rp, Rp, D)
    block on the tensor cores and token 0's row and column beside it, 2 Rp (Rp + 2) D: two
    products forward, five backward (`attention_pallas.attention_cost`)."""
    lse = (instr.operand_shapes(shapes)[1] if backward else tuple_element(instr.shape, 1))
    (_, (b, h, rp)), = arrays(lse)
    width = arrays(instr.shape if backward else tuple_element(instr.shape, 0))[0][1][-1]
    d = width // ((3 if backward else 1) * h)
    return (5 if backward else 2) * b * h * 2 * rp * (rp + 2) * d


def _attention_flops(instr: Instr, shapes: dict[str, str], attention_pass: str) -> int:
    """cuDNN's fused attention as its kernels run it: q (B, T, H, D) as its first operand,
    each (batch, head) pair's T x T scores computed in whole ATTENTION_TILE x
    ATTENTION_TILE tiles (T rounded up); the forward runs two products (4 B H T'^2 D
    FLOPs), the backward five (the scores again, dV, dP, dQ, dK). The Pallas attention:
    `_pallas_attention_flops`."""
    backward = attention_pass == "backward"
    if _pallas_pass(instr):
        return _pallas_attention_flops(instr, shapes, backward)
    q = arrays(instr.operand_shapes(shapes)[0])
    if not q or len(q[0][1]) != 4:
        return 0
    b, t, h, d = q[0][1]
    tiled = -(-t // ATTENTION_TILE) * ATTENTION_TILE
    return (10 if backward else 4) * b * h * tiled * tiled * d


def _results(instr: Instr) -> str:
    """What a kernel writes: its shape, less a library call's scratch workspace (the s8
    array a cuBLAS call's tuple ends with, the u8 one of cuDNN's attention: the backward's
    f32 dQ accumulator lives there, its cost is in the pass's fitted efficiency)."""
    if instr.opcode == "custom-call" and instr.shape.startswith("("):
        parts, k = [], 0
        while (part := tuple_element(instr.shape, k)):
            parts.append(part)
            k += 1
        if len(parts) > 1 and parts[-1].startswith(("s8[", "u8[")):
            parts = parts[:-1]
        return ", ".join(parts)
    return instr.shape


def int_ops(module: Module, comp: str) -> int:
    """Integer arithmetic in a fused computation (and any it calls): each add, multiply,
    bitwise or shift instruction of an integer type, times its output's elements."""
    total = 0
    for instr in module.computations.get(comp, []):
        if instr.opcode in _INT_OPS and instr.dtype in _INT_DTYPES:
            total += math.prod(arrays(instr.shape)[0][1])
        total += sum(int_ops(module, c) for c in instr.callees)
    return total


def _untouched_bytes(module: Module, instr: Instr) -> int:
    """Bytes of a fusion's operands and outputs that the kernel names but does not move:
    a result that is a dynamic-update-slice of a parameter is updated in place (a ring
    slot written, one layer's gradient added into a stack: XLA aliases the buffer), and a
    parameter read only through (dynamic-)slices is read only there (a ring slot read).
    The kernel moves the slices; the whole buffers count in neither operands nor outputs
    but once per slice. 0 for any other kernel."""
    if instr.opcode != "fusion" or not instr.callees:
        return 0
    body = module.computations.get(instr.callees[0], [])
    if not body:
        return 0
    by_name = {i.name: i for i in body}
    root = body[-1]
    results = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    saved = 0
    for r in results:
        if (r is not None and r.opcode == "dynamic-update-slice" and len(r.operands) > 1
                and getattr(by_name.get(r.operands[0]), "opcode", "") == "parameter"
                and r.operands[1] in by_name):
            # the buffer in and out, less the slice written (and read, for an add)
            saved += 2 * shape_bytes(r.shape) - 2 * shape_bytes(by_name[r.operands[1]].shape)
    users: dict[str, list[Instr]] = {}
    for i in body:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    for p in (i for i in body if i.opcode == "parameter"):
        uses = users.get(p.name, [])
        if uses and all(u.opcode in ("dynamic-slice", "slice") and u.operands[0] == p.name
                        for u in uses):
            saved += shape_bytes(p.shape) - sum(shape_bytes(u.shape) for u in uses)
    return saved


def kernels(module: Module, dot_flops_of=None) -> list[Kernel]:
    """Every kernel the program launches per step, in program order. `dot_flops_of(comp)`
    (optional) gives the matmul FLOPs inside a fused computation (Triton GEMMs)."""
    fused = {c for instrs in module.computations.values() for i in instrs
             if i.opcode in ("fusion", "custom-call") for c in i.callees}
    out = []
    for comp, instrs in module.computations.items():
        runs = module.runs.get(comp, 0)
        if not runs or comp in fused:
            continue
        shapes = {i.name: i.shape for i in instrs}
        for instr in instrs:
            if not launches_kernel(instr):
                continue
            kind = classify(instr)
            ints = sum(int_ops(module, c) for c in instr.callees) if kind != "gemm" else 0
            outputs = _results(instr)
            nbytes = shape_bytes(outputs) + sum(shape_bytes(s)
                                                for s in instr.operand_shapes(shapes))
            nbytes -= _untouched_bytes(module, instr)
            if kind not in ("gemm", "attention") and ints >= RNG_INT_OPS_PER_BYTE * nbytes > 0:
                kind = "rng"
            flops, variant, attention_flops = 0, "", 0
            if kind == "gemm":
                library = instr.opcode in ("custom-call", "dot")
                flops = (_gemm_flops(instr, shapes) if library else
                         sum(dot_flops_of(c) for c in instr.callees) if dot_flops_of else 0)
                variant = (gemm_shape_class(_gemm_mnk(instr, shapes)) if library
                           else _fusion_gemm_class(module, instr))
            elif kind == "attention":
                variant = _attention_pass(instr)
                if instr.operands:
                    attention_flops = _attention_flops(instr, shapes, variant)
            op = (_OP_NAME.search(instr.attrs) or [None, ""])[1]
            out.append(Kernel(instr.name, kind, nbytes, flops, runs, outputs,
                              "/".join(op.split("/")[-2:]), ints,
                              attention_flops=attention_flops,
                              variant=variant))
    return out


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One distinct GEMM of a program, as a kernel runs it: each operand's shape in memory
    order (major to minor, its layout applied) and dtype, the contracting and batch
    dimensions in that order, the result's dtype; `runs` per step."""
    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    lhs_dtype: str
    rhs_dtype: str
    out_dtype: str
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    runs: int = 0

    @property
    def flops(self) -> int:
        """2 x batch x free lhs x free rhs x contracted, per run."""
        free_rhs = [d for i, d in enumerate(self.rhs)
                    if i not in self.rhs_contracting + self.rhs_batch]
        return 2 * math.prod(self.lhs) * math.prod(free_rhs)

    def label(self) -> str:
        """'bf16[262144,384] x bf16[384,1536] -> bf16 (contract 1x0)'."""
        def dims(x):
            return ",".join(map(str, x))
        batch = (f", batch {dims(self.lhs_batch)}x{dims(self.rhs_batch)}"
                 if self.lhs_batch else "")
        return (f"{self.lhs_dtype}[{dims(self.lhs)}] x {self.rhs_dtype}[{dims(self.rhs)}] -> "
                f"{self.out_dtype} (contract {dims(self.lhs_contracting)}x"
                f"{dims(self.rhs_contracting)}{batch})")


def _in_memory_order(shape: str) -> tuple[str, tuple[int, ...], list[int]]:
    """'bf16[4,8]{0,1}' -> ('bf16', (8, 4), [1, 0]): dims major to minor, and where each
    logical dimension sits in that order."""
    [(dtype, dims)] = arrays(shape)[:1] or [("", ())]
    m = re.search(r"\]\{([\d,]*)", shape)
    minor_to_major = [int(d) for d in m.group(1).split(",") if d] if m else []
    if sorted(minor_to_major) != list(range(len(dims))):
        minor_to_major = list(range(len(dims)))[::-1]
    order = minor_to_major[::-1]
    return dtype, tuple(dims[d] for d in order), [order.index(d) for d in range(len(dims))]


def _dims(attrs: str, key: str) -> tuple[int, ...]:
    """A dot's dimension list from a cuBLAS call's JSON or a dot's attribute."""
    m = (re.search(rf'"{key}_dimensions":\[([^\]]*)\]', attrs)
         or re.search(rf"\b{key}_dims=\{{([\d,]*)\}}", attrs))
    return tuple(int(d.strip('" ')) for d in m.group(1).split(",") if d.strip('" ')) if m else ()


def gemms(module: Module) -> list[Gemm]:
    """The program's distinct GEMMs (cuBLAS calls, and dots in any computation that runs:
    Triton GEMM fusions, XLA:CPU's dots), with their executions per step, most FLOPs first."""
    found: dict[Gemm, int] = collections.Counter()
    calls = collections.Counter()  # computation -> fusions calling it per step
    for comp, instrs in module.computations.items():
        for i in instrs:
            if i.opcode == "fusion":
                for c in i.callees:
                    calls[c] += module.runs.get(comp, 0)
    for comp, instrs in module.computations.items():
        runs = module.runs.get(comp, 0) or calls.get(comp, 0)
        shapes = {i.name: i.shape for i in instrs}
        for i in instrs:
            cublas = i.opcode == "custom-call" and "cublas" in i.attrs
            if not runs or not (cublas or i.opcode == "dot") or len(i.operands) < 2:
                continue
            (lt, ls, lpos), (rt, rs, rpos) = (_in_memory_order(s)
                                              for s in i.operand_shapes(shapes)[:2])
            out = arrays(_results(i))
            if not ls or not rs or not out:
                continue
            g = Gemm(ls, rs, lt, rt, out[0][0],
                     tuple(lpos[d] for d in _dims(i.attrs, "lhs_contracting")),
                     tuple(rpos[d] for d in _dims(i.attrs, "rhs_contracting")),
                     tuple(lpos[d] for d in _dims(i.attrs, "lhs_batch")),
                     tuple(rpos[d] for d in _dims(i.attrs, "rhs_batch")))
            found[g] += runs
    out = [dataclasses.replace(g, runs=n) for g, n in found.items()]
    return sorted(out, key=lambda g: -g.flops * g.runs)


def traffic(found: list[Kernel], bandwidth: float, peak_flops: float,
            rates: Rates = H100_RATES) -> dict:
    """Per class: kernels, HBM bytes and GEMM FLOPs per step, and the floor of the step
    (module docstring), as JSON-ready numbers."""
    by = collections.OrderedDict((k, {"kernels": 0, "bytes": 0, "flops": 0, "int_ops": 0})
                                 for k in CLASSES)
    floor = 0.0
    ceiling = peak_flops * rates.fastest_gemm()
    for k in found:
        row = by[k.kind]
        row["kernels"] += k.runs
        row["bytes"] += k.bytes * k.runs
        row["flops"] += k.flops * k.runs
        row["int_ops"] += k.int_ops * k.runs
        floor += k.runs * (max(k.bytes / bandwidth, (k.flops + k.attention_flops) / ceiling)
                           + rates.launch_s)
    total = sum(r["bytes"] for r in by.values())
    alike = collections.OrderedDict()  # (class, shape, op) -> the group, first seen first
    for k in found:
        group = alike.setdefault((k.kind, k.shape, k.op), {
            "name": k.name, "kind": k.kind, "shape": k.shape, "op": k.op, "kernels": 0,
            "bytes": 0})
        group["kernels"] += k.runs
        group["bytes"] += k.bytes * k.runs
    largest = sorted(alike.values(), key=lambda g: -g["bytes"])[:LARGEST]
    return {"classes": {k: v for k, v in by.items() if v["kernels"]}, "largest": largest,
            "kernels": sum(r["kernels"] for r in by.values()), "bytes": total,
            "flops": sum(r["flops"] for r in by.values()),
            "int_ops": sum(r["int_ops"] for r in by.values()), "floor_s": floor,
            "predicted_s": predicted_s(found, bandwidth, peak_flops, rates),
            "predicted_s_by_class": predicted_by_class(found, bandwidth, peak_flops, rates),
            "bandwidth_floor_s": total / bandwidth, "bandwidth": bandwidth,
            "peak_flops": peak_flops, "ceiling_flops": ceiling, "launch_s": rates.launch_s}


def kernel_s(k: Kernel, bandwidth: float, peak_flops: float, rates: Rates) -> float:
    """One execution of a kernel, predicted: max(bytes / (bandwidth x e_mem of its
    class), FLOPs / (peak x e of its shape class or pass)), plus its integer operations at
    `rates.int_per_s` and a launch (module docstring)."""
    flops = k.flops + k.attention_flops
    compute = flops / (peak_flops * rates.compute(k.kind, k.variant)) if flops else 0.0
    return (max(k.bytes / (bandwidth * rates.mem(k.kind)), compute)
            + k.int_ops / rates.int_per_s + rates.launch_s)


def predicted_s(found: list[Kernel], bandwidth: float, peak_flops: float,
                rates: Rates = H100_RATES) -> float:
    """The step's predicted time: each kernel's `kernel_s` times its runs, summed over the
    kernels in order."""
    return sum(k.runs * kernel_s(k, bandwidth, peak_flops, rates) for k in found)


def predicted_by_class(found: list[Kernel], bandwidth: float, peak_flops: float,
                       rates: Rates = H100_RATES) -> dict[str, float]:
    """`predicted_s` split by class (seconds per step), the classes with kernels only."""
    by: dict[str, float] = {}
    for k in found:
        by[k.kind] = by.get(k.kind, 0.0) + k.runs * kernel_s(k, bandwidth, peak_flops, rates)
    return {c: by[c] for c in CLASSES if c in by}


def report(t: dict) -> str:
    """The traffic table as text."""
    lines = [f"GPU program: {t['kernels']} kernels per step, {t['bytes'] / 1e9:.2f} GB of HBM "
             f"traffic (operands + outputs), {t['flops'] / 1e12:.3f} TFLOP in GEMMs, "
             f"{t['int_ops'] / 1e9:.1f} G integer ops elsewhere; floor "
             f"{t['floor_s'] * 1e3:.2f} ms (each kernel max(bytes / "
             f"{t['bandwidth'] / 1e12:.2f} TB/s, FLOPs / {t['peak_flops'] / 1e12:.0f} "
             f"TFLOP/s) + {t['launch_s'] * 1e6:.0f} us); predicted step "
             f"{t['predicted_s'] * 1e3:.1f} ms (fitted efficiencies: vit_pure/xla/kernels.py)"]
    for kind, row in t["classes"].items():
        lines.append(f"  {kind:18s} {row['kernels']:6d} kernels  {row['bytes'] / 1e9:9.3f} GB  "
                     f"{100 * row['bytes'] / max(t['bytes'], 1):5.1f}%")
    return "\n".join(lines)


def largest_report(t: dict, n: int = LARGEST) -> str:
    """The `n` groups of alike kernels of `traffic` that move the most bytes per step, one
    line each."""
    lines = [f"where the traffic goes, {min(n, len(t['largest']))} largest (GB per step, "
             "kernels, class, output as laid out, JAX operation):"]
    for g in t["largest"][:n]:
        lines.append(f"  {g['bytes'] / 1e9:8.3f} {g['kernels']:4d}  {g['kind']:18s} "
                     f"{g['shape'][:64]}  {g['op'] or g['name']}")
    return "\n".join(lines)
