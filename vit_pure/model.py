"""A Vision Transformer as two pure functions over a nested dict of arrays.

    params = init_params(key, cfg)                      # dict of jax.Array, nothing else
    logits = apply(params, images, cfg, policy, train=True, rng=key, example_ids=ids)

Axis letters in shape comments: B batch, T tokens, E width, H heads, D head dim (E = H*D),
M MLP hidden, L layers, P patch pixels (p*p*C), K classes. The blocks are stacked along L
(`blocks/attn/qkv/kernel` is (L, E, 3, H, D)): one layout for a loop, a `lax.scan` and a
pipeline; `param_axes(cfg)` names each leaf's axes (every parameter: docs/training.md).
`_block` is LayerNorm -> attention -> residual -> LayerNorm -> MLP -> residual, calls into
vit_pure/layers/; masks come from `fold_in(rng, example_id)`, the same on any device count.
Tensor parallelism (`Parallel.tp_axis`) splits heads and MLP units over a mesh axis with Megatron's
two operators, here: `_copy_to_tp` ("f") before each column-parallel matmul and
`_reduce_from_tp` ("g") after each row-parallel one.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.ad_checkpoint import checkpoint_name

from vit_pure.config import Execution, ViTConfig, class_token_rows, remat_saved_names
from vit_pure.layers.attention import class_token_attention, self_attention
from vit_pure.layers.dropout import drop_path, dropout, example_keys
from vit_pure.layers.linear import add_bias, varying_like
from vit_pure.layers.mlp import mlp
from vit_pure.layers.norm import fold_affine, layer_norm, standardise
from vit_pure.layers.remat import LN, save_dot, save_policy
from vit_pure.policy import Policy, matmul

F32 = jnp.float32
_INIT_STD = 0.02
# Dropout sites, folded into each example's key with the layer index.
_SITE_EMBED, _SITE_ATTN, _SITE_MLP, _SITE_PATH_ATTN, _SITE_PATH_MLP = range(5)



# ------------------------------------------------------------------------ initialisation
_TRUNC_STD = 0.87962566  # the std of a unit normal truncated to [-2, 2]


def _trunc_normal(key, shape, dtype):
    """A normal truncated to two standard deviations, rescaled to std _INIT_STD, drawn
    flat and then reshaped: the same values as the draw in `shape` (a draw's values are
    laid out in row-major order), and a rank-1 sampler compiles several times faster
    than one of rank 4 or 5."""
    flat = jax.random.truncated_normal(key, -2.0, 2.0, (math.prod(shape),), dtype)
    return (_INIT_STD / _TRUNC_STD) * flat.reshape(shape)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def init_params(key: jax.Array, cfg: ViTConfig, dtype=jnp.float32) -> dict:
    """Fresh parameters for `cfg`, as a nested dict of arrays (see the module docstring).

    Jitted as a whole, so a fresh start compiles one program, not one random sampler per
    distinct shape (each a compile of its own outside jit)."""
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
        "pos_embed": w((cfg.pos_tokens, E)),
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
        "head": {"kernel": w((E * (1 + (cfg.pool == "cls+mean")), cfg.num_classes)),
                 "bias": zeros(cfg.num_classes)},
    }
    if cfg.stem:  # keys of its own: every other param is drawn as without a stem
        stem, c_in = {}, cfg.channels
        for i, c_out in enumerate(cfg.stem):
            std = math.sqrt(2.0 / (9 * c_in))
            k = jax.random.normal(jax.random.fold_in(key, 1000 + i), (9 * c_in * c_out,))
            # The barrier keeps XLA from folding the scale into the sampler's own constants,
            # which would round some values one place differently from the scaled draw.
            k = jax.lax.optimization_barrier(k)
            stem[f"conv{i}"] = {"kernel": (std * k.reshape(3, 3, c_in, c_out)).astype(dtype),
                                "bias": zeros(c_out)}
            c_in = c_out
        params = {"stem": stem, **params}
    if cfg.lsa:  # no key: the plain attention's scale, so every other param is unchanged
        params["blocks"]["attn"]["log_scale"] = jnp.full((L, H), -0.5 * math.log(D), dtype)
    if cfg.layer_scale is not None:  # no key either: a constant start
        for name in ("ls1", "ls2"):
            params["blocks"][name] = {"gamma": jnp.full((L, E), cfg.layer_scale, dtype)}
    if cfg.registers:  # a key of its own, as the stem's
        params["reg_tokens"] = _trunc_normal(jax.random.fold_in(key, 2000), (cfg.registers, E),
                                             dtype)
    return params


def param_axes(cfg: ViTConfig) -> dict:
    """Logical axis names of every parameter, in the same tree as `init_params`."""
    ln = {"scale": ("layers", "embed"), "bias": ("layers", "embed")}
    conv = {"kernel": ("conv_h", "conv_w", "stem_in", "stem_out"), "bias": ("stem_out",)}
    stem = {"stem": {f"conv{i}": dict(conv) for i in range(len(cfg.stem))}} if cfg.stem else {}
    lsa = {"log_scale": ("layers", "heads")} if cfg.lsa else {}
    ls = ({name: {"gamma": ("layers", "embed")} for name in ("ls1", "ls2")}
          if cfg.layer_scale is not None else {})
    reg = {"reg_tokens": ("registers", "embed")} if cfg.registers else {}
    return {
        **stem,
        "patch_embed": {"kernel": ("patch", "embed"), "bias": ("embed",)},
        **({"cls_token": ("embed",)} if cfg.class_token else {}),
        "pos_embed": ("tokens", "embed"),
        **reg,
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
            **ls,
        },
        "final_ln": {"scale": ("embed",), "bias": ("embed",)},
        "head": {"kernel": ("embed", "classes"), "bias": ("classes",)},
    }


def count_params(params) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))



# ------------------------------------------------- tensor parallelism: Megatron's f and g
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



@dataclasses.dataclass(frozen=True)
class Parallel:
    """Where the model's collectives go when it runs inside `shard_map`; the default,
    all None, is one device and no collective.

    tp_axis    the mesh axis of tensor parallelism: the heads and MLP units are split over
               it, and `_copy_to_tp` / `_reduce_from_tp` write its collectives.
    gather     FSDP's hook `gather(tree, path)`: all-gathers the sharded leaves of a
               params subtree (train_shardmap.make_gather); `compute_params` applies it.
    pipe_axis  the pipeline's mesh axis (vit_pure/pipeline/), None outside a pipeline.
    """
    tp_axis: str | None = None
    gather: Callable | None = None
    pipe_axis: str | None = None


# --------------------------------------------------------------------------- the network
def compute_params(tree, policy: Policy, par: Parallel = Parallel(), path: str = ""):
    """Parameters as a layer uses them: gathered by the FSDP hook (if any), then cast to
    the compute dtype; the one place params change dtype.

    `path` is where `tree` sits in the params ("" for the top level, "blocks" for one
    layer's params, its layer axis sliced off): the hook looks each leaf up by its full
    path, e.g. "blocks/mlp/fc1/kernel". The hook receives the master (float32) shards and
    casts before it gathers, so the weights travel in the compute dtype while their
    gradients come back, reduce-scattered, in float32 (train_shardmap.fsdp_gather).
    """
    if par.gather is not None:
        tree = par.gather(tree, path)
    return policy.cast_to_compute(tree)


def compute_blocks(blocks, policy: Policy, par: Parallel):
    """The stacked blocks (leading layer axis) gathered by the FSDP hook layer by layer and
    stacked again, in the compute dtype; without a hook, as they are (the encoder casts
    each layer just before its use, so no compute-dtype copy of them all is held). For a
    pipeline, which gathers once per step rather than once per micro-batch tick."""
    if par.gather is None:
        return blocks
    n = jax.tree.leaves(blocks)[0].shape[0]
    layers = [compute_params(jax.tree.map(lambda a, i=i: a[i], blocks), policy, par, "blocks")
              for i in range(n)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


@jax.custom_vjp
def _add_embeddings(x, bias, cls, pos):
    """(cls rows, x + bias) + pos in float32: x (B, N, E) the patch embedding's product,
    bias (E,), cls (n, E) the class token (n = 1) or nothing (n = 0), pos (n + N, E).

    A custom VJP so that the backward pass sums the gradient over the batch once, for pos,
    and takes cls's and the bias's gradients from that (its first n rows, the sum of the
    others) instead of three sums over (B, T, E) (docs/performance.md, "The memory-bound
    passes")."""
    x = x.astype(F32) + bias.astype(F32)
    head = jnp.broadcast_to(cls.astype(F32), (x.shape[0], *cls.shape))
    return jnp.concatenate([head, x], axis=1) + pos.astype(F32)


def _add_embeddings_fwd(x, bias, cls, pos):
    # x's dtype rides along as an empty array (residuals must be arrays).
    return _add_embeddings(x, bias, cls, pos), (jnp.zeros((0,), x.dtype), bias, cls, pos)


def _add_embeddings_bwd(residuals, g):
    x_like, bias, cls, pos = residuals
    n = cls.shape[0]
    g = g.astype(F32)
    dpos = g.sum(0)  # (n + N, E), float32
    return (g[:, n:].astype(x_like.dtype), dpos[n:].sum(0).astype(bias.dtype),
            dpos[:n].astype(cls.dtype), dpos.astype(pos.dtype))


_add_embeddings.defvjp(_add_embeddings_fwd, _add_embeddings_bwd)


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
    pos = params["pos_embed"]
    cls = (params["cls_token"].reshape(1, -1) if cfg.class_token  # (n, E), n = 0 or 1
           else jnp.zeros((0, x.shape[-1]), pos.dtype))
    x = _add_embeddings(x, *(varying_like(a, x) for a in (  # (B, T - R, E) f32
        params["patch_embed"]["bias"], cls, pos)))
    if cfg.registers:  # after the class token, no position embedding (DINOv2)
        n = int(cfg.class_token)
        reg = jnp.broadcast_to(params["reg_tokens"].astype(F32), (x.shape[0], *params[
            "reg_tokens"].shape))
        x = jnp.concatenate([x[:, :n], reg, x[:, n:]], axis=1)  # (B, T, E)
    return dropout(x.astype(cd), cfg.dropout, ex_keys, 0, _SITE_EMBED, execution.dropout_masks,
                   execution.packed_masks)




def _block(p, x, layer, cfg: ViTConfig, policy: Policy, ex_keys, execution: Execution,
           tp_axis, class_token_only: bool = False):
    """One pre-LayerNorm encoder block. p: this layer's params (no L axis); x (B*T, E),
    the residual stream as one row per token (`encoder`); attention alone sees (B, T).
    `class_token_only`: after the attention's keys and values, only each example's first
    row goes on (`attention.class_token_attention`): returns (B, E).

    Matmuls return the policy's matmul dtype (bf16 on GPU, f32 on CPU, see policy.py);
    the bias adds and the GELU run in it, the softmax and LayerNorm in float32. With
    tensor parallelism this device holds Hl of H heads and Ml of M hidden units: each
    branch's input is copied to the tensor-parallel group ("f") and its row-parallel
    output summed over it ("g")."""
    masks = (execution.dropout_masks, execution.packed_masks)  # how dropout draws and keeps
    # Stochastic depth rate grows linearly with the (possibly traced) layer index.
    path_rate = cfg.drop_path * layer / max(cfg.depth - 1, 1)
    path_keys = ex_keys if cfg.drop_path > 0 else None

    def residual(y, bias, site, path_site, ls):
        """The end of a branch: its bias, dropout, stochastic depth, then the layer scale's
        per-channel gain (cfg.layer_scale; in float32, so that its gradient sums there)."""
        y = add_bias(y, bias)
        y = dropout(y.astype(policy.compute_dtype), cfg.dropout, ex_keys, layer + 1, site,
                    *masks)
        y = drop_path(y, path_rate, path_keys, layer + 1, path_site)
        if ls is None:
            return y
        return (y.astype(F32) * ls["gamma"].astype(F32)).astype(y.dtype)

    def norm(x, ln, branch, name):
        """LayerNorm `ln` of x for `branch` (p[branch], whose matmul `name` reads it): with
        Execution.layer_norm "fold", x standardised and ln's scale and bias folded into
        that matmul's params instead (`norm.fold_affine`). Not under tensor parallelism:
        each device's weight slice would give part of the scale's gradient, summed over
        the group by a collective that Megatron's two operators do not write."""
        if execution.layer_norm == "apply" or tp_axis is not None:
            return layer_norm(x, p[ln], cfg.ln_eps), p[branch]
        w, b = fold_affine(p[ln], p[branch][name]["kernel"], p[branch][name]["bias"])
        return standardise(x, cfg.ln_eps), {**p[branch], name: {"kernel": w, "bias": b}}

    h, attn = norm(x, "ln1", "attn", "qkv")
    h = _copy_to_tp(checkpoint_name(h, LN), tp_axis)
    if class_token_only:  # the class token's rows from here on: (B, E)
        y = class_token_attention(h, attn, cfg, policy, execution)
        x = x.reshape(-1, cfg.seq_len, x.shape[-1])[:, 0]
    else:
        y = self_attention(h, attn, cfg, policy, execution)
    y = save_dot(_reduce_from_tp(y, tp_axis))  # the sum over heads
    x = x + residual(y, p["attn"]["out"]["bias"], _SITE_ATTN, _SITE_PATH_ATTN, p.get("ls1"))

    h, mlp_params = norm(x, "ln2", "mlp", "fc1")
    h = _copy_to_tp(checkpoint_name(h, LN), tp_axis)
    y = save_dot(_reduce_from_tp(mlp(h, mlp_params, policy, execution, cfg.gelu), tp_axis))
    return x + residual(y, p["mlp"]["fc2"]["bias"], _SITE_MLP, _SITE_PATH_MLP, p.get("ls2"))


def encoder(blocks, x, cfg: ViTConfig, policy: Policy, ex_keys=None, *,
            execution: Execution = Execution(), par: Parallel = Parallel(),
            layer_offset=0, class_token_only: bool = False):
    """Run the stacked blocks (leading axis = layers) over x (B, T, E); returns (B, T, E),
    or with `class_token_only` (B, 1, E): the last block computes the class token's row
    alone after its attention (`_block`; `class_token_rows` says when).

    Inside, the residual stream is a (B*T, E) matrix, one row per token (a free reshape):
    every matmul, LayerNorm, bias, GELU and dropout then works on rows, and attention
    alone reshapes to (B, T). Carried as (B, T, E), XLA:GPU lays the stream out batch-
    minor and transposes it around every matmul (docs/performance.md, "The memory-bound
    passes").

    `layer_offset` is the global index of blocks[0] (pipeline stages hold a slice of the
    layers; the index seeds dropout). Each layer's params are made ready just before use
    (`compute_params`: `par`'s FSDP `gather(layer_params, "blocks")` hook if any, then the
    cast to the compute dtype). `execution` picks the layer loop (a scan or unrolled),
    what the backward pass keeps (remat), the attention implementation and the dropout
    masks: see `config.Execution`.
    """
    saved = remat_saved_names(execution.remat)
    # `blocks` may also be a list of per-layer params (no layer axis): the pipeline's
    # table-driven schedules pass its layers so, to find the weights among a pull-back's
    # residuals (pipeline/ring.py).
    layered = isinstance(blocks, (list, tuple))
    num_layers = len(blocks) if layered else jax.tree.leaves(blocks)[0].shape[0]

    def make_body(last_row_only):
        def body(x, p_and_layer):
            p, layer = p_and_layer
            p = compute_params(p, policy, par, "blocks")
            return _block(p, x, layer, cfg, policy, ex_keys, execution, par.tp_axis,
                          last_row_only)

        if execution.remat == "block":
            return jax.checkpoint(body)  # saves nothing inside the block
        return jax.checkpoint(body, policy=save_policy(saved)) if saved else body

    body = make_body(False)
    layers = layer_offset + jnp.arange(num_layers)
    B, T, E = x.shape
    if T != cfg.seq_len:  # `_block` splits the rows into examples of cfg.seq_len tokens
        raise ValueError(f"{cfg.name}: the encoder takes {cfg.seq_len} tokens, got {T}")
    x = x.reshape(B * T, E)
    full = num_layers - class_token_only  # the layers that keep every row
    if execution.scan and full:
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *blocks) if layered else blocks
        x, _ = jax.lax.scan(lambda x, pl: (body(x, pl), None), x,
                            (jax.tree.map(lambda a: a[:full], stacked), layers[:full]))
    else:
        for i in range(full):
            p = blocks[i] if layered else jax.tree.map(lambda a: a[i], blocks)
            x = body(x, (p, layers[i]))
    if not class_token_only:
        return x.reshape(B, T, E)
    p = blocks[-1] if layered else jax.tree.map(lambda a: a[-1], blocks)
    return make_body(True)(x, (p, layers[-1])).reshape(B, 1, E)


def pool(params, x, cfg: ViTConfig) -> jax.Array:
    """tokens (B, T, E) -> the head's input (B, E), or (B, 2E) for "cls+mean": from the class
    token, or from the mean of the patch tokens, taken in float32 (cfg.pool "mean": every
    token but the class token and the registers; "gap": every patch token, there being no
    class token), through the final LayerNorm."""
    if cfg.pool == "cls+mean":  # DINOv2's: normalise every token, then pool
        B, T, E = x.shape
        x = layer_norm(x.reshape(B * T, E), params["final_ln"], cfg.ln_eps).reshape(B, T, E)
        mean = jnp.mean(x[:, cfg.prefix_tokens:].astype(F32), axis=1).astype(x.dtype)
        return jnp.concatenate([x[:, 0], mean], axis=-1)  # (B, 2E)
    if cfg.pool == "cls":
        feature = x[:, 0]
    else:
        patches = x[:, cfg.prefix_tokens:]  # not the class token nor the registers
        feature = jnp.mean(patches.astype(F32), axis=1).astype(x.dtype)  # (B, E)
    return layer_norm(feature, params["final_ln"], cfg.ln_eps)


def classify(head_params, feature, policy: Policy = Policy()) -> jax.Array:
    """The linear head: features (B, F) -> logits (B, K) in the output dtype."""
    logits = matmul(feature, head_params["kernel"], policy)
    logits = logits.astype(F32) + head_params["bias"].astype(F32)
    return logits.astype(policy.output_dtype)


def head(params, x, cfg: ViTConfig, policy: Policy):
    """tokens (B, T, E) -> logits (B, K): `pool`, then `classify`."""
    return classify(params["head"], pool(params, x, cfg), policy)


def dropout_keys(cfg: ViTConfig, train: bool, rng, example_ids, batch_size: int):
    """The per-example keys (B,) of a forward pass's dropout and stochastic depth, or None
    when it draws nothing (evaluation, or both rates 0). Used by `apply` and by
    the pipeline's `program.table_grads`. example_ids default to 0..B-1."""
    if not train or (cfg.dropout == 0 and cfg.drop_path == 0):
        return None
    if rng is None:
        raise ValueError("train=True needs rng for dropout / drop path")
    if example_ids is None:
        example_ids = jnp.arange(batch_size)
    return example_keys(rng, example_ids)


def apply(params, images, cfg: ViTConfig, policy: Policy = Policy(), *, train: bool = False,
          rng: jax.Array | None = None, example_ids: jax.Array | None = None,
          execution: Execution = Execution(), par: Parallel = Parallel()) -> jax.Array:
    """The forward pass: images (B, h, w, C), normalised floats -> logits (B, K).

    train: turn on dropout and stochastic depth (needs `rng`). example_ids (B,) int: each
    example's index in the *global* batch (default 0..B-1); it seeds that example's masks,
    so a batch split over devices gives the same masks as one device. `execution`
    (config.Execution: layer loop, remat, attention, dropout masks) and `par` (the mesh
    axes and FSDP hook of the collectives, `Parallel`): see `encoder`.
    """
    ex_keys = dropout_keys(cfg, train, rng, example_ids, images.shape[0])
    top = compute_params({k: v for k, v in params.items() if k != "blocks"}, policy, par)
    x = embed(top, images, cfg, policy, ex_keys, execution)
    x = encoder(params["blocks"], x, cfg, policy, ex_keys, execution=execution, par=par,
                class_token_only=class_token_rows(cfg, execution))
    return head(top, x, cfg, policy)


def features(params, images, cfg: ViTConfig, policy: Policy = Policy(), *,
             execution: Execution = Execution(), par: Parallel = Parallel()) -> jax.Array:
    """The evaluation forward pass up to the head: images (B, h, w, C) -> the head's input
    (B, F) (`pool`), so that `classify(params["head"], features(...))` is `apply(...)`.
    A frozen backbone's features, computed once for a linear probe (vit_pure/run/probe.py)."""
    top = compute_params({k: v for k, v in params.items() if k not in ("blocks", "head")},
                         policy, par)
    x = embed(top, images, cfg, policy, None, execution)
    x = encoder(params["blocks"], x, cfg, policy, None, execution=execution, par=par,
                class_token_only=class_token_rows(cfg, execution))
    return pool(top, x, cfg)
