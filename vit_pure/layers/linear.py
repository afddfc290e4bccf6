"""Bias adds with float32 gradients (`add_bias`; `dense`, a matmul that adds its own bias;
`biased`, either as `Execution.biases` says), and the cast that types a parameter like an
activation.

Inside `shard_map` a replicated parameter that meets a varying activation must be made
varying first (`varying_like`): a custom VJP's cotangent for the parameter must have the
parameter's type, and the transpose of the cast sums it over those axes, as autodiff's
implicit broadcast would.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from vit_pure.layers.remat import save_dot
from vit_pure.policy import Policy, matmul

F32 = jnp.float32
ONES_WIDTH = 8  # the ones column and its zero padding: `dense`'s extra input columns


def varying_like(w, x):
    """w marked as varying over the manual mesh axes x varies over (inside shard_map;
    outside, w itself), as autodiff's implicit broadcast does: a custom VJP's cotangent
    for w must have w's type, and the transpose of this cast sums it over those axes."""
    axes = jax.typeof(x).mat.varying - jax.typeof(w).mat.varying
    return jax.lax.pcast(w, tuple(sorted(axes, key=str)), to="varying") if axes else w



def add_bias(y, bias):
    """`_add_bias`(y, bias) with bias marked varying like y (`varying_like`), as
    `layer_norm` does for its params."""
    return _add_bias(y, varying_like(bias, y))


@jax.custom_vjp
def _add_bias(y, bias):
    """y + bias, the bias cast to y's dtype (the matmul dtype), its gradient summed over
    the rows in float32 (autodiff of the add would sum in the matmul dtype: bf16 on a GPU).

    The forward is a plain add after the matmul, the form XLA:GPU folds into cuBLASLt's
    bias epilogue; the sum shares a kernel with the gradient's other consumers. The
    biases of matmuls whose input the kit writes itself go through `dense` instead."""
    return y + bias.astype(y.dtype)


def _add_bias_fwd(y, bias):
    return _add_bias(y, bias), bias


def _add_bias_bwd(bias, dy):
    rows = tuple(range(dy.ndim - 1))
    return dy, jnp.sum(dy.astype(F32), axis=rows).astype(bias.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)


def dense(x, w, b, policy: Policy):
    """x @ w + b for x (rows, K) and w (K, N), the bias added by the matmul itself: x
    gets a column of ones (padded with zeros to `ONES_WIDTH` columns, the producer of x
    writes them) and w the bias as its row K. The result is the matmul dtype, tagged as
    a product (`save_dot`).

    The backward pass's weight-gradient product then also makes the bias gradient (the
    ones column's row: the sum of the output's gradient over the rows, accumulated in
    float32 inside the GEMM), so no kernel reads that (rows, N) gradient again for a
    column sum: one pass over it a layer for fc1 (B*T x M) and for each of q, k, v
    (docs/performance.md, "The memory-bound passes")."""
    return dense_with_ones(with_ones(x), w, b, policy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fan_out(x, n: int):
    """x, n times, for n matmuls that read it: the cotangents are summed as a chain, each
    added to the next one's product (ct[n-1] + (... + (ct[1] + ct[0]))), the form in
    which XLA:GPU's GEMM rewriter accumulates each data-gradient product into the next
    (cuBLAS beta = 1) instead of writing n products for a kernel that adds them up
    (autodiff's own sum, behind the ones column's concatenation, is not seen so)."""
    return (x,) * n


def _fan_out_fwd(x, n):
    return fan_out(x, n), None


def _fan_out_bwd(n, _, cts):
    total = cts[0]
    for ct in cts[1:]:
        total = ct + total
    return (total,)


fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def copies(x, n: int, data_grads: str):
    """x, n times, for n matmuls: `fan_out` ("chain") or plain copies whose cotangents
    JAX sums itself ("sum"): `Execution.qkv_data_grads`."""
    return fan_out(x, n) if data_grads == "chain" else (x,) * n


def biased(x, w, b, policy: Policy, biases: str):
    """x @ w + b for x (rows, K) and w (K, N) in the matmul dtype, the bias as
    `Execution.biases` says: "ones-column", inside the product (`dense`: K + ONES_WIDTH
    columns, the bias gradient from the weight gradient's product); "epilogue", added
    after the product (`add_bias`: the form cuBLASLt's bias epilogue takes, K columns,
    the bias gradient a float32 column sum of the output's gradient)."""
    if biases == "ones-column":
        return dense(x, w, b, policy)
    return add_bias(save_dot(matmul(x, w, policy)), b)


def with_ones(x):
    """x (rows, K) with `dense`'s ones columns: (rows, K + ONES_WIDTH). Matmuls that read
    the same x share one (`dense_with_ones`): the backward pass then keeps one copy."""
    return jnp.concatenate([x, _ones_block(x)], axis=1)


def dense_with_ones(xa, w, b, policy: Policy):
    """`dense` of x given as `with_ones(x)`."""
    pad = varying_like(jnp.zeros((ONES_WIDTH - 1, w.shape[1]), w.dtype), w)
    wa = jnp.concatenate([w, varying_like(b, w).astype(w.dtype).reshape(1, -1), pad], axis=0)
    # Both operands typed alike before the custom VJP, whose cotangents keep their types
    # (a replicated weight meeting a batch-split input is made varying here, as autodiff's
    # implicit broadcast would: the transpose sums its gradient over those axes).
    return save_dot(_ones_matmul(varying_like(xa, wa), varying_like(wa, xa), policy))


def _ones_block(x):
    """(rows, ONES_WIDTH) in x's dtype: a column of ones, then zeros; varying like x."""
    onehot = (jnp.arange(ONES_WIDTH) == 0).astype(x.dtype)
    return varying_like(jnp.broadcast_to(onehot, (x.shape[0], ONES_WIDTH)), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ones_matmul(xa, wa, policy):
    """xa @ wa as `policy.matmul` computes it, for `dense`'s operands. A custom VJP of one
    product (what the pipeline's zero-bubble split defers to its W pass, pipeline/split.py)
    so that the data gradient comes from wa's first K rows alone: the ones columns'
    gradient is zeros, which XLA drops, not a (rows, K + ONES_WIDTH) product sliced."""
    return jnp.einsum("rk,kn->rn", xa, wa, precision=policy.precision,
                      preferred_element_type=policy.matmul_dtype)


def _ones_matmul_fwd(xa, wa, policy):
    return _ones_matmul(xa, wa, policy), (xa, wa)


def _ones_matmul_bwd(policy, residuals, dy):
    xa, wa = residuals
    K = xa.shape[1] - ONES_WIDTH
    dy = dy.astype(xa.dtype)  # as `policy.einsum`'s backward: products in the compute dtype
    dx = matmul(dy, wa[:K].T, policy).astype(xa.dtype)
    dwa = matmul(xa.T, dy, policy).astype(wa.dtype)  # (K + ONES_WIDTH, N): w's and b's
    return jnp.concatenate([dx, jnp.zeros_like(xa[:, K:])], axis=1), dwa


_ones_matmul.defvjp(_ones_matmul_fwd, _ones_matmul_bwd)
