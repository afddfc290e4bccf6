"""A collective's time as NCCL runs it: ring, tree, NVLS or NVLS-tree, the fastest chosen as
NCCL's tuner chooses, or the one forced (as NCCL_ALGO does).

Used by vit_pure/plan/report.py (`--plan N`) and vit_pure/tools/price_collective.py (one
collective on the command line). Pure arithmetic: no JAX here. The model (a latency plus
the bytes over the limiting link, as NCCL's tuner): above `call_cost`; the algorithms one
by one: `call_cost`.

WHAT IS NOT MODELLED: CollNet / in-network SHARP, PAT (NCCL 2.23's all-gather and
reduce-scatter for one GPU a node), NCCL's protocol choice (LL, LL128, Simple: folded into
each fabric's fitted ramp and latencies), congestion from other jobs. The fabrics are
fitted on 2-4 nodes and checked up to 32 (tests/test_plan_nccl.py); beyond that the
formulas extrapolate (docs/planning.md).
"""
from __future__ import annotations

import dataclasses
import math

from vit_pure.plan import interconnect as ic

RING, TREE, NVLS, NVLS_TREE, P2P = "ring", "tree", "nvls", "nvlstree", "p2p"
ALGORITHMS = (RING, TREE, NVLS, NVLS_TREE)
AUTO = "auto"
CHOICES = (AUTO, RING, TREE, NVLS, NVLS_TREE)

# How far the published runs reach (vit_pure/plan/measurements/nccl_all_reduce.json):
# within 30% on two fabrics up to 8 nodes; one fabric (EFA) up to 32, where the model is
# up to 1.75x optimistic for 64 MiB-1 GiB calls; nothing beyond.
VALIDATED_NODES, CHECKED_NODES = 8, 32


def scale_note(nodes: int) -> str:
    """What the published runs say about a collective across `nodes` nodes ('' when they
    cover it)."""
    if nodes <= VALIDATED_NODES:
        return ""
    if nodes <= CHECKED_NODES:
        return (f"{nodes} nodes: checked on one fabric only (EFA, 16 and 32 nodes), where "
                "the model is up to 1.75x optimistic for 64 MiB-1 GiB calls "
                "(docs/planning.md)")
    return (f"{nodes} nodes: beyond the {CHECKED_NODES} nodes of any published run the "
            "fabric profiles were checked on; the formulas extrapolate (docs/planning.md)")


# One NVLink step of a ring or chain: a few microseconds (NCCL's tuning tables give its
# NVLink latencies per step in this range, src/graph/tuning.cc): assumed.
NVLINK_HOP = 1.0e-6


@dataclasses.dataclass(frozen=True)
class Cost:
    """One call: its latency, the seconds per byte of its buffer, and the algorithm."""
    latency: float
    seconds_per_byte: float
    algorithm: str

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes * self.seconds_per_byte


def nvswitch(hw: ic.Hardware) -> bool:
    """NVLink SHARP inside a node: the table gives its all-reduce rate (H100, H200)."""
    return hw.intra.all_reduce_peak > 0


def candidates(kind: str, where: ic.Placement, hw: ic.Hardware) -> tuple[str, ...]:
    """The algorithms NCCL has for this collective on this placement and hardware."""
    if kind == ic.PERMUTE:
        return (P2P,)
    if not where.crosses_nodes:
        if kind == ic.ALL_REDUCE and nvswitch(hw):
            return (RING, NVLS)
        return (RING,)
    if kind == ic.ALL_REDUCE:
        # In NCCL's order of preference where two cost the same (NVLS-tree on NVSwitch).
        return (RING, NVLS_TREE, TREE) if nvswitch(hw) else (RING, TREE)
    return (RING,)


