"""What the peers of benchmarks/peers.py share: the recipe's optimizer constants, the
normalisation, the timing loop and the device figures. Each peer (the kit, Flax NNX,
PyTorch) runs in a child process of its own; peers.py starts them.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from benchmarks import bench
from vit_pure.data.cifar10 import CIFAR10_MEAN, CIFAR10_STD  # noqa: F401 (the peers')

LR, WEIGHT_DECAY, BETAS, CLIP, LABEL_SMOOTHING = 1e-3, 0.05, (0.9, 0.999), 1.0, 0.1


def time_steps(dispatch, wait, warmup: int, steps: int) -> list[float]:
    """As bench.measure_train_step: dispatch(i) starts step i and returns something to
    wait() on; one step stays in flight while the next is dispatched, and a step's time
    is the interval between two consecutive completions. Returns the timed intervals."""
    finished, previous = [], None
    start = time.perf_counter()
    for i in range(warmup + steps + 1):  # one more: see bench.measure_train_step
        handle = dispatch(i)
        if previous is not None:
            wait(previous)
            finished.append(time.perf_counter())
        previous = handle
    wait(previous)
    finished.append(time.perf_counter())
    intervals = [b - a for a, b in zip([start] + finished, finished)]
    return intervals[warmup:warmup + steps]


def host_batches(batch: int, n: int = 2, seed: int = 0):
    """n random CIFAR-shaped uint8 batches (NHWC) and int32 labels, on the host."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, (batch, 32, 32, 3), dtype=np.uint8),
             rng.integers(0, 10, (batch,), dtype=np.int32)) for _ in range(n)]


def jax_device_info() -> dict:
    d = jax.devices()[0]
    return {"device": f"{d.device_kind} ({d.platform}, jax {jax.__version__})",
            "platform": d.platform}


def jax_peak_bytes():
    """Peak device memory of the first JAX device (None where the backend has no figure)."""
    return bench.device_peak_bytes(jax.devices()[0])
