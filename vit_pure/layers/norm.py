"""LayerNorm: float32 statistics and arithmetic, the result in the input's dtype; or its
standardisation alone with its scale and bias folded into the next matmul's weights
(`standardise`, `fold_affine`: Execution.layer_norm "fold").

A custom VJP (`_normalise`) so that the backward pass reads and writes what a fused
kernel would: it keeps x as it came and two float32 statistics per token, not float32
copies of the (rows, E) intermediates.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from vit_pure.layers.linear import varying_like

F32 = jnp.float32


def layer_norm(x, p, eps):
    """LayerNorm with float32 statistics; returns x's dtype (`_normalise`)."""
    return _normalise(x, varying_like(p["scale"], x), varying_like(p["bias"], x), eps)



def standardise(x, eps):
    """(x - mean) / std over the last axis, float32 statistics, x's dtype: `layer_norm`
    without its scale and bias, for a matmul that takes them into its weights
    (`fold_affine`). Its backward is one row-wise pass: no column sums of dy and x."""
    e = x.shape[-1]
    return layer_norm(x, {"scale": jnp.ones((e,), x.dtype), "bias": jnp.zeros((e,), x.dtype)},
                      eps)


def fold_affine(p, kernel, bias):
    """A LayerNorm's scale and bias (`p`) folded into the matmul that reads its output:
    (xhat * scale + b_ln) @ W + b = xhat @ (scale[:, None] * W) + (b_ln @ W + b), for
    `kernel` (E, ...) and `bias` (...) -> the folded (kernel, bias) in their dtypes.

    The same function as `layer_norm` then the matmul, rounded elsewhere (the product
    scale * W is rounded to W's dtype instead of the LayerNorm's output). The backward
    then makes the scale's and bias's gradients from the matmul's weight and bias
    gradients, (E, N) arrays, instead of column sums over the (rows, E) activation and
    its gradient. Computed in float32 (the gradient sums over N too), elementwise: the
    bias's term is a sum of products, not a dot, as the policy's matmuls are the model's."""
    e = kernel.shape[0]
    w = kernel.reshape(e, -1).astype(F32)
    scale = varying_like(p["scale"], kernel).astype(F32)
    shift = varying_like(p["bias"], kernel).astype(F32)
    folded_w = (scale[:, None] * w).astype(kernel.dtype).reshape(kernel.shape)
    folded_b = jnp.sum(shift[:, None] * w, axis=0).reshape(bias.shape) + bias.astype(F32)
    return folded_w, folded_b.astype(bias.dtype)


def _ln_statistics(x, eps):
    """Per-token mean and 1 / std over the last axis, float32, shape (..., 1).

    On a GPU from one read of x (`_welford`), elsewhere in two (`_two_pass`): the same
    figures to float32 rounding, and neither loses the variance to cancellation."""
    xf = x.astype(F32)
    mean, var = jax.lax.platform_dependent(xf, cuda=_welford, rocm=_welford,
                                           default=_two_pass)
    return mean, jax.lax.rsqrt(var + eps)


def _two_pass(xf):
    """The mean, then the mean of squared deviations from it: two reads of x."""
    mean = xf.mean(-1, keepdims=True)
    return mean, jnp.square(xf - mean).mean(-1, keepdims=True)


def _welford(xf):
    """Mean and variance from one reduction: per-element (count, mean, sum of squared
    deviations) triples merged pairwise as Chan et al. do, so XLA:GPU makes them in the
    kernel that writes x (the residual add) and the second read of x goes. Unlike the mean
    of squares less the squared mean, it does not cancel when |mean| >> std. (XLA:CPU runs
    a variadic reduction element by element: slower than the two sums there.)"""
    n, mean, m2 = jax.lax.reduce((jnp.ones_like(xf), xf, jnp.zeros_like(xf)),
                                 (F32(0), F32(0), F32(0)), _chan_merge, (xf.ndim - 1,))
    return mean[..., None], (m2 / xf.shape[-1])[..., None]


def _chan_merge(a, b):
    """Two (count, mean, M2) partials -> their union's (Chan, Golub & LeVeque, 1979)."""
    (na, ma, sa), (nb, mb, sb) = a, b
    n = na + nb
    w = jnp.where(n > 0, nb / jnp.maximum(n, 1), 0)  # nb / n; 0 for two empty partials
    d = mb - ma
    return n, ma + d * w, sa + sb + d * d * na * w


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _normalise(x, scale, bias, eps):
    """(x - mean) / std * scale + bias over the last axis, the statistics and the
    arithmetic in float32, the result in x's dtype.

    A custom VJP so that the backward pass reads and writes what a fused kernel would:
    it keeps x as it came (the compute dtype) and the two float32 statistics per token,
    and returns dx in x's dtype, each formula in float32 inside its kernel. Plain autodiff
    keeps float32 copies of the (B, T, E) intermediates and sums the scale and bias
    gradients through them (on a GPU, in layouts that need transposes)."""
    return _normalise_fwd(x, scale, bias, eps)[0]


def _normalise_fwd(x, scale, bias, eps):
    mean, rstd = _ln_statistics(x, eps)
    y = (x.astype(F32) - mean) * rstd
    y = (y * scale.astype(F32) + bias.astype(F32)).astype(x.dtype)
    return y, (x, scale, bias, mean, rstd)


def _normalise_bwd(eps, residuals, dy):
    x, scale, bias, mean, rstd = residuals
    # The barrier: the statistics are read as saved (8 bytes a token). Else XLA:GPU
    # recomputes them inside the dx kernel, and the scale gradient's column sum, which
    # cannot share that row-wise kernel, reads a float32 (B*T, E) product written for it.
    mean, rstd = jax.lax.optimization_barrier((mean, rstd))
    xhat = (x.astype(F32) - mean) * rstd
    dy = dy.astype(F32)
    rows = tuple(range(x.ndim - 1))  # every axis but the normalised one
    dscale = jnp.sum(dy * xhat, axis=rows).astype(scale.dtype)
    dbias = jnp.sum(dy, axis=rows).astype(bias.dtype)
    g = dy * scale.astype(F32)
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx.astype(x.dtype), dscale, dbias


_normalise.defvjp(_normalise_fwd, _normalise_bwd)
