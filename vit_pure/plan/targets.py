"""GPU targets the plan compiles for without a GPU (deviceless ahead-of-time compilation).

With JAX's CUDA plugin installed (`pip install -r requirements-gpu.txt`; no driver, no GPU
needed), XLA:GPU compiles the training step for a GPU described by a `GpuTargetConfig`
text proto (targets/*.txtpb, each figure with its source). The compiled program is the
GPU's: its kernels, its async and combined collectives, its memory. It cannot run.

A description is added only when it was read from a real device or its figures are
published; `--hardware NAME` uses one when it exists and the plugin imports, else the plan
compiles for fake CPU devices (and says so).
"""
from __future__ import annotations

import os
import pathlib
import re

from jax.experimental import topologies

from vit_pure.quiet import cuda_plugin_installed  # noqa: F401 (targets.cuda_plugin_installed)

TARGETS_DIR = pathlib.Path(__file__).resolve().parent / "targets"
# --hardware name -> its device description.
GPU_TARGETS = {"h100": "h100-sxm.txtpb", "h200": "h200-sxm.txtpb"}


def gpu_target(name: str) -> str | None:
    """The GpuTargetConfig text for `--hardware name`, or None when the kit has none or
    the plugin is missing (then the plan compiles for CPU devices)."""
    if name not in GPU_TARGETS or not cuda_plugin_installed():
        return None
    return (TARGETS_DIR / GPU_TARGETS[name]).read_text()


def device_description(name: str) -> str:
    """The device kind the description stands for ('NVIDIA H200'): what JAX's
    `device.device_kind` reads on that GPU."""
    text = (TARGETS_DIR / GPU_TARGETS[name]).read_text()
    return re.search(r'device_description_str:\s*"([^"]*)"', text).group(1)


def target_for_device(device_kind: str) -> str | None:
    """The --hardware name whose description is the GPU at hand (its `device_kind`), or
    None when the kit describes no such GPU."""
    for name in GPU_TARGETS:
        if device_description(name) == device_kind:
            return name
    return None


def memory_bandwidth(name: str) -> float:
    """The described GPU's memory bandwidth, bytes/s (its target's memory_bandwidth)."""
    text = (TARGETS_DIR / GPU_TARGETS[name]).read_text()
    return float(re.search(r"memory_bandwidth:\s*(\d+)", text).group(1))


def gpu_devices(target_config: str, n: int, per_host: int) -> list:
    """n devices of the described GPU, `per_host` to a host (the last host may hold
    fewer), for a mesh: topology "1 x hosts x per_host". Call before JAX's backends start:
    the plugin's start-up check needs a driver unless it is told to skip it."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    per_host = min(per_host, n)
    hosts = -(-n // per_host)
    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                            topology=f"1x{hosts}x{per_host}")
    return list(topology.devices)[:n]
