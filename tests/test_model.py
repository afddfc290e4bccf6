"""The pure-pytree ViT: parameter count, shapes, dtypes, randomness, scan, gradients."""
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend.random import threefry2x32_p

import train_shardmap
from vit_pure import (
    PRESETS,
    Policy,
    apply,
    config,
    count_params,
    init_params,
    model,
    param_axes,
    step,
)
from vit_pure.config import DROPOUT_MASKS, Execution, ViTConfig
from vit_pure.layers import dropout, norm
from vit_pure.run import cli, settings
from vit_pure.tools.params_table import format_param_table

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(jax.random.key(0), TINY)


def _images(n, cfg=TINY, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, cfg.image_size, cfg.image_size, 3))


# `apply` compiled whole: one program a configuration instead of an XLA compile for each
# operation of an eager call. The configuration, policy, mode and execution are static.
_apply = jax.jit(apply, static_argnames=("cfg", "policy", "train", "execution"))


def test_vit_cifar_matches_reference_model():
    cfg = PRESETS["vit-cifar"]
    assert (cfg.image_size, cfg.patch_size, cfg.num_classes, cfg.width, cfg.depth, cfg.heads,
            cfg.mlp_dim, cfg.dropout, cfg.ln_eps) == (32, 4, 10, 384, 6, 8, 1536, 0.1, 1e-6)
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    assert count_params(shapes) == 10_695_562


def test_param_axes_cover_every_param_with_matching_rank(tiny_params):
    axes = param_axes(TINY)
    assert jax.tree.structure(tiny_params) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_p = jax.tree.leaves(tiny_params)
    flat_a = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    for p, a in zip(flat_p, flat_a):
        assert p.ndim == len(a), (p.shape, a)
    assert axes["blocks"]["mlp"]["fc1"]["kernel"] == ("layers", "embed", "mlp")


def test_init_statistics(tiny_params):
    cfg = PRESETS["vit-cifar"]
    params = init_params(jax.random.key(1), cfg)
    w = np.asarray(params["blocks"]["mlp"]["fc1"]["kernel"])
    assert abs(w.std() - 0.02) < 0.001 and np.abs(w).max() <= 2 * 0.02 / 0.87962566 + 1e-6
    assert not np.any(params["cls_token"]) and not np.any(params["blocks"]["attn"]["qkv"]["bias"])
    assert np.all(params["blocks"]["ln1"]["scale"] == 1)


@pytest.mark.parametrize("policy, out_dtype", [
    ("fp32", jnp.float32), ("bf16", jnp.float32), ("fp16", jnp.float32),
    ("p=bf16,c=bf16,o=bf16", jnp.bfloat16), ("p=f16,c=f16,o=f32", jnp.float32),
])
def test_output_shape_and_dtype_under_each_policy(tiny_params, policy, out_dtype):
    pol = Policy.parse(policy)
    params = pol.cast_to_param(tiny_params)
    logits = apply(params, _images(3), TINY, pol, train=True, rng=jax.random.key(2))
    assert logits.shape == (3, TINY.num_classes) and logits.dtype == out_dtype
    ref = apply(tiny_params, _images(3), TINY, train=True, rng=jax.random.key(2))
    # Low precision changes the numbers a little, not a lot.
    np.testing.assert_allclose(np.asarray(logits, np.float32), ref, atol=0.05)


@pytest.mark.parametrize("policy, result", [("bf16", "f32"), ("p=f32,c=bf16,o=f32,m=bf16", "bf16"),
                                            ("fp32", "f32")])
def test_policy_decides_every_dot_of_the_training_step(tiny_params, policy, result):
    """Every dot of a training step (forward, both backward matmuls, attention einsums)
    takes compute-dtype operands and returns the policy's matmul dtype: f32 under
    m=f32 (the backward pass through the custom VJP), bf16 under m=bf16."""
    pol = Policy.parse(policy)
    operand = "bf16" if pol.compute_dtype == jnp.bfloat16 else "f32"

    def dots_of(execution):
        def loss(p, x):
            return jnp.mean(apply(p, x, TINY, pol, train=True, rng=jax.random.key(0),
                                  execution=execution) ** 2)

        # The lowered program: what the step asks XLA for. (XLA:CPU then rewrites bf16
        # dots it has no kernel for; on a GPU the compiled dots keep these types.)
        text = jax.jit(jax.grad(loss)).lower(tiny_params, _images(2)).as_text()
        return re.findall(r"stablehlo\.dot_general .*?: \((.*?)\) -> tensor<(.*?)>", text)

    every, shipped = dots_of(Execution(last_block="all")), dots_of(Execution())
    # 6 per layer, x3 with the backward pass; the head 3, the patch embedding 2 (no
    # gradient w.r.t. the images). The class token's last block has more, smaller dots.
    assert len(every) == 3 * 6 * TINY.depth + 3 + 2 < len(shipped)
    for operands, out in every + shipped:
        assert out.endswith("x" + result), (operands, out)
        assert [t.rsplit("x", 1)[1] for t in re.findall(r"tensor<(.*?)>", operands)] == \
            [operand, operand], (operands, out)


