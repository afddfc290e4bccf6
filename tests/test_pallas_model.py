"""The model with its Pallas kernels computes the XLA path's loss and gradients.

Both sets on at once (`--mlp-kernels pallas`, `--qkv-projection pallas`, with the fused
attention "xla", which a CPU runs): a CPU runs each kernel's whole-array branch, so this
checks the custom VJPs around the kernels (tests/test_mlp_kernel.py and
tests/test_qkv_kernel.py check the kernels themselves against the formulas):

* on one device, unrolled and under a layer scan with `block-save-dots`;
* under tensor parallelism, FSDP and a pipeline in the train script's shard_map (each
  device's kernels see its heads' and hidden units' columns), against one device, with
  the same collectives at the same lines as the XLA path: the kernels add none;
* with shapes the tiles do not fit, the program is the reference one.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST, grads_step
from test_collective_sites import collective_sites, misplaced

import train_shardmap as ts
from vit_pure import model, step
from vit_pure.config import PRESETS, Execution
from vit_pure.pallas import failures, qkv
from vit_pure.pallas import mlp as mlp_kernels
from vit_pure.pallas.common import Tiling
from vit_pure.policy import LossScale, Policy
from vit_pure.run import backend, cli

# Sizes both kernels' tiles fit: E 64, 4 heads of 16, M 64 (16 a device under TP over 4);
# 17 tokens (24 padded): 16 examples make 272 MLP rows and 384 padded rows, both
# multiples of 16.
CFG = PRESETS["tiny"].replace(name="pallas-model-test", width=64, heads=4, mlp_dim=64,
                              depth=2, drop_path=0.0)
XLA = Execution(attention="xla")
PALLAS = XLA.replace(mlp_kernels="pallas", qkv_projection="pallas")
KERNELS = {"gelu_fc2_forward": 1, "gelu_fc2_backward": 1, "gelu_fc2_weight_gradient": 1,
           "qkv_projection": 1, "qkv_input_gradient": 1}  # each, once a layer


def _kernels(jaxpr) -> collections.Counter:
    """How many times each kernel is called in a jaxpr: the `name=` parameter of its
    pallas_call equations."""
    text = str(jaxpr)
    return collections.Counter({name: len(re.findall(rf"\sname={name}(?!\w)", text))
                                for name in KERNELS})


def _loss_and_grads(execution, batch):
    params = model.init_params(jax.random.key(0), CFG)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(batch, 32, 32, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, batch))

    def loss(p):
        logits = model.apply(p, images, CFG, Policy(), train=True, rng=jax.random.key(1),
                             example_ids=jnp.arange(batch), execution=execution)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(batch), labels])

    calls = _kernels(jax.make_jaxpr(jax.grad(loss))(params))
    return jax.jit(jax.value_and_grad(loss)).lower(params).compile(FAST)(params), calls


def _assert_close(got, want, msg=""):
    scale = math.sqrt(sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(want)))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale,
                                   err_msg=f"{msg} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("scan, remat", [(False, "none"), (True, "block-save-dots")])
def test_model_gradients_equal_the_xla_path(scan, remat):
    (loss, grads), calls = _loss_and_grads(PALLAS.replace(scan=scan, remat=remat), 16)
    (want_loss, want), none = _loss_and_grads(XLA.replace(scan=scan, remat=remat), 16)
    # Each kernel once a layer in the trace (the scan traces its body once).
    assert calls == {name: n * (1 if scan else CFG.depth) for name, n in KERNELS.items()}
    assert not +none
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    _assert_close(grads, want)


def test_shapes_the_tiles_do_not_fit_run_the_reference_path():
    """One example: 17 MLP rows and 24 padded rows, neither a multiple of 16."""
    (_, grads), calls = _loss_and_grads(PALLAS, 1)
    (_, want), _ = _loss_and_grads(XLA, 1)
    assert not +calls
    _assert_close(grads, want)


@pytest.mark.parametrize("mesh, fsdp", [("data=4,model=2", False), ("data=2,model=4", False),
                                        ("data=2,pipe=2,model=2", True)])
def test_tensor_parallel_gradients_equal_one_device(mesh, fsdp):
    """The train script's shard_map gradients with the kernels equal one device's with the
    XLA path (float32). Batch 64: 16 or 32 examples a device; with the pipeline, two
    microbatches of 16 a device, and FSDP gathering the weights before the kernels."""
    sc = step.StepConfig(CFG, Policy(), execution=PALLAS)
    optimizer = step.make_optimizer(step.OptimConfig(warmup_steps=1), 1)[0]
    state = jax.device_get(step.init_state(jax.random.key(0), CFG, sc.policy, optimizer))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, (64,), dtype=np.int32)
    ids, key = np.arange(64, dtype=np.int32), step.step_key(0, 0, 0)

    reference = dataclasses.replace(sc, execution=XLA)
    want, _ = jax.jit(lambda p: step.local_grads(
        reference, p, LossScale.create(dynamic=False), images, labels, ids, key)
    ).lower(state["params"]).compile(FAST)(state["params"])

    strategy = ts.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp)
    args = (strategy.put_state(state), *strategy.put_batch(images, labels, ids),
            strategy.put_replicated(key))
    grads_of = grads_step(strategy)
    jaxpr = jax.make_jaxpr(grads_of)(*args)
    assert set(+_kernels(jaxpr)) == set(KERNELS)  # the pipeline traces its stage more than once
    grads, _ = grads_of.lower(*args).compile(FAST)(*args)
    _assert_close(jax.device_get(grads), jax.device_get(want), mesh)
    # The same collectives as the XLA path's, all where the code writes them.
    xla = ts.ShardMapStrategy(reference, optimizer, mesh, fsdp=fsdp)
    sites = collective_sites(jaxpr)
    assert sites and not misplaced(sites)
    assert sites == collective_sites(jax.make_jaxpr(grads_step(xla))(*args))


def _refused(*args, **kwargs):
    raise ValueError("The Pallas Triton lowering currently requires that all operations "
                     "have array arguments and results whose size is a power of 2.\n"
                     "Encountered an array of shape (24, 24)")


def test_a_kernel_the_device_refuses_is_one_line_and_exit_2(monkeypatch, capsys):
    """The train script asked for the kernels, on a device whose compiler refuses one
    (here: the forward kernel's entry raises what Triton's lowering raises), from inside
    `--accum-steps auto`'s compile: one line naming the kernel, the error's first line
    and the flag that turns it off; exit code 2, no traceback."""

    chosen = backend.step_config

    def pallas_step_config(args, **kw):  # as an NVIDIA GPU would resolve the flags
        sc = chosen(args, **kw)
        return dataclasses.replace(sc, cfg=CFG, execution=sc.execution.replace(
            mlp_kernels="pallas"))

    monkeypatch.setattr(backend, "step_config", pallas_step_config)
    # start_runtime writes XLA_FLAGS (--cpu-devices): put it back afterwards.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.setattr(mlp_kernels, "_forward_call", _refused)
    # Batch 384: MLP rows a multiple of 16 a device whether the process has 1 device or
    # conftest's 8 (--cpu-devices cannot change a backend already started), so that the
    # kernels' tiles fit; the failure comes as the step is traced, before any compile.
    code = cli.main_guard(lambda: ts.main([
        "--model", "tiny", "--dataset", "synthetic", "--batch", "384", "--steps", "1",
        "--accum-steps", "auto", "--cpu-devices", "1", "--log-every", "1"]))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "Traceback" not in err[0]
    assert err[0].startswith("error: the Pallas kernel gelu_fc2_forward (--mlp-kernels pallas)")
    assert "ValueError: The Pallas Triton lowering currently requires" in err[0]
    assert "(24, 24)" not in err[0]  # the first line only
    assert err[0].endswith("--mlp-kernels xla turns it off")


def test_a_real_triton_lowering_error_names_its_kernel():
    """The kernel lowered for CUDA (no GPU needed to lower) at a tiling Triton refuses (24
    rows a block): the error as Pallas raises it is traced back to the kernel by name."""
    x = jnp.zeros((48, 32), jnp.bfloat16)
    w3, b3 = jnp.zeros((32, 3, 32), jnp.bfloat16), jnp.zeros((3, 1, 32))
    call = functools.partial(qkv._projection_call, fit=Tiling(24, 32, 32, 3, 4, 1),
                             out_dtype=jnp.bfloat16, precision=None, interpret=False)
    with pytest.raises(Exception) as caught:
        jax.jit(call).trace(x, w3, b3).lower(lowering_platforms=("cuda",))
    line = failures.failure_line(caught.value)
    assert line is not None and "qkv_projection (--qkv-projection pallas)" in line, line
    assert line.endswith("--qkv-projection xla turns it off") and "\n" not in line
    assert failures.failure_line(ValueError("an unrelated bug")) is None
