"""The attention implementations (`--attention`, attention.ATTENTION_IMPLS) compute one function.

"xla" calls `jax.nn.dot_product_attention` on (B, T, H, D) with the token axis padded to a
multiple of 8 around the call and the padded keys masked (attention.attend_padded); it must
give the einsum path's logits and gradients: to float32 rounding under fp32, to bf16
rounding under bf16. The tiny model has 17 tokens, padded to 24, so the padding and its
mask are really exercised (and dropping the mask is a difference the checks see). Under
tensor parallelism (local heads) and a pipeline, the "xla" path matches data parallel
within tests/test_layout_matrix.py's tolerances. "cudnn" needs an NVIDIA GPU: on CPU it is
a one-line usage error; its check against the einsum path is benchmarks/probes/attention_check.py
(a GPU script, not a test).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_cli_errors as cli_errors
import test_layout_matrix as matrix
from jax.extend.core import jaxprs_in_params

from vit_pure.config import Execution
from vit_pure.errors import UsageError
from vit_pure.layers.attention import attend_padded, attention_einsum, padded_length
from vit_pure.model import apply, init_params
from vit_pure.policy import Policy
from vit_pure.run import cli, settings

CFG = matrix.CFG  # tiny, depth 2: 4 heads of 6, 17 tokens; dropout and drop path on
ONE_LAYER = CFG.replace(depth=1)  # for the model-level checks: half the compile time
EPS32 = float(jnp.finfo(jnp.float32).eps)
EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)
# (policy, relative tolerance): the largest difference of each array (logits, each
# gradient leaf) over that array's largest entry. Float32: a few float32 roundings (the
# two paths scale the scores in a different order); bf16: one bf16 rounding.
POLICIES = [("fp32", 32 * EPS32), ("p=f32,c=bf16,o=f32,m=f32", EPS_BF16),
            ("p=f32,c=bf16,o=f32,m=bf16", EPS_BF16)]


def _worst(a, b) -> float:
    """Largest |a - b| over the largest |a|, over the leaves of two trees."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.all(np.isfinite(y))
        worst = max(worst, float(np.max(np.abs(x - y)) / np.max(np.abs(x))))
    return worst


@functools.cache
def _params():
    return jax.jit(lambda key: init_params(key, ONE_LAYER))(jax.random.key(0))  # one compile


@functools.cache
def _logits_and_grads(policy_text: str, attention: str):
    """Training-mode logits (dropout, drop path on) and the gradients of a random linear
    function of them, for 6 images."""
    rng = np.random.default_rng(1)
    images = rng.standard_normal((6, 32, 32, 3), np.float32)
    weights = rng.standard_normal((6, ONE_LAYER.num_classes), np.float32)
    policy = Policy.parse(policy_text)

    def f(params):
        logits = apply(params, images, ONE_LAYER, policy, train=True, rng=jax.random.key(3),
                       execution=Execution(attention=attention)).astype(jnp.float32)
        return jnp.sum(logits * weights), logits

    compiled = jax.jit(jax.grad(f, has_aux=True)).lower(_params()).compile(matrix.FAST)
    grads, logits = compiled(_params())
    return jax.device_get(logits), jax.device_get(grads)


def test_the_token_axis_is_padded():
    assert CFG.seq_len == 17 and padded_length(CFG.seq_len) == 24
    assert padded_length(65) == 72  # vit-cifar
    assert padded_length(64) == 64


@pytest.mark.parametrize("policy, tol", POLICIES, ids=[p for p, _ in POLICIES])
def test_xla_attention_matches_einsum(policy, tol):
    ref_logits, ref_grads = _logits_and_grads(policy, "einsum")
    logits, grads = _logits_and_grads(policy, "xla")
    print(policy, "logits", _worst(ref_logits, logits), "grads", _worst(ref_grads, grads),
          "tolerance", tol)
    assert _worst(ref_logits, logits) <= tol
    assert _worst(ref_grads, grads) <= tol


def test_the_mask_matters():
    """The check can fail: the same padded call without the key mask lets the 7 zero keys
    into every softmax, a difference far outside the bf16 tolerance."""
    B, T, H, D = 3, CFG.seq_len, CFG.heads, CFG.head_dim
    Tp = padded_length(T)

    @jax.jit
    def three_ways(qkv):
        policy = Policy()
        q, k, v = (jnp.pad(a, ((0, 0), (0, Tp - T), (0, 0), (0, 0))) for a in
                   jnp.moveaxis(qkv.reshape(B, T, 3, H, D), 2, 0))
        unmasked = jax.nn.dot_product_attention(q, k, v, implementation="xla")[:, :T]
        return (attention_einsum(qkv, CFG, policy),
                attend_padded(q, k, v, T, policy, "xla")[:, :T], unmasked.reshape(B, T, H * D))

    qkv = np.random.default_rng(4).standard_normal((B, T, 3 * H * D), np.float32)
    ref, got, unmasked = three_ways(qkv)
    assert _worst(ref, got) <= 32 * EPS32
    assert _worst(ref, unmasked) > 10 * EPS_BF16


