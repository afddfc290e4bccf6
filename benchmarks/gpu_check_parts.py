"""The parts of benchmarks/gpu_check.py that run in a child process of their own (they
start JAX): the environment and the program. Each returns a JSON-ready dict."""
from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys

import jax

from benchmarks import harness
from vit_pure.plan import targets


def env(out: pathlib.Path, dry: bool) -> dict:
    device = jax.devices()[0]
    text = (targets.TARGETS_DIR / targets.GPU_TARGETS["h100"]).read_text()
    h100 = text.split('device_description_str: "')[1].split('"')[0]
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return {"status": "ok", "jax": jax.__version__, "python": platform.python_version(),
            "torch": torch_version, "platform": device.platform,
            "device": getattr(device, "device_kind", str(device)),
            "compute_capability": getattr(device, "compute_capability", None),
            "memory_limit": (stats or {}).get("bytes_limit"), "h100_description": h100,
            "is_h100": getattr(device, "device_kind", "") == h100}


def program(out: pathlib.Path, dry: bool) -> dict:
    """The headline's program as the GPU compiles it, read beside the deviceless compile
    (a dry run: the tiny model's deviceless compile alone, where the plugin is)."""
    env = {**os.environ}
    if dry:
        if not targets.cuda_plugin_installed():
            return {"status": "skipped: no JAX CUDA plugin for the deviceless compile"}
        argv = ["--model", "tiny", "--batch", "64", "--kit", "tiny="]
        env.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    else:
        dump = out / "dump"
        subprocess.run([sys.executable, "-m", "benchmarks.peers", "--only", "kit", "--batch",
                        "4096", "--dtype", "bf16", "--steps", "2", "--warmup", "1"],
                       cwd=harness.REPO, check=True, capture_output=True, timeout=60,
                       env={**env, "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
                                               "--xla_dump_hlo_module_re=.*train_step.*"})
        [gpu] = sorted(dump.glob("*train_step*gpu_after_optimizations.txt"))[-1:]
        argv = ["--kit", "as shipped=", "--program", f"gpu={gpu}"]
    run = subprocess.run([sys.executable, "-m", "benchmarks.deviceless", *argv, "--json",
                          str(out / "program-rows.json")], cwd=harness.REPO,
                         capture_output=True, text=True, timeout=90 * (4 if dry else 1), env=env)
    (out / "program.md").write_text(run.stdout + run.stderr[-3000:])
    return {"status": "ok" if run.returncode == 0 else f"failed ({run.returncode})",
            "table": run.stdout}
