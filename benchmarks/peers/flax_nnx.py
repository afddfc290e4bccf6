"""The Flax NNX peer of benchmarks.peers: a ViT written here to the kit's config
(vit_pure.config.PRESETS: pre-LN, class token, learned position embedding, tanh-GELU,
dropout after the embedding and on each residual branch), ``dtype=compute,
param_dtype=float32``, optax AdamW, a jitted step with the parameters and optimizer state
donated. Read it beside vit_pure/model.py.

The driver runs it in a process of its own (`python -m benchmarks.peers.flax_nnx --child
JOB`), and only where flax is installed; it does not import the kit.
"""
from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import optax
from einops import rearrange
from flax import nnx

from benchmarks import harness
from benchmarks.peers.common import BETAS, CLIP, LABEL_SMOOTHING, LR, WEIGHT_DECAY, child


def make_nnx_vit(cfg: dict, dtype, precision, seed: int = 0):
    """A ViT in Flax NNX, to the kit's config: returns the module. The dropout masks come
    from an explicit key passed to __call__ (one mask per site for the whole batch)."""
    F32 = jnp.float32
    E, M, T = cfg["width"], cfg["mlp_dim"], (cfg["image_size"] // cfg["patch_size"]) ** 2 + 1
    init = jax.nn.initializers.truncated_normal(0.02)
    dense = dict(dtype=dtype, param_dtype=F32, precision=precision, kernel_init=init)
    norm = dict(epsilon=cfg["ln_eps"], dtype=dtype, param_dtype=F32)

    def dropout(x, key):
        rate = cfg["dropout"]
        if not rate:
            return x
        keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
        return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(E, rngs=rngs, **norm)
            self.attn = nnx.MultiHeadAttention(
                num_heads=cfg["heads"], in_features=E, qkv_features=E, out_features=E,
                decode=False, rngs=rngs, **dense)
            self.ln2 = nnx.LayerNorm(E, rngs=rngs, **norm)
            self.fc1 = nnx.Linear(E, M, rngs=rngs, **dense)
            self.fc2 = nnx.Linear(M, E, rngs=rngs, **dense)

        def __call__(self, x, key):
            k1, k2 = jax.random.split(key)
            x = x + dropout(self.attn(self.ln1(x), deterministic=True), k1)
            return x + dropout(self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)))), k2)

    class ViT(nnx.Module):
        def __init__(self, rngs):
            p = cfg["patch_size"]
            self.patch = nnx.Linear(p * p * cfg["channels"], E, rngs=rngs, **dense)
            self.cls = nnx.Param(jnp.zeros((1, 1, E), F32))
            self.pos = nnx.Param(init(rngs.params(), (1, T, E), F32))
            for i in range(cfg["depth"]):  # attributes, not a list: any flax version
                setattr(self, f"block{i}", Block(rngs))
            self.final_ln = nnx.LayerNorm(E, rngs=rngs, **norm)
            self.head = nnx.Linear(E, cfg["num_classes"], rngs=rngs, **dense)

        def __call__(self, images, key):  # images: (B, H, W, C) float32, normalised
            p = cfg["patch_size"]
            x = self.patch(rearrange(images, "b (h p) (w q) c -> b (h w) (p q c)", p=p, q=p))
            cls = jnp.broadcast_to(self.cls[...].astype(x.dtype), (x.shape[0], 1, E))
            x = jnp.concatenate([cls, x], axis=1) + self.pos[...].astype(x.dtype)
            keys = jax.random.split(key, cfg["depth"] + 1)
            x = dropout(x, keys[0])
            for i in range(cfg["depth"]):
                x = getattr(self, f"block{i}")(x, keys[i + 1])
            return self.head(self.final_ln(x[:, 0])).astype(F32)

    return ViT(nnx.Rngs(seed))


def _decay_mask(params):
    """Weight decay on the weight matrices ("kernel") only, as the kit."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "kernel" in jax.tree_util.keystr(path), params)


def run_nnx(job: dict) -> dict:
    F32 = jnp.float32
    dtype = jnp.bfloat16 if job["dtype"] == "bf16" else F32
    precision = {"default": None, "highest": jax.lax.Precision.HIGHEST}[job["precision"]]
    model = make_nnx_vit(job["cfg"], dtype, precision)
    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, LR, 50, 1000)  # the kit's, 1000 steps
    tx = optax.chain(optax.clip_by_global_norm(CLIP),
                     optax.adamw(schedule, *BETAS, weight_decay=WEIGHT_DECAY, mask=_decay_mask))
    opt_state = tx.init(params)
    mean, std = jnp.asarray(job["mean"], F32), jnp.asarray(job["std"], F32)

    def loss_fn(params, images, labels, key):
        logits = nnx.merge(graphdef, params)(images, key)
        targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), LABEL_SMOOTHING)
        return optax.softmax_cross_entropy(logits, targets).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, images_u8, labels, i):
        images = (images_u8.astype(F32) / 255.0 - mean) / std
        loss, grads = jax.value_and_grad(loss_fn)(params, images, labels,
                                                  jax.random.fold_in(jax.random.key(1), i))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batches = harness.host_batches(job["batch"])
    t0 = time.perf_counter()
    compiled = train_step.lower(params, opt_state, *batches[0], jnp.int32(0)).compile()
    compile_s = time.perf_counter() - t0
    n_params = sum(x.size for x in jax.tree.leaves(params))
    state = {"params": params, "opt": opt_state, "loss": None}

    def dispatch(i):
        images, labels = batches[i % len(batches)]
        state["params"], state["opt"], state["loss"] = compiled(
            state["params"], state["opt"], jax.device_put(images), jax.device_put(labels),
            jnp.int32(i))
        return state["loss"]

    step_s = harness.time_steps(dispatch, jax.block_until_ready, job["warmup"],
                                job["steps"]).wall
    device = jax.devices()[0]
    return {**harness.device_info(device, f"jax {jax.__version__}"), "step_s": step_s,
            "compile_s": compile_s, "loss": float(state["loss"]),
            "peak_bytes": harness.device_peak_bytes(device), "params": n_params}


if __name__ == "__main__":
    sys.exit(child(run_nnx, sys.argv))
