"""What the Pallas kernels share: tile sizes, the mesh-axis types of their inputs, and
which program a call lowers to."""
from __future__ import annotations

import functools

import jax

from vit_pure.pallas.failures import NOTE

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


def dispatch(name: str, kernel, whole_arrays, arrays, interpret: bool):
    """kernel(*arrays): with `interpret`, run by Pallas's interpreter (any backend, for
    tests); else lowered by Pallas (Triton on a GPU), and on a CPU `whole_arrays(*arrays)`,
    the same arithmetic on whole arrays in XLA, in its place (`lax.platform_dependent`).
    An error while the kernel is traced carries a note naming it (`name`, the kernel's
    `pallas_call` name: vit_pure/pallas/failures.py)."""
    try:
        if interpret:
            return kernel(*arrays, interpret=True)
        return jax.lax.platform_dependent(
            *arrays, default=functools.partial(kernel, interpret=False), cpu=whole_arrays)
    except Exception as e:
        e.add_note(NOTE + name)
        raise
