"""The MLP's backward pass through fc2 and the GELU as one Pallas (Triton) kernel.

The MLP computes z = gelu(h) @ w, h = fc1's output plus its bias (B*T, M), w = fc2's
kernel (M, E). Its backward, as XLA:GPU builds it from the reference formulas, is three
kernels that pass (B*T, M) arrays through HBM:

    dg = dz @ w.T              cuBLAS: writes dg
    dh = dg * gelu'(h)         elementwise: reads dg and h, writes dh and gelu(h)
    db = sum over rows of dh   a reduction: reads dh again

`gelu_fc2_backward` is one kernel: for a (BM, BN) tile it accumulates dz @ w.T over E in
float32 on the tensor cores, multiplies by gelu'(h) in float32 in registers, and writes
dh, gelu(h) (which fc2's weight gradient, an ordinary GEMM, reads) and the tile's column
sums of dh (float32, one row per row block; the caller adds those up). dg is never
written and dh is read by no second pass: 2.4 GB less HBM traffic a block for vit-cifar
at batch 4096 on the deviceless H100 (docs/performance.md).

It computes what the reference formulas compute with one rounding fewer: dg stays in
float32 (the reference rounds it to the matmul dtype first). No collective: under tensor
parallelism each device holds M / model hidden units of h and w, and every sum here runs
over rows or over E.

The kernel is lowered by Pallas to Triton, which XLA:GPU compiles for NVIDIA GPUs (a
deviceless compile included). A program lowered for a CPU runs the same arithmetic on
whole arrays in XLA instead (`lax.platform_dependent`); `interpret=True` runs the kernel
itself with Pallas's interpreter on any backend: how the tests check its tiling on a CPU.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from vit_pure.pallas.common import block, vary_alike

F32 = jnp.float32
GELU_C = math.sqrt(2.0 / math.pi)  # the tanh form: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))


def gelu_and_slope(x):
    """GELU (tanh form, as `jax.nn.gelu`) of float32 x and its derivative."""
    t = jnp.tanh(GELU_C * (x + 0.044715 * x * x * x))
    gelu = 0.5 * x * (1 + t)
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * GELU_C * (1 + 3 * 0.044715 * x * x)
    return gelu, slope


def tiles(rows: int, hidden: int, width: int) -> tuple[int, int, int] | None:
    """(BM, BN, BK) for dz (rows, width), w (hidden, width), or None when no tiling of
    the kernel's fits those sizes exactly (the caller then runs the reference path)."""
    bm, bn, bk = block(rows), block(hidden), block(width)  # rows, hidden units, over E
    return None if None in (bm, bn, bk) else (bm, bn, bk)


def _epilogue(dg, h, gelu_dtype):
    """From dg = dz @ w.T (float32) and h, a tile or the whole array: dh (h's dtype),
    gelu(h) (`gelu_dtype`) and dh's column sums (float32, (1, n))."""
    gelu, slope = gelu_and_slope(h.astype(F32))
    dh = (dg * slope).astype(h.dtype)
    return dh, gelu.astype(gelu_dtype), jnp.sum(dh.astype(F32), axis=0, keepdims=True)


