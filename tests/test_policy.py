"""The dtype policy: parsing, casting, the bf16 matmul's backward pass, the loss scale."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_pure.policy import LossScale, Policy, cast_floating, matmul, select_tree


@pytest.mark.parametrize("text, expected", [
    ("fp32", ("float32", "float32", "float32", "float32")),
    ("bf16", ("float32", "bfloat16", "float32", "float32")),
    ("fp16", ("float32", "float16", "float32", "float32")),
    ("p=f32,c=bf16,o=f32", ("float32", "bfloat16", "float32", "float32")),
    ("p=f32,c=bf16,o=f32,m=bf16", ("float32", "bfloat16", "float32", "bfloat16")),
    ("c=bf16,m=c", ("float32", "bfloat16", "float32", "bfloat16")),
    ("p=bf16,c=bf16,o=bf16", ("bfloat16", "bfloat16", "bfloat16", "float32")),
    ("c=f16", ("float32", "float16", "float32", "float32")),
    (" P=BF16, C=F32 ", ("bfloat16", "float32", "float32", "float32")),
])
def test_parse(text, expected):
    pol = Policy.parse(text)
    assert (pol.param_dtype.name, pol.compute_dtype.name, pol.output_dtype.name,
            pol.matmul_dtype.name) == expected
    assert Policy.parse(str(pol)) == pol  # the string form round-trips
    assert Policy.gives_matmul_dtype(text) == ("m=" in text)


@pytest.mark.parametrize("bad", ["fp64x", "p=f32,q=bf16", "p=int8", "c", "c=bf16,m=f16",
                                 "c=f32,m=bf16"])
def test_parse_rejects_garbage(bad):
    with pytest.raises(ValueError):
        Policy.parse(bad)


def test_bad_precision_and_loss_scaling_flag():
    with pytest.raises(ValueError, match="precision"):
        Policy(matmul_precision="fastest")
    assert Policy.parse("fp16").needs_loss_scaling
    assert Policy.parse("p=f16,c=f32").needs_loss_scaling
    assert not Policy.parse("bf16").needs_loss_scaling


def test_casting_touches_only_floating_leaves():
    tree = {"w": jnp.ones(3), "step": jnp.array(4, jnp.int32),
            "key": jax.random.key_data(jax.random.key(0)), "half": jnp.ones(2, jnp.float16)}
    out = Policy.parse("bf16").cast_to_compute(tree)
    assert out["w"].dtype == jnp.bfloat16 and out["half"].dtype == jnp.bfloat16
    assert out["step"].dtype == jnp.int32 and out["key"].dtype == jnp.uint32
    np.testing.assert_array_equal(out["key"], tree["key"])
    assert cast_floating(tree, jnp.float16)["w"].dtype == jnp.float16


@pytest.mark.parametrize("policy", ["bf16", "c=bf16,m=bf16"])
def test_matmul_backward_runs_in_compute_dtype_and_matches_f32(policy):
    """Either matmul output dtype: forward and both backward matmuls take bf16 operands
    (the m=f32 policy through the custom VJP, m=bf16 through plain autodiff)."""
    pol = Policy.parse(policy)
    x = jax.random.normal(jax.random.key(0), (4, 5, 16))
    w = jax.random.normal(jax.random.key(1), (16, 8))

    def f(x, w):
        out = matmul(x, w, pol if x.dtype == jnp.bfloat16 else Policy())
        assert out.dtype == (pol.matmul_dtype if x.dtype == jnp.bfloat16 else jnp.float32)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    gx32, gw32 = jax.grad(f, (0, 1))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), (0, 1))(x, w)
    np.testing.assert_allclose(gx32, ref[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw32, ref[1], rtol=1e-5, atol=1e-5)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    gxb, gwb = jax.grad(f, (0, 1))(xb, wb)
    assert gxb.dtype == jnp.bfloat16 and gwb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(gxb, np.float32), gx32, atol=0.1, rtol=0.05)
    # Every matmul of the backward pass takes bf16 operands (none is upcast to f32).
    hlo = jax.jit(jax.grad(f, (0, 1))).lower(xb, wb).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert len(dots) == 3 and all("xbf16>" in d.split("->")[0] and "xf32>" not in d.split("->")[0]
                                  for d in dots)


def test_loss_scale_overflow_and_growth():
    ls = LossScale.create(dynamic=True, initial_scale=8.0, period=2)
    assert float(ls.scale_loss(jnp.float32(1.5))) == 12.0
    grads = {"a": jnp.array([8.0, 16.0])}
    np.testing.assert_array_equal(ls.unscale(grads)["a"], [1.0, 2.0])
    # Overflow: halve the scale, reset the counter.
    bad = {"a": jnp.array([jnp.inf, 1.0])}
    finite = jnp.all(jnp.isfinite(bad["a"]))
    assert not bool(finite)
    ls2 = ls.adjust(finite)
    assert float(ls2.scale) == 4.0 and int(ls2.good_steps) == 0
    # Two finite steps in a row (period=2): double.
    ls3 = ls2.adjust(jnp.array(True))
    assert float(ls3.scale) == 4.0 and int(ls3.good_steps) == 1
    ls4 = ls3.adjust(jnp.array(True))
    assert float(ls4.scale) == 8.0 and int(ls4.good_steps) == 0
    # Skipping a step keeps the old params.
    old, new = {"w": jnp.ones(2)}, {"w": jnp.full(2, jnp.nan)}
    np.testing.assert_array_equal(select_tree(finite, new, old)["w"], [1.0, 1.0])
    # The scale never drops below min_scale.
    tiny = LossScale.create(dynamic=True, initial_scale=1.0)
    assert float(tiny.adjust(jnp.array(False)).scale) == 1.0


def test_static_loss_scale_is_a_no_op():
    ls = LossScale.create(dynamic=False)
    g = {"a": jnp.array([3.0])}
    assert ls.unscale(g) is g and float(ls.scale_loss(jnp.float32(2.0))) == 2.0
    assert ls.adjust(jnp.array(False)) is ls


def test_loss_scale_is_a_pytree_through_jit_and_pmap():
    ls = LossScale.create(dynamic=True, initial_scale=4.0, period=3)
    out = jax.jit(lambda s: s.adjust(jnp.array(False)))(ls)
    assert isinstance(out, LossScale) and float(out.scale) == 2.0 and out.period == 3
    n = jax.local_device_count()
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), ls)
    res = jax.pmap(lambda s: s.adjust(jnp.array(True)))(stacked)
    np.testing.assert_array_equal(res.good_steps, np.ones(n))
