"""Bias adds with float32 gradients (`add_bias`; `dense`, a matmul that adds its own bias),
and the cast that types a parameter like an activation.

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
from vit_pure.policy import Policy, einsum, matmul

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
    (docs/performance.md, "The memory-bound passes"). The data gradient comes from w
    alone (K columns, not K + `ONES_WIDTH`)."""
    return save_dot(_dense(x, w, varying_like(b, w), policy))


def _ones_block(x):
    """(rows, ONES_WIDTH) in x's dtype: a column of ones, then zeros; varying like x."""
    onehot = (jnp.arange(ONES_WIDTH) == 0).astype(x.dtype)
    return varying_like(jnp.broadcast_to(onehot, (x.shape[0], ONES_WIDTH)), x)


def _augmented(x, w, b):
    """(x | 1 0..0) and (w ; b ; 0), the operands of `dense`'s product."""
    xa = jnp.concatenate([x, _ones_block(x)], axis=1)
    pad = jnp.zeros((ONES_WIDTH - 1, w.shape[1]), w.dtype)
    wa = jnp.concatenate([w, b.astype(w.dtype)[None], varying_like(pad, w)], axis=0)
    return xa, wa


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x, w, b, policy):
    xa, wa = _augmented(x, w, b)
    return matmul(xa, wa, policy)


def _dense_fwd(x, w, b, policy):
    xa, wa = _augmented(x, w, b)
    return matmul(xa, wa, policy), (xa, w, b)


def _dense_bwd(policy, residuals, dy):
    xa, w, b = residuals
    K = w.shape[0]
    dy = dy.astype(xa.dtype)  # as `policy.einsum`'s backward: products in the compute dtype
    dx = matmul(dy, w.T, policy).astype(xa.dtype)
    dwa = einsum("rk,rn->kn", xa, dy, policy)  # (K + ONES_WIDTH, N)
    return dx, dwa[:K].astype(w.dtype), dwa[K].astype(b.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)
