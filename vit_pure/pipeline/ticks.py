"""The table-driven pipeline program (1f1b, interleaved, zb-h1), phase by phase.

`schedule_grads` runs one schedule's table (pipeline/schedules.py) inside shard_map:

    plan = static_plan(table)                   numbers read off the table, no jax
    top, chunks, pull_params = prepare_params(...)   the FSDP gather and this stage's
                                                V chunks, kept for its vjp
    stage = Stage(...)                          the micro-batches and the chunk function
    layout = residual_layout(stage)             what the ring keeps of a chunk's pull-back
    carry = lax.scan(tick, ...)                 per tick: run_f, run_b, run_w, exchange
    finish(...)                                 the gradients pulled back, cast, returned

Every point-to-point send of these schedules is in ONE function, `exchange`: the
`lax.ppermute`s over the pipe axis that end a tick (activations forward, input cotangents
back). The only other collectives run here are others' code: the model's
tensor-parallel psums over 'model', bound inside the chunk, and FSDP's all-gathers over
'data' (the script's `Parallel.gather`, in `prepare_params`). Nothing gathers the blocks over
'pipe': each stage stores exactly the chunks it runs (the layout's block order,
`schedules.block_order`, which the script applies when it places the state).

The parameters used on one stage only (embedding, head) are varying over the pipe axis
before the ticks (the caller's pcast): a replicated one would get an implicit psum over
'pipe' from the pull-back inside the B branch, which only the devices on that branch would
join (a deadlock). Their gradients are summed over 'pipe' once, after (the caller's).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
from vit_pure.pipeline.split import Split, input_free, same_data, vary_like, zeros_ring
from vit_pure.step import StepConfig, train_metrics

IDLE = schedules.IDLE


def micro(x, k: int):
    """(b, ...) -> (k, b/k, ...): micro-batch i is rows i*b/k ... (i+1)*b/k - 1."""
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])


def _is_key(a) -> bool:
    return jnp.issubdtype(a.dtype, jax.dtypes.prng_key)


def _bits(a):
    """a, or a PRNG key array's raw bits (what the residual ring holds of a key)."""
    return jax.random.key_data(a) if _is_key(a) else a


# ------------------------------------------------------------------- phase 1: the plan
@dataclasses.dataclass(frozen=True, eq=False)
class StaticPlan:
    """What the program reads off the table before tracing anything (numpy, no jax)."""
    rows: np.ndarray      # (ticks, 6, P): F, F's chunk, B, B's chunk, W, W's chunk
    slots: np.ndarray     # (ticks, 5, P): the residual ring's slot F writes, B reads, W
                          # reads; the cotangent ring's slot I writes, W reads (idle: 0)
    ring: int             # the residual ring's slots: the most sets a stage holds
    kept: int             # zb-h1: slots of the output cotangents held from I to W
    arrive: np.ndarray    # (ticks, 3, P) bool: an activation / a cotangent arrives; the
                          # stage sends its F's output (not its B's cotangent)
    segments: tuple       # the scans, in order (`schedules.Segment`)

    def sends(self) -> int:
        """Collective-permutes per step: what the compiled program runs."""
        return schedules.sends(self.segments)


def static_plan(schedule: schedules.Schedule) -> StaticPlan:
    """The ring's sizes and slots, the arrivals and the scans of `schedule`."""
    schedules.check_sends(schedule)
    arrivals = schedules.arrivals(schedule)  # stage s + 1's activation comes from stage s
    s = schedule
    res, cot = schedules.residual_slots(s), schedules.cotangent_slots(s)
    kept = [cot.at(s.bwd, s.bwd_chunk), cot.at(s.wgt, s.wgt_chunk)] if s.split_backward \
        else [np.zeros_like(s.fwd)] * 2  # no cotangent is kept: the ring's one slot
    slots = np.stack([res.at(s.fwd, s.fwd_chunk), res.at(s.bwd, s.bwd_chunk),
                      res.at(s.wgt, s.wgt_chunk), *kept], axis=1)
    return StaticPlan(rows=schedule.rows(), slots=slots.astype(np.int32),
                      ring=res.size, kept=cot.size,
                      arrive=np.stack([*arrivals, np.roll(arrivals[0], -1, axis=1)], axis=1),
                      segments=schedules.segments(schedule))


