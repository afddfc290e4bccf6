"""The pipeline schedules' tables are sound, and the tick program that runs them
(`--pipeline-schedule`; GPipe's in tests/test_pipeline.py) equals the single-device
reference.

The tables (vit_pure/pipeline/schedules.py) are checked as data: every micro-batch runs
forward and backward once through every virtual stage, in dependency order, each send
consumed the tick after it is made; 1F1B holds fewer residual sets than GPipe; the
modelled lockstep time of 1F1B equals GPipe's and zb-h1 and interleaved beat it. The
program is checked through the training script's own strategy (tiny model, fake CPU
devices) against `jax.grad` of the mean loss on one device, within the tolerances of
tests/test_layout_matrix.py: one zb-h1 cell in the default tier, the rest `slow`.
"""
import dataclasses
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import grads_step
from test_layout_matrix import tolerances

import train_shardmap
from benchmarks import pipeline_schedules as bench
from vit_pure import PRESETS, Policy, step
from vit_pure.config import Execution
from vit_pure.errors import UsageError
from vit_pure.pipeline import ring, schedules, tick
from vit_pure.pipeline.schedules import IDLE
from vit_pure.run import cli

CFG = PRESETS["tiny"]
BATCH = 16
CASES = [(P, M, name, V) for P in (2, 4, 8) for M in (P, 2 * P, 4 * P)
         for name, V in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2))]


# ------------------------------------------------------------------------- the tables
@pytest.mark.parametrize("P,M,name,V", CASES)
def test_every_micro_batch_runs_once_in_dependency_order(P, M, name, V):
    s = schedules.build(name, P, M, V)
    f_at, b_at, w_at = {}, {}, {}
    for t in range(s.ticks):
        for st in range(P):
            for arr, chunk, at in ((s.fwd, s.fwd_chunk, f_at), (s.bwd, s.bwd_chunk, b_at),
                                   (s.wgt, s.wgt_chunk, w_at)):
                if arr[t, st] != IDLE:
                    key = (int(arr[t, st]), int(chunk[t, st]) * P + st)
                    assert key not in at, f"{name}: {key} twice"
                    at[key] = t
    every = {(i, j) for i in range(M) for j in range(P * V)}
    assert set(f_at) == set(b_at) == every
    assert set(w_at) == (every if name == "zb-h1" else set())
    for (i, j), t in f_at.items():
        assert j == 0 or f_at[(i, j - 1)] < t          # input computed before
        assert b_at[(i, j)] >= t                        # backward after its forward
        if j < P * V - 1:
            assert b_at[(i, j)] > b_at[(i, j + 1)]      # cotangent computed before
        if name == "zb-h1":
            assert w_at[(i, j)] >= b_at[(i, j)]
    if name != "gpipe":
        schedules.check_sends(s)  # each send read before the next one overwrites it


@pytest.mark.parametrize("P", [2, 4, 8])
def test_memory_and_time_from_the_tables(P):
    M = 8 * P
    gpipe, one_f = schedules.build("gpipe", P, M), schedules.build("1f1b", P, M)
    zb, inter = schedules.build("zb-h1", P, M), schedules.build("interleaved", P, M, 2)
    assert list(schedules.in_flight(gpipe)) == [M] * P
    # 1F1B: stage s holds P - s (PipeDream-Flush's promise), one F or B a tick, so
    # 2(M + P - 1) ticks; zb-h1, built on 1F1B's table, holds no more than 1F1B (P).
    assert list(schedules.in_flight(one_f)) == [P - s for s in range(P)]
    assert one_f.ticks == 2 * (M + P - 1)
    assert schedules.in_flight(zb).max() == P
    # GPipe's bubble is the textbook (P-1)/(M+P-1), whatever F and B cost.
    for t_f, t_b in ((1.0, 2.0), (1.0, 3.0)):
        assert schedules.bubble(gpipe, t_f, t_b) == pytest.approx((P - 1) / (M + P - 1))
    base = schedules.lockstep_time(gpipe, 1.0, 2.0)
    # In lockstep a tick where some stage runs B lasts B: at most 2 t_B / (t_F + t_B) of
    # GPipe's time, its price for P - s; with F as long as B, exactly GPipe's.
    assert base < schedules.lockstep_time(one_f, 1.0, 2.0) <= base * 4 / 3
    assert schedules.lockstep_time(one_f, 1.0, 1.0) == pytest.approx(
        schedules.lockstep_time(gpipe, 1.0, 1.0))
    assert schedules.lockstep_time(zb, 1.0, 2.0, 1.0) < base
    assert schedules.lockstep_time(inter, 1.0, 2.0) < base
    assert schedules.ring_size(one_f) == P


