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
    q, k and v it reads each (BM, BK) tile of hp's rows once for the three, accumulates
    over E in float32 on the tensor cores, adds the bias and writes the tiles. No qkv
    array, no copy.
  * `projection_input_gradient` is the backward's input gradient, dq @ wq.T + dk @ wk.T
    + dv @ wv.T, as one GEMM kernel over the three (a contraction over 3*H*D), writing
    d(hp) and the column sums of dq, dk and dv (the bias gradient). A program owns a
    row block and all of E where its accumulators fit, so it reads dq, dk, dv once. No
    d(qkv) array.

The K loops are `lax.fori_loop`s, which Triton software-pipelines (`num_stages`); the
tiles come from a table per shape (`projection_tiling`, `gradient_tiling`); the grids
launch column blocks fastest (grid axis 0), so the programs running together share a
row block (vit_pure/pallas/common.py). w is read through a free reshape to (E, 3, n),
one BlockSpec a third.

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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from vit_pure.pallas.common import (
    ACC_LIMIT,
    BLOCKS,
    SMEM_BYTES,
    Tiling,
    block,
    dispatch,
    fits_grid,
    group_of,
    launch,
    mm,
    vary_alike,
)
from vit_pure.pallas.traffic import block_bytes, grid_bytes

F32 = jnp.float32
ROWS = (64, 32, 16)   # a program's rows (three accumulators, or all of E)
STEPS = (64, 32, 16)  # a K loop's step
THIRDS = (0, 1, 2)    # q, k, v


