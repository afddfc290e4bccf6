"""--layer-decay D: layer-wise learning-rate decay (step.scale_by_layer).

* The factors: the embeddings D^(L+1), block j D^(L-j), the final LayerNorm and the head 1.
* One SGD step (momentum has no effect on step one) with D = 0.5 moves each param by
  exactly its factor times the undecayed step; AdamW's decoupled weight decay is scaled
  with it; under --trainable head D changes nothing.
* Two steps give the same params, layer by layer, on one device and under pmap, data
  parallel, FSDP, tensor parallel and pipelines (interleaved virtual stages included,
  whose blocks sit on the devices in a permuted order): each device holds its own blocks'
  factors.
* A bad D is one line, exit 2.

Small model (tiny, depth 4, no dropout) and few steps.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layout_matrix import FAST, tolerances

import train_pmap
import train_shardmap as ts
from vit_pure import step
from vit_pure.config import PRESETS
from vit_pure.policy import Policy
from vit_pure.run import cli, settings

D, STEPS, BATCH, LR = 0.5, 2, 16, 0.1
POLICY = Policy.parse("fp32")
MODEL = PRESETS["tiny"].replace(name="layer-decay-test", dropout=0.0, drop_path=0.0)
L = MODEL.depth
SC = step.StepConfig(MODEL, POLICY, grad_clip=1.0)


def _sgd(decay: float, **kw):
    optim = step.OptimConfig(lr=LR, weight_decay=0.01, warmup_steps=0, optimizer="sgd",
                             layer_decay=decay, **kw)
    return step.make_optimizer(optim, 10)[0]


def _params():
    return step.init_state(jax.random.key(0), MODEL, POLICY, _sgd(1.0))["params"]


def _batch(i: int):
    rng = np.random.default_rng(i)
    return (rng.integers(0, 256, (BATCH, 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, (BATCH,), dtype=np.int32),
            np.arange(BATCH, dtype=np.int32) + i * BATCH, step.step_key(0, 0, i))


def _expected_factor(path) -> np.ndarray | float:
    top = path[0].key
    if top == "blocks":
        return D ** (L - np.arange(L))  # block j at depth j + 1: D^(L + 1 - (j + 1))
    return D ** (L + 1) if top in ("patch_embed", "cls_token", "pos_embed") else 1.0


def _factor_array(path, p):
    """`_expected_factor` broadcastable against the param."""
    f = _expected_factor(path)
    return np.reshape(f, (L,) + (1,) * (p.ndim - 1)) if path[0].key == "blocks" else f


def test_factors_per_param():
    params = _params()
    factors = step.layer_factors(params, D)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    assert {path[0].key for path, _ in flat} == {"patch_embed", "cls_token", "pos_embed",
                                                  "blocks", "final_ln", "head"}
    for (path, p), f in zip(flat, jax.tree.leaves(factors), strict=True):
        assert f.dtype == jnp.float32 and f.ndim == p.ndim, path
        want = _expected_factor(path)
        if path[0].key == "blocks":
            assert f.shape == (L,) + (1,) * (p.ndim - 1), path
            np.testing.assert_array_equal(f.ravel(), want)  # [D^4, D^3, D^2, D]
        else:
            assert f.shape == (1,) * p.ndim and float(f.ravel()[0]) == want, path
    assert float(factors["head"]["kernel"].ravel()[0]) == 1.0
    assert float(factors["pos_embed"].ravel()[0]) == D ** 5


def test_one_sgd_step_moves_each_block_by_its_factor():
    """Step one of SGD with momentum: the update is -lr g (plus weight decay), so with D
    it is each param's factor times the update without D, exactly (D = 0.5: powers of
    two), and the new params moved by the factor times the undecayed move."""
    params = _params()
    images, labels, ids, key = _batch(0)
    grads, _ = jax.jit(lambda p: step.local_grads(SC, p, step.init_state(
        jax.random.key(0), MODEL, POLICY, _sgd(1.0))["loss_scale"], images, labels, ids,
        key))(params)
    plain, decayed = _sgd(1.0), _sgd(D)
    # Eager on purpose: under jit XLA:CPU may contract p * wd + g into an FMA in one
    # program and not in the other, and "exactly" holds only op by op.
    u1, _ = plain.update(grads, plain.init(params), params)
    ud, _ = decayed.update(grads, decayed.init(params), params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, p), a, b in zip(flat, jax.tree.leaves(u1), jax.tree.leaves(ud), strict=True):
        f = _factor_array(path, p)
        assert np.any(np.asarray(a)), path
        np.testing.assert_array_equal(np.asarray(b), f * np.asarray(a), err_msg=str(path))

    def one_step(optimizer):
        state = step.init_state(jax.random.key(0), MODEL, POLICY, optimizer, params=params)
        sc = step.StepConfig(MODEL, POLICY, grad_clip=0.0)
        norm = jnp.sqrt(step.sum_of_squares(grads))
        return step.apply_gradients(sc, state, grads, norm, optimizer)[0]["params"]
    # The new params: the same, up to the rounding of p + u (one float32 ulp of p each).
    new1, newd = one_step(plain), one_step(decayed)
    for (path, p), a, b in zip(flat, jax.tree.leaves(new1), jax.tree.leaves(newd), strict=True):
        f, p = _factor_array(path, p), np.asarray(p)
        np.testing.assert_allclose(np.asarray(b) - p, f * (np.asarray(a) - p), rtol=0,
                                   atol=2 * np.spacing(np.abs(p).max()), err_msg=str(path))


def test_adamw_weight_decay_is_scaled_with_the_learning_rate():
    """Zero gradients: AdamW's update is -lr * wd * p on the weight matrices alone, and
    with D each layer's factor times that (decoupled decay scaled like the rate)."""
    params = _params()
    optim = step.OptimConfig(lr=1e-2, weight_decay=0.5, warmup_steps=0, layer_decay=D)
    optimizer = step.make_optimizer(optim, 10)[0]
    updates = jax.device_get(jax.jit(lambda p: optimizer.update(
        jax.tree.map(jnp.zeros_like, p), optimizer.init(p), p)[0])(params))
    params = jax.device_get(params)  # the checks below in numpy, not op by op in jax
    for j in range(L):
        np.testing.assert_allclose(updates["blocks"]["attn"]["qkv"]["kernel"][j],
                                   -1e-2 * 0.5 * D ** (L - j)
                                   * params["blocks"]["attn"]["qkv"]["kernel"][j], rtol=1e-6)
    np.testing.assert_allclose(updates["patch_embed"]["kernel"],
                               -1e-2 * 0.5 * D ** (L + 1) * params["patch_embed"]["kernel"],
                               rtol=1e-6)
    np.testing.assert_allclose(updates["head"]["kernel"], -1e-2 * 0.5 * params["head"]["kernel"],
                               rtol=1e-6)
    assert not np.any(np.asarray(updates["head"]["bias"]))  # no decay on biases


