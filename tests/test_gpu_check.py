"""benchmarks/gpu_check.py, the prepared GPU check, cannot rot between GPU loans.

* default tier: the rows it times and the headline command it runs parse with the training
  script's flags, and its summary reads a record;
* slow tier: `--dry-run` runs every part on this CPU (the kernels in Pallas's interpreter,
  no timing) and writes the JSON and the summary.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import subprocess_env

from benchmarks import gpu_check, harness


def test_the_rows_and_the_headline_command_parse(tmp_path):
    steps = gpu_check._steps(tmp_path, dry=True)
    log = gpu_check._log(tmp_path, dry=True)
    assert steps["status"] == log["status"] == "dry run: flags checked"
    command = " ".join(steps["command"])
    for row in gpu_check.STEP_ROWS:
        assert f"--kit {row}" in command
    assert "--only kit,torch-compile" in command
    assert log["command"][1:] == ["train_shardmap.py", *gpu_check.HEADLINE]
    assert sum(gpu_check.LIMITS.values()) <= 8 * 60  # the loan's 8 minutes


def test_the_summary_reads_a_record():
    record = {"started": "t", "dry_run": False, "parts": {
        "kernels": {"status": "ok", "rows": [
            {"kernel": "gelu_fc2_forward", "dtype": "bfloat16", "error": 0.002,
             "kernel_ms": 2.0, "xla_ms": 3.0},
            {"kernel": "qkv_projection", "dtype": "float32", "error": float("nan"),
             "failed": "ValueError: no"}]},
        "steps": {"status": "failed (timeout)", "seconds": 200.0, "log": "steps.md"}}}
    text = gpu_check.summary(record)
    assert "| gelu_fc2_forward | bfloat16 | 2.00e-03 | 2.000 | 3.000 | 1.50 |" in text
    assert "- steps: failed (timeout), 200.0 s (steps.md)" in text


@pytest.mark.slow
def test_the_dry_run_runs_every_part(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path),
                          "--dry-run"], cwd=harness.REPO, capture_output=True, text=True,
                         timeout=900, env=subprocess_env(JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = record["parts"]
    assert list(parts) == list(gpu_check.LIMITS) and record["dry_run"]
    assert parts["env"]["status"] == "ok" and parts["env"]["jax"]
    rows = parts["kernels"]["rows"]
    assert {r["kernel"] for r in rows} == {"gelu_fc2_forward", "gelu_fc2_backward",
                                           "gelu_fc2_weight_gradient", "qkv_projection",
                                           "qkv_input_gradient"}
    assert all(r["error"] < 2 ** -6 for r in rows), rows  # bf16, interpreted
    assert parts["program"]["status"] in ("ok", "skipped: no JAX CUDA plugin for the "
                                                "deviceless compile"), parts["program"]
    assert "gelu_fc2_backward" in (tmp_path / "summary.md").read_text()
