"""The GPU profile read right and the predictor fitted class by class, on the files of the
H100 run of 2026-11-27 (shared/gpu-runs/, beside the checkout; skipped where absent) and
the H200 run in docs/gpu-runs/.

* each trace (three steps run as one CUDA graph each) joined to the program XLA compiled
  there: every event of the step matched, the classes at the times summed from the trace
  by hand (H100) and reported by gpu_check on the GPU (H200);
* each GPU's shipped rates are the class-by-class fit to its profile, and they predict
  each class of its program within 10% and its step within 5%; the H200's own program of
  2026-11-27 within 5% of its 73.4 ms; every kit row's program a GPU run wrote
  (`gpu_check`'s steps part, DIR/programs/) within 5% of that row's step, but for rows run
  under XLA_FLAGS (skipped: the predictor prices autotuned GEMMs);
* `fit_step --profile` refuses, in one line, the profile that run's gpu_check wrote
  (everything under the CUDA graph's name), and a --hardware other than the profile's;
* the walk on a hand-made trace: a de-duplicated fusion named after another, library
  kernels and Memsets split between consecutive custom calls.
"""
from __future__ import annotations

import gzip
import json
import pathlib
import statistics
import subprocess
import sys

import pytest
from conftest import subprocess_env

from benchmarks import deviceless, fit_step, profile_breakdown
from vit_pure.errors import UsageError
from vit_pure.plan import interconnect as ic
from vit_pure.plan import targets
from vit_pure.xla import hlo, kernels

REPO = pathlib.Path(__file__).resolve().parents[1]
_RUNS = next((p / "shared" / "gpu-runs" for p in REPO.parents
              if (p / "shared" / "gpu-runs").is_dir()), None)
# Every folder of GPU runs: the shared one beside the checkout, and the runs on file here.
RUN_ROOTS = [r for r in (_RUNS, REPO / "docs" / "gpu-runs") if r is not None]
H100_RUN = _RUNS / "2026-11-27-h100" if _RUNS else None
H200_RUN = _RUNS / "2026-11-27-h200" if _RUNS else None
H100_STEP_MS = 67.0   # steps.md there: the kit as shipped
H200_STEP_MS = 73.4   # steps.md of the H200 run
H200_ON_FILE = REPO / "docs" / "gpu-runs" / "2026-11-28-h200"  # gpu_check's files there
H200_PROFILE = H200_ON_FILE / "kernel_times.json"


def _need(path):
    if path is None or not path.exists():
        pytest.skip(f"the shared GPU run is not beside this checkout ({path})")
    return path


def _join(trace, program):
    """A trace of three steps joined to the program they ran: (module, kernel_times
    record)."""
    module = profile_breakdown.read_program(str(program))
    events, _ = profile_breakdown.device_events(profile_breakdown.load_events([str(trace)]))
    found = kernels.kernels(module, lambda comp: hlo.computation_dot_flops(module, comp))
    return module, profile_breakdown.kernel_times(found, events, 3, module=module)


@pytest.fixture(scope="module")
def h100_profile():
    """The H100 trace joined to its program: (module, kernel_times record)."""
    trace = _need(H100_RUN and H100_RUN / "profile.trace.json.gz")
    module, record = _join(trace, _need(H100_RUN / "step.hlo.txt.gz"))
    return module, {**record, "step_ms": H100_STEP_MS}


def test_the_h100_trace_joins_its_program(h100_profile):
    """Every kernel event of the three steps is given to an instruction: 480 kernel
    launches a step, 0 failed name checks; attention (cuDNN, 5 layers) 14.59 ms and the
    GEMMs 26.1 ms a step, the dropout masks' hashes (rng) 1.71."""
    module, record = h100_profile
    assert record["steps"] == 3 and record["matched_fraction"] >= 0.99
    assert record["failed_name_checks"] == 0 and record["unmatched_us"] < 0.01 * 66.9e3
    ms = record["classes_ms"]
    assert ms["attention"] == pytest.approx(14.59, rel=0.03)
    assert ms["gemm"] == pytest.approx(26.1, rel=0.03)
    assert ms["rng"] == pytest.approx(1.71, rel=0.05)
    assert sum(ms.values()) == pytest.approx(66.9, rel=0.01)
    assert record["step_ms_trace"] == pytest.approx(H100_STEP_MS, rel=0.02)
    launches = profile_breakdown.launches(module)
    assert len(launches) == 480
    timed = {k["name"] for k in record["kernels"] if k["us"] > 0}
    assert {i.name for i, _ in launches} <= timed


