"""The plan compiled for a GPU without one (vit_pure/plan/targets.py, vit_pure/xla/kernels.py)
and benchmarks.deviceless.

The kernel reading is checked on a hand-written fragment of XLA:GPU's HLO (no plugin
needed). The compiles need JAX's CUDA plugin (`pip install -r requirements-gpu.txt`, about
5.5 GB, or only the plugin and cuDNN as .ci/run installs them before its slow tests): they
are marked slow and skipped, saying so, where it is not installed. Run them with the plugin:
`python -m pytest -q -m slow tests/test_deviceless.py`.
"""
from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import subprocess_env

from benchmarks import fit_step, profile_breakdown
from vit_pure.layers import attention_pallas
from vit_pure.plan import interconnect as ic
from vit_pure.plan import targets
from vit_pure.xla import hlo, kernels

REPO = pathlib.Path(__file__).resolve().parents[1]
needs_plugin = pytest.mark.skipif(
    not targets.cuda_plugin_installed(),
    reason="JAX's CUDA plugin is not installed (pip install -r requirements-gpu.txt)")

# One of each kind of kernel, as XLA:GPU prints them (shapes and names cut down).
FRAGMENT = """HloModule jit_train_step, entry_computation_layout={()->()}

%fused_add (p0: bf16[64,32], p1: bf16[64,32]) -> bf16[64,32] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %add = bf16[64,32]{1,0} add(%p0, %p1)
}

ENTRY %main (a: bf16[64,16], w: bf16[16,32], q: bf16[2,72,4,8]) -> bf16[64,32] {
  %a = bf16[64,16]{1,0} parameter(0)
  %w = bf16[16,32]{1,0} parameter(1)
  %q = bf16[2,72,4,8]{3,2,1,0} parameter(2)
  %gemm = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(%a, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %out = bf16[64,32]{1,0} get-tuple-element(%gemm), index=0
  %fmha = (bf16[2,72,4,8]{3,2,1,0}, f32[2,4,72]{2,1,0}, s8[1024]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax"
  %loop_add_fusion = bf16[64,32]{1,0} fusion(%out, %out), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/jvp()/add" stack_frame_id=3}
  %input_reduce_fusion = f32[64]{0} fusion(%loop_add_fusion), kind=kInput, calls=%fused_add
  %loop_transpose_fusion = bf16[32,64]{1,0} fusion(%loop_add_fusion), kind=kLoop, calls=%fused_add
  %all-reduce-start = bf16[64,32]{1,0} all-reduce-start(%loop_add_fusion), replica_groups={{0}}, to_apply=%fused_add
  ROOT %all-reduce-done = bf16[64,32]{1,0} all-reduce-done(%all-reduce-start)
}
"""


def test_kernels_and_their_traffic_by_class():
    found = {k.name: k for k in kernels.kernels(hlo.parse_module(FRAGMENT))}
    kinds = {name: k.kind for name, k in found.items()}
    assert kinds == {"gemm": "gemm", "fmha": "attention", "loop_add_fusion": "elementwise",
                     "input_reduce_fusion": "norms/reductions",
                     "loop_transpose_fusion": "transposes/copies",
                     "all-reduce-start": "collectives"}
    # The GEMM: reads a and w, writes its result (not the s8 workspace); 2 x 64 x 32 x 16.
    assert found["gemm"].bytes == 2 * (64 * 16 + 16 * 32 + 64 * 32)
    assert found["gemm"].flops == 2 * 64 * 32 * 16
    assert found["loop_add_fusion"].bytes == 3 * 2 * 64 * 32  # two reads, one write
    assert found["input_reduce_fusion"].bytes == 2 * 64 * 32 + 4 * 64
    t = kernels.traffic(list(found.values()), bandwidth=1e9, peak_flops=1e12)
    assert t["kernels"] == 6 and t["bytes"] == sum(k.bytes for k in found.values())
    # The floor: bytes at the bandwidth, FLOPs (GEMM and attention) at the fastest GEMM
    # rate measured, a launch each.
    rates = kernels.H100_RATES
    ceiling = 1e12 * rates.fastest_gemm()
    assert t["floor_s"] == pytest.approx(sum(
        max(k.bytes / 1e9, (k.flops + k.attention_flops) / ceiling) for k in found.values())
        + 6 * rates.launch_s)
    assert "gemm" in kernels.report(t) and "transposes/copies" in kernels.report(t)
    # The kernels that move the most, largest first, with their shape and JAX operation
    # (no two alike here: each its own group).
    assert [k["name"] for k in t["largest"]] == sorted(
        found, key=lambda n: (-found[n].bytes, list(found).index(n)))
    [add] = [k for k in t["largest"] if k["name"] == "loop_add_fusion"]
    assert (add["kind"], add["shape"], add["op"], add["bytes"], add["kernels"]) == (
        "elementwise", "bf16[64,32]{1,0}", "jvp()/add", found["loop_add_fusion"].bytes, 1)
    twice = kernels.traffic([found["loop_add_fusion"], dataclasses.replace(
        found["loop_add_fusion"], name="loop_add_fusion.1")], 1e9, 1e12)["largest"]
    assert [(g["kernels"], g["bytes"]) for g in twice] == [(2, 2 * add["bytes"])]
    report = kernels.largest_report(t, 6)
    assert len(report.splitlines()) == 7 and "jvp()/add" in report


