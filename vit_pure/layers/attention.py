"""Self-attention of an encoder block, one call (`self_attention`): the q, k, v
projection, attention over this device's heads, and the output projection.

Four implementations compute the same function of the same parameters
(tests/test_attention.py, tests/test_attention_pallas.py), picked by `Execution.attention`:
"einsum", the reference (`attention_einsum`, two products on (B, H, T, D)); "xla" and
"cudnn" (`attend_padded`, `jax.nn.dot_product_attention` on (B, Tp, H, D) with the tokens
padded to a multiple of 8 and the padded keys masked: `padded_projections`); "pallas"
(opt-in: layers/attention_pallas.py, a Mosaic GPU kernel for short sequences;
"pallas-interpret" runs it in JAX's interpreter on a CPU). With pool "cls" the last block
may compute the class token's row alone (`class_token_attention`).

The output projection's bias is not added here: with tensor parallelism it is a
row-parallel matmul whose partial sums `model._block` adds up first.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from einops import rearrange

from vit_pure.config import Execution, ViTConfig
from vit_pure.layers.attention_pallas import attention_pallas
from vit_pure.layers.linear import biased, copies, dense_with_ones, with_ones
from vit_pure.layers.remat import save_dot
from vit_pure.policy import Policy, einsum, matmul

F32 = jnp.float32
TOKEN_MULTIPLE = 8  # the fused attention pads the token axis to a multiple of this



def self_attention(h, a, cfg: ViTConfig, policy: Policy, execution: Execution):
    """h (B*T, E) compute dtype, a this layer's "attn" params -> the output projection's
    result (B*T, E) in the matmul dtype, before its bias. With tensor parallelism a holds
    Hl of the H heads and the result is this device's partial sum over them."""
    implementation = execution.attention
    biases = execution.qkv_biases
    E, T = h.shape[-1], cfg.seq_len
    if implementation != "einsum" and cfg.lsa:
        raise ValueError(f"{cfg.name}: locality self-attention (lsa) runs on the einsum "
                         f"attention only, not {implementation!r}")
    if implementation in ("einsum", "pallas", "pallas-interpret"):  # (B, T, Hl*D)
        w_qkv, b_qkv = a["qkv"]["kernel"].reshape(E, -1), a["qkv"]["bias"].reshape(-1)
        qkv = biased(h, w_qkv, b_qkv, policy, biases)  # (B*T, 3*Hl*D), matmul dtype
        qkv = qkv.reshape(-1, T, qkv.shape[-1]).astype(policy.compute_dtype)
        if implementation == "einsum":
            ctx = attention_einsum(qkv, cfg, policy, a.get("log_scale"))
        else:  # the kernel reads this unpadded token-major buffer as it is
            ctx = attention_pallas(qkv, cfg.head_dim,
                                   interpret=implementation == "pallas-interpret")
    else:  # (B, Tp, Hl*D)
        q, k, v = padded_projections(h, a["qkv"], cfg, policy, execution)
        ctx = attend_padded(q, k, v, T, policy, implementation)
    B, Tc = ctx.shape[:2]  # Tc > T with the fused call: its padded rows, sliced off below
    y = matmul(ctx.reshape(B * Tc, -1), a["out"]["kernel"].reshape(-1, E), policy)
    if Tc != T:
        y = y.reshape(B, Tc * E)[:, :T * E].reshape(B * T, E)
    return y


