"""fc2 and the GELU as Pallas kernels (vit_pure/pallas/mlp.py, `--mlp-kernels pallas`).

* the three kernels, run by Pallas's interpreter on the CPU (the kernel bodies and tiling
  that Triton compiles for a GPU; tests/test_deviceless.py compiles them for the H100),
  return what the reference formulas return: gelu(h) @ w; fc2's input gradient times the
  GELU's derivative and its column sums; gelu(h).T @ dz; so does the whole-array
  arithmetic that a program lowered for a CPU runs in their place;
* the model's gradients with the custom VJP around them equal the XLA path's, on one
  device and under tensor parallelism (each device's kernels see its M / model hidden
  units), where they add no collective;
* shapes their tiles do not fit run the reference path, and the flags that cannot use
  them are refused in one line.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST, grads_step
from test_collective_sites import collective_sites, misplaced

import train_shardmap as ts
from vit_pure import model, step
from vit_pure.config import PRESETS, Execution
from vit_pure.errors import UsageError
from vit_pure.pallas import mlp as mlp_kernel
from vit_pure.policy import LossScale, Policy
from vit_pure.run import backend, cli

# Sizes the kernel's tiles fit: E 48 (BK 16), M 64 (BN 64; 32 and 16 under TP over 2 and
# 4), 17 tokens: the local batch a multiple of 16 makes the rows a multiple of 16 (BM).
CFG = PRESETS["tiny"].replace(name="mlp-kernel-test", width=48, heads=4, mlp_dim=64,
                              depth=2, drop_path=0.0)


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


@pytest.mark.parametrize("interpret", [True, False])
@pytest.mark.parametrize("rows, hidden, width", [(96, 256, 48), (512, 64, 128), (16, 16, 16)])
def test_the_kernels_compute_the_reference_formulas(rows, hidden, width, interpret):
    """512 rows: the weight gradient's sum in 4 row ranges of 128."""
    k = jax.random.split(jax.random.key(0), 3)
    dz = jax.random.normal(k[0], (rows, width), jnp.float32)
    w = 0.2 * jax.random.normal(k[1], (hidden, width), jnp.float32)
    h = 2 * jax.random.normal(k[2], (rows, hidden), jnp.float32)
    got = _kernels(dz, w, h, interpret=interpret, precision=jax.lax.Precision.HIGHEST)
    for g, r, name in zip(got, _reference(dz, w, h), ("z", "dh", "dbias", "dw")):
        assert g.shape == r.shape and g.dtype == jnp.float32, name
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()),
                                   err_msg=name)


def test_in_bf16_each_output_is_within_one_rounding_of_the_float32_formula():
    """bf16 in and out, as on the GPU: z, dh and dw within a bf16 rounding or two of the
    float32 formulas (the kernels round gelu(h) to bf16 for the tensor cores, as cuBLASLt's
    epilogue does; the XLA path also rounds fc2's input gradient to bf16 first); the bias
    gradient is the float32 sum of the bf16 dh returned."""
    k = jax.random.split(jax.random.key(1), 3)
    dz, w, h = (jax.random.normal(k[0], (128, 64), jnp.bfloat16),
                (0.2 * jax.random.normal(k[1], (64, 64))).astype(jnp.bfloat16),
                jax.random.normal(k[2], (128, 64), jnp.bfloat16))
    z, dh, dbias, dw = _kernels(dz, w, h, interpret=True)
    assert (z.dtype, dh.dtype, dbias.dtype, dw.dtype) == (jnp.bfloat16,) * 2 + (
        jnp.float32, jnp.bfloat16)
    want = _reference(*(a.astype(jnp.float32) for a in (dz, w, h)))
    for got, r, name in ((z, want[0], "z"), (dh, want[1], "dh"), (dw, want[3], "dw")):
        np.testing.assert_allclose(np.asarray(got, np.float32), r, rtol=2 ** -6,
                                   atol=2 ** -7 * float(jnp.abs(r).max()) / 4, err_msg=name)
    np.testing.assert_allclose(dbias, dh.astype(jnp.float32).sum(0), rtol=1e-6, atol=1e-4)


def test_tiles_fit_exactly_or_not_at_all():
    assert mlp_kernel.tiles(266240, 1536, 384) == (128, 128, 128)  # vit-cifar, batch 4096
    assert mlp_kernel.splits(266240, 128) == 16  # 16 row ranges of 130 tiles
    assert mlp_kernel.tiles(17 * 16, 64, 48) == (16, 64, 16)
    assert mlp_kernel.tiles(17 * 8, 64, 48) is None  # 136 rows: no multiple of 16
    assert mlp_kernel.tiles(272, 40, 48) is None and mlp_kernel.tiles(272, 64, 24) is None
    with pytest.raises(ValueError, match="no tiling fits rows 136"):
        mlp_kernel.gelu_fc2_backward(jnp.zeros((136, 48)), jnp.zeros((64, 48)),
                                     jnp.zeros((136, 64)))
    with pytest.raises(ValueError, match="do not fit"):
        mlp_kernel.gelu_fc2_forward(jnp.zeros((16, 48)), jnp.zeros((64, 48)), jnp.float32)


def _loss_and_grads(cfg, execution, batch):
    params = model.init_params(jax.random.key(0), cfg)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(batch, 32, 32, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, batch))

    def loss(p):
        logits = model.apply(p, images, cfg, Policy(), train=True, rng=jax.random.key(1),
                             example_ids=jnp.arange(batch), execution=execution)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(batch), labels])

    calls = str(jax.make_jaxpr(jax.grad(loss))(params)).count("pallas_call[")
    return jax.jit(jax.value_and_grad(loss)).lower(params).compile(FAST)(params), calls


