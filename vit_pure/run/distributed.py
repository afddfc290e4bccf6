"""Several processes, one program: JAX's multi-process ("multi-controller") runtime.

Every process (one per host, usually) runs the same script with the same flags, plus
where it is in the job:

    host 0:  python train_shardmap.py ... --coordinator 10.0.0.1:1234 \
                 --num-processes 2 --process-id 0
    host 1:  python train_shardmap.py ... --coordinator 10.0.0.1:1234 \
                 --num-processes 2 --process-id 1

`initialize` connects them (process 0 runs the coordinator at that address; the
scripts' main() calls it through `cli.start_runtime`, right after parsing the flags).
After it, `jax.devices()` lists the devices of *all* processes and `jax.local_devices()`
this process's own; a jitted program over a mesh of all devices runs on every process at
once, each process driving its own devices, and the collectives written in the scripts
cross hosts (NCCL on GPUs, ICI/DCN on TPUs, gloo on CPUs). Nothing else changes in the
step.

What does change is the host side, all of it here or in vit_pure/run/loop.py:

* Data: every process computes the same global batch order from (seed, epoch, step) and
  takes only its share, rows [i*B/P, (i+1)*B/P) for process i (`local_rows`); the
  strategy turns the P shares into one global array (`global_batch`).
* State: every process holds the same host copy (same seed, or the same checkpoint) and
  places only the blocks its own devices hold. Reading it back (checkpoints) gathers the
  blocks that live on other processes (`to_host`).
* Control flow: every process must run the same collectives in the same order, so any
  decision that changes the sequence of steps (stop on SIGTERM, which may reach the
  processes at different times) is agreed first (`agree_max`). Logs and checkpoint files
  come from process 0 only; a `barrier` keeps the processes together at the end.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
from jax.experimental import multihost_utils

from vit_pure.data import cifar10 as data_lib
from vit_pure.errors import DataError


def initialize(coordinator: str | None, num_processes: int | None,
               process_id: int | None) -> None:
    """Join the job: `jax.distributed.initialize`, before anything touches a device.

    Arguments left None are filled in by JAX's cluster detection (SLURM, Open MPI,
    Cloud TPU; the coordinator also from $JAX_COORDINATOR_ADDRESS); it raises
    ValueError when it cannot. Detection also limits each process to the GPU of its local
    rank: one process per GPU (docs/multihost.md, with the variables it reads). On CPU
    the collectives between processes use gloo, JAX's default there
    (`jax_cpu_collectives_implementation`), so nothing else is needed.
    """
    jax.distributed.initialize(coordinator_address=coordinator,
                               num_processes=num_processes, process_id=process_id)


def local_rows(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """This process's rows of each global-batch array (all of them with one process)."""
    return tuple(data_lib.process_slice(a, jax.process_index(), jax.process_count())
                 for a in arrays)


@functools.lru_cache(maxsize=64)
def _check_rows(sharding: jax.sharding.Sharding, n_rows: int) -> None:
    """DataError unless this process's devices hold exactly rows [i*n/P, (i+1)*n/P)."""
    i, p = jax.process_index(), jax.process_count()
    blocks = {idx[0].indices(n_rows)[:2]
              for idx in sharding.addressable_devices_indices_map((n_rows,)).values()}
    lo, hi = min(b[0] for b in blocks), max(b[1] for b in blocks)
    want = (i * n_rows // p, (i + 1) * n_rows // p)
    if (lo, hi) != want or sum(stop - start for start, stop in blocks) != hi - lo:
        raise DataError(
            f"process {i}'s devices hold rows {sorted(blocks)} of a batch of {n_rows}, not "
            f"its own share [{want[0]}, {want[1]}): the batch axis of the mesh must be split "
            f"across the {p} processes (e.g. --mesh data=D with D a multiple of {p})")


def global_batch(local: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """One global array, split over the batch axis by `sharding`, from each process's rows.

    Every process passes its own `local_rows` share; the result has P times as many rows,
    and each process's devices hold its own rows (checked once per sharding and size).
    With one process this is `jax.device_put(local, sharding)`.
    """
    n_rows = local.shape[0] * jax.process_count()
    _check_rows(sharding, n_rows)
    return jax.make_array_from_process_local_data(sharding, local, (n_rows, *local.shape[1:]))


def put_global(tree, shardings):
    """Place host values that every process holds identically (the state, a key).

    `shardings`: one sharding, or a tree of them matching a prefix of `tree` (like
    `jax.device_put`). Each process builds only the blocks of its own devices (`idx` is
    a device's block index); `jax.device_put` would first check, across processes, that
    every process passed the same value.
    """
    def put(x, sharding):
        is_key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        host = x if is_key else np.asarray(x)  # (a key's blocks are sliced as a jax array)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.tree.map(lambda sharding, sub: jax.tree.map(lambda x: put(x, sharding), sub),
                        shardings, tree)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of `x` as a numpy array, on every process."""
    if x.is_fully_addressable:  # one process: every block is here
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:  # each device holds all of it: read one of ours
        return np.asarray(x.addressable_data(0))
    # All-gather across processes: the blocks held by other processes' devices. Every
    # process must call this, for the same arrays in the same order.
    return multihost_utils.process_allgather(x, tiled=True)


def agree_max(value: int) -> int:
    """The largest of the processes' `value`s, on every process (a small all-gather).

    Every process must call this at the same point of the run; with one process it is
    `value` itself and moves nothing.
    """
    if jax.process_count() == 1:
        return value
    # All-gather of one int32 per process (through the devices), then the max on the host.
    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier of this name (no-op with one)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
