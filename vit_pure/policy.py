"""The dtype policy: which dtype parameters are stored in, computed in, and returned in.

One frozen dataclass decides every cast in the kit: `param_dtype` (what the optimizer
updates and checkpoints hold), `compute_dtype` (matmul inputs and activations),
`output_dtype` (what `apply` returns) and `matmul_dtype` (what every matmul returns; the
product accumulates in float32 whatever it says). String form (`--policy`, `Policy.parse`):
``p=f32,c=bf16,o=f32,m=bf16``; ``fp32`` / ``bf16`` / ``fp16`` mean float32 master params
computing in that dtype with float32 outputs. ``m`` has one right answer per backend
(docs/precision.md), which the scripts pick (vit_pure/run/backend.py).

Fixed rules, whatever the policy says: only floating leaves are cast; LayerNorm
statistics, the softmax, the loss and the optimizer run in float32. Float16 needs a
dynamic loss scale (`LossScale`) against underflowing gradients.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

_DTYPE_NAMES = {
    "f32": jnp.float32, "fp32": jnp.float32, "float32": jnp.float32,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "f16": jnp.float16, "fp16": jnp.float16, "float16": jnp.float16,
}
_SHORT_NAMES = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16",
                jnp.dtype(jnp.float16): "f16"}
_PRECISIONS = {"default": jax.lax.Precision.DEFAULT, "high": jax.lax.Precision.HIGH,
               "highest": jax.lax.Precision.HIGHEST}


def dtype_name(dtype) -> str:
    """The policy string's name of a dtype: "f32", "bf16" or "f16"."""
    return _SHORT_NAMES[jnp.dtype(dtype)]


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
    matmul_dtype: jnp.dtype = jnp.dtype(jnp.float32)
    # Matmul precision for every matmul of the model: "default", "high" or "highest".
    # On CPU float32 matmuls are exact whatever this says; on NVIDIA GPUs "default" lets
    # float32 matmuls use TF32 tensor cores and "highest" forbids it.
    matmul_precision: str = "default"

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype", "matmul_dtype"):
            dtype = jnp.dtype(getattr(self, field))
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"policy {field} must be a floating dtype, got {dtype}")
            object.__setattr__(self, field, dtype)
        if self.matmul_dtype not in (jnp.dtype(jnp.float32), self.compute_dtype):
            raise ValueError(f"policy matmul dtype must be f32 or the compute dtype "
                             f"({dtype_name(self.compute_dtype)}), got "
                             f"{_SHORT_NAMES.get(self.matmul_dtype, self.matmul_dtype)}")
        if self.matmul_precision not in _PRECISIONS:
            raise ValueError(f"matmul precision must be one of {', '.join(_PRECISIONS)}, "
                             f"got {self.matmul_precision!r}")

    # ----------------------------------------------------------------- parsing / printing
    @classmethod
    def parse(cls, text: str, matmul_precision: str = "default") -> "Policy":
        """`fp32` | `bf16` | `fp16` | `p=..,c=..,o=..[,m=..]` (missing parts default to f32;
        `m=c` means "the compute dtype")."""
        text = text.strip().lower()
        if "=" not in text:
            return cls(jnp.float32, parse_dtype(text), jnp.float32, jnp.float32, matmul_precision)
        parts = {"p": "f32", "c": "f32", "o": "f32", "m": "f32"}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in parts:
                raise ValueError(f"bad policy {text!r}: expected p=DTYPE,c=DTYPE,o=DTYPE[,m=DTYPE]")
            parts[key] = value
        compute = parse_dtype(parts["c"])
        matmul = compute if parts["m"].strip() == "c" else parse_dtype(parts["m"])
        return cls(parse_dtype(parts["p"]), compute, parse_dtype(parts["o"]), matmul,
                   matmul_precision)

    @staticmethod
    def gives_matmul_dtype(text: str) -> bool:
        """Does the policy string fix the matmul output dtype (an `m=` part)?"""
        return any(item.partition("=")[0].strip() == "m" for item in text.lower().split(","))

    def __str__(self) -> str:
        return (f"p={dtype_name(self.param_dtype)},c={dtype_name(self.compute_dtype)},"
                f"o={dtype_name(self.output_dtype)},m={dtype_name(self.matmul_dtype)}")

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


def cast_floating(tree, dtype):
    """Cast the floating-point leaves of `tree` to `dtype`; leave all other leaves alone."""
    def cast(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return jnp.asarray(x).astype(dtype)
        return x
    return jax.tree.map(cast, tree)


# --------------------------------------------------------------------------------- matmul
def matmul(x: jax.Array, w: jax.Array, policy: "Policy") -> jax.Array:
    """``x @ w`` for x (..., K) and w (K, N): see `einsum`."""
    return einsum("...k,kn->...n", x, w, policy)


def einsum(spec: str, a: jax.Array, b: jax.Array, policy: "Policy") -> jax.Array:
    """A two-operand einsum, both operands in the compute dtype, accumulating in float32
    and returning ``policy.matmul_dtype``. Every matmul and attention einsum of the
    model goes through here.

    Operands must agree on the mesh axes they vary over (inside shard_map): this function
    inserts no cast between them, so no collective can hide in here; the training scripts
    and the model's tensor-parallel operators make every operand explicit.
    """
    if policy.matmul_dtype == a.dtype:
        # The output dtype is the input dtype: plain autodiff already runs both backward
        # products with compute-dtype inputs (and float32 accumulation inside the GEMM).
        return jnp.einsum(spec, a, b, precision=policy.precision,
                          preferred_element_type=policy.matmul_dtype)
    return _einsum_f32_out(spec, a, b, policy.precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _einsum_f32_out(spec: str, a: jax.Array, b: jax.Array, precision=None) -> jax.Array:
    """The einsum returning float32 for low-precision a, b (the ``m=f32`` policy).

    Plain autodiff of a product with ``preferred_element_type=float32`` would hand the
    backward pass a float32 cotangent and so run both backward products (two thirds of
    training FLOPs) with float32 operands; this custom VJP casts the cotangent back to
    the input dtype first, so they too take compute-dtype inputs and accumulate in
    float32. For float32 inputs it is exactly plain autodiff.
    """
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def _einsum_fwd(spec, a, b, precision):
    return _einsum_f32_out(spec, a, b, precision), (a, b)


def _einsum_bwd(spec, precision, residuals, g):
    # For "A,B->C" (every index of A in B or C, and of B in A or C, as in all the model's
    # products): dA = einsum("C,B->A", g, b), dB = einsum("A,C->B", a, g).
    a, b = residuals
    (sa, sb), sc = spec.split("->")[0].split(","), spec.split("->")[1]
    g = g.astype(a.dtype)
    da = jnp.einsum(f"{sc},{sb}->{sa}", g, b, precision=precision,
                    preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{sa},{sc}->{sb}", a, g, precision=precision,
                    preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


_einsum_f32_out.defvjp(_einsum_fwd, _einsum_bwd)


# ----------------------------------------------------------------------------- loss scale
@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("scale", "good_steps"),
                   meta_fields=("dynamic", "period", "factor", "min_scale"))
@dataclasses.dataclass(frozen=True)
class LossScale:
    """A dynamic (or, with ``dynamic=False``, constant 1) loss scale; a pytree.

    Float16's narrow exponent range lets small gradients underflow to zero: multiply the
    loss by S before differentiating, divide the gradients by S afterwards, halve S and
    skip the step whenever a gradient is not finite, double it after `period` finite steps
    in a row.

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


def select_tree(pred: jax.Array, on_true, on_false):
    """Per-leaf ``where(pred, a, b)``: used to skip a step whose gradients overflowed."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


