"""One tick of a table-driven pipeline, and the scans that run the table's ticks.

Each tick a stage reads its column of the table and runs, each in a `lax.cond`, its F
(forward of a micro-batch through a chunk of its layers), its B (the backward; zb-h1: I,
the input gradient) and zb-h1's W (the weight gradient), then `exchange`: the only
function with the schedules' sends, collective-permutes over the pipe axis. Training and
evaluation run the same tick; evaluation's table has F's alone and keeps no residuals.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex

from vit_pure.config import Execution
from vit_pure.model import Parallel, embed, encoder
from vit_pure.pipeline import schedules
from vit_pure.pipeline.ring import ResidualLayout, vary_like, zeros_ring
from vit_pure.pipeline.split import Split


def row(a, i):
    """a[i] along the first axis, i a traced index: one dynamic slice. (jnp's indexing
    traces a jit of several ops per use, and a tick reads hundreds of ring slots.) Unlike
    jnp, a negative i is clamped to row 0, not counted from the end: idle ticks carry
    micro-batch and chunk -1, and read row 0 in branches whose results they drop."""
    return lax.dynamic_index_in_dim(a, i, keepdims=False)


def micro(x, k: int):
    """(b, ...) -> (k, b/k, ...): micro-batch i is rows i*b/k ... (i+1)*b/k - 1."""
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])


# ---------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True, eq=False)
class StaticPlan:
    """What the program reads off the table before tracing anything (numpy, no jax)."""
    rows: np.ndarray      # (ticks, 6, P): F, F's chunk, B, B's chunk, W, W's chunk
    slots: np.ndarray     # (ticks, 5, P): the residual ring's slot F writes, B reads, W
                          # reads; the cotangent ring's slot I writes, W reads (idle: 0)
    ring: int             # the residual ring's slots: the most sets a stage holds
    kept: int             # zb-h1: slots of the output cotangents held from I to W
    arrive: np.ndarray    # (ticks, 3, P) bool: an activation arrives, a cotangent
                          # arrives, the stage sends its F's output (not its B's)
    segments: tuple       # the scans, in order (`schedules.Segment`)

    def sends(self) -> int:
        """Collective-permutes per step: what the compiled program runs."""
        return schedules.sends(self.segments)


def static_plan(s: schedules.Schedule) -> StaticPlan:
    """The rings' sizes and slots, the arrivals and the scans of table `s`."""
    schedules.check_sends(s)
    gets_y, gets_dx = schedules.arrivals(s)  # stage s + 1's activation comes from stage s
    res, cot = schedules.residual_slots(s), schedules.cotangent_slots(s)
    kept = [cot.at(s.bwd, s.bwd_chunk), cot.at(s.wgt, s.wgt_chunk)] if s.split_backward \
        else [np.zeros_like(s.fwd)] * 2  # no cotangent is kept: the ring's one slot
    slots = np.stack([res.at(s.fwd, s.fwd_chunk), res.at(s.bwd, s.bwd_chunk),
                      res.at(s.wgt, s.wgt_chunk), *kept], axis=1)
    return StaticPlan(rows=s.rows(), slots=slots.astype(np.int32), ring=res.size,
                      kept=cot.size,
                      arrive=np.stack([gets_y, gets_dx, np.roll(gets_y, -1, axis=1)], axis=1),
                      segments=schedules.segments(s))


# --------------------------------------------------------------------------- the stage
@dataclasses.dataclass(frozen=True, eq=False)
class Stage:
    """One stage's micro-batches and chunk function (closed over by the tick's branches).
    u8 / ids / labels: the slice cut into M micro-batches; keys: their dropout keys (None
    without dropout); prepare_images(u8, labels, ids) -> images, a micro-batch's rows of
    the slice's preparation; top / chunks: the parameters in the compute dtype, the blocks
    as (V, L/(PV), ...) chunks; output(top, y, mb, last) -> F's sums: what an F adds to
    the tick's sums (the loss and accuracy; evaluation: the logits at row mb), zeros but
    where `last` (the model's last virtual stage)."""
    cfg: object
    policy: object
    execution: Execution
    stages: int
    virtual: int
    stage: jax.Array
    u8: jax.Array
    ids: jax.Array
    labels: jax.Array
    keys: jax.Array | None
    prepare_images: Callable
    output: Callable
    top: dict
    chunks: dict
    par: Parallel

    @property
    def chunk(self) -> int:
        return jax.tree.leaves(self.chunks)[0].shape[1]

    def embed_mb(self, top, mb):
        """Micro-batch mb prepared and embedded (stage 0 runs it in the tick of its F, and
        again in the pull-back at its B: nothing of either is kept between)."""
        images = self.prepare_images(row(self.u8, mb), row(self.labels, mb), row(self.ids, mb))
        keys = None if self.keys is None else row(self.keys, mb)
        return embed(top, images, self.cfg, self.policy, keys, self.execution)

    def layers(self, v):
        return [jax.tree.map(lambda a, i=i: row(row(a, v), i), self.chunks)
                for i in range(self.chunk)]

    def fn(self, layers, top, x, v, mb):
        """Chunk v on this stage over micro-batch mb: (output, F's sums)."""
        y = encoder(layers, x, self.cfg, self.policy,
                    None if self.keys is None else row(self.keys, mb), execution=self.execution,
                    par=Parallel(tp_axis=self.par.tp_axis),
                    layer_offset=(v * self.stages + self.stage) * self.chunk)
        last = (self.stage == self.stages - 1) & (v == self.virtual - 1)
        return y, self.output(top, y, mb, last)


