"""What a collective costs on hardware you do not have: a small cited table, stated formulas.

Used by vit_pure/plan/build.py (`--plan N`) to turn the collectives of a compiled training step
into seconds. Pure arithmetic: no JAX here.

THE FORMULAS. V is the collective's buffer per device, in bytes: the whole array an
all-reduce reduces, the whole (gathered) array of an all-gather, the whole (unscattered)
array of a reduce-scatter, the array a collective-permute sends. n devices take part, W is
a bandwidth in bytes per second.

    all-gather, reduce-scatter (ring)   V (n-1) / (n W)
    all-reduce (ring: reduce-scatter, then all-gather)   2 V (n-1) / (n W)
    collective-permute (one hop)        V / W
    every call, in addition             a latency alpha

W is the *bus bandwidth* in the sense of nccl-tests (doc/PERFORMANCE.md): the rate at which
each device's link carries a ring collective. nccl-tests defines busbw = algbw x 2(n-1)/n
for all-reduce and algbw x (n-1)/n for all-gather and reduce-scatter, with algbw = S / t, so
for a measured run t = 2 S (n-1) / (n busbw): the formula above read backwards
(tests/test_plan.py checks it against published nccl-tests output).

Hierarchical (inside vs across nodes). `devices_per_node` devices share a fast domain
(NVLink / NVSwitch on GPUs, ICI on TPUs); nodes are joined by a slower network, one NIC per
GPU. A group of n = p x m devices, p in each of m nodes, runs its collective as NCCL and
XLA do across nodes: a ring inside each node over the whole V, and rings across nodes over
each device's V / p share, each device on its own NIC:

    all-gather, reduce-scatter   V (p-1) / (p W_intra) + (V / p) (m-1) / (m W_inter)
    all-reduce                   twice that
    collective-permute           V / W_intra inside a node, V / W_inter across nodes

With m = 1 this is the flat ring on W_intra, with p = 1 the flat ring on W_inter.

Which devices share a node: mesh position i (row-major over the mesh's axes, the order
jax.make_mesh hands devices out, innermost axis fastest) is on node i // devices_per_node.
"""
from __future__ import annotations

import dataclasses

GB = 1e9

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all-reduce", "all-gather", "reduce-scatter"
PERMUTE, ALL_TO_ALL = "collective-permute", "all-to-all"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, PERMUTE, ALL_TO_ALL)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Bandwidths in bytes/s, latencies in seconds."""
    name: str
    platform: str            # the JAX backend whose defaults apply ("gpu", "tpu")
    peak_flops: float        # dense bf16 matmul peak, one device
    memory_bytes: float      # device memory
    intra_bw: float          # bus bandwidth of a ring inside a node (NVLink / ICI)
    inter_bw: float          # per device, across nodes (its NIC / DCN share)
    devices_per_node: int    # devices that share the fast domain
    intra_latency: float     # alpha per call inside a node
    inter_latency: float     # alpha per call across nodes
    sources: str             # where the figures come from

    def describe(self) -> str:
        return (f"{self.name}: {self.peak_flops / 1e12:.0f} TFLOP/s bf16 dense, "
                f"{self.memory_bytes / 2**30:.0f} GiB; {self.devices_per_node} per node: "
                f"{self.intra_bw / GB:.0f} GB/s bus bandwidth inside, "
                f"{self.inter_bw / GB:.1f} GB/s per device across; latency "
                f"{self.intra_latency * 1e6:.0f} / {self.inter_latency * 1e6:.0f} us per call")


# Sources (public figures; the achieved bandwidths and the latencies are assumptions, said so):
# [H100]  NVIDIA H100 Tensor Core GPU datasheet: SXM5 989 TFLOP/s BF16 dense (1,979 with
#         sparsity), 80 GB HBM3, NVLink 900 GB/s per GPU (both directions: 450 GB/s one way).
# [H200]  NVIDIA H200 Tensor Core GPU datasheet: 989 TFLOP/s BF16 dense, 141 GB HBM3e,
#         NVLink 900 GB/s.
# [A100]  NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOP/s BF16 dense, 80 GB, NVLink
#         600 GB/s (300 one way). Measured ring bandwidth on 8 NVLink A100s: 195 GB/s one
#         way (nccl-tests sendrecv_perf at 1 GiB, github.com/li-plus/playground cuda/nccl.md).
# [NIC]   DGX H100 / DGX A100 user guides: one ConnectX-7 400 Gb/s NDR InfiniBand port per
#         H100 (50 GB/s line rate), one ConnectX-6 200 Gb/s HDR port per A100 (25 GB/s).
#         Achieved: assumed ~92% of line rate (46 and 23 GB/s).
# [NCCL]  Intra-node H100 all-reduce bus bandwidth: assumed 370 GB/s, ~82% of NVLink4's
#         450 GB/s one way; for scale, 16 H100 over two nodes reached 339 GB/s busbw at
#         8 GiB in a published nccl-tests all_reduce_perf run
#         (github.com/lessizzmore/create-a3mega-ztan-fork, ztan-NCCL-test-result).
# [v5e]   cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM2, 256-chip pod, 2D
#         torus, data-center network 6.4 Tbps per pod (3.1 GB/s per chip).
# [v5p]   cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM, ICI 1,200 GB/s per chip
#         (both directions, all links), 3D torus, DCN 50 Gb/s per chip (6.25 GB/s).
# [book]  "How to Scale Your Model" (the JAX scaling book, jax-ml.github.io/scaling-book),
#         "All About TPUs": ICI 4.5e10 B/s one way per link on v5e, 9e10 on v5p; a ring
#         along one torus axis uses both directions: 9e10 (v5e) and 1.8e11 (v5p).
# Latencies: assumed (10 us inside an NVLink node, 30 us across nodes, 5 us on ICI); small
# messages only, where they matter (give --latency-us for your cluster).
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", "gpu", 989e12, 80 * 2**30, 370 * GB, 46 * GB, 8, 10e-6, 30e-6,
                     "H100 datasheet; NVLink4 450 GB/s one way, 370 GB/s all-reduce bus "
                     "bandwidth assumed; 400 Gb/s NDR per GPU, 46 GB/s assumed"),
    "h200": Hardware("h200", "gpu", 989e12, 141e9, 370 * GB, 46 * GB, 8, 10e-6, 30e-6,
                     "H200 datasheet; links as h100"),
    "a100": Hardware("a100", "gpu", 312e12, 80 * 2**30, 195 * GB, 23 * GB, 8, 10e-6, 30e-6,
                     "A100 datasheet; 195 GB/s ring bandwidth measured by nccl-tests on 8 "
                     "NVLink A100s; 200 Gb/s HDR per GPU, 23 GB/s assumed"),
    "tpu-v5e": Hardware("tpu-v5e", "tpu", 197e12, 16e9, 90 * GB, 3.125 * GB, 256, 5e-6,
                        30e-6, "Cloud TPU v5e docs; ICI from the JAX scaling book"),
    "tpu-v5p": Hardware("tpu-v5p", "tpu", 459e12, 95 * 2**30, 180 * GB, 6.25 * GB, 6144,
                        5e-6, 30e-6, "Cloud TPU v5p docs (largest single slice 6,144 chips); "
                        "ICI from the JAX scaling book"),
}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a collective's group sits: n devices, p in each of m nodes; for a permute,
    whether any source -> target pair crosses a node."""
    n: int
    nodes: int
    crosses_nodes: bool = False

    @property
    def per_node(self) -> int:
        return self.n // self.nodes