@pytest.mark.parametrize("P", [2, 3, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 8])
@pytest.mark.parametrize("t_b", [2.0, 3.0])
def test_1f1b_equals_gpipe_with_pairwise_sends(P, mult, t_b):
    """docs/parallelism.md: with pairwise sends 1F1B's step equals GPipe's (its swaps let
    neighbours run out of phase); in lockstep it costs more, up to 2 t_B / (t_F + t_B)."""
    gpipe, one_f = schedules.build("gpipe", P, mult * P), schedules.build("1f1b", P, mult * P)
    assert schedules.pairwise_time(one_f, 1.0, t_b) == schedules.pairwise_time(gpipe, 1.0, t_b)
    lockstep = schedules.lockstep_time(one_f, 1.0, t_b) / schedules.lockstep_time(gpipe, 1.0, t_b)
    assert 1.0 < lockstep <= 2 * t_b / (1.0 + t_b)


@pytest.mark.parametrize("name,P,M,V", [("1f1b", 4, 32, 1), ("1f1b", 4, 4, 1),
                                         ("zb-h1", 4, 32, 1), ("zb-h1", 2, 4, 1),
                                         ("interleaved", 4, 32, 3), ("interleaved", 2, 4, 2),
                                         ("gpipe", 4, 8, 1)])
def test_the_ring_keeps_each_residual_set_until_read(name, P, M, V):
    """The program's ring as the table drives it: every F writes its slot (an idle tick
    writes back what the slot holds); every B and W must then find its own micro-batch's
    residuals at the slot the plan names, in a ring of exactly as many slots as the most
    sets a stage holds (interleaved once needed 23 slots for 15 sets: a modulo rule)."""
    s = schedules.build(name, P, M, V)
    plan = tick.static_plan(s)
    assert plan.ring == schedules.in_flight(s).max()
    for st in range(P):
        held = {}
        for t in range(s.ticks):
            f = s.fwd[t, st]
            if f != IDLE:
                held[int(plan.slots[t, 0, st])] = (f, s.fwd_chunk[t, st])
            for mb, ch, k in ((s.bwd[t, st], s.bwd_chunk[t, st], 1),
                              (s.wgt[t, st], s.wgt_chunk[t, st], 2)):
                if mb != IDLE:
                    assert held.get(int(plan.slots[t, k, st])) == (mb, ch), (name, st, t)


@pytest.mark.parametrize("P,M", [(4, 32), (4, 4), (2, 4), (8, 16)])
def test_zb_h1_keeps_each_output_cotangent_until_w(P, M):
    """The program's ring of the weight matmuls' output cotangents: I writes micro-batch i's
    into the slot the plan names, W reads it later; no I may overwrite one that a W still
    has to read, and the ring is as large as the most cotangent sets waiting at once."""
    s = schedules.build("zb-h1", P, M)
    plan = tick.static_plan(s)
    assert plan.kept <= plan.ring
    waiting = np.cumsum((s.bwd != IDLE).astype(int) - (s.wgt != IDLE), axis=0)
    assert plan.kept == int((waiting + (s.wgt != IDLE)).max())
    for st in range(P):
        slots = {}
        for t in range(s.ticks):
            i, w = s.bwd[t, st], s.wgt[t, st]
            if i != IDLE:
                slots[int(plan.slots[t, 3, st])] = i
            if w != IDLE:
                assert slots.get(int(plan.slots[t, 4, st])) == w, (P, M, st, t)


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_zb_h1_is_1f1b_with_its_weight_gradients_in_the_bubbles(P):
    """zb-h1 runs 1F1B's F and B ticks (B as I) and puts the W's where their stage idles:
    at K = P its bubble is below 1F1B's at the same memory, and it runs as 1F1B's one scan
    of swaps (plus a scan of its last W's, which send nothing): compile flat in K."""
    for M in (P, 4 * P):
        zb, one_f = schedules.build("zb-h1", P, M), schedules.build("1f1b", P, M)
        T = one_f.ticks
        np.testing.assert_array_equal(zb.fwd[:T], one_f.fwd)
        np.testing.assert_array_equal(zb.bwd[:T], one_f.bwd)
        assert (zb.fwd[T:] == IDLE).all() and (zb.bwd[T:] == IDLE).all()
        assert schedules.bubble(zb) < schedules.bubble(one_f)
        assert schedules.in_flight(zb).max() == schedules.in_flight(one_f).max()
        assert [g.period for g in schedules.segments(zb)] in ([2], [2, 1])