# ------------------------------------------------------- phase 2: the parameters' prep
def prepare_params(params, policy, par: Parallel, virtual: int):
    """(top, chunks, pull_params): the non-block parameters in the compute dtype, this
    stage's blocks as (V, L/(PV), ...) chunks, and the pull-back of that preparation
    (after the ticks it takes the gradients back to params' layout: the FSDP
    reduce-scatters). The stage's blocks are its chunks already, in order (the layout's
    `schedules.block_order`): chunk v is rows v L/(PV) ... of them, so nothing moves over
    'pipe'."""
    per = jax.tree.leaves(params["blocks"])[0].shape[0]

    def prepare(p):
        top = compute_params({k: v for k, v in p.items() if k != "blocks"}, policy, par)
        blocks = compute_blocks(p["blocks"], policy, par)
        return top, jax.tree.map(lambda a: a.reshape(virtual, per // virtual, *a.shape[1:]),
                                 blocks)

    (top, chunks), pull_params = jax.vjp(prepare, params)
    return top, chunks, pull_params


# ------------------------------------------------- phase 3: micro-batches and the chunk
@dataclasses.dataclass(frozen=True, eq=False)
class Stage:
    """One stage's micro-batches and chunk function (closed over by the tick's branches).
    u8 / ids / labels / targets / keys: the slice cut into M micro-batches (keys None
    without dropout); top / chunks: `prepare_params`'s; split: zb-h1's (else None)."""
    sc: StepConfig
    stages: int
    virtual: int
    stage: jax.Array
    u8: jax.Array
    ids: jax.Array
    labels: jax.Array
    targets: jax.Array
    keys: jax.Array | None
    prepare_images: object
    top: dict
    chunks: dict
    par: Parallel
    split: Split | None = None

    @property
    def chunk(self) -> int:
        return jax.tree.leaves(self.chunks)[0].shape[1]

    def embed_mb(self, top, mb):
        """Micro-batch mb prepared and embedded (stage 0 runs it in the tick of its F, and
        again in the pull-back at its B: nothing of either is kept between)."""
        images = self.prepare_images(self.u8[mb], self.labels[mb], self.ids[mb])
        keys = None if self.keys is None else self.keys[mb]
        return embed(top, images, self.sc.cfg, self.sc.policy, keys, self.sc.execution)

    def layers(self, v):
        return [jax.tree.map(lambda a, i=i: a[v, i], self.chunks) for i in range(self.chunk)]

    def fn(self, cp, top, x, v, mb):
        """Chunk v on this stage over micro-batch mb: (output, loss (0 but on the last
        virtual stage), accuracy)."""
        sc = self.sc
        y = encoder(cp, x, sc.cfg, sc.policy, None if self.keys is None else self.keys[mb],
                    execution=sc.execution, par=Parallel(tp_axis=self.par.tp_axis),
                    layer_offset=(v * self.stages + self.stage) * self.chunk)
        m = train_metrics(sc, head(top, y, sc.cfg, sc.policy), self.labels[mb], self.targets[mb])
        last = (self.stage == self.stages - 1) & (v == self.virtual - 1)
        return y, jnp.where(last, m["loss"], 0.0), jnp.where(last, m["accuracy"], 0.0)

    def pulled(self, v, mb, x):
        """F: (outputs, pull-back, the weight matmuls' operands kept for W (zb-h1))."""
        if self.split is not None:
            return self.split.forward((self.layers(v), self.top), x, v, mb)
        return *jax.vjp(lambda cp, t, x: self.fn(cp, t, x, v, mb), self.layers(v),
                        self.top, x), []


def make_stage(sc: StepConfig, schedule, top, chunks, images_u8, labels, targets, example_ids,
               drop_key, prepare_images, par: Parallel):
    """(the `Stage` of this device, a zero index of the table's type, an embedded
    micro-batch): the last two only for traces (mb and v vary over the pipe axis, as the
    table's entries do; XLA drops what the traces compute)."""
    M, pipe_axis = schedule.microbatches, par.pipe_axis
    ex_keys = dropout_keys(sc.cfg, True, drop_key, example_ids, labels.shape[0])
    # The raw images are held through the ticks, each micro-batch prepared where it is
    # embedded (`prepare_images`: its rows of the whole slice's augmentation).
    stage = Stage(sc, schedule.stages, schedule.virtual, lax.axis_index(pipe_axis),
                  micro(lax.pcast(images_u8, pipe_axis, to="varying"), M),
                  micro(example_ids, M), micro(labels, M), micro(targets, M),
                  None if ex_keys is None else micro(ex_keys, M), prepare_images, top, chunks,
                  par)
    zero = lax.pcast(jnp.zeros((), jnp.int32), pipe_axis, to="varying")
    x0 = stage.embed_mb(top, zero)
    if schedule.split_backward:  # zb-h1: B split into I and W (pipeline/split.py)
        split = Split(lambda p, x, v, mb: stage.fn(*p, x, v, mb), (stage.layers(zero), top),
                      x0, zero, zero)
        stage = dataclasses.replace(stage, split=split)
    return stage, zero, x0


# ----------------------------------------------------------- phase 4: the residual ring
@dataclasses.dataclass(frozen=True, eq=False)
class ResidualLayout:
    """Which of a chunk's pull-back residuals the ring keeps, and how to rebuild the
    pull-back at B from them. A residual that depends on neither the chunk's input nor the
    micro-batch (a weight, its reshape or cast) is `fixed`: not kept, traced again at B.
    A PRNG key residual (a rematerialised block's dropout keys) is kept as its raw bits:
    a ring of keys would not keep the varying type that the branches need."""
    fixed: tuple          # per pull-back leaf: True = traced again at B, not kept
    same: tuple           # per pull-back leaf: an earlier kept leaf holding its elements
                          # (it is that leaf reshaped: not kept), or None
    tree: object          # the pull-back's tree structure
    impls: tuple          # per kept pull-back leaf: its PRNG key implementation, or None
    entries: tuple        # one traced value per ring entry: its shape and type
    outputs: tuple        # the traced F's outputs: (y, loss, accuracy)
    x: jax.Array          # the traced F's input (its shape and type)

    @property
    def kept(self) -> tuple:
        """Per pull-back leaf: True where the ring keeps it."""
        return tuple(not f and s is None for f, s in zip(self.fixed, self.same))

    @property
    def n_pull(self) -> int:
        """The ring's first n_pull entries are the pull-back's; the rest W's operands."""
        return self.kept.count(True)

    def pack(self, pull, acts) -> list:
        """What the ring keeps of one F: its kept residuals (keys as bits), acts."""
        leaves = jax.tree.leaves(pull)
        return [_bits(a) for a, k in zip(leaves, self.kept) if k] + list(acts)

    def unpack(self, again, stored):
        """The pull-back of the F whose ring entries are `stored`, from `again`, the
        pull-back of the same chunk traced again at B (on any input: its fixed leaves)."""
        it = iter(a if k is None else jax.random.wrap_key_data(a, impl=k)
                  for a, k in zip(stored[:self.n_pull], self.impls))
        leaves = list(jax.tree.leaves(again))
        for i, (fixed, same) in enumerate(zip(self.fixed, self.same)):
            if not fixed:  # an earlier leaf's elements, or the ring's next entry
                leaves[i] = next(it) if same is None else leaves[same].reshape(leaves[i].shape)
        return jax.tree.unflatten(self.tree, leaves)

    def rings(self, slots: int, axis: str) -> list:
        """The ring: `slots` zero copies of each entry, varying over `axis`."""
        return [zeros_ring(a, slots, axis) for a in self.entries]


def residual_layout(pulled, zero, x0) -> ResidualLayout:
    """The layout of `pulled(v, mb, x) -> (outputs, pull-back, acts)`'s residuals, from
    traces at v = mb = `zero` and x = `x0`."""
    def residuals(mb, x):
        return jax.tree.leaves(pulled(zero, mb, x)[1])

    fixed = input_free(residuals, zero, x0)
    # A leaf that is another kept leaf reshaped (the same value under two shapes, as an
    # attention's output and the next matmul's operand) is made from it at B.
    same = [None if f or s is None or fixed[s] else s
            for f, s in zip(fixed, same_data(residuals, zero, x0))]
    out, pull, acts = pulled(zero, zero, x0)
    leaves, tree = jax.tree.flatten(pull)
    layout = ResidualLayout(tuple(fixed), tuple(same), tree, (), (), tuple(out), x0)
    impls = tuple(jax.random.key_impl(a) if _is_key(a) else None
                  for a, k in zip(leaves, layout.kept) if k)
    return dataclasses.replace(layout, impls=impls, entries=tuple(layout.pack(pull, acts)))


# ------------------------------------------------------------------ phase 5: the tick
def _unless(pred, fn, *xs):
    """lax.cond: fn(*xs) where pred holds, zeros of its type elsewhere."""
    return lax.cond(pred, fn, lambda *a: jax.tree.map(jnp.zeros_like, fn(*a)), *xs)


def _add_grads(acc, v, g_cp, g_top):
    """acc (chunks', top's float32 sums) plus chunk v's gradients; a None gradient (zb-h1's
    I or W leaves some) adds nothing."""
    g_chunks, g_tops = acc
    for i, g_layer in enumerate(g_cp):
        g_chunks = jax.tree.map(lambda g, a, i=i: a if g is None else a.at[v, i].add(
            g.astype(a.dtype)), g_layer, g_chunks, is_leaf=lambda g: g is None)
    return g_chunks, jax.tree.map(lambda g, a: a if g is None else a + g.astype(a.dtype),
                                  g_top, g_tops, is_leaf=lambda g: g is None)


def run_f(stage: Stage, layout: ResidualLayout, f_mb, f_v, recv_f, rings, write, sums):
    """F of micro-batch f_mb through chunk f_v (idle where f_mb < 0): (the output to send,
    the ring with its residuals written at slot `write`, the loss and accuracy sums).
    Stage 0 embeds its first chunk's input; every other F reads the received activation.
    The branch returns the residual set (an idle tick: what slot `write` holds) and the
    tick writes it into the ring, in place (the scan's carry). The branch only reads the
    ring: XLA gives a conditional's results buffers of their own, so a ring written inside
    the branch was a second ring (copied into the branch's result and back each tick: the
    deviceless H100 program held both)."""
    y0, loss0, _ = layout.outputs

    def do_f(x, rings):
        (y, loss, acc), pull, acts = stage.pulled(f_v, f_mb, x)
        return y, [vary_like(a, r) for a, r in zip(layout.pack(pull, acts), rings)], loss, acc

    def no_f(x, rings):
        zero = jnp.zeros_like(loss0)
        return jnp.zeros_like(y0), [r[write] for r in rings], zero, zero

    x = lax.cond((stage.stage == 0) & (f_v == 0) & (f_mb >= 0),
                 lambda r: vary_like(stage.embed_mb(stage.top, f_mb), r), lambda r: r, recv_f)
    y, res, loss, acc = lax.cond(f_mb >= 0, do_f, no_f, x, rings)
    rings = [r.at[write].set(a) for a, r in zip(res, rings)]
    return y, rings, (sums[0] + loss, sums[1] + acc)


def run_b(stage: Stage, layout: ResidualLayout, b_mb, b_v, slot, kept, recv_b, rings, cots,
          grads, seed):
    """B (zb-h1: I) of micro-batch b_mb through chunk b_v (idle where b_mb < 0): the
    pull-back of the received cotangent (the loss's seed / M on the last virtual stage)
    through the ring's residuals at `slot` (zb-h1: its output cotangents kept at slot
    `kept` of theirs). Returns (the input cotangent to send, the cotangents'
    ring with zb-h1's weight-matmul output cotangents written, the gradient sums). The
    branch reads its slot of the ring, writes zb-h1's cotangents into theirs and adds its
    gradients to the float32 sums itself: no copy of a residual set goes in or comes out,
    nor a tick's gradients."""
    _, loss0, _ = layout.outputs
    P, V, M = stage.stages, stage.virtual, stage.u8.shape[0]

    def cotangent(dy):
        last = (stage.stage == P - 1) & (b_v == V - 1)
        return (jnp.where(last, jnp.zeros_like(dy), dy),
                jnp.zeros_like(loss0) + jnp.where(last, seed / M, 0.0), jnp.zeros_like(loss0))

    def do_b(rings, dy, grads, cots):
        res = [r[slot] for r in rings]
        again = stage.pulled(b_v, b_mb, jnp.zeros_like(layout.x))[1]  # XLA keeps the fixed
        pulled = layout.unpack(again, res)(cotangent(dy))
        if stage.split is None:
            g_cp, g_top, dx, dys = *pulled, []
        else:  # zb-h1's I: the weights' gradients are None (W's)
            (g_cp, g_top), dx, dys = stage.split.input_grads(pulled)
        return dx, [c.at[kept].set(d) for c, d in zip(cots, dys)], \
            _add_grads(grads, jnp.maximum(b_v, 0), stage.sc.policy.cast_to_compute(g_cp), g_top)

    def no_b(rings, dy, grads, cots):  # do_b's types (XLA drops its work), the rest kept
        return jnp.zeros_like(do_b(rings, dy, grads, cots)[0]), cots, grads

    dx, cots, grads = lax.cond(b_mb >= 0, do_b, no_b, rings, recv_b, grads, cots)

    def do_embed(dx):  # stage 0's input cotangent through the embedding (run again)
        _, pull = jax.vjp(lambda t: stage.embed_mb(t, b_mb), stage.top)
        return pull(vary_like(dx, layout.x))[0]

    g_top = _unless((stage.stage == 0) & (b_v == 0) & (b_mb >= 0), do_embed, dx)
    grads = grads[0], jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads[1], g_top)
    return dx, cots, grads


