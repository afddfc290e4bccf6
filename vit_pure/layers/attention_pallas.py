"""Attention for short sequences as a Pallas kernel for Mosaic GPU, forward and backward.

    ctx = attention_pallas(qkv, head_dim)                  # (B, T, 3*Hl*D) -> (B, T, Hl*D)
    ctx = attention_pallas(qkv, head_dim, interpret=True)  # the same kernel on the CPU

The function of `attention.attention_einsum` (softmax(q k^T / sqrt(D)) v per head, no
mask, no dropout) for the token counts a ViT has, written for the sequence that fits on
chip whole: one program holds a (batch, head) pair's q, k and v, its scores and
probabilities, and walks `PAIRS_PER_PROGRAM` pairs of one head. It reads the projection's
output as it is, token-major and unpadded, and pads on chip only; the backward recomputes
the probabilities from the saved log-sum-exp and writes dq, dk, dv once, in the compute
dtype. The design in detail: the comment below the imports.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# JAX exports the Mosaic GPU interpreter's parameters under no public name yet.
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from vit_pure.errors import UsageError
from vit_pure.layers.linear import varying_like

F32 = jnp.float32
MAX_TOKENS = 256  # one pair's (Tp, Tp) scores on chip
# On the GPU one warpgroup holds a pair's (Tp, Tp) float32 scores in registers (128 x 128:
# 128 registers a thread) and the backward's tiles fit shared memory up to Tp = 128; past
# that the rows must be split over warpgroups (not written yet).
MAX_TOKENS_GPU = 128
# An H100's shared memory for one block (what Mosaic GPU checks a kernel against), less an
# allowance for the barriers and the tiles' alignment.
SHARED_MEMORY = 232_448 - 4096
ROW_MULTIPLE = 64  # a warpgroup's wgmma rows: the on-chip token padding
PAIRS_PER_PROGRAM = 4  # (batch, head) pairs one program walks (same head, 4 examples)

# Layout. The kernel reads the q, k, v projection's output as it is, (B, T, 3, Hl, D)
# token-major and unpadded (q, k, v from one buffer, no head transpose, no pad copy), seen
# as (B*T, 3, Hl, D): each pair's three (T, D) tiles are strided copies (TMA) into
# shared-memory tiles of Tp = T rounded up to `ROW_MULTIPLE` rows, zeroed once per program:
# the padding lives on chip only. A copy is T rounded up to 8 rows (the swizzled tiles' row
# granularity), so rows T.. of a tile may hold the next example's first rows (`_load`). The
# padded keys are masked (-inf, zero weight); the padded query rows are computed and never
# written, and the backward zeroes them before they could reach dk and dv. The context is
# written back exactly T rows a pair, (B, T, Hl, D), which reshapes for free into the
# output projection's (B*T, Hl*D) input.
#
# Forward, per pair: s = q k^T (float32 accumulation) scaled by 1/sqrt(D) in float32, the
# row maximum m, p = exp(s - m), l = sum(p); ctx = (p in the compute dtype) v / l, rounded
# to the compute dtype; the log-sum-exp m + log(l) (float32, (B, Hl, Tp)) is the one
# residual beyond q, k, v.
#
# Backward, per pair, one kernel: the scores again from q and k, p = exp(s - lse) (the
# probabilities, normalised, without a second softmax), dp = do v^T, the softmax's gradient
# ds = p * (dp - rowsum(p * dp)) (the row sum from the (Tp, Tp) tiles on chip, so the
# forward's output is not read again), then dv = p^T do, dq = ds k / sqrt(D), dk = ds^T q /
# sqrt(D): each written once, in the compute dtype, into one (B, T, 3, Hl, D) array laid out
# as the projection's output (its gradient goes straight into the projection's backward
# GEMMs). No float32 workspace in memory and no helper kernels.
#
# Precision against the einsum path: both products accumulate in float32; the scores stay
# float32 (the einsum path rounds them to `policy.matmul_dtype` first), the probabilities
# are rounded to the compute dtype before the second product, as there. So under bf16 the
# kernel is at least as close to a float32 reference as the einsum path
# (tests/test_attention_pallas.py measures both).
#
# The matrix products (`_mma`) are the one part that differs between the GPU and
# `interpret=True`: on the GPU, `plgpu.wgmma` on shared-memory tiles (a transposed operand as
# `plgpu.transpose_ref`, no copy); interpreted, a `lax.dot_general` of the same tiles read
# into values, because JAX's Mosaic GPU interpreter does not take a transposed wgmma
# operand (docs/performance.md, "A Pallas attention kernel"). Everything else (the copies,
# barriers, masks, softmax, the stores) is the same code in both modes.


def padded_tokens(tokens: int) -> int:
    """The rows of a pair's tiles on chip: T rounded up to `ROW_MULTIPLE` (65 -> 128)."""
    return -(-tokens // ROW_MULTIPLE) * ROW_MULTIPLE


def check_shape(tokens: int, head_dim: int, dtype, interpret: bool = False) -> None:
    """Raise ValueError (one line) for what the kernel does not take. On the GPU the
    wgmma instruction takes 16-bit inputs (float32 would run as TF32, not the einsum
    path's float32) and a contraction (the head dim, for q k^T) in steps of 16 elements;
    interpreted, any float dtype and head dim run."""
    limit = MAX_TOKENS if interpret else MAX_TOKENS_GPU
    if not 1 <= tokens <= limit:
        raise ValueError(f"pallas attention {'interpreted ' if interpret else 'on the GPU '}"
                         f"takes 1 to {limit} tokens, got {tokens}")
    dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if interpret:
        dtypes += (jnp.dtype(F32),)
    if jnp.dtype(dtype) not in dtypes:
        raise ValueError(f"pallas attention {'interpreted ' if interpret else 'on the GPU '}"
                         f"takes {', '.join(d.name for d in dtypes)}, got {jnp.dtype(dtype)}")
    if not interpret and head_dim % 16:
        raise ValueError(f"pallas attention on the GPU takes a head dim that is a multiple "
                         f"of 16, got {head_dim}")
    need = backward_shared_memory(tokens, head_dim, dtype)
    if not interpret and need > SHARED_MEMORY:
        raise ValueError(f"pallas attention on the GPU: {tokens} tokens of head dim "
                         f"{head_dim} need {need:,} bytes of shared memory in the backward, "
                         f"over {SHARED_MEMORY:,}")


def backward_shared_memory(tokens: int, head_dim: int, dtype) -> int:
    """The backward kernel's shared-memory tiles in bytes (the larger kernel's): q, k, v,
    dctx and the three outputs (Tp, D), p and ds (Tp, Tp), the log-sum-exp (Tp,)."""
    tp = padded_tokens(tokens)
    return (7 * tp * head_dim + 2 * tp * tp) * jnp.dtype(dtype).itemsize + 4 * tp


def attention_pallas(qkv, head_dim: int, interpret: bool = False):
    """qkv (B, T, 3*Hl*D) in the compute dtype, q, k, v in that order and each head's D
    entries together (the q, k, v projection's layout, as `attention_einsum` reads it) ->
    the context (B, T, Hl*D) in the compute dtype. `interpret`: run the kernels in JAX's
    Mosaic GPU interpreter (on the CPU) instead of compiling them for a GPU."""
    B, T, width = qkv.shape
    check_shape(T, head_dim, qkv.dtype, interpret)
    devices = jax.sharding.get_abstract_mesh().size  # inside shard_map / pmap: the mesh's
    if interpret and devices > 1:
        # JAX's interpreter simulates one GPU's memory for the whole process: with 2 fake
        # devices it fails ("Barrier remains allocated"), with 8 it blocked
        raise UsageError(f"--attention pallas-interpret runs on one device (JAX's Mosaic GPU "
                         f"interpreter), not {devices}: give --cpu-devices 1")
    heads = width // (3 * head_dim)
    ctx = _attention(qkv.reshape(B, T, 3, heads, head_dim), interpret)  # (B, T, Hl, D)
    return ctx.reshape(B, T, heads * head_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _attention(qkv, interpret):
    return _forward(qkv, interpret)[0]


# Inside shard_map a kernel's outputs come back typed as the same on every device of the
# mesh axes (Pallas calls run without the varying-axis check); each device's output is its
# own, so `_forward` and `_backward` mark them varying like the input (`varying_like`;
# inside these rules, no transpose of the cast is ever taken).
def _attention_fwd(qkv, interpret):
    ctx, lse = _forward(qkv, interpret)
    return ctx, (qkv, lse)


def _attention_bwd(interpret, residuals, dctx):
    qkv, lse = residuals
    return (_backward(qkv, lse, dctx.astype(qkv.dtype), interpret),)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ------------------------------------------------------------------------- kernel pieces
def _mma(a, b, *, transpose_a=False, transpose_b=False, interpret: bool):
    """a @ b (with a or b transposed) in float32: a (M, K) and b (K, N) shared-memory
    tiles (as stored: (K, M) for transpose_a, (N, K) for transpose_b), or a an array in
    registers (16-bit, untransposed). On the GPU one wgmma, the transposes read through
    the tile's descriptor; interpreted, a dot of the tiles' contents (see the module
    docstring)."""
    if interpret:
        x, y = (a if isinstance(a, jax.Array) else a[...]), b[...]
        dims = (((0,) if transpose_a else (1,)), ((1,) if transpose_b else (0,)))
        return lax.dot_general(x, y, (dims, ((), ())), preferred_element_type=F32)
    a = plgpu.transpose_ref(a, (1, 0)) if transpose_a else a
    b = plgpu.transpose_ref(b, (1, 0)) if transpose_b else b
    shape = (a.shape[0], b.shape[1])

    def product(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(product, plgpu.ACC(shape, F32))


def _pairs(batch, body):
    """Run body(b) for this program's examples b (`PAIRS_PER_PROGRAM` of them, fewer in
    the last program when the batch does not divide), for the program's head."""
    first = lax.axis_index("group") * PAIRS_PER_PROGRAM

    @pl.loop(0, PAIRS_PER_PROGRAM)
    def _(i):
        b = first + i

        @pl.when(b < batch)
        def _():
            body(b)


def _load(refs, tiles, barriers, b, tokens: int):
    """Copy example b's rows of each gmem (B*T, D) view into its shared-memory tile, then
    wait for all of them. The copy is T rounded up to 8 rows (the swizzled tiles' row
    granularity): rows T.. of it are the next example's first rows, or zeros past the
    array's end (the copy engine fills them); the rows after stay as zeroed. The kernels
    mask or drop every padded row (see `_scores`, `_backward`)."""
    rows = -(-tokens // 8) * 8
    for i, (ref, tile) in enumerate(zip(refs, tiles)):
        plgpu.copy_gmem_to_smem(ref.at[pl.ds(b * tokens, rows)], tile.at[pl.ds(0, rows)],
                                barriers.at[i])
    for i in range(len(refs)):
        plgpu.barrier_wait(barriers.at[i])


def _store(values, tiles, refs, b, tokens: int):
    """Write each (Tp, D) value's first T rows to example b's rows of its gmem (B*T, D)
    view, through its (unswizzled) shared-memory tile: exactly T rows, nothing of the
    next example's. Returns when the tiles may be written again."""
    for value, tile in zip(values, tiles):
        tile[...] = value.astype(tile.dtype)
    plgpu.commit_smem()
    for tile, ref in zip(tiles, refs):
        plgpu.copy_smem_to_gmem(tile.at[pl.ds(0, tokens)], ref.at[pl.ds(b * tokens, tokens)])
    plgpu.wait_smem_to_gmem(0)


def _zero(tiles, interpret: bool):
    for tile in tiles:
        tile[...] = _wgmma_layout(jnp.zeros(tile.shape, tile.dtype), interpret)
    plgpu.commit_smem()


def _scores(q_tile, k_tile, tokens: int, interpret: bool):
    """(Tp, Tp) float32 scores q k^T / sqrt(D), the padded keys at -inf."""
    tp, d = q_tile.shape
    s = _mma(q_tile, k_tile, transpose_b=True, interpret=interpret) * (1.0 / math.sqrt(d))
    key = _wgmma_layout(lax.broadcasted_iota(jnp.int32, (tp, tp), 1), interpret)
    return jnp.where(key < tokens, s, -jnp.inf)


def _rows(x, shape):
    """A per-row vector (Tp,) broadcast along the rows' columns to `shape`."""
    return lax.broadcast_in_dim(x, shape, (0,))


def _load_rows(ref, interpret: bool):
    """A (Tp,) float32 vector from shared memory, one entry per score row (on the GPU in
    the layout of the scores' row reductions)."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))


def _wgmma_layout(x, interpret: bool):
    """x in the wgmma accumulator's register layout on the GPU (a hint for Mosaic GPU's
    layout inference); the value itself interpreted."""
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _rows_below(tokens: int, shape, interpret: bool):
    """A (Tp, N) mask of the real query rows."""
    return _wgmma_layout(lax.broadcasted_iota(jnp.int32, shape, 0), interpret) < tokens


def _smem(rows: int, cols: int, head_dim: int, dtype, interpret: bool):
    """A (rows, cols) shared-memory tile. On the GPU an MMA operand's tile is stored
    swizzled in (8, swizzle) tiles, as wgmma's descriptors read it, with one swizzle for
    every operand (wgmma takes two operands of the same swizzle): the widest that divides
    a head-dim row (32 bytes for vit-cifar's 48-entry bf16 rows). Interpreted, plain."""
    if interpret:
        return plgpu.SMEM((rows, cols), dtype)
    bits = jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(head_dim * bits, "an attention tile")
    return plgpu.SMEM((rows, cols), dtype, transforms=(
        plgpu.TilingTransform((8, 8 * swizzle // bits)), plgpu.SwizzleTransform(swizzle)))


def _compiler_params(interpret: bool):
    return None if interpret else plgpu.CompilerParams(approx_math=False)


def _interpret_params(interpret: bool):
    """The interpreter reads past an array's end as zeros, as the GPU's copy engine does
    (`_load`'s last example)."""
    if not interpret:
        return None
    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


def _grid(batch: int, heads: int) -> tuple[int, int]:
    return (-(-batch // PAIRS_PER_PROGRAM), heads)


# ---------------------------------------------------------------------------- forward
def _forward(qkv, interpret: bool):
    """qkv (B, T, 3, Hl, D) -> ctx (B, T, Hl, D) in qkv's dtype, lse (B, Hl, Tp) float32.
    The kernel sees the token axes merged with the batch, (B*T, ...): free reshapes."""
    B, T, _, H, D = qkv.shape
    tp, cd = padded_tokens(T), qkv.dtype

    # The body's name is the kernel's in the compiled program (xla/kernels.py finds it).
    def attention_pallas_forward(qkv_ref, ctx_ref, lse_ref, q_s, k_s, v_s, o_s, lse_s,
                                 barriers):
        h = lax.axis_index("head")
        _zero((q_s, k_s, v_s), interpret)

        def pair(b):
            _load([qkv_ref.at[:, j, h] for j in range(3)], (q_s, k_s, v_s), barriers, b, T)
            s = _scores(q_s, k_s, T, interpret)
            m = s.max(axis=1)
            p = jnp.exp(s - _rows(m, s.shape))
            l_sum = p.sum(axis=1)
            # the probabilities enter the product in the compute dtype, from registers
            o = _mma(p.astype(cd), v_s, interpret=interpret)
            o = o / _rows(l_sum, o.shape)
            lse_s[...] = m + jnp.log(l_sum)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, h])
            _store([o], (o_s,), [ctx_ref.at[:, h]], b, T)

        _pairs(B, pair)

    tile = _smem(tp, D, D, cd, interpret)
    ctx, lse = plgpu.kernel(
        attention_pallas_forward,
        out_type=(jax.ShapeDtypeStruct((B * T, H, D), cd), jax.ShapeDtypeStruct((B, H, tp), F32)),
        scratch_types=[tile, tile, tile, plgpu.SMEM((tp, D), cd),
                       plgpu.SMEM((tp,), F32), plgpu.Barrier(num_barriers=3)],
        grid=_grid(B, H), grid_names=("group", "head"),
        compiler_params=_compiler_params(interpret), interpret=_interpret_params(interpret),
    )(qkv.reshape(B * T, 3, H, D))
    return varying_like(ctx.reshape(B, T, H, D), qkv), varying_like(lse, qkv)


# --------------------------------------------------------------------------- backward
def _backward(qkv, lse, dctx, interpret: bool):
    """qkv (B, T, 3, Hl, D), lse (B, Hl, Tp) float32, dctx (B, T, Hl, D) -> dqkv (B, T, 3,
    Hl, D) in qkv's dtype."""
    B, T, _, H, D = qkv.shape
    tp, cd = padded_tokens(T), qkv.dtype
    scale = 1.0 / math.sqrt(D)

    def attention_pallas_backward(qkv_ref, lse_ref, do_ref, dqkv_ref, q_s, k_s, v_s, do_s,
                                  p_s, ds_s, lse_s, out_s, barriers):
        h = lax.axis_index("head")
        _zero((q_s, k_s, v_s, do_s), interpret)

        def pair(b):
            plgpu.copy_gmem_to_smem(lse_ref.at[b, h], lse_s, barriers.at[4])
            _load([*(qkv_ref.at[:, j, h] for j in range(3)), do_ref.at[:, h]],
                  (q_s, k_s, v_s, do_s), barriers, b, T)
            plgpu.barrier_wait(barriers.at[4])
            s = _scores(q_s, k_s, T, interpret)
            # (Tp, Tp) f32, rows normalised; the padded query rows zero (rows T to T
            # rounded up to 8 hold the next example's q and dctx), so that they add
            # nothing to dv and dk
            real = _rows_below(T, s.shape, interpret)
            p = jnp.where(real, jnp.exp(s - _rows(_load_rows(lse_s, interpret), s.shape)), 0.0)
            p_s[...] = p.astype(cd)
            plgpu.commit_smem()
            dp = _mma(do_s, v_s, transpose_b=True, interpret=interpret)  # (Tp, Tp) f32
            pc = p.astype(cd).astype(F32)  # the probabilities the forward's product used
            ds = jnp.where(real, pc * (dp - _rows((pc * dp).sum(axis=1), dp.shape)), 0.0)
            ds_s[...] = ds.astype(cd)
            plgpu.commit_smem()
            dv = _mma(p_s, do_s, transpose_a=True, interpret=interpret)
            dq = _mma(ds_s, k_s, interpret=interpret) * scale
            dk = _mma(ds_s, q_s, transpose_a=True, interpret=interpret) * scale
            _store([dq, dk, dv], out_s, [dqkv_ref.at[:, j, h] for j in range(3)], b, T)

        _pairs(B, pair)

    tile = _smem(tp, D, D, cd, interpret)
    square = _smem(tp, tp, D, cd, interpret)
    out = plgpu.SMEM((tp, D), cd)
    dqkv = plgpu.kernel(
        attention_pallas_backward,
        out_type=jax.ShapeDtypeStruct((B * T, 3, H, D), cd),
        scratch_types=[tile, tile, tile, tile, square, square, plgpu.SMEM((tp,), F32),
                       (out, out, out), plgpu.Barrier(num_barriers=5)],
        grid=_grid(B, H), grid_names=("group", "head"),
        compiler_params=_compiler_params(interpret), interpret=_interpret_params(interpret),
    )(qkv.reshape(B * T, 3, H, D), lse, dctx.reshape(B * T, H, D))
    return varying_like(dqkv.reshape(B, T, 3, H, D), qkv)


# ------------------------------------------------------------------------------- cost
def attention_cost(batch: int, tokens: int, heads: int, head_dim: int, dtype) -> dict:
    """The kernels' HBM bytes and matrix FLOPs (the MMAs as issued, padded rows included),
    forward and backward, for the predictor and the benchmarks: what they read and write
    once each, nothing more (the design's floor)."""
    tp, e = padded_tokens(tokens), jnp.dtype(dtype).itemsize
    pairs, tile = batch * heads, tokens * head_dim * e
    lse = tp * 4
    fwd_bytes = pairs * (3 * tile + tile + lse)  # q, k, v in; ctx, lse out
    bwd_bytes = pairs * (3 * tile + tile + lse + 3 * tile)  # q, k, v, dctx, lse in; dqkv
    mma = 2 * tp * tp * head_dim  # one (Tp, Tp, D) product
    return {"forward_bytes": fwd_bytes, "backward_bytes": bwd_bytes,
            "forward_flops": pairs * 2 * mma, "backward_flops": pairs * 5 * mma,
            "useful_forward_flops": pairs * 2 * 2 * tokens * tokens * head_dim}