def test_picture_reads_the_table():
    pic = schedules.picture(schedules.build("1f1b", 2, 3))
    assert pic.splitlines() == ["    stage 0: F0 .  F1 B0 F2 B1 .  B2",
                                "    stage 1: .  F0 B0 F1 B1 F2 B2 ."]


# ------------------------------------------------------ the program's phases, alone
@pytest.mark.parametrize("name,P,M,V", [("1f1b", 4, 4, 1), ("1f1b", 4, 16, 1),
                                         ("1f1b", 3, 24, 1), ("zb-h1", 2, 4, 1),
                                         ("zb-h1", 4, 32, 1), ("interleaved", 2, 4, 2),
                                         ("interleaved", 4, 32, 2), ("gpipe", 2, 1, 1),
                                         ("gpipe", 2, 8, 1), ("gpipe", 4, 32, 1)])
def test_static_plan(name, P, M, V):
    """The numbers the program reads off the table: a ring as large as the stages' most
    residual sets, the writes inside it, zb-h1's cotangent ring, the scans and sends."""
    s = schedules.build(name, P, M, V)
    plan = tick.static_plan(s)
    assert plan.rows.shape == (s.ticks, 6, P)
    assert plan.ring == schedules.in_flight(s).max()
    assert plan.slots.shape == (s.ticks, 5, P) and 0 <= plan.slots.min()
    assert plan.slots[:, :3].max() < plan.ring and plan.slots[:, 3:].max() < plan.kept
    assert name == "zb-h1" or plan.kept == 1
    # The scans cover the ticks in order; every send a segment makes is a pair of
    # neighbours, round the ring with virtual stages (the last stage feeds stage 0).
    assert [g.start for g in plan.segments] == [0] + [g.stop for g in plan.segments[:-1]]
    assert plan.segments[-1].stop == s.ticks
    neighbours = {(a, (a + 1) % P) for a in range(P if V > 1 else P - 1)}
    for g in plan.segments:
        assert (g.stop - g.start) % g.period == 0 and len(g.sends) == g.period
        for sends in g.sends:
            for what, pairs in sends:
                assert {(a, b) if what == "f" else (b, a) for a, b in pairs} <= neighbours \
                    or what == "fb"
    # Only useful sends: at K = 4P at most 1.2 times the sends that carry data
    # (1F1B: one swap a tick; the others: each way only while something goes that way);
    # GPipe's exactly: K + P - 2 each way. At most four scans at any K: the compiled
    # program does not grow with the micro-batches.
    if M >= 4 * P:
        assert plan.sends() <= 1.2 * schedules.messages(s)
    if name == "gpipe":
        assert plan.sends() == 2 * (M + P - 2)
    assert len(plan.segments) <= 4


def test_1f1b_swaps_once_a_tick():
    """1F1B's stage pairs only swap: one scan of two ticks a step, each with one send of
    whichever each stage made (pairs (0,1), (2,3) at even ticks, (1,2) at odd ones)."""
    plan = tick.static_plan(schedules.build("1f1b", 4, 32))
    (g,) = plan.segments
    assert (g.period, g.phases) == (2, "FB")
    assert g.sends == ((("fb", ((0, 1), (1, 0), (2, 3), (3, 2))),),
                       (("fb", ((1, 2), (2, 1))),))
    assert plan.sends() == 70  # 2 (K + P - 1) ticks, against 2K = 64 that carry data


