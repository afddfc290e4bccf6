"""The communication plan (`--plan N`, vit_pure/plan/build.py) against closed forms and runs.

Each layout's step is compiled once (module fixtures) with the tiny model on the 8 fake
devices of conftest.py, built for an H100 target (bf16 matmul outputs), without the
augmentation (which holds no collective and only slows the compile). What is checked:

* the bytes and counts of every layout's collectives against closed forms: data
  parallel (pmap), FSDP, tensor parallel, pipeline, and trip counts under --scan and
  gradient accumulation;
* the dtype correction: XLA:CPU upcasts bf16 all-reduces to f32, the plan counts bf16;
* predicted against measured: the collectives of the compiled program, run under the
  profiler on the 8 fake devices, execute exactly `count` times, and the gradient
  all-reduce moves exactly the bytes of the placed parameters;
* the cost formulas against published nccl-tests output;
* one compile for 64 devices, in a fresh process, through the script's command line.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import math
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import subprocess_env

import train_pmap
import train_shardmap as ts
from benchmarks import bench
from vit_pure import layout, step
from vit_pure.config import PRESETS, Execution
from vit_pure.model import count_params, init_params
from vit_pure.pipeline import schedules, tick
from vit_pure.plan import collectives, targets
from vit_pure.plan import interconnect as ic
from vit_pure.run import cli, settings
from vit_pure.run import planning as plan
from vit_pure.run.settings import RunConfig
from vit_pure.xla import flops, hlo

REPO = pathlib.Path(__file__).resolve().parents[1]
CFG = PRESETS["tiny"]  # T = 17 tokens, E = 24, depth 4
T, E, L = CFG.seq_len, CFG.width, CFG.depth
BATCH = 16
H100 = ic.HARDWARE["h100"]


def _line(path: str, text: str) -> str:
    """'file:line' of the one line of `path` containing `text` (plan sources look so)."""
    lines = (REPO / path).read_text().splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (path, text, hits)
    return f"{path}:{hits[0]}"


def _setup(*flags, accum_steps=1):
    args = cli.parse_args(ts.build_parser(), ["--model", "tiny", "--batch", str(BATCH),
                                              "--dtype", "bf16", "--dropout", "0",
                                              "--drop-path", "0", *flags])
    sc = settings.step_config(args, platform=H100.platform)
    sc = dataclasses.replace(sc, augment=False, accum_steps=accum_steps)
    return sc, step.make_optimizer(RunConfig.from_args(args).schedule.optim, 100)[0]


def _shardmap_plan(mesh, *flags, fsdp=False, microbatches=None, accum_steps=1):
    sc, opt = _setup(*flags, accum_steps=accum_steps)
    strategy = ts.ShardMapStrategy(sc, opt, mesh, fsdp=fsdp, microbatches=microbatches)
    return plan.plan_step(strategy, opt, BATCH, H100, script="train_shardmap.py"), strategy


def _from(p, source_text, path):
    where = _line(path, source_text)
    return [c for c in p.collectives if c.source.split(" ")[0] == where]


@pytest.fixture(scope="module")
def dp():
    sc, opt = _setup()
    strategy = train_pmap.PmapStrategy(sc, opt, devices=jax.devices()[:8])
    return plan.plan_step(strategy, opt, BATCH, H100, script="train_pmap.py")


@pytest.fixture(scope="module")
def tp():
    return _shardmap_plan("data=2,model=4")


@pytest.fixture(scope="module")
def fsdp():
    return _shardmap_plan("data=8", fsdp=True)


@pytest.fixture(scope="module")
def pipe():
    return _shardmap_plan("data=2,pipe=4", microbatches=4)


@pytest.fixture(scope="module")
def loops():  # tensor parallel, layers under lax.scan, 2 accumulation micro-batches
    return _shardmap_plan("data=2,model=4", "--scan", accum_steps=2)


# --------------------------------------------------------------- closed forms per layout
def test_data_parallel_gradient_all_reduce_is_4_bytes_per_parameter(dp):
    grads = _from(dp, "grads = lax.pmean(grads, AXIS)", "train_pmap.py")
    n_params = count_params(jax.eval_shape(lambda: init_params(jax.random.key(0), CFG)))
    assert dp.params_per_device == n_params
    assert {(c.kind, c.axes, c.dtype, c.count) for c in grads} == {("all-reduce", "data", "f32", 1)}
    assert sum(c.nbytes for c in grads) == 4 * n_params
    # Nothing else crosses devices but the scalar metrics.
    others = [c for c in dp.collectives if c not in grads]
    assert others and all(c.nbytes <= 8 for c in others)
    # All of it fits one 30 MiB bucket of XLA:GPU's combiner: one call per step; with a
    # 1-byte bucket every array is its own call.
    assert dp.per_axis()["data"]["calls"] == 1
    module = hlo.parse_module(dp.compiled.as_text())
    calls = collectives.model_calls(module, dp.collectives, threshold=1)
    assert sum(calls.values()) == len(dp.collectives)


def test_program_flops_are_the_model_flops_but_one_unneeded_gradient(dp):
    """The dot ops of the compiled per-device program = bench.py's training count for the
    per-device batch, less the patch embedding's input gradient, which nothing needs, plus
    the ones columns through which `layers.linear.dense` adds its biases."""
    unneeded = 2 * CFG.num_patches * CFG.patch_dim * E
    per_device = BATCH // 8
    execution = Execution(last_block="class-token")  # the scripts' default
    assert dp.program_flops == (bench.train_flops_per_image(CFG, execution) - unneeded
                                + flops.bias_column_flops_per_image(CFG, True, execution)
                                - flops.outer_product_flops_per_image(CFG, execution)
                                ) * per_device
    assert dp.model_flops == bench.train_flops_per_image(CFG, execution) * per_device


def test_fsdp_gathers_and_scatters_each_weight_once(fsdp):
    p, strategy = fsdp
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), CFG))
    specs, leaves = jax.tree.leaves(strategy.param_specs, is_leaf=lambda x: isinstance(x, ts.P)), \
        jax.tree.leaves(shapes)
    on_data = [("data" in ts.mesh_axes(s), math.prod(x.shape)) for x, s in zip(leaves, specs)]
    sharded = sum(size for split, size in on_data if split)
    replicated = sum(size for split, size in on_data if not split)
    assert sharded > 0 and replicated > 0
    gathers = _from(p, "return lax.all_gather(shard.astype(dtype), DATA", "train_shardmap.py")
    # JAX records a custom VJP's backward ops at the forward's call site (make_gather's
    # call of fsdp_gather), not at the psum_scatter in _fsdp_gather_bwd.
    scatters = _from(p, "return x if axis is None else fsdp_gather(x, axis, dtype)",
                     "train_shardmap.py")
    # The whole weights, gathered in bf16 in the forward pass, their gradients
    # reduce-scattered in f32: V is the whole (unsharded) array.
    assert {(c.kind, c.axes, c.dtype) for c in gathers} == {("all-gather", "data", "bf16")}
    assert {(c.kind, c.axes, c.dtype) for c in scatters} == {("reduce-scatter", "data", "f32")}
    assert sum(c.nbytes * c.count for c in gathers) == 2 * sharded
    assert sum(c.nbytes * c.count for c in scatters) == 4 * sharded
    grads = _from(p, "lambda g, s: g if over_data(s) else lax.pmean(g, DATA)", "train_shardmap.py")
    assert sum(c.nbytes for c in grads) == 4 * replicated
    assert p.params_per_device == sharded // 8 + replicated


def test_tensor_parallel_four_activation_all_reduces_per_layer(tp):
    p, _ = tp
    b_local = BATCH // 2
    forward = _from(p, "return y if tp_axis is None else jax.lax.psum(y, tp_axis)",
                    "vit_pure/model.py")
    backward = _from(p, 'return x if tp_axis is None else jax.lax.pcast(x, tp_axis, to="varying")',
                     "vit_pure/model.py")
    # Each block's two branches, every token's row, but in the last block (on the class
    # token, the scripts' default): its output projection and MLP all-reduce one row an
    # example, and of its two inputs' gradients the MLP's is one row (the attention's,
    # from the keys and values, covers every token).
    rows, cls = b_local * T * E, b_local * E
    assert sorted(c.elements for c in forward) == sorted([rows] * (2 * L - 2) + [cls] * 2)
    assert sorted(c.elements for c in backward) == sorted([rows] * (2 * L - 1) + [cls])
    for c in forward + backward:
        assert (c.kind, c.axes, c.count) == ("all-reduce", "model", 1)
        # XLA:CPU compiled it in f32; the target reduces bf16 (the lowered program's dtype).
        assert (c.compiled_dtype, c.dtype, c.nbytes) == ("f32", "bf16", 2 * c.elements)
    assert any("_reduce_from_tp" in line and "counted as bf16" in line for line in p.corrections)
    # Every parameter is replicated over 'data' (its TP block): 4 bytes each, once.
    grads = _from(p, "lambda g, s: g if over_data(s) else lax.pmean(g, DATA)", "train_shardmap.py")
    assert {(c.axes, c.dtype, c.count) for c in grads} == {("data", "f32", 1)}
    assert sum(c.nbytes for c in grads) == 4 * p.params_per_device


def test_pipeline_one_permute_per_tick_each_way(pipe):
    p, _ = pipe
    S, K = 4, 4
    m = BATCH // 2 // K  # examples per micro-batch
    permutes = [c for c in p.collectives if c.kind == "collective-permute"]
    assert {(c.axes, c.dtype, c.nbytes) for c in permutes} == {("pipe", "bf16", 2 * m * T * E)}
    # GPipe's table: a send after each forward tick but the last, as many backward.
    assert sum(c.count for c in permutes) == 2 * (K + S - 2) == \
        tick.static_plan(schedules.build("gpipe", S, K)).sends()
    assert {c.source.split(" ")[0] for c in permutes} == {
        _line("vit_pure/pipeline/tick.py", "new = lax.ppermute(out, pipe_axis")}


def test_pipeline_schedule_in_the_plan(pipe):
    """The plan reports the schedule's table (bubble, activations held) and the compiled
    program's sends; the memory verdict names 1F1B where GPipe does not fit and it would."""
    p, _ = pipe
    table = schedules.build("gpipe", 4, 4)
    assert p.pipeline["bubble"] == pytest.approx(schedules.bubble(table))
    sends = sum(c.count for c in p.collectives if c.kind == "collective-permute")
    assert (f"pipeline: gpipe, 4 stages x 4 micro-batches, {table.ticks} ticks; bubble "
            f"{schedules.bubble(table):.3f}") in p.report()
    assert f"point-to-point: {sends} sends" in p.report()
    assert p.record()["pipeline"]["held"] == 4
    # K = 32: 1F1B holds 4 of 32 micro-batches (P - s on stage s); a card between its
    # estimate and GPipe's.
    many = dataclasses.replace(p, pipeline=schedules.summary("gpipe", 4, 32))
    est = many._one_f_one_b_bytes()
    assert est < many.memory_bytes
    gib = (est + many.memory_bytes) / 2 / 2**30
    small = dataclasses.replace(many, hardware=ic.with_overrides(H100, memory_gib=gib))
    assert "or --pipeline-schedule 1f1b: it holds 4 of 32" in small.verdict()[0]
    assert f"give {est / 2**30:.1f} GiB, which fits" in small.verdict()[0]
    tiny = dataclasses.replace(many, hardware=ic.with_overrides(H100, memory_gib=1e-6))
    assert "does not fit" in tiny.verdict()[0] and "1f1b" not in tiny.verdict()[0]