def class_token_attention(h, a, cfg: ViTConfig, policy: Policy, execution: Execution):
    """`self_attention` for the class token's row alone: h (B*T, E) compute dtype, the
    class token each example's first row -> (B, E), that row's output projection in the
    matmul dtype, before its bias (with tensor parallelism a partial sum over Hl heads).

    Keys and values come from every row (with `execution.qkv_biases` "ones-column", one
    ones-column copy of h for both, `with_ones`; else each bias after its product:
    `linear.biased`; their data gradients added as `execution.qkv_data_grads` says),
    the query from the first row alone; the two products are einsums with one query row
    (scores (B, Hl, T), no padding and no fused kernel: a (1, T) score matrix per head).
    With locality self-attention the class token's score for itself (key 0) is masked."""
    E, T, D = h.shape[-1], cfg.seq_len, cfg.head_dim
    B, cd, biases = h.shape[0] // T, policy.compute_dtype, execution.qkv_biases
    w, b = a["qkv"]["kernel"].reshape(E, 3, -1), a["qkv"]["bias"].reshape(3, -1)
    hk, hv = copies(h, 2, execution.qkv_data_grads)
    if biases == "ones-column":
        k, v = (dense_with_ones(with_ones(hi), w[:, i], b[i], policy)
                for i, hi in ((1, hk), (2, hv)))
    else:
        k, v = (biased(hi, w[:, i], b[i], policy, biases) for i, hi in ((1, hk), (2, hv)))
    k, v = (y.reshape(B, T, -1, D).astype(cd) for y in (k, v))  # (B, T, Hl, D) each
    q = biased(h.reshape(B, T, E)[:, 0], w[:, 0], b[0], policy, biases)
    q = q.reshape(B, -1, D).astype(cd)
    scores = save_dot(einsum("bhd,bthd->bht", q, k, policy)).astype(F32)  # (B, Hl, T)
    log_scale = a.get("log_scale")
    if log_scale is None:
        scores = scores / math.sqrt(D)
    else:
        scores = scores * jnp.exp(log_scale.astype(F32))[:, None]
        scores = jnp.where(jnp.arange(T) == 0, -jnp.inf, scores)  # the token itself
    probs = jax.nn.softmax(scores, axis=-1).astype(cd)
    ctx = save_dot(einsum("bht,bthd->bhd", probs, v, policy)).astype(cd)  # (B, Hl, D)
    return matmul(ctx.reshape(B, -1), a["out"]["kernel"].reshape(-1, E), policy)


def attention_einsum(qkv, cfg: ViTConfig, policy: Policy, log_scale=None):
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