def test_residual_layout_keeps_what_depends_on_the_input():
    """The ring's layout alone: a weight's reshape is traced again at B, not kept; the
    activation and a PRNG key (as its raw bits) are kept; unpacking what F kept, into the
    pull-back traced again on another input, gives F's own pull-back."""
    w = jnp.arange(6.0).reshape(3, 2)

    def pulled(v, mb, x):
        key = jax.random.fold_in(jax.random.key(7), mb)

        def f(x):
            h = jnp.tanh(x @ w.T)  # (2, 3): w.T a residual made from no input
            noisy = jax.checkpoint(lambda h, k: h * jax.random.uniform(k, h.shape))
            return noisy(h, key).sum()
        out, pull = jax.vjp(f, x)
        return (out, out, out), pull, [x * 2]

    zero, x0 = jnp.int32(0), jnp.ones((2, 2))
    layout = ring.residual_layout(pulled, zero, x0)
    assert True in layout.fixed and False in layout.fixed
    assert any(i is not None for i in layout.impls)  # the key, kept as bits
    assert all(not jnp.issubdtype(e.dtype, jax.dtypes.prng_key) for e in layout.entries)
    assert len(layout.entries) == layout.n_pull + 1  # + the one kept operand
    x = jnp.array([[0.5, -1.0], [2.0, 0.25]])
    _, pull, acts = pulled(zero, jnp.int32(3), x)
    stored = layout.pack(pull, acts)
    np.testing.assert_array_equal(stored[-1], x * 2)
    again = pulled(zero, zero, jnp.zeros_like(x))[1]
    np.testing.assert_allclose(layout.unpack(again, stored)(1.0)[0], pull(1.0)[0], rtol=1e-6)
    assert not np.allclose(again(1.0)[0], pull(1.0)[0])  # the trace again alone differs


def test_residual_layout_keeps_one_copy_of_a_reshaped_residual():
    """A residual that holds another's elements under another shape (an attention's
    output and the next matmul's operand) is kept once: `same_data` finds it, the ring
    holds the first, and the pull-back rebuilt from the ring equals F's own."""
    @jax.custom_vjp
    def square(x):
        return (x * x).sum()

    def square_fwd(x):
        return square(x), (x, x.reshape(-1), jnp.cos(x))

    def square_bwd(res, ct):
        x, flat, c = res
        return (ct * (x + flat.reshape(x.shape)) * c / c,)

    square.defvjp(square_fwd, square_bwd)

    def pulled(v, mb, x):
        out, pull = jax.vjp(square, x * (mb + 1.0))
        return (out, out, out), pull, []

    zero, x0 = jnp.int32(0), jnp.ones((2, 3))
    same = ring.same_data(lambda mb, x: jax.tree.leaves(pulled(zero, mb, x)[1]), zero, x0)
    assert same == [None, 0, None]  # x; x reshaped; cos(x), another value
    layout = ring.residual_layout(pulled, zero, x0)
    assert [e.shape for e in layout.entries] == [(2, 3), (2, 3)]  # x and cos(x) alone
    x = jnp.array([[0.5, -1.0, 2.0], [0.25, 3.0, -0.5]])
    _, pull, _ = pulled(zero, jnp.int32(2), x)
    stored = layout.pack(pull, [])
    again = pulled(zero, zero, jnp.zeros_like(x))[1]
    np.testing.assert_allclose(layout.unpack(again, stored)(1.0)[0], pull(1.0)[0], rtol=1e-6)
    assert not np.allclose(again(1.0)[0], pull(1.0)[0])  # the trace again alone differs


def test_the_docs_draw_what_the_program_runs():
    """docs/parallelism.md's schedule pictures ("NAME, S = P, K = M[, V = V]:" then one
    line a stage) are the start-up log's (`describe`) of the tables the program runs."""
    text = (pathlib.Path(__file__).parents[1] / "docs" / "parallelism.md").read_text()
    found = re.findall(r"^(\S+), S = (\d+), K = (\d+)(?:, V = (\d+))?:\n((?:    stage .*\n)+)",
                       text, re.M)
    assert {f[0] for f in found} == {"1f1b", "zb-h1", "interleaved"}
    for name, P, M, V, drawn in found:
        P, V = int(P), int(V or 1)
        log = schedules.describe(P * V * 2, P, int(M), name, V).splitlines()
        assert drawn.splitlines() == log[-P:], name


def _memory_table():
    """docs/parallelism.md's pipeline memory table: (its commands, its rows as (K, label))."""
    text = (pathlib.Path(__file__).parents[1] / "docs" / "parallelism.md").read_text()
    section = text[text.index("### The schedules' memory"):]
    block = section[section.index("```\n") + 4:]
    block = block[:block.index("```")].replace("\\\n", " ")
    commands = [line.split() for line in block.splitlines() if line.strip()]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\w[\w-]*(?: V=\d)?) \|", section, re.M)
    return commands, [(int(p), int(k), label) for p, k, label in rows]