def test_the_h200_trace_of_the_run_on_file_joins_its_program():
    """The H200 run in docs/gpu-runs/: its trace, written by gpu_check's profile part, joined
    to its program here gives what the part reported there (profile.json)."""
    _, record = _join(H200_ON_FILE / "profile.trace.json.gz", H200_ON_FILE / "step.hlo.txt.gz")
    reported = json.loads((H200_ON_FILE / "profile.json").read_text())
    assert record["matched_fraction"] >= 0.99 and record["failed_name_checks"] == 0
    for kind, ms in reported["classes_ms"].items():
        assert record["classes_ms"][kind] == pytest.approx(ms, abs=0.01), kind
    assert reported["classes_ms"]["gemm"] == 23.47 and reported["classes_ms"]["attention"] == 13.84


def test_the_cli_writes_the_join(tmp_path):
    out = tmp_path / "join.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.profile_breakdown",
         str(_need(H100_RUN and H100_RUN / "profile.trace.json.gz")),
         "--program", str(H100_RUN / "step.hlo.txt.gz"), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["matched_fraction"] >= 0.99 and set(got["classes_ms"]) >= {"gemm", "attention",
                                                                         "rng"}
    assert "| attention | 14.59 |" in run.stdout


def _h200_record():
    return json.loads(H200_PROFILE.read_text())


@pytest.mark.parametrize("hardware", ["h100", "h200"])
def test_the_rates_are_the_fit_to_their_gpus_profile(hardware, request):
    """kernels.RATES[hardware] is benchmarks.fit_step's class-by-class fit to that GPU's
    profile (rounded: within 2% each), with nothing left at a default: the H100's on the
    shared run, the H200's on the run in docs/gpu-runs/."""
    if hardware == "h100":
        _, record = request.getfixturevalue("h100_profile")
    else:
        record = _h200_record()
    bandwidth = targets.memory_bandwidth(hardware)
    peak = ic.HARDWARE[hardware].peak_flops
    got, _, defaults = fit_step.fit_profile({**record, "idle_ms": record["idle_ms"]},
                                            bandwidth, peak)
    shipped = kernels.RATES[hardware]
    assert not [d for d in defaults if "e_gemm" in d or "attention" in d], defaults
    for name in kernels.GEMM_SHAPES:
        assert shipped.compute("gemm", name) == pytest.approx(got.compute("gemm", name),
                                                              rel=0.02), name
    for name in kernels.ATTENTION_PASSES:
        assert shipped.compute("attention", name) == pytest.approx(
            got.compute("attention", name), rel=0.02), name
    for name in ("elementwise", "norms/reductions", "transposes/copies"):
        assert shipped.mem(name) == pytest.approx(got.mem(name), rel=0.02), name
    assert shipped.int_per_s == pytest.approx(got.int_per_s, rel=0.02)
    assert shipped.launch_s == pytest.approx(got.launch_s, rel=0.05)


def _predicts_each_class_and_the_step(module, hardware: str, classes_ms: dict,
                                      step_ms: float) -> None:
    """kernels.RATES[hardware] on `module`: each class within 10% of its measured time,
    the step within 5% of `step_ms`."""
    found = kernels.kernels(module, lambda comp: hlo.computation_dot_flops(module, comp))
    bandwidth, peak = targets.memory_bandwidth(hardware), ic.HARDWARE[hardware].peak_flops
    rates = kernels.RATES[hardware]
    by_class = kernels.predicted_by_class(found, bandwidth, peak, rates)
    for kind, measured in classes_ms.items():
        assert by_class[kind] * 1e3 == pytest.approx(measured, rel=0.10), kind
    step = kernels.predicted_s(found, bandwidth, peak, rates) * 1e3
    assert step == pytest.approx(step_ms, rel=0.05)


def test_the_shipped_rates_predict_each_class_of_the_h100_program(h100_profile):
    """Each class within 10% of its measured time, the step within 5% of 67.0 ms."""
    module, record = h100_profile
    _predicts_each_class_and_the_step(module, "h100", record["classes_ms"], H100_STEP_MS)


def test_the_shipped_rates_predict_each_class_of_the_h200_program():
    """The H200 run in docs/gpu-runs/: each class within 10% of its measured time, the
    step within 5% of the pipelined step measured there."""
    record = _h200_record()
    module = profile_breakdown.read_program(str(H200_ON_FILE / "step.hlo.txt.gz"))
    _predicts_each_class_and_the_step(module, "h200", record["classes_ms"], record["step_ms"])


def test_the_h200s_own_program_is_predicted_within_5_percent():
    dump = _need(H200_RUN and H200_RUN / "train_step.gpu_after_optimizations.txt.gz")
    row = deviceless.program_row(gzip.decompress(dump.read_bytes()).decode(), "h200")
    assert row["gpu_program"]["predicted_s"] * 1e3 == pytest.approx(H200_STEP_MS, rel=0.05)