# jax 0.11's text: a tuple's element as `%t#i` (no get-tuple-element), a GEMM fusion's
# kind after its Triton tiling config, a cuBLAS call whose lhs is a multi-output fusion's
# second result.
FRAGMENT_011 = """HloModule jit_train_step, entry_computation_layout={()->()}

%fused_two (p0: bf16[64,16]) -> (bf16[64,16], f32[64,16]) {
  %p0 = bf16[64,16]{1,0} parameter(0)
  %c = f32[64,16]{1,0} convert(%p0)
  ROOT %t = (bf16[64,16]{1,0}, f32[64,16]{1,0}) tuple(%p0, %c)
}

%gemm_computation (p0: bf16[64,16], p1: bf16[16,8]) -> bf16[64,8] {
  %p0 = bf16[64,16]{1,0} parameter(0)
  %p1 = bf16[16,8]{1,0} parameter(1)
  ROOT %d = bf16[64,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[64,16], w: bf16[16,32], v: bf16[16,8]) -> bf16[64,32] {
  %a = bf16[64,16]{1,0} parameter(0)
  %w = bf16[16,32]{1,0} parameter(1)
  %v = bf16[16,8]{1,0} parameter(2)
  %loop_convert_fusion = (bf16[64,16]{1,0}, /*index=1*/f32[64,16]{1,0}) fusion(%a), kind=kLoop, calls=%fused_two
  %custom-call.1 = (bf16[64,32]{1,0}, s8[33554432]{0}) custom-call(%loop_convert_fusion#0, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %gemm_fusion_dot = bf16[64,8]{1,0} fusion(%loop_convert_fusion#0, %v), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"block_level_fusion_config":{"num_warps":"4","output_tiles":[{"sizes":["16","8"]}]},"kind":"__triton_nested_gemm_fusion"}}
  ROOT %loop_add_fusion = bf16[64,32]{1,0} fusion(%custom-call.1#0, %custom-call.1#0), kind=kLoop, calls=%fused_two
}
"""


def test_tuple_elements_and_fusion_kinds_of_jax_0_11():
    """`%t#i` is the i-th array of t's tuple, not the whole tuple; a fusion's kind is found
    after a `block_level_fusion_config`."""
    module = hlo.parse_module(FRAGMENT_011)
    assert hlo.tuple_element("(bf16[2]{0}, /*index=1*/(s8[4], u8[1]))", 1) == "(s8[4], u8[1])"
    found = {k.name: k for k in kernels.kernels(
        module, lambda comp: hlo.computation_dot_flops(module, comp))}
    assert {n: k.kind for n, k in found.items()} == {
        "loop_convert_fusion": "elementwise", "custom-call.1": "gemm",
        "gemm_fusion_dot": "gemm", "loop_add_fusion": "elementwise"}
    assert found["custom-call.1"].bytes == 2 * (64 * 16 + 16 * 32 + 64 * 32)
    assert found["custom-call.1"].flops == 2 * 64 * 32 * 16
    assert found["gemm_fusion_dot"].flops == 2 * 64 * 8 * 16
    assert found["gemm_fusion_dot"].bytes == 2 * (64 * 16 + 16 * 8 + 64 * 8)
    assert found["loop_add_fusion"].bytes == 3 * 2 * 64 * 32


H200_RUN = REPO.parent / "shared" / "gpu-runs" / "2026-11-27-h200"


