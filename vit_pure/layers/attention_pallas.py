"""Attention for short sequences as a Pallas kernel for Mosaic GPU, forward and backward.

    ctx = attention_pallas(qkv, head_dim)                  # (B, T, 3*Hl*D) -> (B, T, Hl*D)
    ctx = attention_pallas(qkv, head_dim, interpret=True)  # the same kernel on the CPU

The function of `attention.attention_einsum` (softmax(q k^T / sqrt(D)) v per head, no
mask, no dropout) for the token counts a ViT has, written for the sequence that fits on
chip whole: one program holds a (batch, head) pair's q, k and v, its scores and
probabilities, and walks `PAIRS_PER_PROGRAM` pairs of one head. A ViT's sequence is one
class token and a square number of patches (vit-cifar: 1 + 64): the patches' scores run on
the tensor cores in tiles that fit them exactly, the first token's row and column on the
CUDA cores. It reads the projection's output as it is, unpadded, pads on chip only, and
writes dq, dk, dv once, in the compute dtype. The design: the comment below the imports.
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
MAX_TOKENS = 257  # the first token and 256 rows of the rest: one pair's scores on chip
# On the GPU one warpgroup holds a pair's (Rp, Rp) float32 scores in registers (128 x 128:
# 128 registers a thread) and the backward's tiles fit shared memory up to Rp = 128; past
# that the rows must be split over warpgroups (not written yet).
MAX_TOKENS_GPU = 129
# An H100's shared memory for one block (what Mosaic GPU checks a kernel against), less an
# allowance for the barriers and the tiles' alignment.
SHARED_MEMORY = 232_448 - 4096
ROW_MULTIPLE = 64  # a warpgroup's wgmma rows: the on-chip padding of the rest
PAIRS_PER_PROGRAM = 4  # (batch, head) pairs one program walks (same head, 4 examples)

# Split. Token 0 (a ViT's class token) is set apart from the rest, R = T - 1 tokens (the
# patches), which sit in tiles of Rp = R rounded up to `ROW_MULTIPLE` rows: for vit-cifar
# 64 patch rows, exactly a warpgroup's wgmma tile, where the sequence whole (65) would pad
# to 128 and compute 3.9x the products it needs. The scores are four blocks:
#
#     s_00  s_0R        the first token's query against every key: a (1, R) row
#     s_R0  s_RR        the rest's queries: against token 0's key a (R, 1) column, against
#                       the rest's keys the (Rp, Rp) block, the one product on tensor cores
#
# The row and the column are matrix-vector products on the CUDA cores: elementwise products
# of an (Rp, D) tile with token 0's vector, reduced over D (per row of the tile) or over the
# rows (per entry of D). Attention treats its tokens alike, so the split is exact for any
# sequence; it pays when R is a multiple of 64.
#
# Vectors. On the GPU a tile in registers is laid out as wgmma's accumulator; its row
# reductions give one layout (`ROWS`: an entry per tile row, as the scores' row maxima),
# its column reductions another (`COLS`: an entry per entry of D, as token 0's q, k, v). The
# first query's softmax needs sums and maxima over all keys: taken as column reductions of
# an (Rp, D) array whose row r holds key r's term (row 0 also token 0's own), which gives
# every entry of a `COLS` vector the total; a row reduction of that broadcast gives it back
# as `ROWS`. No scalar ever lives in registers, and the interpreter runs the same code.
#
# Layout. The kernel reads the q, k, v projection's output as it is, (B, T, 3*Hl*D)
# token-major and unpadded (q, k, v from one buffer, no head transpose, no pad copy), seen
# as the matrix (B*T, 3*Hl*D) (`_columns`): array j (q, k, v) of head h is the D columns
# from (j*Hl + h)*D, and each pair's three (R, D) tiles are strided copies (TMA) of such a
# column block into shared-memory tiles of Rp rows, zeroed once per program, and token 0's
# three rows into a small unswizzled tile: the padding lives on chip only. A tile's copy is
# R rounded up to 8 rows (the swizzled tiles' row granularity), so rows R.. of a tile may
# hold the next example's first rows (`_load`). The padded keys are masked (-inf, zero
# weight); the padded query rows are computed and never written, and the backward zeroes
# them before they could reach dk and dv. The context is written back exactly T rows a
# pair into (B*T, Hl*D), the output projection's input as it is. Every array a copy
# touches in memory is such a matrix (the log-sum-exp (B, Hl, Rp), a pair's (1, 1, Rp)
# block) and is only ever sliced, never indexed by an integer: Mosaic GPU's warpgroup
# lowering (`_compiler_params`) rejects a copy whose memory side drops an indexed axis.
# The reshapes to and from these views happen outside the kernels, where they are free.
#
# Forward, per pair: s = q k^T (float32 accumulation) scaled by 1/sqrt(D) in float32, the
# row maximum m, p = exp(s - m), l = sum(p); ctx = (p in the compute dtype) v / l, rounded
# to the compute dtype; the rest's log-sum-exp m + log(l) (float32, (B, Hl, Rp)) is the one
# residual beyond q, k, v (the first query's is recomputed: 2 Rp D products).
#
# Backward, per pair, one kernel: the scores again from q and k, p = exp(s - lse) (the
# probabilities, normalised, without a second softmax), dp = do v^T, the softmax's gradient
# ds = p * (dp - rowsum(p * dp)) (the row sum from the tiles on chip, so the forward's
# output is not read again), then dv = p^T do, dq = ds k / sqrt(D), dk = ds^T q / sqrt(D):
# each written once, in the compute dtype, into one (B*T, 3*Hl*D) array laid out as the
# projection's output (its gradient goes straight into the projection's backward GEMMs).
# No float32 workspace in memory and no helper kernels.
#
# Precision against the einsum path: the products accumulate in float32; the scores stay
# float32 (the einsum path rounds them to `policy.matmul_dtype` first), the probabilities
# and the softmax's gradient are rounded to the compute dtype before the products that
# take them, the tensor cores' and the CUDA cores' alike. So under bf16 the kernel is at
# least as close to a float32 reference as the einsum path (tests/test_attention_pallas.py
# measures both).
#
# The matrix products (`_mma`) are the one part that differs between the GPU and
# `interpret=True`: on the GPU, `plgpu.wgmma` on shared-memory tiles (a transposed operand as
# `plgpu.transpose_ref`, no copy); interpreted, a `lax.dot_general` of the same tiles read
# into values, because JAX's Mosaic GPU interpreter does not take a transposed wgmma
# operand (docs/performance.md, "A Pallas attention kernel"). Everything else (the copies,
# barriers, masks, softmax, the stores) is the same code in both modes.


def padded_rest(tokens: int) -> int:
    """The rows of a pair's tiles on chip: the T - 1 tokens after the first, rounded up to
    `ROW_MULTIPLE` (65 -> 64, 197 -> 256)."""
    return -(-(tokens - 1) // ROW_MULTIPLE) * ROW_MULTIPLE


def check_shape(tokens: int, head_dim: int, dtype, interpret: bool = False) -> None:
    """Raise ValueError (one line) for what the kernel does not take. On the GPU the
    wgmma instruction takes 16-bit inputs (float32 would run as TF32, not the einsum
    path's float32) and a contraction (the head dim, for q k^T) in steps of 16 elements;
    interpreted, any float dtype and head dim run."""
    limit = MAX_TOKENS if interpret else MAX_TOKENS_GPU
    if not 2 <= tokens <= limit:
        raise ValueError(f"pallas attention {'interpreted ' if interpret else 'on the GPU '}"
                         f"takes 2 to {limit} tokens, got {tokens}")
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
    dctx and the three outputs (Rp, D), p and ds (Rp, Rp), token 0's tiles (eight rows of
    each input, `_load`) and its three output rows, the log-sum-exp (Rp,)."""
    rp = padded_rest(tokens)
    return ((7 * rp * head_dim + 2 * rp * rp + (4 * 8 + 3) * head_dim)
            * jnp.dtype(dtype).itemsize + 4 * rp)


def attention_pallas(qkv, head_dim: int, interpret: bool = False):
    """qkv (B, T, 3*Hl*D) in the compute dtype, q, k, v in that order and each head's D
    entries together (the q, k, v projection's layout, as `attention_einsum` reads it) ->
    the context (B, T, Hl*D) in the compute dtype. `interpret`: run the kernels in JAX's
    Mosaic GPU interpreter (on the CPU) instead of compiling them for a GPU."""
    B, T, width = qkv.shape
    check_shape(T, head_dim, qkv.dtype, interpret)
    if not interpret and (B * T) % 8:
        # the copies' memory side is (B*T, D) rows, tiled by 8 on the GPU
        raise ValueError(f"pallas attention on the GPU takes batch x tokens in multiples of "
                         f"8, got {B} x {T}")
    devices = jax.sharding.get_abstract_mesh().size  # inside shard_map / pmap: the mesh's
    if interpret and devices > 1:
        # JAX's interpreter simulates one GPU's memory for the whole process: with 2 fake
        # devices it fails ("Barrier remains allocated"), with 8 it blocked
        raise UsageError(f"--attention pallas-interpret runs on one device (JAX's Mosaic GPU "
                         f"interpreter), not {devices}: give --cpu-devices 1")
    ctx = _attention(qkv.reshape(B * T, width), T, head_dim, interpret)  # (B*T, Hl*D)
    return ctx.reshape(B, T, width // 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _attention(qkv, tokens, head_dim, interpret):
    return _forward(qkv, tokens, head_dim, interpret)[0]


# Inside shard_map a kernel's outputs come back typed as the same on every device of the
# mesh axes (Pallas calls run without the varying-axis check); each device's output is its
# own, so `_forward` and `_backward` mark them varying like the input (`varying_like`;
# inside these rules, no transpose of the cast is ever taken).
def _attention_fwd(qkv, tokens, head_dim, interpret):
    ctx, lse = _forward(qkv, tokens, head_dim, interpret)
    return ctx, (qkv, lse)


def _attention_bwd(tokens, head_dim, interpret, residuals, dctx):
    qkv, lse = residuals
    return (_backward(qkv, lse, dctx.astype(qkv.dtype), tokens, head_dim, interpret),)


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


def _columns(ref, block, head_dim: int):
    """Column block `block` of a gmem (B*T, n*D) matrix: the (B*T, D) view that `_load`
    and `_store` copy rows of (block j*Hl + h: array j of head h)."""
    return ref.at[:, pl.ds(block * head_dim, head_dim)]


def _pair(ref, b, h):
    """Pair (b, h)'s (1, 1, Rp) block of a gmem (B, Hl, Rp) array, sliced, not indexed."""
    return ref.at[pl.ds(b, 1), pl.ds(h, 1)]


def _load(refs, tiles, first, barriers, b, tokens: int):
    """Copy example b's rows of each gmem (B*T, D) view: rows 1.. into its shared-memory
    tile, rows 0..7 into `first[i]` (token 0 and seven rows that are not read: Mosaic GPU
    copies whole multiples of 128 bytes); then wait for all of them. A tile's copy is T - 1
    rounded up to 8 rows (the swizzled tiles' row granularity): its last rows are the next
    example's first rows, or zeros past the array's end (the copy engine fills them); the
    rows after stay as zeroed. The kernels mask or drop every padded row (see `_scores`,
    `_backward`)."""
    rows = -(-(tokens - 1) // 8) * 8
    for i, (ref, tile) in enumerate(zip(refs, tiles)):
        plgpu.copy_gmem_to_smem(ref.at[pl.ds(b * tokens + 1, rows)], tile.at[pl.ds(0, rows)],
                                barriers.at[2 * i])
        plgpu.copy_gmem_to_smem(ref.at[pl.ds(b * tokens, 8)], first.at[i],
                                barriers.at[2 * i + 1])
    for i in range(2 * len(refs)):
        plgpu.barrier_wait(barriers.at[i])


def _store(values, tiles, firsts, first_tile, refs, b, tokens: int):
    """Write each (Rp, D) value's first T - 1 rows to example b's rows 1.. of its gmem
    (B*T, D) view, through its (unswizzled) shared-memory tile, and each (D,) vector of
    `firsts` to its row 0, through its row of `first_tile`: exactly T rows, nothing of the
    next example's. Returns when the tiles may be written again."""
    for value, tile in zip(values, tiles):
        tile[...] = value.astype(tile.dtype)
    for i, vector in enumerate(firsts):
        first_tile[i] = vector.astype(first_tile.dtype)
    plgpu.commit_smem()
    for i, (tile, ref) in enumerate(zip(tiles, refs)):
        plgpu.copy_smem_to_gmem(tile.at[pl.ds(0, tokens - 1)],
                                ref.at[pl.ds(b * tokens + 1, tokens - 1)])
        plgpu.copy_smem_to_gmem(first_tile.at[pl.ds(i, 1)], ref.at[pl.ds(b * tokens, 1)])
    plgpu.wait_smem_to_gmem(0)


def _zero(tiles, interpret: bool):
    for tile in tiles:
        tile[...] = _wgmma_layout(jnp.zeros(tile.shape, tile.dtype), interpret)
    plgpu.commit_smem()


def _wgmma_layout(x, interpret: bool):
    """x in the wgmma accumulator's register layout on the GPU (a hint for Mosaic GPU's
    layout inference); the value itself interpreted."""
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _tile(ref, interpret: bool):
    """An (Rp, D) shared-memory tile in registers, in the wgmma layout and its own dtype
    (half the registers of float32 in bf16; every product with token 0's float32 vectors
    promotes it, exactly)."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)


def _first(ref, i: int, interpret: bool):
    """Token 0's row of array i in `ref` ((n, 8, D), `_load`) as a float32 (D,) vector,
    one entry per column of an (Rp, D) tile (`COLS`)."""
    if interpret:
        return ref[i, 0].astype(F32)
    return plgpu.load(ref.at[i, 0], (), layout=plgpu.Layout.WGMMA.reduce(0)).astype(F32)


def _load_rows(ref, interpret: bool):
    """A (Rp,) float32 vector from shared memory, one entry per tile row (`ROWS`)."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))


def _rows(x, shape):
    """A per-row vector (Rp,) broadcast along the rows' columns to `shape`."""
    return lax.broadcast_in_dim(x, shape, (0,))


def _cols(x, shape):
    """A per-column vector (D,) broadcast down the rows to `shape`."""
    return lax.broadcast_in_dim(x, shape, (1,))


def _row_index(shape, interpret: bool):
    """(Rp, N) int32: each entry's row."""
    return _wgmma_layout(lax.broadcasted_iota(jnp.int32, shape, 0), interpret)


def _row_ids(shape, interpret: bool):
    """(Rp,) int32 `ROWS`: each row's index."""
    return _row_index(shape, interpret).max(axis=1)


def _rows_below(rest: int, shape, interpret: bool):
    """An (Rp, N) mask of the real query rows."""
    return _row_index(shape, interpret) < rest


def _round(x, dtype):
    """x rounded to `dtype` and back to float32: what a product in that dtype sees."""
    return x.astype(dtype).astype(F32)


class _First:
    """The first query's softmax over all keys, on the CUDA cores, from its q, token 0's
    key and the rest's keys (an (Rp, D) tile in registers): `p_keys` (Rp,) `ROWS` for the
    rest's keys (zero on the padding), `p_self` (Rp,) `ROWS`, every entry its weight on
    its own key; both normalised and rounded to the compute dtype, as the products that
    take them see them (the forward's and the backward's the same)."""

    def __init__(self, q0, k0, k_rest, rest: int, scale: float, dtype, interpret: bool):
        shape = k_rest.shape
        row = _row_index(shape, interpret)
        s_keys = (k_rest * _cols(q0, shape)).sum(axis=1) * scale
        s_keys = jnp.where(_row_ids(shape, interpret) < rest, s_keys, -jnp.inf)
        s_self = (_cols(q0 * k0, shape)).sum(axis=1) * scale  # every entry q0 . k0
        top = _over_keys(_rows(s_keys, shape), _rows(s_self, shape), row, jnp.max)
        m = _cols(top, shape).max(axis=1)  # the maximum, as ROWS
        e_keys, e_self = jnp.exp(s_keys - m), jnp.exp(s_self - m)
        total = _over_keys(_rows(e_keys, shape), _rows(e_self, shape), row, jnp.sum)
        l_sum = _cols(total, shape).max(axis=1)
        self.p_keys = _round(e_keys / l_sum, dtype)
        self.p_self = _round(e_self / l_sum, dtype)
        self.shape, self.row = shape, row


def _over_keys(per_key, own, row, reduce):
    """A sum or maximum over all T keys, per column: `per_key` (Rp, D) holds the rest's
    key r's term in row r, `own` (Rp, D) token 0's in every row; reduced down the rows with
    token 0's term taken once (in row 0) -> (D,) `COLS`."""
    if reduce is jnp.max:
        return jnp.where(row == 0, jnp.maximum(per_key, own), per_key).max(axis=0)
    return jnp.where(row == 0, per_key + own, per_key).sum(axis=0)


def _scores(q_tile, k_tile, rest: int, interpret: bool):
    """(Rp, Rp) float32 scores of the rest's queries and keys, q k^T / sqrt(D), the
    padded keys at -inf."""
    rp, d = q_tile.shape
    s = _mma(q_tile, k_tile, transpose_b=True, interpret=interpret) * (1.0 / math.sqrt(d))
    key = _wgmma_layout(lax.broadcasted_iota(jnp.int32, (rp, rp), 1), interpret)
    return jnp.where(key < rest, s, -jnp.inf)


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
    """The kernels are written for Mosaic GPU's lane semantics (each thread's view of a
    warpgroup's arrays, `plgpu.wgmma` into an accumulator), JAX's default before 0.11, and
    name it: from 0.11 the default is warpgroup semantics, whose layout inference finds no
    layouts for them (JAX 0.10's, tried deviceless)."""
    if interpret:
        return None
    return plgpu.CompilerParams(approx_math=False,
                                lowering_semantics=plgpu.LoweringSemantics.Lane)


def _interpret_params(interpret: bool):
    """The interpreter reads past an array's end as zeros, as the GPU's copy engine does
    (`_load`'s last example)."""
    if not interpret:
        return None
    return InterpretGPUParams(out_of_bounds_reads="uninitialized", uninitialized_memory="zero")


def _grid(batch: int, heads: int) -> tuple[int, int]:
    return (-(-batch // PAIRS_PER_PROGRAM), heads)


# ---------------------------------------------------------------------------- forward
def _forward(qkv, T: int, D: int, interpret: bool):
    """qkv (B*T, 3*Hl*D) -> ctx (B*T, Hl*D) in qkv's dtype, lse (B, Hl, Rp) float32."""
    H, rp, rest, cd = qkv.shape[1] // (3 * D), padded_rest(T), T - 1, qkv.dtype
    B = qkv.shape[0] // T
    scale = 1.0 / math.sqrt(D)

    # The body's name is the kernel's in the compiled program (xla/kernels.py finds it).
    def attention_pallas_forward(qkv_ref, ctx_ref, lse_ref, q_s, k_s, v_s, first_s, o_s,
                                 o_first_s, lse_s, barriers):
        h = lax.axis_index("head")
        _zero((q_s, k_s, v_s), interpret)

        def pair(b):
            _load([_columns(qkv_ref, j * H + h, D) for j in range(3)], (q_s, k_s, v_s),
                  first_s, barriers, b, T)
            q0, k0, v0 = (_first(first_s, j, interpret) for j in range(3))
            q_rest = _tile(q_s, interpret)
            shape = q_rest.shape
            # the rest's queries: the rest's keys on the tensor cores, token 0's key beside
            s = _scores(q_s, k_s, rest, interpret)
            s0 = (q_rest * _cols(k0, shape)).sum(axis=1) * scale
            m = jnp.maximum(s.max(axis=1), s0)
            p, p0 = jnp.exp(s - _rows(m, s.shape)), jnp.exp(s0 - m)
            l_sum = p.sum(axis=1) + p0
            # the probabilities enter the products in the compute dtype, from registers
            o = (_mma(p.astype(cd), v_s, interpret=interpret)
                 + _rows(_round(p0, cd), shape) * _cols(v0, shape))
            o = o / _rows(l_sum, shape)
            lse_s[0, 0] = m + jnp.log(l_sum)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_s, _pair(lse_ref, b, h))
            # the first query, on the CUDA cores
            first = _First(q0, k0, _tile(k_s, interpret), rest, scale, cd, interpret)
            o_first = _over_keys(_rows(first.p_keys, shape) * _tile(v_s, interpret),
                                 _rows(first.p_self, shape) * _cols(v0, shape),
                                 first.row, jnp.sum)
            _store([o], (o_s,), [o_first], o_first_s, [_columns(ctx_ref, h, D)], b, T)

        _pairs(B, pair)

    tile = _smem(rp, D, D, cd, interpret)
    ctx, lse = plgpu.kernel(
        attention_pallas_forward,
        out_type=(jax.ShapeDtypeStruct((B * T, H * D), cd),
                  jax.ShapeDtypeStruct((B, H, rp), F32)),
        scratch_types=[tile, tile, tile, plgpu.SMEM((3, 8, D), cd), plgpu.SMEM((rp, D), cd),
                       plgpu.SMEM((1, D), cd), plgpu.SMEM((1, 1, rp), F32),
                       plgpu.Barrier(num_barriers=6)],
        grid=_grid(B, H), grid_names=("group", "head"),
        compiler_params=_compiler_params(interpret), interpret=_interpret_params(interpret),
    )(qkv)
    return varying_like(ctx, qkv), varying_like(lse, qkv)


# --------------------------------------------------------------------------- backward
def _first_query_grads(first: _First, v0, do0, v_rest, dtype):
    """The softmax's gradient on the first query's scores, (Rp,) `ROWS` both, rounded to
    the compute dtype: on the rest's keys (zero on the padding), and on its own key (every
    entry the same)."""
    shape = v_rest.shape
    dp_keys = (v_rest * _cols(do0, shape)).sum(axis=1)
    dp_self = _cols(v0 * do0, shape).sum(axis=1)  # every entry v0 . do0
    total = _over_keys(_rows(first.p_keys * dp_keys, shape),
                       _rows(first.p_self * dp_self, shape), first.row, jnp.sum)
    r = _cols(total, shape).max(axis=1)  # the row sum of p * dp, as ROWS
    return (_round(first.p_keys * (dp_keys - r), dtype),
            _round(first.p_self * (dp_self - r), dtype))


def _backward(qkv, lse, dctx, T: int, D: int, interpret: bool):
    """qkv (B*T, 3*Hl*D), lse (B, Hl, Rp) float32 (`_forward`'s), dctx (B*T, Hl*D) -> dqkv
    (B*T, 3*Hl*D) in qkv's dtype."""
    H, rp, rest, cd = qkv.shape[1] // (3 * D), padded_rest(T), T - 1, qkv.dtype
    B = qkv.shape[0] // T
    scale = 1.0 / math.sqrt(D)

    def attention_pallas_backward(qkv_ref, lse_ref, do_ref, dqkv_ref, q_s, k_s, v_s, do_s,
                                  first_s, p_s, ds_s, lse_s, out_s, out_first_s, barriers):
        h = lax.axis_index("head")
        _zero((q_s, k_s, v_s, do_s), interpret)

        def pair(b):
            plgpu.copy_gmem_to_smem(_pair(lse_ref, b, h), lse_s, barriers.at[8])
            _load([*(_columns(qkv_ref, j * H + h, D) for j in range(3)),
                   _columns(do_ref, h, D)], (q_s, k_s, v_s, do_s), first_s, barriers, b, T)
            plgpu.barrier_wait(barriers.at[8])
            q0, k0, v0, do0 = (_first(first_s, j, interpret) for j in range(4))
            q_r, k_r, v_r, do_r = (_tile(t, interpret) for t in (q_s, k_s, v_s, do_s))
            shape = q_r.shape
            lse = _load_rows(lse_s.at[0, 0], interpret)
            # the rest's queries: (Rp, Rp) f32 on the rest's keys, normalised, the padded
            # query rows zero (rows R to R rounded up to 8 hold the next example's q and
            # dctx), so that they add nothing to dv and dk; p0 on token 0's key
            s = _scores(q_s, k_s, rest, interpret)
            real = _rows_below(rest, s.shape, interpret)
            p = jnp.where(real, jnp.exp(s - _rows(lse, s.shape)), 0.0)
            p0 = jnp.where(_row_ids(shape, interpret) < rest,
                           jnp.exp((q_r * _cols(k0, shape)).sum(axis=1) * scale - lse), 0.0)
            p_s[...] = p.astype(cd)
            plgpu.commit_smem()
            dp = _mma(do_s, v_s, transpose_b=True, interpret=interpret)  # (Rp, Rp) f32
            dp0 = (do_r * _cols(v0, shape)).sum(axis=1)
            # the probabilities the forward's products used
            pc, pc0 = _round(p, cd), _round(p0, cd)
            r = (pc * dp).sum(axis=1) + pc0 * dp0
            ds = jnp.where(real, pc * (dp - _rows(r, dp.shape)), 0.0)
            ds0 = _round(pc0 * (dp0 - r), cd)
            ds_s[...] = ds.astype(cd)
            plgpu.commit_smem()
            # the first query
            first = _First(q0, k0, k_r, rest, scale, cd, interpret)
            ds_keys, ds_self = _first_query_grads(first, v0, do0, v_r, cd)
            # the gradients: the rest's rows from the tensor cores plus token 0's terms
            dv = (_mma(p_s, do_s, transpose_a=True, interpret=interpret)
                  + _rows(first.p_keys, shape) * _cols(do0, shape))
            dq = (_mma(ds_s, k_s, interpret=interpret) + _rows(ds0, shape) * _cols(k0, shape))
            dk = (_mma(ds_s, q_s, transpose_a=True, interpret=interpret)
                  + _rows(ds_keys, shape) * _cols(q0, shape))
            # token 0's rows
            row = first.row
            dq0 = _over_keys(_rows(ds_keys, shape) * k_r, _rows(ds_self, shape) * _cols(k0, shape),
                             row, jnp.sum)
            dk0 = _over_keys(_rows(ds0, shape) * q_r, _rows(ds_self, shape) * _cols(q0, shape),
                             row, jnp.sum)
            dv0 = _over_keys(_rows(pc0, shape) * do_r,
                             _rows(first.p_self, shape) * _cols(do0, shape), row, jnp.sum)
            _store([dq * scale, dk * scale, dv], out_s, [dq0 * scale, dk0 * scale, dv0],
                   out_first_s, [_columns(dqkv_ref, j * H + h, D) for j in range(3)], b, T)

        _pairs(B, pair)

    tile = _smem(rp, D, D, cd, interpret)
    square = _smem(rp, rp, D, cd, interpret)
    out = plgpu.SMEM((rp, D), cd)
    dqkv = plgpu.kernel(
        attention_pallas_backward,
        out_type=jax.ShapeDtypeStruct((B * T, 3 * H * D), cd),
        scratch_types=[tile, tile, tile, tile, plgpu.SMEM((4, 8, D), cd), square, square,
                       plgpu.SMEM((1, 1, rp), F32), (out, out, out), plgpu.SMEM((3, D), cd),
                       plgpu.Barrier(num_barriers=9)],
        grid=_grid(B, H), grid_names=("group", "head"),
        compiler_params=_compiler_params(interpret), interpret=_interpret_params(interpret),
    )(qkv, lse, dctx)
    return varying_like(dqkv, qkv)


# ------------------------------------------------------------------------------- cost
def attention_cost(batch: int, tokens: int, heads: int, head_dim: int, dtype) -> dict:
    """The kernels' HBM bytes and FLOPs as issued, forward and backward, for the predictor
    and the benchmarks: what they read and write once each, nothing more (the design's
    floor); per product the (Rp, Rp, D) block on the tensor cores (padded rows included)
    and token 0's row and column beside it (2 Rp D each on the CUDA cores): 2 Rp (Rp + 2) D,
    two products forward, five backward."""
    rp, e = padded_rest(tokens), jnp.dtype(dtype).itemsize
    pairs, tile = batch * heads, tokens * head_dim * e
    lse = rp * 4
    fwd_bytes = pairs * (3 * tile + tile + lse)  # q, k, v in; ctx, lse out
    bwd_bytes = pairs * (3 * tile + tile + lse + 3 * tile)  # q, k, v, dctx, lse in; dqkv
    product = 2 * rp * (rp + 2) * head_dim
    return {"forward_bytes": fwd_bytes, "backward_bytes": bwd_bytes,
            "forward_flops": pairs * 2 * product, "backward_flops": pairs * 5 * product,
            "useful_forward_flops": pairs * 2 * 2 * tokens * tokens * head_dim}
