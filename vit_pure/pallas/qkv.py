"""The attention's q, k, v projection written straight into cuDNN's inputs: two Pallas kernels.

cuDNN's flash attention takes q, k and v as three arrays, each (B, Tp, H, D) with the
token axis padded (attention.py: 65 tokens -> 72). The reference path computes them as
XLA:GPU builds it from `model._block`'s formulas:

    qkv = h @ w + b           one cuBLAS GEMM: writes (B*T, 3*H*D)
    q, k, v = pad(split(qkv)) a copy: reads qkv, writes three padded arrays
    (backward)                a copy back: reads dq, dk, dv, writes d(qkv) and the bias
                              gradient; then the input-gradient GEMM reads d(qkv)

Here the LayerNorm's output h comes in padded (hp, (B*Tp, E): XLA writes the zero rows in
the LayerNorm's own kernel), and

  * `projection` is one GEMM kernel with three outputs: for a (BM, BN) tile of each of
    q, k and v it reads hp's rows once, accumulates over E in float32 on the tensor
    cores, adds the bias and writes the tile. No qkv array, no copy.
  * `projection_input_gradient` is the backward's input gradient, dq @ wq.T + dk @ wk.T
    + dv @ wv.T, as one GEMM kernel over the three (a contraction over 3*H*D), writing
    d(hp) and the column sums of dq, dk and dv (the bias gradient). No d(qkv) array.

The weight gradient stays three ordinary GEMMs (hp.T @ dq, ...). Padded rows: their q, k, v
are the bias (hp's rows are zeros there); cuDNN's padding mask gives the padded keys zero
weight and the caller slices the padded queries' outputs off, so dq, dk and dv are zero
on those rows and add nothing to any gradient.

Arithmetic: as the reference, with one rounding fewer (the bias is added to the float32
accumulator, not to a product rounded to the output dtype). No collective: under tensor
parallelism each device holds its heads' columns of w, and every sum here runs over rows
or over E. A program lowered for a CPU runs the same arithmetic on whole arrays in XLA
(`lax.platform_dependent`); `interpret=True` runs the kernels with Pallas's interpreter.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from vit_pure.pallas.common import block, dispatch, vary_alike

F32 = jnp.float32


def tiles(rows: int, width: int, columns: int) -> tuple[int, int, int] | None:
    """(BM, BN, BK) for hp (rows, width) and q, k, v (rows, columns) each, or None when no
    tiling fits those sizes exactly (the caller then runs the reference path). BN and BK
    tile both `width` and `columns` (the forward's output and contraction, the backward's
    the other way round)."""
    bm, bn = block(rows), block(math.gcd(width, columns))
    if None in (bm, bn):
        return None
    return bm, bn, bn


def _check(x, w, columns, who):
    if x.ndim != 2 or w.shape != (x.shape[1], 3 * columns):
        raise ValueError(f"{who}: x {x.shape}, w {w.shape} do not fit x (rows, E), "
                         f"w (E, 3 * {columns})")
    fit = tiles(x.shape[0], x.shape[1], columns)
    if fit is None:
        raise ValueError(f"{who}: no tiling fits rows {x.shape[0]}, E {x.shape[1]}, "
                         f"{columns} columns per projection (`tiles`)")
    return fit


# ---------------------------------------------------------------------------- forward
def projection(x, w, bias, out_dtype, *, precision=None, interpret: bool = False):
    """(q, k, v): x @ w + bias split into thirds by columns, each (rows, n) of `out_dtype`.

    x (rows, E), w (E, 3n) with x's dtype, bias (3n,). The product accumulates in float32
    and the bias is added before the one rounding to `out_dtype`. precision: the
    matmul's (`lax.Precision`; None: the default). interpret: as `mlp.gelu_fc2_backward`.
    Shapes must fit `tiles` (ValueError otherwise)."""
    columns = w.shape[-1] // 3
    fit = _check(x, w, columns, "qkv projection")
    if bias.shape != (3 * columns,) or w.dtype != x.dtype:
        raise ValueError(f"qkv projection: bias {bias.shape}, w {w.dtype}: want "
                         f"({3 * columns},) and x's dtype {x.dtype}")
    x, w, bias = vary_alike(x, w, bias.reshape(1, -1))
    kernel = functools.partial(_projection_call, tiling=fit, out_dtype=out_dtype,
                               precision=precision)
    whole = functools.partial(_projection_whole, out_dtype=out_dtype, precision=precision)
    return dispatch("qkv_projection", kernel, whole, (x, w, bias), interpret)


def _projection_kernel(x_ref, w_ref, b_ref, q_ref, k_ref, v_ref, *, bk, precision):
    """One (BM, BN) tile of each of q, k, v: x_ref (BM, E); w_ref (E, 3n) and b_ref (1, 3n),
    whole; the tile's columns are BN * program_id(1) onwards within each third."""
    bn, columns = q_ref.shape[1], w_ref.shape[1] // 3
    col = pl.program_id(1) * bn
    for third, out_ref in enumerate((q_ref, k_ref, v_ref)):
        cols = pl.ds(third * columns + col, bn)
        acc = b_ref[:, cols].astype(F32)  # (1, BN): the dots add onto the bias
        for k in range(x_ref.shape[1] // bk):  # unrolled: E / BK steps
            rows = pl.ds(k * bk, bk)
            acc = acc + pl_triton.dot(x_ref[:, rows], w_ref[rows, cols], precision=precision)
        out_ref[...] = acc.astype(out_ref.dtype)


def _projection_call(x, w, bias, *, tiling, out_dtype, precision, interpret):
    (rows, width), columns = x.shape, w.shape[1] // 3
    bm, bn, bk = tiling
    out = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    return pl.pallas_call(
        functools.partial(_projection_kernel, bk=bk, precision=precision),
        grid=(rows // bm, columns // bn),  # row blocks outer: a row block stays in L2
        in_specs=[pl.BlockSpec((bm, width), lambda i, j: (i, 0)),
                  pl.BlockSpec(w.shape, lambda i, j: (0, 0)),
                  pl.BlockSpec(bias.shape, lambda i, j: (0, 0))],
        out_specs=[out, out, out],
        # Inside shard_map the outputs vary over the mesh axes the inputs vary over.
        out_shape=[jax.ShapeDtypeStruct((rows, columns), out_dtype,
                                        manual_axis_type=jax.typeof(x).mat)] * 3,
        compiler_params=pl_triton.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="qkv_projection",
        # Read back by vit_pure/xla/kernels.py: Triton's IR in the HLO is opaque.
        metadata={"flops": str(2 * rows * width * 3 * columns)},
    )(x, w, bias)


def _projection_whole(x, w, bias, *, out_dtype, precision):
    """The kernel's arithmetic on whole arrays, in XLA: what a CPU runs."""
    y = jnp.dot(x, w, precision=precision, preferred_element_type=F32) + bias.astype(F32)
    return tuple(y.astype(out_dtype).reshape(x.shape[0], 3, -1)[:, i] for i in range(3))


# ---------------------------------------------------------------------------- backward
def projection_input_gradient(dq, dk, dv, w, out_dtype, *, precision=None,
                              interpret: bool = False):
    """For (q, k, v) = `projection`(x, w, bias): (dx, dbias) from their gradients.

    dq, dk, dv (rows, n) of w's dtype, w (E, 3n): dx = dq @ wq.T + dk @ wk.T + dv @ wv.T
    (`out_dtype`, accumulated in float32 over all 3n), dbias = the column sums of dq, dk
    and dv side by side (float32, (3n,)). Shapes must fit `tiles` (ValueError otherwise)."""
    rows, columns = dq.shape
    fit = _check(jax.ShapeDtypeStruct((rows, w.shape[0]), w.dtype), w, columns,
                 "qkv input gradient")
    if not (dq.shape == dk.shape == dv.shape and dq.dtype == dk.dtype == dv.dtype == w.dtype):
        raise ValueError(f"qkv input gradient: dq {dq.shape} {dq.dtype}, dk {dk.shape} "
                         f"{dk.dtype}, dv {dv.shape} {dv.dtype}: want one shape and w's "
                         f"dtype {w.dtype}")
    arrays = vary_alike(dq, dk, dv, w)
    kernel = functools.partial(_gradient_call, tiling=fit, out_dtype=out_dtype,
                               precision=precision)
    whole = functools.partial(_gradient_whole, out_dtype=out_dtype, precision=precision)
    return dispatch("qkv_input_gradient", kernel, whole, arrays, interpret)


def _gradient_kernel(dq_ref, dk_ref, dv_ref, w_ref, dx_ref, db_ref, *, bk, precision):
    """One (BM, BN) tile of dx: dq_ref, dk_ref, dv_ref (BM, n); w_ref (E, 3n), whole; the
    tile's columns (of E) are BN * program_id(1) onwards. The first column tile of a row
    block also writes the row block's column sums of dq, dk, dv: db_ref (1, 3n)."""
    bn, columns = dx_ref.shape[1], dq_ref.shape[1]
    w_rows = pl.ds(pl.program_id(1) * bn, bn)
    first = pl.program_id(1) == 0
    acc = jnp.zeros(dx_ref.shape, F32)
    for third, d_ref in enumerate((dq_ref, dk_ref, dv_ref)):
        for k in range(columns // bk):  # unrolled: 3n / BK steps in all
            chunk = d_ref[:, pl.ds(k * bk, bk)]
            w_cols = pl.ds(third * columns + k * bk, bk)
            acc = acc + pl_triton.dot(chunk, w_ref[w_rows, w_cols], trans_b=True,
                                      precision=precision)

            @pl.when(first)
            def _():
                db_ref[:, w_cols] = jnp.sum(chunk.astype(F32), axis=0, keepdims=True)
    dx_ref[...] = acc.astype(dx_ref.dtype)


def _gradient_call(dq, dk, dv, w, *, tiling, out_dtype, precision, interpret):
    (rows, columns), width = dq.shape, w.shape[0]
    bm, bn, bk = tiling
    grid = (rows // bm, width // bn)
    d = pl.BlockSpec((bm, columns), lambda i, j: (i, 0))
    dx, db = pl.pallas_call(
        functools.partial(_gradient_kernel, bk=bk, precision=precision),
        grid=grid,
        in_specs=[d, d, d, pl.BlockSpec(w.shape, lambda i, j: (0, 0))],
        out_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                   pl.BlockSpec((1, 3 * columns), lambda i, j: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(dq).mat)
                   for shape, dtype in (((rows, width), out_dtype),
                                        ((grid[0], 3 * columns), F32))],
        compiler_params=pl_triton.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="qkv_input_gradient",
        metadata={"flops": str(2 * rows * width * 3 * columns)},
    )(dq, dk, dv, w)
    return dx, db.sum(axis=0)  # the row blocks' column sums added up


def _gradient_whole(dq, dk, dv, w, *, out_dtype, precision):
    """The kernel's arithmetic on whole arrays, in XLA: what a CPU runs."""
    d = jnp.concatenate([dq, dk, dv], axis=1)
    dx = jax.lax.dot_general(d, w, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=F32)
    return dx.astype(out_dtype), jnp.sum(d.astype(F32), axis=0)