def _kernel(dz_ref, w_ref, h_ref, dh_ref, gelu_ref, dbias_ref, *, bk: int, precision):
    """One (BM, BN) tile: dz_ref (BM, E), w_ref (BN, E), h_ref (BM, BN) in; dh_ref and
    gelu_ref (BM, BN), dbias_ref (1, BN) float32 out."""
    def dot(k):  # the k-th BK columns of the contraction over E
        cols = pl.ds(k * bk, bk)
        return pl_triton.dot(dz_ref[:, cols], w_ref[:, cols], trans_b=True, precision=precision)

    dg = dot(0)
    for k in range(1, dz_ref.shape[1] // bk):  # unrolled: E / BK steps
        dg += dot(k)
    dh_ref[...], gelu_ref[...], dbias_ref[...] = _epilogue(dg, h_ref[...], gelu_ref.dtype)


def _whole_arrays(dz, w, h, *, gelu_dtype, precision):
    """The kernel's arithmetic on whole arrays, in XLA: what a CPU runs (one row block)."""
    dg = jax.lax.dot_general(dz, w, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=F32)
    dh, gelu, dbias = _epilogue(dg, h, gelu_dtype)
    return dh, gelu, dbias[0]


def gelu_fc2_backward(dz, w, h, gelu_dtype, *, precision=None, interpret: bool = False):
    """For z = gelu(h) @ w: (dh, gelu(h), dbias) from dz (rows, E), w (M, E), h (rows, M).

    dh: the gradient at h (h's dtype), dz @ w.T times gelu'(h), the product kept in
    float32 until then; gelu(h) in `gelu_dtype`, for fc2's weight gradient; dbias: the
    column sums of dh (float32, (M,)), the gradient of a bias added to make h.
    precision: the matmul's (`lax.Precision`, as the policy's; None is the default:
    TF32 for float32 inputs on a GPU, as XLA's GEMMs).
    interpret: True runs the kernel with Pallas's interpreter, on any backend (for tests;
    outside shard_map only: inside, the interpreter checks the kernel's constants against
    the blocks' mesh axes and refuses). False (the default) decides where the program is
    lowered: Triton on a GPU, and on a CPU the same arithmetic on whole arrays in XLA.
    Shapes must fit `tiles` (ValueError otherwise)."""
    rows, width = dz.shape
    hidden = w.shape[0]
    if w.shape[1] != width or h.shape != (rows, hidden) or dz.dtype != w.dtype:
        raise ValueError(f"gelu_fc2_backward: dz {dz.shape} {dz.dtype}, w {w.shape} "
                         f"{w.dtype}, h {h.shape} do not fit dz (rows, E), w (M, E) of "
                         "dz's dtype, h (rows, M)")
    fit = tiles(rows, hidden, width)
    if fit is None:
        raise ValueError(f"gelu_fc2_backward: no tiling fits rows {rows}, M {hidden}, "
                         f"E {width} (`tiles`)")
    dz, w, h = vary_alike(dz, w, h)
    call = functools.partial(_call, tiling=fit, gelu_dtype=gelu_dtype, precision=precision)
    if interpret:
        return call(dz, w, h, interpret=True)
    return jax.lax.platform_dependent(
        dz, w, h, default=functools.partial(call, interpret=False),
        cpu=functools.partial(_whole_arrays, gelu_dtype=gelu_dtype, precision=precision))


def _call(dz, w, h, *, tiling, gelu_dtype, precision, interpret):
    (rows, width), hidden = dz.shape, w.shape[0]
    bm, bn, bk = tiling
    grid = (rows // bm, hidden // bn)  # row blocks outer: a row block's dz stays in L2
    dh, gelu, dbias = pl.pallas_call(
        functools.partial(_kernel, bk=bk, precision=precision),
        grid=grid,
        in_specs=[pl.BlockSpec((bm, width), lambda i, j: (i, 0)),
                  pl.BlockSpec((bn, width), lambda i, j: (j, 0)),
                  pl.BlockSpec((bm, bn), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                   pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                   pl.BlockSpec((1, bn), lambda i, j: (i, j))],
        # Inside shard_map the outputs vary over the mesh axes h varies over.
        out_shape=[jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(h).mat)
                   for shape, dtype in ((h.shape, h.dtype), (h.shape, gelu_dtype),
                                        ((grid[0], hidden), F32))],
        compiler_params=pl_triton.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="gelu_fc2_backward",
        # Read back from the compiled program by vit_pure/xla/kernels.py: Triton's IR in
        # the HLO is opaque, so the kernel states its matmul FLOPs.
        metadata={"flops": str(2 * rows * hidden * width)},
    )(dz, w, h)
    return dh, gelu, dbias.sum(axis=0)  # the row blocks' column sums added up
