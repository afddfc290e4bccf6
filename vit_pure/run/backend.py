"""Backend-aware defaults: what the training scripts run when a flag is left to them.

Each setting has a right answer that depends on the hardware; the measurements behind each
are in docs/performance.md (the section named after it), and the start-up log says what
was chosen and why. Layers (`--scan` not given): unrolled on CPU and GPU, the layer scan
elsewhere. Matmul output (no `m=` in `--policy`): the compute dtype on accelerators,
float32 on CPU (XLA:CPU upcasts a bf16-output dot entirely). Attention: cuDNN's fused
attention on an NVIDIA GPU of compute capability 8.0+ in bf16, else the einsums. `--dtype
auto`: bf16 where it is fast (accelerators; CPUs with avx512_bf16 or amx_bf16), else fp32.
Dropout masks: `threefry16`, packed eight to a byte, on accelerators; `bernoulli`, a byte
an element, on CPU. Every other knob's default, and each of these on a CPU, is
`config.Execution`'s. `resolve` runs once, in run/settings.py `step_config`.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from vit_pure.config import Execution, ViTConfig
from vit_pure.errors import UsageError
from vit_pure.layers import attention_pallas
from vit_pure.policy import Policy, dtype_name
from vit_pure.quiet import nvidia_gpu_visible  # noqa: F401 (backend.nvidia_gpu_visible)

# CPU flags (/proc/cpuinfo) that mean native bf16 arithmetic.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
# The program the flags and this module leave as it is (on a CPU: every knob).
DEFAULT = Execution()
# Backends where the unrolled layer loop was measured faster than the scan.
UNROLLED_MEASURED = ("cpu", "gpu", "cuda", "rocm")

@dataclasses.dataclass(frozen=True)
class Choices:
    """The resolved settings, and one line per choice the hardware made."""
    policy: Policy
    scan: bool
    attention: str
    dropout_masks: str
    packed_masks: bool
    notes: tuple[str, ...]


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not there)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16(flags: frozenset[str]) -> bool:
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def _cpu_kind(flags: frozenset[str]) -> str:
    """What the startup notes say of the CPU's bf16 support."""
    if not cpu_has_bf16(flags):
        return "this CPU has no bf16 arithmetic (no avx512_bf16 or amx_bf16)"
    return f"this CPU has bf16 arithmetic ({'/'.join(f for f in BF16_CPU_FLAGS if f in flags)})"


def resolve(policy_text: str, matmul_precision: str, scan: bool | None, platform: str,
            flags: frozenset[str] | None = None, attention: str | None = None,
            cudnn: bool = False, dropout_masks: str | None = None) -> Choices:
    """The policy, layer loop, attention and dropout masks (how drawn, how kept) for
    `platform` ("cpu", "gpu", "tpu", ...): one resolver per knob below, each returning its
    choice and its notes, in this order.

    policy_text: `--policy` if given, else `--dtype` ("fp32", "bf16", "fp16" or "auto").
    scan: `--scan` (True), `--no-scan` (False) or not given (None).
    flags: the CPU's feature flags (default: read /proc/cpuinfo when platform is "cpu").
    attention: `--attention` if given, else None.
    cudnn: whether the device runs cuDNN's fused attention (`cudnn_attention_runs`).
    dropout_masks: `--dropout-masks` if given, else None.
    """
    on_cpu = platform == "cpu"
    if on_cpu and flags is None:
        flags = cpu_flags()
    policy, notes = _resolve_policy(policy_text, matmul_precision, platform, flags)
    scan, layer_notes = _resolve_layers(scan, platform)
    attention, attention_notes = _resolve_attention(attention, cudnn, policy)
    dropout_masks, mask_notes = _resolve_dropout_masks(dropout_masks, platform)
    notes += layer_notes + attention_notes + mask_notes
    packed = DEFAULT.packed_masks if on_cpu else True
    return Choices(policy, scan, attention, dropout_masks, packed, tuple(notes))


