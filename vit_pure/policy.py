"""The dtype policy: which dtype parameters are stored in, computed in, and returned in.

One frozen dataclass decides every cast in the kit:

    param_dtype    what the optimizer updates and checkpoints hold ("master" weights)
    compute_dtype  what the model's matmuls and activations run in
    output_dtype   what `apply` returns (the logits)

String form (the command line's `--policy`): ``p=f32,c=bf16,o=f32``. The short forms
``fp32`` / ``bf16`` / ``fp16`` mean float32 master params computing in that dtype with
float32 outputs (the usual mixed-precision recipe). Parameters themselves may also be
stored in low precision (``p=bf16,c=bf16``); that runs, but see README for why it trains
worse.

Fixed rules, whatever the policy says:
  * only floating leaves are cast (integer step counters, RNG keys are left alone);
  * LayerNorm statistics, the softmax and the loss are computed in float32;
  * matmuls take compute-dtype inputs and accumulate in float32
    (``preferred_element_type``); see `matmul` for the backward pass.

Float16 has a narrow exponent range, so small gradients underflow to zero; the usual cure
is a *dynamic loss scale* (`LossScale`): multiply the loss by S before differentiating,
divide the gradients by S afterwards, halve S and skip the step whenever a gradient is not
finite, double it after `period` finite steps in a row.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

_DTYPE_NAMES = {
    "f32": jnp.float32, "fp32": jnp.float32, "float32": jnp.float32,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "f16": jnp.float16, "fp16": jnp.float16, "float16": jnp.float16,
}
_SHORT_NAMES = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16",
                jnp.dtype(jnp.float16): "f16"}
_PRECISIONS = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH,
               "highest": jax.lax.Precision.HIGHEST}


def parse_dtype(name: str) -> jnp.dtype:
    try:
        return jnp.dtype(_DTYPE_NAMES[name.strip().lower()])
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; use one of f32, bf16, f16 (or fp32, fp16, bfloat16, ...)"
        ) from None


@dataclasses.dataclass(frozen=True)
class Policy:
    param_dtype: jnp.dtype = jnp.dtype(jnp.float32)
    compute_dtype: jnp.dtype = jnp.dtype(jnp.float32)
    output_dtype: jnp.dtype = jnp.dtype(jnp.float32)
    # Matmul precision for every matmul of the model: "default", "high" or "highest".
    # On CPU float32 matmuls are exact whatever this says; on NVIDIA GPUs "default" lets
    # float32 matmuls use TF32 tensor cores and "highest" forbids it.
    matmul_precision: str = "default"

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            dtype = jnp.dtype(getattr(self, field))
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"policy {field} must be a floating dtype, got {dtype}")
            object.__setattr__(self, field, dtype)
        if self.matmul_precision not in _PRECISIONS:
            raise ValueError(f"matmul precision must be one of {', '.join(_PRECISIONS)}, "
                             f"got {self.matmul_precision!r}")

    # ----------------------------------------------------------------- parsing / printing
    @classmethod
    def parse(cls, text: str, matmul_precision: str = "default") -> "Policy":
        """`fp32` | `bf16` | `fp16` | `p=..,c=..,o=..` (missing parts default to f32)."""
        text = text.strip().lower()
        if "=" not in text:
            return cls(jnp.float32, parse_dtype(text), jnp.float32, matmul_precision)
        parts = {"p": "f32", "c": "f32", "o": "f32"}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in parts:
                raise ValueError(f"bad policy {text!r}: expected p=DTYPE,c=DTYPE,o=DTYPE")
            parts[key] = value
        return cls(parse_dtype(parts["p"]), parse_dtype(parts["c"]), parse_dtype(parts["o"]),
                   matmul_precision)

    def __str__(self) -> str:
        return (f"p={_SHORT_NAMES[self.param_dtype]},c={_SHORT_NAMES[self.compute_dtype]},"
                f"o={_SHORT_NAMES[self.output_dtype]}")

    @property
    def precision(self) -> jax.lax.Precision:
        return _PRECISIONS[self.matmul_precision]

    @property
    def needs_loss_scaling(self) -> bool:
        return jnp.float16 in (self.param_dtype, self.compute_dtype)

    # ----------------------------------------------------------------------------- casts
    def cast_to_param(self, tree):
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree):
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree):
        return cast_floating(tree, self.output_dtype)


def cast_floating(tree, dtype):
    """Cast the floating-point leaves of `tree` to `dtype`; leave all other leaves alone."""
    def cast(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return jnp.asarray(x).astype(dtype)
        return x
    return jax.tree.map(cast, tree)


# --------------------------------------------------------------------------------- matmul
def matmul(x: jax.Array, w: jax.Array, precision=None) -> jax.Array:
    """``x @ w`` for x (..., K) and w (K, N), accumulating and returning float32.

    Inside shard_map, an operand that is invariant over a mesh axis the other varies
    over is first cast to varying, as jnp.matmul would do implicitly; doing it out here,
    outside the custom VJP below, lets autodiff transpose that cast as usual.
    """
    vx, vw = _varying_axes(x), _varying_axes(w)
    if vx - vw:
        w = jax.lax.pcast(w, tuple(sorted(vx - vw)), to="varying")
    if vw - vx:
        x = jax.lax.pcast(x, tuple(sorted(vw - vx)), to="varying")
    return _matmul(x, w, precision)


def _varying_axes(x) -> frozenset:
    """The manual mesh axes x varies over, inside shard_map (empty elsewhere)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying; earlier: aval.vma
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, w: jax.Array, precision=None) -> jax.Array:
    """``x @ w`` accumulating in float32 (see `matmul`).

    Inputs are expected in the compute dtype. Plain autodiff of a dot with
    ``preferred_element_type=float32`` would hand the backward pass a float32 cotangent and
    so run both backward matmuls (two thirds of training FLOPs) in float32; this custom VJP
    casts the cotangent back to the input dtype first, so they too take compute-dtype inputs
    and accumulate in float32. For float32 inputs it is exactly plain autodiff.
    """
    return jnp.matmul(x, w, precision=precision, preferred_element_type=jnp.float32)


