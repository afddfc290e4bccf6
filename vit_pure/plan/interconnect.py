"""What a collective costs on hardware you do not have: cited curves, stated formulas.

Used by the plan (vit_pure/plan/report.py, nccl.py) to turn the collectives of a compiled
training step into seconds: the links and hardware table with their sources, the ring
formulas (stated above `Link`), where a group sits across nodes (`placement`). Pure
arithmetic: no JAX here.
"""
from __future__ import annotations

import dataclasses
import math

from vit_pure.plan import fabrics as fb
from vit_pure.plan.fabrics import Fabric

GB = 1e9

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all-reduce", "all-gather", "reduce-scatter"
PERMUTE, ALL_TO_ALL = "collective-permute", "all-to-all"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, PERMUTE, ALL_TO_ALL)


# THE FORMULAS. V is the collective's buffer per device, in bytes: the whole array an
# all-reduce reduces, the whole (gathered) array of an all-gather, the whole (unscattered)
# array of a reduce-scatter, the array a collective-permute sends. n devices take part.
#     all-gather, reduce-scatter (ring)                     V (n-1) / (n W)
#     all-reduce (ring: reduce-scatter, then all-gather)    2 V (n-1) / (n W)
#     collective-permute (one hop)                          V / W
#     every call, in addition                               a latency alpha
# W is a bus bandwidth that depends on the message: `Link`. How a group spread over nodes
# runs (HIERARCHICAL): `transfer_seconds`; which group sets the price (PLACEMENT):
# `placement`. Across nodes on GPUs the plan prices collectives as NCCL runs them instead
# (nccl.py, fabrics.py); the hierarchical formula is what hardware without a fabric profile
# (the TPUs) keeps, and what nccl.py calls inside one node.
@dataclasses.dataclass(frozen=True)
class Link:
    """One level of the interconnect: its bus bandwidth as a function of the chunk a device
    handles per ring step, and its latency per call. half = 0: flat.

    W is the *bus bandwidth* in the sense of nccl-tests (doc/PERFORMANCE.md): busbw = algbw x
    2(n-1)/n for all-reduce and algbw x (n-1)/n for all-gather and reduce-scatter, with algbw =
    S / t, so for a measured run t = 2 S (n-1) / (n busbw): the formula above read
    backwards.

    W DEPENDS ON THE MESSAGE. A link reaches its peak only on large messages: nccl-tests curves
    climb from a few GB/s at 1 MiB to the peak at GiBs. Each level of the hardware (`Link`: inside
    a node, across nodes) has a curve of the chunk c a device handles per ring step,

        W(c) = W_peak x^k / (1 + x^k),   x = c / c_half

    (c_half: the chunk at which half the peak is reached; k: how sharply it rises), and a
    latency per call. The chunk is V / p inside a node (p devices of the group there) and V / n
    across nodes, so the ring's length enters twice: in the (n-1)/n factors and in the chunk.
    Across nodes the latency grows with log2 of the nodes (a tree's depth; assumed).
    """
    peak: float                      # bytes/s, large messages (ring collectives)
    half: float = 0.0                # chunk (bytes) at which half the peak is reached
    k: float = 1.0                   # how sharply the curve rises
    latency: float = 0.0             # seconds per call (across nodes: at 2 nodes)
    all_reduce_peak: float = 0.0     # bytes/s for all-reduce where it differs (NVLink SHARP)
    min_chunk: float = 0.0           # below it the bandwidth stays at its value there

    def bandwidth(self, chunk: float, kind: str = ALL_GATHER) -> float:
        peak = self.all_reduce_peak if kind == ALL_REDUCE and self.all_reduce_peak else self.peak
        if self.half <= 0:
            return peak
        x = (max(chunk, self.min_chunk, 1.0) / self.half) ** self.k
        return peak * x / (1.0 + x)

    def describe(self) -> str:
        peak = f"{self.peak / GB:.1f}" + (f" ({self.all_reduce_peak / GB:.0f} all-reduce)"
                                          if self.all_reduce_peak else "")
        shape = (f", half of it at {self.half / 2**20:.1f} MiB chunks (k {self.k:.2f})"
                 if self.half else "")
        return f"{peak} GB/s{shape}, {self.latency * 1e6:.0f} us per call"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and its links."""
    name: str
    platform: str            # the JAX backend whose defaults apply ("gpu", "tpu")
    peak_flops: float        # dense bf16 matmul peak, one device
    memory_bytes: float      # device memory
    intra: Link              # bus bandwidth inside a node (NVLink / ICI)
    inter: Link              # per device, across nodes (its NIC / DCN share)
    devices_per_node: int    # devices that share the fast domain
    sources: str             # where the figures come from
    measured_efficiency: float = 0.0   # a training step's measured MFU on this device, if any
    efficiency_source: str = ""
    fabric: Fabric | None = None       # across nodes, as NCCL runs it (vit_pure/plan/nccl.py)

    def describe(self) -> str:
        across = (f"fabric {self.fabric.describe()}" if self.fabric is not None else
                  f"per device, {self.inter.describe()}")
        return (f"{self.name}: {self.peak_flops / 1e12:.0f} TFLOP/s bf16 dense, "
                f"{self.memory_bytes / 2**30:.0f} GiB; {self.devices_per_node} per node; "
                f"inside a node {self.intra.describe()}; across nodes {across}")


# Sources (public figures; what is assumed is said so):
# [H100]  NVIDIA H100 Tensor Core GPU datasheet: SXM5 989 TFLOP/s BF16 dense (1,979 with
#         sparsity), 80 GB HBM3, NVLink 900 GB/s per GPU (both directions: 450 GB/s one way).
# [H200]  NVIDIA H200 Tensor Core GPU datasheet: 989 TFLOP/s BF16 dense, 141 GB HBM3e,
#         NVLink 900 GB/s.
# [A100]  NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s BF16 dense, 80 GB, NVLink
#         600 GB/s (300 one way). Measured ring bandwidth on 8 NVLink A100s: 195 GB/s one
#         way (nccl-tests sendrecv_perf at 1 GiB, github.com/li-plus/playground cuda/nccl.md).
# [NIC]   DGX A100 user guide: one ConnectX-6 200 Gb/s HDR port per A100 (25 GB/s line
#         rate), taken at ~92% (23 GB/s): assumed.
# [X16]   (The plan's h100 now prices cross-node collectives with a fabric profile,
#         fabrics.py; `H100_ACROSS` stays as the `inter` link of the table, unused where
#         a fabric is set.) H100 across two nodes, the curve `H100_ACROSS` is fitted to: nccl-tests
#         all_reduce_perf on 16 H100 80GB HBM3, 8 per node (GCP A3 Mega: one 200 Gb/s NIC
#         per GPU), github.com/lessizzmore/create-a3mega-ztan-fork, file
#         ztan-NCCL-test-result, out-of-place:
#             size     time (us)   busbw (GB/s)
#             8 MiB       571.9       27.50
#             32 MiB     1059.9       59.36
#             128 MiB    1652.2      152.32
#             1 GiB      6759.0      297.86
#             8 GiB     47535        338.82
#         and 123-136 us for every size up to 512 B (the latency), 203 us at 1 MiB. Read
#         as the hierarchical formula with p = 8, m = 2: each GPU's NIC carries V / 8 in
#         t - 123 us, which rises to 22.6 GB/s at 8 GiB (90% of the 25 GB/s line rate).
#         Least squares on log(time) over the 11 sizes 8 MiB..8 GiB: peak 24.7 GB/s, half
#         11.9 MB (chunks of V / 16), k 0.81; within 25% of every point
#         (tests/test_plan_cost.py). Below 0.5 MiB chunks (8 MiB over 16) it keeps the
#         0.5 MiB bandwidth. A 400 Gb/s NDR fabric (DGX H100) has
#         twice the line rate: `--inter-gbps 46` scales the curve's peak.
# [NVL]   H100 inside a node (8 GPUs, NVSwitch): the peak all-reduce bus bandwidth with
#         NVLink SHARP is ~480 GB/s on 8 GPUs and ring collectives (all-gather,
#         reduce-scatter) reach ~370 GB/s of NVLink's 450 one way (NCCL maintainer,
#         github.com/NVIDIA/nccl-tests/issues/212); a single-node all_reduce_perf run on 8
#         H100 measured 476 GB/s (github.com/NVIDIA/nccl-tests/issues/290, "in the expected
#         range for H100"). The JAX scaling book (jax-ml.github.io/scaling-book/gpus)
#         measures ~150 GB/s for a 58 MB all-reduce on 8 H100: with the peak and the shape
#         k of [X16], that places half the peak at 19 MB chunks (58 MB / 8 = 7.25 MB chunks
#         at 150 of 480 GB/s). No full 8 B..8 GiB single-node curve was found: this one is
#         two points and a borrowed shape. Latency 10 us per call inside a node: assumed.
# [v5e]   cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2, 256-chip pod, 2D
#         torus, data-center network 6.4 Tbps per pod (3.1 GB/s per chip).
# [v5p]   cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM, ICI 1,200 GB/s per chip
#         (both directions, all links), 3D torus, DCN 50 Gb/s per chip (6.25 GB/s).
# [book]  "How to Scale Your Model" (the JAX scaling book, jax-ml.github.io/scaling-book),
#         "All About TPUs": ICI 4.5e10 B/s one way per link on v5e, 9e10 on v5p; a ring
#         along one torus axis uses both directions: 9e10 (v5e) and 1.8e11 (v5p).
# [MFU]   The kit's own step on one H100 80GB HBM3, the MFU bench.py reports for vit-cifar,
#         batch 4096, bf16, cuDNN attention (the measurement: docs/performance.md).
# Flat links (no curve) and their latencies for A100 and TPUs: assumed, large messages only.
H100_INSIDE = Link(370 * GB, 19e6, 0.81, 10e-6, all_reduce_peak=480 * GB, min_chunk=2**20)
H100_ACROSS = Link(24.7 * GB, 11.9e6, 0.81, 123e-6, min_chunk=2**19)
H100_MFU = (0.170, "vit-cifar, batch 4096, bf16, one H100 (docs/performance.md)")
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", "gpu", 989e12, 80 * 2**30, H100_INSIDE, H100_ACROSS, 8,
                     "H100 datasheet; NVLink curve [NVL]; across nodes the fabric profile "
                     "(vit_pure/plan/fabrics.py), priced as NCCL runs it "
                     "(vit_pure/plan/nccl.py)", *H100_MFU, fabric=fb.IB_400),
    "h200": Hardware("h200", "gpu", 989e12, 141e9, H100_INSIDE, H100_ACROSS, 8,
                     "H200 datasheet; links as h100", fabric=fb.IB_400),
    "a100": Hardware("a100", "gpu", 312e12, 80 * 2**30, Link(195 * GB, latency=10e-6),
                     Link(23 * GB, latency=30e-6), 8,
                     "A100 datasheet; 195 GB/s ring bandwidth measured by nccl-tests on 8 "
                     "NVLink A100s; across nodes 200 Gb/s HDR per GPU (fabric ib-200)",
                     fabric=fb.FABRICS["ib-200"]),
    "tpu-v5e": Hardware("tpu-v5e", "tpu", 197e12, 16e9, Link(90 * GB, latency=5e-6),
                        Link(3.125 * GB, latency=30e-6), 256,
                        "Cloud TPU v5e docs; ICI from the JAX scaling book"),
    "tpu-v5p": Hardware("tpu-v5p", "tpu", 459e12, 95 * 2**30, Link(180 * GB, latency=5e-6),
                        Link(6.25 * GB, latency=30e-6), 6144,
                        "Cloud TPU v5p docs (largest single slice 6,144 chips); "
                        "ICI from the JAX scaling book"),
}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a collective's slowest group sits: n devices in `nodes` nodes, `per_node_max`
    in its fullest node and `per_node_min` in its emptiest; of its `groups` groups,
    `straddling` cross a node boundary. For a permute, n = 2 and a crossing pair counts."""
    n: int
    nodes: int = 1
    per_node_min: int = 0     # 0: n // nodes
    per_node_max: int = 0     # 0: n // nodes
    groups: int = 1
    straddling: int = 0

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def p_min(self) -> int:
        return self.per_node_min or self.n // self.nodes

    @property
    def p_max(self) -> int:
        return self.per_node_max or self.n // self.nodes