def _resolve_policy(policy_text: str, matmul_precision: str, platform: str,
                    flags: frozenset[str] | None) -> tuple[Policy, list[str]]:
    """`--dtype auto`, the matmul output dtype a policy without `m=` leaves open, and
    what float32 matmuls mean on an accelerator."""
    notes = []
    on_cpu = platform == "cpu"
    bf16_fast = not on_cpu or cpu_has_bf16(flags)
    text = policy_text.strip().lower()
    if text == "auto":
        text = "bf16" if bf16_fast else "fp32"
        notes.append(f"dtype: {text} (--dtype auto; "
                     f"{_cpu_kind(flags) if on_cpu else 'accelerator'})")
    policy = Policy.parse(text, matmul_precision)
    if on_cpu and policy.compute_dtype == jnp.bfloat16 and not bf16_fast:
        notes.append(f"dtype: bf16 as asked, but {_cpu_kind(flags)}: XLA emulates it, slower "
                     "than fp32 (docs/precision.md); --dtype fp32 is faster here")
    if not Policy.gives_matmul_dtype(text) and policy.compute_dtype != jnp.float32:
        matmul = jnp.dtype(jnp.float32) if on_cpu else policy.compute_dtype
        policy = dataclasses.replace(policy, matmul_dtype=matmul)
        notes.append(
            f"matmul outputs: {dtype_name(matmul)} "
            + ("(CPU: XLA:CPU upcasts low-precision-output dots; give m= in --policy to "
               "choose)" if on_cpu else
               "(accelerator: the GEMM accumulates in f32 inside and rounds once; "
               "give m=f32 in --policy for f32 outputs)"))
    if platform != "cpu" and policy.compute_dtype == jnp.float32:
        notes.append("fp32 matmuls: " + (
            "TF32 tensor cores where the GPU has them (--matmul-precision default); "
            "--matmul-precision highest for full float32" if matmul_precision == "default"
            else f"precision {matmul_precision}"))
    return policy, notes


def _resolve_layers(scan: bool | None, platform: str) -> tuple[bool, list[str]]:
    """The layer loop: unrolled where measured faster, else the scan."""
    if scan is not None:
        return scan, []
    scan = DEFAULT.scan if platform in UNROLLED_MEASURED else True
    return scan, ["layers: " + (
        "unrolled loop (--scan not given; measured faster than the layer scan on "
        f"{'CPU' if platform == 'cpu' else 'GPU'}: docs/performance.md)" if not scan else
        f"lax.scan (--no-scan not given; {platform}: unrolled not measured here, the "
        "scan compiles deep models faster)")]


def _resolve_attention(attention: str | None, cudnn: bool,
                       policy: Policy) -> tuple[str, list[str]]:
    """cuDNN's fused attention where it runs in bf16, else the einsums."""
    if attention is not None:
        return attention, []
    if cudnn and policy.compute_dtype == jnp.bfloat16:
        return "cudnn", ["attention: cuDNN fused (--attention not given; measured faster "
                         "than the einsums on an H100 in bf16: docs/performance.md; "
                         "--attention einsum for the reference path)"]
    return DEFAULT.attention, []


def _resolve_dropout_masks(dropout_masks: str | None, platform: str) -> tuple[str, list[str]]:
    """How the masks are drawn (threefry16 on accelerators), and the CPU's note on how
    they are kept (a byte an element there; packed elsewhere: `Choices.packed_masks`)."""
    notes = []
    on_cpu = platform == "cpu"
    if dropout_masks is None:
        dropout_masks = DEFAULT.dropout_masks if on_cpu else "threefry16"
        if not on_cpu:
            notes.append("dropout masks: threefry16 (--dropout-masks not given; a quarter of "
                         "bernoulli's Threefry hashes: docs/performance.md; --dropout-masks "
                         "bernoulli for the reference masks)")
    if on_cpu:
        notes.append("dropout masks: kept a byte an element (CPU: packed eight to a byte they "
                     "save memory on a GPU, not time here; docs/performance.md)")
    return dropout_masks, notes


def cudnn_attention_runs(device) -> bool:
    """Whether `device` runs cuDNN's fused attention: a CUDA GPU of compute capability 8.0 or
    more (Ampere on). Other devices have no CUDA compute capability (ROCm names a gfx
    target; a CPU has none)."""
    try:
        major, minor = getattr(device, "compute_capability", "").split(".")
        return (int(major), int(minor)) >= (8, 0)
    except ValueError:
        return False


