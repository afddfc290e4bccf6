"""fc2 and the GELU before it as three Pallas (Triton) kernels, forward and backward.

The MLP computes z = gelu(h) @ w, h = fc1's output plus its bias (B*T, M), w = fc2's
kernel (M, E). As XLA:GPU builds it from the reference formulas, each pass writes gelu(h)
or a (B*T, M) gradient that the next kernel reads back:

    forward   fc1's GEMM writes h and gelu(h) (cuBLASLt's BIAS_GELU_AUX epilogue); fc2's
              GEMM reads gelu(h)
    backward  dg = dz @ w.T (cuBLAS: writes dg); dh = dg * gelu'(h) (elementwise: reads
              dg and h, writes dh and gelu(h) again); db = the column sums of dh (reads
              dh again); dw = gelu(h).T @ dz (cuBLAS: reads gelu(h))

Here gelu(h) and dg are never written:

  * `gelu_fc2_forward`: fc2 with the GELU in its prologue. A program owns a block of
    rows and all of E (or as many column blocks of it as its accumulators hold): each
    (BR, BK) tile of h is put through the GELU in float32 once, as it is loaded, rounded
    to w's dtype for the tensor cores (as cuBLASLt's epilogue rounds its output) and
    multiplied into every column block's accumulator; fc1 then writes h alone (its bias
    in its GEMM's epilogue).
  * `gelu_fc2_backward`: for a (BR, BM) tile, dz @ w.T accumulated over E in float32 on
    the tensor cores, multiplied by gelu'(h) in registers; writes dh and the tile's
    column sums of dh (float32, one row per row block; the caller adds those up).
  * `gelu_fc2_weight_gradient`: gelu(h).T @ dz; a program owns BM hidden units and all
    of E, so each tile of h goes through the GELU once; the sum over rows is split into
    row ranges (float32 partial sums, added up by the caller) so that the (M, E)
    output's few tiles keep the GPU busy.

Every K loop is a `lax.fori_loop`, which Triton software-pipelines (`num_stages`); the
tiles come from a table per kernel and shape (`forward_tiling`, `backward_tiling`,
`weight_tiling`); the grids launch the column blocks fastest (grid axis 0), so the
programs running together share the row block of h or dz they read
(vit_pure/pallas/common.py).

For vit-cifar at batch 4096 on the deviceless H100 that is 3.3 GB less HBM traffic a
block than XLA's kernels (docs/performance.md). The arithmetic is the reference's with
one rounding fewer in the backward (dg stays in float32; the reference rounds it to the
matmul dtype first). No collective: under tensor parallelism each device holds M / model
hidden units of h and w, and every sum here runs over rows, over E or over its own
hidden units.

The kernels are lowered by Pallas to Triton, which XLA:GPU compiles for NVIDIA GPUs (a
deviceless compile included). A program lowered for a CPU runs the same arithmetic on
whole arrays in XLA instead (`lax.platform_dependent`); `interpret=True` runs the kernels
themselves with Pallas's interpreter on any backend: how the tests check their tiling on
a CPU (outside shard_map only: inside, the interpreter checks the kernel's constants
against the blocks' mesh axes and refuses).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from vit_pure.pallas.common import (
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
GELU_C = math.sqrt(2.0 / math.pi)  # the tanh form: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
SPLITS = (16, 8, 4, 2, 1)  # row ranges the weight gradient's sum is split into, at most
ROWS = (64, 32, 16)        # a program's rows where it owns all of E (its accumulators)
STEPS = (64, 32, 16)       # a K loop's step


def gelu_and_slope(x):
    """GELU (tanh form, as `jax.nn.gelu`) of float32 x and its derivative."""
    t = jnp.tanh(GELU_C * (x + 0.044715 * x * x * x))
    gelu = 0.5 * x * (1 + t)
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * GELU_C * (1 + 3 * 0.044715 * x * x)
    return gelu, slope


def exact_gelu_and_slope(x):
    """GELU (exact form, x * Phi(x) with erf, as `jax.nn.gelu(x, approximate=False)`) of
    float32 x and its derivative Phi(x) + x * phi(x). The kernels here use the tanh form;
    layers/mlp.py runs the exact one through XLA."""
    cdf = 0.5 * (1 + jax.lax.erf(x * (1 / math.sqrt(2.0))))
    pdf = jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return x * cdf, cdf + x * pdf


def _gelu(h, dtype):
    """gelu(h) in float32, rounded to `dtype`: what the forward and weight-gradient kernels
    feed the tensor cores."""
    return gelu_and_slope(h.astype(F32))[0].astype(dtype)


# ---------------------------------------------------------------------------- tile table
def forward_tiling(rows: int, hidden: int, width: int, itemsize: int = 2) -> Tiling | None:
    """Rows a program owns, the step over M, E's column block and how many of them a
    program owns (all of E where its accumulators fit: the GELU once per element)."""
    br, bk, bn = block(rows, ROWS), block(hidden, STEPS), block(width)
    if None in (br, bk, bn):
        return None
    group = group_of(br, bn, width // bn)
    if not fits_grid(rows // br):
        return None
    return launch(br, bk, bn, group, (br * bk + bk * bn * group) * itemsize)


def backward_tiling(rows: int, hidden: int, width: int, itemsize: int = 2) -> Tiling | None:
    """A (BR, BM) tile of dh a program, the step over E."""
    br, bm, bk = block(rows), block(hidden), block(width, STEPS)
    if None in (br, bm, bk) or not fits_grid(rows // br):
        return None
    return launch(br, bk, bm, 1, (br * bk + bm * bk) * itemsize)


def weight_tiling(rows: int, hidden: int, width: int, itemsize: int = 2) -> Tiling | None:
    """BM hidden units a program (its rows of dw), the step over the rows, E's column block
    and how many of them a program owns."""
    bm, bk, bn = block(hidden, ROWS), block(rows, STEPS), block(width)
    if None in (bm, bk, bn):
        return None
    group = group_of(bm, bn, width // bn)
    return launch(bm, bk, bn, group, (bk * bm + bk * bn * group) * itemsize)


def tiles(rows: int, hidden: int, width: int, itemsize: int = 2):
    """The three kernels' tilings for h (rows, hidden) and w (hidden, width), or None when
    one of them fits no tiling exactly (the caller then runs the reference path)."""
    fit = (forward_tiling(rows, hidden, width, itemsize),
           backward_tiling(rows, hidden, width, itemsize),
           weight_tiling(rows, hidden, width, itemsize))
    return None if None in fit else fit


def _check(h, w, dz_or_none, who, tiling):
    rows, hidden = h.shape
    width = w.shape[1]
    if (w.shape[0] != hidden or h.dtype != w.dtype
            or (dz_or_none is not None and (dz_or_none.shape != (rows, width)
                                            or dz_or_none.dtype != w.dtype))):
        raise ValueError(f"{who}: h {h.shape} {h.dtype}, w {w.shape} {w.dtype}"
                         + ("" if dz_or_none is None else
                            f", dz {dz_or_none.shape} {dz_or_none.dtype}")
                         + " do not fit h (rows, M), w (M, E), dz (rows, E), one dtype")
    fit = tiling(rows, hidden, width, jnp.dtype(h.dtype).itemsize)
    if fit is None:
        raise ValueError(f"{who}: no tiling fits rows {rows}, M {hidden}, E {width} (`tiles`)")
    return fit


def _params(fit: Tiling):
    return pl_triton.CompilerParams(num_warps=fit.num_warps, num_stages=fit.num_stages)


def _metadata(flops: int, nbytes: int) -> dict:
    """Read back from the compiled program by vit_pure/xla/kernels.py: Triton's IR in the
    HLO is opaque, so each kernel states its matmul FLOPs and its HBM bytes as its grid
    moves them (vit_pure/pallas/traffic.py)."""
    return {"flops": str(flops), "bytes": str(nbytes)}


# ---------------------------------------------------------------------------- forward
def gelu_fc2_forward(h, w, out_dtype, *, precision=None, interpret: bool = False):
    """z = gelu(h) @ w, (rows, E) in `out_dtype`, from h (rows, M) and w (M, E) of one
    dtype: gelu(h) in float32 rounded to that dtype, the product accumulated in float32.
    precision: the matmul's (`lax.Precision`, as the policy's; None is the default: TF32
    for float32 inputs on a GPU, as XLA's GEMMs). interpret: True runs the kernel with
    Pallas's interpreter, on any backend (for tests); False (the default) decides where
    the program is lowered: Triton on a GPU, on a CPU the same arithmetic on whole arrays
    in XLA. Shapes must fit `forward_tiling` (ValueError otherwise)."""
    fit = _check(h, w, None, "gelu_fc2_forward", forward_tiling)
    kernel = functools.partial(_forward_call, fit=fit, out_dtype=out_dtype,
                               precision=precision)
    whole = functools.partial(_forward_whole, out_dtype=out_dtype, precision=precision)
    return dispatch("gelu_fc2_forward", kernel, whole, vary_alike(h, w), interpret)


def _forward_kernel(h_ref, w_ref, z_ref, *, fit: Tiling, precision):
    """A (BR, BN * group) block of z: h_ref (BR, M), w_ref (M, BN * group) in. Each
    (BR, BK) tile of h goes through the GELU once and into every column block."""
    bk, bn = fit.step, fit.cols

    def step(k, accs):
        units = pl.ds(pl.multiple_of(k * bk, bk), bk)
        g = _gelu(h_ref[:, units], w_ref.dtype)
        return tuple(acc + mm(g, w_ref[units, pl.ds(c * bn, bn)], precision=precision)
                     for c, acc in enumerate(accs))

    zero = jnp.zeros((fit.rows, bn), F32)
    accs = jax.lax.fori_loop(0, h_ref.shape[1] // bk, step, (zero,) * fit.group)
    for c, acc in enumerate(accs):
        z_ref[:, pl.ds(c * bn, bn)] = acc.astype(z_ref.dtype)


def _forward_call(h, w, *, fit: Tiling, out_dtype, precision, interpret):
    (rows, hidden), width = h.shape, w.shape[1]
    br, cols = fit.rows, fit.cols * fit.group
    # Axis 0, launched fastest: E's column groups (one at vit-cifar's E); axis 1: row
    # blocks. A wave's programs read consecutive row blocks of h, each once.
    grid = (width // cols, rows // br)
    h_map, w_map, z_map = (lambda j, i: (i, 0)), (lambda j, i: (0, j)), (lambda j, i: (i, j))
    size = jnp.dtype(h.dtype).itemsize
    nbytes = grid_bytes(grid, [(block_bytes((br, hidden), size), h_map),
                               (block_bytes((hidden, cols), size), w_map)],
                        [(block_bytes((br, cols), jnp.dtype(out_dtype).itemsize), z_map)])
    return pl.pallas_call(
        functools.partial(_forward_kernel, fit=fit, precision=precision),
        grid=grid,
        in_specs=[pl.BlockSpec((br, hidden), h_map), pl.BlockSpec((hidden, cols), w_map)],
        out_specs=pl.BlockSpec((br, cols), z_map),
        # Inside shard_map the output varies over the mesh axes h varies over.
        out_shape=jax.ShapeDtypeStruct((rows, width), out_dtype,
                                       manual_axis_type=jax.typeof(h).mat),
        compiler_params=_params(fit),
        interpret=interpret,
        name="gelu_fc2_forward",
        metadata=_metadata(2 * rows * hidden * width, nbytes),
    )(h, w)


def _forward_whole(h, w, *, out_dtype, precision):
    """The forward kernel's arithmetic on whole arrays, in XLA: what a CPU runs."""
    return jnp.dot(_gelu(h, w.dtype), w, precision=precision,
                   preferred_element_type=F32).astype(out_dtype)


