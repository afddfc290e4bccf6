"""The plan's cost model (vit_pure/plan/interconnect.py, overlap.py, report.py) against
published curves, placements worked by hand and the compiled program's data flow.

* the message-size-aware curves reproduce the nccl-tests points they are fitted to;
* a collective is priced by its slowest group: groups that straddle nodes cross them;
* overlap by dependency: tensor-parallel activations and pipeline hand-offs are on the
  critical path, gradient reductions and FSDP's gathers are not, and the floor is
  compute + critical + the part of the rest the compute cannot hide;
* FSDP + --remat block counts its backward re-gathers, and its memory differs;
* the plan at the given and at the measured efficiency.

The compiled steps are the tiny model's on the 8 fake devices of conftest.py, as in
tests/test_plan.py (whose helpers build them).
"""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
from conftest import subprocess_env
from test_plan import BATCH, H100, REPO, _from, _setup, _shardmap_plan

from vit_pure.plan import collectives, targets
from vit_pure.plan import interconnect as ic
from vit_pure.plan.overlap import CRITICAL, OVERLAPPABLE
from vit_pure.run import planning as plan
from vit_pure.xla import hlo

MiB, GiB = 2**20, 2**30

# nccl-tests all_reduce_perf, 16 H100 in 2 nodes of 8 (github.com/lessizzmore/
# create-a3mega-ztan-fork, ztan-NCCL-test-result), out-of-place: size -> time (us), busbw.
ACROSS_2_NODES = {8 * MiB: (571.9, 27.50), 32 * MiB: (1059.9, 59.36),
                  128 * MiB: (1652.2, 152.32), 1 * GiB: (6759.0, 297.86),
                  8 * GiB: (47535.0, 338.82)}


def _all_reduce_seconds(size: float, where: ic.Placement, hw=H100) -> float:
    return (ic.transfer_seconds(ic.ALL_REDUCE, size, where, hw)
            + ic.latency_seconds(where, hw))


# ------------------------------------------------------------------ the curves
@pytest.mark.parametrize("size", sorted(ACROSS_2_NODES))
def test_cross_node_curve_within_25_percent_of_the_published_run(size):
    t_us, busbw = ACROSS_2_NODES[size]
    # The run's own busbw from its time (nccl-tests: busbw = S/t x 2(n-1)/n): the points
    # are read right.
    assert size / (t_us * 1e-6) * 2 * 15 / 16 / 1e9 == pytest.approx(busbw, rel=2e-3)
    predicted = _all_reduce_seconds(size, ic.placement([list(range(16))], 8))
    assert predicted == pytest.approx(t_us * 1e-6, rel=0.25)


def test_cross_node_latency_is_the_small_message_floor():
    # 123-136 us for every size up to 512 B in the same run.
    t = _all_reduce_seconds(512, ic.placement([list(range(16))], 8))
    assert 100e-6 < t < 140e-6


@pytest.mark.parametrize("size, busbw", [(4 * GiB, 476e9), (58e6, 150e9)])
def test_intra_node_curve_at_its_cited_points(size, busbw):
    """8 H100 in one node: 476 GB/s all-reduce busbw measured at large sizes
    (github.com/NVIDIA/nccl-tests/issues/290), ~150 GB/s for a 58 MB all-reduce (the JAX
    scaling book)."""
    t = ic.transfer_seconds(ic.ALL_REDUCE, size, ic.Placement(8, 1), H100)
    assert size / t * 2 * 7 / 8 == pytest.approx(busbw, rel=0.25)


def test_small_messages_are_slower_per_byte_than_large():
    where = ic.placement([list(range(16))], 8)
    small = _all_reduce_seconds(8 * MiB, where) / (8 * MiB)
    large = _all_reduce_seconds(8 * GiB, where) / (8 * GiB)
    assert small > 5 * large
    # A flat link (half = 0) keeps the size-independent formula.
    flat = dataclasses.replace(H100, intra=ic.Link(370e9))
    assert ic.transfer_seconds(ic.ALL_GATHER, 1e6, ic.Placement(8, 1), flat) == \
        pytest.approx(1e6 * 7 / (8 * 370e9))