def _matmul_fwd(x, w, precision):
    return _matmul(x, w, precision), (x, w)


def _matmul_bwd(precision, residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    dx = jnp.matmul(g, w.T, precision=precision, preferred_element_type=jnp.float32)
    x2 = x.reshape(-1, x.shape[-1])
    g2 = g.reshape(-1, g.shape[-1])
    dw = jnp.matmul(x2.T, g2, precision=precision, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# ----------------------------------------------------------------------------- loss scale
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("scale", "good_steps"),
                   meta_fields=("dynamic", "period", "factor", "min_scale"))
@dataclasses.dataclass(frozen=True)
class LossScale:
    """A dynamic (or, with ``dynamic=False``, constant 1) loss scale; a pytree.

    Its two arrays (``scale``, ``good_steps``) travel through jit, pmap and shard_map
    like any other state; the settings are static.
    """

    scale: jax.Array
    good_steps: jax.Array
    dynamic: bool = True
    period: int = 2000
    factor: float = 2.0
    min_scale: float = 1.0

    @classmethod
    def create(cls, dynamic: bool, initial_scale: float = 2.0 ** 15, period: int = 2000):
        scale = initial_scale if dynamic else 1.0
        return cls(jnp.asarray(scale, jnp.float32), jnp.asarray(0, jnp.int32), dynamic, period)

    def scale_loss(self, loss):
        return loss * self.scale.astype(loss.dtype) if self.dynamic else loss

    def unscale(self, grads):
        if not self.dynamic:
            return grads
        inv = 1.0 / self.scale
        return jax.tree.map(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), grads)

    def adjust(self, grads_finite: jax.Array) -> "LossScale":
        """After a step: grow after `period` finite steps, shrink (and reset) on overflow."""
        if not self.dynamic:
            return self
        grown = self.good_steps + 1 >= self.period
        scale = jnp.where(grads_finite,
                          jnp.where(grown, self.scale * self.factor, self.scale),
                          jnp.maximum(self.scale / self.factor, self.min_scale))
        good = jnp.where(grads_finite & ~grown, self.good_steps + 1, 0)
        return dataclasses.replace(self, scale=scale, good_steps=good.astype(jnp.int32))


def all_finite(tree) -> jax.Array:
    """True iff every element of every leaf is finite (a scalar bool array)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def select_tree(pred: jax.Array, on_true, on_false):
    """Per-leaf ``where(pred, a, b)``: used to skip a step whose gradients overflowed."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
