"""The step math both training scripts share: optimizer, loss, per-device gradients, update.

This module writes no collective. The step is split so that each script writes its
collectives between the pieces, once:

    grads, metrics = local_grads(sc, params, ...)     # this device's slice of the batch
    grads, metrics = <all-reduce over 'data'>(...)    # written in the script
    norm = <global gradient norm>                     # a collective under model parallelism
    state = apply_gradients(sc, state, grads, norm, optimizer)  # same on every device

A trace of `local_grads` / `local_eval` may still hold what `model.Parallel` hands it: the
model's tensor-parallel operators, the script's FSDP hook. `accumulate` is the one
gradient path: `local_grads` and the pipeline's gradients both run through it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vit_pure.config import INPUT_SCALINGS, Execution, ViTConfig
from vit_pure.data import augment as augment_lib
from vit_pure.data import randaugment as randaugment_lib
from vit_pure.errors import UsageError
from vit_pure.model import Parallel, apply, features, init_params
from vit_pure.policy import LossScale, Policy, select_tree

F32 = jnp.float32


def decay_mask(params) -> Any:
    """Weight decay on weight matrices only: not on biases, LayerNorms, the position
    embedding or the class token."""
    def is_kernel(path, _):
        return getattr(path[-1], "key", None) == "kernel"
    return jax.tree_util.tree_map_with_path(is_kernel, params)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer's settings (--optimizer, --lr, --weight-decay, --warmup-steps)."""
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_steps: int | None = None  # None: 5% of the run's steps
    # "adamw", or "sgd": SGD with momentum 0.9 (the fine-tuning recipe of Dosovitskiy et
    # al. 2020), with weight decay added to the gradient of the weight matrices if > 0.
    optimizer: str = "adamw"
    # --trainable: "all" the params, or only the "head" (a linear probe of a frozen
    # backbone: the others are neither updated nor decayed; `trainable_params`).
    trainable: str = "all"
    # --layer-decay D in (0, 1]: layer-wise learning-rate decay (`scale_by_layer`); 1.0 off.
    layer_decay: float = 1.0


TRAINABLE = ("all", "head")  # --trainable
# The params at depth 0 under layer-wise decay (`layer_factors`): the embeddings, with
# the stem and the register tokens; the stacked blocks are depths 1..L, the rest L + 1.
EMBEDDINGS = ("stem", "patch_embed", "cls_token", "pos_embed", "reg_tokens")


class LayerDecayState(NamedTuple):
    """`scale_by_layer`'s state: each param's update factors, in a tree like the params."""
    factors: Any


def layer_factors(params, decay: float):
    """The factor of each param's update under layer-wise learning-rate decay, in a tree
    like `params`: decay^(L + 1 - i) at depth i, the embeddings (`EMBEDDINGS`) at i = 0,
    block j at i = j + 1, the final LayerNorm and the head at i = L + 1 (factor 1), L the
    depth (BEiT's assignment: H. Bao et al. 2021, arXiv:2106.08254; MAE's layer_decay).

    A stacked-block leaf (L, ...) gets an (L, 1, ..., 1) float32 array, its row j block
    j's factor; every other leaf a (1, ..., 1) array of its rank. Same rank as the param,
    so the optimizer state's layout takes the param's PartitionSpec (the training scripts
    leave the size-1 axes unsplit): the rows go where the blocks go, a pipeline stage's
    rows with its blocks, permuted with them under an interleaved schedule's block order.
    Each device then holds the factors of the blocks it holds, with no collective."""
    blocks = params.get("blocks") if isinstance(params, dict) else None
    depth = jax.tree.leaves(blocks)[0].shape[0] if blocks else 0

    def factor(path, p):
        top = path[0].key
        if top == "blocks":
            rows = decay ** (depth - np.arange(depth, dtype=np.float64))
            return jnp.asarray(rows.reshape(depth, *(1,) * (p.ndim - 1)), F32)
        power = depth + 1 if top in EMBEDDINGS else 0
        return jnp.full((1,) * p.ndim, decay ** power, F32)
    return jax.tree_util.tree_map_with_path(factor, params)