# ------------------------------------------------------------- the two kinds of B
class WholeBackward:
    """B in one piece (gpipe, 1f1b, interleaved): F keeps the chunk's pull-back, B runs it
    and gets every gradient; W does nothing."""

    def __init__(self, stage: Stage):
        self.stage = stage

    def forward(self, v, mb, x):
        """F: (outputs, pull-back, the operands kept for W: none)."""
        st = self.stage
        return *jax.vjp(lambda ls, t, x: st.fn(ls, t, x, v, mb), st.layers(v), st.top, x), []

    def grads(self, pulled):
        """B's results from the pull-back's: (layers', top's gradients, dx, W's cotangents:
        none)."""
        g_layers, g_top, dx = pulled
        return g_layers, g_top, dx, []

    def taps(self) -> list:
        """The output cotangents B keeps for W, one zero each: none."""
        return []


class SplitBackward(WholeBackward):
    """zb-h1's B as I and W (pipeline/split.py): F also keeps each weight matmul's
    activation operand, I returns the weights' gradients as None and each weight matmul's
    output cotangent, W makes the weights' gradients from the two."""

    def __init__(self, stage: Stage, zero, x0):
        super().__init__(stage)
        self.split = Split(lambda p, x, v, mb: stage.fn(*p, x, v, mb),
                           (stage.layers(zero), stage.top), x0, zero, zero)

    def forward(self, v, mb, x):
        return self.split.forward((self.stage.layers(v), self.stage.top), x, v, mb)

    def grads(self, pulled):
        (g_layers, g_top), dx, out_cots = self.split.input_grads(pulled)
        return g_layers, g_top, dx, out_cots

    def weight_grads(self, v, mb, acts, out_cots):
        """W: (layers', top's gradients), None but for the weights."""
        return self.split.weight_grads((self.stage.layers(v), self.stage.top), acts, out_cots,
                                       v, mb)

    def taps(self) -> list:
        return self.split.taps()


