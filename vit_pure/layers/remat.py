"""What an encoder block keeps for its backward pass (the --remat flag; model.encoder).

`model._block` tags values with `jax.ad_checkpoint.checkpoint_name`: matmul and attention
outputs "dot" (`save_dot`), LayerNorm outputs "ln", the GELU output "gelu", dropout and
drop-path masks "mask". A remat mode picks which of those names survive to the backward
pass (`config.remat_saved_names`); `save_policy` turns them into a `jax.checkpoint` policy.
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from vit_pure.config import REMAT_SAVE_NAMES

DOT, LN, GELU, MASK = REMAT_SAVE_NAMES
# JAX's cuDNN attention binds its forward kernel as a primitive of this name (plus
# "_wrapper"); its outputs are the context and the softmax statistics the backward reads.
_CUDNN_ATTENTION_FWD = "dot_product_attention_fwd"


def save_dot(y):
    """Tag a matmul or attention output so that remat="block-save-dots" keeps it (an
    identity otherwise). Under an ``m=f32`` policy policy.matmul is a custom VJP, which
    hides its dot from `jax.checkpoint_policies.dots_saveable`; hence names, not that
    policy."""
    return checkpoint_name(y, DOT)


def _cudnn_attention_outputs(prim, *_, **__) -> bool:
    """A remat policy: save the outputs of cuDNN's fused attention forward (the context
    and the softmax statistics its backward reads). They sit inside JAX's custom VJP,
    where `attention.attend_padded` cannot name them."""
    return prim.name.startswith(_CUDNN_ATTENTION_FWD)


def save_policy(names: tuple[str, ...]):
    """The remat policy that keeps the values named `names` (and, with "dot", the outputs
    of cuDNN's attention kernel: without them the backward pass would rerun the whole
    attention forward to get its softmax statistics back) and recomputes the rest."""
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    if DOT in names:
        policy = jax.checkpoint_policies.save_from_both_policies(policy,
                                                                _cudnn_attention_outputs)
    return policy
