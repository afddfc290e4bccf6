"""Layer scale (ViTConfig.layer_scale) and register tokens (ViTConfig.registers) give the
same training steps under tensor parallelism, FSDP and a pipeline as under data
parallelism, and each changes the function the model computes (the gains and registers
are read, not carried along unused)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layout_matrix import CFG, assert_matches, run

from vit_pure.model import apply, init_params, param_axes

# A start well away from 1 and from 0: a gain that was skipped, or applied twice, shows.
LS_CFG = CFG.replace(name="layer-scale-test", layer_scale=0.37)
REG_CFG = LS_CFG.replace(name="register-test", registers=3, pool="mean")


# pp+tp+fsdp splits the gains over all three axes at once; tp and fsdp alone are the
# wider sweep (`-m exhaustive`).
@pytest.mark.parametrize("layout", [pytest.param("tp", marks=pytest.mark.exhaustive),
                                    pytest.param("fsdp", marks=pytest.mark.exhaustive),
                                    "pp+tp+fsdp"])
def test_layer_scale_matches_data_parallel(layout):
    assert_matches(run("dp", "fp32", False, "none", LS_CFG),
                   run(layout, "fp32", False, "none", LS_CFG), "fp32", LS_CFG)


def test_registers_match_data_parallel_under_pipeline_tensor_and_fsdp():
    assert_matches(run("dp", "fp32", False, "none", REG_CFG),
                   run("pp+tp+fsdp", "fp32", False, "none", REG_CFG), "fp32", REG_CFG)


def test_layer_scale_gains_multiply_each_branch():
    """With every gain 1 the model is the plain one; doubling ls2 alone changes it."""
    params = init_params(jax.random.key(1), LS_CFG)
    assert params["blocks"]["ls1"]["gamma"].shape == (CFG.depth, CFG.width)
    assert jax.tree.structure(param_axes(LS_CFG), is_leaf=lambda x: isinstance(x, tuple)) \
        == jax.tree.structure(params)
    images = jax.random.normal(jax.random.key(2), (3, 32, 32, 3))
    plain = {k: v for k, v in params.items() if k != "blocks"}
    plain["blocks"] = {k: v for k, v in params["blocks"].items() if k not in ("ls1", "ls2")}
    ones = jax.tree.map(jnp.ones_like, {k: params["blocks"][k] for k in ("ls1", "ls2")})
    unit = {**params, "blocks": {**params["blocks"], **ones}}
    np.testing.assert_allclose(apply(unit, images, LS_CFG), apply(plain, images, CFG),
                               rtol=1e-6, atol=1e-6)
    scaled = jax.tree.map(lambda g: 2 * g, ones["ls2"])
    doubled = {**unit, "blocks": {**unit["blocks"], "ls2": scaled}}
    assert np.abs(apply(doubled, images, LS_CFG) - apply(unit, images, LS_CFG)).max() > 1e-3


def test_registers_sit_between_class_token_and_patches():
    """The registers are read by attention (changing them changes the class token's
    logits) and pos_embed keeps one row per patch and the class token."""
    params = init_params(jax.random.key(1), REG_CFG.replace(pool="cls"))
    assert params["pos_embed"].shape == (REG_CFG.num_patches + 1, CFG.width)
    assert REG_CFG.seq_len == REG_CFG.num_patches + 1 + 3
    images = jax.random.normal(jax.random.key(2), (2, 32, 32, 3))
    cfg = REG_CFG.replace(pool="cls")
    # Not a constant shift: each token's LayerNorm would remove it.
    moved = {**params, "reg_tokens": jax.random.normal(jax.random.key(3), (3, CFG.width))}
    logits = jax.jit(lambda p: apply(p, images, cfg))
    assert np.abs(np.asarray(logits(moved)) - np.asarray(logits(params))).max() > 1e-4