# ---------------------------------------------------------------------------- input gradient
def gelu_fc2_backward(dz, w, h, *, precision=None, interpret: bool = False):
    """For z = gelu(h) @ w: (dh, dbias) from dz (rows, E), w (M, E) and h (rows, M).

    dh: the gradient at h (h's dtype), dz @ w.T times gelu'(h), the product kept in
    float32 until then; dbias: the column sums of dh (float32, (M,)), the gradient of a
    bias added to make h. precision, interpret: as `gelu_fc2_forward`. Shapes must fit
    `backward_tiling` (ValueError otherwise)."""
    fit = _check(h, w, dz, "gelu_fc2_backward", backward_tiling)
    kernel = functools.partial(_backward_call, fit=fit, precision=precision)
    whole = functools.partial(_backward_whole, precision=precision)
    return dispatch("gelu_fc2_backward", kernel, whole, vary_alike(dz, w, h), interpret)


def _backward_epilogue(dg, h):
    """From dg = dz @ w.T (float32) and h, a tile or the whole array: dh (h's dtype) and
    dh's column sums (float32, (1, n))."""
    dh = (dg * gelu_and_slope(h.astype(F32))[1]).astype(h.dtype)
    return dh, jnp.sum(dh.astype(F32), axis=0, keepdims=True)