# A group of n GPUs in m nodes, p of them in a node (p_nic: the fewest in a node, whose NICs
# carry the most; p: the most, whose NVLink stage is the longest). S: the call's bytes per
# GPU (the whole array an all-reduce reduces or an all-gather gathers). Every call is a
# latency plus its bytes over the bandwidth of the link that limits it; NCCL's own tuner has
# this shape (src/graph/tuning.cc: a base latency, a latency per step, a bandwidth per
# algorithm). Across nodes each GPU uses its own NIC, whose bandwidth depends on the bytes
# it carries per network step of the call (vit_pure/plan/fabrics.py's ramp):
#     net = p_nic x fabric.bandwidth(c)            a node's NICs together
#     c = S / (p_nic x steps)                      steps: m-1 for a ring, ceil(log2 m) for a tree
def call_cost(kind: str, size: float, where: ic.Placement, hw: ic.Hardware,
              algorithm: str) -> Cost:
    """One call of `size` bytes per GPU by `algorithm` (one of `candidates`). In the terms
    of the comment above (n, m, p, p_nic, S, net, c):

    so a call of a given size, spread over more steps on more nodes, reaches less of the
    peak. NVLink enters at its peak rates: the fabric's ramp is fitted end to end on
    cross-node runs and already holds what small calls lose inside the node.

    RING (all-reduce, all-gather, reduce-scatter). One ring per channel; each crosses a node
    boundary once per node, so the bus bandwidth is the nodes' NICs or NVLink's ring rate,
    whichever is lower, and the latency grows linearly with the ring's steps:

        busbw = min(net, NVLink's ring busbw)
        all-reduce        2 (n-1)/n S / busbw + base + 2 (m-1) hop + 2 (n-m) nvlink_hop
        all-gather, r-s     (n-1)/n S / busbw + base +   (m-1) hop +   (n-m) nvlink_hop

    TREE (all-reduce). A chain inside each node, a double binary tree across the nodes
    (NCCL 2.4 on): the latency grows with log2 of the nodes. Across two nodes the tree is one
    edge and each node sends S once (half a ring's bytes: the reason a 2-node all-reduce's
    busbw can exceed the NICs'); from three nodes on a node is inner in one of the two trees
    and sends 2S, as much as a ring:

        algbw = min(net / (1 if m == 2 else 2), the node's ring all-reduce as algbw)
        S / algbw + base + 2 ceil(log2 m) hop + 2 (p-1) nvlink_hop

    NVLS-TREE (all-reduce, NVSwitch: H100 / H200). The tree across nodes, NVLink SHARP inside
    them: the in-node stage is the switch's (its all-reduce busbw, 480 GB/s on 8 H100) and
    takes two NVLink steps instead of the chain's 2 (p-1).

    NVLS (all-reduce inside one NVSwitch node) and the in-node ring: the in-node curve of
    vit_pure/plan/interconnect.py (its `Link`), as before.

    PERMUTE (collective-permute, NCCL send/recv): S over one NIC across nodes, + base + hop.
    """
    n, m = where.n, where.nodes
    if n <= 1 or size <= 0:
        return Cost(0.0, 0.0, algorithm)
    if hw.fabric is None or not where.crosses_nodes:
        # Inside a node (or a table without a fabric: TPUs): the link curves of
        # interconnect.py. NVLS is the all-reduce rate of NVLink SHARP; a ring is held to
        # the ring rate (NCCL_ALGO=Ring).
        link_hw = hw if algorithm != RING or not nvswitch(hw) else dataclasses.replace(
            hw, intra=dataclasses.replace(hw.intra, all_reduce_peak=0.0))
        per_byte = ic.transfer_seconds(kind, size, where, link_hw) / size
        return Cost(ic.latency_seconds(where, hw), per_byte, algorithm)
    fabric = hw.fabric
    p_nic, p = where.p_min, where.p_max
    if kind == ic.PERMUTE:
        return Cost(fabric.base + fabric.hop, 1.0 / fabric.bandwidth(size), P2P)
    # NVLink at its peak: the fabric's ramp, fitted end to end on cross-node runs, already
    # holds what small calls lose inside the node.
    ring_nvlink = hw.intra.peak
    if algorithm == RING:
        net = p_nic * fabric.bandwidth(size / (p_nic * (m - 1)))
        busbw = min(net, ring_nvlink) if p > 1 else net
        steps = 2.0 if kind == ic.ALL_REDUCE else 1.0
        latency = fabric.base + steps * ((m - 1) * fabric.hop + (n - m) * NVLINK_HOP)
        return Cost(latency, steps * (n - 1) / n / busbw, RING)
    if kind != ic.ALL_REDUCE or algorithm not in (TREE, NVLS_TREE):
        raise ValueError(f"{algorithm} does not run {kind} across nodes")
    depth = math.ceil(math.log2(m))
    net = p_nic * fabric.bandwidth(size / (p_nic * depth))
    across = net / (1.0 if m == 2 else 2.0)
    if p <= 1:
        inside, nvlink_steps = math.inf, 0
    elif algorithm == NVLS_TREE:
        # NVLink SHARP's all-reduce busbw, as algbw (busbw = algbw x 2 (p-1) / p).
        inside = hw.intra.all_reduce_peak * p / (2.0 * (p - 1))
        nvlink_steps = 2
    else:  # a chain: no faster than the node's ring all-reduce
        inside, nvlink_steps = ring_nvlink * p / (2.0 * (p - 1)), 2 * (p - 1)
    latency = (fabric.base + 2 * depth * fabric.hop
               + nvlink_steps * NVLINK_HOP)
    return Cost(latency, 1.0 / min(across, inside), algorithm)


def best_cost(kind: str, size: float, where: ic.Placement, hw: ic.Hardware,
              algorithm: str = AUTO) -> Cost:
    """The call's cost by the fastest algorithm NCCL has for it (`auto`, as its tuner
    picks), or by the one forced where it applies (as NCCL_ALGO: an algorithm that cannot
    run this collective here falls back to the fastest that can, and says so by name)."""
    options = candidates(kind, where, hw)
    if algorithm != AUTO:
        forced = {TREE: (TREE, NVLS_TREE), NVLS: (NVLS, NVLS_TREE)}.get(algorithm, (algorithm,))
        chosen = tuple(a for a in forced if a in options)
        options = chosen or options
    costs = [call_cost(kind, size, where, hw, a) for a in options]
    return min(costs, key=lambda c: c.seconds(size))


def seconds(kind: str, nbytes: float, where: ic.Placement, hw: ic.Hardware,
            algorithm: str = AUTO, message: float = 0.0) -> tuple[float, float, str]:
    """(transfer, latency, algorithm) of `nbytes` moved in a call of `message` bytes (a
    combined bucket: the call's size picks the algorithm and the bandwidth; 0: its own)."""
    size = message or nbytes
    if where.n <= 1 or nbytes <= 0:
        return 0.0, 0.0, "-"
    cost = best_cost(kind, size, where, hw, algorithm)
    return nbytes * cost.seconds_per_byte, cost.latency, cost.algorithm


def bus_bandwidth(kind: str, nbytes: float, n: int, t: float) -> float:
    """nccl-tests' busbw (doc/PERFORMANCE.md) of a call of `nbytes` in `t` seconds."""
    factor = {ic.ALL_REDUCE: 2.0 * (n - 1) / n, ic.ALL_GATHER: (n - 1) / n,
              ic.REDUCE_SCATTER: (n - 1) / n}.get(kind, 1.0)
    return nbytes / t * factor if t > 0 else 0.0
