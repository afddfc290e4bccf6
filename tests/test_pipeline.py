"""Pipeline parallelism (`--mesh ...,pipe=S --microbatches K`) equals the single-device
reference.

The tiny model (depth 4, so 2 or 4 stages) on 8 fake CPU devices, dropout and stochastic
depth on, the on-device augmentation on, float32. Everything goes through the training
script's own `ShardMapStrategy` (its `global_grads` under conftest.grads_step, its
compiled `train_step` / `eval_step`);
the reference is `jax.grad` of the mean loss over the whole batch on one device
(`step.local_grads`), with the same step key and example ids.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_adamw_params_agree, grads_step, key_bias

import train_shardmap
from vit_pure import PRESETS, Policy, pipeline, step
from vit_pure.pipeline import schedules, tick

# Many pipelined compiles: ~2.5 minutes on 2 cores. Run with `python -m pytest -m slow`.
from vit_pure.run import checkpoint, cli

pytestmark = pytest.mark.slow

CFG = PRESETS["tiny"]
BATCH = 16


def _sc(**kw):
    kw.setdefault("grad_clip", 0.0)
    return step.StepConfig(CFG, Policy(), **kw)


def _batch(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, CFG.num_classes, (n,), dtype=np.int32)
    return images, labels, np.arange(n, dtype=np.int32)


LR, EPS = 1e-3, 1e-8  # EPS: optax's default, given for the key bias's bound
OPT = optax.adamw(LR, eps=EPS, weight_decay=0.05, mask=step.decay_mask)


def _host_state(sc, optimizer=OPT):
    return jax.device_get(step.init_state(jax.random.key(0), sc.cfg, sc.policy, optimizer))


def _strategy(sc, mesh, k, fsdp=False, optimizer=OPT, schedule="gpipe", virtual=1):
    return train_shardmap.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp, microbatches=k,
                                           schedule=schedule, virtual_stages=virtual)


def _inputs(strategy, seed=0):
    return (*strategy.put_batch(*_batch(seed)),
            strategy.put_replicated(step.step_key(0, 0, seed)))


@pytest.fixture(scope="module")
def reference():
    sc = _sc()
    host = _host_state(sc)
    images, labels, ids = _batch(0)
    grads, metrics = jax.jit(lambda p: step.local_grads(
        sc, p, host["loss_scale"], images, labels, ids, step.step_key(0, 0, 0)))(
            host["params"])
    return jax.device_get(grads), jax.device_get(metrics)


def _max_rel_diff(a, b):
    norm = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(b)))
    return max(float(np.max(np.abs(x - y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))) / norm


def _collectives(text):
    return {op: len(re.findall(rf"\b{op}\(", text)) for op in
            ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")}


def _grads(strategy, sc):
    """The script's compiled gradient step (the first half of its train step)."""
    state = strategy.put_state(_host_state(sc))
    compiled = grads_step(strategy).lower(state, *_inputs(strategy)).compile()
    grads, metrics = compiled(state, *_inputs(strategy))
    return jax.device_get(grads), jax.device_get(metrics), _collectives(compiled.as_text())


LAYOUTS = [  # (--mesh, --microbatches, --fsdp); the exhaustive ones add no new axis
    ("data=4,pipe=2", 1, False), ("data=4,pipe=2", 2, False),
    pytest.param("data=4,pipe=2", 4, False, marks=pytest.mark.exhaustive),
    ("data=2,pipe=4", 4, False),
    pytest.param("data=2,model=2,pipe=2", 2, False, marks=pytest.mark.exhaustive),
    ("data=2,model=2,pipe=2", 2, True),
]


@pytest.mark.parametrize("mesh,k,fsdp", LAYOUTS)
def test_loss_and_grads_equal_single_device_reference(mesh, k, fsdp, reference):
    ref_grads, ref_metrics = reference
    sc = _sc()
    strategy = _strategy(sc, mesh, k, fsdp)
    grads, metrics, counts = _grads(strategy, sc)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["accuracy"], ref_metrics["accuracy"])
    assert _max_rel_diff(grads, ref_grads) <= 1e-5
    # Every piece really has a gradient: the embedding (stage 0 only), every layer of every
    # stage, and the head (last stage only), so a dropped psum or a masked stage shows.
    for g in (grads["patch_embed"]["kernel"], grads["pos_embed"], grads["head"]["kernel"],
              *grads["blocks"]["mlp"]["fc1"]["kernel"]):
        assert np.abs(g).max() > 1e-5

    # The compiled step's collectives. The schedule's collective-permutes: GPipe's table
    # runs as scans of ticks that send the same ways (forward, then back), one send
    # written in each scan's body that sends. All-gathers only from FSDP, one per sharded
    # weight per step (each stage gathers its own layers once, before the ticks): never
    # one of another stage's params.
    stages = strategy.stages
    plan = tick.static_plan(schedules.build("gpipe", stages, k))
    assert counts["collective-permute"] == sum(len(x) for g in plan.segments for x in g.sends)
    assert plan.sends() == 2 * (k + stages - 2)  # each run once a tick: K + S - 2 each way
    specs = strategy.param_specs
    sharded = lambda tree: sum(  # noqa: E731  (weights split over 'data', i.e. FSDP)
        "data" in train_shardmap.mesh_axes(s) for s in jax.tree.leaves(tree, is_leaf=_is_spec))
    top = {k_: v for k_, v in specs.items() if k_ != "blocks"}
    gathers = sharded(specs["blocks"]) * CFG.depth // stages + sharded(top) if fsdp else 0
    assert counts["all-gather"] == counts["reduce-scatter"] == gathers
    assert counts["all-to-all"] == 0
    assert counts["all-reduce"] >= 1