def projection_tiling(rows: int, width: int, columns: int, itemsize: int = 2):
    """Rows a program, the step over E, a column block of each of q, k, v."""
    bm, bk = block(rows, ROWS), block(width, STEPS)
    # Three (BM, BN) accumulators, within ACC_LIMIT where a block that divides n allows.
    bn = block(columns, [b for b in BLOCKS if bm and 3 * bm * b <= ACC_LIMIT] or BLOCKS[-1:])
    if None in (bm, bk, bn) or not fits_grid(rows // bm):
        return None
    return launch(bm, bk, bn, 3, (bm * bk + 3 * bk * bn) * itemsize)


def gradient_tiling(rows: int, width: int, columns: int, itemsize: int = 2):
    """Rows a program, the step over each third's n, E's column block and how many of them
    a program owns."""
    bm, bn = block(rows, ROWS), block(width)
    if None in (bm, bn) or block(columns, STEPS) is None or not fits_grid(rows // bm):
        return None
    group = group_of(bm, bn, width // bn)

    def stage(bk):  # a K step's tiles: three of d, three of w (all of E's group)
        return (3 * bm * bk + 3 * bn * group * bk) * itemsize

    # The largest step whose tiles leave room for two pipeline stages, if any does.
    steps = [b for b in STEPS if columns % b == 0]
    bk = next((b for b in steps if 2 * stage(b) <= SMEM_BYTES), steps[-1])
    return launch(bm, bk, bn, group, stage(bk))


def tiles(rows: int, width: int, columns: int, itemsize: int = 2):
    """The two kernels' tilings for hp (rows, width) and q, k, v (rows, columns) each, or
    None when either fits no tiling exactly (the caller then runs the reference path)."""
    fit = (projection_tiling(rows, width, columns, itemsize),
           gradient_tiling(rows, width, columns, itemsize))
    return None if None in fit else fit


def _check(x, w, columns, who):
    if x.ndim != 2 or w.shape != (x.shape[1], 3 * columns):
        raise ValueError(f"{who}: x {x.shape}, w {w.shape} do not fit x (rows, E), "
                         f"w (E, 3 * {columns})")
    fit = tiles(x.shape[0], x.shape[1], columns, jnp.dtype(w.dtype).itemsize)
    if fit is None:
        raise ValueError(f"{who}: no tiling fits rows {x.shape[0]}, E {x.shape[1]}, "
                         f"{columns} columns per projection (`tiles`)")
    return fit


def _params(fit: Tiling):
    return pl_triton.CompilerParams(num_warps=fit.num_warps, num_stages=fit.num_stages)


# ---------------------------------------------------------------------------- forward
def projection(x, w, bias, out_dtype, *, precision=None, interpret: bool = False):
    """(q, k, v): x @ w + bias split into thirds by columns, each (rows, n) of `out_dtype`.

    x (rows, E), w (E, 3n) with x's dtype, bias (3n,). The product accumulates in float32
    and the bias is added before the one rounding to `out_dtype`. precision: the
    matmul's (`lax.Precision`; None: the default). interpret: as `mlp.gelu_fc2_backward`.
    Shapes must fit `tiles` (ValueError otherwise)."""
    columns = w.shape[-1] // 3
    fit = _check(x, w, columns, "qkv projection")[0]
    if bias.shape != (3 * columns,) or w.dtype != x.dtype:
        raise ValueError(f"qkv projection: bias {bias.shape}, w {w.dtype}: want "
                         f"({3 * columns},) and x's dtype {x.dtype}")
    x, w, bias = vary_alike(x, w.reshape(w.shape[0], 3, columns),
                            bias.reshape(3, 1, columns))
    kernel = functools.partial(_projection_call, fit=fit, out_dtype=out_dtype,
                               precision=precision)
    whole = functools.partial(_projection_whole, out_dtype=out_dtype, precision=precision)
    return dispatch("qkv_projection", kernel, whole, (x, w, bias), interpret)


def _projection_kernel(x_ref, wq_ref, wk_ref, wv_ref, bq_ref, bk_ref, bv_ref,
                       q_ref, k_ref, v_ref, *, fit: Tiling, precision):
    """One (BM, BN) tile of each of q, k, v: x_ref (BM, E); w*_ref (E, BN) and b*_ref
    (1, BN), that third's columns of w and the bias. Each (BM, BK) tile of x is loaded
    once for the three dots."""
    bk, shape = fit.step, q_ref.shape

    def step(k, accs):
        units = pl.ds(pl.multiple_of(k * bk, bk), bk)
        chunk = x_ref[:, units]
        return tuple(acc + mm(chunk, w_ref[units, :], precision=precision)
                     for acc, w_ref in zip(accs, (wq_ref, wk_ref, wv_ref)))

    start = tuple(jnp.broadcast_to(b[...].astype(F32), shape) for b in (bq_ref, bk_ref, bv_ref))
    accs = jax.lax.fori_loop(0, x_ref.shape[1] // bk, step, start)
    for acc, out_ref in zip(accs, (q_ref, k_ref, v_ref)):
        out_ref[...] = acc.astype(out_ref.dtype)


def _projection_call(x, w3, b3, *, fit: Tiling, out_dtype, precision, interpret):
    (rows, width), columns = x.shape, w3.shape[2]
    bm, bn = fit.rows, fit.cols
    # Axis 0, launched fastest: column blocks of q, k, v; axis 1: row blocks. A wave's
    # programs share a row block of x.
    grid = (columns // bn, rows // bm)
    x_map, out_map = (lambda j, i: (i, 0)), (lambda j, i: (i, j))
    w_specs = [pl.BlockSpec((width, pl.squeezed, bn), lambda j, i, t=t: (0, t, j))
               for t in THIRDS]
    b_specs = [pl.BlockSpec((pl.squeezed, 1, bn), lambda j, i, t=t: (t, 0, j)) for t in THIRDS]
    size, out_size = jnp.dtype(x.dtype).itemsize, jnp.dtype(out_dtype).itemsize
    nbytes = grid_bytes(
        grid, [(block_bytes((bm, width), size), x_map)]
        + [(block_bytes((width, bn), size), lambda j, i, t=t: (0, t, j)) for t in THIRDS]
        + [(block_bytes((1, bn), b3.dtype.itemsize), lambda j, i, t=t: (t, 0, j))
           for t in THIRDS],
        [(block_bytes((bm, bn), out_size), out_map)] * 3)
    out = pl.BlockSpec((bm, bn), out_map)
    return pl.pallas_call(
        functools.partial(_projection_kernel, fit=fit, precision=precision),
        grid=grid,
        in_specs=[pl.BlockSpec((bm, width), x_map), *w_specs, *b_specs],
        out_specs=[out, out, out],
        # Inside shard_map the outputs vary over the mesh axes the inputs vary over.
        out_shape=[jax.ShapeDtypeStruct((rows, columns), out_dtype,
                                        manual_axis_type=jax.typeof(x).mat)] * 3,
        compiler_params=_params(fit),
        interpret=interpret,
        name="qkv_projection",
        # Read back by vit_pure/xla/kernels.py: Triton's IR in the HLO is opaque.
        metadata={"flops": str(2 * rows * width * 3 * columns), "bytes": str(nbytes)},
    )(x, w3, w3, w3, b3, b3, b3)


def _projection_whole(x, w3, b3, *, out_dtype, precision):
    """The kernel's arithmetic on whole arrays, in XLA: what a CPU runs."""
    w = w3.reshape(w3.shape[0], -1)
    y = jnp.dot(x, w, precision=precision, preferred_element_type=F32) + b3.reshape(
        1, -1).astype(F32)
    return tuple(y.astype(out_dtype).reshape(x.shape[0], 3, -1)[:, i] for i in THIRDS)


# ---------------------------------------------------------------------------- backward
def projection_input_gradient(dq, dk, dv, w, out_dtype, *, precision=None,
                              interpret: bool = False):
    """For (q, k, v) = `projection`(x, w, bias): (dx, dbias) from their gradients.

    dq, dk, dv (rows, n) of w's dtype, w (E, 3n): dx = dq @ wq.T + dk @ wk.T + dv @ wv.T
    (`out_dtype`, accumulated in float32 over all 3n), dbias = the column sums of dq, dk
    and dv side by side (float32, (3n,)). Shapes must fit `tiles` (ValueError otherwise)."""
    rows, columns = dq.shape
    fit = _check(jax.ShapeDtypeStruct((rows, w.shape[0]), w.dtype), w, columns,
                 "qkv input gradient")[1]
    if not (dq.shape == dk.shape == dv.shape and dq.dtype == dk.dtype == dv.dtype == w.dtype):
        raise ValueError(f"qkv input gradient: dq {dq.shape} {dq.dtype}, dk {dk.shape} "
                         f"{dk.dtype}, dv {dv.shape} {dv.dtype}: want one shape and w's "
                         f"dtype {w.dtype}")
    arrays = vary_alike(dq, dk, dv, w.reshape(w.shape[0], 3, columns))
    kernel = functools.partial(_gradient_call, fit=fit, out_dtype=out_dtype,
                               precision=precision)
    whole = functools.partial(_gradient_whole, out_dtype=out_dtype, precision=precision)
    return dispatch("qkv_input_gradient", kernel, whole, arrays, interpret)


def _gradient_kernel(dq_ref, dk_ref, dv_ref, wq_ref, wk_ref, wv_ref, dx_ref, db_ref, *,
                     fit: Tiling, precision):
    """A (BM, BN * group) block of dx: dq_ref, dk_ref, dv_ref (BM, n); w*_ref
    (BN * group, n), that third's columns of w on the block's rows of E. The first column
    group of a row block also writes the row block's column sums of dq, dk, dv: db_ref
    (1, 3n)."""
    bk, bn, columns = fit.step, fit.cols, dq_ref.shape[1]
    first = pl.program_id(0) == 0

    def step(k, accs):
        units = pl.ds(pl.multiple_of(k * bk, bk), bk)
        for t, (d_ref, w_ref) in enumerate(zip((dq_ref, dk_ref, dv_ref),
                                               (wq_ref, wk_ref, wv_ref))):
            chunk = d_ref[:, units]
            accs = tuple(acc + mm(chunk, w_ref[pl.ds(c * bn, bn), units], trans_b=True,
                                  precision=precision) for c, acc in enumerate(accs))

            @pl.when(first)
            def _():
                db_ref[:, pl.ds(pl.multiple_of(t * columns + k * bk, bk), bk)] = jnp.sum(
                    chunk.astype(F32), axis=0, keepdims=True)
        return accs

    zero = jnp.zeros((fit.rows, bn), F32)
    accs = jax.lax.fori_loop(0, columns // bk, step, (zero,) * fit.group)
    for c, acc in enumerate(accs):
        dx_ref[:, pl.ds(c * bn, bn)] = acc.astype(dx_ref.dtype)


def _gradient_call(dq, dk, dv, w3, *, fit: Tiling, out_dtype, precision, interpret):
    (rows, columns), width = dq.shape, w3.shape[0]
    bm, cols = fit.rows, fit.cols * fit.group
    # Axis 0, launched fastest: E's column groups (one at vit-cifar's E); axis 1: row
    # blocks. A program reads its row block of dq, dk, dv once.
    grid = (width // cols, rows // bm)
    d_map, dx_map, db_map = (lambda j, i: (i, 0)), (lambda j, i: (i, j)), (lambda j, i: (i, 0))
    size = jnp.dtype(dq.dtype).itemsize
    nbytes = grid_bytes(
        grid, [(block_bytes((bm, columns), size), d_map)] * 3
        + [(block_bytes((cols, columns), size), lambda j, i, t=t: (j, t, 0)) for t in THIRDS],
        [(block_bytes((bm, cols), jnp.dtype(out_dtype).itemsize), dx_map),
         (block_bytes((1, 3 * columns), 4), db_map)])
    d = pl.BlockSpec((bm, columns), d_map)
    w_specs = [pl.BlockSpec((cols, pl.squeezed, columns), lambda j, i, t=t: (j, t, 0))
               for t in THIRDS]
    dx, db = pl.pallas_call(
        functools.partial(_gradient_kernel, fit=fit, precision=precision),
        grid=grid,
        in_specs=[d, d, d, *w_specs],
        out_specs=[pl.BlockSpec((bm, cols), dx_map), pl.BlockSpec((1, 3 * columns), db_map)],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(dq).mat)
                   for shape, dtype in (((rows, width), out_dtype),
                                        ((grid[1], 3 * columns), F32))],
        compiler_params=_params(fit),
        interpret=interpret,
        name="qkv_input_gradient",
        metadata={"flops": str(2 * rows * width * 3 * columns), "bytes": str(nbytes)},
    )(dq, dk, dv, w3, w3, w3)
    return dx, db.sum(axis=0)  # the row blocks' column sums added up


def _gradient_whole(dq, dk, dv, w3, *, out_dtype, precision):
    """The kernel's arithmetic on whole arrays, in XLA: what a CPU runs."""
    d = jnp.concatenate([dq, dk, dv], axis=1)
    w = w3.reshape(w3.shape[0], -1)
    dx = jax.lax.dot_general(d, w, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=F32)
    return dx.astype(out_dtype), jnp.sum(d.astype(F32), axis=0)