def test_the_docs_memory_table_commands_still_run():
    """Each row of the docs' memory table comes from its command, and the command still
    parses, down to the training script's flags of every row (the cheap form of running
    it: the rows themselves are minutes of compiling each)."""
    commands, rows = _memory_table()
    assert commands and rows
    made = set()
    for argv in commands:
        assert argv[:3] == ["python", "-m", "benchmarks.pipeline_schedules"], argv
        args = bench.build_parser().parse_args(argv[3:])
        if args.from_json:
            for pattern in args.from_json:
                assert list(pathlib.Path(__file__).parents[1].glob(pattern)), pattern
            continue
        for P in args.stages:
            for mult in args.mult:
                for name in args.schedules:
                    V = args.virtual if name == "interleaved" else 1
                    job = {"model": args.model, "batch": args.batch, "dtype": args.dtype,
                           "image_size": args.image_size, "remat": args.remat,
                           "hardware": args.hardware, "stages": P,
                           "microbatches": mult * P, "schedule": name, "virtual": V}
                    cli.parse_args(train_shardmap.build_parser(), bench.row_argv(job))
                    schedules.build(name, P, mult * P, V)
                    made.add((P, mult * P, name + (f" V={V}" if V > 1 else "")))
    assert set(rows) <= made


@pytest.mark.parametrize("name,P,M,V,message", [
    ("zb", 2, 2, 1, "expected one of gpipe, 1f1b, interleaved, zb-h1"),
    ("1f1b", 2, 2, 2, "--virtual-stages 2 needs --pipeline-schedule interleaved"),
    ("interleaved", 4, 6, 2, "--microbatches 6 must be a multiple of the 4 stages"),
])
def test_bad_schedules_are_one_line_errors(name, P, M, V, message):
    with pytest.raises(ValueError, match=message):
        schedules.build(name, P, M, V)


# ------------------------------------------------------------------------ the program
def _batch(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
            rng.integers(0, CFG.num_classes, (n,), dtype=np.int32),
            np.arange(n, dtype=np.int32))


OPT = optax.adamw(1e-3, weight_decay=0.05, mask=step.decay_mask)


def _run(sc, mesh=None, k=None, schedule="gpipe", v=1, fsdp=False, steps=0, n=BATCH):
    """(grads, metrics) of one step and the losses of `steps` training steps, through
    the script's strategy (on as many devices as the mesh has), with batches of n; the
    single-device reference when mesh is None."""
    host = jax.device_get(step.init_state(jax.random.key(0), sc.cfg, sc.policy, OPT))
    key = step.step_key(0, 0, 0)
    images, labels, ids = _batch(0, n)
    if mesh is None:
        grads, metrics = jax.jit(lambda p: step.local_grads(
            sc, p, host["loss_scale"], images, labels, ids, key))(host["params"])
        strategy = train_shardmap.ShardMapStrategy(sc, OPT, "data=1", devices=jax.devices()[:1])
    else:
        size = int(np.prod([int(a.split("=")[1]) for a in mesh.split(",")]))
        strategy = train_shardmap.ShardMapStrategy(sc, OPT, mesh, fsdp=fsdp, microbatches=k,
                                                   schedule=schedule, virtual_stages=v,
                                                   devices=jax.devices()[:size])
        state = strategy.put_state(host)
        inputs = (*strategy.put_batch(images, labels, ids), strategy.put_replicated(key))
        grads, metrics = grads_step(strategy)(state, *inputs)
        grads = strategy.host_state({"params": grads})["params"]  # the layers in order
    losses = []
    state = strategy.put_state(host)
    for i in range(steps):
        state, m = strategy.train_step(state, *strategy.put_batch(*_batch(i, n)),
                                       strategy.put_replicated(step.step_key(0, 0, i)))
        losses.append(float(m["loss"]))
    return jax.device_get(grads), jax.device_get(metrics), losses


@functools.cache  # cells of one recipe share its reference (the remat cells, THREE at n=20)
def _reference(sc, steps, n):
    return _run(sc, steps=steps, n=n)


def _sc(policy, accum):
    return step.StepConfig(CFG, Policy.parse(policy), grad_clip=0.0, accum_steps=accum)


