"""Bias adds with float32 gradients, and the cast that types a parameter like an activation.

Inside `shard_map` a replicated parameter that meets a varying activation must be made
varying first (`varying_like`): a custom VJP's cotangent for the parameter must have the
parameter's type, and the transpose of the cast sums it over those axes, as autodiff's
implicit broadcast would.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

F32 = jnp.float32


def varying_like(w, x):
    """w marked as varying over the manual mesh axes x varies over (inside shard_map;
    outside, w itself), as autodiff's implicit broadcast does: a custom VJP's cotangent
    for w must have w's type, and the transpose of this cast sums it over those axes."""
    axes = jax.typeof(x).mat.varying - jax.typeof(w).mat.varying
    return jax.lax.pcast(w, tuple(sorted(axes, key=str)), to="varying") if axes else w



def add_bias(y, bias, barrier=False):
    """`_add_bias`(y, bias) with bias marked varying like y (`varying_like`), as
    `layer_norm` does for its params."""
    return _add_bias(y, varying_like(bias, y), barrier)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add_bias(y, bias, barrier):
    """y + bias, the bias cast to y's dtype (the matmul dtype), its gradient summed over
    the rows in float32 (autodiff of the add would sum in the matmul dtype: bf16 on a GPU).

    The forward is a plain add after the matmul, the form XLA:GPU folds into cuBLASLt's
    bias epilogue. With `barrier` (fc1's bias, whose gradient the GELU's derivative
    makes) an optimisation barrier makes the sum read the incoming gradient as its
    producer wrote it, in y's dtype; without it XLA:GPU writes that float32 product out
    for the reduction to read (+15 GB of HBM traffic in the headline step,
    docs/performance.md). For the other biases the barrier would cost a pass instead."""
    return y + bias.astype(y.dtype)


def _add_bias_fwd(y, bias, barrier):
    return _add_bias(y, bias, barrier), bias


def _add_bias_bwd(barrier, bias, dy):
    if barrier:
        dy = jax.lax.optimization_barrier(dy)
    rows = tuple(range(dy.ndim - 1))
    return dy, jnp.sum(dy.astype(F32), axis=rows).astype(bias.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)
