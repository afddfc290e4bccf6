"""pmap, shard_map and a single-device reference compute the same gradients and updates.

Gradients are read out of each script's *real* compiled train step: with plain SGD at
learning rate 1 and no clipping or weight decay, params_after = params - grads, so
grads = params_before - params_after (exact up to one float subtraction). Everything runs
on 8 fake CPU devices with the tiny model, dropout and stochastic depth on, and the
on-device augmentation on.
"""
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_adamw_params_agree, key_bias
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_pmap
import train_shardmap
from vit_pure import PRESETS, Policy, model, step

CFG = PRESETS["tiny"]
BATCH = 16


def _sc(policy="fp32", **kw):
    return step.StepConfig(CFG, Policy.parse(policy), grad_clip=0.0, **kw)


def _batch(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, CFG.num_classes, (n,), dtype=np.int32)
    return images, labels, np.arange(n, dtype=np.int32)


def _state(sc, optimizer):
    # On the host: the strategies donate their device copy, this one must survive.
    return jax.device_get(step.init_state(jax.random.key(0), CFG, sc.policy, optimizer))


def _strategy(kind, sc, optimizer, n):
    devices = jax.devices()[:n]
    if kind == "pmap":
        return train_pmap.PmapStrategy(sc, optimizer, devices=devices)
    return train_shardmap.ShardMapStrategy(sc, optimizer, f"data={n}", devices=devices)


def _run_steps(strategy, host_state, n_steps):
    state = strategy.put_state(host_state)
    for i in range(n_steps):
        images, labels, ids = _batch(seed=i)
        key = strategy.put_replicated(step.step_key(0, 0, i))
        state, _ = strategy.train_step(state, *strategy.put_batch(images, labels, ids), key)
    return strategy.host_state(state)


@functools.cache  # two tests read the 8-device gradients of both scripts
def _grads_via_sgd(kind, sc, n):
    """The gradient a script's train step computes, read out of one SGD(lr=1) step."""
    sgd = optax.sgd(1.0)
    host = _state(sc, sgd)
    after = _run_steps(_strategy(kind, sc, sgd, n), host, 1)
    return jax.tree.map(lambda a, b: np.asarray(a, np.float32) - np.asarray(b, np.float32),
                        host["params"], after["params"])


def _reference_grads(sc):
    """Single device: jax.grad of the mean loss over the whole batch, no collectives."""
    host = _state(sc, optax.sgd(1.0))
    images, labels, ids = _batch(seed=0)
    grads, _ = jax.jit(lambda p: step.local_grads(
        sc, p, host["loss_scale"], images, labels, ids, step.step_key(0, 0, 0)))(host["params"])
    return jax.tree.map(lambda g: np.asarray(g, np.float32), grads)


def _max_rel_diff(a, b):
    norm = np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(b)))
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(np.max(np.abs(x - y))) for x, y in pairs) / norm


@pytest.fixture(scope="module")
def reference_grads():
    return _reference_grads(_sc())


@pytest.mark.parametrize("kind", ["pmap", "shard_map"])
# 8 devices split the batch finest; 2 is the wider sweep (`-m exhaustive`).
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.exhaustive), 8])
def test_gradients_equal_single_device_reference(kind, n, reference_grads):
    grads = _grads_via_sgd(kind, _sc(), n)
    assert _max_rel_diff(grads, reference_grads) <= 1e-5
    # The gradient is not trivially zero anywhere important.
    assert np.abs(grads["blocks"]["mlp"]["fc1"]["kernel"]).max() > 1e-4


def test_pmap_and_shardmap_gradients_agree_to_the_last_bits():
    # Not bitwise: XLA fuses the two programs differently, so a few entries differ in the
    # last bits; the check is at float32 rounding level, relative to the gradient norm.
    g_pmap = _grads_via_sgd("pmap", _sc(), 8)
    g_shard = _grads_via_sgd("shard_map", _sc(), 8)
    pairs = zip(jax.tree.leaves(g_pmap), jax.tree.leaves(g_shard))
    differing = sum(int(np.sum(a != b)) for a, b in pairs)
    total = sum(a.size for a in jax.tree.leaves(g_pmap))
    print(f"pmap vs shard_map: {differing} of {total} gradient entries differ in any bit, "
          f"max difference {_max_rel_diff(g_pmap, g_shard):.2e} of the gradient norm")
    assert _max_rel_diff(g_pmap, g_shard) <= 1e-7


def test_bf16_gradients_close_to_f32_reference(reference_grads):
    grads = _grads_via_sgd("shard_map", _sc("bf16"), 8)
    # bf16 has an 8-bit mantissa: per-entry error up to ~1% of the gradient scale.
    assert _max_rel_diff(grads, reference_grads) <= 2e-2
    assert _max_rel_diff(grads, reference_grads) > 1e-7  # really computed in bf16