def scale_by_layer(decay: float) -> optax.GradientTransformation:
    """Each param's update times its `layer_factors` entry. Placed after the whole
    optimizer, it scales AdamW's decoupled weight decay with the learning rate, as
    per-layer learning rates would. The factors are state, laid out like the params
    (see `layer_factors`), so the update is elementwise on each device's own block."""
    def init(params):
        return LayerDecayState(layer_factors(params, decay))

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda u, f: (u * f).astype(u.dtype), updates,
                            state.factors), state
    return optax.GradientTransformation(init, update)


def frozen_updates(optimizer, trainable: str) -> optax.GradientTransformation:
    """`optimizer` on the head's params alone, under --trainable head: the frozen
    backbone's updates are zeros (weight decay included), and its optimizer state keeps
    one element per frozen leaf instead of the leaf's copies (AdamW's moments of the head
    only). The state keeps the params' tree, each frozen leaf's moments a (1, ..., 1)
    array, so it is laid out as any optimizer state is (`layout.like_param` keeps size-1
    axes whole)."""
    def shrunk(tree):
        if not isinstance(tree, dict):  # optax.tree_map_params' stand-in for the params
            return tree
        return {k: v if k == "head" else jax.tree.map(
                    lambda x: jnp.zeros((1,) * jnp.ndim(x), jnp.result_type(x)), v)
                for k, v in tree.items()}

    def init(params):
        return optimizer.init(shrunk(params))

    def update(updates, state, params=None):
        head, state = optimizer.update(shrunk(updates), state,
                                       None if params is None else shrunk(params))
        return {k: head[k] if k == "head" else jax.tree.map(jnp.zeros_like, v)
                for k, v in updates.items()}, state
    return optax.GradientTransformation(init, update)


def trainable_params(params, trainable: str):
    """params with the frozen ones behind stop_gradient: their gradients are zeros that
    autodiff never computes, so a frozen backbone costs its forward pass alone."""
    if trainable == "all":
        return params
    return {k: v if k == "head" else jax.lax.stop_gradient(v) for k, v in params.items()}


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """The warm-up's length in steps: --warmup-steps (None: 5% of the run, at least 1),
    less than the run's length."""
    warmup = optim.warmup_steps if optim.warmup_steps is not None else max(1, total_steps // 20)
    return min(warmup, max(total_steps - 1, 0))


def make_optimizer(optim: OptimConfig,
                   total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """AdamW (or SGD with momentum) with linear warm-up and cosine decay, and with
    `optim.layer_decay` < 1 each update scaled by its layer's factor (`scale_by_layer`;
    not under --trainable head, where only the head, factor 1, trains). Gradient
    clipping is not in here: it
    needs the *global* gradient norm, which under model parallelism is a collective, so
    the scripts compute the norm and `apply_gradients` clips."""
    if not 0.0 < optim.layer_decay <= 1.0:
        raise ValueError(f"layer_decay must be in (0, 1], got {optim.layer_decay}")
    warmup = warmup_steps(optim, total_steps)
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=0.0)
    if optim.optimizer == "sgd":
        decay = ([optax.add_decayed_weights(optim.weight_decay, mask=decay_mask)]
                 if optim.weight_decay > 0 else [])
        optimizer = optax.chain(*decay, optax.sgd(schedule, momentum=0.9))
    else:
        optimizer = optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=optim.weight_decay,
                                mask=decay_mask)
    if optim.layer_decay != 1.0 and optim.trainable == "all":
        optimizer = optax.chain(optimizer, scale_by_layer(optim.layer_decay))
    if optim.trainable != "all":
        optimizer = frozen_updates(optimizer, optim.trainable)
    return optimizer, schedule