def test_the_h200s_own_program_reads_as_measured_there():
    """The step XLA compiled on the H200 (jax 0.11.2): 458 kernels, 178.3 GB, 17.13 TFLOP
    in 74 cuBLASLt GEMMs (and the head's three small Triton GEMMs), 12 cuDNN calls."""
    dump = H200_RUN / "train_step.gpu_after_optimizations.txt.gz"
    if not dump.exists():
        pytest.skip(f"the shared H200 run is not beside this checkout ({dump})")
    module = hlo.parse_module(gzip.decompress(dump.read_bytes()).decode())
    found = kernels.kernels(module, lambda comp: hlo.computation_dot_flops(module, comp))
    t = kernels.traffic(found, 4.3e12, 760e12)
    assert t["kernels"] == 458
    assert t["bytes"] == pytest.approx(178.3e9, rel=0.02)
    assert t["flops"] == pytest.approx(17.13e12, rel=0.01)
    cublas = [i for i in module.computations[module.entry]
              if '"__cublas$lt$matmul"' in i.attrs]
    assert len(cublas) == 74 and t["classes"]["gemm"]["kernels"] == 74 + 3
    assert t["classes"]["attention"]["kernels"] == 12


# A kernel drawing random bits: integer shifts and xors, then a compare.
BITS_FRAGMENT = """HloModule jit_train_step, entry_computation_layout={()->()}

%fused_bits (p0: u32[64,32]) -> pred[64,32] {
  %p0 = u32[64,32]{1,0} parameter(0)
  %c = u32[] constant(13)
  %b = u32[64,32]{1,0} broadcast(%c), dimensions={}
  %s = u32[64,32]{1,0} shift-left(%p0, %b)
  %x = u32[64,32]{1,0} xor(%s, %p0)
  ROOT %lt = pred[64,32]{1,0} compare(%x, %b), direction=LT
}

ENTRY %main (k: u32[64,32]) -> pred[64,32] {
  %k = u32[64,32]{1,0} parameter(0)
  ROOT %mask = pred[64,32]{1,0} fusion(%k), kind=kLoop, calls=%fused_bits
}
"""


def test_integer_arithmetic_is_counted_apart_from_the_floor():
    """Each integer add / bitwise / shift inside a kernel, times its elements (here a
    shift and a xor over 64 x 32); float work and the GEMMs count none, and the floor
    is the bytes' alone."""
    [bits] = kernels.kernels(hlo.parse_module(BITS_FRAGMENT))
    assert bits.int_ops == 2 * 64 * 32
    assert all(k.int_ops == 0 for k in kernels.kernels(hlo.parse_module(FRAGMENT)))
    t = kernels.traffic([bits], bandwidth=1e9, peak_flops=1e12)
    assert t["int_ops"] == 2 * 64 * 32
    assert t["floor_s"] == pytest.approx(bits.bytes / 1e9 + kernels.H100_RATES.launch_s)
    assert "0.0 G integer ops" in kernels.report(t)


# A ring of 8 slots of bf16[64,32]: one slot read (a dynamic-slice of the ring), one slot
# written in place (a dynamic-update-slice of the ring), as a pipeline's tick does.
RING_FRAGMENT = """HloModule jit_train_step, entry_computation_layout={()->()}

%fused_read (p0: bf16[8,64,32], p1: s32[]) -> bf16[1,64,32] {
  %p0 = bf16[8,64,32]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,64,32]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,64,32}
}

%fused_write (p0: bf16[8,64,32], p1: bf16[1,64,32], p2: s32[]) -> bf16[8,64,32] {
  %p0 = bf16[8,64,32]{2,1,0} parameter(0)
  %p1 = bf16[1,64,32]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %neg = bf16[1,64,32]{2,1,0} negate(%p1)
  ROOT %dus = bf16[8,64,32]{2,1,0} dynamic-update-slice(%p0, %neg, %p2, %z, %z)
}

ENTRY %main (ring: bf16[8,64,32], x: bf16[1,64,32], i: s32[]) -> bf16[8,64,32] {
  %ring = bf16[8,64,32]{2,1,0} parameter(0)
  %x = bf16[1,64,32]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %slot = bf16[1,64,32]{2,1,0} fusion(%ring, %i), kind=kLoop, calls=%fused_read
  ROOT %written = bf16[8,64,32]{2,1,0} fusion(%ring, %slot, %i), kind=kLoop, calls=%fused_write
}
"""


def test_in_place_updates_and_slice_reads_move_the_slice_only():
    """XLA updates a buffer in place where a kernel ends in a dynamic-update-slice of its
    parameter, and a kernel that dynamic-slices a parameter reads that slice: the bytes
    are the slots', not the ring's (else a pipeline's ring would price as copied whole
    every tick)."""
    found = {k.name: k for k in kernels.kernels(hlo.parse_module(RING_FRAGMENT))}
    slot = 2 * 64 * 32
    assert found["slot"].bytes == slot + slot + 4  # the slot read, written; the index
    assert found["written"].bytes == 2 * slot + slot + 4  # the slot in, the slot read/written