def _is_spec(x):
    return isinstance(x, jax.sharding.PartitionSpec)


def test_dropout_follows_the_global_layer_index(reference, monkeypatch):
    """A pipeline that restarts the layer count on each stage (layer_offset = 0) draws
    other dropout masks, and the comparison above notices: that test can fail."""
    real_encoder = tick.encoder
    monkeypatch.setattr(tick, "encoder", lambda *a, layer_offset, **kw: real_encoder(
        *a, layer_offset=0, **kw))
    sc = _sc()
    grads, _, _ = _grads(_strategy(sc, "data=4,pipe=2", 1), sc)
    assert _max_rel_diff(grads, reference[0]) > 1e-3


def test_training_recipe_matches_the_unpipelined_step():
    """Label smoothing, RandAugment and mixup / cutmix: the pipeline prepares the batch
    through step.accumulate, as step.local_grads does, so it matches the script's
    unpipelined step (data=4 on both sides)."""
    # Two blocks, one a stage: the batch is prepared before the first block, so more
    # blocks prove nothing more here and cost compile time (depth 4: twice the time).
    sc = dataclasses.replace(_sc(label_smoothing=0.1, randaugment=(2, 9), mixup_alpha=0.8,
                                 cutmix_alpha=1.0), cfg=CFG.replace(depth=2))
    plain = train_shardmap.ShardMapStrategy(sc, OPT, "data=4", devices=jax.devices()[:4])
    want, want_metrics, _ = _grads(plain, sc)
    got, metrics, _ = _grads(_strategy(sc, "data=4,pipe=2", 2), sc)
    np.testing.assert_allclose(metrics["loss"], want_metrics["loss"], rtol=1e-6)
    assert _max_rel_diff(got, want) <= 1e-5


def test_accumulation_nests_outside_the_pipeline(reference):
    sc = _sc(accum_steps=2)  # 4 per device -> 2 accumulation steps of 2 -> 2 micro-batches
    grads, _, _ = _grads(_strategy(sc, "data=4,pipe=2", 2), sc)
    assert _max_rel_diff(grads, reference[0]) <= 1e-5


@pytest.mark.parametrize("schedule,virtual", [
    # GPipe's steps: the wider sweep (its gradients are the reference's, above).
    pytest.param("gpipe", 1, marks=pytest.mark.exhaustive),
    # Interleaved stores the blocks in `block_order` on the devices: the optimizer updates
    # them there, and host_state must give them back in layer order.
    ("interleaved", 2),
])
def test_params_after_3_adamw_steps_agree(schedule, virtual):
    sc, steps = _sc(grad_clip=1.0), 3
    host = _host_state(sc)

    @jax.jit
    def reference_step(state, images, labels, ids, key):
        # One device, the library's pieces, no collectives.
        grads, _ = step.local_grads(sc, state["params"], state["loss_scale"], images, labels,
                                    ids, key)
        norm = jnp.sqrt(step.sum_of_squares(grads))
        return step.apply_gradients(sc, state, grads, norm, OPT)[0], grads

    ref, key_bias_grad = host, 0.0
    for i in range(steps):
        ref, grads = reference_step(ref, *_batch(i), step.step_key(0, 0, i))
        key_bias_grad = max(key_bias_grad, float(np.abs(key_bias(grads)).max()))
    ref = jax.device_get(ref["params"])
    assert max(float(np.max(np.abs(a - b))) for a, b in
               zip(jax.tree.leaves(ref), jax.tree.leaves(host["params"]))) > 1e-3

    strategy = _strategy(sc, "data=2,model=2,pipe=2", 2, schedule=schedule, virtual=virtual)
    state = strategy.put_state(host)
    for i in range(steps):
        state, metrics = strategy.train_step(state, *_inputs(strategy, i))
    assert np.isfinite(float(metrics["loss"]))
    assert_adamw_params_agree(strategy.host_state(state)["params"], ref, key_bias_grad, steps,
                              LR, EPS)