def test_no_gradient_is_summed_in_bf16(tiny_params):
    """Under bf16 matmul outputs (m=bf16, the GPU default) the bias gradients, sums over
    every token of a bf16 gradient, add up in float32 (`layers.linear._add_bias`): no sum of the
    training step's gradient runs in bf16. (Autodiff of a plain bias add sums in bf16:
    24 such sums in this model before `_add_bias`.)"""
    pol = Policy.parse("p=f32,c=bf16,o=f32,m=bf16")

    def loss(p, x):
        return jnp.mean(apply(p, x, TINY, pol, train=True, rng=jax.random.key(0)) ** 2)

    text = jax.jit(jax.grad(loss)).lower(tiny_params, _images(2)).as_text()
    sums = re.findall(r"stablehlo\.reduce\(.*?applies stablehlo\.add .*?: \(tensor<(.*?)>",
                      text)
    assert len(sums) > 4 * TINY.depth  # the bias and LayerNorm gradients at least
    assert [t for t in sums if t.endswith("bf16")] == []


def test_layer_norm_statistics_from_one_read_match_two_reads():
    """The GPU's LayerNorm statistics (`norm._welford`, one reduction of (count, mean, M2)
    triples) against the two passes every other backend runs, in float32: rows of unit
    scale, and rows whose mean is 10^3 and 10^4 times their std, where the mean of
    squares less the squared mean would lose every digit of the variance."""
    rng = np.random.default_rng(0)
    for mean, std, rtol in ((0.0, 1.0, 1e-5), (1e3, 1.0, 1e-3), (-3e4, 3.0, 1e-3)):
        x = jnp.asarray(mean + std * rng.standard_normal((32, 384)), jnp.float32)
        m_ref, v_ref = norm._two_pass(x)
        m, v = jax.jit(norm._welford)(x)
        np.testing.assert_allclose(m, m_ref, rtol=1e-6, atol=1e-5 * std)  # float32 ulps
        np.testing.assert_allclose(v, v_ref, rtol=rtol)


def test_dropout_and_drop_path_off_at_eval_on_in_training(tiny_params):
    x = _images(4)
    eval_a = _apply(tiny_params, x, TINY, train=False, rng=jax.random.key(0))
    eval_b = _apply(tiny_params, x, TINY, train=False, rng=jax.random.key(1))
    np.testing.assert_array_equal(eval_a, eval_b)
    np.testing.assert_array_equal(eval_a, _apply(tiny_params, x, TINY))
    train_a = _apply(tiny_params, x, TINY, train=True, rng=jax.random.key(0))
    train_b = _apply(tiny_params, x, TINY, train=True, rng=jax.random.key(1))
    assert np.abs(train_a - eval_a).max() > 1e-3 and np.abs(train_a - train_b).max() > 1e-3
    with pytest.raises(ValueError, match="rng"):
        apply(tiny_params, x, TINY, train=True)


