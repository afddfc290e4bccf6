"""benchmarks/gpu_check.py, the prepared GPU check, cannot rot between GPU loans.

* default tier: the rows it times and the headline command it runs parse with the training
  script's flags, its summary reads a record, and a GEMM is timed one product a call;
* slow tier: `--dry-run` runs every part on this CPU (no timing) and writes the JSON and
  the summary: the profile and GEMM-shape parts run the tiny model here, and
  benchmarks.fit_step fits its profile.
"""
from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import subprocess_env

from benchmarks import gpu_check, gpu_check_parts, harness
from vit_pure.xla import kernels


def test_the_rows_and_the_headline_command_parse(tmp_path):
    steps = gpu_check._steps(tmp_path, dry=True)
    log = gpu_check._log(tmp_path, dry=True)
    assert steps["status"] == log["status"] == "dry run: flags checked"
    command = " ".join(steps["command"])
    for row in gpu_check.STEP_ROWS + gpu_check.GELU_ROWS + gpu_check.LAST_ROWS:
        assert f"--kit {row}" in command
    assert "--only torch-compile,kit" in command  # the comparator first
    assert log["command"][1:] == ["train_shardmap.py", *gpu_check.HEADLINE]
    assert sum(gpu_check.LIMITS.values()) <= 8 * 60  # the loan's 8 minutes


def test_the_summary_reads_a_record():
    record = {"started": "t", "dry_run": False, "parts": {
        "steps": {"status": "failed (timeout)", "seconds": 200.0, "log": "steps.md"}}}
    text = gpu_check.summary(record)
    assert "- steps: failed (timeout), 200.0 s (steps.md)" in text
    part = {"status": "ok", "step_ms": 70.0, "kernels_ms": 68.0, "unmatched_ms": 0.5,
            "classes_ms": {"gemm": 40.0, "elementwise": 20.0}}
    table = gpu_check.part_table("profile", part)
    assert "| gemm | 40.00 |" in table
    assert "| step (pipelined, inputs staged) | 70.00 |" in table
    record["parts"]["profile"] = {**part, "table": table}
    assert "## profile" in gpu_check.summary(record)


@pytest.mark.slow
def test_the_dry_run_runs_every_part(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path),
                          "--dry-run"], cwd=harness.REPO, capture_output=True, text=True,
                         timeout=len(gpu_check.CHILD_PARTS) * gpu_check.DRY_LIMIT_S + 120,
                         env=subprocess_env(JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = record["parts"]
    assert list(parts) == list(gpu_check.LIMITS) and record["dry_run"]
    assert parts["env"]["status"] == "ok" and parts["env"]["jax"]
    assert parts["program"]["status"] in ("ok", "skipped: no JAX CUDA plugin for the "
                                                "deviceless compile"), parts["program"]
    assert parts["profile"]["status"] == "ok", parts["profile"]
    assert parts["profile"]["classes_ms"]["gemm"] > 0
    assert parts["gemms"]["status"] == "ok" and parts["gemms"]["shapes"], parts["gemms"]
    assert all(r["tflop_per_s"] > 0 for r in parts["gemms"]["shapes"])
    fit = subprocess.run([sys.executable, "-m", "benchmarks.fit_step", "--profile",
                          str(tmp_path / "kernel_times.json")], cwd=harness.REPO,
                         capture_output=True, text=True, timeout=120,
                         env=subprocess_env(JAX_PLATFORMS="cpu"))
    assert fit.returncode == 0 and "fit on the profile of tiny" in fit.stdout, fit.stderr
    assert "- program: " in (tmp_path / "summary.md").read_text()


def test_a_gemm_is_timed_one_product_a_call():
    """Three copies of one product in one jit compile to one product (XLA's CSE): the
    GEMM-shape part once divided one product's time by three. A call now runs exactly one
    product, of the program's layout (here a weight gradient: both operands contract their
    leading dimension) and result dtype."""
    g = kernels.Gemm(lhs=(2, 64, 24), rhs=(2, 64, 16), lhs_dtype="bf16", rhs_dtype="bf16",
                     out_dtype="f32", lhs_contracting=(1,), rhs_contracting=(1,),
                     lhs_batch=(0,), rhs_batch=(0,))
    f, a, b = gpu_check_parts.gemm_call(g)
    compiled = f.lower(a, b).compile().as_text()
    assert compiled.count(" dot(") == 1, compiled
    got = np.asarray(jax.block_until_ready(f(a, b)))
    assert got.dtype == np.float32 and got.shape == (2, 24, 16)
    want = np.einsum("bkm,bkn->bmn", np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.std(np.asarray(a, np.float32)) > 0.5  # random operands, not a constant
