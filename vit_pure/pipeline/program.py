"""Pipeline parallelism for the ViT, inside `jax.shard_map`: GPipe (below) and the
table-driven schedules 1f1b, interleaved and zb-h1 (`schedule_grads`; their tables are
pipeline/schedules.py, zb-h1's split of B into I and W pipeline/split.py).

The encoder's stacked blocks (leading layer axis L) are split into S contiguous *stages*
over a mesh axis (the scripts call it 'pipe'; PartitionSpec P('pipe', ...) on the layer
axis), so stage s holds layers s*L/S ... (s+1)*L/S - 1. The rest of the model is
replicated over that axis, but only one stage really uses each piece:

    stage 0        patch embedding, class token, position embedding, blocks 0 .. L/S-1
    stage s        blocks s*L/S .. (s+1)*L/S - 1
    stage S-1      blocks ..., final LayerNorm, head, loss

Each device's slice of the batch (b examples) is cut into K micro-batches of b/K. The
schedule is GPipe's: a loop of K + S - 1 *ticks*; at tick t every stage runs its layers on
the activations it holds (stage 0 takes micro-batch t, fresh from the embedding), then one
`lax.ppermute` hands each stage's output to the next stage. Stage s works on micro-batch
t - s, so micro-batch k leaves the last stage at tick k + S - 1:

    tick:      0    1    2    3    4          (S = 2 stages, K = 4 micro-batches)
    stage 0:   m0   m1   m2   m3   .
    stage 1:   .    m0   m1   m2   m3         "." = idle (the bubble)

The backward pass is not written by hand: `jax.grad` differentiates the whole loop, which
runs the ticks in reverse with each ppermute transposed (stage s+1 -> s). That is GPipe:
all forwards, then all backwards. Out of S * (K + S - 1) stage-ticks, S * (S - 1) are
idle, so the *bubble fraction* is (S - 1) / (K + S - 1): more micro-batches, smaller bubble.

SPMD has no "idle": every device runs the same program every tick. An idle stage computes
on something harmless (zeros, or a repeat of a real micro-batch) and its result is
*masked*: the last stage keeps only the outputs of ticks S-1 .. K+S-2, and the loss is
zeroed on every stage but the last. A masked value gets a zero cotangent, so the idle work
adds exactly nothing to any gradient.

Randomness: dropout and stochastic depth draw from each example's global id and the
*global* layer index (`layer_offset` = stage * L/S): the single-device numbers.

Collectives written here (and nowhere else in the pipeline):
  * `lax.ppermute` over the pipe axis, once per tick: activations stage s -> s+1 (under
    tensor parallelism every 'model' rank holds and sends its own copy of them); the
    table-driven schedules also send cotangents s+1 -> s, and with virtual stages they
    all-gather the blocks over the pipe axis once per step (`schedule_grads`);
  * `lax.psum` over the pipe axis of the loss and metrics (they exist on the last stage
    only) and of the gradients of the pipe-replicated parameters (see `pipeline_grads`).
Everything about the 'data' axis (and FSDP) stays in the script, as with `step.local_grads`.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from vit_pure.config import Execution, ViTConfig
from vit_pure.errors import UsageError
from vit_pure.model import compute_params, dropout_keys, embed, encoder, head
from vit_pure.pipeline import schedules
from vit_pure.pipeline.split import Split, input_free
from vit_pure.pipeline.split import vary_like as _vary_like
from vit_pure.pipeline.split import zeros_ring as _zeros_ring
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


def bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe's idle share of stage-ticks: (S - 1) / (K + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def _micro(x, k: int):
    """(b, ...) -> (k, b/k, ...): micro-batch i is rows i*b/k ... (i+1)*b/k - 1."""
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])


# ------------------------------------------------------------------------- the schedule
def pipelined_encoder(blocks, x_micro, cfg: ViTConfig, policy, ex_keys_micro, *,
                      pipe_axis: str, execution: Execution = Execution(),
                      tp_axis: str | None = None):
    """GPipe over this stage's blocks (L/S layers, leading axis).

    x_micro (K, m, T, E): the embedded micro-batches (only stage 0's copy is read).
    ex_keys_micro (K, m) per-example dropout keys, or None.
    Returns (K, m, T, E): the encoder's outputs, valid on the last stage only (the other
    stages return their own last outputs, which the caller masks).
    """
    K = x_micro.shape[0]
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
        y = encoder(blocks, x, cfg, policy, keys, execution=execution, tp_axis=tp_axis,
                    layer_offset=stage * per_stage)
        if t >= S - 1:  # on the last stage, the output of micro-batch t - (S - 1)
            outputs.append(y)
        if t < K + S - 2 and S > 1:
            # Collective-permute over the pipe axis: stage s's output -> stage s+1, the
            # input of its next tick. (Autodiff's transpose sends the cotangents back,
            # s+1 -> s, in the backward pass.)
            received = lax.ppermute(y, pipe_axis, perm=shift)
    return jnp.stack(outputs)


def pipelined_logits(params, images, cfg: ViTConfig, policy, *, train: bool = False,
                     rng=None, example_ids=None, pipe_axis: str, microbatches: int,
                     execution: Execution = Execution(), tp_axis: str | None = None,
                     gather=None):
    """`model.apply`, pipelined: images (b, h, w, C) -> logits (b, classes), valid on the
    last stage. params: this stage's blocks (L/S layers), every other parameter whole;
    `train`, `rng`, `example_ids` and `execution` as in `apply`.

    `gather` (FSDP) is applied once per step to the non-block params and to each of this
    stage's layers, *before* the tick loop: inside it, every layer would all-gather its
    weights K + S - 1 times (and reduce-scatter as often in the backward pass).
    """
    ex_keys = dropout_keys(cfg, train, rng, example_ids, images.shape[0])
    top = compute_params({k: v for k, v in params.items() if k != "blocks"}, policy, gather)
    blocks = params["blocks"]  # cast to the compute dtype layer by layer, in the encoder
    if gather is not None:
        n = jax.tree.leaves(blocks)[0].shape[0]
        layers = [compute_params(jax.tree.map(lambda a, i=i: a[i], blocks), policy, gather,
                                 "blocks") for i in range(n)]
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    K = microbatches
    # Every stage embeds (a matmul, plus a stem's if any: cheap next to the blocks) but
    # only stage 0's result is read. The embedding's weights vary over the pipe axis (each
    # stage differentiates its own copy, see `pipeline_grads`); the images, replicated
    # over it, are marked varying too, so the patch projection's (and the stem's) two
    # operands agree, as policy.einsum requires. Nothing
    # differentiates the images, so this cast has no transpose: no collective. (The
    # images enter replicated over the pipe axis: the scripts split the batch over 'data'.)
    images = lax.pcast(images, pipe_axis, to="varying")
    x = embed(top, images, cfg, policy, ex_keys, execution)  # (b, T, E)
    y = pipelined_encoder(blocks, _micro(x, K), cfg, policy,
                          None if ex_keys is None else _micro(ex_keys, K),
                          pipe_axis=pipe_axis, execution=execution, tp_axis=tp_axis)
    y = y.reshape(x.shape)  # (K, m, T, E) -> (b, T, E), the examples back in order
    return head(top, y, cfg, policy)  # meaningful on the last stage only


def _on_last_stage(x, pipe_axis):
    """x where this is the last stage, zeros elsewhere (the mask of the idle copies)."""
    last = lax.axis_index(pipe_axis) == lax.axis_size(pipe_axis) - 1
    return jax.tree.map(lambda v: jnp.where(last, v, jnp.zeros_like(v)), x)


# ------------------------------------------------------ the table-driven schedules
def _is_key(a) -> bool:
    return jnp.issubdtype(a.dtype, jax.dtypes.prng_key)


def _bits(a):
    """a, or a PRNG key array's raw bits (what the residual ring holds of a key)."""
    return jax.random.key_data(a) if _is_key(a) else a