def test_scan_equals_unrolled(tiny_params):
    x = _images(4)
    kw = dict(train=True, rng=jax.random.key(5))
    loop = jax.jit(lambda p: apply(p, x, TINY, **kw))(tiny_params)
    scan = jax.jit(lambda p: apply(p, x, TINY, execution=Execution(scan=True), **kw))(tiny_params)
    np.testing.assert_allclose(scan, loop, rtol=1e-6, atol=1e-6)
    remat = jax.jit(lambda p: apply(p, x, TINY, execution=Execution(scan=True, remat="block"),
                                    **kw))(tiny_params)
    np.testing.assert_allclose(remat, loop, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("masks", DROPOUT_MASKS)
def test_same_logits_for_one_batch_of_8_and_two_batches_of_4(tiny_params, masks):
    x, rng = _images(8), jax.random.key(7)
    execution = Execution(dropout_masks=masks)
    whole = apply(tiny_params, x, TINY, train=True, rng=rng, execution=execution)
    halves = [apply(tiny_params, x[i:i + 4], TINY, train=True, rng=rng,
                    example_ids=jnp.arange(i, i + 4), execution=execution) for i in (0, 4)]
    np.testing.assert_array_equal(np.concatenate(halves), whole)
    # ...and the masks really are per example: shifting the ids changes the result.
    shifted = apply(tiny_params, x[:4], TINY, train=True, rng=rng, example_ids=jnp.arange(4, 8),
                    execution=execution)
    assert np.abs(shifted - whole[:4]).max() > 1e-3


def test_dropout_masks_flag_reaches_the_step():
    parser = cli.build_parser("test")
    for argv, platform, expected in [
            ([], "cpu", "bernoulli"), ([], "gpu", "threefry16"),  # the backend's defaults
            (["--dropout-masks", "threefry16"], "cpu", "threefry16"),
            (["--dropout-masks", "bernoulli"], "gpu", "bernoulli")]:
        args = cli.parse_args(parser, ["--model", "tiny", *argv])
        sc = settings.step_config(args, platform=platform)
        assert sc.execution.dropout_masks == expected
        assert any(n.startswith("dropout masks: threefry16") for n in sc.notes) == (
            not argv and platform == "gpu")
    assert step.StepConfig(TINY, Policy()).execution.dropout_masks == "bernoulli"


def test_pool_flag_replaces_the_presets_pool():
    parser = cli.build_parser("test")
    for argv, expected in [([], "cls"), (["--pool", "gap"], "gap"), (["--pool", "mean"], "mean")]:
        cfg = settings.step_config(cli.parse_args(parser, ["--model", "vit-cifar", *argv]),
                                        platform="cpu").cfg
        assert cfg.pool == expected and cfg.seq_len == (64 if expected == "gap" else 65)


@pytest.mark.parametrize("masks", DROPOUT_MASKS)
def test_dropout_masks_keep_the_rate_and_the_mean(masks):
    """Each way of drawing masks keeps 1 - rate of the elements, independently: the
    kept fraction, the fraction of adjacent pairs both dropped (threefry16 cuts each
    32-bit word into two neighbours), and the mean of the output (kept values scaled by
    1 / the keep probability) all within 5 standard errors, over 64 examples of 65 x 97
    elements (an odd count, so the last word is cut short)."""
    rate, shape = 0.1, (65, 97)
    keys = dropout.example_keys(jax.random.key(3), jnp.arange(64))
    keep = np.asarray(jax.vmap(lambda k: dropout.keep_mask(k, shape, rate, masks))(keys))
    n = keep.size
    assert abs(keep.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n)
    flat = keep.reshape(64, -1)[:, :-1].reshape(-1, 2)
    both = (~flat).all(axis=1).mean()
    assert abs(both - rate ** 2) < 5 * np.sqrt(rate ** 2 / len(flat))
    x = jnp.full((64, *shape), 1.0)
    out = dropout.dropout(x, rate, keys, 1, model._SITE_ATTN, masks)
    assert abs(float(out.mean()) - 1.0) < 5 * np.sqrt(rate / (1 - rate) / n)
    # Examples and sites draw different masks.
    assert (keep[0] != keep[1]).mean() > 0.1
    other = dropout.dropout(x, rate, keys, 1, model._SITE_MLP, masks)
    assert float(jnp.mean((out == 0) != (other == 0))) > 0.1


@pytest.mark.parametrize("masks", DROPOUT_MASKS)
def test_masks_on_token_rows_belong_to_their_example(masks):
    """Inside the encoder the stream is (B*T, E), one row per token: dropout draws the
    same mask there as on (B, T, E), and stochastic depth keeps or drops all T rows of an
    example together, scaled by 1 / (1 - rate), with each example's choice its own (the
    same whether its batch neighbours are there or not)."""
    B, T, E, rate = 6, 5, 4, 0.5
    keys = dropout.example_keys(jax.random.key(1), jnp.arange(B))
    x = jax.random.normal(jax.random.key(2), (B, T, E))
    rows = dropout.dropout(x.reshape(B * T, E), 0.3, keys, 2, model._SITE_MLP, masks)
    np.testing.assert_array_equal(rows, dropout.dropout(x, 0.3, keys, 2, model._SITE_MLP,
                                                       masks).reshape(B * T, E))
    paths = dropout.drop_path(jnp.ones((B * T, E)), rate, keys, 3, model._SITE_PATH_MLP)
    per_example = np.asarray(paths).reshape(B, T * E)
    assert set(np.unique(per_example)) <= {0.0, 1.0 / (1 - rate)}
    assert (per_example == per_example[:, :1]).all()  # all rows of an example alike
    assert 0 < (per_example[:, 0] == 0).sum() < B  # some examples dropped, some kept
    alone = dropout.drop_path(jnp.ones((T, E)), rate, keys[2:3], 3, model._SITE_PATH_MLP)
    np.testing.assert_array_equal(alone, paths[2 * T:3 * T])


def test_packed_masks_are_the_masks_and_dropout_reads_them_as_autodiff_would(
        tiny_params, capsys):
    """`dropout.pack` keeps element i of a row in bit i % 8 of byte i // 8 and `unpack`
    undoes it; `apply_mask` on the packed mask or on the bools gives, in both passes,
    bitwise what autodiff of the plain `where` gives; and the model keeps its dropout
    masks for the backward pass packed (uint8, E / 8 bytes a token), not as bools, unless
    `Execution.packed_masks` is off (as on a CPU, the default)."""
    keep = jax.random.bernoulli(jax.random.key(0), 0.7, (6, 5, 24))
    packed = dropout.pack(keep)
    assert packed.dtype == jnp.uint8 and packed.shape == (6, 5, 3)
    np.testing.assert_array_equal(dropout.unpack(packed), keep)
    assert dropout.pack(jnp.arange(16) == 10).tolist() == [0, 4]
    x = jax.random.normal(jax.random.key(1), keep.shape, jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), keep.shape, jnp.bfloat16)
    p = dropout.keep_probability(0.1, "threefry16")
    y_ref, vjp_ref = jax.vjp(lambda x: jnp.where(keep, x / p, 0).astype(x.dtype), x)
    for mask in (packed, keep):
        y, vjp = jax.vjp(lambda x: dropout.apply_mask(x, mask, p), x)
        np.testing.assert_array_equal(y, y_ref)
        np.testing.assert_array_equal(vjp(dy)[0], vjp_ref(dy)[0])

    # Drawn packed (`keep_bytes`) or as bools (`keep_mask`), the model's masks are the
    # same, for both methods; threefry16's byte j holds the halves of hashes (j, 0), (j, 1).
    keys = dropout.example_keys(jax.random.key(5), jnp.arange(3))
    rows = jax.random.normal(jax.random.key(6), (3 * 5, 16))
    for masks in DROPOUT_MASKS:
        np.testing.assert_array_equal(
            dropout.dropout(rows, 0.3, keys, 2, model._SITE_MLP, masks, packed=True),
            dropout.dropout(rows, 0.3, keys, 2, model._SITE_MLP, masks, packed=False))
    k1, k2 = (k.reshape(1) for k in jax.random.key_data(keys[0]))
    w1, w2 = threefry2x32_p.bind(k1, k2, jnp.array([7], jnp.uint32), jnp.array([1], jnp.uint32))
    halves = np.array([w1[0] & 0xFFFF, w1[0] >> 16, w2[0] & 0xFFFF, w2[0] >> 16])
    bits = dropout.unpack(dropout.keep_bytes(keys[0], 8, 0.3, "threefry16"))[8 * 7 + 4:8 * 8]
    np.testing.assert_array_equal(bits, halves < round(0.7 * 65536))

    x = jax.random.normal(jax.random.key(3), (2, 32, 32, 3))

    def saved_masks(execution):
        """The types of the masks a training step's backward pass keeps."""
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(
            lambda p: jnp.sum(apply(p, x, TINY, train=True, rng=jax.random.key(4),
                                    execution=execution)), tiny_params)
        return sorted(line.split()[0] for line in capsys.readouterr().out.splitlines()
                      if "named 'mask'" in line)

    T, E = TINY.seq_len, TINY.width
    every = Execution(last_block="all")  # every block's masks of the same shape
    assert saved_masks(every.replace(packed_masks=True)) == sorted(
        [f"u8[2,{T},{E // 8}]"] + [f"u8[{2 * T},{E // 8}]"] * (2 * TINY.depth))  # embedding's
    # What a CPU runs (Execution's default; vit_pure/run/backend.py):
    assert saved_masks(every) == sorted(
        [f"bool[2,{T},{E}]"] + [f"bool[{2 * T},{E}]"] * (2 * TINY.depth))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pmap", "pp+tp+fsdp"])