def test_overrides_scale_the_curve():
    fast = ic.with_overrides(H100, inter_gbps=2 * 24.7)
    where = ic.placement([[0, 8], [1, 9]], 8)  # one device a node: all of it on the NICs
    slow_t = ic.transfer_seconds(ic.ALL_REDUCE, 1 * GiB, where, H100)
    assert ic.transfer_seconds(ic.ALL_REDUCE, 1 * GiB, where, fast) == pytest.approx(slow_t / 2)


# --------------------------------------------------------------- placement
def _model_groups(data: int, model: int) -> list[list[int]]:
    """The 'model' groups of a data x model mesh ('model' innermost)."""
    return [list(range(d * model, (d + 1) * model)) for d in range(data)]


def test_data16_model6_prices_its_straddling_groups_across_nodes():
    where = ic.placement(_model_groups(16, 6), 8)
    # Devices 6..11 sit 2 on node 0 and 4 on node 1: 8 of the 16 groups straddle.
    assert (where.groups, where.straddling, where.nodes) == (16, 8, 2)
    assert (where.p_min, where.p_max) == (2, 4)
    inside = ic.placement([list(range(6))], 8)
    v = 9.2 * MiB  # a ViT-B/16 activation all-reduce of the layout
    assert (ic.transfer_seconds(ic.ALL_REDUCE, v, where, H100)
            > 3 * ic.transfer_seconds(ic.ALL_REDUCE, v, inside, H100))
    assert ic.latency_seconds(where, H100) == H100.inter.latency
    # Divisible sizes never straddle.
    assert ic.placement(_model_groups(32, 4), 8).straddling == 0


@pytest.fixture(scope="module")
def tp():
    return _shardmap_plan("data=2,model=4")


def test_the_report_says_when_groups_cross_a_node(tp):
    p, strategy = tp
    _, opt = _setup()
    six = ic.with_overrides(H100, devices_per_node=6)
    p6 = plan.plan_step(strategy, opt, BATCH, six, script="train_shardmap.py")
    model6, model8 = p6.per_axis()["model"], p.per_axis()["model"]
    assert (model6["groups"], model6["straddling"]) == (2, 1)
    assert (model8["groups"], model8["straddling"]) == (2, 0)
    assert model6["seconds"] > model8["seconds"]
    text = p6.report()
    assert "1 of 2 groups CROSS A NODE BOUNDARY" in text
    # Rows name NCCL's algorithm: across two nodes an all-reduce runs as NVLS-tree (tree
    # across, NVLink SHARP inside), inside one node as NVLS; forcing the ring prices rings.
    assert model6["algorithms"] == ["nvlstree"] and model8["algorithms"] == ["nvls"]
    assert "NCCL nvlstree" in text
    ring = dataclasses.replace(p6, algorithm="ring")
    assert ring.per_axis()["model"]["algorithms"] == ["ring"]
    assert ring.per_axis()["model"]["seconds"] > model6["seconds"]
    # The advice tests divisibility, not <=: model=4 fits in 6 but does not divide it.
    advice = p6._advice("model", model6, p6.compute_s)
    assert "model=4 does not divide the 6 devices" in advice and "{1, 2, 3, 6}" in advice
    assert "stays inside a node" in p._advice("model", model8, p.compute_s)


# ---------------------------------------------------------------- overlap
def test_tensor_parallel_activations_are_critical_gradients_overlap(tp):
    p, _ = tp
    forward = _from(p, "return y if tp_axis is None else jax.lax.psum(y, tp_axis)",
                    "vit_pure/model.py")
    backward = _from(p, 'return x if tp_axis is None else jax.lax.pcast(x, tp_axis, to="varying")',
                     "vit_pure/model.py")
    grads = _from(p, "lambda g, s: g if over_data(s) else lax.pmean(g, DATA)", "train_shardmap.py")
    assert forward and backward and grads
    assert {c.overlap for c in forward + backward} == {CRITICAL}
    assert {c.overlap for c in grads} == {OVERLAPPABLE}
    assert p.critical_s == pytest.approx(sum(p.seconds(c) for c in forward + backward))
    # The floor never hides the critical part.
    step = p.steps(p.efficiency)
    assert step["step_overlap_s"] >= step["compute_s"] + p.critical_s
    assert "critical" in p.report() and "overlappable" in p.report()