def test_scan_and_accumulation_multiply_by_trip_counts(loops):
    p, _ = loops
    K, b_micro = 2, BATCH // 2 // 2
    tp_ops = [c for c in p.collectives if c.axes == "model" and c.elements == b_micro * T * E]
    # One forward and one backward loop body, each with two all-reduces, run L - 1 times
    # per micro-batch, K micro-batches per step; the last block, on the class token, runs
    # once per micro-batch after the loop: its attention input's gradient over every
    # token, its other three all-reduces over one row an example.
    assert sorted(c.count for c in tp_ops) == [K] + [(L - 1) * K] * 4
    cls_ops = [c for c in p.collectives if c.axes == "model" and c.elements == b_micro * E]
    assert [c.count for c in cls_ops] == [K] * 3
    # The gradient all-reduce runs once per optimizer step, after the accumulation.
    grads = _from(p, "lambda g, s: g if over_data(s) else lax.pmean(g, DATA)", "train_shardmap.py")
    assert grads and all(c.count == 1 for c in grads)


# ------------------------------------------------------------- predicted vs measured
def _zero_inputs(strategy, sc, opt):
    """Zeros for the train step, placed as the training loop places its inputs."""
    shapes = jax.eval_shape(lambda: step.init_state(jax.random.key(0), sc.cfg, sc.policy, opt))
    state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    batch = (np.zeros((BATCH, *plan.DATASET_IMAGE_SHAPE), np.uint8),
             np.zeros((BATCH,), np.int32), np.arange(BATCH, dtype=np.int32))
    return (strategy.put_state(state), *strategy.put_batch(*batch),
            strategy.put_replicated(jax.random.key(0)))


