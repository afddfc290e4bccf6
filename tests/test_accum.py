"""Gradient accumulation (--accum-steps) and rematerialisation (--remat) change memory, not
results.

* `step.local_grads` with K micro-batches, with and without remat, returns the gradients
  of the one-pass reference (single device, float32 tolerance). The tiny model has dropout
  and stochastic depth on, so a micro-batch that lost track of its examples' global ids
  would draw other masks and fail.
* The scripts' real train steps, 3 optimizer steps with K micro-batches (pmap, shard_map
  data=8, shard_map data=4,model=2), end at the reference's parameters (the tiny model two
  blocks deep: remat and the micro-batch loop work per block, and it compiles faster).
* One gradient reduction over 'data' per optimizer step whatever K is: counted in the
  jaxpr (which says where each collective sits, inside a loop or not) and in the lowered
  StableHLO (see `test_one_gradient_all_reduce_per_step`).
* Bad K is a one-line UsageError; `--accum-steps auto` picks K=1 with plenty of memory
  and a larger K under a small (injected) budget; remat really saves memory.
"""
import dataclasses
import functools
import logging

import jax
import numpy as np
import optax
import pytest
from jax.extend import core as jax_core

import train_pmap
import train_shardmap
from vit_pure import PRESETS, Policy, step
from vit_pure.config import Execution
from vit_pure.policy import LossScale
from vit_pure.run import accum, cli
from vit_pure.run.settings import RunConfig, step_config

settings = RunConfig.from_args  # the frozen settings the scripts build from the flags

# dropout 0.1 and drop path 0.1: per-example randomness is on; two blocks, not four.
CFG = PRESETS["tiny"].replace(name="accum-test", depth=2)
BATCH = 32  # 8 devices x 4 examples: K in {1, 2, 4}
IMAGE_SHAPE = (32, 32, 3)  # what the loop feeds: CIFAR-10's images


def _batch(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, CFG.num_classes, (n,), dtype=np.int32)
    return images, labels, np.arange(n, dtype=np.int32)


def _max_rel_diff(a, b):
    """Largest |a - b| over all leaves, relative to the largest |b|."""
    diff = max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    scale = max(float(np.max(np.abs(np.asarray(y, np.float32)))) for y in jax.tree.leaves(b))
    return diff / scale


# ------------------------------------------------------------------ local_grads (1 device)
LOCAL_BATCH = 16
# Stochastic depth only: its per-example masks come from the same per-example keys as
# dropout's, and the model compiles in about half the time without dropout's masks.
# Four blocks, for test_remat_saves_memory.
LOCAL_CFG = PRESETS["tiny"].replace(dropout=0.0, drop_path=0.2)


@functools.lru_cache(maxsize=None)
def _compiled_local_grads(accum_steps: int, remat: str):
    """jit(local_grads) for one (K, remat), compiled once and shared by the tests."""
    # The layer scan: remat's saving shows in the stacked per-layer residuals (unrolled,
    # XLA:CPU's scheduler may keep them alive anyway); results are the same either way.
    sc = step.StepConfig(LOCAL_CFG, Policy(), execution=Execution(scan=True, remat=remat),
                         accum_steps=accum_steps)
    images, labels, ids = _batch(seed=1, n=LOCAL_BATCH)
    params = step.init_params(jax.random.key(0), LOCAL_CFG)
    args = (params, LossScale.create(dynamic=False), images, labels, ids + 100,
            step.step_key(0, 0, 7))
    fn = jax.jit(lambda p, ls, *rest: step.local_grads(sc, p, ls, *rest))
    return fn.lower(*args).compile(), args


def _local_grads(accum_steps, remat):
    compiled, args = _compiled_local_grads(accum_steps, remat)
    return compiled(*args)


@pytest.mark.parametrize("accum_steps,remat", [
    (2, "none"), pytest.param(4, "none", marks=pytest.mark.exhaustive), (1, "block"),
    (1, "block-save-dots"),
    (1, "block-save:ln+gelu+mask")])