def _assert_close(got, want, msg=""):
    scale = math.sqrt(sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(want)))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale,
                                   err_msg=f"{msg} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("scan, remat", [(False, "none"), (True, "block-save-dots")])
def test_model_gradients_equal_the_xla_path(scan, remat):
    pallas = Execution(scan=scan, remat=remat, mlp_kernels="pallas")
    (loss, grads), calls = _loss_and_grads(CFG, pallas, 16)
    (want_loss, want), none = _loss_and_grads(CFG, pallas.replace(mlp_kernels="xla"), 16)
    # Three kernels, in the trace once a layer (the scan traces its body once); a CPU runs
    # their other branch.
    assert (calls, none) == (3 if scan else 3 * CFG.depth, 0)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    _assert_close(grads, want)


def test_shapes_the_tiles_do_not_fit_run_the_reference_path():
    """8 examples of 17 tokens: 136 rows, no multiple of 16: the same program as "xla"."""
    (_, grads), calls = _loss_and_grads(CFG, Execution(mlp_kernels="pallas"), 8)
    (_, want), _ = _loss_and_grads(CFG, Execution(), 8)
    assert calls == 0
    _assert_close(grads, want)


@pytest.mark.parametrize("mesh, fsdp", [("data=4,model=2", False), ("data=2,model=4", False),
                                        ("data=2,pipe=2,model=2", True)])
def test_tensor_parallel_gradients_equal_one_device(mesh, fsdp):
    """The train script's shard_map gradients with the kernel equal one device's with XLA's
    kernels (float32). Batch 64: 16 or 32 examples a device, 272 or 544 rows; with the
    pipeline, two microbatches of 16 a device, and FSDP gathering w before the kernel."""
    sc = step.StepConfig(CFG, Policy(), execution=Execution(mlp_kernels="pallas"))
    optimizer = step.make_optimizer(step.OptimConfig(warmup_steps=1), 1)[0]
    state = jax.device_get(step.init_state(jax.random.key(0), CFG, sc.policy, optimizer))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, (64,), dtype=np.int32)
    ids, key = np.arange(64, dtype=np.int32), step.step_key(0, 0, 0)

    reference = dataclasses.replace(sc, execution=Execution())
    want, _ = jax.jit(lambda p: step.local_grads(
        reference, p, LossScale.create(dynamic=False), images, labels, ids, key)
    ).lower(state["params"]).compile(FAST)(state["params"])

    strategy = ts.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp)
    args = (strategy.put_state(state), *strategy.put_batch(images, labels, ids),
            strategy.put_replicated(key))
    grads_of = grads_step(strategy)
    jaxpr = jax.make_jaxpr(grads_of)(*args)
    assert "pallas_call[" in str(jaxpr)  # the pipeline traces its stage more than once
    grads, _ = grads_of.lower(*args).compile(FAST)(*args)
    _assert_close(jax.device_get(grads), jax.device_get(want), mesh)
    # The same collectives as XLA's path, all where the code writes them.
    xla = ts.ShardMapStrategy(reference, optimizer, mesh, fsdp=fsdp)
    sites = collective_sites(jaxpr)
    assert sites and not misplaced(sites)
    assert sites == collective_sites(jax.make_jaxpr(grads_step(xla))(*args))


def test_the_default_is_the_kernels_on_an_nvidia_gpu_in_bf16_only():
    def choose(dtype="bf16", nvidia=True, given=None, remat="none", platform="gpu"):
        return backend.resolve(dtype, "default", None, platform, nvidia=nvidia,
                               mlp_kernels=given, remat=remat)

    chosen = choose()
    assert chosen.mlp_kernels == "pallas"
    assert any(n.startswith("MLP kernels: Pallas kernels") for n in chosen.notes)
    assert choose(nvidia=False).mlp_kernels == "xla"  # ROCm, or before compute capability 8
    assert choose(dtype="fp32").mlp_kernels == "xla"
    assert choose(remat="block-save:dot+gelu").mlp_kernels == "xla"
    assert choose(remat="block-save-dots").mlp_kernels == "pallas"
    assert choose(given="xla").mlp_kernels == "xla"
    assert choose(platform="cpu", nvidia=False, dtype="fp32").mlp_kernels == "xla"


@pytest.mark.parametrize("flags, message", [
    (["--mlp-kernels", "pallas"], "--mlp-kernels pallas are Triton kernels for NVIDIA GPUs"),
    (["--mlp-kernels", "pallas", "--remat", "block-save:gelu"],
     "--mlp-kernels pallas recomputes the GELU's output, which --remat block-save:gelu")])
def test_flags_that_cannot_use_them_are_one_line_errors(flags, message):
    args = cli.parse_args(cli.build_parser("t"), ["--model", "tiny", *flags])
    with pytest.raises(UsageError, match=message):
        backend.step_config(args, platform="cpu" if "--remat" not in flags else "gpu",
                            device=_Gpu())


class _Gpu:
    compute_capability = "9.0"


def test_execution_refuses_the_kernels_with_a_remat_that_saves_the_gelu():
    with pytest.raises(ValueError, match="recomputes the GELU's output"):
        Execution(mlp_kernels="pallas", remat="block-save:gelu")
    with pytest.raises(ValueError, match="mlp_kernels must be one of xla, pallas"):
        Execution(mlp_kernels="triton")
