"""The MLP of an encoder block: fc2(GELU(fc1 x + b1)), one call (`mlp`).

fc1's product, its bias and the GELU, then fc2 (`_gelu_matmul`). The bias rides as
`Execution.biases` says: inside the product (`linear.dense`'s ones column, the default),
or added in `_gelu` itself right after the product ("epilogue": K = E columns, the bias
gradient summed from the GELU's derivative where it is made). The GELU is written in
the product's dtype right after it, the form XLA:GPU folds into cuBLASLt's GELU (or
BIAS_GELU) epilogue; `Execution.fc1_output` "float32" has the product return float32
and the bias and GELU run in float32 before the cast. The GELU is the tanh form
(ViTConfig.gelu "tanh", the presets') or the exact erf form ("exact", imported timm /
Hugging Face weights).

fc2's bias is not added here: with tensor parallelism fc2 is a row-parallel matmul whose
partial sums `model._block` adds up first.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from vit_pure.config import Execution
from vit_pure.layers.linear import dense, varying_like
from vit_pure.layers.remat import GELU, save_dot
from vit_pure.policy import Policy, matmul

F32 = jnp.float32
GELU_C = math.sqrt(2 / math.pi)  # the tanh form's constant


def mlp(h, m, policy: Policy, execution: Execution, gelu: str = "tanh"):
    """h (rows, E) compute dtype, m this layer's "mlp" params -> fc2's output (rows, E)
    in the matmul dtype, before fc2's bias. With tensor parallelism m holds Ml of the M
    hidden units and the result is this device's partial sum. `gelu`: ViTConfig.gelu;
    `execution.biases` and `execution.fc1_output`: how fc1's bias and product ride."""
    fc1 = policy
    if execution.fc1_output == "float32":  # fc1's product, bias and GELU in float32
        fc1 = dataclasses.replace(policy, matmul_dtype=jnp.dtype(F32))
    w1, b1 = m["fc1"]["kernel"], m["fc1"]["bias"]
    if execution.biases == "ones-column":  # else "fc1-epilogue" or "epilogue"
        x, bias = dense(h, w1, b1, fc1), None  # (rows, Ml), the bias inside the product
    else:
        x = save_dot(matmul(h, w1, fc1))  # (rows, Ml), the bias added by `_gelu`
        bias = varying_like(b1, x)
    return _gelu_matmul(x, bias, m["fc2"]["kernel"], policy.compute_dtype, policy,
                        recompute=execution.remat == "gelu", exact=gelu == "exact",
                        keep=policy.matmul_dtype)


def gelu_and_slope(x):
    """GELU (tanh form, as `jax.nn.gelu`) of float32 x and its derivative."""
    t = jnp.tanh(GELU_C * (x + 0.044715 * x * x * x))
    gelu = 0.5 * x * (1 + t)
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * GELU_C * (1 + 3 * 0.044715 * x * x)
    return gelu, slope


def exact_gelu_and_slope(x):
    """GELU (exact form, x * Phi(x) with erf, as `jax.nn.gelu(x, approximate=False)`) of
    float32 x and its derivative Phi(x) + x * phi(x)."""
    cdf = 0.5 * (1 + jax.lax.erf(x * (1 / math.sqrt(2.0))))
    pdf = jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return x * cdf, cdf + x * pdf


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _gelu(x, bias, dtype, exact=False, keep=None):
    """GELU (tanh form, `jax.nn.gelu`; with `exact` the erf form) of x + bias in x's
    dtype (the product's), returned in `dtype`; `bias` (N,) or None (already inside x).

    Written in x's dtype right after fc1's product so that XLA:GPU folds it into the
    GEMM: cuBLASLt's `GELU_AUX` (`BIAS_GELU_AUX` with the bias) epilogue applies the
    GELU before it rounds its result, and writes its input too, for the backward. A
    custom VJP so that the backward keeps only that input, in `keep` (default x's dtype;
    under `Execution.fc1_output` "float32" the matmul dtype the product would have
    returned, so that the kept array stays its size), and evaluates the derivative's
    formula in float32, returning x's gradient in x's dtype and the bias's summed over
    the rows in float32 from it."""
    return _gelu_fwd(x, bias, dtype, exact, keep)[0]


def _gelu_fwd(x, bias, dtype, exact, keep):
    pre = x if bias is None else x + bias.astype(x.dtype)
    kept = pre.astype(keep or x.dtype)
    # x's dtype rides along as an empty array (residuals must be arrays).
    return (jax.nn.gelu(pre, approximate=not exact).astype(dtype),
            (kept, bias, jnp.zeros((0,), x.dtype)))


def _gelu_bwd(dtype, exact, keep, residuals, dz):
    pre, bias, x = residuals
    _, slope = (exact_gelu_and_slope if exact else gelu_and_slope)(pre.astype(F32))
    dpre = dz.astype(F32) * slope
    if bias is None:
        return dpre.astype(x.dtype), None
    # The bias's gradient summed (in float32) from x's gradient as returned, rounded to
    # x's dtype, as the ones column's weight-gradient product sums it. The barrier: the
    # sum reads x's gradient as written; else XLA:GPU writes the float32 product out for a
    # kernel that makes both the sum and the rounded gradient (a float32 (rows, M) array
    # written and read: docs/performance.md, "The GEMMs in their fast shapes").
    dx = jax.lax.optimization_barrier(dpre.astype(x.dtype))
    rows = tuple(range(dpre.ndim - 1))
    return dx, jnp.sum(dx.astype(F32), axis=rows).astype(bias.dtype)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _gelu_matmul(x, bias, w, dtype, policy: Policy, recompute: bool, exact: bool = False,
                 keep=None):
    """`_gelu`(x + bias) @ w with the policy's matmul (`bias` None: inside x). With
    `recompute` (remat "gelu", where nothing else is recomputed) the GELU's output, a
    (B*T, M) activation, is not kept for the backward pass: the backward recomputes it
    from its input, which the GELU's derivative reads anyway, and XLA makes both in one
    kernel. A block then holds one (B*T, M) array less and writes one more
    (docs/performance.md, "The memory-bound passes"). Under the other
    remat modes the block's own checkpoint decides what is kept. `keep`: `_gelu`'s."""
    def gelu_matmul(x, bias, w):
        return matmul(checkpoint_name(_gelu(x, bias, dtype, exact, keep), GELU), w, policy)

    if not recompute:
        return gelu_matmul(x, bias, w)
    return jax.checkpoint(gelu_matmul,
                          policy=jax.checkpoint_policies.nothing_saveable)(x, bias, w)
