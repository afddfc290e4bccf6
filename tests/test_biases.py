"""The code forms of fc1's and the q, k, v projection's biases, of fc1's product, of the
blocks' LayerNorms and of q, k, v's data gradients (`Execution.biases`, `.fc1_output`,
`.layer_norm`, `.qkv_data_grads`) compute the shipped step's function: the same loss and
gradients in float32, under every attention path that runs on a CPU."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import FAST, grads_step

import train_shardmap as ts
from vit_pure import PRESETS, Policy, apply, init_params, step
from vit_pure.config import Execution
from vit_pure.policy import LossScale

TINY = PRESETS["tiny"]


@functools.lru_cache(maxsize=None)
def _loss_and_grads_fn(cfg, execution, policy):
    """jit(value_and_grad) of the loss, one compile per (cfg, execution, policy), shared by
    the tests (the default forms are every case's reference)."""
    def loss(p, images, labels):
        logits = apply(p, images, cfg, policy, train=True, rng=jax.random.key(3),
                       example_ids=jnp.arange(4) + 5, execution=execution)
        logits = logits.astype(jnp.float32)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), labels])

    return jax.jit(jax.value_and_grad(loss))


def _loss_and_grads(cfg, execution, policy=Policy(), params=None):
    params = init_params(jax.random.key(0), cfg) if params is None else params
    images = jax.random.normal(jax.random.key(1), (4, cfg.image_size, cfg.image_size, 3))
    labels = jnp.arange(4) % cfg.num_classes
    return _loss_and_grads_fn(cfg, execution, policy)(params, images, labels)


def _assert_close(reference, candidate, rel):
    (l_ref, g_ref), (l_new, g_new) = reference, candidate
    assert float(l_new) == pytest.approx(float(l_ref), rel=rel)
    # On the host (numpy): jnp here would compile each op for each leaf's shape.
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(g_ref)),
                            jax.tree.leaves(jax.device_get(g_new)), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        scale = float(np.abs(a).max())
        assert scale > 0, jax.tree_util.keystr(path)  # every parameter gets a gradient
        assert float(np.abs(a - b).max()) <= rel * scale, jax.tree_util.keystr(path)


_FORMS = {  # (attention, last block, Execution fields); beyond `_FAST`: `slow` or `exhaustive`
    "epilogue, einsum": ("einsum", "class-token", {"biases": "epilogue"}),
    "epilogue, xla, every row": ("xla", "all", {"biases": "epilogue"}),
    "fc1 float32, xla": ("xla", "class-token", {"fc1_output": "float32"}),
    "fc1-epilogue, xla": ("xla", "class-token", {"biases": "fc1-epilogue"}),
    "epilogue, xla": ("xla", "class-token", {"biases": "epilogue"}),
    "fc1 float32, einsum, every row": ("einsum", "all", {"fc1_output": "float32"}),
    "both, einsum": ("einsum", "class-token", {"biases": "epilogue", "fc1_output": "float32"}),
    # Both places q, k, v have products of their own: the padded path, the class-token block.
    "qkv data grads summed, xla": ("xla", "class-token", {"qkv_data_grads": "sum"}),
    "qkv data grads summed, epilogue, xla": ("xla", "all", {"qkv_data_grads": "sum",
                                                             "biases": "epilogue"}),
}
_FAST = ("epilogue, xla", "fc1 float32, xla", "qkv data grads summed, xla")
# The einsum path's forms of those the xla path runs: the wider sweep.
_WIDER = ("epilogue, einsum", "fc1 float32, einsum, every row")


def _tier(case):
    return (() if case in _FAST else
            (pytest.mark.exhaustive,) if case in _WIDER else (pytest.mark.slow,))


