"""Fused attention: `jax.nn.dot_product_attention` in place of the einsum reference.

The reference attention is `model._attention_einsum` (the --attention default "einsum"):
two `policy.einsum` products on (B, H, T, D), with the head transposes that layout needs.
"xla" and "cudnn" (`fused_attention`; the scripts pick "cudnn" on NVIDIA GPUs in bf16,
vit_pure/run/backend.py) call `jax.nn.dot_product_attention` on (B, T, H, D), straight
from the qkv matmul's layout, with the token axis padded to a multiple of 8 around the
call and the padded keys masked. All three compute the same function of the same
parameters (tests/test_attention.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from einops import rearrange

from vit_pure.config import ViTConfig
from vit_pure.policy import Policy
from vit_pure.remat import save_dot

TOKEN_MULTIPLE = 8  # the fused attention pads the token axis to a multiple of this


def padded_length(tokens: int) -> int:
    """The token count the fused attention pads to: the next multiple of 8 (65 -> 72)."""
    return -(-tokens // TOKEN_MULTIPLE) * TOKEN_MULTIPLE


def fused_attention(qkv, cfg: ViTConfig, policy: Policy, implementation: str):
    """`jax.nn.dot_product_attention(..., implementation=)` on (B, T, H, D): qkv
    (B, T, 3*Hl*D) compute dtype -> (B, Tp, Hl*D) compute dtype, Tp = `padded_length(T)`,
    over this device's Hl heads, with no head transposes (q, k, v are slices of the qkv
    matmul's output, the context reshapes straight into the output projection's input).
    Rows T to Tp - 1 of each example are padding: the caller slices them off (the block
    does after the output projection, which then reads the kernel's output as it is).

    Padding: cuDNN refuses odd token counts (65 for vit-cifar), so q, k, v are padded with
    zeros on the token axis to the next multiple of 8 (65 -> 72) for this call only, with
    ``key_value_seq_lengths = T``: the padded keys get zero weight (a -0.7*f32max score in
    "xla", cuDNN's padding mask in "cudnn"); the padded query rows are sliced off after
    the output projection, so their gradient is zero. Padding only here, not the whole
    token axis, measured faster on an H100 (docs/performance.md, "Attention
    implementations").

    Precision, against the einsum reference (`model._attention_einsum`):
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
    T = qkv.shape[1]
    q, k, v = (rearrange(qkv, "b t (three h d) -> b t three h d", three=3,
                         d=cfg.head_dim)[:, :, i] for i in range(3))  # (B, T, Hl, D) each
    Tp = padded_length(T)
    q, k, v = (jnp.pad(a, ((0, 0), (0, Tp - T), (0, 0), (0, 0))) for a in (q, k, v))
    return attend_padded(q, k, v, T, policy, implementation)


def attend_padded(q, k, v, tokens: int, policy: Policy, implementation: str):
    """`fused_attention` from q, k, v already padded: (B, Tp, Hl, D) each, compute dtype,
    rows `tokens` to Tp - 1 of each example padding (their values do not matter: the
    padded keys are masked, the padded queries' outputs sliced off by the caller).
    Returns (B, Tp, Hl*D). The Pallas q, k, v projection (vit_pure/pallas/qkv.py) writes
    its outputs in this form, so the split and the padding copy are not made."""
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