def schedule_grads(sc: StepConfig, params, images_u8, labels, targets, example_ids, drop_key,
                   seed, prepare_images, *, schedule, pipe_axis: str, tp_axis: str | None = None,
                   gather=None):
    """One pipelined forward and backward pass run from `schedule`'s table (1f1b,
    interleaved, zb-h1): the gradients of `seed` x the mean loss (seed: the loss scale),
    laid out like params, and this stage's {"loss", "accuracy"} sums (last stage only).

    The program, per stage (every device runs it, reading its own column of the table):
      before the ticks: one `jax.vjp` of the FSDP gather (with virtual stages: the cast
        and the blocks' all-gather over 'pipe'), pulled back after them;
      one `lax.scan` over the ticks; each tick, in this order:
        F  `lax.cond`: stage 0 prepares and embeds the micro-batch of its first chunk's F;
           `jax.vjp` of the chunk (blocks, cast layer by layer, then head and loss, masked
           to zero but on the last virtual stage), its residuals written into a ring of
           slots, the output kept to send;
        B  `lax.cond`: the residuals read back, the pull-back of the received cotangent
           (the loss's seed on the last virtual stage), the gradients (in the compute
           dtype) added in float32; stage 0 pulls its input cotangent back through the
           embedding (the micro-batch prepared and embedded again);
           zb-h1's I: the pull-back with the weight matmuls' weights held constant
           (pipeline/split.py): the input cotangent, the other parameters' gradients and
           each weight matmul's output cotangent dy_l, kept in a second ring until W;
        W  zb-h1: `lax.cond`: each weight matmul's weight gradient from its activation
           operand (kept at F in the residual ring) and dy_l; no cotangent chain again;
        then two `lax.ppermute`s over the pipe axis that every stage joins: the forward's
           output to the next stage, the input cotangent to the previous one.
    The parameters used on one stage only (embedding, head) are varying over the pipe
    axis before the ticks (the caller's pcast): a replicated one would get an implicit
    psum over 'pipe' from the pull-back inside the B branch, which only the devices on that
    branch would join (a deadlock). Their gradients are summed over 'pipe' once, after.
    """
    cfg, policy, execution = sc.cfg, sc.policy, sc.execution
    P_, M, V = schedule.stages, schedule.microbatches, schedule.virtual
    stage = lax.axis_index(pipe_axis)
    per = jax.tree.leaves(params["blocks"])[0].shape[0]  # layers this stage holds
    if per * P_ != cfg.depth or per % V:
        raise ValueError(f"pipeline: {per} layers per stage do not split into {V} chunks")
    chunk = per // V
    table = jnp.asarray(schedule.rows())  # (ticks, 6, P)
    ring = schedules.ring_size(schedule)
    slots = ring if schedules.write_slots(schedule, ring, ring) is not None else ring + 1
    writes = jnp.asarray(schedules.write_slots(schedule, ring, slots))  # (ticks, P)
    held_dy = schedules.kept_size(schedule)  # zb-h1: output cotangents held from I to W

    def prepare(p):
        top = compute_params({k: v for k, v in p.items() if k != "blocks"}, policy, gather)
        blocks = p["blocks"]
        if gather is not None:
            layers = [compute_params(jax.tree.map(lambda a, i=i: a[i], blocks), policy,
                                     gather, "blocks") for i in range(per)]
            blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        if V == 1:  # cast layer by layer in the chunk: no compute-dtype copy held
            return top, jax.tree.map(lambda a: a[None], blocks)
        # All-gather over 'pipe' of the blocks (in the compute dtype), then this stage's
        # chunks: virtual stage v P + s (layers (vP + s) c ...) runs on stage s. (Its
        # transpose, after the ticks, reduce-scatters the gradients back to their stages.)
        whole = lax.all_gather(policy.cast_to_compute(blocks), pipe_axis, axis=0, tiled=True)
        starts = (jnp.arange(V) * P_ + stage) * chunk
        return top, jax.tree.map(lambda a: jnp.stack(
            [lax.dynamic_slice_in_dim(a, starts[v], chunk) for v in range(V)]), whole)

    (top, chunks), prepare_vjp = jax.vjp(prepare, params)
    ex_keys = dropout_keys(cfg, True, drop_key, example_ids, labels.shape[0])
    # The raw images are held through the ticks, each micro-batch prepared where it is
    # embedded (`prepare_images`: its rows of the whole slice's augmentation).
    u8 = _micro(lax.pcast(images_u8, pipe_axis, to="varying"), M)
    ids = _micro(example_ids, M)
    ys_lab, ys_tgt = _micro(labels, M), _micro(targets, M)
    keys = None if ex_keys is None else _micro(ex_keys, M)

    def embed_mb(t, mb):
        """Micro-batch mb prepared and embedded (stage 0 runs it in the tick of its F, and
        again in the pull-back at its B: nothing of either is kept between)."""
        images = prepare_images(u8[mb], ys_lab[mb], ids[mb])
        return embed(t, images, cfg, policy, None if keys is None else keys[mb], execution)

    def layers_of(v):
        return [jax.tree.map(lambda a, i=i: a[v, i], chunks) for i in range(chunk)]

    def chunk_fn(cp, t, x, v, mb):
        """Chunk v on this stage over micro-batch mb: (output, loss (0 but on the last
        virtual stage), accuracy)."""
        y = encoder(cp, x, cfg, policy, None if keys is None else keys[mb],
                    execution=execution, tp_axis=tp_axis,
                    layer_offset=(v * P_ + stage) * chunk)
        m = train_metrics(sc, head(t, y, cfg, policy), ys_lab[mb], ys_tgt[mb])
        last = (stage == P_ - 1) & (v == V - 1)
        return y, jnp.where(last, m["loss"], 0.0), jnp.where(last, m["accuracy"], 0.0)

    def pulled(v, mb, x):
        """F: (outputs, pull-back, the weight matmuls' operands kept for W (zb-h1))."""
        if split is not None:
            return split.forward((layers_of(v), top), x, v, mb)
        return *jax.vjp(lambda cp, t, x: chunk_fn(cp, t, x, v, mb), layers_of(v), top, x), []

    def forward(v, mb, x):
        """Outputs, what the ring keeps (residuals, then W's operands), pull-back's tree."""
        out, pull, acts = pulled(v, mb, x)
        res, tree = jax.tree.flatten(pull)
        return out, [a for a, f in zip(res, fixed) if not f] + acts, tree

    # A trace for the ring's shapes and types (XLA drops it); mb, v vary as the table's do.
    zero = lax.pcast(jnp.zeros((), jnp.int32), pipe_axis, to="varying")
    x0 = embed_mb(top, zero)  # its shape and type only
    # zb-h1: B split into I and W, the weight matmuls' gradients (pipeline/split.py).
    split = Split(lambda p, x, v, mb: chunk_fn(*p, x, v, mb), (layers_of(zero), top), x0,
                  zero, zero) if schedule.split_backward else None
    # Residuals that depend on neither x nor mb (the weights, their reshapes) stay out of
    # the ring: computed again at B.
    fixed = input_free(lambda mb, x: jax.tree.leaves(pulled(zero, mb, x)[1]), zero, x0)
    n_pull = fixed.count(False)  # the ring's first n_pull arrays are the pull-back's
    (y0, loss0, _), res0, layout = forward(zero, zero, x0)
    # A PRNG key residual (a rematerialised block's dropout keys) is kept as its raw bits:
    # a ring of keys would not keep the varying type that the branches need.
    impls = [jax.random.key_impl(a) if _is_key(a) else None for a in res0[:n_pull]]
    rings0 = [_zeros_ring(_bits(a), slots, pipe_axis) for a in res0]
    # The gradients add up in float32 over the micro-batches, cast once at the end.
    zeros = jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), (chunks, top))

    def pullback(v, mb, res, cot):
        again = jax.tree.leaves(pulled(v, mb, jnp.zeros_like(x0))[1])  # XLA keeps the fixed
        it = iter(a if k is None else jax.random.wrap_key_data(a, impl=k)
                  for a, k in zip(res[:n_pull], impls))
        pull = jax.tree.unflatten(layout, [a if f else next(it) for a, f in zip(again, fixed)])
        if split is None:
            return *pull(cot), []  # d chunk params, d top, d x, no kept cotangents
        (g_cp, g_top), dx, dys = split.input_grads(pull(cot))  # None for the weights
        return g_cp, g_top, dx, dys

    def add_grads(acc, v, g_cp, g_top):  # a None gradient (zb-h1's I or W) adds nothing
        g_chunks, g_tops = acc
        for i, g_layer in enumerate(g_cp):
            g_chunks = jax.tree.map(lambda g, a, i=i: a if g is None else a.at[v, i].add(
                g.astype(a.dtype)), g_layer, g_chunks, is_leaf=lambda g: g is None)
        return g_chunks, jax.tree.map(lambda g, a: a if g is None else a + g.astype(a.dtype),
                                      g_top, g_tops, is_leaf=lambda g: g is None)

    def slot(mb, v, n=ring):  # idle (mb = -1): the last slot (the residuals': read, unused)
        return jnp.where(mb >= 0, (mb * V + v) % n, n)  # n=held_dy: zb-h1's kept cotangents

    def tick(carry, rows):
        row, write = rows
        recv_f, recv_b, rings, cots, grads, sums = carry
        f_mb, f_v, b_mb, b_v, w_mb, w_v = (r[stage] for r in row)

        # F: the chunk's forward and its residuals (zeros on an idle tick). The ring is
        # written outside the branch, in place: an idle tick writes into a free slot.
        def do_f(x):
            (y, loss, acc), res, _ = forward(f_v, f_mb, x)
            return y, [_vary_like(_bits(a), r[0]) for a, r in zip(res, rings)], loss, acc

        def no_f(x):
            zero = jnp.zeros_like(loss0)
            return jnp.zeros_like(y0), [jnp.zeros_like(r[0]) for r in rings], zero, zero

        x = lax.cond((stage == 0) & (f_v == 0) & (f_mb >= 0),  # stage 0 embeds its input
                     lambda r: _vary_like(embed_mb(top, f_mb), r), lambda r: r, recv_f)
        y, res, loss, acc = lax.cond(f_mb >= 0, do_f, no_f, x)
        rings = [r.at[write[stage]].set(a) for r, a in zip(rings, res)]
        sums = (sums[0] + loss, sums[1] + acc)

        def cotangent(v, dy):
            last = (stage == P_ - 1) & (v == V - 1)
            return (jnp.where(last, jnp.zeros_like(dy), dy),
                    jnp.zeros_like(loss0) + jnp.where(last, seed / M, 0.0),
                    jnp.zeros_like(loss0))

        # Branches return this tick's gradients (or zeros); the sums add up outside them.
        def unless(pred, fn, *xs):
            return lax.cond(pred, fn, lambda *a: jax.tree.map(jnp.zeros_like, fn(*a)), *xs)

        # B (zb-h1: I): the pull-back of the received cotangent through the residuals
        # (zb-h1: the weight matmuls' output cotangents kept for W, their weights left out).
        def do_b(res, dy):
            g_cp, g_top, dx, dys = pullback(b_v, b_mb, res, cotangent(b_v, dy))
            return dx, dys, policy.cast_to_compute(g_cp), g_top

        dx, dys, *g = unless(b_mb >= 0, do_b, [r[slot(b_mb, b_v)] for r in rings], recv_b)
        grads = add_grads(grads, jnp.maximum(b_v, 0), *g)

        # Stage 0's input cotangent through the embedding (run again: nothing kept).
        def do_embed(dx):
            _, pull = jax.vjp(lambda t: embed_mb(t, b_mb), top)
            return pull(_vary_like(dx, x0))[0]

        g_top = unless((stage == 0) & (b_v == 0) & (b_mb >= 0), do_embed, dx)
        grads = grads[0], jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads[1], g_top)

        if split is not None:  # W: each weight matmul's gradient from its kept a_l, dy_l
            cots = [c.at[slot(b_mb, b_v, held_dy)].set(d) for c, d in zip(cots, dys)]

            def do_w(res, dys):
                g = split.weight_grads((layers_of(w_v), top), res[n_pull:], dys, w_v, w_mb)
                return policy.cast_to_compute(g[0]), g[1]

            g = unless(w_mb >= 0, do_w, [r[slot(w_mb, w_v)] for r in rings],
                       [c[slot(w_mb, w_v, held_dy)] for c in cots])
            grads = add_grads(grads, jnp.maximum(w_v, 0), *g)

        # Collective-permutes over the pipe axis, joined by every stage every tick: the
        # forward's output to the next stage, the input cotangent to the previous one
        # (with virtual stages round the ring: the last stage feeds stage 0's next chunk).
        fwd_perm = [(s, (s + 1) % P_) for s in range(P_ if V > 1 else P_ - 1)]
        bwd_perm = [((s + 1) % P_, s) for s in range(P_ if V > 1 else P_ - 1)]
        recv_f = lax.ppermute(y, pipe_axis, perm=fwd_perm)
        recv_b = lax.ppermute(dx, pipe_axis, perm=bwd_perm)
        return (recv_f, recv_b, rings, cots, grads, sums), None

    # zb-h1: the output cotangents dy_l from I until W, a slot more for idle ticks' writes.
    cots0 = [] if split is None else [_zeros_ring(t, held_dy + 1) for t in split.taps()]
    carry = (jnp.zeros_like(y0), jnp.zeros_like(x0), rings0, cots0, zeros,
             (jnp.zeros_like(loss0), jnp.zeros_like(loss0)))
    carry, _ = lax.scan(tick, carry, (table, writes))
    _, _, _, _, (g_chunks, g_top), (loss, acc) = carry
    g_top = jax.tree.map(lambda g, t: g.astype(t.dtype), g_top, top)
    g_chunks = jax.tree.map(lambda g, c: g.astype(c.dtype), g_chunks, chunks)
    (grads,) = prepare_vjp((g_top, g_chunks))
    return grads, {"loss": loss / M, "accuracy": acc / M}