def test_threefry16_masks_match_data_parallel_under_other_strategies(layout):
    """--dropout-masks threefry16 reaches every strategy's step: two training steps under
    pmap and under pipeline x tensor x FSDP match data parallel with the same masks,
    within the layout matrix's tolerances (a strategy that drew bernoulli masks instead
    would be far outside them)."""
    import test_layout_matrix as matrix
    ref = matrix.run("dp", "fp32", False, "none", dropout_masks="threefry16")
    matrix.assert_matches(ref, matrix.run(layout, "fp32", False, "none",
                                          dropout_masks="threefry16"), "fp32")
    other = matrix.run("dp", "fp32", False, "none", dropout_masks="bernoulli")
    assert other["metrics"][0]["loss"] != ref["metrics"][0]["loss"]


def _saved_names(params, remat, capsys) -> collections.Counter:
    """How many residuals of each checkpoint name the tiny model's gradient keeps."""
    x, rng = _images(2), jax.random.key(7)
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(
        lambda p: jnp.sum(apply(p, x, TINY, train=True, rng=rng,
                                           execution=Execution(remat=remat))), params)
    return collections.Counter(re.findall(r"named '(\w+)'", capsys.readouterr().out))


@pytest.mark.parametrize("remat, names", [
    ("block-save-dots", {"dot"}), ("block-save:dot", {"dot"}),
    ("block-save:ln+gelu", {"ln", "gelu"}), ("block-save:mask", {"mask"}),
    ("block-save:dot+ln+gelu+mask", {"dot", "ln", "gelu", "mask"})])
