"""What the Pallas kernels share: tile sizes, and the mesh-axis types of their inputs."""
from __future__ import annotations

import jax

# Triton's blocks are powers of two; tensor-core dots need 16 or more on each side.
BLOCKS = (128, 64, 32, 16)


def block(size: int) -> int | None:
    """The largest of `BLOCKS` that divides `size`, or None."""
    return next((b for b in BLOCKS if size % b == 0), None)


def vary_alike(*arrays):
    """The arrays, each marked varying over every manual mesh axis any of them varies over
    (inside shard_map; outside, unchanged): a kernel's blocks meet in one dot. A type
    cast, no data moves."""
    axes = frozenset().union(*(jax.typeof(a).mat.varying for a in arrays))
    return tuple(jax.lax.pcast(a, tuple(sorted(axes - jax.typeof(a).mat.varying, key=str)),
                               to="varying") if axes - jax.typeof(a).mat.varying else a
                 for a in arrays)
