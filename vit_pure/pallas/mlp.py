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

  * `gelu_fc2_forward`: fc2 with the GELU in its prologue. Each (BM, BK) tile of h is put
    through the GELU in float32 as it is loaded, rounded to w's dtype for the tensor
    cores (as cuBLASLt's epilogue rounds its output) and multiplied in; fc1 then writes
    h alone (its bias in its GEMM's epilogue).
  * `gelu_fc2_backward`: for a (BM, BN) tile, dz @ w.T accumulated over E in float32 on
    the tensor cores, multiplied by gelu'(h) in registers; writes dh and the tile's
    column sums of dh (float32, one row per row block; the caller adds those up).
  * `gelu_fc2_weight_gradient`: gelu(h).T @ dz, the GELU recomputed from each tile of h
    as it is loaded; the sum over rows is split into row ranges (float32 partial sums,
    added up by the caller) so that the (M, E) output's few tiles keep the GPU busy.

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

from vit_pure.pallas.common import block, dispatch, vary_alike

F32 = jnp.float32
GELU_C = math.sqrt(2.0 / math.pi)  # the tanh form: 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
SPLITS = (16, 8, 4, 2, 1)  # row ranges the weight gradient's sum is split into, at most


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


def tiles(rows: int, hidden: int, width: int) -> tuple[int, int, int] | None:
    """(BR, BM, BE) for h (rows, hidden) and w (hidden, width): the tiles of the rows, the
    hidden units and E that every kernel here uses; None when none fits those sizes
    exactly (the caller then runs the reference path)."""
    fit = block(rows), block(hidden), block(width)
    return None if None in fit else fit


def _check(h, w, dz_or_none, who):
    rows, hidden = h.shape
    width = w.shape[1]
    if (w.shape[0] != hidden or h.dtype != w.dtype
            or (dz_or_none is not None and (dz_or_none.shape != (rows, width)
                                            or dz_or_none.dtype != w.dtype))):
        raise ValueError(f"{who}: h {h.shape} {h.dtype}, w {w.shape} {w.dtype}"
                         + ("" if dz_or_none is None else
                            f", dz {dz_or_none.shape} {dz_or_none.dtype}")
                         + " do not fit h (rows, M), w (M, E), dz (rows, E), one dtype")
    fit = tiles(rows, hidden, width)
    if fit is None:
        raise ValueError(f"{who}: no tiling fits rows {rows}, M {hidden}, E {width} (`tiles`)")
    return fit


# ---------------------------------------------------------------------------- forward
def gelu_fc2_forward(h, w, out_dtype, *, precision=None, interpret: bool = False):
    """z = gelu(h) @ w, (rows, E) in `out_dtype`, from h (rows, M) and w (M, E) of one
    dtype: gelu(h) in float32 rounded to that dtype, the product accumulated in float32.
    precision: the matmul's (`lax.Precision`, as the policy's; None is the default: TF32
    for float32 inputs on a GPU, as XLA's GEMMs). interpret: True runs the kernel with
    Pallas's interpreter, on any backend (for tests); False (the default) decides where
    the program is lowered: Triton on a GPU, on a CPU the same arithmetic on whole arrays
    in XLA. Shapes must fit `tiles` (ValueError otherwise)."""
    fit = _check(h, w, None, "gelu_fc2_forward")
    kernel = functools.partial(_forward_call, tiling=fit, out_dtype=out_dtype,
                               precision=precision)
    whole = functools.partial(_forward_whole, out_dtype=out_dtype, precision=precision)
    return dispatch(kernel, whole, vary_alike(h, w), interpret)


def _forward_kernel(h_ref, w_ref, z_ref, *, bm: int, precision):
    """One (BR, BE) tile of z: h_ref (BR, M), w_ref (M, BE) in, z_ref (BR, BE) out."""
    def step(k, acc):
        units = pl.ds(pl.multiple_of(k * bm, bm), bm)
        return acc + pl_triton.dot(_gelu(h_ref[:, units], w_ref.dtype), w_ref[units, :],
                                   precision=precision)

    acc = jax.lax.fori_loop(0, h_ref.shape[1] // bm, step, jnp.zeros(z_ref.shape, F32))
    z_ref[...] = acc.astype(z_ref.dtype)


def _forward_call(h, w, *, tiling, out_dtype, precision, interpret):
    (rows, hidden), width = h.shape, w.shape[1]
    br, bm, be = tiling
    return pl.pallas_call(
        functools.partial(_forward_kernel, bm=bm, precision=precision),
        grid=(rows // br, width // be),  # row blocks outer: a row block of h stays in L2
        in_specs=[pl.BlockSpec((br, hidden), lambda i, j: (i, 0)),
                  pl.BlockSpec((hidden, be), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((br, be), lambda i, j: (i, j)),
        # Inside shard_map the output varies over the mesh axes h varies over.
        out_shape=jax.ShapeDtypeStruct((rows, width), out_dtype,
                                       manual_axis_type=jax.typeof(h).mat),
        compiler_params=pl_triton.CompilerParams(num_warps=8, num_stages=3),
        interpret=interpret,
        name="gelu_fc2_forward",
        # Read back from the compiled program by vit_pure/xla/kernels.py: Triton's IR in
        # the HLO is opaque, so each kernel states its matmul FLOPs.
        metadata={"flops": str(2 * rows * hidden * width)},
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
    `tiles` (ValueError otherwise)."""
    fit = _check(h, w, dz, "gelu_fc2_backward")
    kernel = functools.partial(_backward_call, tiling=fit, precision=precision)
    whole = functools.partial(_backward_whole, precision=precision)
    return dispatch(kernel, whole, vary_alike(dz, w, h), interpret)


def _backward_epilogue(dg, h):
    """From dg = dz @ w.T (float32) and h, a tile or the whole array: dh (h's dtype) and
    dh's column sums (float32, (1, n))."""
    dh = (dg * gelu_and_slope(h.astype(F32))[1]).astype(h.dtype)
    return dh, jnp.sum(dh.astype(F32), axis=0, keepdims=True)


def _backward_kernel(dz_ref, w_ref, h_ref, dh_ref, dbias_ref, *, be: int, precision):
    """One (BR, BM) tile: dz_ref (BR, E), w_ref (BM, E), h_ref (BR, BM) in;
    dh_ref (BR, BM), dbias_ref (1, BM) float32 out."""
    def dot(k):  # the k-th BE columns of the contraction over E
        cols = pl.ds(k * be, be)
        return pl_triton.dot(dz_ref[:, cols], w_ref[:, cols], trans_b=True, precision=precision)

    dg = dot(0)
    for k in range(1, dz_ref.shape[1] // be):  # unrolled: E / BE steps
        dg += dot(k)
    dh_ref[...], dbias_ref[...] = _backward_epilogue(dg, h_ref[...])


def _backward_call(dz, w, h, *, tiling, precision, interpret):
    (rows, width), hidden = dz.shape, h.shape[1]
    br, bm, be = tiling
    grid = (rows // br, hidden // bm)  # row blocks outer: a row block's dz stays in L2
    dh, dbias = pl.pallas_call(
        functools.partial(_backward_kernel, be=be, precision=precision),
        grid=grid,
        in_specs=[pl.BlockSpec((br, width), lambda i, j: (i, 0)),
                  pl.BlockSpec((bm, width), lambda i, j: (j, 0)),
                  pl.BlockSpec((br, bm), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((br, bm), lambda i, j: (i, j)),
                   pl.BlockSpec((1, bm), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(h).mat)
                   for shape, dtype in ((h.shape, h.dtype), ((grid[0], hidden), F32))],
        compiler_params=pl_triton.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret,
        name="gelu_fc2_backward",
        metadata={"flops": str(2 * rows * hidden * width)},
    )(dz, w, h)
    return dh, dbias.sum(axis=0)  # the row blocks' column sums added up


def _backward_whole(dz, w, h, *, precision):
    """The input-gradient kernel's arithmetic on whole arrays, in XLA: what a CPU runs."""
    dg = jnp.dot(dz, w.T, precision=precision, preferred_element_type=F32)
    dh, dbias = _backward_epilogue(dg, h)
    return dh, dbias[0]


# ---------------------------------------------------------------------------- weight gradient
def splits(rows: int, br: int) -> int:
    """How many row ranges `gelu_fc2_weight_gradient` sums separately: the most of `SPLITS`
    that cuts the rows into whole BR-row tiles."""
    return next(s for s in SPLITS if rows % (s * br) == 0)


def gelu_fc2_weight_gradient(h, dz, out_dtype, *, precision=None, interpret: bool = False):
    """For z = gelu(h) @ w: dw = gelu(h).T @ dz, (M, E) in `out_dtype`, from h (rows, M)
    and dz (rows, E) of one dtype; gelu(h) in float32 rounded to that dtype, the sum over
    rows in float32. precision, interpret: as `gelu_fc2_forward`. Shapes must fit `tiles`
    (ValueError otherwise)."""
    w_like = jax.ShapeDtypeStruct((h.shape[1], dz.shape[1]), dz.dtype)
    fit = _check(h, w_like, dz, "gelu_fc2_weight_gradient")
    kernel = functools.partial(_weight_call, tiling=fit, out_dtype=out_dtype,
                               precision=precision)
    whole = functools.partial(_weight_whole, out_dtype=out_dtype, precision=precision)
    return dispatch(kernel, whole, vary_alike(h, dz), interpret)


def _weight_kernel(h_ref, dz_ref, dw_ref, *, br: int, precision):
    """One row range's (BM, BE) tile of dw: h_ref (R, BM), dz_ref (R, BE) in, R rows of
    this range; dw_ref (BM, BE) float32 out, this range's partial sum."""
    def step(k, acc):
        rows = pl.ds(pl.multiple_of(k * br, br), br)
        return acc + pl_triton.dot(_gelu(h_ref[rows, :], dz_ref.dtype), dz_ref[rows, :],
                                   trans_a=True, precision=precision)

    dw_ref[...] = jax.lax.fori_loop(0, h_ref.shape[0] // br, step,
                                    jnp.zeros(dw_ref.shape, F32))


def _weight_call(h, dz, *, tiling, out_dtype, precision, interpret):
    (rows, hidden), width = h.shape, dz.shape[1]
    br, bm, be = tiling
    n = splits(rows, br)
    grid = (n, hidden // bm, width // be)  # E innermost: a range's tile of h stays in L2
    partial = pl.pallas_call(
        functools.partial(_weight_kernel, br=br, precision=precision),
        grid=grid,
        in_specs=[pl.BlockSpec((rows // n, bm), lambda s, i, j: (s, i)),
                  pl.BlockSpec((rows // n, be), lambda s, i, j: (s, j))],
        out_specs=pl.BlockSpec((bm, be), lambda s, i, j: (s * grid[1] + i, j)),
        out_shape=jax.ShapeDtypeStruct((n * hidden, width), F32,
                                       manual_axis_type=jax.typeof(h).mat),
        compiler_params=pl_triton.CompilerParams(num_warps=8, num_stages=3),
        interpret=interpret,
        name="gelu_fc2_weight_gradient",
        metadata={"flops": str(2 * rows * hidden * width)},
    )(h, dz)
    return partial.reshape(n, hidden, width).sum(axis=0).astype(out_dtype)


def _weight_whole(h, dz, *, out_dtype, precision):
    """The weight-gradient kernel's arithmetic on whole arrays, in XLA: what a CPU runs."""
    return jnp.dot(_gelu(h, dz.dtype).T, dz, precision=precision,
                   preferred_element_type=F32).astype(out_dtype)