# How to get JAX's CUDA build (the plugin and NVIDIA's libraries, the version of jax).
CUDA_INSTALL = "pip install -r requirements-gpu.txt"


def cuda_missing_note(platform: str, gpu_visible: bool, jax_platforms: str) -> str | None:
    """One line when an NVIDIA GPU is there but JAX runs elsewhere because it has no CUDA
    backend (`pip install -r requirements.txt` installs the CPU build); None when JAX runs
    on the GPU, there is no GPU, or JAX_PLATFORMS asked for the CPU (--cpu-devices does)."""
    if platform == "gpu" or not gpu_visible or jax_platforms.strip().lower() == "cpu":
        return None
    return (f"note: an NVIDIA GPU is visible but JAX runs on {platform} (this environment has "
            f"no CUDA build of jax); to train on the GPU: {CUDA_INSTALL}")


def note_missing_cuda(gpu_visible=nvidia_gpu_visible) -> None:
    """Print `cuda_missing_note` for this process (call after cli.start_runtime)."""
    note = cuda_missing_note(jax.default_backend(), gpu_visible(),
                             os.environ.get("JAX_PLATFORMS", ""))
    if note:
        print(note, file=sys.stderr, flush=True)


def cudnn_attention_usable(cfg: ViTConfig, platform: str, device=None) -> bool:
    """Whether cuDNN's fused attention can run `cfg` here: an NVIDIA GPU of compute
    capability 8.0+ (`device`, default JAX's first), a head dim cuDNN takes, and no
    locality self-attention (cfg.lsa runs on the einsum attention only)."""
    if platform != "gpu" or cfg.lsa or not _cudnn_head_dim(cfg):
        return False
    return cudnn_attention_runs(device if device is not None else jax.devices()[0])


def _cudnn_head_dim(cfg: ViTConfig) -> bool:
    """cuDNN's fused attention takes a head dim that is a multiple of 8, at most 128."""
    return cfg.head_dim % 8 == 0 and cfg.head_dim <= 128


def check_attention(attention: str, policy: Policy, platform: str, cfg: ViTConfig) -> None:
    """--attention cudnn: cuDNN's fused attention runs on NVIDIA GPUs, on 16-bit inputs;
    pallas on NVIDIA GPUs, at the sequences, head dims and dtypes its kernel takes
    (`attention_pallas.check_shape`). A model with locality self-attention (cfg.lsa) runs
    on the einsum attention only."""
    if cfg.lsa and attention != "einsum":
        raise UsageError(f"--model {cfg.name} uses locality self-attention, which runs on "
                         f"--attention einsum only, not {attention}")
    if attention == "pallas" and platform != "gpu":
        raise UsageError(f"--attention pallas is a Mosaic GPU kernel and needs an NVIDIA GPU; "
                         f"this run is on {platform}: use --attention pallas-interpret to run "
                         f"it interpreted (slow), or einsum")
    if attention in ("pallas", "pallas-interpret"):
        try:
            attention_pallas.check_shape(cfg.seq_len, cfg.head_dim, policy.compute_dtype,
                                         interpret=attention == "pallas-interpret")
        except ValueError as e:
            raise UsageError(f"--attention {attention} with --model {cfg.name}: {e}") from None
    if attention != "cudnn":
        return
    if platform != "gpu":
        raise UsageError(f"--attention cudnn needs an NVIDIA GPU (cuDNN); this run is on "
                         f"{platform}: use --attention xla (or einsum)")
    if not _cudnn_head_dim(cfg):
        raise UsageError(f"--attention cudnn needs a head dim that is a multiple of 8, at "
                         f"most 128; --model {cfg.name} has {cfg.head_dim}: use --attention "
                         f"xla (or einsum)")
    if policy.compute_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise UsageError(f"--attention cudnn needs a 16-bit compute dtype (--dtype bf16 or "
                         f"fp16); the policy {policy} computes in float32")
