"""The random bits the programs draw do not depend on a JAX setting a user may have.

`jax_threefry_partitionable` (JAX_THREEFRY_PARTITIONABLE) changes the bits jax.random
draws for an array; the last block on the class token alone computes the whole block's
loss only when an example's mask over its first row is the first row of its whole mask,
which the partitionable Threefry gives. The scripts' start-up (`cli.start_runtime`) turns
the setting on whatever it was: the class-token and every-row programs then agree, with
dropout and stochastic depth, under both mask kinds and both settings a user may start
from. Without it, the bernoulli masks of the two programs differ (the last test).
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest

from vit_pure.config import Execution, get_preset
from vit_pure.model import apply, init_params
from vit_pure.run import cli

CFG = get_preset("tiny").replace(dropout=0.3, drop_path=0.1, depth=1, image_size=16)
IMAGES = jax.random.uniform(jax.random.key(1), (4, 16, 16, 3))
LABELS = jnp.arange(4) % CFG.num_classes


@contextlib.contextmanager
def threefry_partitionable(on: bool):
    """The setting as a user's environment would leave it, put back afterwards."""
    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", on)
    try:
        yield
    finally:
        jax.config.update("jax_threefry_partitionable", before)


@functools.cache
def _compiled(last_block: str, masks: str):
    """One jitted function a program: jit's cache then keys each compile by the setting
    too, so a program is compiled once for each setting it runs under."""
    def loss(p, key):
        logits = apply(p, IMAGES, CFG, train=True, rng=key, example_ids=jnp.arange(4) + 5,
                       execution=Execution(last_block=last_block, dropout_masks=masks))
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), LABELS])
    return jax.jit(jax.value_and_grad(loss))


@functools.cache
def _params():
    return init_params(jax.random.key(0), CFG)  # once: the same weights under each setting


def loss_and_grads(last_block: str, masks: str):
    # The key is made here, under the setting in force (a key's bits do not depend on it).
    return _compiled(last_block, masks)(_params(), jax.random.key(3))


def assert_agree(masks: str):
    (l_all, g_all), (l_cls, g_cls) = (loss_and_grads(b, masks) for b in ("all", "class-token"))
    assert float(l_cls) == pytest.approx(float(l_all), rel=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_all))
    for a, b in zip(jax.tree.leaves(g_all), jax.tree.leaves(g_cls), strict=True):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * scale


@pytest.mark.parametrize("masks", ["bernoulli", "threefry16"])
@pytest.mark.parametrize("user_setting", [True, False], ids=["partitionable", "not"])
def test_start_up_pins_the_setting_and_the_programs_agree(user_setting, masks, capsys):
    args = cli.parse_args(cli.build_parser("test"), ["--model", "tiny"])
    with threefry_partitionable(user_setting):
        cli.start_runtime(args)
        assert jax.config.jax_threefry_partitionable
        err = capsys.readouterr().err
        assert ("jax_threefry_partitionable was off" in err) == (not user_setting), err
        assert_agree(masks)


def test_without_the_setting_the_bernoulli_masks_differ():
    """Why the start-up sets it: left off, the class-token program's masks are not the
    first rows of the whole block's, and its loss moves."""
    with threefry_partitionable(False):
        (l_all, _), (l_cls, _) = (loss_and_grads(b, "bernoulli") for b in ("all", "class-token"))
    assert abs(float(l_cls) - float(l_all)) > 1e-4 * abs(float(l_all))
