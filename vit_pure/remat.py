"""What an encoder block keeps for its backward pass (the --remat flag; model.encoder).

`model._block` tags values with `jax.ad_checkpoint.checkpoint_name`: matmul and attention
outputs "dot" (`save_dot`), LayerNorm outputs "ln", the GELU output "gelu", dropout and
drop-path masks "mask". A remat mode picks which of those names survive to the backward
pass (`remat_saved_names`); `save_policy` turns the names into a `jax.checkpoint` policy.
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

# Rematerialisation modes of `model.encoder`: these, or "block-save:" and names from
# REMAT_SAVE_NAMES joined by "+" (see `remat_saved_names`).
REMAT_MODES = ("none", "block", "block-save-dots")
REMAT_SAVE = "block-save:"
# What a block may keep for its backward pass under "block-save:NAMES", each a
# `checkpoint_name` put on values in `model._block`.
REMAT_SAVE_NAMES = ("dot", "ln", "gelu", "mask")
DOT, LN, GELU, MASK = REMAT_SAVE_NAMES
# JAX's cuDNN attention binds its forward kernel as a primitive of this name (plus
# "_wrapper"); its outputs are the context and the softmax statistics the backward reads.
_CUDNN_ATTENTION_FWD = "dot_product_attention_fwd"


def remat_saved_names(remat: str) -> tuple[str, ...]:
    """The names `remat` keeps for the backward pass: () for "none" and "block" (which
    keep nothing inside a block), ("dot",) for "block-save-dots", the names listed in
    "block-save:NAME+NAME..." (from REMAT_SAVE_NAMES). ValueError for anything else."""
    if remat in REMAT_MODES:
        return (DOT,) if remat == "block-save-dots" else ()
    names = remat[len(REMAT_SAVE):].split("+") if remat.startswith(REMAT_SAVE) else []
    if not names or any(n not in REMAT_SAVE_NAMES for n in names) or len(set(names)) < len(names):
        raise ValueError(f"remat must be one of {', '.join(REMAT_MODES)} or {REMAT_SAVE}NAMES "
                         f"with distinct NAMES from {'+'.join(REMAT_SAVE_NAMES)}, got {remat!r}")
    return tuple(names)


def save_dot(y):
    """Tag a matmul or attention output so that remat="block-save-dots" keeps it (an
    identity otherwise). Under an ``m=f32`` policy policy.matmul is a custom VJP, which
    hides its dot from `jax.checkpoint_policies.dots_saveable`; hence names, not that
    policy."""
    return checkpoint_name(y, DOT)


def _cudnn_attention_outputs(prim, *_, **__) -> bool:
    """A remat policy: save the outputs of cuDNN's fused attention forward (the context
    and the softmax statistics its backward reads). They sit inside JAX's custom VJP,
    where `attention.fused_attention` cannot name them."""
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