def init_state(key, cfg: ViTConfig, policy: Policy, optimizer, *, ema: bool = False,
               params=None) -> dict:
    """The whole training state, one plain pytree. With `ema` (`--ema DECAY` > 0) it also
    holds "ema": a float32 copy of the params, laid out like them (see `update_ema`).
    `params`: start from these (a tree like `init_params(key, cfg)`'s, e.g. imported
    weights, vit_pure/weights/) instead of a fresh initialisation."""
    if params is None:
        return _fresh_state(key, cfg, policy, optimizer, ema)
    return _state_around(params, policy, optimizer, ema)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _fresh_state(key, cfg: ViTConfig, policy: Policy, optimizer, ema: bool) -> dict:
    return _state_around(init_params(key, cfg), policy, optimizer, ema)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _state_around(params, policy: Policy, optimizer, ema: bool) -> dict:
    """`init_state` around given params, as one program (with the draw, `_fresh_state`):
    the optimizer's zeros, the casts and the EMA's copy compile together, not each
    shape's on its own."""
    params = policy.cast_to_param(params)
    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "loss_scale": LossScale.create(dynamic=policy.needs_loss_scaling),
        "step": jnp.zeros((), jnp.int32),
    }
    if ema:
        state["ema"] = jax.tree.map(lambda p: p.astype(F32), params)
    return state


def step_input_shapes(sc: StepConfig, optimizer, global_batch: int,
                      image_shape: tuple[int, int, int]) -> tuple:
    """The train step's inputs as `jax.ShapeDtypeStruct`s, unplaced: (state, images,
    labels, example ids, key). `image_shape` (h, w, C) is what the loop feeds (the
    dataset's images, uint8; the step resizes them to the model's input on the device).
    What compiles the step without data starts here: the planner (abstract, laid out as
    a strategy places them) and `--accum-steps auto`'s measurement (zeros, placed)."""
    state = jax.eval_shape(lambda: init_state(jax.random.key(0), sc.cfg, sc.policy, optimizer,
                                              ema=sc.ema_decay > 0))
    ids = jax.ShapeDtypeStruct((global_batch,), jnp.int32)
    return (state, jax.ShapeDtypeStruct((global_batch, *image_shape), jnp.uint8), ids, ids,
            jax.eval_shape(lambda: jax.random.key(0)))


# --------------------------------------------------------------------------- weight EMA
def ema_decay_at(decay: float, step) -> jax.Array:
    """The EMA's decay for the update after `step` optimizer steps were already taken (0 for
    the first update): min(decay, (1 + step) / (10 + step)).

    The warm-up is TensorFlow's (tf.train.ExponentialMovingAverage with num_updates): early
    on the average follows the params closely (0.1, 0.18, 0.25, ...), so a short run's EMA
    is not dominated by the random initial weights; it reaches `decay` after
    (10 * decay - 1) / (1 - decay) steps (8,991 for 0.999, 89,991 for 0.9999)."""
    t = jnp.asarray(step, F32)
    return jnp.minimum(jnp.asarray(decay, F32), (1.0 + t) / (10.0 + t))


def update_ema(decay: float, ema, params, step):
    """ema <- d * ema + (1 - d) * params, d = `ema_decay_at(decay, step)`, in float32.

    Elementwise on each device's own block: the EMA of a sharded param is sharded the
    same way (train_shardmap.py lays "ema" out with the params' specs), so it needs no
    collective under any layout. Sources: exponential moving averages of the weights
    (Polyak averaging; B. T. Polyak, A. B. Juditsky, "Acceleration of stochastic
    approximation by averaging", 1992), as used in ViT training recipes (DeiT, H. Touvron
    et al. 2021, arXiv:2012.12877; timm's ModelEmaV2)."""
    d = ema_decay_at(decay, step)
    return jax.tree.map(lambda e, p: d * e + (1.0 - d) * p.astype(F32), ema, params)