# Tensor parallelism splits the fused call's heads; under a pipeline each stage runs whole
# layers, as under data parallelism: the wider sweep (`-m exhaustive`).
@pytest.mark.parametrize("layout", ["tp", pytest.param("pp", marks=pytest.mark.exhaustive)])
def test_xla_attention_under_model_parallelism_matches_data_parallel(layout):
    """TP runs the fused call on each device's 2 of the 4 heads; the pipeline on each
    stage's layer. Same checks and tolerances as the layout matrix, against the
    data-parallel step with the same attention (which `test_xla_attention_matches_einsum`
    ties to the einsum path)."""
    matrix.assert_matches(matrix.run("dp", "fp32", False, "none", attention="xla"),
                          matrix.run(layout, "fp32", False, "none", attention="xla"), "fp32")


def test_cudnn_on_cpu_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    code = cli_errors._main("shardmap", cli_errors.BASE + ["--attention", "cudnn"])
    cli_errors._assert_one_line(code, capsys.readouterr().err,
                                "--attention cudnn needs an NVIDIA GPU (cuDNN); this run is on "
                                "cpu")


def test_cudnn_needs_a_16_bit_compute_dtype():
    """On a GPU, cuDNN's kernel takes bf16 / fp16 only: float32 is refused before any
    compile (checked here by naming the platform)."""
    parser = cli.build_parser("test")
    args = cli.parse_args(parser, ["--model", "vit-cifar", "--attention", "cudnn",
                                   "--dtype", "fp32"])
    with pytest.raises(UsageError, match="--attention cudnn needs a 16-bit compute dtype"):
        settings.step_config(args, platform="gpu")
    args.dtype = "bf16"
    sc = settings.step_config(args, platform="gpu")
    assert sc.execution.attention == "cudnn"
    assert dataclasses.replace(sc, execution=sc.execution.replace(attention="einsum")) != sc


def test_cudnn_needs_a_head_dim_it_takes():
    """cuDNN's kernel takes head dims that are multiples of 8 up to 128: the tiny model's
    6 is refused in one line when asked for, and not chosen as the GPU default."""
    parser = cli.build_parser("test")
    args = cli.parse_args(parser, ["--model", "tiny", "--attention", "cudnn", "--dtype", "bf16"])
    with pytest.raises(UsageError, match="needs a head dim that is a multiple of 8, at most "
                                         "128; --model tiny has 6"):
        settings.step_config(args, platform="gpu")
    args = cli.parse_args(parser, ["--model", "tiny", "--dtype", "bf16"])
    gpu = type("Gpu", (), {"compute_capability": "9.0"})()
    assert settings.step_config(args, platform="gpu", device=gpu).execution.attention == "einsum"
    args = cli.parse_args(parser, ["--model", "vit-cifar", "--dtype", "bf16"])
    assert settings.step_config(args, platform="gpu", device=gpu).execution.attention == "cudnn"


def test_lsa_model_runs_on_the_einsum_attention(capsys, monkeypatch):
    """Locality self-attention (ViTConfig.lsa) is written on the einsum path only: asking
    for a fused one is a one-line usage error, and on a GPU the default stays einsum."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    code = cli_errors._main("shardmap", cli_errors.BASE + ["--model", "vit-cifar-conv-lsa",
                                                           "--attention", "xla"])
    cli_errors._assert_one_line(code, capsys.readouterr().err,
                                "--model vit-cifar-conv-lsa uses locality self-attention, "
                                "which runs on --attention einsum only, not xla")
    parser = cli.build_parser("test")
    args = cli.parse_args(parser, ["--model", "vit-cifar-conv-lsa", "--dtype", "bf16"])
    assert settings.step_config(args, platform="gpu").execution.attention == "einsum"


def _count_primitives(jaxpr, prefix: str) -> int:
    """Equations whose primitive's name starts with `prefix`, in `jaxpr` and every jaxpr
    nested in it (jit, checkpoint, custom VJP)."""
    return sum(eqn.primitive.name.startswith(prefix)
               + sum(_count_primitives(sub, prefix) for sub in jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


@pytest.mark.parametrize("remat, forwards", [("none", 1), ("block-save-dots", 1), ("block", 2)])
def test_remat_keeps_the_cudnn_attention_forward(monkeypatch, remat, forwards):
    """"block-save-dots" saves cuDNN's attention outputs (the context and the softmax
    statistics), so the backward pass runs cuDNN's backward kernel without a second
    forward kernel, as with no remat; "block" recomputes everything, the forward kernel
    included, which shows the count sees a recompute. The training step's gradient is
    traced, not compiled: JAX's cuDNN version and GPU checks are stubbed, so this runs
    on a CPU."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    monkeypatch.setattr(cudnn_attention, "check_cudnn_version", lambda: 91900)
    monkeypatch.setattr(cudnn_attention, "check_compute_capability", lambda _: True)
    cfg = ONE_LAYER.replace(heads=3)  # head dim 8: cuDNN takes multiples of 8
    policy = Policy.parse("p=f32,c=bf16,o=f32,m=bf16")
    images = jnp.zeros((2, 32, 32, 3), jnp.float32)

    def loss(params):
        logits = apply(params, images, cfg, policy, train=True, rng=jax.random.key(3),
                       execution=Execution(attention="cudnn", remat=remat,
                                           last_block="all"))  # one layer: the last
        return jnp.sum(logits.astype(jnp.float32))

    params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    grad = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    assert _count_primitives(grad, "dot_product_attention_fwd") == forwards
    assert _count_primitives(grad, "dot_product_attention_bwd") == 1