def test_remat_keeps_the_named_values_and_only_those(tiny_params, capsys, remat, names):
    """Against remat "block" (nothing kept inside a block; the embedding's dropout mask,
    outside the blocks, is kept either way), each mode keeps more of exactly its names:
    per block two LayerNorm outputs, one GELU output, four masks (dropout and drop path
    after attention and after the MLP), and the matmul / attention products."""
    base = _saved_names(tiny_params, "block", capsys)
    got = _saved_names(tiny_params, remat, capsys)
    assert {n for n in got if got[n] > base[n]} == names, (got, base)
    per_block = {"ln": 2, "gelu": 1, "mask": 4}
    for name in names - {"dot"}:
        assert got[name] - base[name] == per_block[name] * TINY.depth, (name, got, base)


def test_remat_gelu_recomputes_the_gelu_output_and_none_keeps_it(tiny_params, capsys):
    """remat "none" keeps every activation, the GELU's output of each block too; "gelu"
    keeps all of them but that one, recomputed in the backward pass."""
    none = _saved_names(tiny_params, "none", capsys)
    gelu = _saved_names(tiny_params, "gelu", capsys)
    assert none["gelu"] == TINY.depth and gelu["gelu"] == 0
    assert none - collections.Counter(gelu=TINY.depth) == gelu


@pytest.mark.parametrize("bad", ["blocks", "block-save:", "block-save:dot+foo",
                                 "block-save:dot+dot", "block-save:dot,ln"])
def test_remat_mode_errors(bad):
    with pytest.raises(ValueError, match="remat must be one of"):
        apply(init_params(jax.random.key(0), TINY), _images(1), TINY,
              execution=Execution(remat=bad))


def test_dropout_masks_benchmark_sees_which_prngs_keep_the_per_example_rule(capsys):
    """benchmarks/probes/dropout_masks.py: Threefry (the kit's) gives each example its own mask
    on any batch split and runs inside shard_map; RBG's vmap draws the whole batch from
    the first key, which the check must catch."""
    from benchmarks.probes import dropout_masks
    rows = {(r["masks"], r["impl"]): r for r in dropout_masks.main(
        ["--model", "tiny", "--batch", "4", "--steps", "1", "--impls", "threefry2x32,rbg"])}
    for kit in [("threefry16", "threefry2x32"), ("bernoulli", "threefry2x32")]:
        assert rows[kit]["per_example"] and rows[kit]["shard_map"] == "yes"
    assert not rows[("bernoulli", "rbg")]["per_example"]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows.values())
    assert "| threefry16 | threefry2x32 | yes | yes |" in capsys.readouterr().out


def test_gradients_match_finite_differences():
    # float32 throughout (the model keeps LayerNorm statistics and accumulations in float32
    # by design), so central differences with a moderate step: the truncation error is
    # O(eps^2) ~ 1e-6 and the rounding error ~ 1e-7 / eps ~ 1e-4 relative.
    cfg = ViTConfig(name="fd", image_size=8, patch_size=4, num_classes=3, width=12, depth=2,
                    heads=3, mlp_dim=10)
    params = init_params(jax.random.key(0), cfg)
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(9), a.shape),
                          params)
    x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
    labels = jnp.array([0, 2])

    @jax.jit
    def loss(p):
        logits = apply(p, x, cfg)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    def loss_at(p, d, step):
        return loss(jax.tree.map(lambda a, b: a + step * b, p, d))

    groups = ["cls_token", "pos_embed", "patch_embed", "blocks", "final_ln", "head"]

    @jax.jit
    def numeric_and_analytic(p, eps):
        # A random direction in one group of parameters at a time, so that a wrong gradient
        # of one small parameter cannot hide behind the others; all groups in one program.
        dirs = []
        for i, name in enumerate(groups):
            d = jax.tree.map(jnp.zeros_like, p)
            d[name] = jax.tree.map(lambda a: jax.random.normal(jax.random.key(i), a.shape),
                                   p[name])
            dirs.append(d)
        d = jax.tree.map(lambda *xs: jnp.stack(xs), *dirs)  # a leading axis: one per group
        along = jax.vmap(loss_at, in_axes=(None, 0, None))
        numeric = (along(p, d, eps) - along(p, d, -eps)) / (2 * eps)
        grads = jax.grad(loss)(p)
        analytic = sum(jnp.tensordot(v, g, axes=g.ndim)
                       for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(d)))
        return numeric, analytic

    numeric, analytic = numeric_and_analytic(params, 1e-3)
    for name, n, a in zip(groups, numeric, analytic, strict=True):
        assert abs(n) > 1e-3, name  # the direction really moves the loss
        np.testing.assert_allclose(a, n, rtol=2e-3, err_msg=name)


