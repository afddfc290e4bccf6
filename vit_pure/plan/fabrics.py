"""The network between GPU nodes: one profile per fabric (`Fabric`: a NIC's bandwidth ramp
and its latencies), each fitted to published nccl-tests runs (the runs, with their
sources, are in vit_pure/plan/measurements/; how: above `Fabric`).

vit_pure/plan/nccl.py turns these into the time of a ring, a tree or an NVLS call.
Pure arithmetic: no JAX here.
"""
from __future__ import annotations

import dataclasses

GB = 1e9
MiB = 2**20


# A profile says, per GPU (one NIC each, as on HGX / DGX H100 and the clouds' H100 nodes):
#   nic   the NIC's bandwidth reached on large messages (bytes/s)
#   half  the bytes one NIC carries in one call at which half of `nic` is reached;
#   k     how sharply it rises (bandwidth(c) = nic x^k / (1 + x^k), x = c / half): NCCL
#         opens fewer channels and fills its pipeline of fixed-size chunks only on large
#         calls, so a call's bandwidth grows with its size
#   hop   the latency of one step across the network (a ring step, a tree level)
#   base  the latency every call pays (launch, setup, the protocol's round trip)
# How they were fitted: least squares on log(time) of the nccl.py model against the runs
# marked "fit" in measurements/nccl_all_reduce.json (the published table of each fabric with
# the fewest nodes), each parameter rounded; the runs marked "check" were not used, and
# tests/test_plan_nccl.py holds the model within 30% of every point of both. The 200 Gb/s
# variants have no run of their own: the 400 Gb/s profile at half the NIC bandwidth
# (assumed).
@dataclasses.dataclass(frozen=True)
class Fabric:
    """One cross-node network, per GPU (its fields: the comment above)."""
    name: str
    nic: float           # bytes/s per GPU, large messages
    half: float          # bytes per NIC per call at half of `nic`
    k: float
    hop: float           # seconds per network step (ring step, tree level)
    base: float          # seconds per call
    summary: str         # what it is, in a few words
    sources: str         # where the figures come from

    def bandwidth(self, per_nic: float) -> float:
        """The NIC's bandwidth on a call that moves `per_nic` bytes through it."""
        if self.half <= 0:
            return self.nic
        x = (max(per_nic, 1.0) / self.half) ** self.k
        return self.nic * x / (1.0 + x)

    def describe(self) -> str:
        return (f"{self.name} ({self.summary}): {self.nic / GB:.1f} GB/s a GPU, half of it at "
                f"{self.half / MiB:.1f} MiB a NIC per call (k {self.k:.2f}); "
                f"{self.base * 1e6:.0f} us a call + {self.hop * 1e6:.0f} us a network step")


# Sources (measurements/nccl_all_reduce.json has every point):
# [IB]    nccl-tests all_reduce_perf on 4 HGX H100 nodes, 8 x 400 Gb/s InfiniBand HCAs a
#         node, NCCL 2.26 (github.com/NVIDIA/nccl-tests/issues/309, first table): fitted;
#         8 nodes of the same thread: checked. An NCCL maintainer in
#         github.com/NVIDIA/nccl-tests/issues/290: 46-48 GB/s per 400 Gb/s NDR NIC.
# [EFA]   nccl-tests all_reduce_perf on AWS p5.48xlarge, 2 to 32 nodes, NCCL 2.28.7 with
#         aws-ofi-nccl's tuner (github.com/crazyguitar/aws-gpu-communication-benchmark,
#         data/nccl_all_reduce.csv): 2 and 4 nodes fitted, 8 to 32 checked.
# [TCPXO] nccl-tests all_reduce_perf on 16 H100 of GCP A3 Mega, 2 nodes, GPUDirect-TCPXO,
#         one 200 Gb/s NIC a GPU (github.com/lessizzmore/create-a3mega-ztan-fork, file
#         ztan-NCCL-test-result): fitted, with its 123-136 us small-message latency.
IB_400 = Fabric("ib-400", 46.0 * GB, 0.75 * MiB, 0.76, 11e-6, 66e-6,
                "InfiniBand NDR, 400 Gb/s a GPU (DGX / HGX H100)",
                "fitted to nccl-tests on 4 H100 nodes, NCCL 2.26 "
                "(github.com/NVIDIA/nccl-tests/issues/309)")
EFA_P5 = Fabric("efa-p5", 46.0 * GB, 0.35 * MiB, 0.60, 33e-6, 272e-6,
                "AWS EFA on p5.48xlarge, 3,200 Gb/s a node",
                "fitted to nccl-tests on 2 and 4 p5.48xlarge nodes, NCCL 2.28.7 "
                "(github.com/crazyguitar/aws-gpu-communication-benchmark)")
TCPXO = Fabric("tcpxo", 23.0 * GB, 21.5 * MiB, 0.80, 4e-6, 41e-6,
               "GCP A3 Mega, GPUDirect-TCPXO, 200 Gb/s a GPU",
               "fitted to nccl-tests on 2 A3 Mega nodes "
               "(github.com/lessizzmore/create-a3mega-ztan-fork)")
FABRICS: dict[str, Fabric] = {
    f.name: f for f in (
        IB_400,
        dataclasses.replace(IB_400, name="roce-400", summary="RoCE, 400 Gb/s a GPU",
                            sources="as ib-400 (no RoCE run was fitted: assumed alike)"),
        dataclasses.replace(IB_400, name="ib-200", nic=IB_400.nic / 2,
                            summary="InfiniBand HDR, 200 Gb/s a GPU (DGX A100)",
                            sources="ib-400 at half the NIC bandwidth (assumed)"),
        dataclasses.replace(IB_400, name="roce-200", nic=IB_400.nic / 2,
                            summary="RoCE, 200 Gb/s a GPU",
                            sources="ib-400 at half the NIC bandwidth (assumed)"),
        EFA_P5,
        TCPXO,
    )
}


def with_overrides(fabric: Fabric, *, nic_gbps=None, latency_us=None) -> Fabric:
    """`fabric` with the command line's figures: `nic_gbps` sets the NIC's peak (the ramp's
    shape kept); `latency_us` scales base and hop so that a two-node call's latency
    (base + 2 hops, a tree's up and down) is that many microseconds."""
    changes = {}
    if nic_gbps is not None:
        changes["nic"] = nic_gbps * GB
    if latency_us is not None:
        two_nodes = fabric.base + 2 * fabric.hop
        scale = latency_us * 1e-6 / two_nodes if two_nodes else 0.0
        changes |= {"base": fabric.base * scale, "hop": fabric.hop * scale}
    return dataclasses.replace(fabric, **changes)
