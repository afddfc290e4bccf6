"""The MLP of an encoder block: fc2(GELU(fc1 x + b1)), one call (`mlp`).

fc1's matmul with its bias inside the product (`linear.dense`), then the GELU written in
the matmul dtype right after it (`_gelu`), the form XLA:GPU folds into cuBLASLt's GELU
epilogue; then fc2 (`_gelu_matmul`). The GELU is the tanh form (ViTConfig.gelu "tanh",
the presets') or the exact erf form ("exact", imported timm / Hugging Face weights).

fc2's bias is not added here: with tensor parallelism fc2 is a row-parallel matmul whose
partial sums `model._block` adds up first.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from vit_pure.config import Execution
from vit_pure.layers.linear import dense
from vit_pure.layers.remat import GELU
from vit_pure.policy import Policy, matmul

F32 = jnp.float32
GELU_C = math.sqrt(2 / math.pi)  # the tanh form's constant


def mlp(h, m, policy: Policy, execution: Execution, gelu: str = "tanh"):
    """h (rows, E) compute dtype, m this layer's "mlp" params -> fc2's output (rows, E)
    in the matmul dtype, before fc2's bias. With tensor parallelism m holds Ml of the M
    hidden units and the result is this device's partial sum. `gelu`: ViTConfig.gelu."""
    h = dense(h, m["fc1"]["kernel"], m["fc1"]["bias"], policy)  # (rows, Ml), matmul dtype
    return _gelu_matmul(h, m["fc2"]["kernel"], policy.compute_dtype, policy,
                        recompute=execution.remat == "gelu", exact=gelu == "exact")


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gelu(x, dtype, exact=False):
    """GELU (tanh form, `jax.nn.gelu`; with `exact` the erf form) of x in x's dtype (the
    matmul dtype), returned in `dtype`.

    Written in x's dtype right after fc1's matmul (its bias inside the product,
    `linear.dense`) so that XLA:GPU folds it into the GEMM: cuBLASLt's `GELU_AUX`
    epilogue applies the GELU before it rounds its result, and writes x too, for the
    backward. A custom VJP so that the backward keeps only x, in the matmul dtype, and
    evaluates the derivative's formula in float32, returning x's gradient in x's dtype."""
    return jax.nn.gelu(x, approximate=not exact).astype(dtype)


def _gelu_fwd(x, dtype, exact):
    return _gelu(x, dtype, exact), x


def _gelu_bwd(dtype, exact, x, dz):
    _, slope = (exact_gelu_and_slope if exact else gelu_and_slope)(x.astype(F32))
    return ((dz.astype(F32) * slope).astype(x.dtype),)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _gelu_matmul(x, w, dtype, policy: Policy, recompute: bool, exact: bool = False):
    """`_gelu`(x) @ w with the policy's matmul. With `recompute` (remat "gelu", where
    nothing else is recomputed) the GELU's output, a (B*T, M) activation, is not kept
    for the backward pass: the backward recomputes it from x, which the GELU's
    derivative reads anyway, and XLA makes both in one kernel. A block then holds one
    (B*T, M) array less and writes one more (docs/performance.md, "Cutting the
    headline's traffic, deviceless"). Under the other remat modes the block's own
    checkpoint decides what is kept."""
    def gelu_matmul(x, w):
        return matmul(checkpoint_name(_gelu(x, dtype, exact), GELU), w, policy)

    if not recompute:
        return gelu_matmul(x, w)
    return jax.checkpoint(gelu_matmul, policy=jax.checkpoint_policies.nothing_saveable)(x, w)
