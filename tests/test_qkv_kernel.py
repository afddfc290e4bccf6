"""The q, k, v projection as Pallas kernels (vit_pure/pallas/qkv.py, `--qkv-projection`).

* the two kernels, run by Pallas's interpreter on the CPU (the kernel bodies and tiling
  that Triton compiles for a GPU; tests/test_deviceless.py compiles them for the H100),
  return what the reference formulas return: x @ w + bias in thirds; [dq dk dv] @ w.T
  and the column sums of dq, dk, dv; so does the whole-array arithmetic that a program
  lowered for a CPU runs in their place;
* the model's loss and gradients with them (the fused attention "xla", which a CPU runs)
  equal the XLA path's, on one device and under tensor parallelism with FSDP and a
  pipeline (each device's kernels see its heads' columns), where they add no collective;
* shapes the tiles do not fit run the reference path, and the flags that cannot use them
  are refused in one line.
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
from vit_pure.pallas import qkv
from vit_pure.policy import LossScale, Policy
from vit_pure.run import backend, cli

# Sizes the tiles fit: E 64, 4 heads of 16 (Hl*D 64; 32 and 16 under TP over 2 and 4);
# 17 tokens padded to 24, so a local batch of 2 or more makes the rows a multiple of 16.
CFG = PRESETS["tiny"].replace(name="qkv-kernel-test", width=64, heads=4, mlp_dim=64,
                              depth=2, drop_path=0.0)
XLA_ATTENTION = Execution(attention="xla")


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


def test_in_bf16_each_output_is_rounded_once():
    """bf16 in and out, as on the GPU: q, k, v and dx within one bf16 rounding of the
    float32 formulas (the bias added before the rounding); the bias gradient in float32."""
    x, w, bias, dq, dk, dv = _arrays(jax.random.key(1), (128, 64), (64, 192), (192,),
                                     *[(128, 64)] * 3, dtype=jnp.bfloat16)
    f32 = [a.astype(jnp.float32) for a in (x, w, bias, dq, dk, dv)]
    got = qkv.projection(x, w, bias, jnp.bfloat16, interpret=True)
    want = (f32[0] @ f32[1] + f32[2]).reshape(128, 3, 64)
    for i, g in enumerate(got):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(g, np.float32), want[:, i], rtol=2 ** -7,
                                   atol=2 ** -7, err_msg=i)
    dx, dbias = qkv.projection_input_gradient(dq, dk, dv, w, jnp.bfloat16, interpret=True)
    d = jnp.concatenate(f32[3:], axis=1)
    assert (dx.dtype, dbias.dtype) == (jnp.bfloat16, jnp.float32)
    np.testing.assert_allclose(np.asarray(dx, np.float32), d @ f32[1].T, rtol=2 ** -7,
                               atol=2 ** -7 * 4)
    np.testing.assert_allclose(dbias, d.sum(axis=0), rtol=1e-6, atol=1e-4)


def test_tiles_fit_exactly_or_not_at_all():
    assert qkv.tiles(4096 * 72, 384, 384) == (128, 128, 128)  # vit-cifar, batch 4096
    assert qkv.tiles(2 * 24, 64, 16) == (16, 16, 16)
    assert qkv.tiles(24, 64, 64) is None  # one example of 24 rows: no multiple of 16
    assert qkv.tiles(48, 48, 24) is None  # tiny's 4 heads of 6
    with pytest.raises(ValueError, match="no tiling fits rows 24"):
        qkv.projection(jnp.zeros((24, 64)), jnp.zeros((64, 192)), jnp.zeros(192),
                       jnp.float32)
    with pytest.raises(ValueError, match="do not fit"):
        qkv.projection(jnp.zeros((16, 64)), jnp.zeros((48, 192)), jnp.zeros(192),
                       jnp.float32)


def _loss_and_grads(execution, batch):
    params = model.init_params(jax.random.key(0), CFG)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(batch, 32, 32, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, batch))

    def loss(p):
        logits = model.apply(p, images, CFG, Policy(), train=True, rng=jax.random.key(1),
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
    xla = XLA_ATTENTION.replace(scan=scan, remat=remat)
    (loss, grads), calls = _loss_and_grads(xla.replace(qkv_projection="pallas"), 8)
    (want_loss, want), none = _loss_and_grads(xla, 8)
    # Two kernels a layer, in the trace once a layer (the scan traces its body once);
    # a CPU runs their other branch.
    assert (calls, none) == (2 if scan else 2 * CFG.depth, 0)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    _assert_close(grads, want)


def test_shapes_the_tiles_do_not_fit_run_the_reference_path():
    """One example: 24 padded rows, no multiple of 16: the same program as "xla"."""
    (_, grads), calls = _loss_and_grads(XLA_ATTENTION.replace(qkv_projection="pallas"), 1)
    (_, want), _ = _loss_and_grads(XLA_ATTENTION, 1)
    assert calls == 0
    _assert_close(grads, want)


@pytest.mark.parametrize("mesh, fsdp", [("data=4,model=2", False),
                                        ("data=2,pipe=2,model=2", True)])
def test_tensor_parallel_gradients_equal_one_device(mesh, fsdp):
    """The train script's shard_map gradients with the kernels equal one device's with the
    XLA path (float32). Batch 32: 8 or 16 examples a device (with the pipeline, two
    microbatches of 8); FSDP gathers w before the kernels."""
    sc = step.StepConfig(CFG, Policy(), execution=XLA_ATTENTION.replace(qkv_projection="pallas"))
    optimizer = step.make_optimizer(step.OptimConfig(warmup_steps=1), 1)[0]
    state = jax.device_get(step.init_state(jax.random.key(0), CFG, sc.policy, optimizer))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (32, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, (32,), dtype=np.int32)
    ids, key = np.arange(32, dtype=np.int32), step.step_key(0, 0, 0)

    reference = dataclasses.replace(sc, execution=XLA_ATTENTION)
    want, _ = jax.jit(lambda p: step.local_grads(
        reference, p, LossScale.create(dynamic=False), images, labels, ids, key)
    ).lower(state["params"]).compile(FAST)(state["params"])

    strategy = ts.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp)
    args = (strategy.put_state(state), *strategy.put_batch(images, labels, ids),
            strategy.put_replicated(key))
    grads_of = grads_step(strategy)
    jaxpr = jax.make_jaxpr(grads_of)(*args)
    assert "pallas_call[" in str(jaxpr)
    grads, _ = grads_of.lower(*args).compile(FAST)(*args)
    _assert_close(jax.device_get(grads), jax.device_get(want), mesh)
    # The same collectives as the XLA path's, all where the code writes them.
    xla = ts.ShardMapStrategy(reference, optimizer, mesh, fsdp=fsdp)
    sites = collective_sites(jaxpr)
    assert sites and not misplaced(sites)
    assert sites == collective_sites(jax.make_jaxpr(grads_step(xla))(*args))


def test_the_default_is_the_kernels_with_cudnn_attention_in_bf16_only():
    def choose(dtype="bf16", nvidia=True, given=None, attention=None, platform="gpu"):
        return backend.resolve(dtype, "default", None, platform, nvidia=nvidia, cudnn=nvidia,
                               attention=attention, qkv_projection=given)

    chosen = choose()
    assert (chosen.attention, chosen.qkv_projection) == ("cudnn", "pallas")
    assert any(n.startswith("qkv projection: Pallas kernels") for n in chosen.notes)
    assert choose(attention="einsum").qkv_projection == "xla"
    assert choose(attention="xla").qkv_projection == "xla"  # measured with cuDNN only
    assert choose(dtype="fp32").qkv_projection == "xla"
    assert choose(nvidia=False).qkv_projection == "xla"
    assert choose(given="xla").qkv_projection == "xla"
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
        backend.step_config(args, platform=platform, device=_Gpu())


def test_execution_refuses_the_kernels_without_a_fused_attention():
    with pytest.raises(ValueError, match="writes the fused attention's padded inputs"):
        Execution(qkv_projection="pallas")
    with pytest.raises(ValueError, match="qkv_projection must be one of xla, pallas"):
        Execution(attention="xla", qkv_projection="triton")
