"""The plan compiled for a GPU without one (vit_pure/plan/targets.py, vit_pure/xla/kernels.py).

The kernel reading is checked on a hand-written fragment of XLA:GPU's HLO (no plugin
needed). The compiles need JAX's CUDA plugin (`pip install -r requirements-gpu.txt`, about
5.5 GB): they are skipped, saying so, where it is not installed, which includes .ci/run
(its install takes about 100 s of the CI's 15 minutes). Run them with the plugin:
`python -m pytest -q -m slow tests/test_deviceless.py`.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

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
  %loop_add_fusion = bf16[64,32]{1,0} fusion(%out, %out), kind=kLoop, calls=%fused_add
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
    assert t["floor_s"] == pytest.approx(sum(max(k.bytes / 1e9, k.flops / 1e12)
                                             for k in found.values()) + 6 * kernels.LAUNCH_S)
    assert "gemm" in kernels.report(t) and "transposes/copies" in kernels.report(t)


def test_the_h100_description_is_the_gpu_the_kit_measured():
    text = (targets.TARGETS_DIR / targets.GPU_TARGETS["h100"]).read_text()
    assert "core_count: 132" in text and 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
    assert targets.memory_bandwidth("h100") == 3.35232e12


def _plan(tmp_path, *flags) -> dict:
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "train_shardmap.py", *flags, "--hardware", "h100",
                          "--plan-json", str(out)], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=subprocess_env(JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled for h100: XLA:GPU for NVIDIA H100 80GB HBM3, deviceless" in run.stdout
    return json.loads(out.read_text())


@needs_plugin
@pytest.mark.slow
def test_a_tiny_model_compiles_for_eight_h100s(tmp_path):
    record = _plan(tmp_path, "--model", "tiny", "--batch", "64", "--dtype", "bf16",
                   "--mesh", "data=4,model=2", "--plan", "8", "--accum-steps", "1")
    assert record["compiled_for"] == "gpu" and record["devices"] == 8
    program = record["gpu_program"]
    assert program["kernels"] > 0 and program["classes"]["gemm"]["kernels"] > 0
    assert {c["kind"] for c in record["collectives"]} == {"all-reduce"}
    assert {c["axes"] for c in record["collectives"]} == {"model", "data"}
    assert record["memory"]["total"] > 0


@needs_plugin
@pytest.mark.slow
def test_the_headline_program_calls_cudnn_attention(tmp_path):
    """vit-cifar in bf16 on the H100: cuDNN's fused attention, forward and backward, once
    per layer each (6 layers), chosen for the target (not for this CPU)."""
    record = _plan(tmp_path, "--batch", "64", "--dtype", "bf16", "--plan", "1",
                   "--accum-steps", "1")
    assert record["gpu_program"]["classes"]["attention"]["kernels"] == 2 * 6
    assert any("attention: cuDNN fused" in note for note in record["notes"])