# --------------------------------------------------------------------------- step pieces
def one_hot_targets(labels, num_classes: int, smoothing: float = 0.0):
    """Float32 target distributions, with optional label smoothing."""
    targets = jax.nn.one_hot(labels, num_classes, dtype=F32)
    return optax.smooth_labels(targets, smoothing) if smoothing else targets


def cross_entropy(logits, labels, num_classes: int, smoothing: float = 0.0, *, targets=None):
    """Per-example softmax cross-entropy in float32 against `labels` (with optional label
    smoothing) or against given soft `targets` (mixup / cutmix)."""
    if targets is None:
        targets = one_hot_targets(labels, num_classes, smoothing)
    return optax.softmax_cross_entropy(logits.astype(F32), targets)


def prepare_images(images_u8, key, example_ids, *, train: bool, image_size: int,
                   randaugment: tuple[int, int] = (0, 0), inputs: str = "cifar10"):
    """uint8 batch -> normalised float32, with the training augmentation (on device).

    Training: random flip + resized crop (vit_pure.data.cifar10), then, if `randaugment` =
    (num_ops, magnitude) has num_ops > 0, RandAugment (vit_pure.data.randaugment), all on
    [0, 1] pixels, each example's draws keyed by its global id; then the model's input
    scaling (`inputs`, ViTConfig.inputs: the CIFAR-10 mean / std by default, [-1, 1] or
    ImageNet's for imported weights). Models with another input size (the 224 px presets)
    get the batch resized.
    """
    x = images_u8.astype(F32) * (1.0 / 255.0)
    if train:
        x = augment_lib.augment(key, x, example_ids)
        num_ops, magnitude = randaugment
        if num_ops:
            x = randaugment_lib.rand_augment(jax.random.fold_in(key, 1), x, example_ids,
                                             num_ops=num_ops, magnitude=magnitude)
    mean, std = INPUT_SCALINGS[inputs]
    x = (x - jnp.asarray(mean, F32)) / jnp.asarray(std, F32)
    if x.shape[1] != image_size:
        x = jax.image.resize(x, (x.shape[0], image_size, image_size, x.shape[3]), "bilinear")
    return x