def test_local_grads_match_one_pass(accum_steps, remat):
    ref_grads, ref_metrics = _local_grads(1, "none")
    grads, metrics = _local_grads(accum_steps, remat)
    # float32, 16 examples: only the order of the float sums differs (measured ~5e-7).
    assert _max_rel_diff(grads, ref_grads) < 1e-5
    for k in ("loss", "accuracy"):
        np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-6)
    # Not vacuous: the gradients are far from zero, and other dropout masks change them.
    assert max(float(np.max(np.abs(np.asarray(g)))) for g in jax.tree.leaves(ref_grads)) > 1e-2


def test_remat_saves_memory():
    """XLA's own memory analysis of the gradient computation: recomputing each block
    keeps less than keeping its matmul outputs, which keeps less than no remat."""
    temp = {r: _compiled_local_grads(1, r)[0].memory_analysis().temp_size_in_bytes
            for r in ("none", "block-save-dots", "block")}
    assert temp["none"] > temp["block-save-dots"] > temp["block"], temp


def test_local_grads_rejects_k_not_dividing_the_batch():
    sc = step.StepConfig(CFG, Policy(), accum_steps=3)
    images, labels, ids = _batch(n=8)
    with pytest.raises(ValueError, match="per-device batch 8 does not divide into 3"):
        jax.eval_shape(lambda p: step.local_grads(
            sc, p, LossScale.create(dynamic=False), images, labels, ids, step.step_key(0, 0, 0)),
            step.init_params(jax.random.key(0), CFG))


# ------------------------------------------------------------- the scripts' train steps
def _strategy(kind, sc, optimizer, mesh=None, fsdp=False):
    if kind == "pmap":
        return train_pmap.PmapStrategy(sc, optimizer)
    return train_shardmap.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp)


def _three_steps(kind, mesh, accum_steps, remat, fsdp=False):
    """Params and losses after 3 optimizer steps of a script's real train step."""
    # SGD with momentum rather than Adam: Adam divides by sqrt(v), which blows the
    # last-bit differences of near-zero gradients up to learning-rate size.
    optimizer = optax.sgd(0.1, momentum=0.9)
    sc = step.StepConfig(CFG, Policy(), execution=Execution(remat=remat),
                         accum_steps=accum_steps)
    strategy = _strategy(kind, sc, optimizer, mesh, fsdp)
    state = strategy.put_state(step.init_state(jax.random.key(0), CFG, sc.policy, optimizer))
    losses = []
    for i in range(3):
        key = strategy.put_replicated(step.step_key(0, 0, i))
        state, metrics = strategy.train_step(state, *strategy.put_batch(*_batch(seed=i)), key)
        losses.append(strategy.metrics_to_host(metrics)["loss"])
    return strategy.host_state(state)["params"], losses


@pytest.fixture(scope="module")
def reference_three_steps():
    return _three_steps("shard_map", "data=8", 1, "none")


@pytest.mark.parametrize("kind,mesh,accum_steps,remat,fsdp", [
    ("pmap", None, 2, "none", False),
    # K=4 with block remat is the FSDP row's too: data=8 alone is the wider sweep.
    pytest.param("shard_map", "data=8", 4, "block", False, marks=pytest.mark.exhaustive),
    ("shard_map", "data=4,model=2", 2, "block-save-dots", False),
    # FSDP: each micro-batch gathers the weights and reduce-scatters its own gradients.
    ("shard_map", "data=4,model=2", 4, "block", True),
])
def test_three_steps_match_reference(reference_three_steps, kind, mesh, accum_steps, remat,
                                     fsdp):
    ref_params, ref_losses = reference_three_steps
    params, losses = _three_steps(kind, mesh, accum_steps, remat, fsdp)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert _max_rel_diff(params, ref_params) < 1e-5
    # The parameters moved: a step that did nothing would not match by accident.
    init = step.init_params(jax.random.key(0), CFG)
    assert _max_rel_diff(params, init) > 1e-3