# ---------------------------------------------------------------------- training / eval
def pipeline_grads(sc: StepConfig, params, loss_scale, images_u8, labels, example_ids, key,
                   *, pipe_axis: str, microbatches: int, tp_axis: str | None = None,
                   gather=None, schedule: str = "gpipe", virtual: int = 1):
    """`step.local_grads` for a pipeline stage: the loss and gradients of this device's
    slice of the batch, with the encoder pipelined over `pipe_axis`.

    params["blocks"] is this stage's slice of the layers (varying over `pipe_axis`); every
    other parameter is replicated over `pipe_axis`. Returns (grads laid out like params,
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
    check_pipeline(sc.cfg, lax.axis_size(pipe_axis), microbatches,
                   labels.shape[0] // sc.accum_steps)
    m = labels.shape[0] // sc.accum_steps // microbatches
    if schedule != "gpipe" and sc.augment and (sc.mixup_alpha or sc.cutmix_alpha) and m % 2:
        raise UsageError(f"pipeline schedule {schedule}: each micro-batch is mixed on its "
                         f"own (pairs 2k, 2k+1), so it needs an even size, not {m}")

    def micro_metrics(p, images, labels, targets, example_ids, drop_key):
        logits = pipelined_logits(p, images, sc.cfg, sc.policy, train=True, rng=drop_key,
                                  example_ids=example_ids, pipe_axis=pipe_axis,
                                  microbatches=microbatches, execution=sc.execution,
                                  tp_axis=tp_axis, gather=gather)
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
                                     seed, prepare, schedule=table, pipe_axis=pipe_axis,
                                     tp_axis=tp_axis, gather=gather)
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


def pipeline_eval(sc: StepConfig, params, images_u8, labels, mask, *, pipe_axis: str,
                  microbatches: int, tp_axis: str | None = None, gather=None):
    """`step.local_eval` for a pipeline stage: sums over this device's slice (padding
    masked out) of loss, correct, count; the same on every stage.

    Uses `microbatches` pieces if the slice divides into them, else their greatest common
    divisor with the slice (an evaluation batch need not share the training batch's size).
    """
    k = math.gcd(labels.shape[0], microbatches)
    sums = eval_sums(sc, lambda images: pipelined_logits(
        params, images, sc.cfg, sc.policy, pipe_axis=pipe_axis, microbatches=k,
        execution=sc.execution, tp_axis=tp_axis, gather=gather), images_u8, labels, mask)
    # All-reduce (sum) over the pipe axis: the sums exist on the last stage only.
    return lax.psum(_on_last_stage(sums, pipe_axis), pipe_axis)
