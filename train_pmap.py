"""Data-parallel ViT training with `jax.pmap`: every collective written in this file.

    python train_pmap.py --batch 4096 --dtype bf16 --data-dir ./data
    python train_pmap.py --model tiny --dataset synthetic --steps 20 --cpu-devices 8

pmap runs one copy of `_train_step` per device. State is replicated: every array carries
a leading device axis. Each device gets its slice of the global batch, computes the
gradient of its local mean loss, and one `lax.pmean` over the axis named 'data' turns
those into the gradient of the global mean loss, the same on every device, so every
device applies the same update and the replicas never drift apart.
"""
from __future__ import annotations

import os
import sys

# isort: off
if __name__ == "__main__" and not {"-h", "--help"} & set(sys.argv) and (
        "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", "")):
    # The first line, before JAX loads (seconds on a busy CPU). The restart with huge
    # pages (vit_pure/run/hostmem.py) sets that tunable, so it is said once.
    print(f"{os.path.basename(__file__)}: starting: loading JAX", flush=True)
import vit_pure  # noqa: E402, F401 (before jax: JAX's CUDA plugin without a GPU, quiet.py)
# isort: on
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vit_pure import step
from vit_pure.run import accum, cli, entry, hostmem

AXIS = "data"


class PmapStrategy:
    name = "pmap"

    def __init__(self, sc: step.StepConfig, optimizer, devices=None):
        if devices is None:
            # Every device of every process, grouped by process: with several processes
            # (vit_pure/run/distributed.py) process p feeds the devices at [p*L, (p+1)*L).
            devices = [d for p in range(jax.process_count())
                       for d in jax.local_devices(process_index=p)]
        self.devices = list(devices)
        self.n_devices = self.batch_divisor = len(self.devices)
        # The devices this process feeds: all of them, unless there are several processes.
        self.local_devices = [d for d in self.devices if d.process_index == jax.process_index()]
        self.sc = sc
        # This process's arrays with a leading device axis: slice i lives on local device i.
        # (Multi-process pmap takes and returns each process's *local* slices.)
        self._device_axis = NamedSharding(Mesh(np.array(self.local_devices), (AXIS,)),
                                          PartitionSpec(AXIS))
        self._build(optimizer)

    def describe(self) -> str:
        procs = len({d.process_index for d in self.devices})
        return (f"{self.n_devices} devices on axis '{AXIS}' ({self.devices[0].platform})"
                + (f", {procs} processes" if procs > 1 else ""))

    def check_batch(self, global_batch: int, flag: str = "--batch", accum_steps: int = 1) -> None:
        """UsageError unless the global batch splits over the processes and devices, and
        each device's slice into `accum_steps` micro-batches."""
        accum.check_accum_steps(accum_steps, global_batch, self.batch_divisor, flag)

    # -------------------------------------------------------------------- the two steps
    def _build(self, optimizer):
        sc = self.sc

        def train_step(state, images, labels, example_ids, key):
            # Under pmap each device holds its own copy of the params and nothing tracks
            # replication, so grad of the local loss is exactly this device's gradient:
            # no hidden reduction (compare train_shardmap.py's pcast).
            grads, metrics = step.local_grads(
                sc, state["params"], state["loss_scale"], images, labels, example_ids, key)
            # All-reduce (mean) of the gradients over the data axis: each device's local
            # gradient becomes the gradient of the global mean loss.
            grads = lax.pmean(grads, AXIS)
            # All-reduce (mean) of the scalar metrics, for logging.
            metrics = lax.pmean(metrics, AXIS)
            grad_norm = jnp.sqrt(step.sum_of_squares(grads))
            state, _ = step.apply_gradients(sc, state, grads, grad_norm, optimizer)
            return state, {**metrics, "grad_norm": grad_norm}

        def eval_step(state, images, labels, mask):
            sums = step.local_eval(sc, state["params"], images, labels, mask)
            # All-reduce (sum) of loss / correct / count: padding is masked, so sums, not means.
            return lax.psum(sums, AXIS)

        # The step's key is the same on every device (in_axes=None): examples draw their
        # own randomness from it with their global ids.
        self.train_step = jax.pmap(train_step, axis_name=AXIS, in_axes=(0, 0, 0, 0, None),
                                   donate_argnums=0, devices=self.devices)
        self.eval_step = jax.pmap(eval_step, axis_name=AXIS, devices=self.devices)
        # A frozen backbone's features (--trainable head: vit_pure/run/probe.py), each
        # device's rows of the batch; no collective.
        self.features_step = jax.pmap(
            lambda state, images: step.local_features(sc, state["params"], images),
            devices=self.devices)

    # -------------------------------------------------------------------- placement
    def put_state(self, state):
        # Replicate: every array gets a leading axis of size n (this process's devices),
        # slice i on device i (a broadcast view on the host, copied once to each device).
        n = len(self.local_devices)

        def replicate(x):
            x = np.broadcast_to(np.asarray(x), (n, *np.shape(x)))
            return jax.device_put(x, self._device_axis)
        return jax.tree.map(replicate, state)

    def put_batch(self, *arrays):
        # This process's rows of the global batch (all of it with one process), split into
        # per-device slices: (rows, ...) -> (n, rows/n, ...), n = this process's devices.
        n = len(self.local_devices)
        return tuple(jax.device_put(a.reshape(n, a.shape[0] // n, *a.shape[1:]), self._device_axis)
                     for a in arrays)

    def put_replicated(self, x):
        return x

    def host_state(self, state) -> dict:
        # Every replica holds the whole state: read one of this process's, i.e. the
        # block (1, ...) on one local device (no program runs, nothing crosses processes).
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[0], state)

    def batch_to_host(self, x) -> np.ndarray:
        # (devices, rows, ...) -> this process's rows, then every process's (all-gathered
        # across processes, in process order: the order of the global batch's rows).
        rows = np.asarray(x).reshape(-1, *x.shape[2:])
        if jax.process_count() == 1:
            return rows
        return multihost_utils.process_allgather(rows, tiled=True)

    def metrics_to_host(self, metrics) -> dict:
        # The metrics were all-reduced, so every device (hence every process) has them.
        return {k: float(np.asarray(v.addressable_data(0))[0]) for k, v in metrics.items()}


def main(argv=None) -> dict:
    args = cli.parse_args(cli.build_parser(__doc__.splitlines()[0]), argv)
    # Train (or, with --plan N, compile for N devices and print the plan): vit_pure/run/entry.py.
    return entry.main(args, PmapStrategy, "train_pmap.py")


if __name__ == "__main__":
    hostmem.use_huge_pages()  # restarts once; see vit_pure/run/hostmem.py
    sys.exit(cli.main_guard(main))