# The kit's Pallas attention as XLA:GPU prints its two custom calls (vit-cifar's head
# size, 2 examples of 65 tokens, 8 heads; kernel hashes cut).
PALLAS_FRAGMENT = """HloModule jit_train_step, entry_computation_layout={()->()}

ENTRY %main (qkv: bf16[130,1152], dctx: bf16[130,384]) -> bf16[130,1152] {
  %qkv = bf16[130,1152]{1,0} parameter(0)
  %dctx = bf16[130,384]{1,0} parameter(1)
  %mpmd_map.20 = (bf16[130,384]{1,0}, f32[2,8,64]{2,1,0}) custom-call(%qkv), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(train_step)/jvp()/attention_pallas_forward/mpmd_map" stack_frame_id=7}
  %lse = f32[2,8,64]{2,1,0} get-tuple-element(%mpmd_map.20), index=1
  %other_kernel = f32[2,8,64]{2,1,0} custom-call(%lse), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(train_step)/jvp()/some_kernel/mpmd_map"}
  ROOT %mpmd_map.35 = bf16[130,1152]{1,0} custom-call(%qkv, %lse, %dctx), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI, metadata={op_name="jit(train_step)/transpose(jvp())/attention_pallas_backward/mpmd_map" stack_frame_id=9}
}
"""


def test_the_pallas_attention_is_priced_as_an_attention_pass():
    """Its two custom calls are attention kernels, forward and backward, with the matrix
    FLOPs the layer itself counts (`attention_pallas.attention_cost`: of 65 tokens, token 0
    apart and the other 64 in one tile on chip); another Mosaic GPU kernel stays "other"."""
    found = {k.name: k for k in kernels.kernels(hlo.parse_module(PALLAS_FRAGMENT))}
    cost = attention_pallas.attention_cost(2, 65, 8, 48, "bfloat16")
    forward, backward = found["mpmd_map.20"], found["mpmd_map.35"]
    assert (forward.kind, forward.variant) == ("attention", "forward")
    assert (backward.kind, backward.variant) == ("attention", "backward")
    assert forward.attention_flops == cost["forward_flops"]
    assert backward.attention_flops == cost["backward_flops"]
    assert found["other_kernel"].kind == "other" and found["other_kernel"].attention_flops == 0
    # the fragment's shapes are the kernels' own: what the pricing reads is what they write
    qkv = jax.ShapeDtypeStruct((130, 1152), jnp.bfloat16)
    ctx, lse = jax.eval_shape(lambda x: attention_pallas._forward(x, 65, 48, False), qkv)
    assert (ctx.shape, lse.shape) == ((130, 384), (2, 8, 64))
    dqkv = jax.eval_shape(lambda x, m, g: attention_pallas._backward(x, m, g, 65, 48, False),
                          qkv, lse, ctx)
    assert dqkv.shape == (130, 1152)


def test_the_predicted_step_prices_each_kernel_at_its_class():
    """max(bytes / (bandwidth x e_mem), FLOPs / (peak x e_class)) + integer work + a
    launch, per kernel: XLA's GEMMs and cuDNN's attention each at their own efficiency."""
    rates = kernels.Rates(e_mem=0.5, e_gemm=0.8, e_attention=0.4, int_per_s=1e3,
                          launch_s=1e-3)
    found = [kernels.Kernel("g", "gemm", 100, 8000, 2),
             kernels.Kernel("a", "attention", 10, 0, 1, attention_flops=4000),
             kernels.Kernel("e", "elementwise", 1000, 0, 1, int_ops=5)]
    got = kernels.predicted_s(found, bandwidth=1e3, peak_flops=1e4, rates=rates)
    want = (2 * (max(0.2, 1.0) + 1e-3) + (max(0.02, 1.0) + 1e-3)
            + (2.0 + 5e-3 + 1e-3))
    assert got == pytest.approx(want)


def test_the_fit_recovers_the_efficiencies_that_made_the_steps():
    """Steps made with known efficiencies (four mixes of memory, GEMM and attention
    work): the grid fit finds them, and each row left out is predicted exactly."""
    made = kernels.Rates(e_mem=0.7, e_gemm=0.55, e_attention=0.35, int_per_s=1e13)
    rows = []
    for i, (gb, tflop, attn) in enumerate([(100, 10, 1), (150, 12, 0.5), (120, 18, 2),
                                           (90, 9, 4)]):
        found = [kernels.Kernel("m", "elementwise", int(gb * 1e9), 0, 1),
                 kernels.Kernel("g", "gemm", int(1e9), int(tflop * 1e12), 1),
                 kernels.Kernel("a", "attention", int(1e8), 0, 1,
                                attention_flops=int(attn * 1e12))]
        ms = kernels.predicted_s(found, 3e12, 1e15, made) * 1e3
        rows.append({"label": str(i), "measured_ms": ms, "kernels": fit_step.summarise(found)})
    got = fit_step.fit(rows, 3e12, 1e15, made)
    assert (got.e_mem, got.e_gemm, got.e_attention) == (0.7, 0.55, 0.35)
    table = fit_step.report(rows, 3e12, 1e15)
    assert table.count("+0.0%") + table.count("-0.0%") == 2 * len(rows)


