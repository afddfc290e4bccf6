"""Pipeline parallelism (vit_pure/pipeline.py) equals the single-device reference.

The tiny model (depth 4) on 8 fake CPU devices, dropout and stochastic depth on, the
on-device augmentation on, float32. A small shard_map harness below plays the training
script's part for the 'data' axis (pcast before the gradient, pmean after), exactly as
train_shardmap.py does; everything about the 'pipe' axis is vit_pure.pipeline's.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from vit_pure import PRESETS, Policy, pipeline, step
from vit_pure.model import init_params, param_axes

CFG = PRESETS["tiny"]
BATCH = 16
DATA, MODEL, PIPE = "data", "model", "pipe"


def _sc(**kw):
    kw.setdefault("grad_clip", 0.0)
    return step.StepConfig(CFG, Policy(), **kw)


def _batch(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, CFG.num_classes, (n,), dtype=np.int32)
    return images, labels, np.arange(n, dtype=np.int32)


def _state(sc, optimizer):
    return jax.device_get(step.init_state(jax.random.key(0), CFG, sc.policy, optimizer))


# ------------------------------------------------------------------------------ harness
def _mesh(data, model, pipe):
    return jax.make_mesh((data, model, pipe), (DATA, MODEL, PIPE),
                         axis_types=(AxisType.Auto,) * 3,
                         devices=jax.devices()[:data * model * pipe])


def _param_specs(mesh):
    """Layers over 'pipe', heads and MLP units over 'model', everything else replicated."""
    rules = {"layers": PIPE, "heads": MODEL, "mlp": MODEL}
    def spec(names):
        return P(*(rules[n] if n in rules and mesh.shape[rules[n]] > 1 else None
                   for n in names))
    return jax.tree.map(spec, param_axes(CFG), is_leaf=lambda x: isinstance(x, tuple))


def _axes(spec):
    return tuple(a for a in spec if a is not None)


def _is_spec(x):
    return isinstance(x, P)


class Harness:
    """A data x model x pipe training step around pipeline.pipeline_grads."""

    def __init__(self, sc, optimizer, data, model, pipe, microbatches):
        self.mesh = _mesh(data, model, pipe)
        self.specs = specs = _param_specs(self.mesh)
        tp = MODEL if model > 1 else None
        opt_specs = optax.tree_map_params(
            optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, jax.eval_shape(
                lambda: init_params(jax.random.key(0), CFG))), specs,
            transform_non_params=lambda _: P(), is_leaf=_is_spec)
        self.state_specs = {"params": specs, "opt_state": opt_specs, "loss_scale": P(),
                            "step": P()}

        def grads_fn(state, images, labels, ids, key):
            # As train_shardmap.py: varying over 'data' before the gradient, pmean after.
            params = jax.tree.map(lambda x: lax.pcast(x, DATA, to="varying"), state["params"])
            grads, metrics = pipeline.pipeline_grads(
                sc, params, state["loss_scale"], images, labels, ids, key, pipe_axis=PIPE,
                microbatches=microbatches, tp_axis=tp)
            grads = lax.pmean(grads, DATA)
            sq = jnp.zeros((), jnp.float32)
            for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=_is_spec)):
                part = jnp.sum(jnp.square(g))
                sq = sq + (lax.psum(part, _axes(s)) if _axes(s) else part)
            return grads, {**lax.pmean(metrics, DATA), "grad_norm": jnp.sqrt(sq)}

        def train_step(state, images, labels, ids, key):
            grads, metrics = grads_fn(state, images, labels, ids, key)
            state, _ = step.apply_gradients(sc, state, grads, metrics["grad_norm"], optimizer)
            return state, metrics

        batch = P(DATA)
        ins = (self.state_specs, batch, batch, batch, P())
        self.grads_step = jax.jit(jax.shard_map(grads_fn, mesh=self.mesh, in_specs=ins,
                                                out_specs=(specs, P())))
        self.train_step = jax.jit(jax.shard_map(train_step, mesh=self.mesh, in_specs=ins,
                                                out_specs=(self.state_specs, P())))

    def put(self, state, *batch):
        shard = lambda s: NamedSharding(self.mesh, s)  # noqa: E731
        state = jax.device_put(state, jax.tree.map(shard, self.state_specs, is_leaf=_is_spec))
        return (state, *(jax.device_put(a, shard(P(DATA))) for a in batch))


# --------------------------------------------------------------------------- reference
def _reference(sc, host, seed=0):
    images, labels, ids = _batch(seed)
    grads, metrics = jax.jit(lambda p: step.local_grads(
        sc, p, host["loss_scale"], images, labels, ids, step.step_key(0, 0, seed)))(
            host["params"])
    return jax.device_get(grads), jax.device_get(metrics)


@pytest.fixture(scope="module")
def reference():
    sc = _sc()
    return _reference(sc, _state(sc, optax.sgd(1.0)))


def _max_rel_diff(a, b):
    norm = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(b)))
    return max(float(np.max(np.abs(x - y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))) / norm


def _collectives(text):
    return {op: len(re.findall(rf"\b{op}\(", text)) for op in
            ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")}


LAYOUTS = [  # (data, model, pipe, micro-batches)
    (4, 1, 2, 1), (4, 1, 2, 2), (4, 1, 2, 4),
    (2, 1, 4, 4),
    (2, 2, 2, 2),
]


@pytest.mark.parametrize("data,model,pipe,k", LAYOUTS)
def test_loss_and_grads_equal_single_device_reference(data, model, pipe, k, reference):
    ref_grads, ref_metrics = reference
    sc = _sc()
    h = Harness(sc, optax.sgd(1.0), data, model, pipe, k)
    state, *batch = h.put(_state(sc, optax.sgd(1.0)), *_batch(0))
    compiled = h.grads_step.lower(state, *batch, step.step_key(0, 0, 0)).compile()
    grads, metrics = compiled(state, *batch, step.step_key(0, 0, 0))
    grads = jax.device_get(grads)
    # The collective inventory of the compiled step: the schedule's collective-permutes
    # (one per tick but the last, and as many transposed ones in the backward pass), and
    # no all-gather of stage params: each stage only ever touches its own layers. The
    # all-reduces are the pmean over 'data', the psums over 'pipe' (and TP's over 'model').
    counts = _collectives(compiled.as_text())
    assert counts["collective-permute"] == 2 * (k + pipe - 2)
    assert counts["all-gather"] == counts["reduce-scatter"] == counts["all-to-all"] == 0
    assert counts["all-reduce"] >= 1
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["accuracy"]), float(ref_metrics["accuracy"]))
    assert _max_rel_diff(grads, ref_grads) <= 1e-5
    # Every piece really has a gradient: the embedding (stage 0 only), every layer of every
    # stage, and the head (last stage only), so a dropped psum or a masked stage shows.
    for g in (grads["patch_embed"]["kernel"], grads["pos_embed"], grads["head"]["kernel"],
              *grads["blocks"]["mlp"]["fc1"]["kernel"]):
        assert np.abs(g).max() > 1e-5


def test_dropout_really_follows_the_global_layer_index(reference):
    """A pipeline that restarts the layer count on each stage (layer_offset = 0) draws
    other dropout masks, and the comparison above notices: the test can fail."""
    ref_grads, _ = reference
    sc = _sc()
    h = Harness(sc, optax.sgd(1.0), 4, 1, 2, 1)
    real_encoder = pipeline.encoder
    try:
        pipeline.encoder = lambda *a, layer_offset, **kw: real_encoder(*a, layer_offset=0, **kw)
        state, *batch = h.put(_state(sc, optax.sgd(1.0)), *_batch(0))
        grads = jax.device_get(h.grads_step(state, *batch, step.step_key(0, 0, 0))[0])
    finally:
        pipeline.encoder = real_encoder
    assert _max_rel_diff(grads, ref_grads) > 1e-3


def test_params_after_3_adamw_steps_agree():
    sc = _sc(grad_clip=1.0)
    opt = optax.adamw(1e-3, weight_decay=0.05, mask=step.decay_mask)
    host = _state(sc, opt)

    @jax.jit
    def reference_step(state, images, labels, ids, key):
        # One device, the library's pieces, no collectives.
        grads, _ = step.local_grads(sc, state["params"], state["loss_scale"], images, labels,
                                    ids, key)
        norm = jnp.sqrt(step.sum_of_squares(grads))
        return step.apply_gradients(sc, state, grads, norm, opt)[0]

    state = host
    for i in range(3):
        state = reference_step(state, *_batch(seed=i), step.step_key(0, 0, i))
    ref = jax.device_get(state["params"])
    assert max(float(np.max(np.abs(a - b))) for a, b in
               zip(jax.tree.leaves(ref), jax.tree.leaves(host["params"]))) > 1e-3

    h = Harness(sc, opt, 2, 2, 2, 2)  # data x model x pipe, 2 micro-batches
    state = h.put(host)[0]
    for i in range(3):
        _, *batch = h.put(host, *_batch(seed=i))
        state, _ = h.train_step(state, *batch, step.step_key(0, 0, i))
    for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)


def test_accumulation_nests_outside_the_pipeline(reference):
    ref_grads, _ = reference
    sc = _sc(accum_steps=2)
    h = Harness(sc, optax.sgd(1.0), 4, 1, 2, 2)
    state, *batch = h.put(_state(sc, optax.sgd(1.0)), *_batch(0))
    grads = jax.device_get(h.grads_step(state, *batch, step.step_key(0, 0, 0))[0])
    assert _max_rel_diff(grads, ref_grads) <= 1e-5


def test_eval_sums_equal_unpipelined_eval():
    sc = _sc()
    host = _state(sc, optax.sgd(1.0))
    images, labels, _ = _batch(0)
    mask = np.ones(BATCH, np.float32)
    mask[-3:] = 0
    ref = jax.device_get(step.local_eval(sc, host["params"], images, labels, mask))
    h = Harness(sc, optax.sgd(1.0), 2, 2, 2, 1)
    run = jax.jit(jax.shard_map(
        lambda state, x, y, m: lax.psum(pipeline.pipeline_eval(
            sc, state["params"], x, y, m, pipe_axis=PIPE, microbatches=6, tp_axis=MODEL),
            DATA),  # 8 per device and 6 asked for: gcd -> 2 micro-batches
        mesh=h.mesh, in_specs=(h.state_specs, P(DATA), P(DATA), P(DATA)), out_specs=P()))
    out = run(*h.put(host, images, labels, mask))
    assert float(out["count"]) == BATCH - 3
    np.testing.assert_allclose(float(out["loss"]), float(ref["loss"]), rtol=1e-6)
    assert float(out["correct"]) == float(ref["correct"])


def test_planning_errors_and_bubble():
    with pytest.raises(ValueError, match="depth 4 .* 3 equal stages"):
        pipeline.check_pipeline(CFG, 3, 1)
    with pytest.raises(ValueError, match="per-device batch 6 does not divide into 4"):
        pipeline.check_pipeline(CFG, 2, 4, 6)
    assert pipeline.bubble_fraction(2, 1) == 0.5
    assert pipeline.bubble_fraction(4, 8) == 3 / 11
    text = pipeline.describe(CFG, 2, 4)
    assert "stage 0: patch+class+position embedding, blocks 0..1" in text
    assert "stage 1: blocks 2..3, final LayerNorm, head, loss" in text
    assert "bubble fraction 0.200" in text


def test_unsplit_blocks_are_refused():
    """Blocks that were not split over 'pipe' would run every layer on every stage."""
    sc = _sc()
    h = Harness(sc, optax.sgd(1.0), 4, 1, 2, 1)
    whole = {**h.state_specs, "params": {**h.state_specs["params"], "blocks": jax.tree.map(
        lambda s: P(), h.state_specs["params"]["blocks"], is_leaf=_is_spec)}}
    f = jax.shard_map(lambda state, x, y, i, key: pipeline.pipeline_grads(
        sc, jax.tree.map(lambda a: lax.pcast(a, DATA, to="varying"), state["params"]),
        state["loss_scale"], x, y, i, key, pipe_axis=PIPE, microbatches=1)[1],
        mesh=h.mesh, in_specs=(whole, P(DATA), P(DATA), P(DATA), P()), out_specs=P())
    with pytest.raises(ValueError, match="holds 4 of 4 layers over 2 stages"):
        jax.eval_shape(f, _state(sc, optax.sgd(1.0)), *_batch(0), step.step_key(0, 0, 0))
