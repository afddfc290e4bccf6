"""The MLP of an encoder block: fc2(GELU(fc1 x + b1)), one call (`mlp`).

Two paths compute the same function of the same parameters:

- XLA (`Execution.mlp_kernels` "xla", the default): fc1's matmul, then its bias add and
  the GELU written in the matmul dtype right after it (`add_bias`, `_gelu`), the form
  XLA:GPU folds into cuBLASLt's bias-GELU epilogue; then fc2 (`_gelu_matmul`).
- Pallas ("pallas"): fc2 with the GELU in its prologue and the backward as two kernels
  (`_bias_gelu_fc2`, kernels in vit_pure/pallas/mlp.py); the GELU's output is never
  written.

The GELU is the tanh form (ViTConfig.gelu "tanh", the presets') or the exact erf form
("exact", imported timm / Hugging Face weights). The Pallas kernels compute the tanh form
only: with "exact" the MLP runs the XLA path whatever `Execution.mlp_kernels` says.

fc2's bias is not added here: with tensor parallelism fc2 is a row-parallel matmul whose
partial sums `model._block` adds up first.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from vit_pure.config import Execution
from vit_pure.layers.linear import add_bias, varying_like
from vit_pure.layers.remat import GELU, save_dot
from vit_pure.pallas.mlp import (
    exact_gelu_and_slope,
    gelu_and_slope,
    gelu_fc2_backward,
    gelu_fc2_forward,
    gelu_fc2_weight_gradient,
    tiles,
)
from vit_pure.policy import Policy, matmul

F32 = jnp.float32


def mlp(h, m, policy: Policy, execution: Execution, gelu: str = "tanh"):
    """h (rows, E) compute dtype, m this layer's "mlp" params -> fc2's output (rows, E)
    in the matmul dtype, before fc2's bias. With tensor parallelism m holds Ml of the M
    hidden units and the result is this device's partial sum. `gelu`: ViTConfig.gelu."""
    h = save_dot(matmul(h, m["fc1"]["kernel"], policy))  # (rows, Ml), matmul dtype
    if (execution.mlp_kernels == "pallas" and gelu == "tanh"
            and _mlp_pallas_fits(h, m["fc2"]["kernel"], policy)):
        return _bias_gelu_fc2(h, varying_like(m["fc1"]["bias"], h), m["fc2"]["kernel"], policy)
    h = add_bias(h, m["fc1"]["bias"], barrier=True)
    return _gelu_matmul(h, m["fc2"]["kernel"], policy.compute_dtype, policy,
                        recompute=execution.remat == "none", exact=gelu == "exact")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gelu(x, dtype, exact=False):
    """GELU (tanh form, `jax.nn.gelu`; with `exact` the erf form) of x in x's dtype (the
    matmul dtype), returned in `dtype`.

    Written in x's dtype right after fc1's matmul and bias add so that XLA:GPU folds it
    into the GEMM: cuBLASLt's `BIAS_GELU_AUX` epilogue applies bias and GELU before it
    rounds its result, and writes x too, for the backward. A custom VJP so that the
    backward keeps only x, in the matmul dtype, and evaluates the derivative's formula in
    float32, returning x's gradient in x's dtype."""
    return jax.nn.gelu(x, approximate=not exact).astype(dtype)


def _gelu_fwd(x, dtype, exact):
    return _gelu(x, dtype, exact), x


def _gelu_bwd(dtype, exact, x, dz):
    _, slope = (exact_gelu_and_slope if exact else gelu_and_slope)(x.astype(F32))
    return ((dz.astype(F32) * slope).astype(x.dtype),)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _gelu_matmul(x, w, dtype, policy: Policy, recompute: bool, exact: bool = False):
    """`_gelu`(x) @ w with the policy's matmul. With `recompute` (remat "none", where
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


def _mlp_pallas_fits(h, w, policy: Policy) -> bool:
    """Whether `_bias_gelu_fc2`'s kernels take fc1's output h (rows, M) and fc2's kernel w
    (M, E): their tiles fit and the matmul returns w's dtype, the compute dtype (their
    dots read h, fc2's incoming gradient and w in one dtype)."""
    return (h.ndim == 2 and policy.matmul_dtype == w.dtype
            and tiles(h.shape[0], w.shape[0], w.shape[1]) is not None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _bias_gelu_fc2(h, bias, w, policy: Policy):
    """fc2(gelu(h + bias)): `add_bias`, `_gelu` and `_gelu_matmul` (remat "none") in one, as
    the Pallas kernels of vit_pure/pallas/mlp.py (`Execution.mlp_kernels`): fc1's bias
    is added in fc1's GEMM (XLA:GPU folds it into cuBLASLt's epilogue), then fc2 with the
    GELU in its prologue; the backward runs fc2's input gradient, the GELU's derivative
    and fc1's bias gradient as one kernel and fc2's weight gradient as another, each
    recomputing the GELU from h + bias (rows, M), the one array kept for the backward.
    The GELU's output (rows, M) is never written."""
    return _bias_gelu_fc2_fwd(h, bias, w, policy)[0]


def _bias_gelu_fc2_fwd(h, bias, w, policy):
    pre = h + bias.astype(h.dtype)
    z = gelu_fc2_forward(pre, w, policy.matmul_dtype, precision=policy.precision)
    return z, (pre, bias, w)


def _bias_gelu_fc2_bwd(policy, residuals, dz):
    pre, bias, w = residuals
    dpre, dbias = gelu_fc2_backward(dz, w, pre, precision=policy.precision)
    dw = gelu_fc2_weight_gradient(pre, dz, w.dtype, precision=policy.precision)
    return dpre, dbias.astype(bias.dtype), dw


_bias_gelu_fc2.defvjp(_bias_gelu_fc2_fwd, _bias_gelu_fc2_bwd)