def run_w(stage: Stage, layout: ResidualLayout, w_mb, w_v, slot, kept, rings, cots, grads):
    """zb-h1's W of micro-batch w_mb through chunk w_v (idle where w_mb < 0): each weight
    matmul's weight gradient from its activation operand (kept at F in the residual ring's
    `slot`) and its output cotangent (kept at I in slot `kept`); no cotangent chain again. Returns the sums (the
    branch reads both slots and adds to the sums itself, as run_b)."""
    def do_w(rings, cots, grads):
        res = [r[slot] for r in rings]
        dys = [c[kept] for c in cots]
        g = stage.split.weight_grads((stage.layers(w_v), stage.top), res[layout.n_pull:], dys,
                                     w_v, w_mb)
        return _add_grads(grads, jnp.maximum(w_v, 0), stage.sc.policy.cast_to_compute(g[0]),
                          g[1])

    return lax.cond(w_mb >= 0, do_w, lambda rings, cots, grads: grads, rings, cots, grads)


def exchange(sends, y, dx, recv_f, recv_b, arrive, pipe_axis: str):
    """The tick's point-to-point sends (`Segment.sends`, one tick's): collective-permutes
    over the pipe axis of the F's output to the next stage ("f"), of the input cotangent
    to the previous one ("b"), or, where stage pairs swap ("fb"), of the one this stage
    sends (arrive[2]: its F's output). What arrives (arrive[0], arrive[1]: this stage's
    flags) replaces a receive buffer; a buffer is kept until then, read by a later tick."""
    for what, pairs in sends:
        out = y if what == "f" else dx if what == "b" else jnp.where(arrive[2], y, dx)
        new = lax.ppermute(out, pipe_axis, perm=list(pairs))
        if "f" in what:
            recv_f = jnp.where(arrive[0], new, recv_f)
        if "b" in what:
            recv_b = jnp.where(arrive[1], new, recv_b)
    return recv_f, recv_b