def _backward_kernel(dz_ref, w_ref, h_ref, dh_ref, dbias_ref, *, fit: Tiling, precision):
    """One (BR, BM) tile: dz_ref (BR, E), w_ref (BM, E), h_ref (BR, BM) in;
    dh_ref (BR, BM), dbias_ref (1, BM) float32 out."""
    bk = fit.step

    def step(k, acc):  # the k-th BK columns of the contraction over E
        cols = pl.ds(pl.multiple_of(k * bk, bk), bk)
        return acc + mm(dz_ref[:, cols], w_ref[:, cols], trans_b=True, precision=precision)

    dg = jax.lax.fori_loop(0, dz_ref.shape[1] // bk, step, jnp.zeros(dh_ref.shape, F32))
    dh_ref[...], dbias_ref[...] = _backward_epilogue(dg, h_ref[...])


def _backward_call(dz, w, h, *, fit: Tiling, precision, interpret):
    (rows, width), hidden = dz.shape, h.shape[1]
    br, bm = fit.rows, fit.cols
    # Axis 0, launched fastest: the hidden units' blocks; axis 1: row blocks. A wave's
    # programs share a row block of dz (read from HBM once a wave, then from L2).
    grid = (hidden // bm, rows // br)
    dz_map, w_map, tile_map = (lambda j, i: (i, 0)), (lambda j, i: (j, 0)), (lambda j, i: (i, j))
    size = jnp.dtype(h.dtype).itemsize
    nbytes = grid_bytes(grid, [(block_bytes((br, width), size), dz_map),
                               (block_bytes((bm, width), size), w_map),
                               (block_bytes((br, bm), size), tile_map)],
                        [(block_bytes((br, bm), size), tile_map),
                         (block_bytes((1, bm), 4), tile_map)])
    dh, dbias = pl.pallas_call(
        functools.partial(_backward_kernel, fit=fit, precision=precision),
        grid=grid,
        in_specs=[pl.BlockSpec((br, width), dz_map), pl.BlockSpec((bm, width), w_map),
                  pl.BlockSpec((br, bm), tile_map)],
        out_specs=[pl.BlockSpec((br, bm), tile_map), pl.BlockSpec((1, bm), tile_map)],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(h).mat)
                   for shape, dtype in ((h.shape, h.dtype), ((grid[1], hidden), F32))],
        compiler_params=_params(fit),
        interpret=interpret,
        name="gelu_fc2_backward",
        metadata=_metadata(2 * rows * hidden * width, nbytes),
    )(dz, w, h)
    return dh, dbias.sum(axis=0)  # the row blocks' column sums added up