def _check(policy, accum, mesh, k, schedule, v=1, fsdp=False, steps=0, sc=None, n=BATCH):
    sc = sc or _sc(policy, accum)  # (given: a recipe of its own, with its own reference)
    assert sc.policy == Policy.parse(policy)
    if sc.policy.needs_loss_scaling:
        # fp16: the scaled per-device loss overflows or not depending on the per-device
        # batch, so the reference is GPipe on the same mesh (tests/test_pipeline.py ties
        # GPipe to the single-device step), as tests/test_layout_matrix.py compares fp16
        # layouts with data parallelism over the same devices.
        ref_grads, ref_metrics, ref_losses = _run(sc, mesh, k, "gpipe", steps=steps, n=n)
    else:
        ref_grads, ref_metrics, ref_losses = _reference(sc, steps, n)
    grads, metrics, losses = _run(sc, mesh, k, schedule, v, fsdp, steps, n)
    tol_metrics, tol_params = tolerances(Policy.parse(policy))
    assert float(metrics["loss"]) == pytest.approx(float(ref_metrics["loss"]), rel=tol_metrics)
    assert float(metrics["accuracy"]) == pytest.approx(float(ref_metrics["accuracy"]))
    flat = [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]
    ref = [np.asarray(r, np.float32) for r in jax.tree.leaves(ref_grads)]
    # fp16's first scale (2^15) may overflow: the same leaves must, so that the loss
    # scale's non-finite check skips the same steps (the losses below show it did).
    finite = [bool(np.isfinite(r).all()) for r in ref]
    assert [bool(np.isfinite(g).all()) for g in flat] == finite
    pairs = [(g, r) for g, r, f in zip(flat, ref, finite) if f]
    assert pairs or policy != "fp32"
    norm = np.sqrt(sum(np.sum(np.square(r)) for _, r in pairs))
    dist = np.sqrt(sum(np.sum(np.square(g - r)) for g, r in pairs))
    assert dist <= tol_params * norm, f"gradient distance {dist / norm:.2e} of the norm"
    # Every piece has a gradient: embedding (stage 0), every layer, head (last stage).
    for g in (grads["patch_embed"]["kernel"], grads["head"]["kernel"],
              *grads["blocks"]["mlp"]["fc1"]["kernel"]):
        assert np.abs(np.asarray(g, np.float32)).max() > 0
    assert losses == pytest.approx(ref_losses, rel=tol_metrics)


WIDER = pytest.mark.exhaustive  # a schedule already run on a harder layout in CI
SLOW = [  # (policy, accum, mesh, K, schedule, V, fsdp, training steps)
    ("fp32", 1, "data=2,pipe=4", 4, "1f1b", 1, False, 3),
    ("bf16", 2, "data=2,model=2,pipe=2", 2, "1f1b", 1, True, 0),
    # The default tier runs K=4.
    pytest.param("fp32", 1, "data=2,pipe=4", 8, "zb-h1", 1, False, 0, marks=WIDER),
    ("bf16", 1, "data=2,model=2,pipe=2", 4, "zb-h1", 1, True, 0),
    ("fp32", 2, "data=2,model=2,pipe=2", 2, "interleaved", 2, False, 0),
    pytest.param("bf16", 1, "data=4,pipe=2", 4, "interleaved", 2, True, 0, marks=WIDER),
    ("p=f32,c=f16,o=f32", 1, "data=4,pipe=2", 4, "zb-h1", 1, False, 2),  # loss scaling
]


@pytest.mark.slow
@pytest.mark.parametrize("policy,accum,mesh,k,schedule,v,fsdp,steps", SLOW)
def test_schedules_equal_the_reference(policy, accum, mesh, k, schedule, v, fsdp, steps):
    _check(policy, accum, mesh, k, schedule, v, fsdp, steps)


def test_zb_h1_equals_the_reference():
    """The default tier's one program check (~5 s here): zb-h1, whose table has every
    kind of entry (F, I, W, idle), on 4 stages."""
    _check("fp32", 1, "data=2,pipe=4", 4, "zb-h1")


