"""The Pallas attention kernel (vit_pure/layers/attention_pallas.py) computes the einsum
path's attention, forward and gradients, run in JAX's Mosaic GPU interpreter on the CPU.

Float32: within 1e-5 of the einsum path (relative to the largest entry). bf16: the kernel
and the einsum path are each compared with a float32 reference on the same bf16 inputs,
and the kernel's error may not exceed the einsum path's own. The shapes cover the on-chip
padding of the tokens after the first (17 -> 16 rows padded to 64, 65 -> 64 exactly, 197
-> 256), a sequence of two tokens (token 0 and one more), several head dims, and batches
that do not divide into the kernel's pairs per program (the last program's missing
examples).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_cli_errors as cli_errors
import test_layout_matrix as matrix
from jax.sharding import PartitionSpec as P

from vit_pure.config import Execution
from vit_pure.layers import attention_pallas as ap
from vit_pure.layers.attention import attention_einsum
from vit_pure.model import apply, init_params
from vit_pure.plan import targets
from vit_pure.policy import Policy

FP32 = Policy.parse("fp32")
BF16 = Policy.parse("p=f32,c=bf16,o=f32,m=bf16")
# (batch, tokens, heads, head dim): batches 5, 3, 6 and 2 leave the last program of 4
# pairs with 1, 3, 2 and 2 examples.
SHAPES = [(5, 17, 2, 8), (3, 65, 2, 48), (6, 197, 1, 64), (2, 2, 1, 16)]


def _relative(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    assert np.all(np.isfinite(x)) and np.all(np.isfinite(y))
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def _inputs(shape, dtype):
    B, T, H, D = shape
    kq, kw = jax.random.split(jax.random.key(T * 100 + D))
    qkv = (2.0 * jax.random.normal(kq, (B, T, 3 * H * D), jnp.float32)).astype(dtype)
    weights = jax.random.normal(kw, (B, T, H * D), jnp.float32)
    return qkv, weights


def _einsum(qkv, head_dim, policy):
    cfg = matrix.CFG.replace(width=qkv.shape[-1] // 3, heads=qkv.shape[-1] // (3 * head_dim))
    return attention_einsum(qkv, cfg, policy)


@functools.cache
def _results(shape, dtype_name: str):
    """(forward, gradient of sum(out * weights)) of the kernel, the einsum path in that
    dtype, and the einsum path in float32 on the same (rounded) inputs."""
    dtype = jnp.dtype(dtype_name)
    qkv, weights = _inputs(shape, dtype)
    D = shape[3]
    policy = FP32 if dtype == jnp.float32 else BF16

    def both(f):
        def loss(x):
            return jnp.sum(f(x).astype(jnp.float32) * weights)
        return jax.jit(lambda x: (f(x), jax.grad(loss)(x)))

    kernel = both(lambda x: ap.attention_pallas(x, D, interpret=True))(qkv)
    einsum = both(lambda x: _einsum(x, D, policy))(qkv)
    reference = both(lambda x: _einsum(x.astype(jnp.float32), D, FP32))(qkv)
    return jax.device_get((kernel, einsum, reference))


@pytest.mark.parametrize("shape", SHAPES)
def test_float32_equals_the_einsum_path(shape):
    (out, grad), (out_e, grad_e), _ = _results(shape, "float32")
    assert out.shape == out_e.shape and grad.shape == grad_e.shape
    assert _relative(out, out_e) <= 1e-5
    assert _relative(grad, grad_e) <= 1e-5


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_bf16_is_within_the_einsum_paths_own_error(shape):
    (out, grad), (out_e, grad_e), (out_r, grad_r) = _results(shape, "bfloat16")
    assert out.dtype == grad.dtype == jnp.bfloat16
    assert _relative(out, out_r) <= _relative(out_e, out_r)
    assert _relative(grad, grad_r) <= _relative(grad_e, grad_r)
    # and not by accident: both are bf16-sized errors, not zero
    assert 0 < _relative(out_e, out_r) < 4 * float(jnp.finfo(jnp.bfloat16).eps)


def test_padded_keys_get_no_weight():
    """Every key row of the padding changes nothing: a value of 1e4 on a padded key would
    show. Here the real keys' values carry the signal, and the output is their average
    under softmax weights, so it stays within their range."""
    (out, _), _, _ = _results(SHAPES[0], "float32")
    qkv, _ = _inputs(SHAPES[0], jnp.float32)
    B, T, H, D = SHAPES[0]
    v = np.asarray(qkv).reshape(B, T, 3, H, D)[:, :, 2]  # (B, T, H, D)
    out = np.asarray(out).reshape(B, T, H, D)
    assert np.all(out <= v.max(axis=1, keepdims=True) + 1e-5)
    assert np.all(out >= v.min(axis=1, keepdims=True) - 1e-5)


def test_the_model_with_the_kernel_equals_the_einsum_model():
    cfg = matrix.CFG.replace(depth=1)
    params = jax.jit(lambda key: init_params(key, cfg))(jax.random.key(0))
    images = np.random.default_rng(1).standard_normal((3, 32, 32, 3), np.float32)

    def grads(attention):
        def f(p):
            logits = apply(p, images, cfg, FP32, train=True, rng=jax.random.key(3),
                           execution=Execution(attention=attention))
            return jnp.sum(logits * jnp.arange(logits.shape[-1])), logits
        return jax.device_get(jax.jit(jax.grad(f, has_aux=True))(params))

    (g_kernel, logits_kernel), (g_einsum, logits_einsum) = (grads("pallas-interpret"),
                                                            grads("einsum"))
    assert _relative(logits_kernel, logits_einsum) <= 1e-5
    for a, b in zip(jax.tree.leaves(g_kernel), jax.tree.leaves(g_einsum), strict=True):
        assert _relative(a, b) <= 1e-4


@pytest.mark.parametrize("tokens, head_dim, dtype, interpret, message", [
    (130, 16, jnp.bfloat16, False, "on the GPU takes 2 to 129 tokens, got 130"),
    (258, 16, jnp.float32, True, "interpreted takes 2 to 257 tokens, got 258"),
    (1, 16, jnp.float32, True, "interpreted takes 2 to 257 tokens, got 1"),
    (17, 24, jnp.bfloat16, False, "multiple of 16, got 24"),
    (17, 16, jnp.float32, False, "on the GPU takes bfloat16, float16, got float32"),
    (17, 6, jnp.int32, True, "interpreted takes bfloat16, float16, float32, got int32"),
    (100, 128, jnp.bfloat16, False, "need 304,384 bytes of shared memory in the backward"),
])
def test_shapes_it_does_not_take_are_refused(tokens, head_dim, dtype, interpret, message):
    with pytest.raises(ValueError, match=message):
        ap.check_shape(tokens, head_dim, dtype, interpret)
    ap.check_shape(65, 48, jnp.bfloat16)  # vit-cifar's attention on the GPU
    ap.check_shape(17, 6, jnp.float32, interpret=True)


@pytest.mark.parametrize("flags, message", [
    (["--attention", "pallas"],
     "--attention pallas is a Mosaic GPU kernel and needs an NVIDIA GPU"),
    (["--attention", "pallas-interpret"],
     "--attention pallas-interpret runs on one device (JAX's Mosaic GPU interpreter), not 8: "
     "give --cpu-devices 1"),
    (["--attention", "pallas-interpret", "--image-size", "136"],  # 17 x 17 patches + 1
     "--attention pallas-interpret with --model tiny: pallas attention interpreted takes 2 "
     "to 257 tokens, got 290")])
def test_where_it_cannot_run_is_one_line(flags, message, capsys, monkeypatch):
    """On a CPU the kernel itself cannot run; interpreted, it runs on one device only; a
    sequence it does not take is refused before anything is traced."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    code = cli_errors._main("shardmap", cli_errors.BASE + flags)
    cli_errors._assert_one_line(code, capsys.readouterr().err, message)


