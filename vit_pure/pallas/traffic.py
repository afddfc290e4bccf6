"""The HBM traffic of a Pallas kernel as its grid and BlockSpecs move it.

A kernel's program loads each of its input blocks and stores each of its output blocks.
What comes from HBM rather than from the L2 cache depends on which programs run
together: the GPU launches the grid in order, axis 0 fastest (vit_pure/pallas/common.py),
about one program per SM at a time. Here the grid is cut into waves of `WAVE`
consecutive programs (132: an H100's SMs); within a wave a block loaded by several
programs is counted once, across waves every time. That credits the L2 with reuse only
between programs that run together, and with nothing else: a block that a later wave
loads again is counted again, whatever the cache might still hold.

Each kernel states the figure in its call's metadata (`"bytes"`), which
vit_pure/xla/kernels.py reads from the compiled program in place of the operand sizes.
"""
from __future__ import annotations

import itertools
import math

WAVE = 132


def launch_order(grid: tuple[int, ...]):
    """The grid's program indices in launch order: axis 0 fastest."""
    for rest in itertools.product(*(range(n) for n in reversed(grid[1:]))):
        for first in range(grid[0]):
            yield (first, *reversed(rest))


def grid_bytes(grid: tuple[int, ...], inputs, outputs, wave: int = WAVE) -> int:
    """Bytes moved between HBM and the SMs by a kernel of `grid`: `inputs` and `outputs`
    are (block bytes, index map) pairs, an index map taking the program's indices as
    its BlockSpec's does. Inputs: distinct blocks per wave of `wave` programs; outputs:
    every block a program stores, once."""
    total = 0
    programs = list(launch_order(grid))
    for start in range(0, len(programs), wave):
        chunk = programs[start:start + wave]
        for nbytes, index in inputs:
            total += nbytes * len({tuple(index(*p)) for p in chunk})
    for nbytes, index in outputs:
        total += nbytes * len({tuple(index(*p)) for p in programs})
    return total


def block_bytes(shape: tuple[int | None, ...], itemsize: int) -> int:
    """Bytes of a block (a None dimension is squeezed: one element along it)."""
    return math.prod(1 if d is None else d for d in shape) * itemsize
