"""Pipeline parallelism for the ViT inside `jax.shard_map`: GPipe, and the entry to the
table-driven schedules (tables pipeline/schedules.py, program pipeline/ticks.py).

The stacked blocks are split into S contiguous stages over 'pipe' (interleaved's V chunks
in `schedules.block_order`); embedding, final norm and head are replicated over it; each
device's batch slice is cut into K micro-batches. GPipe is a loop of K + S - 1 ticks,
every stage running what it holds and one `lax.ppermute` handing each output on;
`jax.grad` of the loop runs it in reverse: bubble (S - 1) / (K + S - 1). Dropout draws
from each example's global id and the global layer index (`layer_offset`).

Collectives written here: GPipe's `lax.ppermute` over 'pipe' once per tick; `lax.psum`
over 'pipe' of the loss and metrics and of the pipe-replicated parameters' gradients
(`pipeline_grads`). The table schedules' sends are in `ticks.exchange`; 'data' (and FSDP)
stays in the script.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from vit_pure.config import Execution, ViTConfig
from vit_pure.errors import UsageError
from vit_pure.model import (
    Parallel,
    compute_blocks,
    compute_params,
    dropout_keys,
    embed,
    encoder,
    head,
)
from vit_pure.pipeline import schedules
from vit_pure.pipeline.ticks import eval_logits, micro, schedule_grads
from vit_pure.step import StepConfig, accumulate, eval_sums, train_metrics


# ----------------------------------------------------------------------------- planning
def check_pipeline(cfg: ViTConfig, stages: int, microbatches: int,
                   local_batch: int | None = None) -> None:
    """ValueError (one line) unless the depth splits into `stages` and the per-device
    batch into `microbatches`."""
    if stages < 1 or microbatches < 1:
        raise ValueError(f"pipeline: stages ({stages}) and micro-batches ({microbatches}) "
                         f"must be positive")
    if cfg.depth % stages:
        raise ValueError(f"pipeline: depth {cfg.depth} of {cfg.name} does not split into "
                         f"{stages} equal stages (pipe must divide the depth)")
    if local_batch is not None and local_batch % microbatches:
        raise ValueError(f"pipeline: the per-device batch {local_batch} does not divide into "
                         f"{microbatches} micro-batches")


def step_config(sc: StepConfig) -> StepConfig:
    """What a pipeline runs of `sc`: the last block on every row. Each stage runs one
    program for whichever blocks it holds (`pipelined_encoder`), so no stage's last layer is
    statically the model's, and the class token's row cannot be split off there."""
    return dataclasses.replace(sc, execution=sc.execution.replace(last_block="all"))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe's idle share of stage-ticks: (S - 1) / (K + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


# ------------------------------------------------------------------------- the schedule
def pipelined_encoder(blocks, x_micro, cfg: ViTConfig, policy, ex_keys_micro, *,
                      par: Parallel, execution: Execution = Execution()):
    """GPipe over this stage's blocks (L/S layers, leading axis), over `par.pipe_axis`.

    x_micro (K, m, T, E): the embedded micro-batches (only stage 0's copy is read).
    ex_keys_micro (K, m) per-example dropout keys, or None.
    Returns (K, m, T, E): the encoder's outputs, valid on the last stage only (the other
    stages return their own last outputs, which the caller masks).
    """
    K, pipe_axis = x_micro.shape[0], par.pipe_axis
    S = lax.axis_size(pipe_axis)
    stage = lax.axis_index(pipe_axis)
    per_stage = jax.tree.leaves(blocks)[0].shape[0]
    if per_stage * S != cfg.depth:
        raise ValueError(f"pipeline: this stage holds {per_stage} of {cfg.depth} layers over "
                         f"{S} stages; split the blocks' layer axis over {pipe_axis!r}")
    # Activations move one stage down the line per tick; the last stage sends nothing
    # and stage 0 receives nothing (ppermute fills it with zeros).
    shift = [(s, s + 1) for s in range(S - 1)]

    received = jnp.zeros_like(x_micro[0])  # what this stage got from stage - 1
    outputs = []
    for t in range(K + S - 1):
        # Stage 0 starts micro-batch t (after the last one it repeats it: idle work);
        # every other stage continues the micro-batch the previous stage just finished.
        x = jnp.where(stage == 0, x_micro[min(t, K - 1)], received)
        # This stage holds micro-batch t - stage; its examples' keys seed the dropout
        # (clipped at the ends, where the stage is idle and its result is masked).
        keys = None if ex_keys_micro is None else \
            ex_keys_micro[jnp.clip(t - stage, 0, K - 1)]
        y = encoder(blocks, x, cfg, policy, keys, execution=execution,
                    par=Parallel(tp_axis=par.tp_axis), layer_offset=stage * per_stage)
        if t >= S - 1:  # on the last stage, the output of micro-batch t - (S - 1)
            outputs.append(y)
        if t < K + S - 2 and S > 1:
            # Collective-permute over the pipe axis: stage s's output -> stage s+1, the
            # input of its next tick. (Autodiff's transpose sends the cotangents back,
            # s+1 -> s, in the backward pass.)
            received = lax.ppermute(y, pipe_axis, perm=shift)
    return jnp.stack(outputs)


def pipelined_logits(params, images, cfg: ViTConfig, policy, *, train: bool = False,
                     rng=None, example_ids=None, par: Parallel, microbatches: int,
                     execution: Execution = Execution()):
    """`model.apply`, pipelined: images (b, h, w, C) -> logits (b, classes), valid on the
    last stage. params: this stage's blocks (L/S layers), every other parameter whole;
    `train`, `rng`, `example_ids` and `execution` as in `apply`.

    `par.gather` (FSDP) is applied once per step to the non-block params and to each of
    this stage's layers (`model.compute_blocks`), *before* the tick loop: inside it, every
    layer would all-gather its weights K + S - 1 times (and reduce-scatter as often in the
    backward pass).
    """
    ex_keys = dropout_keys(cfg, train, rng, example_ids, images.shape[0])
    top = compute_params({k: v for k, v in params.items() if k != "blocks"}, policy, par)
    blocks = compute_blocks(params["blocks"], policy, par)
    K = microbatches
    # Every stage embeds (a matmul, plus a stem's if any: cheap next to the blocks) but
    # only stage 0's result is read. The embedding's weights vary over the pipe axis (each
    # stage differentiates its own copy, see `pipeline_grads`); the images, replicated
    # over it, are marked varying too, so the patch projection's (and the stem's) two
    # operands agree, as policy.einsum requires. Nothing
    # differentiates the images, so this cast has no transpose: no collective. (The
    # images enter replicated over the pipe axis: the scripts split the batch over 'data'.)
    images = lax.pcast(images, par.pipe_axis, to="varying")
    x = embed(top, images, cfg, policy, ex_keys, execution)  # (b, T, E)
    y = pipelined_encoder(blocks, micro(x, K), cfg, policy,
                          None if ex_keys is None else micro(ex_keys, K),
                          par=par, execution=execution)
    y = y.reshape(x.shape)  # (K, m, T, E) -> (b, T, E), the examples back in order
    return head(top, y, cfg, policy)  # meaningful on the last stage only


def _on_last_stage(x, pipe_axis):
    """x where this is the last stage, zeros elsewhere (the mask of the idle copies)."""
    last = lax.axis_index(pipe_axis) == lax.axis_size(pipe_axis) - 1
    return jax.tree.map(lambda v: jnp.where(last, v, jnp.zeros_like(v)), x)


# ---------------------------------------------------------------------- training / eval
def pipeline_grads(sc: StepConfig, params, loss_scale, images_u8, labels, example_ids, key,
                   *, par: Parallel, microbatches: int, schedule: str = "gpipe",
                   virtual: int = 1):
    """`step.local_grads` for a pipeline stage: the loss and gradients of this device's
    slice of the batch, with the encoder pipelined over `pipe_axis` (`par.pipe_axis`).

    params["blocks"] is this stage's slice of the layers (varying over `pipe_axis`); every
    other parameter is replicated over `pipe_axis`. With `virtual` chunks per stage
    (interleaved) the blocks must be stored in `schedules.block_order`: stage s's slice is
    its chunks, virtual stages s, P + s, .... Returns (grads laid out like params,
    unscaled; {"loss", "accuracy"}), the same on every stage except for the blocks.
    Gradient accumulation (`sc.accum_steps`) nests outside the pipeline: each
    accumulation micro-batch is itself pipelined in `microbatches` pieces.

    The replicated pieces and the gradient pitfall: the embedding is used on stage 0 only
    and the final norm / head on the last stage only. Each stage marks its copy of them
    varying over `pipe_axis` (`lax.pcast`) *before* differentiating, so autodiff computes
    the plain per-stage gradient (nonzero on one stage only) and hides no reduction; the
    sum over stages is then the explicit `lax.psum` at the end, which hands every stage
    the whole gradient so that all copies take the same optimizer step. (Without the
    pcast, check_vma's transpose of the implicit broadcast would do that psum silently.)
    """
    pipe_axis = par.pipe_axis
    check_pipeline(sc.cfg, lax.axis_size(pipe_axis), microbatches,
                   labels.shape[0] // sc.accum_steps)
    m = labels.shape[0] // sc.accum_steps // microbatches
    if schedule != "gpipe" and sc.augment and (sc.mixup_alpha or sc.cutmix_alpha) and m % 2:
        raise UsageError(f"pipeline schedule {schedule}: each micro-batch is mixed on its "
                         f"own (pairs 2k, 2k+1), so it needs an even size, not {m}")

    def micro_metrics(p, images, labels, targets, example_ids, drop_key):
        logits = pipelined_logits(p, images, sc.cfg, sc.policy, train=True, rng=drop_key,
                                  example_ids=example_ids, par=par,
                                  microbatches=microbatches, execution=sc.execution)
        # All-reduce (sum) over the pipe axis: the loss exists on the last stage, every
        # other stage adds 0. Its transpose hands each stage the cotangent 1, which the
        # mask turns into 0 on all but the last stage.
        return lax.psum(_on_last_stage(train_metrics(sc, logits, labels, targets),
                                       pipe_axis), pipe_axis)

    # Varying over the pipe axis before the gradient (see the docstring): each stage's
    # copy of the replicated pieces gets its own, per-stage gradient.
    params = {k: v if k == "blocks" else lax.pcast(v, pipe_axis, to="varying")
              for k, v in params.items()}
    # step.accumulate: the batch preparation (augmentation, mixup / cutmix over the whole
    # local slice), the gradient and the accumulation of every step, so every stage sees
    # exactly the images, targets and micro-batches an unpipelined step sees.
    table = None if schedule == "gpipe" else schedules.build(
        schedule, lax.axis_size(pipe_axis), microbatches, virtual)

    def micro_grads(p, images_u8, labels, targets, example_ids, drop_key, seed, prepare):
        grads, sums = schedule_grads(sc, p, images_u8, labels, targets, example_ids, drop_key,
                                     seed, prepare, schedule=table, par=par)
        # All-reduce (sum) over the pipe axis: the metrics exist on the last stage only.
        return grads, lax.psum(sums, pipe_axis)

    grads, metrics = accumulate(sc, micro_metrics, params, loss_scale, images_u8, labels,
                                example_ids, key, grads_fn=None if table is None else micro_grads)

    # All-reduce (sum) over the pipe axis of the gradients of the pipe-replicated params:
    # the embedding's gradient is nonzero on stage 0 only, the final norm's and head's on
    # the last stage only; the sum gives every stage the whole gradient. The blocks'
    # gradients stay where their layers live.
    grads = {k: g if k == "blocks" else lax.psum(g, pipe_axis) for k, g in grads.items()}
    return grads, metrics


def pipeline_eval(sc: StepConfig, params, images_u8, labels, mask, *, par: Parallel,
                  microbatches: int, virtual: int = 1):
    """`step.local_eval` for a pipeline stage: sums over this device's slice (padding
    masked out) of loss, correct, count; the same on every stage.

    Uses `microbatches` pieces if the slice divides into them, else their greatest common
    divisor with the slice (an evaluation batch need not share the training batch's size).
    `virtual`: the chunks per stage of the layout (`schedules.block_order`) the blocks are
    stored in.
    """
    k = math.gcd(labels.shape[0], microbatches)
    # The forward ticks as one scan (ticks.eval_logits): GPipe's, or round the stages V
    # times through the chunks each stage stores.
    sums = eval_sums(sc, lambda images: eval_logits(
        sc, params, images, par=par, microbatches=k, virtual=virtual), images_u8, labels, mask)
    # All-reduce (sum) over the pipe axis: the sums exist on the last stage only.
    return lax.psum(_on_last_stage(sums, par.pipe_axis), par.pipe_axis)