def test_a_checkpoint_resumes_under_another_schedule(tmp_path):
    """docs/parallelism.md: checkpoints keep the layers in order "and resume under any
    schedule". Two steps under 1F1B, written as the loop writes a checkpoint and read
    back; the third step from it under 1F1B, GPipe and interleaved: the same loss, and the
    same params after it (float32 sums in another order: to rounding)."""
    sc = _sc(grad_clip=1.0)
    first = _strategy(sc, "data=4,pipe=2", 2, schedule="1f1b")
    state = first.put_state(_host_state(sc))
    for i in range(2):
        state, _ = first.train_step(state, *_inputs(first, i))
    host = first.host_state(state)
    path = checkpoint.save(tmp_path, 2, host, {})
    saved = checkpoint.restore(path, jax.eval_shape(lambda: host))
    assert int(saved["step"]) == 2
    after = {}
    for schedule, virtual in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
        strategy = _strategy(sc, "data=4,pipe=2", 2, schedule=schedule, virtual=virtual)
        state, metrics = strategy.train_step(strategy.put_state(saved), *_inputs(strategy, 2))
        after[schedule] = float(metrics["loss"]), strategy.host_state(state)["params"]
    loss, params = after.pop("1f1b")
    for schedule, (other_loss, other_params) in after.items():
        assert other_loss == pytest.approx(loss, rel=1e-6), schedule
        assert _max_rel_diff(other_params, params) <= 1e-6, schedule


def test_eval_step_equals_unpipelined_eval():
    sc = _sc()
    host = _host_state(sc)
    images, labels, _ = _batch(0)
    mask = np.ones(BATCH, np.float32)
    mask[-3:] = 0  # padding
    ref = jax.device_get(step.local_eval(sc, host["params"], images, labels, mask))
    # 8 per device and 6 micro-batches asked for: evaluation runs gcd(8, 6) = 2.
    strategy = _strategy(sc, "data=2,model=2,pipe=2", 6)
    out = strategy.eval_step(strategy.put_state(host), *strategy.put_batch(images, labels, mask))
    assert float(out["count"]) == BATCH - 3
    np.testing.assert_allclose(float(out["loss"]), float(ref["loss"]), rtol=1e-6)
    assert float(out["correct"]) == float(ref["correct"])


def test_layout_and_start_message():
    strategy = _strategy(_sc(), "data=2,model=2,pipe=2", 4)
    specs = strategy.param_specs
    assert specs["blocks"]["mlp"]["fc1"]["kernel"] == jax.sharding.PartitionSpec(
        "pipe", None, "model")
    assert specs["head"]["kernel"] == jax.sharding.PartitionSpec(None, None)
    text = strategy.describe()
    assert "stage 0: patch+class+position embedding, blocks 0..1" in text
    assert "stage 1: blocks 2..3, final LayerNorm, head, loss" in text
    assert "gpipe schedule, 4 micro-batches, 10 ticks, bubble 0.200" in text
    assert "    stage 1: .  F0 F1 F2 F3 B3 B2 B1 B0 ." in text  # the table's picture
    # Measured on the placed arrays, per device: 21,448 B of pipe-replicated embedding
    # and head, plus 18,496 B of blocks (half the layers, heads and MLP split over
    # 'model'), against 93,128 B for the whole model under pure data parallelism.
    assert "params 39,944..39,944 B" in text


@pytest.mark.parametrize("mesh,k,message", [
    ("data=2,pipe=4", None, None),
    ("data=2,pipe=3", 1, "--mesh pipe=3: pipeline: depth 4 of tiny does not split into 3"),
    ("data=8", 2, "--microbatches needs a pipeline"),
    ("data=4,pipe=2", 0, "--microbatches must be >= 1"),
])
def test_bad_pipeline_settings_are_one_line_errors(mesh, k, message):
    devices = jax.devices()[:6] if "pipe=3" in mesh else None
    if message is None:  # the default: K = S micro-batches
        assert _strategy(_sc(), mesh, k).microbatches == 4
        return
    with pytest.raises(cli.UsageError, match=re.escape(message)):
        train_shardmap.ShardMapStrategy(_sc(), OPT, mesh, devices=devices, microbatches=k)


def test_batch_must_split_into_micro_batches():
    strategy = _strategy(_sc(), "data=4,pipe=2", 4)
    strategy.check_batch(32)  # 8 per device: fine
    with pytest.raises(cli.UsageError, match="per-device batch 6 .* --microbatches 4"):
        strategy.check_batch(24)


def test_planning_helpers():
    with pytest.raises(ValueError, match="per-device batch 6 does not divide into 4"):
        pipeline.check_pipeline(CFG, 2, 4, 6)
    assert pipeline.bubble_fraction(2, 1) == 0.5
    assert pipeline.bubble_fraction(4, 8) == 3 / 11
