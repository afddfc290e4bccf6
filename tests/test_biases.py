"""The code forms of fc1's and the q, k, v projection's biases and of fc1's product
(`Execution.biases`, `Execution.fc1_output`) compute the shipped step's function: the
same loss and gradients in float32, under every attention path that runs on a CPU."""
import jax
import jax.numpy as jnp
import pytest

from vit_pure import PRESETS, Policy, apply, init_params
from vit_pure.config import Execution

TINY = PRESETS["tiny"]


def _loss_and_grads(cfg, execution, policy=Policy()):
    params = init_params(jax.random.key(0), cfg)
    images = jax.random.normal(jax.random.key(1), (4, cfg.image_size, cfg.image_size, 3))
    labels = jnp.arange(4) % cfg.num_classes

    def loss(p):
        logits = apply(p, images, cfg, policy, train=True, rng=jax.random.key(3),
                       example_ids=jnp.arange(4) + 5, execution=execution)
        logits = logits.astype(jnp.float32)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), labels])

    return jax.value_and_grad(loss)(params)


def _assert_close(reference, candidate, rel):
    (l_ref, g_ref), (l_new, g_new) = reference, candidate
    assert float(l_new) == pytest.approx(float(l_ref), rel=rel)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_ref),
                            jax.tree.leaves(g_new), strict=True):
        scale = float(jnp.abs(a).max())
        assert scale > 0, jax.tree_util.keystr(path)  # every parameter gets a gradient
        assert float(jnp.abs(a - b).max()) <= rel * scale, jax.tree_util.keystr(path)


@pytest.mark.parametrize("attention, last_block", [("einsum", "class-token"), ("xla", "all"),
                                                   ("xla", "class-token")])
@pytest.mark.parametrize("form", [{"biases": "epilogue"}, {"fc1_output": "float32"},
                                  {"biases": "epilogue", "fc1_output": "float32"}])
def test_bias_and_fc1_forms_give_the_same_loss_and_gradients(attention, last_block, form):
    """float32, dropout and stochastic depth on: loss and every gradient (the biases'
    included) within 1e-5 of the largest element of each, against the default forms."""
    cfg = TINY.replace(dropout=0.1, drop_path=0.1)
    base = Execution(attention=attention, last_block=last_block)
    _assert_close(_loss_and_grads(cfg, base), _loss_and_grads(cfg, base.replace(**form)), 1e-5)


@pytest.mark.parametrize("form", [{"biases": "epilogue"}, {"fc1_output": "float32"}])
def test_bias_and_fc1_forms_under_bf16_and_remat_gelu(form):
    """bf16 compute and matmul outputs, the GELU output recomputed (remat "gelu"), exact
    GELU: the same loss and gradients within bf16 rounding."""
    cfg = TINY.replace(gelu="exact")
    policy = Policy.parse("p=f32,c=bf16,o=f32,m=bf16")
    base = Execution(remat="gelu")
    _assert_close(_loss_and_grads(cfg, base, policy),
                  _loss_and_grads(cfg, base.replace(**form), policy), 5e-2)


def test_unknown_forms_are_refused():
    with pytest.raises(ValueError, match="biases must be one of"):
        Execution(biases="inside")
    with pytest.raises(ValueError, match="fc1_output must be one of"):
        Execution(fc1_output="bf16")