def test_trainable_head_ignores_the_decay():
    params = _params()
    grads = jax.tree.map(jnp.ones_like, params)
    plain, decayed = _sgd(1.0, trainable="head"), _sgd(D, trainable="head")
    s1, sd = plain.init(params), decayed.init(params)
    assert jax.tree.structure(s1) == jax.tree.structure(sd)
    for a, b in zip(jax.tree.leaves(plain.update(grads, s1, params)[0]),
                    jax.tree.leaves(decayed.update(grads, sd, params)[0]), strict=True):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------- layouts
@pytest.fixture(scope="module")
def reference():
    """STEPS steps on one device, the library's pieces and no collectives: (initial
    params, params after the steps with D, params after the steps without)."""
    def run(optimizer):
        @jax.jit
        def one(state, images, labels, ids, key):
            grads, _ = step.local_grads(SC, state["params"], state["loss_scale"], images,
                                        labels, ids, key)
            norm = jnp.sqrt(step.sum_of_squares(grads))
            return step.apply_gradients(SC, state, grads, norm, optimizer)[0]
        state = step.init_state(jax.random.key(0), MODEL, POLICY, optimizer)
        for i in range(STEPS):
            state = one(state, *_batch(i))
        return jax.device_get(state["params"])
    return jax.device_get(_params()), run(_sgd(D)), run(_sgd(1.0))