# ---------------------------------------------------------- phase 6: scan and finish
def schedule_grads(sc: StepConfig, params, images_u8, labels, targets, example_ids, drop_key,
                   seed, prepare_images, *, schedule, par: Parallel):
    """One pipelined forward and backward pass run from `schedule`'s table (1f1b,
    interleaved, zb-h1): the gradients of `seed` x the mean loss (seed: the loss scale),
    laid out like params, and this stage's {"loss", "accuracy"} sums (last stage only).
    The phases are this module's (its docstring); each tick runs F, B (zb-h1: I), W and
    the sends, each a `lax.cond` on the stage's column of the table."""
    P, M, V = schedule.stages, schedule.microbatches, schedule.virtual
    pipe_axis = par.pipe_axis
    per = jax.tree.leaves(params["blocks"])[0].shape[0]  # layers this stage holds
    if per * P != sc.cfg.depth or per % V:
        raise ValueError(f"pipeline: {per} layers per stage do not split into {V} chunks")
    plan = static_plan(schedule)
    top, chunks, pull_params = prepare_params(params, sc.policy, par, V)
    stage, zero, x0 = make_stage(sc, schedule, top, chunks, images_u8, labels, targets,
                                 example_ids, drop_key, prepare_images, par)
    layout = residual_layout(stage.pulled, zero, x0)
    y0, loss0, _ = layout.outputs

    def tick(carry, xs, phases: str, sends: tuple):
        """One tick: its F, B (zb-h1: I) and W where the segment has them, its sends."""
        row, slots, arrive = xs
        recv_f, recv_b, rings, cots, grads, sums = carry
        f_mb, f_v, b_mb, b_v, w_mb, w_v = (r[stage.stage] for r in row)
        f_slot, b_slot, w_slot, i_kept, w_kept = (r[stage.stage] for r in slots)
        y, dx = jnp.zeros_like(y0), jnp.zeros_like(x0)
        if "F" in phases:
            y, rings, sums = run_f(stage, layout, f_mb, f_v, recv_f, rings, f_slot, sums)
        if "B" in phases:
            dx, cots, grads = run_b(stage, layout, b_mb, b_v, b_slot, i_kept, recv_b, rings,
                                    cots, grads, seed)
        if "W" in phases and stage.split is not None:
            grads = run_w(stage, layout, w_mb, w_v, w_slot, w_kept, rings, cots, grads)
        recv_f, recv_b = exchange(sends, y, dx, recv_f, recv_b, arrive[:, stage.stage],
                                  pipe_axis)
        return recv_f, recv_b, rings, cots, grads, sums

    # The gradients add up in float32 over the micro-batches, cast once at the end.
    zeros = jax.tree.map(lambda a: jnp.zeros_like(a, jnp.float32), (chunks, top))
    # zb-h1: the output cotangents dy_l from I until W (an idle tick writes none).
    cots0 = [] if stage.split is None else [zeros_ring(t, plan.kept) for t in stage.split.taps()]
    carry = (jnp.zeros_like(y0), jnp.zeros_like(x0), layout.rings(plan.ring, pipe_axis),
             cots0, zeros, (jnp.zeros_like(loss0), jnp.zeros_like(loss0)))
    return finish(scan_segments(tick, carry, plan), top, chunks, pull_params, M)