def test_fsdp_gathers_prefetch_and_scatters_overlap():
    p, _ = _shardmap_plan("data=8", fsdp=True)
    gathers = [c for c in p.collectives if c.kind == ic.ALL_GATHER]
    scatters = [c for c in p.collectives if c.kind == ic.REDUCE_SCATTER]
    assert gathers and scatters
    assert {c.overlap for c in gathers + scatters} == {OVERLAPPABLE}
    assert any("prefetch" in c.reason for c in gathers)
    assert p.critical_s == 0
    step = p.steps(p.efficiency)
    assert step["step_overlap_s"] == pytest.approx(max(step["compute_s"], p.comm_s))


def test_pipeline_hand_offs_are_critical():
    p, _ = _shardmap_plan("data=2,pipe=4", microbatches=4)
    permutes = [c for c in p.collectives if c.kind == ic.PERMUTE]
    assert permutes and {c.overlap for c in permutes} == {CRITICAL}


def test_scanned_tensor_parallel_step_keeps_its_activations_critical():
    """Under --scan the psums sit in a loop body; their results still feed matmuls. (The
    body's four, and the last block's attention input gradient after the loop: that
    block, on the class token, is outside it.)"""
    p, _ = _shardmap_plan("data=2,model=4", "--scan", accum_steps=2)
    tp_ops = [c for c in p.collectives if c.axes == "model" and c.nbytes > 8]
    activations = [c for c in tp_ops if c.elements == BATCH // 4 * 17 * 24]
    assert len(activations) == 5 and {c.overlap for c in activations} == {CRITICAL}


# ------------------------------------------------------------ buckets and calls
def test_a_combined_bucket_is_priced_at_its_size(tp):
    """Each collective's message is the bytes of the modelled call that carries it."""
    p, _ = tp
    grads = _from(p, "lambda g, s: g if over_data(s) else lax.pmean(g, DATA)", "train_shardmap.py")
    assert len(grads) > 1 and all(c.message >= c.nbytes for c in p.collectives)
    # The gradients share few calls: each call's bytes, counted once, add up to theirs.
    same = [c for c in p.collectives if (c.kind, c.axes, c.dtype) == ("all-reduce", "data", "f32")]
    assert sum(set(c.message for c in same)) == sum(c.nbytes for c in same)
    assert max(c.message for c in grads) > max(c.nbytes for c in grads)
    # Priced at a large call's size, an array moves faster than alone (the tiny model's
    # calls are all below the curve's smallest chunk: the same rate).
    small = min(grads, key=lambda c: c.nbytes)
    assert (ic.transfer_seconds(small.kind, small.nbytes, small.where, H100, 64 * MiB)
            < ic.transfer_seconds(small.kind, small.nbytes, small.where, H100) / 5)


# ------------------------------------------------------------ FSDP + remat
@pytest.fixture(scope="module")
def fsdp_remat():
    return _shardmap_plan("data=8", "--remat", "block", fsdp=True)


def test_fsdp_remat_counts_its_backward_regathers(fsdp_remat):
    plain, _ = _shardmap_plan("data=8", fsdp=True)
    remat, strategy = fsdp_remat
    gathers = [c for c in plain.collectives if c.kind == ic.ALL_GATHER]
    regathers = [c for c in remat.collectives if c.kind == ic.ALL_GATHER]
    # The block weights (16 arrays of the tiny model's 4 blocks) are gathered again in
    # the backward pass: 19 + 16.
    assert (len(gathers), len(regathers)) == (19, 35)
    extra = sum(c.nbytes * c.count for c in regathers) - sum(c.nbytes * c.count for c in gathers)
    assert extra > 0
    assert remat.memory_bytes != plain.memory_bytes
    assert remat.memory["temp"] < plain.memory["temp"]
    assert not [line for line in remat.corrections if "merged by XLA:CPU" in line]
    # The re-gathers read weights saved behind remat's barrier: prefetches, not waits.
    assert {c.overlap for c in regathers} == {OVERLAPPABLE}


def test_count_correction_restores_what_the_cpu_compile_merges(fsdp_remat):
    """With remat's barriers expanded (XLA:CPU's default), the compile merges the
    re-gathers; the lowered program's per-line counts bring them back."""
    _, strategy = fsdp_remat
    _, opt = _setup("--remat", "block")
    lowered = strategy.train_step.lower(*plan.abstract_inputs(strategy, opt, BATCH))
    compiled = lowered.compile({"xla_disable_hlo_passes": collectives.CPU_COMBINER})
    module = hlo.parse_module(compiled.as_text())
    found = collectives.read_collectives(module, dict(strategy.mesh.shape), 8)
    asked = collectives.lowered_collectives(lowered.as_text(debug_info=True))
    merged, lines = collectives.correct_counts(found, asked)
    n_asked = sum(kind == ic.ALL_GATHER for kind, *_ in asked)
    n_found = sum(c.kind == ic.ALL_GATHER for c in found)
    assert n_found < n_asked and lines
    assert n_found + sum(c.kind == ic.ALL_GATHER for c in merged) == n_asked


# The tiny step without its random parts (dropout, drop-path and the training script's
# default RandAugment 2x9): remat's re-gathers are of the block weights, which none of them
# touches, and they are about half of XLA:GPU's compile time for the tiny step (the masks'
# Threefry hashes, RandAugment's ops). The same as PLAIN_STEP in tests/test_deviceless.py.
PLAIN_STEP = ("--dropout", "0", "--drop-path", "0", "--randaugment", "0")


def _gpu_plan(tmp_path, name, *flags) -> dict:
    out = tmp_path / f"{name}.json"
    run = subprocess.run([sys.executable, "train_shardmap.py", "--model", "tiny", "--batch", "64",
                          "--dtype", "bf16", "--mesh", "data=8", "--fsdp", "--plan", "8",
                          "--accum-steps", "1", "--hardware", "h100", *PLAIN_STEP, *flags,
                          "--plan-json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=subprocess_env(JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(not targets.cuda_plugin_installed(),
                    reason="JAX's CUDA plugin is not installed (requirements-gpu.txt)")
@pytest.mark.slow
def test_xla_gpu_keeps_the_regathers_and_they_prefetch(tmp_path):
    """XLA:GPU's own program (deviceless): with --remat block it gathers the block
    weights again (the bytes grow by theirs), and every gather, combined or not, reads no
    computed value."""
    plain, remat = _gpu_plan(tmp_path, "plain"), _gpu_plan(tmp_path, "remat", "--remat", "block")
    assert plain["compiled_for"] == remat["compiled_for"] == "gpu"

    def gathered(record):
        return sum(c["bytes"] * c["count"] for c in record["collectives"]
                   if c["kind"] == ic.ALL_GATHER)

    assert gathered(remat) > gathered(plain)
    assert {c["overlap"] for c in remat["collectives"] if c["kind"] == ic.ALL_GATHER} == \
        {OVERLAPPABLE}


# ------------------------------------------------------------ efficiency
def test_the_plan_at_the_measured_efficiency(tp):
    p, _ = tp
    assert H100.measured_efficiency == pytest.approx(39358 * 4.264e9 / 989e12, abs=1e-3)
    record = p.record()
    measured = record["predicted"]["at_measured_efficiency"]
    assert measured["efficiency"] == H100.measured_efficiency
    assert measured["compute_s"] == pytest.approx(
        record["predicted"]["compute_s"] * p.efficiency / H100.measured_efficiency)
    text = p.report()
    assert f"efficiency {p.efficiency:.3f}" in text and "efficiency 0.170 (measured" in text
    a100 = dataclasses.replace(p, hardware=ic.HARDWARE["a100"])
    assert a100.record()["predicted"]["at_measured_efficiency"] is None
    assert math.isfinite(record["predicted"]["step_overlap_s"])