def test_param_table_totals():
    cfg = PRESETS["vit-cifar"]
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    table = format_param_table(shapes)
    assert "10,695,562 params" in table and "42,782,248" in table  # 4 bytes each
    bf16 = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), shapes)
    assert "21,391,124" in format_param_table(bf16)


# The convolutional stem (ViTConfig.stem): 32x32 -> 16x16x8 -> 8x8x12 ahead of 4x4
# patches of the stem's output (8-pixel patches of the image) -> 4 patches of 4*4*12.
STEM = TINY.replace(name="tiny-stem", stem=(8, 12), patch_size=16)


def test_stem_layer_is_a_3x3_stride_2_convolution():
    """model._conv3x3_stride2 (nine taps through the policy's matmul) equals XLA's own
    convolution with padding 1, then the bias and GELU."""
    from jax import lax

    from vit_pure.model import _conv3x3_stride2

    params = init_params(jax.random.key(3), STEM)["stem"]["conv1"]
    x = jax.random.normal(jax.random.key(4), (2, 16, 16, 8))
    want = lax.conv_general_dilated(x, params["kernel"], (2, 2), ((1, 1), (1, 1)),
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    precision=lax.Precision.HIGHEST)
    want = jax.nn.gelu(want + params["bias"])
    got = _conv3x3_stride2(x, params, Policy(matmul_precision="highest"))
    assert got.shape == (2, 8, 8, 12)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_stem_shapes_axes_and_the_rest_of_the_model_unchanged():
    """A stem adds its own params (fan-in scaled) and changes only the patch embedding's
    input size; every other param is drawn exactly as without the stem."""
    params = init_params(jax.random.key(0), STEM)
    plain = init_params(jax.random.key(0), STEM.replace(stem=(), patch_size=16))
    assert STEM.num_patches == 4 and STEM.patch_dim == 4 * 4 * 12
    assert params["stem"]["conv0"]["kernel"].shape == (3, 3, 3, 8)
    assert params["patch_embed"]["kernel"].shape == (192, TINY.width)
    std = float(np.std(np.asarray(params["stem"]["conv1"]["kernel"])))
    assert std == pytest.approx((2 / (9 * 8)) ** 0.5, rel=0.15)
    for name in ("pos_embed", "cls_token", "blocks", "head"):
        for a, b in zip(jax.tree.leaves(params[name]), jax.tree.leaves(plain[name])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    axes = param_axes(STEM)
    assert jax.tree.structure(params) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, tuple))
    logits = _apply(params, _images(3, STEM), STEM)
    assert logits.shape == (3, 10) and bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("bad", [dict(stem=(8,), patch_size=1, image_size=32),
                                 dict(stem=(8, 0))])
def test_stem_config_errors(bad):
    with pytest.raises(ValueError, match="stem"):
        TINY.replace(**bad)