# ------------------------------------------------------------- one all-reduce per step
def _reductions(jaxpr, in_loop=False):
    """(primitive, axes, inside a loop?) of every psum-like equation, nested jaxprs too."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name.startswith("psum") or name in ("reduce_scatter", "pmax", "pmin"):
            axes = eqn.params.get("axes", eqn.params.get("axis_name"))
            out.append((name, tuple(axes) if isinstance(axes, (tuple, list)) else (axes,),
                        in_loop))
        loop = in_loop or name in ("scan", "while")
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax_core.ClosedJaxpr):
                    out += _reductions(sub.jaxpr, loop)
                elif isinstance(sub, jax_core.Jaxpr):
                    out += _reductions(sub, loop)
    return out


def _train_step_program(kind, mesh, accum_steps):
    # RandAugment off: it has no collectives, and it triples the time to trace the step.
    args = cli.parse_args(train_shardmap.build_parser(), ["--model", "tiny", "--randaugment", "0"])
    sc = dataclasses.replace(step_config(args), accum_steps=accum_steps)
    optimizer = optax.sgd(0.1, momentum=0.9)
    strategy = _strategy(kind, sc, optimizer, mesh)
    inputs = accum.train_step_inputs(strategy, sc, optimizer, BATCH, IMAGE_SHAPE)
    jaxpr = jax.make_jaxpr(strategy.train_step)(*inputs).jaxpr
    lowered = strategy.train_step.lower(*inputs).as_text()
    accum.free(inputs)
    return _reductions(jaxpr), lowered


@pytest.mark.parametrize("kind,mesh", [
    ("pmap", None), ("shard_map", "data=8"), ("shard_map", "data=4,model=2")])
def test_one_gradient_all_reduce_per_step(kind, mesh):
    """The gradient reduction over 'data' is written once per optimizer step, outside the
    micro-batch loop, so its count does not grow with K.

    Which count is exact: the jaxpr lists every collective the code writes, with its mesh
    axes and whether it sits inside a loop (`scan`), so "no 'data' reduction inside a
    loop, and as many as there are gradient arrays plus the 2 metrics" is exact. The
    lowered StableHLO has one `stablehlo.all_reduce` per reduced array too, but a loop
    body appears in it once however often it runs, so its count alone cannot tell a
    per-step reduction from a per-micro-batch one; it is checked to be the same for every
    K. The compiled HLO (`all-reduce(`) is what finally runs, after XLA's combiner merges
    the per-array all-reduces into a few; its count is backend-dependent, so not used.
    (Tensor parallelism adds 'model' all-reduces inside the loops: one forward and one
    backward per row/column-parallel pair, per layer, per micro-batch, as it must.)
    """
    n_grad_arrays = len(jax.tree.leaves(step.init_params(jax.random.key(0), PRESETS["tiny"])))
    programs = {k: _train_step_program(kind, mesh, k) for k in (1, 4)}
    for k, (reductions, stablehlo) in programs.items():
        over_data = [r for r in reductions if "data" in r[1]]
        assert not [r for r in over_data if r[2]], f"K={k}: a 'data' reduction inside a loop"
        assert len(over_data) == n_grad_arrays + 2, (k, over_data)  # + loss and accuracy
    assert programs[1][1].count("stablehlo.all_reduce") == \
        programs[4][1].count("stablehlo.all_reduce")
    assert programs[4][1].count("stablehlo.while") > programs[1][1].count("stablehlo.while")


# ---------------------------------------------------------------- batch rules, bad K, auto K
def _no_log(*_, **__):
    pass


def test_batch_must_split_over_processes_and_devices(monkeypatch):
    assert accum.per_device_batch(4096, 8) == 512
    assert accum.per_device_batch(24, 3) == 8
    for batch, n, flag, needles in [
            (100, 8, "--batch", ["--batch 100 is not divisible by the 8 data-parallel devices",
                                 "96 or 104"]),
            (0, 8, "--eval-batch", ["--eval-batch must be positive"]),
            (-8, 8, "--batch", ["--batch must be positive"])]:
        with pytest.raises(cli.UsageError) as e:
            accum.per_device_batch(batch, n, flag)
        assert "\n" not in str(e.value) and all(x in str(e.value) for x in needles), e.value
    monkeypatch.setattr(accum.jax, "process_count", lambda: 3)
    with pytest.raises(cli.UsageError, match="--batch 32 is not divisible by the 3 processes"):
        accum.per_device_batch(32, 8)


def test_bad_accum_steps_is_a_usage_error():
    with pytest.raises(cli.UsageError, match=r"--accum-steps 3 does not divide the per-device "
                       r"batch 4 .* use one of 1, 2, 4"):
        accum.check_accum_steps(3, BATCH, 8)
    args = cli.parse_args(train_shardmap.build_parser(), [
        "--model", "tiny", "--batch", str(BATCH), "--accum-steps", "8"])
    with pytest.raises(cli.UsageError, match="per-device batch 4"):
        accum.build_strategy(settings(args), step_config(args), train_pmap.PmapStrategy,
                             optax.sgd(0.1, momentum=0.9), image_shape=IMAGE_SHAPE,
                             log=_no_log)
    args = cli.parse_args(train_shardmap.build_parser(), [
        "--model", "tiny", "--batch", str(BATCH), "--eval-batch", "12"])
    with pytest.raises(cli.UsageError, match="--eval-batch 12 is not divisible by the 8"):
        accum.build_strategy(settings(args), step_config(args), train_pmap.PmapStrategy,
                             optax.sgd(0.1, momentum=0.9), image_shape=IMAGE_SHAPE,
                             log=_no_log)


def test_auto_candidates_respect_the_pipeline_micro_batches():
    sc = step.StepConfig(CFG, Policy())
    strategy = train_shardmap.ShardMapStrategy(sc, optax.sgd(0.1), "data=4,pipe=2",
                                               microbatches=4)
    # 64 over data=4: 16 per device; each accumulation step must still hold 4 micro-batches.
    assert [k for k in accum.candidates(16) if accum._allows(strategy, 64, k)] == [1, 2, 4]


@pytest.mark.parametrize("flag", ["0", "-2", "two"])
def test_accum_steps_flag_rejects_garbage(flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(train_shardmap.build_parser(), ["--accum-steps", flag])
    assert e.value.code == 2
    assert "--accum-steps" in capsys.readouterr().err


def test_accum_steps_flag_default_is_auto():
    args = cli.parse_args(train_shardmap.build_parser(), [])
    assert args.accum_steps == "auto"
    assert step_config(args).accum_steps == 1  # until build_strategy chooses


def test_explicit_accum_steps_reach_the_factory_as_a_value():
    args = cli.parse_args(train_shardmap.build_parser(), ["--model", "tiny", "--accum-steps", "4"])
    sc = step_config(args)
    seen = []

    def make_strategy(sc, optimizer):
        seen.append(sc)
        return train_pmap.PmapStrategy(sc, optimizer)
    strategy, got = accum.build_strategy(settings(args), sc, make_strategy, optax.sgd(0.1),
                                         image_shape=IMAGE_SHAPE, log=_no_log)
    assert [s.accum_steps for s in seen] == [4] and got is strategy.sc is seen[0]
    assert got == dataclasses.replace(sc, accum_steps=4)
    assert args.accum_steps == 4 and sc.accum_steps == 1  # neither args nor sc is written


@functools.lru_cache(maxsize=None)
def _auto(budget_gib):
    """--accum-steps auto with an injected --memory-budget; (K, its log record)."""
    args = cli.parse_args(train_shardmap.build_parser(), [
        "--model", "tiny", "--batch", "64", "--mesh", "data=8", "--randaugment", "0",
        "--memory-budget", repr(budget_gib)])
    # No dropout or RandAugment here: the choice is measured either way, and each halves
    # the compile time.
    sc = dataclasses.replace(step_config(args),
                             cfg=CFG.replace(dropout=0.0, drop_path=0.0))
    records = []
    strategy, sc = accum.build_strategy(
        settings(args), sc, lambda sc, opt: train_shardmap.ShardMapStrategy(sc, opt, args.mesh),
        optax.sgd(0.1, momentum=0.9), image_shape=IMAGE_SHAPE,
        log=lambda text, **record: records.append(record))
    assert strategy.sc is sc and args.accum_steps == "auto"
    record = [r for r in records if r.get("event") == "accum_steps"][0]
    assert record["accum_steps"] == sc.accum_steps
    # The budget is the flag's, shared by the 8 devices.
    assert record["budget_bytes_per_device"] == budget_gib * accum.GiB / 8
    return sc.accum_steps, record


def test_auto_picks_one_micro_batch_when_memory_is_plentiful():
    k, record = _auto(1000.0)
    assert k == 1 and record["compiled"] == [1]


def test_auto_picks_more_micro_batches_under_a_small_budget():
    _, plenty = _auto(1000.0)
    one_pass = plenty["estimate_bytes_per_device"]
    k, record = _auto((one_pass - 1) * 8 / accum.GiB)  # K=1 is one byte too big
    assert k > 1 and record["compiled"][0] == 1
    assert record["estimate_bytes_per_device"] <= one_pass - 1


def test_auto_budget_can_be_injected():
    budget = accum.Budget(1e12, "test")
    args = cli.parse_args(train_shardmap.build_parser(), ["--model", "tiny", "--batch", "64"])
    assert accum.resolve_budget(args.memory_budget, budget) is budget
    args = cli.parse_args(train_shardmap.build_parser(), ["--memory-budget", "2"])
    assert accum.resolve_budget(args.memory_budget, None).bytes_per_device == 2 * accum.GiB / 8
    with pytest.raises(SystemExit):
        cli.parse_args(train_shardmap.build_parser(), ["--memory-budget", "0"])


def test_budget_on_cpu_shares_host_ram_between_devices(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   16000000 kB\n")
    devices = jax.local_devices()
    budget = accum.device_budget(devices[:4], safety=0.5, meminfo=str(meminfo))
    assert budget.bytes_per_device == 0.5 * 16000000 * 1024 / 4
    assert "4 local devices" in budget.source


def test_candidates_and_prediction():
    assert accum.candidates(12) == [1, 2, 3, 4, 6, 12]
    # bytes(K) = a + b / K is exact for affine data: a = 100, b = 800.
    measured = [accum.StepMemory(k, 0, 0, 0, 100 + 800 // k) for k in (1, 2)]
    assert accum._predict(measured, 8) == pytest.approx(200)


# Every preset; the 32-pixel ones other than the default share vit-cifar's geometry and run
# with the slow tests.
AUTO_PRESETS = [pytest.param(name, marks=() if name == "vit-cifar" or PRESETS[name].image_size
                             != 32 else (pytest.mark.slow,)) for name in sorted(PRESETS)]


@pytest.mark.parametrize("preset", AUTO_PRESETS)
def test_auto_measures_the_program_the_loop_runs(preset, monkeypatch):
    """`--accum-steps auto` compiles the train step for the images the loop feeds (32x32
    CIFAR-10 images, resized on the device for the 224-pixel presets), so the loop's first
    step reuses that compile: one compilation of the train step in the whole run. Each
    preset keeps its input geometry (image size, patch size, classes) but is made narrow
    and one block deep, to compile in seconds."""
    narrow = PRESETS[preset].replace(width=16, depth=1, heads=2, mlp_dim=16)
    monkeypatch.setattr(cli, "get_preset", lambda name: narrow)
    compiles = []

    class Count(logging.Handler):
        def emit(self, record):
            if "Finished XLA compilation of jit(train_step)" in record.getMessage():
                compiles.append(record.getMessage())

    handler = Count()
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            train_shardmap.main([
                "--model", preset, "--dataset", "synthetic", "--synthetic-train", "16",
                "--synthetic-val", "0", "--synthetic-test", "0", "--batch", "8",
                "--steps", "1", "--accum-steps", "auto", "--memory-budget", "100",
                "--randaugment", "0", "--no-final-eval", "--no-progress"])
    finally:
        logging.getLogger("jax").removeHandler(handler)
    assert len(compiles) == 1, compiles