# ----------------------------------------------------------------------------- the tick
class Carry(NamedTuple):
    """What the scans carry from tick to tick."""
    recv_f: jax.Array     # the last activation received from the previous stage
    recv_b: jax.Array     # the last input cotangent received from the next stage
    rings: list           # the residual ring, one array per entry of the layout
    out_cots: list        # zb-h1: the ring of weight matmuls' output cotangents, I to W
    grads: tuple          # (chunks', top's) float32 gradient sums
    sums: object          # F's sums (`Stage.output`)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """What every tick reads: the stage, its B, the ring's layout (None: evaluation, no
    backward), the loss's cotangent `seed` / M, and zeros of the sent values' types."""
    stage: Stage
    backward: WholeBackward | None
    layout: ResidualLayout | None
    seed: jax.Array | None
    y0: jax.Array
    x0: jax.Array


def _cond_once(pred, fn, idle, *xs):
    """lax.cond: fn(*xs) where pred holds, else idle(zeros of fn's output types, *xs); fn
    traced once. (A branch of zeros_like(fn(...)) would trace the chunk's forward and
    backward a second time, for their types alone.) The taken branch binds fn's traced
    equations again."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*xs)
    tree, run = jax.tree.structure(shapes), jex.jaxpr_as_fun(closed)

    def taken(*a):
        return jax.tree.unflatten(tree, run(*jax.tree.leaves(a)))

    def not_taken(*a):
        zeros = [vary_like(jnp.zeros(t.shape, t.dtype), t.manual_axis_type.varying)
                 for t in closed.out_avals]
        return idle(jax.tree.unflatten(tree, zeros), *a)

    return lax.cond(pred, taken, not_taken, *xs)


def _unless(pred, fn, *xs):
    """lax.cond: fn(*xs) where pred holds, zeros of its type elsewhere."""
    return _cond_once(pred, fn, lambda zeros, *_: zeros, *xs)


def _add_grads(acc, v, g_layers, g_top):
    """acc (chunks', top's float32 sums) plus chunk v's gradients; a None gradient (zb-h1's
    I or W leaves some) adds nothing."""
    g_chunks, g_tops = acc
    for i, g_layer in enumerate(g_layers):
        g_chunks = jax.tree.map(lambda g, a, i=i: a if g is None else a.at[v, i].add(
            g.astype(a.dtype)), g_layer, g_chunks, is_leaf=lambda g: g is None)
    return g_chunks, jax.tree.map(lambda g, a: a if g is None else a + g.astype(a.dtype),
                                  g_top, g_tops, is_leaf=lambda g: g is None)


def run_f(pr: Program, mb, v, slot, recv_f, rings, sums):
    """F of micro-batch mb through chunk v (idle where mb < 0): (the output to send, the
    ring with its residuals written at `slot`, the sums plus F's). Stage 0 embeds its
    first chunk's input; every other F reads the received activation. The branch returns
    the residual set (an idle tick: what `slot` holds) and the tick writes it into the
    ring in place: XLA gives a conditional's results buffers of their own, so a ring
    written inside the branch would be a second ring."""
    st = pr.stage
    x = lax.cond((st.stage == 0) & (v == 0) & (mb >= 0),
                 lambda r: vary_like(st.embed_mb(st.top, mb), r), lambda r: r, recv_f)
    if pr.layout is None:  # evaluation: nothing kept for a backward
        y, out = _unless(mb >= 0, lambda x: st.fn(st.layers(v), st.top, x, v, mb), x)
        return y, rings, jax.tree.map(jnp.add, sums, out)

    def do_f(x, rings):
        (y, out), pull, acts = pr.backward.forward(v, mb, x)
        return y, [vary_like(a, r) for a, r in zip(pr.layout.pack(pull, acts), rings)], out

    def no_f(x, rings):
        return jnp.zeros_like(pr.y0), [row(r, slot) for r in rings], \
            jax.tree.map(jnp.zeros_like, sums)

    y, res, out = lax.cond(mb >= 0, do_f, no_f, x, rings)
    rings = [r.at[slot].set(a) for a, r in zip(res, rings)]
    return y, rings, jax.tree.map(jnp.add, sums, out)


def run_b(pr: Program, mb, v, slot, kept, recv_b, rings, out_cots, grads):
    """B (zb-h1: I) of micro-batch mb through chunk v (idle where mb < 0): the pull-back
    of the received cotangent (the loss's seed / M on the last virtual stage) through the
    ring's residuals at `slot`. Returns (the input cotangent to send, the output
    cotangents' ring with zb-h1's written at `kept`, the gradient sums). The branch reads
    its slot and adds its gradients to the float32 sums itself: no copy of a residual set
    goes in or comes out, nor a tick's gradients."""
    st = pr.stage

    def cotangent(dy):
        last = (st.stage == st.stages - 1) & (v == st.virtual - 1)
        loss = jnp.zeros_like(pr.layout.outputs[1][0])
        return (jnp.where(last, jnp.zeros_like(dy), dy),
                (loss + jnp.where(last, pr.seed, 0.0), jnp.zeros_like(loss)))

    def do_b(rings, dy, grads, out_cots):
        res = [row(r, slot) for r in rings]
        again = pr.backward.forward(v, mb, jnp.zeros_like(pr.layout.x))[1]  # its fixed
        g_layers, g_top, dx, new = pr.backward.grads(pr.layout.unpack(again, res)(
            cotangent(dy)))
        return dx, [c.at[kept].set(d) for c, d in zip(out_cots, new)], _add_grads(
            grads, jnp.maximum(v, 0), st.policy.cast_to_compute(g_layers), g_top)

    def no_b(zeros, rings, dy, grads, out_cots):  # a zero dx, the rest kept
        return zeros[0], out_cots, grads

    dx, out_cots, grads = _cond_once(mb >= 0, do_b, no_b, rings, recv_b, grads, out_cots)

    def do_embed(dx):  # stage 0's input cotangent through the embedding (run again)
        _, pull = jax.vjp(lambda t: st.embed_mb(t, mb), st.top)
        return pull(vary_like(dx, pr.layout.x))[0]

    g_top = _unless((st.stage == 0) & (v == 0) & (mb >= 0), do_embed, dx)
    grads = grads[0], jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads[1], g_top)
    return dx, out_cots, grads


