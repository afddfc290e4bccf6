"""fc2 and the GELU as Pallas kernels (vit_pure/pallas/mlp.py, `--mlp-kernels pallas`).

* the three kernels, run by Pallas's interpreter on the CPU (the kernel bodies and tiling
  that Triton compiles for a GPU; tests/test_deviceless.py compiles them for the H100),
  return what the reference formulas return: gelu(h) @ w; fc2's input gradient times the
  GELU's derivative and its column sums; gelu(h).T @ dz; so does the whole-array
  arithmetic that a program lowered for a CPU runs in their place;
* shapes their tiles do not fit are refused (the model then runs the reference path:
  tests/test_pallas_model.py, which checks the model's gradients with the kernels), and
  the flags that cannot use them are refused in one line.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_pure.config import Execution
from vit_pure.errors import UsageError
from vit_pure.pallas import mlp as mlp_kernel
from vit_pure.run import backend, cli, settings


def _reference(dz, w, h):
    """(z, dh, dbias, dw) by autodiff of gelu(h) @ w, in float32."""
    def f(h, w):
        return jnp.sum(jax.nn.gelu(h, approximate=True) @ w * dz)
    dh, dw = jax.grad(f, argnums=(0, 1))(h, w)
    return jax.nn.gelu(h, approximate=True) @ w, dh, dh.sum(axis=0), dw


def _kernels(dz, w, h, **kw):
    """(z, dh, dbias, dw) from the three kernels."""
    return (mlp_kernel.gelu_fc2_forward(h, w, dz.dtype, **kw),
            *mlp_kernel.gelu_fc2_backward(dz, w, h, **kw),
            mlp_kernel.gelu_fc2_weight_gradient(h, dz, w.dtype, **kw))


@pytest.mark.parametrize("rows, hidden, width, interpret", [
    (96, 256, 48, True), (16, 16, 16, True),  # the kernels: tiles of 32 / 16 rows
    (96, 256, 48, False), (512, 64, 128, False), (16, 16, 16, False)])  # the CPU's XLA
def test_the_kernels_compute_the_reference_formulas(rows, hidden, width, interpret):
    """In float32 at precision highest. The kernels at the headline's tiles, with several
    K steps and 16 row ranges: the bf16 test below."""
    k = jax.random.split(jax.random.key(0), 3)
    dz = jax.random.normal(k[0], (rows, width), jnp.float32)
    w = 0.2 * jax.random.normal(k[1], (hidden, width), jnp.float32)
    h = 2 * jax.random.normal(k[2], (rows, hidden), jnp.float32)
    got = _kernels(dz, w, h, interpret=interpret, precision=jax.lax.Precision.HIGHEST)
    for g, r, name in zip(got, _reference(dz, w, h), ("z", "dh", "dbias", "dw")):
        assert g.shape == r.shape and g.dtype == jnp.float32, name
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()),
                                   err_msg=name)


HEADLINE = (266240, 1536, 384)  # vit-cifar at batch 4096: B*T rows, M, E


def test_the_tile_table():
    """At the headline: the forward and weight-gradient programs own 64 rows (hidden units)
    and all of E (three 128-column accumulators: the GELU once per element), the backward
    a (128, 128) tile; K loops of 64 pipelined in 3 stages, 8 warps. Shapes no tiling fits
    exactly are refused."""
    fwd, bwd, wgt = mlp_kernel.tiles(*HEADLINE)
    assert (fwd.rows, fwd.step, fwd.cols, fwd.group) == (64, 64, 128, 3)
    assert (bwd.rows, bwd.step, bwd.cols, bwd.group) == (128, 64, 128, 1)
    assert (wgt.rows, wgt.step, wgt.cols, wgt.group) == (64, 64, 128, 3)
    assert {(t.num_warps, t.num_stages) for t in (fwd, bwd, wgt)} == {(8, 3)}
    assert mlp_kernel.splits(266240, 64) == 16  # 16 row ranges of 260 steps
    assert mlp_kernel.tiles(17 * 16, 64, 48)[0].rows == 16
    assert mlp_kernel.tiles(17 * 8, 64, 48) is None  # 136 rows: no multiple of 16
    assert mlp_kernel.tiles(272, 40, 48) is None and mlp_kernel.tiles(272, 64, 24) is None
    with pytest.raises(ValueError, match="no tiling fits rows 136"):
        mlp_kernel.gelu_fc2_backward(jnp.zeros((136, 48)), jnp.zeros((64, 48)),
                                     jnp.zeros((136, 64)))
    with pytest.raises(ValueError, match="do not fit"):
        mlp_kernel.gelu_fc2_forward(jnp.zeros((16, 48)), jnp.zeros((64, 48)), jnp.float32)


def test_at_the_headline_tiling_in_bf16_with_several_k_steps():
    """2048 rows, M 128, E 384 in bf16: every kernel at the headline's tiles (above),
    with 2 K steps in the forward, 6 in the backward and 2 in each of the weight
    gradient's 16 row ranges, in Pallas's interpreter, against the float32 formulas (it
    replaces a bf16 check at one tile)."""
    rows, hidden, width = 2048, 128, 384
    fit = mlp_kernel.tiles(rows, hidden, width)
    assert [(t.rows, t.step, t.cols, t.group) for t in fit] == [
        (t.rows, t.step, t.cols, t.group) for t in mlp_kernel.tiles(*HEADLINE)]
    assert (hidden // fit[0].step, width // fit[1].step,
            rows // mlp_kernel.splits(rows, fit[2].step) // fit[2].step) == (2, 6, 2)
    k = jax.random.split(jax.random.key(2), 3)
    dz, w, h = (jax.random.normal(k[0], (rows, width), jnp.bfloat16),
                (0.1 * jax.random.normal(k[1], (hidden, width))).astype(jnp.bfloat16),
                jax.random.normal(k[2], (rows, hidden), jnp.bfloat16))
    z, dh, dbias, dw = _kernels(dz, w, h, interpret=True)
    want = _reference(*(a.astype(jnp.float32) for a in (dz, w, h)))
    for got, r, name in ((z, want[0], "z"), (dh, want[1], "dh"), (dw, want[3], "dw")):
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
        assert err < 2 ** -7, (name, err)  # within a bf16 rounding of the largest entry
    np.testing.assert_allclose(dbias, dh.astype(jnp.float32).sum(0), rtol=1e-5, atol=1e-3)


def test_the_kernels_are_opt_in_everywhere():
    """Not yet timed on a GPU: XLA's kernels by default on every platform; asked for on an
    NVIDIA GPU they run, with a remat that keeps the GELU's input."""
    def choose(dtype="bf16", nvidia=True, given=None, remat="none", platform="gpu"):
        return backend.resolve(dtype, "default", None, platform, nvidia=nvidia,
                               mlp_kernels=given, remat=remat)

    chosen = choose()
    assert chosen.mlp_kernels == "xla"
    assert any(n.startswith("Pallas kernels:") for n in chosen.notes)
    assert choose(nvidia=False).mlp_kernels == "xla"
    assert choose(dtype="fp32").mlp_kernels == "xla"
    assert choose(remat="block-save-dots").mlp_kernels == "xla"
    assert choose(given="pallas").mlp_kernels == "pallas"
    assert choose(given="pallas", remat="block-save-dots").mlp_kernels == "pallas"
    assert choose(platform="cpu", nvidia=False, dtype="fp32").mlp_kernels == "xla"


@pytest.mark.parametrize("flags, message", [
    (["--mlp-kernels", "pallas"], "--mlp-kernels pallas are Triton kernels for NVIDIA GPUs"),
    (["--mlp-kernels", "pallas", "--remat", "block-save:gelu"],
     "--mlp-kernels pallas recomputes the GELU's output, which --remat block-save:gelu")])
def test_flags_that_cannot_use_them_are_one_line_errors(flags, message):
    args = cli.parse_args(cli.build_parser("t"), ["--model", "tiny", *flags])
    with pytest.raises(UsageError, match=message):
        settings.step_config(args, platform="cpu" if "--remat" not in flags else "gpu",
                            device=_Gpu())


class _Gpu:
    compute_capability = "9.0"


def test_execution_refuses_the_kernels_with_a_remat_that_saves_the_gelu():
    with pytest.raises(ValueError, match="recomputes the GELU's output"):
        Execution(mlp_kernels="pallas", remat="block-save:gelu")
    with pytest.raises(ValueError, match="mlp_kernels must be one of xla, pallas"):
        Execution(mlp_kernels="triton")
