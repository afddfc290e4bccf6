"""The q, k, v projection as Pallas kernels (vit_pure/pallas/qkv.py, `--qkv-projection`).

* the two kernels, run by Pallas's interpreter on the CPU (the kernel bodies and tiling
  that Triton compiles for a GPU; tests/test_deviceless.py compiles them for the H100),
  return what the reference formulas return: x @ w + bias in thirds; [dq dk dv] @ w.T
  and the column sums of dq, dk, dv; so does the whole-array arithmetic that a program
  lowered for a CPU runs in their place;
* shapes the tiles do not fit are refused (the model then runs the reference path:
  tests/test_pallas_model.py, which checks the model's loss and gradients with the
  kernels), and the flags that cannot use them are refused in one line.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_pure.config import Execution
from vit_pure.errors import UsageError
from vit_pure.pallas import qkv
from vit_pure.run import backend, cli, settings


def _arrays(key, *shapes, dtype=jnp.float32):
    return [jax.random.normal(k, s, dtype) for k, s in zip(jax.random.split(key, len(shapes)),
                                                            shapes)]


@pytest.mark.parametrize("interpret", [True, False])
@pytest.mark.parametrize("rows, width, columns", [(96, 48, 32), (64, 128, 128)])
def test_the_kernels_compute_the_reference_formulas(rows, width, columns, interpret):
    x, w, bias, dq, dk, dv = _arrays(jax.random.key(0), (rows, width), (width, 3 * columns),
                                     (3 * columns,), *[(rows, columns)] * 3)
    high = jax.lax.Precision.HIGHEST
    got = qkv.projection(x, w, bias, jnp.float32, precision=high, interpret=interpret)
    want = (jnp.dot(x, w, precision=high) + bias).reshape(rows, 3, columns)
    for i, g in enumerate(got):
        assert g.shape == (rows, columns) and g.dtype == jnp.float32
        np.testing.assert_allclose(g, want[:, i], rtol=1e-5, atol=1e-5 * width, err_msg=i)
    dx, dbias = qkv.projection_input_gradient(dq, dk, dv, w, jnp.float32, precision=high,
                                              interpret=interpret)
    d = jnp.concatenate([dq, dk, dv], axis=1)
    np.testing.assert_allclose(dx, jnp.dot(d, w.T, precision=high), rtol=1e-5,
                               atol=1e-5 * columns)
    np.testing.assert_allclose(dbias, d.sum(axis=0), rtol=1e-5, atol=1e-5 * rows)


HEADLINE = (4096 * 72, 384, 384)  # vit-cifar at batch 4096: padded rows, E, H*D


def _shape(t):
    return t.rows, t.step, t.cols, t.group


def test_the_tile_table():
    """At the headline: the projection's programs own 64 rows and a 128-column block of
    each of q, k, v, stepping E by 64 in 3 pipeline stages; the input gradient's own 64
    rows and all of E (dq, dk, dv read once), stepping by 32 in 2 stages (the most its
    tiles leave room for). Shapes no tiling fits exactly are refused."""
    proj, grad = qkv.tiles(*HEADLINE)
    assert (_shape(proj), proj.num_warps, proj.num_stages) == ((64, 64, 128, 3), 8, 3)
    assert (_shape(grad), grad.num_warps, grad.num_stages) == ((64, 32, 128, 3), 8, 2)
    assert _shape(qkv.tiles(2 * 24, 64, 16)[0]) == (16, 64, 16, 3)
    assert qkv.tiles(24, 64, 64) is None  # one example of 24 rows: no multiple of 16
    assert qkv.tiles(48, 48, 24) is None  # tiny's 4 heads of 6
    with pytest.raises(ValueError, match="no tiling fits rows 24"):
        qkv.projection(jnp.zeros((24, 64)), jnp.zeros((64, 192)), jnp.zeros(192),
                       jnp.float32)
    with pytest.raises(ValueError, match="do not fit"):
        qkv.projection(jnp.zeros((16, 64)), jnp.zeros((48, 192)), jnp.zeros(192),
                       jnp.float32)


def test_at_the_headline_tiling_in_bf16_with_several_k_steps():
    """128 rows, E 384, n 128 in bf16 at the headline's tiles (above): 6 K steps in the
    projection, 4 a third in the input gradient, in Pallas's interpreter. q, k, v and dx
    within one bf16 rounding of the float32 formulas (the bias added before the
    rounding); the bias gradient in float32."""
    rows, width, columns = 128, 384, 128
    fit = qkv.tiles(rows, width, columns)
    assert [_shape(t) for t in fit] == [_shape(t) for t in qkv.tiles(*HEADLINE)]
    x, w, bias, dq, dk, dv = _arrays(jax.random.key(1), (rows, width), (width, 3 * columns),
                                     (3 * columns,), *[(rows, columns)] * 3,
                                     dtype=jnp.bfloat16)
    w = (w * 0.1).astype(jnp.bfloat16)
    f32 = [a.astype(jnp.float32) for a in (x, w, bias, dq, dk, dv)]
    got = qkv.projection(x, w, bias, jnp.bfloat16, interpret=True)
    want = (f32[0] @ f32[1] + f32[2]).reshape(rows, 3, columns)
    for i, g in enumerate(got):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), want[:, i], rtol=2 ** -7,
                                   atol=2 ** -7, err_msg=i)
    dx, dbias = qkv.projection_input_gradient(dq, dk, dv, w, jnp.bfloat16, interpret=True)
    d = jnp.concatenate(f32[3:], axis=1)
    assert (dx.dtype, dbias.dtype) == (jnp.bfloat16, jnp.float32)
    np.testing.assert_allclose(np.asarray(dx, np.float32), d @ f32[1].T, rtol=2 ** -7,
                               atol=2 ** -7 * 4)
    np.testing.assert_allclose(dbias, d.sum(axis=0), rtol=1e-6, atol=1e-3)


def test_the_kernels_are_opt_in_everywhere():
    """Not yet timed on a GPU: XLA's GEMM and copy by default, cuDNN attention or not;
    asked for with a fused attention on an NVIDIA GPU, the kernels run."""
    def choose(dtype="bf16", nvidia=True, given=None, attention=None, platform="gpu"):
        return backend.resolve(dtype, "default", None, platform, nvidia=nvidia, cudnn=nvidia,
                               attention=attention, qkv_projection=given)

    chosen = choose()
    assert (chosen.attention, chosen.qkv_projection) == ("cudnn", "xla")
    assert any(n.startswith("Pallas kernels:") for n in chosen.notes)
    assert choose(attention="einsum").qkv_projection == "xla"
    assert choose(dtype="fp32").qkv_projection == "xla"
    assert choose(nvidia=False).qkv_projection == "xla"
    assert choose(given="pallas").qkv_projection == "pallas"
    assert choose(given="pallas", attention="xla").qkv_projection == "pallas"
    assert choose(platform="cpu", nvidia=False, dtype="fp32").qkv_projection == "xla"


class _Gpu:
    compute_capability = "9.0"


@pytest.mark.parametrize("flags, platform, message", [
    (["--qkv-projection", "pallas", "--attention", "xla"], "cpu",
     "--qkv-projection pallas is a Triton kernel for NVIDIA GPUs"),
    (["--qkv-projection", "pallas", "--attention", "einsum"], "gpu",
     "--qkv-projection pallas writes the fused attention's padded inputs")])
def test_flags_that_cannot_use_them_are_one_line_errors(flags, platform, message):
    args = cli.parse_args(cli.build_parser("t"), ["--model", "vit-cifar", "--dtype", "bf16",
                                                  *flags])
    with pytest.raises(UsageError, match=message):
        settings.step_config(args, platform=platform, device=_Gpu())


def test_execution_refuses_the_kernels_without_a_fused_attention():
    with pytest.raises(ValueError, match="writes the fused attention's padded inputs"):
        Execution(qkv_projection="pallas")
    with pytest.raises(ValueError, match="qkv_projection must be one of xla, pallas"):
        Execution(attention="xla", qkv_projection="triton")
