"""A Vision Transformer as two pure functions over a nested dict of arrays.

    params = init_params(key, cfg)                      # dict of jax.Array, nothing else
    logits = apply(params, images, cfg, policy, train=True, rng=key, example_ids=ids)

Axis letters in shape comments:
    B batch   T tokens (patches + class token, if any)   E embedding width   H heads
    D head dim (E = H * D)   M MLP hidden   L encoder layers   P patch pixels (p*p*C)
    K classes

Parameter layout (`init_params`); the encoder blocks are *stacked* along a leading layer
axis L, one layout for every use (a Python loop or `lax.scan` over it, and a pipeline
shards it):

    stem/conv{i}/kernel (3, 3, C_in, C_out)  stem/conv{i}/bias (C_out,)   (cfg.stem only)
    patch_embed/kernel (P, E)   patch_embed/bias (E,)
    cls_token (E,)              pos_embed (T, E)         (no cls_token with cfg.pool "gap")
    blocks/ln1/{scale,bias} (L, E)
    blocks/attn/qkv/kernel (L, E, 3, H, D)     blocks/attn/qkv/bias (L, 3, H, D)
    blocks/attn/out/kernel (L, H, D, E)        blocks/attn/out/bias (L, E)
    blocks/attn/log_scale (L, H)                                           (cfg.lsa only)
    blocks/ln2/{scale,bias} (L, E)
    blocks/mlp/fc1/kernel (L, E, M)            blocks/mlp/fc1/bias (L, M)
    blocks/mlp/fc2/kernel (L, M, E)            blocks/mlp/fc2/bias (L, E)
    final_ln/{scale,bias} (E,)
    head/kernel (E, K)          head/bias (K,)

`param_axes(cfg)` gives the same tree with each leaf's logical axis names (for sharding
rules). Initialisation follows common ViT practice (ViT, DeiT, timm): every weight matrix,
the position embedding and the head from a normal with std 0.02 truncated at two standard
deviations (rescaled so the std really is 0.02); biases and the class token zero;
LayerNorm scale one, bias zero. The optional convolutional stem's kernels (cfg.stem;
Xiao et al. 2021, "Early convolutions help transformers see better", arXiv:2106.14881)
are drawn with He et al.'s fan-in scaling (std sqrt(2 / (9 C_in))), as for any
convolution followed by a rectifier-like activation with no normalisation. Locality
self-attention's log-temperatures (cfg.lsa) start at log(1/sqrt(D)), the plain scale.

Regularisation: dropout (rate `cfg.dropout`) after the embedding and at the end of each
residual branch (after the attention output projection and after the second MLP layer);
stochastic depth (`cfg.drop_path`) drops a whole residual branch per example, with the
rate growing linearly from 0 at the first block to `cfg.drop_path` at the last. Every
random mask is drawn from `fold_in(rng, example_id)` (then the layer and the site), so it
belongs to the example, not to the device holding it: 1, 2 or 8 devices give the same
numbers. All dropout sites sit on full-width activations, so tensor parallelism needs no
special care either.

Tensor parallelism (`tp_axis`): inside `shard_map`, the attention heads and the MLP hidden
units may be split over a mesh axis. The block then reads its local head count from the
kernel shapes, and the two Megatron operators appear in `_block`: `_copy_to_tp` (identity
forward, all-reduce of the gradient backward: "f") before each column-parallel matmul and
`_reduce_from_tp` (all-reduce forward, identity backward: "g") after each row-parallel one.

Attention: `_attention_einsum` is the reference (two `policy.einsum` products on
(B, H, T, D)); vit_pure/attention.py holds the fused variants ("xla", "cudnn"), which
compute the same function of the same parameters (tests/test_attention.py). Dropout masks
(vit_pure/dropout.py) and what a rematerialised block keeps (vit_pure/remat.py) sit beside
it too.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.ad_checkpoint import checkpoint_name

from vit_pure.attention import attend_padded, fused_attention, padded_length
from vit_pure.config import Execution, ViTConfig, remat_saved_names
from vit_pure.dropout import (
    apply_mask,
    example_keys,
    keep_bytes,
    keep_mask,
    keep_probability,
    site_keys,
)
from vit_pure.pallas import qkv as qkv_kernel
from vit_pure.pallas.mlp import (
    gelu_and_slope,
    gelu_fc2_backward,
    gelu_fc2_forward,
    gelu_fc2_weight_gradient,
    tiles,
)
from vit_pure.policy import Policy, einsum, matmul
from vit_pure.remat import GELU, LN, MASK, save_dot, save_policy

F32 = jnp.float32
_INIT_STD = 0.02
# Dropout sites, folded into each example's key with the layer index.
_SITE_EMBED, _SITE_ATTN, _SITE_MLP, _SITE_PATH_ATTN, _SITE_PATH_MLP = range(5)


# ------------------------------------------------------------------------ initialisation
def _trunc_normal(key, shape, dtype):
    # std of a unit normal truncated to [-2, 2] is 0.8796; divide it out.
    return (_INIT_STD / 0.87962566) * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)


def init_params(key: jax.Array, cfg: ViTConfig, dtype=jnp.float32) -> dict:
    """Fresh parameters for `cfg`, as a nested dict of arrays (see the module docstring)."""
    E, H, D, M, L = cfg.width, cfg.heads, cfg.head_dim, cfg.mlp_dim, cfg.depth
    keys = iter(jax.random.split(key, 8))

    def w(shape):
        return _trunc_normal(next(keys), shape, dtype)

    def zeros(*shape):
        return jnp.zeros(shape, dtype)

    def ones(*shape):
        return jnp.ones(shape, dtype)

    params = {
        "patch_embed": {"kernel": w((cfg.patch_dim, E)), "bias": zeros(E)},
        **({"cls_token": zeros(E)} if cfg.class_token else {}),
        "pos_embed": w((cfg.seq_len, E)),
        "blocks": {
            "ln1": {"scale": ones(L, E), "bias": zeros(L, E)},
            "attn": {
                "qkv": {"kernel": w((L, E, 3, H, D)), "bias": zeros(L, 3, H, D)},
                "out": {"kernel": w((L, H, D, E)), "bias": zeros(L, E)},
            },
            "ln2": {"scale": ones(L, E), "bias": zeros(L, E)},
            "mlp": {
                "fc1": {"kernel": w((L, E, M)), "bias": zeros(L, M)},
                "fc2": {"kernel": w((L, M, E)), "bias": zeros(L, E)},
            },
        },
        "final_ln": {"scale": ones(E), "bias": zeros(E)},
        "head": {"kernel": w((E, cfg.num_classes)), "bias": zeros(cfg.num_classes)},
    }
    if cfg.stem:  # keys of its own: every other param is drawn as without a stem
        stem, c_in = {}, cfg.channels
        for i, c_out in enumerate(cfg.stem):
            std = math.sqrt(2.0 / (9 * c_in))
            k = jax.random.normal(jax.random.fold_in(key, 1000 + i), (3, 3, c_in, c_out))
            stem[f"conv{i}"] = {"kernel": (std * k).astype(dtype), "bias": zeros(c_out)}
            c_in = c_out
        params = {"stem": stem, **params}
    if cfg.lsa:  # no key: the plain attention's scale, so every other param is unchanged
        params["blocks"]["attn"]["log_scale"] = jnp.full((L, H), -0.5 * math.log(D), dtype)
    return params


def param_axes(cfg: ViTConfig) -> dict:
    """Logical axis names of every parameter, in the same tree as `init_params`."""
    ln = {"scale": ("layers", "embed"), "bias": ("layers", "embed")}
    conv = {"kernel": ("conv_h", "conv_w", "stem_in", "stem_out"), "bias": ("stem_out",)}
    stem = {"stem": {f"conv{i}": dict(conv) for i in range(len(cfg.stem))}} if cfg.stem else {}
    lsa = {"log_scale": ("layers", "heads")} if cfg.lsa else {}
    return {
        **stem,
        "patch_embed": {"kernel": ("patch", "embed"), "bias": ("embed",)},
        **({"cls_token": ("embed",)} if cfg.class_token else {}),
        "pos_embed": ("tokens", "embed"),
        "blocks": {
            "ln1": dict(ln),
            "attn": {
                "qkv": {"kernel": ("layers", "embed", "qkv", "heads", "head_dim"),
                        "bias": ("layers", "qkv", "heads", "head_dim")},
                "out": {"kernel": ("layers", "heads", "head_dim", "embed"),
                        "bias": ("layers", "embed")},
                **lsa,
            },
            "ln2": dict(ln),
            "mlp": {
                "fc1": {"kernel": ("layers", "embed", "mlp"), "bias": ("layers", "mlp")},
                "fc2": {"kernel": ("layers", "mlp", "embed"), "bias": ("layers", "embed")},
            },
        },
        "final_ln": {"scale": ("embed",), "bias": ("embed",)},
        "head": {"kernel": ("embed", "classes"), "bias": ("classes",)},
    }


def count_params(params) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


# ---------------------------------------------------------------------------- primitives
def _layer_norm(x, p, eps):
    """LayerNorm with float32 statistics; returns x's dtype (`_normalise`)."""
    return _normalise(x, _varying_like(p["scale"], x), _varying_like(p["bias"], x), eps)