def run_w(pr: Program, mb, v, slot, kept, rings, out_cots, grads):
    """zb-h1's W of micro-batch mb through chunk v (idle where mb < 0): each weight
    matmul's weight gradient from its activation operand (kept at F in the residual ring's
    `slot`) and its output cotangent (kept at I in slot `kept`); no cotangent chain
    again. Returns the gradient sums (the branch adds to them itself, as run_b's)."""
    def do_w(rings, out_cots, grads):
        acts = [row(r, slot) for r in rings][pr.layout.n_pull:]
        g_layers, g_top = pr.backward.weight_grads(v, mb, acts, [row(c, kept) for c in out_cots])
        return _add_grads(grads, jnp.maximum(v, 0),
                          pr.stage.policy.cast_to_compute(g_layers), g_top)

    return lax.cond(mb >= 0, do_w, lambda rings, out_cots, grads: grads, rings, out_cots,
                    grads)


def exchange(sends, y, dx, recv_f, recv_b, gets_y, gets_dx, sends_y, pipe_axis: str):
    """The tick's point-to-point sends (`Segment.sends`, one tick's): collective-permutes
    over the pipe axis of the F's output to the next stage ("f"), of the input cotangent
    to the previous one ("b"), or, where stage pairs swap ("fb"), of the one this stage
    sends (its F's output where `sends_y`). What arrives replaces a receive buffer where
    this stage's flag says so (`gets_y`, `gets_dx`); a buffer is kept until then, read by
    a later tick."""
    for what, pairs in sends:
        out = y if what == "f" else dx if what == "b" else jnp.where(sends_y, y, dx)
        new = lax.ppermute(out, pipe_axis, perm=list(pairs))
        if "f" in what:
            recv_f = jnp.where(gets_y, new, recv_f)
        if "b" in what:
            recv_b = jnp.where(gets_dx, new, recv_b)
    return recv_f, recv_b


def tick(pr: Program, carry: Carry, xs, phases: str, sends: tuple) -> Carry:
    """One tick: its F, B (zb-h1: I) and W where the segment has them, then its sends.
    xs: this tick's (table row, slots, arrivals), each (k, P): this stage reads column
    `stage`."""
    row, slots, arrive = (a[:, pr.stage.stage] for a in xs)
    f_mb, f_v, b_mb, b_v, w_mb, w_v = row
    f_slot, b_slot, w_slot, i_kept, w_kept = slots
    recv_f, recv_b, rings, out_cots, grads, sums = carry
    y, dx = jnp.zeros_like(pr.y0), jnp.zeros_like(pr.x0)
    if "F" in phases:
        y, rings, sums = run_f(pr, f_mb, f_v, f_slot, recv_f, rings, sums)
    if "B" in phases:
        dx, out_cots, grads = run_b(pr, b_mb, b_v, b_slot, i_kept, recv_b, rings, out_cots,
                                    grads)
    if "W" in phases:
        grads = run_w(pr, w_mb, w_v, w_slot, w_kept, rings, out_cots, grads)
    recv_f, recv_b = exchange(sends, y, dx, recv_f, recv_b, *arrive, pr.stage.par.pipe_axis)
    return Carry(recv_f, recv_b, rings, out_cots, grads, sums)


def run_ticks(pr: Program, plan: StaticPlan, sums0, grads0=None) -> Carry:
    """Every tick of the plan, each segment one `lax.scan` of `period` ticks a step, from
    empty receive buffers and rings, F's sums from `sums0`, the gradient sums from
    `grads0` (None: evaluation)."""
    axis = pr.stage.par.pipe_axis
    rings, out_cots = [], []
    if pr.layout is not None:
        rings = pr.layout.rings(plan.ring, axis)
        out_cots = [zeros_ring(t, plan.kept) for t in pr.backward.taps()]
    carry = Carry(jnp.zeros_like(pr.y0), jnp.zeros_like(pr.x0), rings, out_cots, grads0,
                  sums0)
    for g in plan.segments:
        n = (g.stop - g.start) // g.period
        xs = tuple(jnp.asarray(a[g.start:g.stop].reshape(n, g.period, *a.shape[1:]))
                   for a in (plan.rows, plan.slots, plan.arrive))

        def body(carry, xs, g=g):
            for k in range(g.period):
                carry = tick(pr, carry, jax.tree.map(lambda a, k=k: a[k], xs), g.phases,
                             g.sends[k])
            return carry, None

        carry, _ = lax.scan(body, carry, xs)
    return carry