@pytest.mark.parametrize("pool, first", [("mean", 1), ("gap", 0)])
def test_pooled_head_reads_the_mean_of_the_patch_tokens(pool, first):
    """pool "mean" and "gap": the head's LayerNorm and projection see the mean of the patch
    tokens (not the class token; under "gap" there is none, so every token), computed here
    by hand from the encoder's output."""
    from vit_pure import model

    cfg = TINY.replace(pool=pool)
    params = init_params(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(2), (3, cfg.seq_len, cfg.width))
    assert x.shape[1] == cfg.num_patches + first
    feature = x[:, first:].mean(axis=1)
    mean = feature.mean(-1, keepdims=True)
    normed = (feature - mean) / jnp.sqrt(((feature - mean) ** 2).mean(-1, keepdims=True)
                                         + cfg.ln_eps)
    normed = normed * params["final_ln"]["scale"] + params["final_ln"]["bias"]
    want = normed @ params["head"]["kernel"] + params["head"]["bias"]
    got = model.head(params, x, cfg, Policy(matmul_precision="highest"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    cls_logits = model.head(params, x, TINY, Policy(matmul_precision="highest"))
    assert np.abs(np.asarray(cls_logits) - np.asarray(got)).max() > 1e-3
    with pytest.raises(ValueError, match="pool"):
        TINY.replace(pool="max")


def test_gap_pool_has_no_class_token_and_draws_the_rest_as_before(tiny_params):
    """pool "gap": no cls_token parameter and one position fewer (vit-cifar: 64 tokens,
    10,695,562 - 2 x 384 parameters); every other param is drawn exactly as with the class
    token, the axes cover the new tree, and the embedding is the patch embedding plus the
    position embedding, with nothing in front."""
    cfg = PRESETS["vit-cifar"].replace(pool="gap")
    assert cfg.seq_len == 64 and not cfg.class_token and PRESETS["vit-cifar"].seq_len == 65
    assert count_params(jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))) == (
        10_695_562 - 2 * 384)
    gap = TINY.replace(pool="gap")
    params = init_params(jax.random.key(0), gap)
    assert "cls_token" not in params and params["pos_embed"].shape == (16, TINY.width)
    assert jax.tree.structure(params) == jax.tree.structure(
        param_axes(gap), is_leaf=lambda x: isinstance(x, tuple))
    for name in ("patch_embed", "blocks", "final_ln", "head"):
        for a, b in zip(jax.tree.leaves(params[name]), jax.tree.leaves(tiny_params[name]),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    images = _images(2, gap)
    policy = Policy(matmul_precision="highest")
    tokens = model.embed(params, images, gap, policy)
    patches = model.embed({**params, "pos_embed": jnp.zeros_like(params["pos_embed"])},
                          images, gap, policy)
    assert tokens.shape == (2, 16, TINY.width)
    np.testing.assert_allclose(np.asarray(tokens - patches),
                               np.broadcast_to(params["pos_embed"], tokens.shape), atol=1e-6)
    logits = _apply(params, images, gap, train=True, rng=jax.random.key(3))
    assert logits.shape == (2, 10) and bool(jnp.all(jnp.isfinite(logits)))


# Locality self-attention (ViTConfig.lsa).
LSA = TINY.replace(name="tiny-lsa", lsa=True)


def _lsa_by_hand(qkv, log_scale, cfg):
    """Attention with per-head temperatures and no self-attention, in float64 numpy:
    qkv (B, T, 3*H*D) -> (B, T, H*D)."""
    B, T, _ = qkv.shape
    q, k, v = np.moveaxis(np.asarray(qkv, np.float64).reshape(B, T, 3, cfg.heads,
                                                              cfg.head_dim), 2, 0)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * np.exp(np.asarray(log_scale,
                                                                    np.float64))[:, None, None]
    scores[:, :, np.arange(T), np.arange(T)] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, -1), probs


def test_lsa_attention_is_a_learned_temperature_with_the_diagonal_masked():
    from vit_pure.layers.attention import attention_einsum as _attention_einsum

    qkv = jax.random.normal(jax.random.key(0), (2, LSA.seq_len, 3 * LSA.width))
    log_scale = jnp.array([-1.5, -0.5, 0.0, 0.7])  # (H,), one temperature per head
    got = _attention_einsum(qkv, LSA, Policy(matmul_precision="highest"), log_scale)
    want, probs = _lsa_by_hand(qkv, log_scale, LSA)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert probs[:, :, np.arange(LSA.seq_len), np.arange(LSA.seq_len)].max() == 0.0
    plain = _attention_einsum(qkv, LSA, Policy(matmul_precision="highest"))
    assert np.abs(np.asarray(plain) - want).max() > 1e-2


def test_lsa_params_start_at_the_plain_scale_learn_and_are_not_decayed():
    """lsa adds blocks/attn/log_scale (L, H) = log(1/sqrt(D)) and changes no other param;
    its gradient is finite and non-zero; weight decay leaves it alone."""
    from vit_pure.step import decay_mask

    params = init_params(jax.random.key(0), LSA)
    plain = init_params(jax.random.key(0), TINY)
    log_scale = params["blocks"]["attn"].pop("log_scale")
    assert log_scale.shape == (LSA.depth, LSA.heads)
    np.testing.assert_allclose(np.asarray(log_scale), -0.5 * np.log(LSA.head_dim), rtol=1e-6)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), params, plain))
    params = init_params(jax.random.key(0), LSA)
    assert not decay_mask(params)["blocks"]["attn"]["log_scale"]
    assert count_params(params) == count_params(plain) + LSA.depth * LSA.heads
    axes = param_axes(LSA)
    assert axes["blocks"]["attn"]["log_scale"] == ("layers", "heads")

    def loss(p):
        return jnp.sum(apply(p, _images(3, LSA), LSA) ** 2)
    grad = jax.jit(jax.grad(loss))(params)["blocks"]["attn"]["log_scale"]
    assert bool(jnp.all(jnp.isfinite(grad))) and float(jnp.abs(grad).min()) > 0