DEEP = dataclasses.replace(_sc("fp32", 1), cfg=CFG.replace(depth=6))  # splits into 3 stages
# One block a stage on 3 stages, for the cells about the schedule on an odd number of
# stages: the stage's body is the same code for one block or several (the cells on 2
# stages run 2 blocks a stage), and each block more costs seconds of compile time.
THREE = dataclasses.replace(_sc("fp32", 1), cfg=CFG.replace(depth=3))


@pytest.mark.slow
def test_three_stages_and_five_micro_batches_equal_the_reference():
    """1F1B on an odd number of stages (pairs (0,1) swap at even ticks, (1,2) at odd ones,
    stage 2 alone at even ticks) and a K that is no multiple of them."""
    _check("fp32", 1, "data=2,pipe=3", 5, "1f1b", sc=THREE, n=20)


# 1F1B on three stages (above) runs in CI; these two are the wider sweep.
@pytest.mark.exhaustive
@pytest.mark.parametrize("mesh,k,schedule,v,sc,n", [
    # virtual stages round three devices (2 chunks of 3 stages: DEEP's 6 blocks)
    ("data=2,pipe=3", 3, "interleaved", 2, DEEP, 12),
    ("data=2,pipe=3", 5, "zb-h1", 1, THREE, 20),
], ids=["data=2,pipe=3-3-interleaved-2-12", "data=2,pipe=3-5-zb-h1-1-20"])
def test_three_stages_slow_cells(mesh, k, schedule, v, sc, n):
    _check("fp32", 1, mesh, k, schedule, v, sc=sc, n=n)


@pytest.mark.slow
def test_zb_h1_with_tensor_parallelism_without_fsdp():
    _check("fp32", 1, "data=2,model=2,pipe=2", 4, "zb-h1")


def _mixing(policy="fp32", cfg=CFG):
    return dataclasses.replace(_sc(policy, 1), cfg=cfg, mixup_alpha=0.8, cutmix_alpha=1.0)


@pytest.mark.slow
def test_mixed_micro_batches_equal_the_reference():
    """mixup / cutmix: the table-driven program prepares each micro-batch where stage 0
    embeds it; its rows must be the whole slice's preparation (pairs 2k, 2k+1 and the
    step's draws), so the step equals the reference that mixes the slice at once."""
    # Two blocks, one a stage: the batch is prepared before the first block, so the blocks
    # behind it prove nothing more here (depth 4 compiled this program in twice the time).
    _check("fp32", 1, "data=4,pipe=2", 2, "1f1b", sc=_mixing(cfg=CFG.replace(depth=2)))


def test_mixing_needs_even_micro_batches():
    with pytest.raises(UsageError, match="needs an even size, not 1"):
        _run(_mixing(), "data=4,pipe=2", 4, "1f1b")


@pytest.mark.slow
# zb-h1 keeps the residuals longest (until W); 1f1b is the wider sweep.
@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=pytest.mark.exhaustive),
                                      "zb-h1"])
def test_rematerialised_blocks_equal_the_reference(schedule):
    """--remat block: the block's residuals are its input and its dropout keys (a PRNG key
    array, which the ring keeps as raw bits), so the step equals the reference's."""
    sc = dataclasses.replace(_sc("fp32", 1), execution=Execution(remat="block"))
    _check("fp32", 1, "data=4,pipe=2", 2, schedule, sc=sc)


_local_eval = jax.jit(step.local_eval, static_argnums=0)  # one compile per StepConfig


@pytest.mark.parametrize("mesh,k,sc,schedule,v", [
    ("data=2,model=2,pipe=2", 6, _sc("fp32", 1), "1f1b", 1),
    ("data=2,pipe=3", 5, DEEP, "1f1b", 1),
    ("data=2,model=2,pipe=2", 6, _sc("fp32", 1), "interleaved", 2),
    ("data=2,pipe=3", 3, DEEP, "interleaved", 2),  # gcd(10, 3) = 1 micro-batch
])
def test_evaluation_equals_the_unpipelined_one(mesh, k, sc, schedule, v):
    """Evaluation runs the forward ticks as one scan (GPipe's; interleaved: round the
    stages V times through the chunks each stores): the sums equal `local_eval`'s,
    padding masked (8 per device and K = 6 asked for: gcd(8, 6) = 2 micro-batches)."""
    n = 20 if "pipe=3" in mesh else BATCH
    host = jax.device_get(step.init_state(jax.random.key(0), sc.cfg, sc.policy, OPT))
    images, labels, _ = _batch(0, n)
    mask = np.ones(n, np.float32)
    mask[-3:] = 0
    want = jax.device_get(_local_eval(sc, host["params"], images, labels, mask))
    size = int(np.prod([int(a.split("=")[1]) for a in mesh.split(",")]))
    strategy = train_shardmap.ShardMapStrategy(sc, OPT, mesh, microbatches=k,
                                               schedule=schedule, virtual_stages=v,
                                               devices=jax.devices()[:size])
    got = strategy.eval_step(strategy.put_state(host),
                             *strategy.put_batch(images, labels, mask))
    assert float(got["count"]) == n - 3
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    assert float(got["correct"]) == float(want["correct"])