def _rows_with_programs() -> list:
    """(program, the row's median step ms, --hardware) of each kit row whose program a
    GPU run on file wrote beside its steps.json (`benchmarks.peers --programs`). A row run
    under XLA_FLAGS is skipped: the flags change what XLA does past the program (the GEMM
    algorithms: `--xla_gpu_autotune_level=0` leaves cuBLAS its default ones, which the
    rates, fitted to autotuned GEMMs, do not price)."""
    rows = []
    for steps in sorted(s for root in RUN_ROOTS for s in root.glob("*/steps*.json")):
        env = steps.parent / "env.json"
        hardware = json.loads(env.read_text()).get("hardware") if env.exists() else None
        for r in json.loads(steps.read_text())["results"]:
            path = steps.parent / "programs" / pathlib.Path(r.get("program") or "-").name
            if hardware and r.get("step_s") and path.is_file():
                flags = (r.get("env") or {}).get("XLA_FLAGS")
                marks = [pytest.mark.skip(reason=f"run under XLA_FLAGS={flags}")] if flags else []
                rows.append(pytest.param(path, statistics.median(r["step_s"]) * 1e3, hardware,
                                         id=f"{steps.parent.name}/{steps.name}/{r['name']}",
                                         marks=marks))
    return rows or [pytest.param(None, None, None, marks=pytest.mark.skip(
        reason="no GPU run on file has written its rows' programs yet (gpu_check's steps "
               "part writes DIR/programs/)"))]


@pytest.mark.parametrize("program, step_ms, hardware", _rows_with_programs())
def test_every_row_on_file_with_its_program_is_predicted_within_5_percent(program, step_ms,
                                                                          hardware):
    text = gzip.decompress(program.read_bytes()).decode()
    row = deviceless.program_row(text, hardware)
    assert row["gpu_program"]["predicted_s"] * 1e3 == pytest.approx(step_ms, rel=0.05)


def test_fit_step_refuses_a_profile_that_attributes_nothing():
    """The profile gpu_check wrote on that run: all 67 ms under the CUDA graph's name."""
    old = _need(H100_RUN and H100_RUN / "kernel_times.json")
    run = subprocess.run([sys.executable, "-m", "benchmarks.fit_step", "--profile", str(old)],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=subprocess_env())
    assert run.returncode == 2 and run.stdout == ""
    [line] = run.stderr.strip().splitlines()
    assert "attributes 0.0%" in line and "command_buffer_1" in line


# A program of two identical fusions (the second de-duplicated without a mark), a copy
# and two consecutive cuBLAS calls, then a cuDNN call.
WALK = """HloModule jit_step, entry_computation_layout={()->()}

%fused_a (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p0)
}

%fused_b (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p0)
}

ENTRY %main (x: f32[8], w: bf16[64,64]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %loop_negate_fusion = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %loop_negate_fusion.1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_b
  %copy.3 = f32[8]{0} copy(%loop_negate_fusion.1)
  %gemm.1 = (bf16[64,64]{1,0}, s8[16]{0}) custom-call(%w, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %gemm.2 = (bf16[64,64]{1,0}, s8[16]{0}) custom-call(%w, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %fmha.1 = (bf16[64,64]{1,0}, u8[16]{0}) custom-call(%w, %w, %w), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  ROOT %loop_negate_fusion.2 = f32[8]{0} fusion(%copy.3), kind=kLoop, calls=%fused_a
}
"""


def _events(names_durations, module="jit_step", correlation="7", start=100.0):
    events, ts = [], start
    for name, dur in names_durations:
        events.append({"ph": "X", "pid": 1, "tid": 14, "ts": ts, "dur": dur, "name": name,
                       "args": {"hlo_module": module, "correlation_id": correlation,
                                "hlo_op": "command_buffer_1"}})
        ts += dur + 1.0
    return events


