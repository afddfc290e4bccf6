"""The pipeline's entry points inside `jax.shard_map`: a training step's gradients and an
evaluation's sums, each one run of the schedule's table through `tick.run_ticks`.

The encoder's stacked blocks are split over the 'pipe' mesh axis (stage s stores layers
s L/P .. (s+1) L/P - 1, or with interleaved's V chunks those of `schedules.block_order`);
the embedding (run on stage 0) and the final norm and head (last stage) are replicated
over it. Each device's slice of the batch is cut into M micro-batches. Collectives written
here: the psums over 'pipe' of the metrics and of the pipe-replicated parameters'
gradients; the sends are `tick.exchange`'s; FSDP's gathers are the script's hook.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from vit_pure.config import ViTConfig
from vit_pure.errors import UsageError
from vit_pure.model import Parallel, compute_blocks, compute_params, dropout_keys, head
from vit_pure.pipeline import schedules
from vit_pure.pipeline.ring import residual_layout
from vit_pure.pipeline.tick import (
    Program,
    SplitBackward,
    Stage,
    WholeBackward,
    micro,
    run_ticks,
    static_plan,
)
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
    program for whichever chunk it holds, so no stage's last layer is statically the
    model's, and the class token's row cannot be split off there."""
    return dataclasses.replace(sc, execution=sc.execution.replace(last_block="all"))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe's idle share of stage-ticks: (S - 1) / (K + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


# ------------------------------------------------------------------- the parameters
def prepare_params(params, policy, par: Parallel, virtual: int):
    """(top, chunks, pull_params): the non-block parameters in the compute dtype, this
    stage's blocks as (V, L/(PV), ...) chunks, and the pull-back of that preparation
    (after the ticks it takes the gradients back to params' layout: the FSDP
    reduce-scatters). The stage's blocks are its chunks already, in order (the layout's
    `schedules.block_order`), so nothing moves over 'pipe'; FSDP gathers each layer once
    per step, not once per tick."""
    per = jax.tree.leaves(params["blocks"])[0].shape[0]
    if per % virtual:
        raise ValueError(f"pipeline: {per} layers per stage do not split into {virtual} chunks")

    def prepare(p):
        top = compute_params({k: v for k, v in p.items() if k != "blocks"}, policy, par)
        blocks = compute_blocks(p["blocks"], policy, par)
        return top, jax.tree.map(lambda a: a.reshape(virtual, per // virtual, *a.shape[1:]),
                                 blocks)

    (top, chunks), pull_params = jax.vjp(prepare, params)
    return top, chunks, pull_params


def _on_last_stage(x, pipe_axis):
    """x where this is the last stage, zeros elsewhere."""
    last = lax.axis_index(pipe_axis) == lax.axis_size(pipe_axis) - 1
    return jax.tree.map(lambda v: jnp.where(last, v, jnp.zeros_like(v)), x)


# ------------------------------------------------------------------------------ training
def table_grads(sc: StepConfig, params, images_u8, labels, targets, example_ids, drop_key,
                seed, prepare_images, *, schedule: schedules.Schedule, par: Parallel):
    """One pipelined forward and backward pass run from `schedule`'s table: the gradients
    of `seed` x the mean loss (seed: the loss scale), laid out like params, and this
    stage's {"loss", "accuracy"} sums (last stage only)."""
    M, V, axis = schedule.microbatches, schedule.virtual, par.pipe_axis
    top, chunks, pull_params = prepare_params(params, sc.policy, par, V)
    labels_mb, targets_mb = micro(labels, M), micro(targets, M)

    def output(top, y, mb, last):  # F's sums: the loss and accuracy, last stage only
        m = train_metrics(sc, head(top, y, sc.cfg, sc.policy), labels_mb[mb], targets_mb[mb])
        return jnp.where(last, m["loss"], 0.0), jnp.where(last, m["accuracy"], 0.0)

    ex_keys = dropout_keys(sc.cfg, True, drop_key, example_ids, labels.shape[0])
    # The raw images are held through the ticks, each micro-batch prepared where it is
    # embedded (`prepare_images`: its rows of the whole slice's preparation).
    stage = Stage(sc.cfg, sc.policy, sc.execution, schedule.stages, V, lax.axis_index(axis),
                  micro(lax.pcast(images_u8, axis, to="varying"), M), micro(example_ids, M),
                  labels_mb, None if ex_keys is None else micro(ex_keys, M), prepare_images,
                  output, top, chunks, par)
    # Traces only (mb and v vary over the pipe axis, as the table's entries do).
    zero = lax.pcast(jnp.zeros((), jnp.int32), axis, to="varying")
    x0 = stage.embed_mb(top, zero)
    backward = SplitBackward(stage, zero, x0) if schedule.split_backward else \
        WholeBackward(stage)
    layout = residual_layout(backward.forward, zero, x0)
    y0, (loss0, _) = layout.outputs
    program = Program(stage, backward, layout, seed / M, y0, x0)
    # The gradients add up in float32 over the micro-batches, cast once at the end.
    grads0 = jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), (chunks, top))
    carry = run_ticks(program, static_plan(schedule), (jnp.zeros_like(loss0),) * 2, grads0)
    g_chunks, g_top = carry.grads
    g_top = jax.tree.map(lambda g, t: g.astype(t.dtype), g_top, top)
    g_chunks = jax.tree.map(lambda g, c: g.astype(c.dtype), g_chunks, chunks)
    (grads,) = pull_params((g_top, g_chunks))
    loss, accuracy = carry.sums
    return grads, {"loss": loss / M, "accuracy": accuracy / M}