def scan_segments(tick, carry, plan: StaticPlan):
    """`lax.scan` over each segment's ticks, `period` ticks a step, in order: tick(carry,
    one tick's (row, slots, arrive), the segment's phases, that tick's sends) -> carry."""
    for g in plan.segments:
        n = (g.stop - g.start) // g.period
        xs = tuple(jnp.asarray(a[g.start:g.stop].reshape(n, g.period, *a.shape[1:]))
                   for a in (plan.rows, plan.slots, plan.arrive))

        def body(carry, xs, g=g):
            for k in range(g.period):
                carry = tick(carry, jax.tree.map(lambda a, k=k: a[k], xs), g.phases,
                             g.sends[k])
            return carry, None

        carry, _ = lax.scan(body, carry, xs)
    return carry


def finish(carry, top, chunks, pull_params, microbatches: int):
    """The scan's sums cast to the parameters' dtypes and pulled back through their
    preparation: (grads laid out like params, {"loss", "accuracy"} means)."""
    _, _, _, _, (g_chunks, g_top), (loss, acc) = carry
    g_top = jax.tree.map(lambda g, t: g.astype(t.dtype), g_top, top)
    g_chunks = jax.tree.map(lambda g, c: g.astype(c.dtype), g_chunks, chunks)
    (grads,) = pull_params((g_top, g_chunks))
    return grads, {"loss": loss / microbatches, "accuracy": acc / microbatches}