@pytest.mark.parametrize("case", [pytest.param(case, marks=_tier(case)) for case in _FORMS])
def test_bias_and_fc1_forms_give_the_same_loss_and_gradients(case):
    """float32, dropout and stochastic depth on: loss and every gradient (the biases'
    included) within 1e-5 of the largest element of each, against the default forms."""
    attention, last_block, form = _FORMS[case]
    cfg = TINY.replace(dropout=0.1, drop_path=0.1)
    base = Execution(attention=attention, last_block=last_block)
    _assert_close(_loss_and_grads(cfg, base), _loss_and_grads(cfg, base.replace(**form)), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("form", [{"biases": "epilogue"}, {"fc1_output": "float32"}])
def test_bias_and_fc1_forms_under_bf16_and_remat_gelu(form):
    """bf16 compute and matmul outputs, the GELU output recomputed (remat "gelu"), exact
    GELU: the same loss and gradients within bf16 rounding."""
    cfg = TINY.replace(gelu="exact")
    policy = Policy.parse("p=f32,c=bf16,o=f32,m=bf16")
    base = Execution(remat="gelu")
    _assert_close(_loss_and_grads(cfg, base, policy),
                  _loss_and_grads(cfg, base.replace(**form), policy), 5e-2)


@pytest.mark.parametrize("attention", ["xla", "einsum"])
def test_qkv_data_grads_reach_every_block_that_has_the_products(attention):
    """"chain" hands q, k and v's input through `linear.fan_out` in each block whose q, k,
    v are products of their own (every block on the padded path; the class-token block
    alone on the einsum path, whose other blocks make q, k, v in one product); "sum"
    through none."""
    x = jnp.zeros((2, TINY.image_size, TINY.image_size, 3))
    params = init_params(jax.random.key(0), TINY)

    def fan_outs(data_grads):
        execution = Execution(attention=attention, qkv_data_grads=data_grads)
        program = jax.make_jaxpr(lambda p: apply(p, x, TINY, execution=execution))(params)
        return str(program).count("name=fan_out")

    assert fan_outs("chain") == (TINY.depth if attention == "xla" else 1)
    assert fan_outs("sum") == 0


def test_unknown_forms_are_refused():
    with pytest.raises(ValueError, match="biases must be one of"):
        Execution(biases="inside")
    with pytest.raises(ValueError, match="fc1_output must be one of"):
        Execution(fc1_output="bf16")
    with pytest.raises(ValueError, match="qkv_data_grads must be one of"):
        Execution(qkv_data_grads="fused")


@pytest.mark.parametrize("mesh", ["data=2,model=4",
                                  pytest.param("data=8", marks=pytest.mark.exhaustive)])
def test_the_forms_under_shard_map_equal_one_device(mesh):
    """shard_map with FSDP, over data=2, model=4 (heads, MLP units and their biases
    split; the LayerNorms applied there) and over data=8: the "epilogue" biases and the
    folded LayerNorms give the ones column's and the applied LayerNorms' gradients and
    loss on one device."""
    cfg = PRESETS["tiny"].replace(name="tp-biases", width=40, heads=8, mlp_dim=56, depth=2)
    optimizer = optax.sgd(0.1)
    default = step.StepConfig(cfg, Policy(), execution=Execution(scan=True, layer_norm="apply"))
    sc = dataclasses.replace(default, execution=default.execution.replace(
        biases="epilogue", layer_norm="fold"))
    state = jax.device_get(step.init_state(jax.random.key(0), cfg, sc.policy, optimizer))
    images = jax.random.normal(jax.random.key(1), (8, cfg.image_size, cfg.image_size, 3))
    labels, ids, key = jnp.arange(8) % cfg.num_classes, jnp.arange(8), jax.random.key(2)
    ref, ref_metrics = jax.jit(lambda p: step.local_grads(
        default, p, LossScale.create(dynamic=False), images, labels, ids, key))(state["params"])

    strategy = ts.ShardMapStrategy(sc, optimizer, mesh, fsdp=True)
    args = (strategy.put_state(state), *strategy.put_batch(images, labels, ids),
            strategy.put_replicated(key))
    grads, metrics = grads_step(strategy).lower(*args).compile(FAST)(*args)
    grads = jax.device_get(grads)
    assert strategy.metrics_to_host(metrics)["loss"] == pytest.approx(
        float(ref_metrics["loss"]), rel=1e-6)
    _assert_close((0.0, ref), (0.0, grads), 1e-5)


@pytest.mark.parametrize("attention, last_block", [
    ("xla", "class-token"), pytest.param("einsum", "all", marks=pytest.mark.slow)])
def test_layer_norm_folded_into_the_matmuls_gives_the_same_loss_and_gradients(attention,
                                                                              last_block):
    """Execution.layer_norm "fold" (the default): the LayerNorms' scale and bias folded
    into q, k, v's and fc1's weights, against "apply", float32: the same loss and every
    gradient (the LayerNorms' scale
    and bias included), non-trivial scale and bias (a trained LayerNorm's are not 1, 0)."""
    cfg = TINY.replace(dropout=0.1, drop_path=0.1)
    base = Execution(attention=attention, last_block=last_block, layer_norm="apply")
    params = init_params(jax.random.key(0), cfg)
    for ln in ("ln1", "ln2"):  # a trained LayerNorm's scale and bias
        key = jax.random.key(7 + (ln == "ln2"))
        shape = params["blocks"][ln]["scale"].shape
        params["blocks"][ln] = {"scale": 1 + 0.3 * jax.random.normal(key, shape),
                                "bias": 0.2 * jax.random.normal(jax.random.fold_in(key, 1),
                                                                shape)}
    _assert_close(_loss_and_grads(cfg, base, params=params),
                  _loss_and_grads(cfg, base.replace(layer_norm="fold"), params=params), 1e-5)