def placement(groups: list[list[int]], devices_per_node: int,
              pairs: list[tuple[int, int]] | None = None) -> Placement:
    """The Placement of a collective from its replica groups (mesh positions), or for a
    collective-permute its source -> target pairs. The largest group decides."""
    if pairs is not None:
        crosses = any(s // devices_per_node != t // devices_per_node for s, t in pairs)
        return Placement(2, 2 if crosses else 1, crosses)
    group = max(groups, key=len)
    nodes = len({d // devices_per_node for d in group})
    return Placement(len(group), nodes, nodes > 1)


def transfer_seconds(kind: str, nbytes: float, where: Placement, hw: Hardware) -> float:
    """The bandwidth term of one collective (module docstring), without the latency."""
    if where.n <= 1 or nbytes == 0:
        return 0.0
    if kind == PERMUTE:
        return nbytes / (hw.inter_bw if where.crosses_nodes else hw.intra_bw)
    p, m = where.per_node, where.nodes
    inside = nbytes * (p - 1) / (p * hw.intra_bw)
    across = (nbytes / p) * (m - 1) / (m * hw.inter_bw)
    return (2.0 if kind == ALL_REDUCE else 1.0) * (inside + across)


def latency_seconds(where: Placement, hw: Hardware) -> float:
    """The latency term (alpha) of one call."""
    if where.n <= 1:
        return 0.0
    return hw.inter_latency if where.crosses_nodes else hw.intra_latency


def wire_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends in the ring algorithm: 2V(n-1)/n for an all-reduce,
    V(n-1)/n for an all-gather / reduce-scatter / all-to-all, V for a permute."""
    if n <= 1:
        return 0.0
    if kind == PERMUTE:
        return nbytes
    return (2.0 if kind == ALL_REDUCE else 1.0) * nbytes * (n - 1) / n


def with_overrides(hw: Hardware, *, peak_tflops=None, intra_gbps=None, inter_gbps=None,
                   devices_per_node=None, latency_us=None, memory_gib=None) -> Hardware:
    """`hw` with the figures given on the command line (None: keep the table's)."""
    changes = {}
    if peak_tflops is not None:
        changes["peak_flops"] = peak_tflops * 1e12
    if intra_gbps is not None:
        changes["intra_bw"] = intra_gbps * GB
    if inter_gbps is not None:
        changes["inter_bw"] = inter_gbps * GB
    if devices_per_node is not None:
        changes["devices_per_node"] = devices_per_node
    if latency_us is not None:
        changes["intra_latency"] = changes["inter_latency"] = latency_us * 1e-6
    if memory_gib is not None:
        changes["memory_bytes"] = memory_gib * 2**30
    return dataclasses.replace(hw, **changes)