def _backward_whole(dz, w, h, *, precision):
    """The input-gradient kernel's arithmetic on whole arrays, in XLA: what a CPU runs."""
    dg = jnp.dot(dz, w.T, precision=precision, preferred_element_type=F32)
    dh, dbias = _backward_epilogue(dg, h)
    return dh, dbias[0]


# ---------------------------------------------------------------------------- weight gradient
def splits(rows: int, step: int) -> int:
    """How many row ranges `gelu_fc2_weight_gradient` sums separately: the most of `SPLITS`
    that cuts the rows into whole `step`-row tiles."""
    return next(s for s in SPLITS if rows % (s * step) == 0)


def gelu_fc2_weight_gradient(h, dz, out_dtype, *, precision=None, interpret: bool = False):
    """For z = gelu(h) @ w: dw = gelu(h).T @ dz, (M, E) in `out_dtype`, from h (rows, M)
    and dz (rows, E) of one dtype; gelu(h) in float32 rounded to that dtype, the sum over
    rows in float32. precision, interpret: as `gelu_fc2_forward`. Shapes must fit
    `weight_tiling` (ValueError otherwise)."""
    w_like = jax.ShapeDtypeStruct((h.shape[1], dz.shape[1]), dz.dtype)
    fit = _check(h, w_like, dz, "gelu_fc2_weight_gradient", weight_tiling)
    kernel = functools.partial(_weight_call, fit=fit, out_dtype=out_dtype,
                               precision=precision)
    whole = functools.partial(_weight_whole, out_dtype=out_dtype, precision=precision)
    return dispatch("gelu_fc2_weight_gradient", kernel, whole, vary_alike(h, dz), interpret)