def test_measured_run_executes_each_collective_count_times(loops, tmp_path):
    """Run the very executable the plan was read from on the 8 fake devices under the
    profiler: each collective op's events / 8 devices = its planned count; and the
    gradient all-reduce's bytes = the bytes of the parameters placed on a device."""
    p, strategy = loops
    sc, opt = strategy.sc, _setup()[1]
    inputs = _zero_inputs(strategy, sc, opt)
    placed = layout.bytes_per_device(inputs[0]["params"], strategy.mesh.devices.flat[0])
    with jax.profiler.trace(str(tmp_path)):
        jax.block_until_ready(p.compiled(*inputs))
    (trace,) = glob.glob(str(tmp_path / "plugins/profile/*/*.trace.json.gz"))
    events = collections.Counter(e.get("args", {}).get("hlo_op", e.get("name"))
                                 for e in json.load(gzip.open(trace))["traceEvents"]
                                 if e.get("ph") == "X")
    assert {c.name: events[c.name] / 8 for c in p.collectives} == \
        {c.name: c.count for c in p.collectives}
    grads = _from(p, "lambda g, s: g if over_data(s) else lax.pmean(g, DATA)", "train_shardmap.py")
    assert sum(c.nbytes for c in grads) == placed


# ------------------------------------------------------------------- cost formulas
def test_all_reduce_formula_reproduces_published_nccl_tests_run():
    """nccl-tests doc/PERFORMANCE.md: busbw = algbw x 2(n-1)/n for all-reduce, algbw = S/t.
    A published all_reduce_perf run on 16 H100 (github.com/lessizzmore/create-a3mega-ztan-fork,
    ztan-NCCL-test-result): 8 GiB (8589934592 B) in 47535 us at 338.82 GB/s busbw."""
    hw = dataclasses.replace(H100, intra=ic.Link(338.82e9))  # flat: the busbw algebra alone
    t = ic.transfer_seconds(ic.ALL_REDUCE, 8589934592, ic.Placement(16, 1), hw)
    assert t == pytest.approx(47535e-6, rel=1e-4)
    # The same run's bus bandwidth from its time, by the PERFORMANCE.md factor.
    assert 8589934592 / 47535e-6 * 2 * 15 / 16 / 1e9 == pytest.approx(338.82, rel=1e-4)