def test_the_walk_gives_each_event_to_its_instruction():
    module = hlo.parse_module(WALK)
    run = [("loop_negate_fusion", 1.0), ("loop_negate_fusion", 2.0), ("memcpy32_post", 3.0),
           ("Memset 0", 4.0), ("nvjet_sm90_tst_128x128", 5.0), ("nvjet_sm90_tss_64x64", 6.0),
           ("Memset 0", 7.0), ("cudnn_flash_bprop", 8.0), ("cudnn_convert_dq", 9.0),
           ("loop_negate_fusion", 10.0)]
    events = (_events(run) + _events(run, correlation="9", start=1000.0)
              + _events([("input_fusion", 50.0)], module="jit_other", correlation="8"))
    joined = profile_breakdown.join(module, events)
    assert joined["executions"] == 2 and joined["failed_name_checks"] == 0
    assert joined["matched_fraction"] == pytest.approx(1.0)
    assert joined["us_per_step"] == {
        "loop_negate_fusion": 1.0, "loop_negate_fusion.1": 2.0, "copy.3": 3.0,
        "gemm.1": 9.0, "gemm.2": 6.0, "fmha.1": 24.0, "loop_negate_fusion.2": 10.0}
    assert joined["step_ms"] == pytest.approx(0.9)  # from 100 us to 1000 us
    # An event no launch takes: unmatched, and named.
    bad = profile_breakdown.join(module, _events(run[:-1] + [("loop_unknown_fusion", 5.0)]))
    assert bad["unmatched_top"] == [["loop_unknown_fusion", 5.0]]
    # A kernel named after a launch that is not next: the walk skips to it (a failed check).
    skipped = profile_breakdown.join(module, _events(run[:1] + run[2:]))
    assert skipped["failed_name_checks"] == 0  # the second runs under the first's name
    jumped = profile_breakdown.join(module, _events([run[0], ("loop_negate_fusion_2", 1.0)]))
    assert jumped["failed_name_checks"] == 1
    assert jumped["us_per_step"]["loop_negate_fusion.2"] == 1.0
    assert bad["matched_fraction"] == pytest.approx(1 - 5.0 / 50.0)


# The rows measured on the H100 (2026-11-27, steps*.md there) as deviceless compiles
# of the kit: label, flags, step ms.
DEVICELESS_ROWS = (("as shipped", "", 67.0), ("every row", "--last-block all", 76.0),
                   ("remat gelu", "--remat gelu", 68.7))


@pytest.mark.slow
@pytest.mark.skipif(not targets.cuda_plugin_installed(),
                    reason="JAX's CUDA plugin is not installed (pip install -r requirements-gpu.txt)")
def test_the_deviceless_rows_are_predicted_near_their_measured_steps(tmp_path):
    """The three rows measured on the H100, compiled deviceless (jax here) and priced at
    the shipped rates: each within 8% of its step, and the rows' differences (the last
    block on every token: +9.0 ms; the GELU output recomputed: +1.7 ms) within 1.5 ms.
    Two things make the programs compiled here lighter than the ones measured: the
    deviceless compile fuses fc1's GELU into its GEMM (cuBLASLt's GELU_AUX), which the
    GPU's own compile did not (~3 ms, docs/performance.md), and the kit has changed since
    the measurement (q, k, v's data gradients accumulated by their GEMMs, `linear.fan_out`:
    predicted 0.4 ms lighter, not yet timed on a GPU; compiled as measured, with
    `--qkv-data-grads sum`, the rows are still 6% under). Hence 8%, where the GPU's own
    programs meet 5% (`test_the_shipped_rates_predict_each_class_of_the_h100_program`);
    the differences between rows carry neither offset."""
    out = tmp_path / "rows.json"
    argv = [sys.executable, "-m", "benchmarks.deviceless", "--hardware", "h100",
            "--json", str(out)]
    for label, flags, _ in DEVICELESS_ROWS:
        argv += ["--kit", f"{label}={flags}"]
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1500,
                         env=subprocess_env(JAX_PLATFORMS="cpu",
                                            JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    predicted = {label: rows[label]["gpu_program"]["predicted_s"] * 1e3
                 for label, _, _ in DEVICELESS_ROWS}
    for label, _, measured in DEVICELESS_ROWS:
        assert predicted[label] == pytest.approx(measured, rel=0.08), (label, predicted)
        assert set(rows[label]["gpu_program"]["predicted_s_by_class"]) >= {"gemm", "attention"}
    base = predicted["as shipped"]
    for label, _, measured in DEVICELESS_ROWS[1:]:
        assert predicted[label] - base == pytest.approx(measured - 67.0, abs=1.5), label


def test_fit_step_takes_the_gpu_a_profile_names(capsys):
    """A profile's rates are shares of its own GPU's peaks: fit_step reads the GPU from the
    record, and refuses in one line a --hardware that names another."""
    assert fit_step.main(["--profile", str(H200_PROFILE)]) == 0
    assert "e_mem by class: norms/reductions 0.653" in capsys.readouterr().out  # of 4.8 TB/s
    with pytest.raises(UsageError, match="taken on h200 .NVIDIA H200.") as e:
        fit_step.main(["--profile", str(H200_PROFILE), "--hardware", "h100"])
    assert "\n" not in str(e.value)