def prepare_batch(sc: "StepConfig", images_u8, labels, example_ids, key):
    """A training batch as the model sees it: (images, soft targets, dropout key).

    Augmentation (flip + crop, RandAugment), label smoothing and mixup / cutmix, all
    keyed by the step's `key` and the examples' global ids.
    """
    aug_key, drop_key = jax.random.split(key)
    images = prepare_images(images_u8, aug_key, example_ids, train=sc.augment,
                            image_size=sc.cfg.image_size, randaugment=sc.randaugment,
                            inputs=sc.cfg.inputs)
    targets = one_hot_targets(labels, sc.cfg.num_classes, sc.label_smoothing)
    if sc.augment and (sc.mixup_alpha or sc.cutmix_alpha):
        try:  # pairs examples 2k, 2k+1 of this slice: the same pairs on any device count
            images, targets = augment_lib.mix_batch(
                jax.random.fold_in(aug_key, 2), images, targets,
                mixup_alpha=sc.mixup_alpha, cutmix_alpha=sc.cutmix_alpha)
        except ValueError as e:  # an odd per-device batch: a bad --batch for these flags
            raise UsageError(str(e)) from None
    return images, targets, drop_key


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static settings of a training step (hashable: safe to close over in jit)."""
    cfg: ViTConfig
    policy: Policy
    label_smoothing: float = 0.0
    grad_clip: float = 1.0  # global-norm clipping threshold (0: off)
    # How the model runs (--scan, --remat, --attention, --dropout-masks, --last-block):
    # config.Execution, whose defaults are what the scripts run on a CPU; run/settings.py
    # `step_config` lets the flags and the backend (run/backend.py) change them.
    execution: Execution = Execution()
    augment: bool = True
    # Recipe: RandAugment (num_ops, magnitude out of 10; 0 ops = off); mixup / cutmix
    # alphas (0 = off). Mixing pairs global examples 2k and 2k+1 (augment.mix_batch),
    # which always sit on one device: the per-device batch must be even.
    randaugment: tuple[int, int] = (0, 0)
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    # Gradient accumulation: each device's slice of the batch runs as this many
    # micro-batches, one after another, inside the compiled step (see `local_grads`).
    accum_steps: int = 1
    # --ema DECAY: an exponential moving average of the params, updated after each optimizer
    # update (`update_ema`); 0 = off (the state then holds no "ema").
    ema_decay: float = 0.0
    # --eval-flip: evaluation averages the logits of each image and its mirror image
    # (test-time augmentation; training is unchanged).
    eval_flip: bool = False
    # --eval-corners: evaluation also scores four corner crops of each image
    # (augment.corner_crops; with eval_flip, each with its mirror too: ten views).
    eval_corners: bool = False
    # --trainable (OptimConfig.trainable): "head" differentiates the head's params alone.
    trainable: str = "all"
    # What the hardware decided for the flags left to it (run/backend.py resolve), for the
    # startup log; not part of the step's identity.
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False)


def local_grads(sc: StepConfig, params, loss_scale: LossScale, images_u8, labels, example_ids,
                key, *, par: Parallel = Parallel()):
    """Loss and gradients of *this device's* slice of the batch; it writes no collective.

    Returns (grads of the local mean loss, unscaled), {"loss", "accuracy"} local means.
    `key` is the step's key (the same on every device); each example's randomness comes
    from its global `example_ids` entry, never from the device it sits on. The model's
    tensor-parallel operators (`par.tp_axis`) and the FSDP hook (`par.gather`, both of
    `model.Parallel`) put their own collectives into the trace; see the module docstring.
    Gradient accumulation (`sc.accum_steps`): see `accumulate`.
    """
    def micro_metrics(p, images, labels, targets, example_ids, drop_key):
        logits = apply(p, images, sc.cfg, sc.policy, train=True, rng=drop_key,
                       example_ids=example_ids, execution=sc.execution, par=par)
        return train_metrics(sc, logits, labels, targets)

    return accumulate(sc, micro_metrics, params, loss_scale, images_u8, labels, example_ids,
                      key)


def train_metrics(sc: StepConfig, logits, labels, targets) -> dict:
    """{"loss": mean float32 cross-entropy against the (soft) targets, "accuracy"}."""
    loss = cross_entropy(logits, labels, sc.cfg.num_classes, targets=targets).mean()
    accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(F32))
    return {"loss": loss, "accuracy": accuracy}


def accumulate(sc: StepConfig, micro_metrics: Callable, params, loss_scale: LossScale,
               images_u8, labels, example_ids, key, grads_fn: Callable | None = None):
    """The one gradient path of the kit (`local_grads` and `pipeline.pipeline_grads`):
    prepare this device's slice, differentiate its mean loss, over `sc.accum_steps`
    micro-batches. Returns (grads, unscaled, in the params' dtypes; mean metrics).

    `micro_metrics(p, images, labels, targets, example_ids, drop_key) -> {"loss", ...}`
    is the forward pass and loss of one micro-batch; its "loss" is differentiated (scaled
    by `loss_scale`, the gradients unscaled after). It and `grads_fn` may hold
    collectives of their own (the pipeline's schedule); this function adds none.

    Gradient accumulation (`sc.accum_steps` = K > 1): the slice of b examples is cut into
    K micro-batches of b/K, run one after another in a `lax.scan`; their gradients are
    summed here, in float32, and divided by K. Only one micro-batch's activations are
    alive at a time, so activation memory shrinks about K-fold, and the result is the
    K = 1 result up to float summation order: the whole slice is augmented (and mixed)
    before it is cut, and each micro-batch carries its examples' global ids, so every
    dropout / drop-path / augmentation draw stays with its example.
    There is deliberately no collective in here: the caller reduces the *summed*
    gradients over the data axis once per optimizer step, so K micro-batches cost one
    all-reduce, not K (reducing per micro-batch would move K times the bytes for the
    same result, since the sum commutes with the all-reduce). Under FSDP the sharded
    weights are different: their all-gather and reduce-scatter sit inside each
    micro-batch's forward and backward pass (the weights are gathered where they are
    used), so K micro-batches cost K of those, as in any ZeRO-3 trainer.

    A pipeline's micro-batches are another thing, and nest inside these: each
    accumulation micro-batch is itself split into the pipeline's micro-batches, which
    fill the stages; accumulation repeats the whole pipelined forward/backward K times.

    `grads_fn(p, images_u8, labels, targets, example_ids, drop_key, seed, prepare) ->
    (grads, metrics)`, if given, replaces `jax.grad` of `micro_metrics`: it returns the
    gradients of `seed` x the loss itself (the table-driven pipeline schedules, which pull
    back stage by stage). It gets the raw images and prepares them itself, a piece at a
    time, with `prepare(images_u8, labels, example_ids) -> images`: every draw belongs to an
    example (or, for mixing, to the step's key and an even-sized piece's pairs), so the
    pieces are the rows of the whole slice's preparation, and no prepared copy of the
    whole slice is held while they run. (Only the targets are taken from the whole slice.)
    """
    images, targets, drop_key = prepare_batch(sc, images_u8, labels, example_ids, key)
    if grads_fn is not None:
        images = images_u8  # the prepared slice is left unused: XLA drops it

        def prepare(images_u8, labels, example_ids):
            return prepare_batch(sc, images_u8, labels, example_ids, key)[0]

    def micro_grads(images, labels, targets, example_ids):
        if grads_fn is not None:
            seed = loss_scale.scale_loss(jnp.ones((), F32))
            grads, metrics = grads_fn(params, images, labels, targets, example_ids, drop_key,
                                      seed, prepare)
            return loss_scale.unscale(grads), metrics

        def scaled_loss(p):
            p = trainable_params(p, sc.trainable)
            metrics = micro_metrics(p, images, labels, targets, example_ids, drop_key)
            return loss_scale.scale_loss(metrics["loss"]), metrics

        grads, metrics = jax.grad(scaled_loss, has_aux=True)(params)
        return loss_scale.unscale(grads), metrics

    batch = (images, labels, targets, example_ids)
    if sc.accum_steps == 1:
        return micro_grads(*batch)
    return sum_micro_batches(micro_grads, params, sc.accum_steps, batch)


def sum_micro_batches(micro_grads: Callable, params, K: int, batch: tuple):
    """`micro_grads(*micro_batch) -> (grads, metrics)` over K equal micro-batches of
    `batch` (arrays (b, ...)), one after another in a `lax.scan`: (the gradients summed in
    float32, divided by K and cast to the params' dtypes; the metrics' means)."""
    b = batch[1].shape[0]
    if b % K:
        raise ValueError(f"accumulation: the per-device batch {b} does not divide into {K} "
                         f"micro-batches")

    def micro_batches(x):  # (b, ...) -> (K, b/K, ...): micro-batch k is rows k*b/K...
        return x.reshape(K, x.shape[0] // K, *x.shape[1:])

    def add(total, micro_batch):
        grads, metrics = micro_grads(*micro_batch)
        return jax.tree.map(lambda t, g: t + g.astype(F32), total, grads), metrics

    # The running sum starts at zero in float32. (zeros_like keeps the params' type under
    # shard_map, e.g. "varying over 'data'", which scan needs the carry to keep.)
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, F32), params)
    total, metrics = jax.lax.scan(add, zeros, tuple(micro_batches(x) for x in batch))
    # Equal-size micro-batches: the mean over the slice is the mean of the K means.
    grads = jax.tree.map(lambda t, p: (t / K).astype(p.dtype), total, params)
    return grads, jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)


def sum_of_squares(tree) -> jax.Array:
    """This device's sum of squared entries (float32) of every leaf of `tree`."""
    return sum((jnp.sum(jnp.square(x.astype(F32))) for x in jax.tree.leaves(tree)),
               jnp.zeros((), F32))


def apply_gradients(sc: StepConfig, state: dict, grads, grad_norm, optimizer):
    """The optimizer update, given gradients already reduced over the data axis and
    their global norm (which the script computes: with sharded params it takes a
    collective). Clips to `sc.grad_clip`; with a dynamic loss scale (float16), a step
    whose gradients are not finite is skipped and the scale shrinks. With "ema" in the
    state (`sc.ema_decay` > 0), the EMA moves towards the new params (`update_ema`), except
    on a skipped step, which leaves it as it was.
    Returns (new state, grads_finite).
    """
    finite = jnp.isfinite(grad_norm)
    if sc.grad_clip > 0:
        factor = jnp.minimum(1.0, sc.grad_clip / jnp.maximum(grad_norm, 1e-12))
        grads = jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    loss_scale = state["loss_scale"]
    if loss_scale.dynamic:
        params = select_tree(finite, params, state["params"])
        opt_state = select_tree(finite, opt_state, state["opt_state"])
    new = {"params": params, "opt_state": opt_state, "loss_scale": loss_scale.adjust(finite),
           "step": state["step"] + 1}
    if "ema" in state:
        ema = update_ema(sc.ema_decay, state["ema"], params, state["step"])
        new["ema"] = select_tree(finite, ema, state["ema"]) if loss_scale.dynamic else ema
    return new, finite


def local_eval(sc: StepConfig, params, images_u8, labels, mask, *,
               par: Parallel = Parallel()):
    """Sums over this device's slice (padding masked out): loss, correct, count."""
    return eval_sums(sc, lambda images: apply(params, images, sc.cfg, sc.policy,
                                              execution=sc.execution, par=par),
                     images_u8, labels, mask)


def local_features(sc: StepConfig, params, images_u8, *, par: Parallel = Parallel()):
    """The head's inputs for this device's slice, of each image and of its left-right
    mirror: (b, 2, F) float32 (the evaluation's preparation, no augmentation or dropout).
    A frozen backbone's features for a linear probe (vit_pure/run/probe.py); no collective
    of its own."""
    images = prepare_images(images_u8, None, None, train=False, image_size=sc.cfg.image_size,
                            inputs=sc.cfg.inputs)

    def one(x):
        return features(params, x, sc.cfg, sc.policy, execution=sc.execution,
                        par=par).astype(F32)
    return jnp.stack([one(images), one(images[:, :, ::-1])], axis=1)


def eval_sums(sc: StepConfig, logits_fn: Callable, images_u8, labels, mask) -> dict:
    """The evaluation of one slice (`local_eval`, `pipeline.pipeline_eval`): the images
    prepared for evaluation, `logits_fn(images) -> logits`, then the masked sums
    {"loss", "correct", "count"}. With `sc.eval_flip` the logits are the mean of the
    image's and its left-right mirror's; with `sc.eval_corners` the views also hold four
    corner crops of the image (and, with eval_flip, their mirrors), the logits the mean over
    all views (each example on its own: no collective)."""
    images = prepare_images(images_u8, None, None, train=False, image_size=sc.cfg.image_size,
                            inputs=sc.cfg.inputs)
    views = [images] + (augment_lib.corner_crops(images) if sc.eval_corners else [])
    if sc.eval_flip:
        views += [v[:, :, ::-1] for v in views]
    logits = sum(logits_fn(v) for v in views) / len(views)
    loss = cross_entropy(logits, labels, sc.cfg.num_classes)
    correct = (jnp.argmax(logits, -1) == labels).astype(F32)
    return {"loss": jnp.sum(loss * mask), "correct": jnp.sum(correct * mask),
            "count": jnp.sum(mask)}


def step_key(seed: int, epoch: int, step: int) -> jax.Array:
    """The key of one training step; reproducible from (seed, epoch, step)."""
    return augment_lib.augment_key(seed, epoch, step)