def test_lsa_needs_the_einsum_attention():
    params = init_params(jax.random.key(0), LSA)
    with pytest.raises(ValueError, match="einsum"):
        apply(params, _images(2, LSA), LSA, execution=Execution(attention="xla"))


_LAST_BLOCK_CASES = {  # name -> (config changes, Execution fields)
    "unrolled": ({}, {}),
    "scan": ({}, {"scan": True}),
    "threefry16": ({}, {"dropout_masks": "threefry16"}),
    "packed masks": ({}, {"packed_masks": True}),
    "remat block": ({}, {"remat": "block"}),
    "save dots": ({}, {"remat": "block-save-dots"}),
    "lsa": ({"lsa": True}, {}),
    "layer scale, exact gelu": ({"layer_scale": 0.1, "gelu": "exact"}, {"scan": True}),
    "depth 1": ({"depth": 1}, {}),
}


_LAST_BLOCK_DEFAULT = ("unrolled", "threefry16", "remat block", "lsa")  # the rest `slow`,
_LAST_BLOCK_WIDER = ("scan", "save dots")  # but these two: `exhaustive`


def _last_block_tier(case):
    return (() if case in _LAST_BLOCK_DEFAULT else (pytest.mark.exhaustive,)
            if case in _LAST_BLOCK_WIDER else (pytest.mark.slow,))


@pytest.mark.parametrize("case", [pytest.param(case, marks=_last_block_tier(case))
                                  for case in _LAST_BLOCK_CASES])
def test_last_block_on_the_class_token_gives_the_same_loss_and_gradients(case):
    """Execution.last_block "class-token" (the scripts' default): after the last block's
    attention only the class token's row goes on, and the loss and every gradient equal
    the whole block's (float32, dropout and stochastic depth on, every mask kind, loop,
    remat mode, locality self-attention, layer scale) to float32 rounding."""
    changes, fields = _LAST_BLOCK_CASES[case]
    cfg = TINY.replace(dropout=0.1, drop_path=0.1, **changes)
    params = init_params(jax.random.key(0), cfg)
    images, labels = _images(4, cfg), jnp.arange(4) % cfg.num_classes

    def loss(p, last_block):
        execution = Execution(last_block=last_block, **fields)
        logits = apply(p, images, cfg, train=True, rng=jax.random.key(3),
                       example_ids=jnp.arange(4) + 5, execution=execution)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(4), labels])

    (l_all, g_all), (l_cls, g_cls) = (jax.value_and_grad(loss)(params, b)
                                      for b in ("all", "class-token"))
    assert l_cls == pytest.approx(float(l_all), rel=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_all))
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g_all), jax.tree.leaves(g_all),
                          jax.tree.leaves(g_cls), strict=True):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * scale, jax.tree_util.keystr(path[0])
    # Every block's parameters get a gradient: the last block's query too.
    assert float(jnp.abs(g_cls["blocks"]["attn"]["qkv"]["kernel"][-1, :, 0]).max()) > 0


def test_last_block_on_the_class_token_returns_its_row_and_only_for_pool_cls():
    """The encoder returns the class token's row (B, 1, E), equal to the whole block's
    first row; the flag's default reaches the step, and pools that read other tokens keep
    every row (`config.class_token_rows`), as do the pipelines (one program a stage)."""
    params = init_params(jax.random.key(0), TINY)
    x = model.embed(params, _images(3), TINY, Policy())
    whole = model.encoder(params["blocks"], x, TINY, Policy())
    first = model.encoder(params["blocks"], x, TINY, Policy(), class_token_only=True)
    assert first.shape == (3, 1, TINY.width)
    np.testing.assert_allclose(first[:, 0], whole[:, 0], rtol=1e-5, atol=1e-5)

    parser = cli.build_parser("test")
    sc = settings.step_config(cli.parse_args(parser, ["--model", "tiny"]), platform="cpu")
    assert sc.execution.last_block == "class-token"
    assert config.class_token_rows(TINY, sc.execution)
    for pool in ("mean", "gap", "cls+mean"):
        assert not config.class_token_rows(TINY.replace(pool=pool), sc.execution)
    args = cli.parse_args(parser, ["--model", "tiny", "--last-block", "all"])
    assert settings.step_config(args, platform="cpu").execution.last_block == "all"
    strategy = train_shardmap.ShardMapStrategy(sc, optax.sgd(0.1), "pipe=2",
                                               devices=jax.devices()[:2])
    assert strategy.sc.execution.last_block == "all"