def padded_length(tokens: int) -> int:
    """The token count the fused attention pads to: the next multiple of 8 (65 -> 72)."""
    return -(-tokens // TOKEN_MULTIPLE) * TOKEN_MULTIPLE


def padded_projections(h, qkv, cfg: ViTConfig, policy: Policy, execution: Execution):
    """q, k, v for the fused attention, each (B, Tp, Hl, D) in the compute dtype, made by
    its own matmul from h (B*T, E) padded on the token axis to Tp = `padded_length(T)`
    (`qkv`: this layer's "qkv" params, the same (E, 3, Hl, D) kernel as the einsum path).

    Each projection writes its array straight in the layout cuDNN reads, so nothing is
    copied between the matmul and the call: one (B*T, 3*Hl*D) matmul would leave q, k
    and v interleaved in each row, and the call's operands must be dense (a pad copy of
    all three, and its gradient, a block). The padded rows of h are zeros, XLA writes
    them in the LayerNorm's kernel (with `execution.qkv_biases` "ones-column", also
    `linear.dense`'s ones column, which adds the biases; "epilogue" adds each after its
    product; their data gradients added as `execution.qkv_data_grads` says); their
    q, k, v are the biases, masked as keys and sliced off as queries
    (`attend_padded`). The cost: three matmuls of width Hl*D
    reading h, each on Tp rows (the GEMMs' FLOPs x Tp / T for this one projection)."""
    E, T = h.shape[-1], cfg.seq_len
    B, Tp, biases = h.shape[0] // T, padded_length(T), execution.qkv_biases
    hp = jnp.pad(h.reshape(B, T, E), ((0, 0), (0, Tp - T), (0, 0))).reshape(B * Tp, E)
    w = qkv["kernel"].reshape(E, 3, -1)
    b = qkv["bias"].reshape(3, -1)
    out = []
    # The three ones-column copies of hp are one array (XLA merges the identical copies).
    for i, hi in enumerate(copies(hp, 3, execution.qkv_data_grads)):
        if biases == "ones-column":
            y = dense_with_ones(with_ones(hi), w[:, i], b[i], policy)  # (B*Tp, Hl*D)
        else:
            y = biased(hi, w[:, i], b[i], policy, biases)
        out.append(y.reshape(B, Tp, -1, cfg.head_dim).astype(policy.compute_dtype))
    return tuple(out)


def attend_padded(q, k, v, tokens: int, policy: Policy, implementation: str):
    """`jax.nn.dot_product_attention(..., implementation=)` on q, k, v padded: (B, Tp, Hl,
    D) each, compute dtype, over this device's Hl heads -> (B, Tp, Hl*D) compute dtype, no
    head transposes (the context reshapes straight into the output projection's input).
    Rows `tokens` to Tp - 1 of each example are padding (their values do not matter: the
    padded keys are masked, the padded queries' outputs sliced off by the caller, the
    block after the output projection).

    Padding: cuDNN refuses odd token counts (65 for vit-cifar), so q, k, v come padded on
    the token axis to the next multiple of 8 (65 -> 72; `padded_projections`), with
    ``key_value_seq_lengths = T``: the padded keys get zero weight (a -0.7*f32max score in
    "xla", cuDNN's padding mask in "cudnn"); the padded query rows are sliced off after
    the output projection, so their gradient is zero. Padding only q, k, v, not the whole
    residual stream, measured faster on an H100 (docs/performance.md, "Attention
    implementations").

    Precision, against the einsum reference (`attention_einsum`):
      * "xla" (JAX's reference implementation, any backend): the scores in float32
        (``preferred_element_type``; for bf16 inputs the BF16_BF16_F32 dot algorithm),
        scaled, masked and put through the softmax in float32, the probabilities cast to
        the compute dtype, the context returned in the compute dtype (float32
        accumulation inside the GEMM). `policy.matmul_dtype` is not consulted and the
        backward products come from plain autodiff (under ``m=f32`` their cotangents
        are float32, not cast to the compute dtype as `policy.einsum` does), so low-
        precision results differ from the einsum path by bf16 rounding, float32 results
        by float32 rounding. The policy's matmul precision applies to the float32 case
        (``jax.default_matmul_precision``).
      * "cudnn" (NVIDIA GPUs, bf16 / fp16 inputs only): cuDNN's flash attention, both
        products accumulating in float32 and the softmax computed online in float32; the
        probabilities are rounded to the input dtype before the second product, as in the
        einsum path; the context comes back in the compute dtype. The backward pass
        recomputes the probabilities from the saved softmax statistics instead of
        keeping the (T, T) matrix. benchmarks/probes/attention_check.py compares its
        gradients with the einsum path's on a GPU.
    The kit has no dropout on the attention probabilities (its dropout sits on full-width
    activations), so the fused call needs none.

    Under remat="block-save-dots": with "cudnn" the kernel's own outputs (the padded
    context and the softmax statistics) are saved, so the backward pass runs only cuDNN's
    backward kernel; with "xla" the padded context is saved and the products inside the
    call are recomputed.
    """
    B, Tp = q.shape[:2]
    lengths = None if Tp == tokens else jnp.full((B,), tokens, jnp.int32)  # no mask, no pad
    precision = (None if policy.matmul_precision == "default" else policy.matmul_precision)
    with jax.default_matmul_precision(precision):
        ctx = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                           implementation=implementation)  # (B, Tp, Hl, D)
    ctx = ctx.astype(policy.compute_dtype)
    if implementation != "cudnn":  # cuDNN's output is saved as it is (`remat.save_policy`)
        ctx = save_dot(ctx)
    return rearrange(ctx, "b t h d -> b t (h d)")