def test_the_cost_counts_each_array_once():
    B, T, H, D = 4, 65, 8, 48
    cost = ap.attention_cost(B, T, H, D, jnp.bfloat16)
    tile = T * D * 2
    assert cost["forward_bytes"] == B * H * (4 * tile + 64 * 4)
    assert cost["backward_bytes"] == B * H * (7 * tile + 64 * 4)
    # token 0 apart, the 64 others in one tile: per product the (64, 64) block and token
    # 0's row and column, (64 + 2) x 64 scores' worth where the einsums need 65 x 65
    assert cost["forward_flops"] == B * H * 2 * 2 * 64 * 66 * D
    assert cost["backward_flops"] == B * H * 5 * 2 * 64 * 66 * D
    assert cost["useful_forward_flops"] == B * H * 2 * 2 * 65 * 65 * D



def test_under_shard_map_the_gradient_is_summed_once():
    """Inside shard_map (check_vma on) the kernel's outputs come back typed as the same on
    every device; they are marked varying like the input, so that autodiff does not sum the
    cotangent over the mesh (a wrong gradient, silently) and the custom VJP's types match.
    One device: with 8 fake devices the interpreted kernels did not finish (blocked, not
    computing) in 15 minutes; the typing is the same on any mesh."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])
    qkv, weights = _inputs(SHAPES[0], jnp.float32)
    D = SHAPES[0][3]

    def grad(attend):
        def local(x, w):
            return jax.grad(lambda y: jnp.sum(attend(y) * w))(x)
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")),
                                     out_specs=P("data")))(qkv, weights)

    kernel = grad(lambda x: ap.attention_pallas(x, D, interpret=True))
    assert _relative(kernel, grad(lambda x: _einsum(x, D, FP32))) <= 1e-5


def _copies_seen_by_layout_inference(fn, *args, monkeypatch) -> list[tuple[str, list[int]]]:
    """The TMA copies (Mosaic GPU's async_load and async_store ops, each with its slice
    lengths: -1 for a memory axis indexed by an integer) of the first kernel that `fn`
    lowers for CUDA under warpgroup semantics (JAX's default from 0.11), as Mosaic GPU's
    layout inference receives them; the lowering is stopped there."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.mosaic_gpu import lowering
    from jax.experimental.pallas import mosaic_gpu as plgpu

    class Seen(Exception):
        pass

    copies = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    yield inner
                    yield from walk(inner)

    def infer_layout(module, **_):
        for op in walk(module.operation):
            if op.operation.name in ("mosaic_gpu.async_load", "mosaic_gpu.async_store"):
                lengths = ir.DenseI64ArrayAttr(op.attributes["slice_lengths"])
                copies.append((op.operation.name, list(lengths)))
        raise Seen

    monkeypatch.setattr(lowering.mgpu, "infer_layout", infer_layout)
    monkeypatch.setattr(ap, "_compiler_params", lambda interpret: plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    with pytest.raises(Seen):
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return copies


@pytest.mark.slow  # CI installs the CUDA plugin for the slow tier
@pytest.mark.skipif(not targets.cuda_plugin_installed(),
                    reason="JAX's CUDA plugin is not installed (pip install -r "
                           "requirements-gpu.txt)")
def test_no_copy_indexes_memory_by_an_integer(monkeypatch):
    """Lowered for a GPU, no TMA copy indexes an array in memory by an integer: Mosaic GPU's
    layout inference (warpgroup semantics, JAX's default from 0.11) rejects a copy whose
    memory side drops an axis (slice length -1). Every copy is counted: forward, each of q,
    k, v in two copies, the log-sum-exp and the context's two out; backward, the
    log-sum-exp and two copies of each of q, k, v, dctx in, two of each of dq, dk, dv out.
    vit-cifar's shape, bf16."""
    B, T, H, D = 16, 65, 8, 48
    rows, rp = B * T, ap.padded_rest(T)
    qkv = jax.ShapeDtypeStruct((rows, 3 * H * D), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((B, H, rp), jnp.float32)
    dctx = jax.ShapeDtypeStruct((rows, H * D), jnp.bfloat16)
    forward = _copies_seen_by_layout_inference(
        lambda x: ap._forward(x, T, D, False), qkv, monkeypatch=monkeypatch)
    backward = _copies_seen_by_layout_inference(
        lambda x, m, g: ap._backward(x, m, g, T, D, False), qkv, lse, dctx,
        monkeypatch=monkeypatch)
    for copies, loads, stores in ((forward, 6, 3), (backward, 9, 6)):
        names = [name for name, _ in copies]
        assert (names.count("mosaic_gpu.async_load"), names.count("mosaic_gpu.async_store")) \
            == (loads, stores), copies
        assert all(-1 not in lengths for _, lengths in copies), copies