def pipeline_grads(sc: StepConfig, params, loss_scale, images_u8, labels, example_ids, key,
                   *, par: Parallel, microbatches: int, schedule: str = "gpipe",
                   virtual: int = 1):
    """`step.local_grads` for a pipeline stage: the loss and gradients of this device's
    slice of the batch, the encoder pipelined over `par.pipe_axis` by `schedule`'s table.

    params["blocks"] is this stage's slice of the layers (with `virtual` chunks, stored in
    `schedules.block_order`); every other parameter is replicated over the pipe axis.
    Returns (grads laid out like params, unscaled; {"loss", "accuracy"}), the same on
    every stage but for the blocks. Gradient accumulation (`sc.accum_steps`) nests
    outside: each accumulation micro-batch is itself pipelined in `microbatches` pieces.

    The gradient pitfall: the embedding is used on stage 0 only, the final norm and head
    on the last stage only. Each stage marks its copy varying over the pipe axis before
    the ticks, so its pull-back is the plain per-stage gradient (a replicated one would
    get an implicit psum over 'pipe' inside the B branch, which only the devices on that
    branch would join: a deadlock); the sum over stages is the explicit psum at the end.
    """
    axis = par.pipe_axis
    check_pipeline(sc.cfg, lax.axis_size(axis), microbatches,
                   labels.shape[0] // sc.accum_steps)
    m = labels.shape[0] // sc.accum_steps // microbatches
    if sc.augment and (sc.mixup_alpha or sc.cutmix_alpha) and m % 2:
        raise UsageError(f"pipeline schedule {schedule}: each micro-batch is mixed on its "
                         f"own (pairs 2k, 2k+1), so it needs an even size, not {m}")
    params = {k: v if k == "blocks" else lax.pcast(v, axis, to="varying")
              for k, v in params.items()}
    table = schedules.build(schedule, lax.axis_size(axis), microbatches, virtual)

    def micro_grads(p, images_u8, labels, targets, example_ids, drop_key, seed, prepare):
        grads, sums = table_grads(sc, p, images_u8, labels, targets, example_ids, drop_key,
                                  seed, prepare, schedule=table, par=par)
        # All-reduce (sum) over the pipe axis: the metrics exist on the last stage only.
        return grads, lax.psum(sums, axis)

    # step.accumulate prepares the batch (augmentation, mixup / cutmix over the whole
    # slice) and hands each micro-batch's rows to the ticks, so every stage sees exactly
    # the images, targets and micro-batches an unpipelined step sees.
    grads, metrics = accumulate(sc, None, params, loss_scale, images_u8, labels,
                                example_ids, key, grads_fn=micro_grads)
    # All-reduce (sum) over the pipe axis of the pipe-replicated params' gradients: the
    # embedding's is nonzero on stage 0 only, the head's on the last stage only. The
    # blocks' gradients stay where their layers live.
    grads = {k: g if k == "blocks" else lax.psum(g, axis) for k, g in grads.items()}
    return grads, metrics


# ---------------------------------------------------------------------------- evaluation
def table_logits(sc: StepConfig, params, images, *, par: Parallel, microbatches: int,
                 virtual: int = 1):
    """Logits (b, classes) of prepared images (b, h, w, C), valid on the last stage: the
    forward ticks of `schedules.forward_only` (stage s runs micro-batch t - s at tick t;
    with V chunks, round the stages V times) through the training's tick, keeping no
    residuals. Each stage runs the blocks it stores: no gather over 'pipe'."""
    axis = par.pipe_axis
    P, K = lax.axis_size(axis), microbatches
    top, chunks, _ = prepare_params(params, sc.policy, par, virtual)
    b = images.shape[0] // K

    def output(top, y, mb, last):  # F's sums: the logits, at row mb, last stage only
        logits = jnp.where(last, head(top, y, sc.cfg, sc.policy), 0.0)
        return jnp.zeros((K, *logits.shape), logits.dtype).at[mb].set(logits)

    zeros = jnp.zeros((K, b), jnp.int32)
    stage = Stage(sc.cfg, sc.policy, sc.execution, P, virtual, lax.axis_index(axis),
                  micro(lax.pcast(images, axis, to="varying"), K), zeros, zeros, None,
                  lambda images, labels, ids: images, output, top, chunks, par)
    zero = lax.pcast(jnp.zeros((), jnp.int32), axis, to="varying")
    x0 = stage.embed_mb(top, zero)
    y0, logits0 = stage.fn(stage.layers(zero), top, x0, zero, zero)  # types only
    program = Program(stage, None, None, None, jnp.zeros_like(y0), jnp.zeros_like(x0))
    carry = run_ticks(program, static_plan(schedules.forward_only(P, K, virtual)),
                      jnp.zeros_like(logits0))
    return carry.sums.reshape(images.shape[0], -1)


def pipeline_eval(sc: StepConfig, params, images_u8, labels, mask, *, par: Parallel,
                  microbatches: int, virtual: int = 1):
    """`step.local_eval` for a pipeline stage: sums over this device's slice (padding
    masked out) of loss, correct, count; the same on every stage.

    Uses `microbatches` pieces if the slice divides into them, else their greatest common
    divisor with the slice (an evaluation batch need not share the training batch's size).
    `virtual`: the chunks per stage of the layout the blocks are stored in.
    """
    k = math.gcd(labels.shape[0], microbatches)
    sums = eval_sums(sc, lambda images: table_logits(
        sc, params, images, par=par, microbatches=k, virtual=virtual), images_u8, labels, mask)
    # All-reduce (sum) over the pipe axis: the sums exist on the last stage only.
    return lax.psum(_on_last_stage(sums, par.pipe_axis), par.pipe_axis)