def _varying_like(w, x):
    """w marked as varying over the manual mesh axes x varies over (inside shard_map;
    outside, w itself), as autodiff's implicit broadcast does: a custom VJP's cotangent
    for w must have w's type, and the transpose of this cast sums it over those axes."""
    axes = jax.typeof(x).mat.varying - jax.typeof(w).mat.varying
    return jax.lax.pcast(w, tuple(sorted(axes, key=str)), to="varying") if axes else w


def _ln_statistics(x, eps):
    """Per-token mean and 1 / std over the last axis, float32, shape (..., 1)."""
    xf = x.astype(F32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return mean, jax.lax.rsqrt(var + eps)


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


def _bias(y, bias, barrier=False):
    """`_add_bias`(y, bias) with bias marked varying like y (`_varying_like`), as
    `_layer_norm` does for its params."""
    return _add_bias(y, _varying_like(bias, y), barrier)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gelu(x, dtype):
    """GELU (tanh form, `jax.nn.gelu`) of x in x's dtype (the matmul dtype), returned
    in `dtype`.

    Written in x's dtype right after fc1's matmul and bias add so that XLA:GPU folds it
    into the GEMM: cuBLASLt's `BIAS_GELU_AUX` epilogue applies bias and GELU before it
    rounds its result, and writes x too, for the backward. A custom VJP so that the
    backward keeps only x, in the matmul dtype, and evaluates the derivative's formula in
    float32, returning x's gradient in x's dtype."""
    return jax.nn.gelu(x).astype(dtype)


def _gelu_fwd(x, dtype):
    return _gelu(x, dtype), x


def _gelu_bwd(dtype, x, dz):
    _, slope = gelu_and_slope(x.astype(F32))
    return ((dz.astype(F32) * slope).astype(x.dtype),)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _gelu_matmul(x, w, dtype, policy: Policy, recompute: bool):
    """`_gelu`(x) @ w with the policy's matmul. With `recompute` (remat "none", where
    nothing else is recomputed) the GELU's output, a (B*T, M) activation, is not kept
    for the backward pass: the backward recomputes it from x, which the GELU's
    derivative reads anyway, and XLA makes both in one kernel. A block then holds one
    (B*T, M) array less and writes one more (docs/performance.md, "Cutting the
    headline's traffic, deviceless"). Under the other remat modes the block's own
    checkpoint decides what is kept."""
    def gelu_matmul(x, w):
        return matmul(checkpoint_name(_gelu(x, dtype), GELU), w, policy)

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
    """fc2(gelu(h + bias)): `_bias`, `_gelu` and `_gelu_matmul` (remat "none") in one, as
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


def _qkv_pallas_fits(h, w, tokens: int, policy: Policy) -> bool:
    """Whether `_padded_qkv`'s kernels take the LayerNorm's output h (B*T, E) and the qkv
    kernel w (E, 3*Hl*D): their tiles fit the padded rows, and h, w and the matmul's
    output share one dtype (the kernels' dots read the incoming gradients and w)."""
    rows = h.shape[0] // tokens * padded_length(tokens)
    return (h.ndim == 2 and h.dtype == w.dtype == policy.matmul_dtype
            and qkv_kernel.tiles(rows, w.shape[0], w.shape[1] // 3) is not None)


def _padded_qkv(h, w, bias, tokens: int, cfg: ViTConfig, policy: Policy):
    """q, k, v for the fused attention, (B, Tp, Hl, D) each in the compute dtype, padded as
    `attention.attend_padded` takes them: h (B*T, E) is padded to Tp rows an example (the
    zero rows are written by the LayerNorm's kernel) and `_qkv_projection` writes the three
    straight from it, with no (B*T, 3*Hl*D) array and no split-and-pad copy."""
    E, Tp = h.shape[-1], padded_length(tokens)
    hp = jnp.pad(h.reshape(-1, tokens, E), ((0, 0), (0, Tp - tokens), (0, 0)))
    qkv = _qkv_projection(hp.reshape(-1, E), w, _varying_like(bias, h), policy)
    D = cfg.head_dim
    return tuple(save_dot(a).astype(policy.compute_dtype).reshape(-1, Tp, a.shape[-1] // D, D)
                 for a in qkv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _qkv_projection(hp, w, bias, policy: Policy):
    """(q, k, v) = hp @ w + bias, split into thirds by columns, (rows, Hl*D) each in the
    matmul dtype: one Pallas kernel forward and one for the input gradient and the bias
    gradient (vit_pure/pallas/qkv.py; `Execution.qkv_projection`); the weight gradient is
    three XLA GEMMs. Keeps hp for the backward, as the reference keeps h."""
    return qkv_kernel.projection(hp, w, bias, policy.matmul_dtype,
                                 precision=policy.precision)


def _qkv_projection_fwd(hp, w, bias, policy):
    return _qkv_projection(hp, w, bias, policy), (hp, w, bias)


def _qkv_projection_bwd(policy, residuals, cotangents):
    hp, w, bias = residuals
    dq, dk, dv = (d.astype(w.dtype) for d in cotangents)
    dhp, dbias = qkv_kernel.projection_input_gradient(dq, dk, dv, w, hp.dtype,
                                                      precision=policy.precision)
    dw = jnp.concatenate([jnp.einsum("re,rn->en", hp, d, precision=policy.precision,
                                     preferred_element_type=w.dtype) for d in (dq, dk, dv)],
                         axis=1)
    return dhp, dw, dbias.astype(bias.dtype)


_qkv_projection.defvjp(_qkv_projection_fwd, _qkv_projection_bwd)


def _dropout(x, rate, ex_keys, layer, site, masks="bernoulli", packed=True):
    """Dropout on x (B, T, E) or (B*T, E): each example's elements lie together, and its
    mask over them (x.size / B, drawn as one flat vector) comes from its own key. With
    `packed` (`Execution.packed_masks`) the mask is kept eight elements a byte along E,
    when E is a multiple of 8."""
    if ex_keys is None or rate == 0.0:
        return x
    keys = site_keys(ex_keys, layer, site)
    per_example = x.size // keys.shape[0]
    if packed and x.shape[-1] % 8 == 0:  # each example's bytes, as rows of E / 8
        keep = jax.vmap(lambda k: keep_bytes(k, per_example // 8, rate, masks))(keys)
        keep = keep.reshape(*x.shape[:-1], -1)
    else:
        keep = jax.vmap(lambda k: keep_mask(k, (per_example,), rate, masks))(keys)
        keep = keep.reshape(x.shape)
    return apply_mask(x, checkpoint_name(keep, MASK), keep_probability(rate, masks))


def _drop_path(x, rate, ex_keys, layer, site):
    """Stochastic depth: zero the whole residual branch x (B*T, E) for some examples."""
    if ex_keys is None:
        return x
    keys = site_keys(ex_keys, layer, site)
    keep = checkpoint_name(jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate))(keys), MASK)
    keep = jnp.repeat(keep, x.shape[0] // keep.shape[0])  # (B*T,): each token its example's
    return jnp.where(keep[:, None], x / (1.0 - rate), 0).astype(x.dtype)


def _copy_to_tp(x, tp_axis):
    """Megatron's "f": identity forward; backward, all-reduce the gradient over `tp_axis`.

    x is the same on every device of `tp_axis`; each device feeds it to its own slice of a
    column-parallel matmul, so x's gradient is the sum of the slices' contributions.
    """
    return x if tp_axis is None else jax.lax.pcast(x, tp_axis, to="varying")


def _reduce_from_tp(y, tp_axis):
    """Megatron's "g": all-reduce forward (sum the row-parallel partial products over
    `tp_axis`); backward, the identity."""
    return y if tp_axis is None else jax.lax.psum(y, tp_axis)


# ----------------------------------------------------------------------------- attention
def _attention_einsum(qkv, cfg: ViTConfig, policy: Policy, log_scale=None):
    """The reference attention: qkv (B, T, 3*Hl*D) compute dtype -> (B, T, Hl*D) compute
    dtype, over this device's Hl heads.

    Locality self-attention (cfg.lsa; `log_scale` (Hl,), this layer's heads): each head's
    scores are scaled by exp(log_scale) instead of 1/sqrt(D), and each token's score for
    itself is masked (-inf, so zero weight after the softmax).

    Both products go through `policy.einsum` (compute-dtype inputs, float32 accumulation,
    `policy.matmul_dtype` out, the policy's matmul precision; under ``m=f32`` its custom
    VJP runs the backward products with compute-dtype inputs too). The scores are scaled
    and the softmax taken in float32; the probabilities enter the second product in the
    compute dtype. The (B, H, T, D) layout costs a transpose of q, k, v and of the
    context (and their transposes again in the backward pass).
    """
    cd = policy.compute_dtype
    q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, d=cfg.head_dim)
    scores = save_dot(einsum("bhqd,bhkd->bhqk", q, k, policy))
    if log_scale is None:
        scores = scores.astype(F32) / math.sqrt(cfg.head_dim)
    else:
        scores = scores.astype(F32) * jnp.exp(log_scale.astype(F32))[:, None, None]
        self_score = jnp.eye(scores.shape[-1], dtype=bool)  # (T, T): query i, key i
        scores = jnp.where(self_score, -jnp.inf, scores)
    probs = jax.nn.softmax(scores, axis=-1)  # f32
    ctx = save_dot(einsum("bhqk,bhkd->bhqd", probs.astype(cd), v, policy))
    return rearrange(ctx.astype(cd), "b h t d -> b t (h d)")


# --------------------------------------------------------------------------- the network
def compute_params(tree, policy: Policy, gather: Callable | None = None, path: str = ""):
    """Parameters as a layer uses them: gathered by the FSDP hook (if any), then cast to
    the compute dtype; the one place params change dtype.

    `path` is where `tree` sits in the params ("" for the top level, "blocks" for one
    layer's params, its layer axis sliced off): the hook looks each leaf up by its full
    path, e.g. "blocks/mlp/fc1/kernel". The hook receives the master (float32) shards and
    casts before it gathers, so the weights travel in the compute dtype while their
    gradients come back, reduce-scattered, in float32 (train_shardmap.fsdp_gather).
    """
    if gather is not None:
        tree = gather(tree, path)
    return policy.cast_to_compute(tree)


def _conv3x3_stride2(x, p, policy: Policy):
    """One stem layer: x (B, h, w, C) -> GELU(conv3x3 stride 2, zero padding 1) (B, h/2,
    w/2, C_out) in the compute dtype. Written as a matmul over the nine taps, so that it
    runs through the policy's matmul like every other product of the model: output pixel
    (i, j) reads input pixels 2i-1..2i+1, 2j-1..2j+1."""
    _, h, w, c = x.shape
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    taps = [xp[:, di:di + h:2, dj:dj + w:2] for di in range(3) for dj in range(3)]
    cols = jnp.concatenate(taps, axis=-1)  # (B, h/2, w/2, 9C), ordered (di, dj, c)
    y = matmul(cols, p["kernel"].reshape(9 * c, -1), policy)
    return jax.nn.gelu(y.astype(F32) + p["bias"].astype(F32)).astype(policy.compute_dtype)


def embed(params, images, cfg: ViTConfig, policy: Policy, ex_keys=None,
          execution: Execution = Execution()):
    """images (B, h, w, C) float -> tokens (B, T, E) in the compute dtype."""
    cd = policy.compute_dtype
    x = images.astype(cd)
    for i in range(len(cfg.stem)):
        x = _conv3x3_stride2(x, params["stem"][f"conv{i}"], policy)
    p = cfg.stem_patch
    patches = rearrange(x, "b (gh p1) (gw p2) c -> b (gh gw) (p1 p2 c)", p1=p, p2=p)
    x = matmul(patches, params["patch_embed"]["kernel"], policy)
    x = x.astype(F32) + params["patch_embed"]["bias"].astype(F32)  # (B, patches, E) f32
    if cfg.class_token:
        cls = jnp.broadcast_to(params["cls_token"].astype(F32), (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1)
    x = x + params["pos_embed"].astype(F32)  # (B, T, E)
    return _dropout(x.astype(cd), cfg.dropout, ex_keys, 0, _SITE_EMBED, execution.dropout_masks,
                    execution.packed_masks)


def _block(p, x, layer, cfg: ViTConfig, policy: Policy, ex_keys, execution: Execution,
           tp_axis):
    """One pre-LayerNorm encoder block. p: this layer's params (no L axis); x (B*T, E),
    the residual stream as one row per token (`encoder`); attention alone sees (B, T)."""
    # Matmuls return the policy's matmul dtype (bf16 on GPU, f32 on CPU, see policy.py);
    # their bias adds (`_bias`) and the GELU (`_gelu`) run in it, the softmax and
    # LayerNorm in f32.
    cd = policy.compute_dtype
    attention = execution.attention
    masks = (execution.dropout_masks, execution.packed_masks)  # how dropout draws and keeps
    E, T = x.shape[-1], cfg.seq_len
    # Stochastic depth rate grows linearly with the (possibly traced) layer index.
    path_rate = cfg.drop_path * layer / max(cfg.depth - 1, 1)
    path_keys = ex_keys if cfg.drop_path > 0 else None

    # Multi-head self-attention; with tensor parallelism this device holds Hl of H heads.
    a = p["attn"]
    h = _copy_to_tp(checkpoint_name(_layer_norm(x, p["ln1"], cfg.ln_eps), LN), tp_axis)
    if attention != "einsum" and cfg.lsa:
        raise ValueError(f"{cfg.name}: locality self-attention (lsa) runs on the einsum "
                         f"attention only, not {attention!r}")
    w_qkv, b_qkv = a["qkv"]["kernel"].reshape(E, -1), a["qkv"]["bias"].reshape(-1)
    if (attention != "einsum" and execution.qkv_projection == "pallas"
            and _qkv_pallas_fits(h, w_qkv, T, policy)):
        q, k, v = _padded_qkv(h, w_qkv, b_qkv, T, cfg, policy)  # (B, Tp, Hl, D) each
        ctx = attend_padded(q, k, v, T, policy, attention)  # (B, Tp, Hl*D)
    else:
        qkv = save_dot(matmul(h, w_qkv, policy))  # (B*T, 3*Hl*D) in the matmul dtype
        qkv = _bias(qkv, b_qkv)
        qkv = qkv.reshape(-1, T, qkv.shape[-1])
        if attention == "einsum":  # (B, T, Hl*D)
            ctx = _attention_einsum(qkv.astype(cd), cfg, policy, a.get("log_scale"))
        else:  # (B, Tp, Hl*D)
            ctx = fused_attention(qkv.astype(cd), cfg, policy, attention)
    B, Tc = ctx.shape[:2]  # Tc > T with the fused call: its padded rows, sliced off below
    y = matmul(ctx.reshape(B * Tc, -1), a["out"]["kernel"].reshape(-1, E), policy)
    if Tc != T:
        y = y.reshape(B, Tc * E)[:, :T * E].reshape(B * T, E)
    y = save_dot(_reduce_from_tp(y, tp_axis))  # the sum over heads
    y = _bias(y, a["out"]["bias"])
    y = _dropout(y.astype(cd), cfg.dropout, ex_keys, layer + 1, _SITE_ATTN, *masks)
    x = x + _drop_path(y, path_rate, path_keys, layer + 1, _SITE_PATH_ATTN)

    # MLP; with tensor parallelism this device holds Ml of M hidden units.
    m = p["mlp"]
    h = _copy_to_tp(checkpoint_name(_layer_norm(x, p["ln2"], cfg.ln_eps), LN), tp_axis)
    h = save_dot(matmul(h, m["fc1"]["kernel"], policy))  # (B*T, Ml), matmul dtype
    if execution.mlp_kernels == "pallas" and _mlp_pallas_fits(h, m["fc2"]["kernel"], policy):
        y = _bias_gelu_fc2(h, _varying_like(m["fc1"]["bias"], h), m["fc2"]["kernel"], policy)
    else:
        h = _bias(h, m["fc1"]["bias"], barrier=True)
        y = _gelu_matmul(h, m["fc2"]["kernel"], cd, policy,
                         recompute=execution.remat == "none")
    y = save_dot(_reduce_from_tp(y, tp_axis))
    y = _bias(y, m["fc2"]["bias"])
    y = _dropout(y.astype(cd), cfg.dropout, ex_keys, layer + 1, _SITE_MLP, *masks)
    return x + _drop_path(y, path_rate, path_keys, layer + 1, _SITE_PATH_MLP)


def encoder(blocks, x, cfg: ViTConfig, policy: Policy, ex_keys=None, *,
            execution: Execution = Execution(), tp_axis=None, gather: Callable | None = None,
            layer_offset=0):
    """Run the stacked blocks (leading axis = layers) over x (B, T, E); returns (B, T, E).

    Inside, the residual stream is a (B*T, E) matrix, one row per token (a free reshape):
    every matmul, LayerNorm, bias, GELU and dropout then works on rows, and attention
    alone reshapes to (B, T). Carried as (B, T, E), XLA:GPU lays the stream out batch-
    minor and transposes it around every matmul (docs/performance.md, "Cutting the
    headline's traffic, deviceless").

    `layer_offset` is the global index of blocks[0] (pipeline stages hold a slice of the
    layers; the index seeds dropout). Each layer's params are made ready just before use
    (`compute_params`: the FSDP `gather(layer_params, "blocks")` hook if given, then the
    cast to the compute dtype). `execution` picks the layer loop (a scan or unrolled),
    what the backward pass keeps (remat), the attention implementation and the dropout
    masks: see `config.Execution`.
    """
    saved = remat_saved_names(execution.remat)
    num_layers = jax.tree.leaves(blocks)[0].shape[0]

    def body(x, p_and_layer):
        p, layer = p_and_layer
        p = compute_params(p, policy, gather, "blocks")
        return _block(p, x, layer, cfg, policy, ex_keys, execution, tp_axis)

    if execution.remat == "block":
        body = jax.checkpoint(body)  # saves nothing inside the block
    elif saved:
        body = jax.checkpoint(body, policy=save_policy(saved))
    layers = layer_offset + jnp.arange(num_layers)
    B, T, E = x.shape
    if T != cfg.seq_len:  # `_block` splits the rows into examples of cfg.seq_len tokens
        raise ValueError(f"{cfg.name}: the encoder takes {cfg.seq_len} tokens, got {T}")
    x = x.reshape(B * T, E)
    if execution.scan:
        x, _ = jax.lax.scan(lambda x, pl: (body(x, pl), None), x, (blocks, layers))
    else:
        for i in range(num_layers):
            x = body(x, (jax.tree.map(lambda a: a[i], blocks), layers[i]))
    return x.reshape(B, T, E)


def head(params, x, cfg: ViTConfig, policy: Policy):
    """tokens (B, T, E) -> logits (B, K) in the output dtype: from the class token, or from
    the mean of the patch tokens, taken in float32 (cfg.pool "mean": every token but the
    class token; "gap": every token, there being no class token)."""
    if cfg.pool == "cls":
        feature = x[:, 0]
    else:
        patches = x[:, 1:] if cfg.class_token else x
        feature = jnp.mean(patches.astype(F32), axis=1).astype(x.dtype)  # (B, E)
    feature = _layer_norm(feature, params["final_ln"], cfg.ln_eps)
    logits = matmul(feature, params["head"]["kernel"], policy)
    logits = logits.astype(F32) + params["head"]["bias"].astype(F32)
    return logits.astype(policy.output_dtype)


def dropout_keys(cfg: ViTConfig, train: bool, rng, example_ids, batch_size: int):
    """The per-example keys (B,) of a forward pass's dropout and stochastic depth, or None
    when it draws nothing (evaluation, or both rates 0). Used by `apply` and by
    `pipeline.pipelined_logits`. example_ids default to 0..B-1."""
    if not train or (cfg.dropout == 0 and cfg.drop_path == 0):
        return None
    if rng is None:
        raise ValueError("train=True needs rng for dropout / drop path")
    if example_ids is None:
        example_ids = jnp.arange(batch_size)
    return example_keys(rng, example_ids)


def apply(params, images, cfg: ViTConfig, policy: Policy = Policy(), *, train: bool = False,
          rng: jax.Array | None = None, example_ids: jax.Array | None = None,
          execution: Execution = Execution(), tp_axis: str | None = None,
          gather: Callable | None = None) -> jax.Array:
    """The forward pass: images (B, h, w, C), normalised floats -> logits (B, K).

    train: turn on dropout and stochastic depth (needs `rng`). example_ids (B,) int: each
    example's index in the *global* batch (default 0..B-1); it seeds that example's masks,
    so a batch split over devices gives the same masks as one device. `execution`
    (config.Execution: layer loop, remat, attention, dropout masks), `tp_axis` and
    `gather`: see `encoder`.
    """
    ex_keys = dropout_keys(cfg, train, rng, example_ids, images.shape[0])
    top = compute_params({k: v for k, v in params.items() if k != "blocks"}, policy, gather)
    x = embed(top, images, cfg, policy, ex_keys, execution)
    x = encoder(params["blocks"], x, cfg, policy, ex_keys, execution=execution,
                tp_axis=tp_axis, gather=gather)
    return head(top, x, cfg, policy)
