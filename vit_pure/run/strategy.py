"""The contract between a training script and the loop: the parallel mechanics a script
hands to `loop.run` (train_pmap.PmapStrategy, train_shardmap.ShardMapStrategy).
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from vit_pure.step import StepConfig


class Strategy(Protocol):
    """The parallel mechanics a script provides to `run`."""
    name: str
    batch_divisor: int  # the global batch must divide by this (the data-parallel degree)
    sc: StepConfig  # the step settings it was built with

    def check_batch(self, global_batch: int, flag: str = "--batch",
                    accum_steps: int = 1) -> None: ...  # UsageError if the batch cannot split
    def describe(self) -> str: ...
    def put_state(self, state: dict) -> Any: ...
    def put_batch(self, *arrays: np.ndarray) -> tuple: ...
    def put_replicated(self, x) -> Any: ...
    # A jitted function (its `lower` compiles it ahead of the first step); `accum` and the
    # plan need that, the loop only calls it.
    def train_step(self, state, images, labels, example_ids, key) -> tuple[Any, dict]: ...
    def eval_step(self, state, images, labels, mask) -> dict: ...
    # The head's inputs of each image and its mirror, (rows, 2, F), for a linear probe on
    # cached features (vit_pure/run/probe.py); None where the strategy has none (a
    # pipeline: its probe runs the frozen backbone in every step).
    features_step: Any
    def batch_to_host(self, x) -> np.ndarray: ...  # a batch-split output, every row
    def host_state(self, state) -> dict: ...
    def metrics_to_host(self, metrics: dict) -> dict: ...