def test_the_h100_description_is_the_gpu_the_kit_measured():
    text = (targets.TARGETS_DIR / targets.GPU_TARGETS["h100"]).read_text()
    assert "core_count: 132" in text and 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
    assert targets.memory_bandwidth("h100") == 3.35232e12


def test_the_h200_description_is_the_gpu_lent():
    """--hardware h200: the same die as the H100 (132 SMs), 4.8 TB/s, 60 MiB of L2,
    143,771 MiB; its device kind is what the H200's own run recorded (env.json), and the
    GPU check finds each description from the device kind it reads."""
    text = (targets.TARGETS_DIR / targets.GPU_TARGETS["h200"]).read_text()
    for field in ("core_count: 132", "l2_cache_size: 62914560",
                  f"device_memory_size: {143771 * 2**20}", "clock_rate_ghz: 1.98"):
        assert field in text
    assert targets.memory_bandwidth("h200") == 4.8e12
    assert targets.device_description("h200") == "NVIDIA H200"
    recorded = H200_RUN / "env.json"
    if recorded.exists():
        assert json.loads(recorded.read_text())["device"] == "NVIDIA H200"
    assert targets.target_for_device("NVIDIA H100 80GB HBM3") == "h100"
    assert targets.target_for_device("NVIDIA H200") == "h200"
    assert targets.target_for_device("NVIDIA A100-SXM4-80GB") is None
    assert set(kernels.RATES) == set(targets.GPU_TARGETS) <= set(ic.HARDWARE)


def test_the_gemms_of_a_program_as_laid_out():
    """Each distinct GEMM once, with its executions, operands in memory order: a cuBLAS
    call (rhs laid out column-major: its contracting dimension moves) and a GEMM fusion's
    dot."""
    module = hlo.parse_module(FRAGMENT_011.replace("%w = bf16[16,32]{1,0}",
                                                   "%w = bf16[16,32]{0,1}"))
    got = {g.label(): (g.runs, g.flops) for g in kernels.gemms(module)}
    assert got == {"bf16[64,16] x bf16[32,16] -> bf16 (contract 1x1)": (1, 2 * 64 * 32 * 16),
                   "bf16[64,16] x bf16[16,8] -> bf16 (contract 1x0)": (1, 2 * 64 * 8 * 16)}


def test_the_fit_from_a_profile_recovers_each_class():
    """Kernel times made with known rates (the predictor's model): the profile fit finds
    e_mem, the INT32 rate, e_gemm and e_attention from the kernels' own times; and the
    four whole-step rows say which term they cannot separate."""
    made = kernels.Rates(e_mem=0.8, e_gemm=0.5, e_attention=0.3, int_per_s=2e13)
    found = [kernels.Kernel("m", "elementwise", int(40e9), 0, 2),
             kernels.Kernel("r", "rng", int(1e9), 0, 1, int_ops=int(50e9)),
             kernels.Kernel("g", "gemm", int(1e9), int(10e12), 3, shape="bf16[4,8]{1,0}"),
             kernels.Kernel("a", "attention", int(1e8), 0, 1, attention_flops=int(1e12))]
    events = [{"ph": "X", "ts": 0, "name": f"kernel_{k.name}", "args": {"hlo_op": k.name},
               "dur": 1e6 * kernels.predicted_s([k], 3e12, 1e15, made) / k.runs}
              for k in found for _ in range(k.runs)]
    events.append({"ph": "X", "ts": 0, "dur": 5.0, "name": "memset", "args": {}})
    record = {"step_ms": 1.0, **profile_breakdown.kernel_times(found, events, steps=1)}
    assert record["unmatched_us"] == 5.0 and record["kernels"][0]["us"] > 0
    got, by_shape, defaults = fit_step.fit_profile(record, 3e12, 1e15, made)
    assert (got.e_mem, got.e_gemm, got.e_attention) == pytest.approx((0.8, 0.5, 0.3))
    assert got.mem("elementwise") == pytest.approx(0.8)
    assert got.int_per_s == pytest.approx(2e13)
    assert [(g["shape"], g["runs"]) for g in by_shape] == [("bf16[4,8]{1,0}", 3)]
    # no shape classes or passes in these kernels, no idle time in the record: defaults
    assert "launch" in defaults and "e_gemm wide" in defaults
    record["matched_fraction"] = 0.95
    report = fit_step.profile_report(record, 3e12, 1e15)
    default_launch = f"launch {kernels.H100_RATES.launch_s * 1e6:.2f} us (default: not in"
    assert default_launch in report and "e_gemm by shape class: wide 0.73 (default" in report
    rows = json.loads((REPO / "benchmarks" / "data" / "h100-2026-11-23.json").read_text())["rows"]
    [line] = fit_step.unseparable(rows)
    assert line.startswith("GEMM FLOPs (e_gemm)") and "(+2.8%)" in line