def _weight_kernel(h_ref, dz_ref, dw_ref, *, fit: Tiling, precision):
    """One row range's (BM, BN * group) block of dw: h_ref (R, BM), dz_ref (R, BN * group)
    in, R rows of this range; dw_ref float32 out, this range's partial sum. Each (BK, BM)
    tile of h goes through the GELU once and into every column block."""
    bk, bn = fit.step, fit.cols

    def step(k, accs):
        rows = pl.ds(pl.multiple_of(k * bk, bk), bk)
        g = _gelu(h_ref[rows, :], dz_ref.dtype)
        return tuple(acc + mm(g, dz_ref[rows, pl.ds(c * bn, bn)], trans_a=True,
                              precision=precision)
                     for c, acc in enumerate(accs))

    zero = jnp.zeros((fit.rows, bn), F32)
    accs = jax.lax.fori_loop(0, h_ref.shape[0] // bk, step, (zero,) * fit.group)
    for c, acc in enumerate(accs):
        dw_ref[:, pl.ds(c * bn, bn)] = acc


def _weight_call(h, dz, *, fit: Tiling, out_dtype, precision, interpret):
    (rows, hidden), width = h.shape, dz.shape[1]
    bm, cols = fit.rows, fit.cols * fit.group
    n = splits(rows, fit.step)
    # Axis 0, launched fastest: blocks of hidden units; then E's column groups; axis 2:
    # row ranges. A wave's programs share a row range of dz; each reads its own h.
    grid = (hidden // bm, width // cols, n)
    h_map, dz_map = (lambda i, j, s: (s, i)), (lambda i, j, s: (s, j))

    def dw_map(i, j, s):  # range s's partial sums: rows s * M onwards
        return s * grid[0] + i, j
    size = jnp.dtype(h.dtype).itemsize
    nbytes = grid_bytes(grid, [(block_bytes((rows // n, bm), size), h_map),
                               (block_bytes((rows // n, cols), size), dz_map)],
                        [(block_bytes((bm, cols), 4), dw_map)])
    partial = pl.pallas_call(
        functools.partial(_weight_kernel, fit=fit, precision=precision),
        grid=grid,
        in_specs=[pl.BlockSpec((rows // n, bm), h_map), pl.BlockSpec((rows // n, cols), dz_map)],
        out_specs=pl.BlockSpec((bm, cols), dw_map),
        out_shape=jax.ShapeDtypeStruct((n * hidden, width), F32,
                                       manual_axis_type=jax.typeof(h).mat),
        compiler_params=_params(fit),
        interpret=interpret,
        name="gelu_fc2_weight_gradient",
        metadata=_metadata(2 * rows * hidden * width, nbytes),
    )(h, dz)
    return partial.reshape(n, hidden, width).sum(axis=0).astype(out_dtype)


def _weight_whole(h, dz, *, out_dtype, precision):
    """The weight-gradient kernel's arithmetic on whole arrays, in XLA: what a CPU runs."""
    return jnp.dot(_gelu(h, dz.dtype).T, dz, precision=precision,
                   preferred_element_type=F32).astype(out_dtype)