def placement(groups: list[list[int]], devices_per_node: int,
              pairs: list[tuple[int, int]] | None = None) -> Placement:
    """The Placement of a collective's slowest group, from its replica groups (mesh
    positions), or for a collective-permute its source -> target pairs. Slowest: the most
    nodes, then the fewest devices on one node (the largest share on one NIC).

    PLACEMENT. Mesh position i (row-major over the mesh's axes, the order jax.make_mesh hands
    devices out, innermost axis fastest) is on node i // devices_per_node. A collective's groups
    need not sit alike: with 6 devices a group on 8-GPU nodes, half the groups straddle two nodes.
    Every group runs at once and the step waits for the slowest, so a collective is priced by
    its slowest group (`placement`).
    """
    if pairs is not None:
        crossing = sum(s // devices_per_node != t // devices_per_node for s, t in pairs)
        return Placement(2, 2 if crossing else 1, 1, 1 if crossing else 2,
                         len(pairs), crossing)
    shapes = []
    for group in groups:
        per_node = {}
        for d in group:
            per_node[d // devices_per_node] = per_node.get(d // devices_per_node, 0) + 1
        shapes.append((len(per_node), -min(per_node.values()), max(per_node.values()),
                       len(group)))
    m, neg_min, p_max, n = max(shapes)
    straddling = sum(shape[0] > 1 for shape in shapes)
    return Placement(n, m, -neg_min, p_max, len(groups), straddling)


def transfer_seconds(kind: str, nbytes: float, where: Placement, hw: Hardware,
                     message: float = 0.0) -> float:
    """The bandwidth term of one collective of V = nbytes (the formulas above `Link`),
    without the latency. `message`: the bytes of the call that carries it (a combined bucket), which
    sets the chunk and so the bandwidth; 0: its own V.

    HIERARCHICAL. `devices_per_node` devices share a fast domain (NVLink / NVSwitch on GPUs, ICI
    on TPUs); nodes are joined by a slower network, one NIC per GPU. A group of n devices in m
    nodes, p_max of them in its fullest node and p_min in its emptiest, runs its collective as
    NCCL does: rings inside each node over the whole V, and across nodes each device carries its
    V / p share on its own NIC. The two stages are pipelined (NCCL streams chunks through both),
    so the slower one sets the time:

        all-gather, reduce-scatter   max( V (p_max-1) / (p_max W_intra(V/p_max)),
                                          (V / p_min) (m-1) / (m W_inter(V/n)) )
        all-reduce                   twice each term
        collective-permute           V / W_intra(V) inside a node, V / W_inter(V) across nodes

    Why the larger, not the sum: in the cited 16-H100 run (two nodes, 8 GiB in 47.5 ms) the
    in-node stage alone takes about 32 ms at NVLink's ~460 GB/s, so a sum would leave 15 ms for
    each GPU's NIC to carry its 1 GiB: 72 GB/s, nearly three times its 25 GB/s line rate. The
    larger of the two needs 22.6 GB/s.
    """
    if where.n <= 1 or nbytes == 0:
        return 0.0
    size = message or nbytes
    if kind == PERMUTE:
        link = hw.inter if where.crosses_nodes else hw.intra
        return nbytes / link.bandwidth(size, kind)
    factor = 2.0 if kind == ALL_REDUCE else 1.0
    p, m = where.p_max, where.nodes
    inside = (nbytes * (p - 1) / (p * hw.intra.bandwidth(size / p, kind)) if p > 1 else 0.0)
    across = ((nbytes / where.p_min) * (m - 1) / (m * hw.inter.bandwidth(size / where.n, kind))
              if m > 1 else 0.0)
    return factor * max(inside, across)


def latency_seconds(where: Placement, hw: Hardware) -> float:
    """The latency term (alpha) of one call: the intra-node link's, or across m nodes the
    measured two-node latency times log2(m) (a tree's depth: assumed)."""
    if where.n <= 1:
        return 0.0
    if not where.crosses_nodes:
        return hw.intra.latency
    return hw.inter.latency * max(1.0, math.log2(where.nodes))


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends in the ring algorithm: 2V(n-1)/n for an all-reduce,
    V(n-1)/n for an all-gather / reduce-scatter / all-to-all, V for a permute."""
    if n <= 1:
        return 0.0
    if kind == PERMUTE:
        return nbytes
    return (2.0 if kind == ALL_REDUCE else 1.0) * nbytes * (n - 1) / n


def with_overrides(hw: Hardware, *, peak_tflops=None, intra_gbps=None, inter_gbps=None,
                   devices_per_node=None, latency_us=None, memory_gib=None,
                   fabric: str | None = None) -> Hardware:
    """`hw` with the figures given on the command line (None: keep the table's). A
    bandwidth given scales its link's curve to that peak (the shape is kept); `fabric`
    names a profile of vit_pure/plan/fabrics.py, whose NIC rate and latency the
    bandwidth and latency given then set."""
    changes = {}
    intra, inter = hw.intra, hw.inter
    across = fb.FABRICS[fabric] if fabric is not None else hw.fabric
    if across is not None:
        changes["fabric"] = fb.with_overrides(across, nic_gbps=inter_gbps,
                                              latency_us=latency_us)
    if peak_tflops is not None:
        changes["peak_flops"] = peak_tflops * 1e12
    if intra_gbps is not None:
        intra = dataclasses.replace(intra, peak=intra_gbps * GB, all_reduce_peak=0.0)
    if inter_gbps is not None:
        inter = dataclasses.replace(inter, peak=inter_gbps * GB, all_reduce_peak=0.0)
    if latency_us is not None:
        intra = dataclasses.replace(intra, latency=latency_us * 1e-6)
        inter = dataclasses.replace(inter, latency=latency_us * 1e-6)
    if devices_per_node is not None:
        changes["devices_per_node"] = devices_per_node
    if memory_gib is not None:
        changes["memory_bytes"] = memory_gib * 2**30
    return dataclasses.replace(hw, intra=intra, inter=inter, **changes)