def _run_layout(layout: str):
    optimizer = _sgd(D)
    if layout == "pmap":
        strategy = train_pmap.PmapStrategy(SC, optimizer, devices=jax.devices()[:8])
    else:
        mesh, fsdp, schedule, virtual = LAYOUTS[layout]
        strategy = ts.ShardMapStrategy(SC, optimizer, mesh, fsdp=fsdp, schedule=schedule,
                                       virtual_stages=virtual)
    host = jax.device_get(step.init_state(jax.random.key(0), MODEL, POLICY, optimizer))
    state, compiled = strategy.put_state(host), None
    for i in range(STEPS):
        images, labels, ids, key = _batch(i)
        args = (state, *strategy.put_batch(images, labels, ids), strategy.put_replicated(key))
        compiled = compiled or strategy.train_step.lower(*args).compile(FAST)
        state, _ = compiled(*args)
    return strategy.host_state(state)["params"]


LAYOUTS = {  # name -> (mesh, fsdp, pipeline schedule, virtual stages)
    "dp": ("data=8", False, "gpipe", 1),
    "fsdp": ("data=8", True, "gpipe", 1),
    "tp": ("data=4,model=2", False, "gpipe", 1),
    "pp": ("data=4,pipe=2", False, "gpipe", 1),
    # Stage s holds chunks s and 2 + s: blocks [0, 2 | 1, 3] on the devices.
    "pp-interleaved": ("data=4,pipe=2", False, "interleaved", 2),
    "pp+tp+fsdp": ("data=2,model=2,pipe=2", True, "interleaved", 2),
}
# pmap (the other script) and pp+tp+fsdp (interleaved chunks: a block's factor follows the
# block, not the stage; its weights split over every axis) cover the rest: the other
# layouts are the wider sweep (`-m exhaustive`).
COVERING = {"pmap", "pp+tp+fsdp"}


def _slices(params):
    """(name, array) per param, the stacked blocks one slice per layer."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(str(k.key) for k in path)
        x = np.asarray(x, np.float64)
        out += ([(f"{name}[{j}]", x[j]) for j in range(L)] if path[0].key == "blocks"
                else [(name, x)])
    return out


@pytest.mark.parametrize("layout", [
    pytest.param(name, marks=() if name in COVERING else (pytest.mark.exhaustive,))
    for name in ["pmap", *LAYOUTS]])
def test_params_after_two_steps_equal_one_device(layout, reference):
    """Every param, each block's slice on its own, moved as on one device: within the
    layout matrix's float32 tolerance of how far one device moved it. Each slice moved by
    its factor's share (with the factors of another block it would be off by 2x or more),
    and differently from the run without decay."""
    init, ref, undecayed = reference
    got = _run_layout(layout)
    _, tol = tolerances(POLICY)
    for (name, g), (_, r), (_, p0), (_, u) in zip(_slices(got), _slices(ref), _slices(init),
                                                  _slices(undecayed), strict=True):
        moved = math.dist(r.ravel(), p0.ravel())
        assert moved > 0, name
        assert math.dist(g.ravel(), r.ravel()) <= tol * moved, name
        if not name.startswith(("head", "final_ln")):  # factor < 1: a different move
            assert math.dist(u.ravel(), r.ravel()) > 0.1 * moved, name


# ----------------------------------------------------------------------- the flag
def test_flag_reaches_the_optimizer_config():
    args = cli.parse_args(ts.build_parser(), ["--layer-decay", "0.65"])
    assert settings.RunConfig.from_args(args).schedule.optim.layer_decay == 0.65
    args = cli.parse_args(ts.build_parser(), [])
    assert settings.RunConfig.from_args(args).schedule.optim.layer_decay == 1.0


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "nan", "inf", "abc"])
def test_bad_layer_decay_is_one_line_exit_2(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(ts.build_parser(), ["--layer-decay", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--layer-decay" in err and "(0, 1]" in err
    assert err.count("\n") == 1
    with pytest.raises(ValueError, match="layer_decay"):
        step.make_optimizer(step.OptimConfig(layer_decay=1.5), 10)
