"""What the Pallas kernels share: the tile table's rules, the launch order, one dot, the
mesh-axis types of their inputs, and which program a call lowers to.

Launch order. Pallas-Triton maps grid axis 0 to CUDA's blockIdx.x, which the GPU
launches fastest, then axis 1 (blockIdx.y, at most 65,535 blocks), then axis 2. The
programs that run together (a wave: about one per SM, 132 on an H100) are consecutive
along axis 0. Every kernel here therefore puts the axis over the large operand's row
blocks last (slow) and the column blocks first (fast): the programs of a wave share the
row block they read, which the L2 cache serves after its first load.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from vit_pure.pallas.failures import NOTE

F32 = jnp.float32
# Triton's blocks are powers of two; tensor-core dots need 16 or more on each side.
BLOCKS = (128, 64, 32, 16)
# A program's float32 accumulators, in elements: 64 x 384 is 96 registers a thread at 8
# warps, as a 128 x 256 Triton GEMM tile holds.
ACC_LIMIT = 64 * 384
SMEM_BYTES = 200 * 1024  # of an H100 SM's 227 KB a block may opt into, some left to Triton
MAX_STAGES = 3
GRID_Y_LIMIT = 65535  # CUDA's limit on blockIdx.y (and z)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One kernel's tiles at one shape (each kernel's `*_tiling` builds it)."""
    rows: int        # rows of a program's output block
    step: int        # the contraction's step, one pass of the pipelined K loop
    cols: int        # a column block of the output (a power of two)
    group: int       # column blocks one program owns (its accumulators)
    num_warps: int
    num_stages: int  # Triton's software pipeline over the K loop (1: none)


def block(size: int, prefs=BLOCKS) -> int | None:
    """The largest of `prefs` that divides `size`, or None."""
    return next((b for b in prefs if size % b == 0), None)


def group_of(rows: int, cols: int, blocks: int) -> int:
    """The most of `blocks` column blocks of `cols` (a divisor of `blocks`) that one program
    can own with `rows` rows within ACC_LIMIT, at least 1."""
    return max([g for g in range(1, blocks + 1)
                if blocks % g == 0 and rows * cols * g <= ACC_LIMIT] or [1])


def launch(rows: int, step: int, cols: int, group: int, stage_bytes: int) -> Tiling:
    """A Tiling with its warps (8 for large accumulators) and pipeline stages (as many as
    fit SMEM_BYTES, `stage_bytes` a stage, up to MAX_STAGES)."""
    warps = 8 if rows * cols * group >= 128 * 128 else 4
    stages = max(1, min(MAX_STAGES, SMEM_BYTES // max(stage_bytes, 1)))
    return Tiling(rows, step, cols, group, warps, stages)


def fits_grid(*slow_axes: int) -> bool:
    """Whether grid axes 1 and 2 stay within CUDA's limit."""
    return all(n <= GRID_Y_LIMIT for n in slow_axes)


def mm(a, b, *, trans_a: bool = False, trans_b: bool = False, precision=None):
    """a @ b (a.T, b.T as asked) accumulated in float32: one tensor-core dot in Triton."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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
