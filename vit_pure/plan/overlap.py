"""Which collectives can hide behind compute, read from the compiled program's data flow.

A collective can run while the device computes only if the computation around it does not
wait for it: nothing computed needs its result, or it needs no computed value (the rule,
above `classify_overlap`; what it does not credit: its docstring). Everything else is on
the critical path. Pure text analysis of the parsed HLO (vit_pure/xla/hlo.py); nothing runs.
"""
from __future__ import annotations

import collections

from vit_pure.plan.collectives import Collective
from vit_pure.xla.hlo import Instr, Module

CRITICAL, OVERLAPPABLE = "critical", "overlappable"
_COMPUTE_OPS = {"dot", "convolution"}
_COMPUTE_TARGETS = ("gemm", "matmul", "cublas", "fmha", "cudnn")


def _compute_checker(module: Module):
    """A function: does this instruction compute a matmul (itself or in what it calls)?"""
    memo: dict[str, bool] = {}

    def computation_has(name: str) -> bool:
        if name not in memo:
            memo[name] = False  # cycles cannot occur in HLO; guards recursion anyway
            memo[name] = any(computes(i) for i in module.computations.get(name, ()))
        return memo[name]

    def computes(instr: Instr) -> bool:
        if instr.opcode in _COMPUTE_OPS:
            return True
        if instr.opcode == "custom-call" and any(t in instr.attrs.lower()
                                                 for t in _COMPUTE_TARGETS):
            return True
        return any(computation_has(c) for c in instr.callees)

    return computes


def _closure(start: str, edges: dict[str, list[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _data_operands(instr: Instr, by_name: dict[str, Instr]) -> list[str]:
    """The values `instr` reads. Remat's barrier holds values saved in the forward pass:
    what passes through it is available long before the backward needs it (a source, not a
    wait). An element of a tuple built in the same computation reads only that element."""
    if instr.opcode == "opt-barrier":
        return []
    if instr.opcode == "get-tuple-element" and instr.operands:
        tup = by_name.get(instr.operands[0])
        if tup is not None and tup.opcode == "tuple" and instr.index is not None \
                and instr.index < len(tup.operands):
            return [o for o in tup.operands[instr.index:instr.index + 1] if o in by_name]
    return [o for o in instr.operands if o in by_name]


def _loop_bodies(module: Module) -> set[str]:
    return {c for instrs in module.computations.values() for i in instrs
            if i.opcode == "while" for c in i.callees}


def _next_iteration_computes(instrs: list[Instr], reached: set[str], users, is_compute) -> bool:
    """In a loop body: does a value in `reached` leave through the ROOT tuple into a slot
    that the next iteration feeds to a matmul?"""
    root = instrs[-1]  # the HLO printer puts the ROOT last
    if root.name not in reached or root.opcode != "tuple":
        return False
    slots = {k for k, operand in enumerate(root.operands) if operand in reached}
    params = {i.name for i in instrs if i.opcode == "parameter"}
    reads = [i.name for i in instrs if i.opcode == "get-tuple-element"
             and i.index in slots and i.operands and i.operands[0] in params]
    return any(is_compute(n) for r in reads for n in _closure(r, users) | {r})


# Two kinds of collective can run while the device computes:
# * nothing computed needs its result: no matmul is downstream of it (the data-parallel
#   gradient all-reduce and FSDP's gradient reduce-scatter, which feed only the optimizer's
#   elementwise update; the metrics' scalars);
# * it needs no computed value: no matmul is upstream of it, so it can be issued as early as
#   its inputs exist (FSDP's weight all-gathers, which read only the parameters: a prefetch).
#   Values that pass through remat's optimization barrier count as available: they were
#   saved in the forward pass (FSDP's backward re-gathers under --remat block).
# Everything else is on the critical path: a matmul produced its operand and another matmul
# waits for its result (tensor parallelism's activation all-reduces, the pipeline's
# hand-offs). "Matmul" is a dot or convolution, a library GEMM or attention call, or a
# fusion, call or loop that contains one. Inside a loop body (a scan over layers, ticks or
# micro-batches), a result that leaves the body through its loop-carried tuple and is read by
# a matmul of the next iteration counts as needed by a matmul.
def classify_overlap(module: Module, found: list[Collective]) -> None:
    """Set each collective's `overlap` (CRITICAL / OVERLAPPABLE) and `reason`.

    Not credited: a backward all-reduce of tensor parallelism could also run beside the same
    layer's weight-gradient matmul, which does not need it (Megatron overlaps the two); the
    plan counts it as critical, so its floor can overstate that part.
    """
    computes = _compute_checker(module)
    bodies = _loop_bodies(module)
    by_comp = collections.defaultdict(list)
    for c in found:
        by_comp[c.computation].append(c)
    for comp, members in by_comp.items():
        instrs = module.computations[comp]
        by_name = {i.name: i for i in instrs}
        users, operands = collections.defaultdict(list), {}
        for i in instrs:
            operands[i.name] = _data_operands(i, by_name)
            for o in operands[i.name]:
                users[o].append(i.name)
        compute = {name for name, i in by_name.items() if computes(i)}

        def is_compute(name, compute=compute):
            return name in compute

        for c in members:
            after = _closure(c.name, users)
            feeds = bool(after & compute) or (comp in bodies and _next_iteration_computes(
                instrs, after | {c.name}, users, is_compute))
            needs = bool(_closure(c.name, operands) & compute)
            if feeds and needs:
                c.overlap, c.reason = CRITICAL, "a matmul makes its input, another waits for it"
            elif not feeds:
                c.overlap, c.reason = OVERLAPPABLE, "no matmul waits for it"
            else:
                c.overlap, c.reason = OVERLAPPABLE, "needs no computed value: a prefetch"