@pytest.mark.slow  # compiles five strategies: ~2 minutes on 2 cores
def test_params_after_5_adamw_steps_agree_everywhere():
    sc = step.StepConfig(CFG, Policy(), grad_clip=1.0)
    lr, eps, steps = 1e-3, 1e-8, 5  # eps: optax's default, given here for the bound below
    opt = optax.adamw(lr, eps=eps, weight_decay=0.05, mask=step.decay_mask)
    host = _state(sc, opt)
    results = {("pmap", 8): _run_steps(_strategy("pmap", sc, opt, 8), host, steps)}
    for n in (1, 2, 4, 8):
        results[("shard_map", n)] = _run_steps(_strategy("shard_map", sc, opt, n), host, steps)

    # Single-device reference written with the library's pieces and no collectives (one
    # jitted step: run op by op it took three times as long as a strategy's five steps).
    @jax.jit
    def reference_step(state, images, labels, ids, key):
        grads, _ = step.local_grads(sc, state["params"], state["loss_scale"], images, labels,
                                    ids, key)
        norm = jnp.sqrt(step.sum_of_squares(grads))
        return step.apply_gradients(sc, state, grads, norm, opt)[0], grads

    state, key_bias_grad = host, 0.0
    noise = jax.tree.map(lambda p: np.zeros(p.shape, bool), host["params"])
    for i in range(steps):
        state, grads = reference_step(state, *_batch(seed=i), step.step_key(0, 0, i))
        key_bias_grad = max(key_bias_grad, float(np.abs(key_bias(grads)).max()))
        # Gradients within float32 rounding of zero (1e-6 of their leaf's largest).
        noise = jax.tree.map(lambda n, g: n | (np.abs(np.asarray(g))
                                               <= 1e-6 * np.abs(np.asarray(g)).max()),
                             noise, grads)
    # Beyond the key bias (every entry, checked above), a handful, by chance.
    assert sum(int(n.sum()) for n in jax.tree.leaves(noise)) - int(key_bias(noise).sum()) <= 24
    ref = jax.device_get(state["params"])
    moved = max(float(np.max(np.abs(a - b))) for a, b in
                zip(jax.tree.leaves(ref), jax.tree.leaves(host["params"])))
    assert moved > 1e-3
    for name, res in results.items():
        assert_adamw_params_agree(res["params"], ref, key_bias_grad, steps, lr, eps, str(name),
                                  rounding_noise=noise)
        assert int(res["step"]) == steps


def _collectives(text):
    return {op: len(re.findall(rf"\b{op}\(", text)) for op in
            ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")}


def _lowered(kind, n=8):
    sc = _sc()
    opt = optax.adamw(1e-3)
    strategy = _strategy(kind, sc, opt, n)
    state = strategy.put_state(_state(sc, opt))
    images, labels, ids = strategy.put_batch(*_batch())
    key = strategy.put_replicated(step.step_key(0, 0, 0))
    return strategy.train_step.lower(state, images, labels, ids, key)


@pytest.mark.parametrize("kind", ["pmap", "shard_map"])
def test_collective_inventory_is_what_the_code_writes(kind):
    """StableHLO (before XLA's combiner) has one all_reduce per reduced array: the
    gradient pmean (one per param leaf) and the metrics pmean (loss, accuracy). Nothing
    else: no gather, no scatter, no permute. (With pure data parallelism no leaf is
    sharded, so the gradient norm needs no collective.) The compiled program may merge
    all-reduces, but must not add any other kind of collective."""
    lowered = _lowered(kind)
    n_params = len(jax.tree.leaves(_state(_sc(), optax.sgd(1.0))["params"]))
    hlo = lowered.as_text()
    expected = n_params + 2
    assert hlo.count('"stablehlo.all_reduce"') == expected
    for other in ("all_gather", "reduce_scatter", "collective_permute", "all_to_all"):
        assert f"stablehlo.{other}" not in hlo
    counts = _collectives(lowered.compile().as_text())
    assert 1 <= counts["all-reduce"] <= expected
    assert counts["all-gather"] == counts["reduce-scatter"] == counts["collective-permute"] == 0
    assert counts["all-to-all"] == 0


def _pmap_recipe_under_shard_map(check_vma: bool):
    """pmean(grad(local loss)) of the tiny model's step 0 under shard_map over 8 devices on
    'data', the params replicated (P()), as the pmap script writes it."""
    sc = _sc()
    host = _state(sc, optax.sgd(1.0))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def pmap_recipe(params, loss_scale, images, labels, ids, key):
        grads, _ = step.local_grads(sc, params, loss_scale, images, labels, ids, key)
        return lax.pmean(grads, "data")

    in_specs = (P(), P(), P("data"), P("data"), P("data"), P())
    f = jax.jit(jax.shard_map(pmap_recipe, mesh=mesh, in_specs=in_specs, out_specs=P(),
                              check_vma=check_vma))
    images, labels, ids = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in _batch())
    return f(host["params"], host["loss_scale"], images, labels, ids, step.step_key(0, 0, 0))