# The tiny step without its random parts (dropout, drop-path, RandAugment: the training
# script's default 2x9), for the compiles whose claim is not about them: none of them holds
# a weight or adds a collective, and together they are about half of what XLA:GPU compiles
# for the tiny step (the masks' Threefry hashes, RandAugment's ops). PLAIN_STEP in
# tests/test_plan_cost.py is the same.
PLAIN_STEP = ("--dropout", "0", "--drop-path", "0", "--randaugment", "0")


def _plan(tmp_path, *flags, hardware: str = "h100") -> tuple[dict, hlo.Module]:
    """The plan's record of `train_shardmap.py FLAGS --hardware H --plan-json`, and the
    program XLA:GPU compiled (XLA's own dump of it, read back)."""
    out, dump = tmp_path / "plan.json", tmp_path / "dump"
    env = subprocess_env(cache=False, JAX_PLATFORMS="cpu")  # XLA dumps what it compiles
    env["XLA_FLAGS"] += f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
    run = subprocess.run([sys.executable, "train_shardmap.py", *flags, "--hardware", hardware,
                          "--plan-json", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    described = targets.device_description(hardware)
    assert f"compiled for {hardware}: XLA:GPU for {described}, deviceless" in run.stdout
    [program] = dump.glob("*jit_train_step*gpu_after_optimizations.txt")
    return json.loads(out.read_text()), hlo.parse_module(program.read_text())


@needs_plugin
@pytest.mark.slow
def test_a_tiny_model_compiles_for_eight_h100s(tmp_path):
    """A data x model mesh of 8 GPUs: the plan's collective rows are the program's
    collectives, launch for launch (XLA:GPU's async, combined all-reduces)."""
    # PLAIN_STEP: dropout, drop-path and RandAugment add no collective.
    record, program = _plan(tmp_path, "--model", "tiny", "--batch", "64", "--dtype", "bf16",
                            "--mesh", "data=4,model=2", "--plan", "8", "--accum-steps", "1",
                            *PLAIN_STEP)
    assert record["compiled_for"] == "gpu" and record["devices"] == 8
    gpu = record["gpu_program"]
    assert gpu["kernels"] > 0 and gpu["classes"]["gemm"]["kernels"] > 0
    assert {c["kind"] for c in record["collectives"]} == {"all-reduce"}
    assert {c["axes"] for c in record["collectives"]} == {"model", "data"}
    assert record["memory"]["total"] > 0
    starts = [i for instrs in program.computations.values() for i in instrs
              if i.opcode == "all-reduce-start"]
    assert starts, "XLA:GPU's all-reduces are async: all-reduce-start / -done"
    assert sum(c["count"] for c in record["collectives"]) == len(starts)
    assert gpu["classes"]["collectives"]["kernels"] == len(starts)


@needs_plugin
@pytest.mark.slow
def test_a_tiny_model_compiles_for_an_h200(tmp_path):
    """--plan with --hardware h200: XLA:GPU compiles for the H200's description, and the
    predicted step prices it at the H200's bandwidth."""
    record, _ = _plan(tmp_path, "--model", "tiny", "--batch", "64", "--dtype", "bf16",
                      "--plan", "1", "--accum-steps", "1", *PLAIN_STEP, hardware="h200")
    assert record["compiled_for"] == "gpu"
    assert record["gpu_program"]["bandwidth"] == 4.8e12


def _kernel_of(entry: dict[str, hlo.Instr], name: str) -> hlo.Instr:
    """The kernel behind a value: through get-tuple-element and bitcast (no kernels)."""
    instr = entry[name]
    while instr.opcode in ("get-tuple-element", "bitcast"):
        instr = entry[instr.operands[0]]
    return instr


def _transposes(module: hlo.Module, instr: hlo.Instr) -> bool:
    """Whether a kernel is, or its fused computations hold, a transpose or a copy."""
    if kernels.classify(instr) == "transposes/copies":
        return True
    pending, seen = list(instr.callees), set()
    while pending:
        comp = pending.pop()
        if comp in seen:
            continue
        seen.add(comp)
        for i in module.computations.get(comp, []):
            if i.opcode in ("transpose", "copy"):
                return True
            pending += i.callees
    return False


@needs_plugin
@pytest.mark.slow
def test_the_headline_program_calls_cudnn_attention(tmp_path):
    """vit-cifar in bf16 on the H100: cuDNN's fused attention, forward and backward, once
    per layer each but the last (6 layers; the last block, on the class token, runs its
    one query row as two einsums), chosen for the target (not for this CPU); its q, k and v
    each come from a GEMM of their own on the padded LayerNorm output, and the kernels
    that read its outputs only slice the token axis: no head transposes or pad copies
    around it. Nor around the matmuls: with the residual
    stream as (B*T, E) rows (model.encoder), transposes and copies are under 10% of the
    step's traffic (19.7% with it carried as (B, T, E), which XLA:GPU laid out
    batch-minor). And fc1's GELU runs in its cuBLASLt call's epilogue (its bias inside
    the product, layers.linear.dense), once per layer."""
    record, program = _plan(tmp_path, "--batch", "64", "--dtype", "bf16", "--plan", "1",
                            "--accum-steps", "1")
    assert record["gpu_program"]["classes"]["attention"]["kernels"] == 2 * 5
    assert any("attention: cuDNN fused" in note for note in record["notes"])
    entry = {i.name: i for i in program.computations[program.entry]}
    calls = [i for i in entry.values() if kernels.classify(i) == "attention"]
    targets_called = [re.search(r'custom_call_target="([^"]+)"', c.attrs).group(1)
                      for c in calls]
    assert sorted(targets_called) == (["__cudnn$fmhaSoftmax"] * 5
                                      + ["__cudnn$fmhaSoftmaxBackward"] * 5)
    readers = {}  # kernel -> the kernels that read its outputs
    for i in entry.values():
        if i.opcode not in ("get-tuple-element", "bitcast"):
            for o in i.operands:
                readers.setdefault(_kernel_of(entry, o).name, []).append(i)
    called = {c.name for c in calls}
    for call in calls:
        around = [_kernel_of(entry, o) for o in call.operands] + readers[call.name]
        moved = [k.name for k in around if k.name not in called and _transposes(program, k)]
        assert not moved, f"{call.name}: transposes around it: {moved}"
    gpu = record["gpu_program"]
    moved = gpu["classes"]["transposes/copies"]["bytes"] / gpu["bytes"]
    assert moved < 0.10, f"transposes and copies are {moved:.1%} of the traffic"
    epilogues = collections.Counter(
        re.search(r'"epilogue":"([A-Z_]+)"', i.attrs).group(1) for i in entry.values()
        if 'custom_call_target="__cublas$lt$matmul"' in i.attrs)
    assert epilogues["GELU_AUX"] == 6, epilogues


def test_the_benchmark_refuses_bad_rows_in_one_line():
    """benchmarks.deviceless checks every row's flags with the training script's parser
    before it compiles anything: one line, exit code 2 (plugin or not)."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.deviceless", "--model", "tiny",
                          "--kit", "ok=--dropout 0", "--kit", "bad=--no-such-flag"],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=subprocess_env())
    assert run.returncode == 2
    assert run.stderr.strip() == ("error: --kit 'bad=--no-such-flag': the training script "
                                  "refuses it: unrecognized arguments: --no-such-flag")


# FRAGMENT with a GEMM that XLA:GPU generated itself (a Triton fusion, as an autotuned
# compile may choose) in place of the cuBLAS call.
TRITON = FRAGMENT.replace(
    "\nENTRY", """
%triton_gemm_computation (p0: bf16[64,16], p1: bf16[16,32]) -> bf16[64,32] {
  %p0 = bf16[64,16]{1,0} parameter(0)
  %p1 = bf16[16,32]{1,0} parameter(1)
  ROOT %dot = bf16[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY""").replace(
    '%gemm = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(%a, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}\n  %out = bf16[64,32]{1,0} get-tuple-element(%gemm), index=0',
    '%out = bf16[64,32]{1,0} fusion(%a, %w), kind=kCustom, calls=%triton_gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}')


def test_a_program_compiled_elsewhere_reads_as_a_row(tmp_path):
    """`benchmarks.deviceless --program LABEL=FILE` reads an optimised XLA:GPU module (a
    GPU's own compile) into a row of the same figures, with no plugin: a GEMM fusion's
    FLOPs count, in its kernel's floor too; a bad file or spec is one line, exit code 2."""
    from benchmarks import deviceless

    assert "__triton_gemm" in TRITON and "cublas" not in TRITON
    row = deviceless.program_row(TRITON, "h100")
    gpu = row["gpu_program"]
    assert gpu["kernels"] == 6 and gpu["classes"]["gemm"]["kernels"] == 1
    assert gpu["flops"] == row["flops"]["program_per_device"] == 2 * 64 * 32 * 16
    assert gpu["classes"]["gemm"]["bytes"] == 2 * (64 * 16 + 16 * 32 + 64 * 32)
    assert row["memory"] is None and row["compile_s"] is None
    # The same figures as the cuBLAS fragment's (the same GEMM, another library).
    cublas = deviceless.program_row(FRAGMENT, "h100")["gpu_program"]
    assert (gpu["bytes"], gpu["flops"]) == (cublas["bytes"], cublas["flops"])

    program = tmp_path / "module.gpu_after_optimizations.txt"
    program.write_text(TRITON)
    run = subprocess.run([sys.executable, "-m", "benchmarks.deviceless", "--program",
                          f"gpu={program}"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=subprocess_env())
    assert run.returncode == 0, run.stderr[-3000:]
    [line] = [r for r in run.stdout.splitlines() if r.startswith("| gpu |")]
    assert line.split("|")[2:4] == [" - ", " 6 "]
    for spec, says in ((f"gpu={tmp_path / 'none.txt'}", "No such file or directory"),
                       ("gpu", "give LABEL=FILE"),
                       (f"gpu={REPO / 'README.md'}", "not an optimised XLA:GPU module")):
        run = subprocess.run([sys.executable, "-m", "benchmarks.deviceless", "--program",
                              spec], cwd=REPO, capture_output=True, text=True, timeout=120,
                             env=subprocess_env())
        assert run.returncode == 2 and run.stdout == ""
        assert run.stderr.startswith(f"error: --program {spec!r}: ") and says in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1


@needs_plugin
@pytest.mark.slow
def test_the_benchmark_compiles_its_rows_for_the_h100(tmp_path):
    """One tiny row through benchmarks.deviceless: its figures are the deviceless plan's,
    its NAME=VALUE words reach its process only, and the table shows it."""
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.deviceless", "--model", "tiny",
                          "--batch", "16", "--kit", "nodrop=VIT_PURE_ROW_PROBE=7 --dropout 0",
                          "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=subprocess_env())
    assert run.returncode == 0, run.stderr[-3000:]
    [row] = json.loads(out.read_text())["results"]
    assert "error" not in row, row
    assert row["name"] == "nodrop" and row["env"] == {"VIT_PURE_ROW_PROBE": "7"}
    m, gpu = row["memory"], row["gpu_program"]
    assert m["total"] == m["argument"] + m["output"] - m["alias"] + m["temp"] > 0
    assert gpu["kernels"] == sum(c["kernels"] for c in gpu["classes"].values()) > 0
    assert gpu["bytes"] == sum(c["bytes"] for c in gpu["classes"].values()) > 0
    assert gpu["flops"] == gpu["classes"]["gemm"]["flops"] > 0
    assert any("compiled for h100: XLA:GPU" in n for n in row["notes"])
    table = [ln for ln in run.stdout.splitlines() if ln.startswith("| nodrop |")]
    assert len(table) == 1 and f"| {gpu['kernels']:,} |" in table[0]


# What pip says when no registry answers (then the GPU install cannot be checked here).
OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Network is unreachable",
           "Temporary failure in name resolution", "ConnectTimeout", "Max retries exceeded")


@pytest.mark.slow  # without the plugin, pip fetches the CUDA wheels' metadata: about a minute
def test_the_gpu_install_command_resolves():
    """`pip install -r requirements-gpu.txt` (README's GPU command) resolves, and to the
    CUDA build of the jax installed here: it would install no other jax, and its plugin,
    if any is to be installed, is of the same version."""
    import jax

    run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                          "--report", "-", "-r", "requirements-gpu.txt"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 and any(word in run.stderr for word in OFFLINE):
        pytest.skip("no package registry answers: " + run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    to_install = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                  for i in report["install"]}
    assert "jax" not in to_install and "jaxlib" not in to_install, to_install
    for name in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
        assert to_install.get(name, jax.__version__) == jax.__version__, to_install
    if not targets.cuda_plugin_installed():
        assert "jax-cuda12-plugin" in to_install, to_install