# ------------------------------------------------------------------- evaluation
def eval_logits(sc: StepConfig, params, images, *, par: Parallel, microbatches: int,
                virtual: int = 1):
    """Logits (b, classes) of prepared images (b, h, w, C), valid on the last stage: the
    forward ticks of `schedules.forward_only` (V = 1: GPipe's, stage s runs micro-batch
    t - s at tick t; V > 1: round the stages V times, through the chunks each stage
    stores) as one `lax.scan`, so the compiled program does not grow with K. Each stage
    runs the blocks it stores: no gather over 'pipe'; idle ticks compute on what they hold
    and are masked, as GPipe's."""
    pipe_axis = par.pipe_axis
    P, K, V = lax.axis_size(pipe_axis), microbatches, virtual
    table = schedules.forward_only(P, K, V)
    schedules.check_sends(table)
    arrive = np.stack([schedules.arrivals(table)[0]] * 3, axis=1)  # [2] unused: "f"
    sends = (("f", tuple((s, (s + 1) % P) for s in range(P if V > 1 else P - 1))),)
    top, chunks, _ = prepare_params(params, sc.policy, par, V)
    stage = lax.axis_index(pipe_axis)
    chunk = jax.tree.leaves(chunks)[0].shape[1]
    x_mb = micro(lax.pcast(images, pipe_axis, to="varying"), K)

    def tick(carry, xs):
        recv, logits = carry
        row, v, arrive = xs
        mb, v = jnp.maximum(row[stage], 0), v[stage] if V > 1 else 0
        x = lax.cond((stage == 0) & (v == 0), lambda r: vary_like(
            embed(top, x_mb[mb], sc.cfg, sc.policy, None, sc.execution), r), lambda r: r, recv)
        y = encoder(jax.tree.map(lambda a: a[v], chunks), x, sc.cfg, sc.policy,
                    execution=sc.execution, par=Parallel(tp_axis=par.tp_axis),
                    layer_offset=(v * P + stage) * chunk)
        keep = (stage == P - 1) & (v == V - 1) & (row[stage] >= 0)
        logits = logits.at[mb].set(jnp.where(keep, head(top, y, sc.cfg, sc.policy), logits[mb]))
        recv, _ = exchange(sends, y, y, recv, recv, arrive[:, stage], pipe_axis)
        return (recv, logits), None

    x0 = embed(top, x_mb[0], sc.cfg, sc.policy, None, sc.execution)
    out0 = head(top, x0, sc.cfg, sc.policy)  # its type only (XLA drops it)
    logits0 = vary_like(jnp.zeros((K, *out0.shape), out0.dtype), out0)
    (_, logits), _ = lax.scan(tick, (jnp.zeros_like(x0), logits0),
                              (jnp.asarray(table.fwd), jnp.asarray(table.fwd_chunk),
                               jnp.asarray(arrive)))
    return logits.reshape(images.shape[0], -1)