@pytest.mark.parametrize("what", ["train", "eval"])
def test_gpipe_compiles_the_same_program_at_any_k(what):
    """GPipe runs from its table through the ticks' scans, as every schedule does: the
    lowered training and evaluation steps have as many matmuls at K = 8 as at K = 2 (the
    program no longer grows with K, as an unrolled loop of ticks did)."""
    def dots(k):
        strategy = train_shardmap.ShardMapStrategy(_sc("fp32", 1), OPT, "data=1,pipe=2",
                                                   microbatches=k, devices=jax.devices()[:2])
        state = strategy.put_state(
            jax.device_get(step.init_state(jax.random.key(0), CFG, Policy(), OPT)))
        images, labels, ids = _batch(0)
        if what == "eval":
            args = (state, *strategy.put_batch(images, labels, np.ones(BATCH, np.float32)))
            return strategy.eval_step.lower(*args).as_text().count("dot_general")
        args = (state, *strategy.put_batch(images, labels, ids),
                strategy.put_replicated(step.step_key(0, 0, 0)))
        return strategy.train_step.lower(*args).as_text().count("dot_general")
    assert dots(8) == dots(2) > 0


def _fc1_kernels(state):
    """fc1's kernel in the params and each of its copies in the optimizer state (Adam's
    mu, nu)."""
    return [x for path, x in jax.tree_util.tree_leaves_with_path(state)
            if "'fc1'" in jax.tree_util.keystr(path) and "kernel" in jax.tree_util.keystr(path)]


def test_interleaved_stores_its_own_chunks_and_gathers_no_block():
    """Interleaved keeps 1/S of the blocks per device, as GPipe: the state is placed in
    `block_order` (stage 0 of 2 with 2 chunks holds layers 0 and 2 of the tiny model's 4,
    their Adam moments beside them), `host_state` gives the layers back in order, and the
    lowered training step all-gathers nothing (it once gathered every block over 'pipe')."""
    strategy = train_shardmap.ShardMapStrategy(_sc("fp32", 1), OPT, "data=1,pipe=2",
                                               microbatches=2, schedule="interleaved",
                                               virtual_stages=2, devices=jax.devices()[:2])
    assert list(strategy.block_order) == [0, 2, 1, 3]
    host = jax.device_get(step.init_state(jax.random.key(0), CFG, Policy(), OPT))
    # Moments that tell the layers apart (Adam's start at zero).
    host["opt_state"] = jax.tree.map(lambda a: a + np.arange(a.size, dtype=a.dtype).reshape(
        a.shape) if a.ndim and a.dtype.kind == "f" else a, host["opt_state"])
    state = strategy.put_state(host)
    placed, want = _fc1_kernels(state), _fc1_kernels(host)
    assert len(placed) == 3  # the kernel, mu, nu
    for x, w in zip(placed, want):
        shards = {sh.device: np.asarray(sh.data) for sh in x.addressable_shards}
        assert [a.shape[0] for a in shards.values()] == [2, 2]  # 1/S of the 4 layers
        np.testing.assert_array_equal(shards[jax.devices()[0]], np.asarray(w)[[0, 2]])
        np.testing.assert_array_equal(shards[jax.devices()[1]], np.asarray(w)[[1, 3]])
    back = strategy.host_state(state)
    for k in ("params", "opt_state"):
        jax.tree.map(np.testing.assert_array_equal, back[k], host[k])
    images, labels, ids = _batch(0)
    text = strategy.train_step.lower(state, *strategy.put_batch(images, labels, ids),
                                     strategy.put_replicated(step.step_key(0, 0, 0))).as_text()
    assert "all_gather" not in text and "reduce_scatter" not in text
    assert "collective_permute" in text