def test_permute_formula_reproduces_published_sendrecv_run():
    """nccl-tests sendrecv_perf on 8 NVLink A100 (github.com/li-plus/playground,
    cuda/nccl.md): 1 GiB in 5503.4 us at 195.10 GB/s (busbw = algbw for sendrecv)."""
    hw = dataclasses.replace(ic.HARDWARE["a100"], intra=ic.Link(195.10e9))
    t = ic.transfer_seconds(ic.PERMUTE, 1073741824, ic.Placement(2, 1), hw)
    assert t == pytest.approx(5503.4e-6, rel=1e-4)


def test_hierarchical_formula_worked_by_hand():
    flat = dataclasses.replace(H100, intra=ic.Link(370e9), inter=ic.Link(46e9))
    # 1 GB all-reduce over 16 H100 in 2 nodes, the stages pipelined:
    # 2 x max(1e9 x 7/(8 x 370e9), 1e9/8 x 1/(2 x 46e9)).
    t = ic.transfer_seconds(ic.ALL_REDUCE, 1e9, ic.Placement(16, 2), flat)
    assert t == pytest.approx(2 * max(2.364865e-3, 1.358696e-3), rel=1e-6)
    # The flat rings at either end; all-gather is half an all-reduce.
    assert ic.transfer_seconds(ic.ALL_GATHER, 1e9, ic.Placement(8, 8), flat) == \
        pytest.approx(1e9 * 7 / (8 * 46e9))
    assert ic.transfer_seconds(ic.ALL_GATHER, 1e9, ic.Placement(8, 1), flat) == \
        pytest.approx(1e9 * 7 / (8 * 370e9))
    assert ic.wire_bytes(ic.ALL_REDUCE, 800, 8) == 1400
    assert ic.placement([[0, 4, 8, 12], [1, 5, 9, 13]], 8) == ic.Placement(4, 2, 2, 2, 2, 2)


