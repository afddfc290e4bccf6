"""zb-h1's split of a stage's backward pass (vit_pure/pipeline/split.py): I and W together
give exactly the gradients of one `jax.vjp`, and W runs the weight matmuls' gradients
only, not the cotangent chain again (its compiled FLOPs, counted by XLA, far below B's).

The program's equality with the single-device reference is tests/test_pipeline_schedules.py's.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.pipeline_schedules import stage_costs
from vit_pure import PRESETS, Policy, model
from vit_pure.config import Execution
from vit_pure.pipeline.split import Split

CFG = PRESETS["tiny"]


def _stage(policy):
    blocks = policy.cast_to_compute(model.init_params(jax.random.key(0), CFG)["blocks"])
    x = jax.random.normal(jax.random.key(1), (3, CFG.seq_len, CFG.width))
    return blocks, x.astype(policy.compute_dtype)


@pytest.mark.parametrize("policy, layer_norm", [
    ("fp32", "apply"), ("bf16", "apply"),  # bf16: the policy's custom-VJP matmul
    ("fp32", "fold")])
def test_i_and_w_give_the_gradients_of_one_vjp(policy, layer_norm):
    policy = Policy.parse(policy)
    blocks, x = _stage(policy)
    execution = Execution(layer_norm=layer_norm)

    def fn(p, x, offset):  # a stage's blocks, then a scalar (as the last stage's loss)
        y = model.encoder(p, x, CFG, policy, execution=execution, layer_offset=offset)
        return y, jnp.sum(jnp.square(y.astype(jnp.float32)))

    offset = jnp.int32(2)
    split = Split(fn, blocks, x, offset)
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(blocks)[0]]
    weights = {n for n, w in zip(names, split.weight_mask) if w}
    # The matmul kernels W takes (all four: under remat "gelu" fc2's would sit inside the
    # GELU's recompute, a jax.checkpoint bound whole, and stay in I), the biases those
    # matmuls add themselves (q, k, v's and fc1's, a row of the weight-gradient product:
    # layers.linear.dense), and with Execution.layer_norm "fold" the LayerNorms' scales
    # and biases, folded into those matmuls' weights (layers.norm.fold_affine); the other
    # biases stay in I.
    folded = {"['ln1']['bias']", "['ln1']['scale']", "['ln2']['bias']", "['ln2']['scale']"}
    if layer_norm == "apply":
        folded = set()
    assert {"['attn']['qkv']['kernel']", "['attn']['out']['kernel']",
            "['mlp']['fc1']['kernel']", "['mlp']['fc2']['kernel']"} <= weights
    assert {n for n in weights if "bias" in n} == {"['attn']['qkv']['bias']",
                                                   "['mlp']['fc1']['bias']"} | {
        n for n in folded if "bias" in n}
    assert {n for n in weights if "ln" in n} == folded

    @jax.jit  # one compile: faster here than running the interpreter op by op
    def both(blocks, x, offset):
        out, pull = jax.vjp(fn, blocks, x, offset)
        cot = (jnp.cos(out[0]), jnp.float32(0.5))
        want_p, want_x, _ = pull(cot)
        got_out, pull_i, acts = split.forward(blocks, x, offset)
        g_cheap, dx, dys = split.input_grads(pull_i(cot))
        g_weights = split.weight_grads(blocks, acts, dys, offset)
        assert len(acts) == len(dys) == len(split.matmuls) == 4 * CFG.depth
        return out, want_p, want_x, got_out, g_cheap, dx, g_weights

    out, want_p, want_x, got_out, g_cheap, dx, g_weights = both(blocks, x, offset)

    def f32(a):
        return np.asarray(a, np.float32)
    np.testing.assert_array_equal(f32(got_out[0]), f32(out[0]))
    np.testing.assert_allclose(f32(dx), f32(want_x), rtol=1e-5, atol=1e-6)
    for name, c, w, want in zip(names, jax.tree.leaves(g_cheap, is_leaf=lambda a: a is None),
                                jax.tree.leaves(g_weights, is_leaf=lambda a: a is None),
                                jax.tree.leaves(want_p)):
        assert (c is None) != (w is None), name  # each gradient from exactly one of I, W
        got = c if w is None else w
        np.testing.assert_allclose(f32(got), f32(want), rtol=1e-5, atol=1e-6, err_msg=name)


def test_w_costs_the_weight_matmuls_only():
    """The benchmark's costs of a tiny stage (XLA:CPU cost_analysis, bf16: the custom-VJP
    matmul): W far below B (re-running the chain would make it about B) and I + W = B."""
    c = stage_costs("tiny", 2, 2, "bf16", hardware="cpu")
    assert c["W"] <= 0.6 * c["B"]
    assert c["I"] + c["W"] == pytest.approx(c["B"], rel=0.05)
    assert c["I"] < c["B"]


def test_shared_operands_and_weights_used_otherwise():
    """Two weight matmuls of one activation keep it once; a parameter that also reaches the
    output another way is no weight (its matmul stays in I); the gradients still add up."""
    keys = jax.random.split(jax.random.key(2), 5)
    p = {"q": jax.random.normal(keys[0], (5, 3)), "k": jax.random.normal(keys[1], (5, 3)),
         "tied": jax.random.normal(keys[2], (3, 4)), "scale": jnp.float32(1.5)}
    x = jax.random.normal(keys[3], (2, 5))

    def fn(p, x):
        h = jnp.tanh(x @ p["q"] + x @ p["k"].astype(jnp.bfloat16).astype(jnp.float32))
        y = (h @ p["tied"]) * p["scale"]
        return jnp.sum(y * jnp.sum(p["tied"]))  # "tied" reaches the loss outside a matmul

    split = Split(fn, p, x)
    assert dict(zip(sorted(p), split.weight_mask)) == {"k": True, "q": True, "scale": False,
                                                        "tied": False}
    assert len(split.matmuls) == 2 and len(split.act_keys) == 1
    _, pull = jax.vjp(fn, p, x)
    want_p, want_x = pull(jnp.float32(1.0))
    _, pull_i, acts = split.forward(p, x)
    g_cheap, dx, dys = split.input_grads(pull_i(jnp.float32(1.0)))
    g_weights = split.weight_grads(p, acts, dys)
    np.testing.assert_allclose(dx, want_x, rtol=1e-5)
    for name in p:
        got = g_weights[name] if split.weight_mask[sorted(p).index(name)] else g_cheap[name]
        np.testing.assert_allclose(got, want_p[name], rtol=1e-5, err_msg=name)
