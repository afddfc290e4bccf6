"""The parts of benchmarks/gpu_check.py that run in a child process of their own (they
start JAX): the environment, the kernels, the program. Each returns a JSON-ready dict."""
from __future__ import annotations

import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import harness
from vit_pure.pallas import mlp, qkv
from vit_pure.plan import targets

# The headline's shapes (vit-cifar, batch 4096): B*T rows, M, E; padded rows, n = H*D.
HEADLINE = {"rows": 4096 * 65, "hidden": 1536, "width": 384, "padded": 4096 * 72,
            "columns": 384}
SMALL = {"rows": 256, "hidden": 64, "width": 128, "padded": 64, "columns": 64}
F32 = jnp.float32


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


def _time_ms(fn, *args, n: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _error(got, want) -> float:
    """max |got - want| / max |want| over the outputs."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    return max(float(jnp.max(jnp.abs(g.astype(F32) - w)) / jnp.max(jnp.abs(w)))
               for g, w in zip(got, want))


def _cases(s: dict, dtype, interpret: bool):
    """(name, kernel fn, XLA fn, float32 reference fn, inputs) for the five kernels."""
    k = jax.random.split(jax.random.key(0), 8)
    r, m, e, rp, n = s["rows"], s["hidden"], s["width"], s["padded"], s["columns"]
    h = jax.random.normal(k[0], (r, m), dtype)
    w = (0.05 * jax.random.normal(k[1], (m, e))).astype(dtype)
    dz = jax.random.normal(k[2], (r, e), dtype)
    x = jax.random.normal(k[3], (rp, e), dtype)
    wq = (0.05 * jax.random.normal(k[4], (e, 3 * n))).astype(dtype)
    b = jax.random.normal(k[5], (3 * n,), F32)
    dq, dk, dv = (jax.random.normal(kk, (rp, n), dtype) for kk in jax.random.split(k[6], 3))
    hi = jax.lax.Precision.HIGHEST
    f = lambda a: a.astype(F32)  # noqa: E731

    def gelu(a):
        return jax.nn.gelu(a, approximate=True)

    def dgelu(dg, a):
        return jax.vjp(gelu, a)[1](dg)[0]

    return [
        ("gelu_fc2_forward",
         lambda h, w: mlp.gelu_fc2_forward(h, w, dtype, interpret=interpret),
         lambda h, w: mlp._forward_whole(h, w, out_dtype=dtype, precision=None),
         lambda h, w: jnp.dot(gelu(f(h)), f(w), precision=hi), (h, w)),
        ("gelu_fc2_backward",
         lambda dz, w, h: mlp.gelu_fc2_backward(dz, w, h, interpret=interpret),
         lambda dz, w, h: mlp._backward_whole(dz, w, h, precision=None),
         lambda dz, w, h: (lambda dh: (dh, dh.sum(0)))(
             dgelu(jnp.dot(f(dz), f(w).T, precision=hi), f(h))), (dz, w, h)),
        ("gelu_fc2_weight_gradient",
         lambda h, dz: mlp.gelu_fc2_weight_gradient(h, dz, dtype, interpret=interpret),
         lambda h, dz: mlp._weight_whole(h, dz, out_dtype=dtype, precision=None),
         lambda h, dz: jnp.dot(gelu(f(h)).T, f(dz), precision=hi), (h, dz)),
        ("qkv_projection",
         lambda x, w, b: qkv.projection(x, w, b, dtype, interpret=interpret),
         lambda x, w, b: qkv._projection_whole(x, w.reshape(e, 3, n), b.reshape(3, 1, n),
                                               out_dtype=dtype, precision=None),
         lambda x, w, b: tuple((jnp.dot(f(x), f(w), precision=hi) + b).reshape(rp, 3, n)
                               [:, i] for i in range(3)), (x, wq, b)),
        ("qkv_input_gradient",
         lambda dq, dk, dv, w: qkv.projection_input_gradient(dq, dk, dv, w, dtype,
                                                             interpret=interpret),
         lambda dq, dk, dv, w: qkv._gradient_whole(dq, dk, dv, w.reshape(e, 3, n),
                                                   out_dtype=dtype, precision=None),
         lambda dq, dk, dv, w: (lambda d: (jnp.dot(d, f(w).T, precision=hi), d.sum(0)))(
             jnp.concatenate([f(dq), f(dk), f(dv)], axis=1)), (dq, dk, dv, wq)),
    ]


def kernels(out: pathlib.Path, dry: bool) -> dict:
    """Each kernel in float32 and bf16 (a dry run: bf16, interpreted): its error against
    float32 arithmetic, and (not in a dry run) its time against the XLA ops it replaces,
    in ms."""
    shapes = SMALL if dry else HEADLINE
    rows = []
    for dtype in (jnp.bfloat16,) if dry else (jnp.float32, jnp.bfloat16):
        for name, kernel, xla, reference, inputs in _cases(shapes, dtype, interpret=dry):
            row = {"kernel": name, "dtype": jnp.dtype(dtype).name, "shapes": shapes}
            try:
                got = jax.jit(kernel)(*inputs)
                row["error"] = _error(got, jax.jit(reference)(*inputs))
                if not dry:
                    row["kernel_ms"] = _time_ms(jax.jit(kernel), *inputs)
                    row["xla_ms"] = _time_ms(jax.jit(xla), *inputs)
            except Exception as e:  # one kernel's failure is a row, not the end of the part
                row["failed"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                row["error"] = float("nan")
            rows.append(row)
            print(row, flush=True)
    return {"status": "ok", "rows": rows}


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