def test_replica_groups_map_to_mesh_axes():
    mesh = {"data": 2, "pipe": 1, "model": 4}
    groups = collectives._replica_groups("replica_groups=[2,4]<=[8], use_global_device_ids=true", 8)
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert collectives.mesh_axes_of(groups, mesh) == "model"
    groups = collectives._replica_groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8)
    assert groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert collectives.mesh_axes_of(groups, mesh) == "data"
    assert collectives.mesh_axes_of([[0, 1, 2, 3, 4, 5, 6, 7]], mesh) == "data+model"
    assert collectives.mesh_axes_of([[0, 1], [1, 2]], {"data": 2, "pipe": 4, "model": 1},
                             pairs=True) == "pipe"


# ----------------------------------------------------------------- verdict and output
def test_verdict_follows_its_rule(dp, tp):
    # Tiny model: the gradient all-reduce dwarfs the compute; the balance batch is
    # b x t_data / t_compute.
    verdict, rule = dp.verdict()
    t_data = dp.per_axis()["data"]["seconds"]
    need = math.ceil(BATCH // 8 * t_data / dp.compute_s)
    assert verdict.startswith("communication-bound") and f">= {need} images" in verdict
    assert "ratio = communication / compute" in rule
    slow = dataclasses.replace(tp[0], hardware=ic.with_overrides(H100, peak_tflops=1e-6))
    assert slow.verdict()[0].startswith("compute-bound")
    small = dataclasses.replace(tp[0], hardware=ic.with_overrides(H100, memory_gib=1e-6))
    assert "does not fit" in small.verdict()[0]


def test_record_has_the_documented_keys(tp):
    record = tp[0].record()
    assert {"devices", "mesh", "hardware", "params_per_device", "collectives",
            "predicted"} <= set(record)
    assert record["devices"] == 8 and record["mesh"] == {"data": 2, "pipe": 1, "model": 4}
    assert all(set(c) == {"kind", "axes", "dtype", "bytes", "count", "source", "overlap",
                          "algorithm"} for c in record["collectives"])
    # Inside a node (tiny mesh of 8 on 8-GPU nodes) NCCL runs rings or NVLS.
    assert {c["algorithm"] for c in record["collectives"]} <= {"ring", "nvls", "p2p"}
    pred = record["predicted"]
    assert pred["step_s"] == pytest.approx(pred["compute_s"] + pred["comm_s"])
    # The floor: the critical-path collectives never hide, the others up to the compute.
    assert 0 < pred["critical_s"] < pred["comm_s"]
    assert pred["step_overlap_s"] == pytest.approx(
        pred["critical_s"] + max(pred["compute_s"], pred["comm_s"] - pred["critical_s"]))
    assert "verdict: " in tp[0].report() and "rule: " in tp[0].report()


def test_bad_plan_input_is_a_usage_error():
    base = ["--model", "tiny", "--batch", "16"]
    with pytest.raises(cli.UsageError, match="--mesh"):
        ts.main(base + ["--plan", "8", "--mesh", "data=3"])
    with pytest.raises(cli.UsageError, match="--hardware"):
        ts.main(base + ["--plan", "8", "--hardware", "tpu-v9"])
    # This process runs JAX on 8 CPU devices (conftest.py), started here if no test has
    # yet. (A TPU target: the CPU path with or without JAX's CUDA plugin; with it an H100
    # target would compile for 64 GPUs, deviceless.)
    assert len(jax.devices("cpu")) == 8
    with pytest.raises(cli.UsageError, match="--plan 64"):
        train_pmap.main(base + ["--plan", "64", "--hardware", "tpu-v5e"])
    run = subprocess.run([sys.executable, "train_shardmap.py", *base, "--plan", "8",
                          "--mesh", "data=3"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=subprocess_env())
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().count("\n") == 0 and run.stderr.startswith("error: --mesh")


# -------------------------------------------------------------------- a large N
def test_plan_for_64_devices_from_the_command_line(tmp_path):
    """A fresh process compiles for 64 fake devices (data=16 x model=4 spans 8 nodes)."""
    out = tmp_path / "plan.json"
    run = subprocess.run(
        [sys.executable, "train_shardmap.py", "--model", "tiny", "--batch", "64", "--dtype",
         "bf16", "--mesh", "data=16,model=4", "--plan", "64", "--plan-json", str(out),
         "--randaugment", "0", "--dropout", "0", "--drop-path", "0", "--accum-steps", "1",
         "--fabric", "efa-p5", "--algo", "ring"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=subprocess_env())
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["devices"] == 64 and record["mesh"] == {"data": 16, "pipe": 1, "model": 4}
    # --fabric and --algo reach the plan: every call priced as a ring on EFA.
    assert record["hardware"]["fabric"]["name"] == "efa-p5" and record["algorithm"] == "ring"
    assert {c["algorithm"] for c in record["collectives"]} == {"ring"}
    if not targets.cuda_plugin_installed():  # (with it, tests/test_deviceless.py's case)
        assert record["compiled_for"] == "cpu" and record["gpu_program"] is None
        assert "compiled for XLA:CPU on 64 fake CPU devices; for the GPU's own program: pip " \
               "install -r requirements-gpu.txt" in run.stdout
    activations = [c for c in record["collectives"] if c["axes"] == "model" and c["bytes"] > 8]
    assert len(activations) == 4 * L
    # Every token's row (4 images a device), but three of the last block's, on the class
    # token (`test_tensor_parallel_four_activation_all_reduces_per_layer`).
    assert sorted(c["bytes"] for c in activations) == sorted(
        [2 * 4 * E] * 3 + [2 * 4 * T * E] * (4 * L - 3))
    assert {(c["dtype"], c["count"]) for c in activations} == {("bf16", 1)}
    # The gradients' all-reduces (4 bytes a param) and the two float32 metric sums (loss,
    # correct count): separate calls on XLA:CPU, one combined call on XLA:GPU.
    data = [c for c in record["collectives"] if c["axes"] == "data"]
    assert sum(c["bytes"] * c["count"] for c in data) == 4 * record["params_per_device"] + 2 * 4
    assert record["per_axis"]["data"]["seconds"] > 0 and "verdict: " in run.stdout