def test_naive_shardmap_recipe_is_n_times_too_large(reference_grads):
    """pmean(grad(local loss)) under shard_map with check_vma=True: autodiff already
    summed the gradient of the replicated params over 'data' (the transpose of their
    implicit broadcast), so the pmean of that sum is N times the true gradient."""
    grads = _pmap_recipe_under_shard_map(check_vma=True)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(reference_grads)):
        np.testing.assert_allclose(np.asarray(g), 8 * ref, rtol=1e-4, atol=1e-6)


def test_pmap_recipe_is_right_for_data_parallelism_with_check_vma_off(reference_grads):
    """The same pmean(grad(local loss)) with check_vma=False: nothing tracks that the
    params are replicated, autodiff sums nothing, and the pmean is the true gradient (the
    docs' "Turning the check off makes the pmap recipe right for data parallelism")."""
    grads = _pmap_recipe_under_shard_map(check_vma=False)
    assert _max_rel_diff(jax.device_get(grads), reference_grads) <= 1e-5


@pytest.mark.parametrize("check_vma", [True, False])
def test_check_vma_off_breaks_tensor_parallelism(check_vma):
    """The other half of the docs' sentence: a tensor-parallel MLP written with the model's
    own Megatron operators (`_copy_to_tp` before the column-parallel matmul,
    `_reduce_from_tp` after the row-parallel one) over 4 devices gives `jax.grad`'s
    gradients with check_vma=True; with it off, the psum's transpose is another psum: the
    weights' gradients come out 4 times too large, and the input's is wrong too."""
    mesh = jax.make_mesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    rng = np.random.default_rng(0)
    x, w1, w2 = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((5, 6), (6, 12), (12, 3)))

    def loss(x, w1, w2, tp_axis=None):
        h = jnp.tanh(model._copy_to_tp(x, tp_axis) @ w1)
        return jnp.sum(model._reduce_from_tp(h @ w2, tp_axis))

    want = jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)
    specs = (P(), P(None, "model"), P("model", None))
    got = jax.jit(jax.shard_map(
        lambda *a: jax.grad(functools.partial(loss, tp_axis="model"), argnums=(0, 1, 2))(*a),
        mesh=mesh, in_specs=specs, out_specs=specs, check_vma=check_vma))(x, w1, w2)
    # Within 1e-5 of the gradients' norm (`_max_rel_diff`): the sums run in another order.
    if check_vma:
        assert _max_rel_diff(jax.device_get(got), want) <= 1e-5
        return
    assert _max_rel_diff(jax.device_get(got[1:]), [4 * w for w in want[1:]]) <= 1e-5
    assert not np.allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=0.1)


@pytest.mark.parametrize("script", [train_pmap, train_shardmap])
@pytest.mark.parametrize("dataset", ["synthetic", "cifar10"])
def test_main_runs_two_steps_and_logs_json(script, dataset, subset_dir, tmp_path):
    """Both scripts, both datasets, the flags a user leaves alone at their defaults (the
    evaluation batch is --batch: 128 images a batch evaluate the 15,000 synthetic val and
    test images in 118 batches, 16 would take 938)."""
    log = tmp_path / "log.jsonl"
    argv = ["--model", "tiny", "--steps", "2", "--batch", "128", "--dataset", dataset,
            "--data-dir", str(subset_dir), "--log-json", str(log), "--no-progress"]
    result = script.main(argv)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r for r in records if "loss" in r and "split" not in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["images_per_s"] > 0 for r in train)
    evals = {r["split"]: r for r in records if "split" in r}
    assert set(evals) == {"val", "test"} and 0 <= evals["test"]["accuracy"] <= 1
    if dataset == "cifar10":
        assert evals["test"]["count"] == 1000 and evals["val"]["count"] == 400
    assert int(result["state"]["step"]) == 2 if script is train_shardmap else True


@pytest.mark.parametrize("argv, message", [
    (["--batch", "12"], "not divisible"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent/x"], "--dataset synthetic"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("VIT_PURE_CIFAR10_URL", "http://127.0.0.1:9/cifar-10-python.tar.gz")
    code = train_pmap.cli.main_guard(lambda: train_pmap.main(
        ["--model", "tiny", "--steps", "1", "--dataset", "synthetic", "--no-progress"] + argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_empty_validation_split_is_skipped_and_said(tmp_path, capsys):
    """--synthetic-val 0: the periodic and the final validation pass are skipped with one
    log line each (no crash), the test split is evaluated as usual."""
    log = tmp_path / "log.jsonl"
    result = train_shardmap.main([
        "--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "32",
        "--synthetic-val", "0", "--synthetic-test", "24", "--batch", "16", "--steps", "4",
        "--eval-every", "1", "--accum-steps", "1", "--randaugment", "0", "--no-progress",
        "--log-json", str(log)])
    out = capsys.readouterr().out
    assert out.count("val: skipped, the split is empty") == 2, out  # epoch 1, and final
    assert "val" not in result and result["test"]["count"] == 24
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["split"] for r in records if "split" in r} == {"test"}
