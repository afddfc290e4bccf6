"""Backend-aware defaults (vit_pure/run/backend.py): what each backend gets for the flags a
user leaves alone, and that explicit flags always win."""
import pathlib

import jax.numpy as jnp
import pytest

from vit_pure.run import backend, cli, settings

BF16_CPU = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2_CPU = frozenset({"avx2", "fma"})


def test_headline_command_on_a_gpu_runs_unrolled_with_bf16_matmul_outputs():
    c = backend.resolve("bf16", "default", None, "gpu")
    assert not c.scan
    assert (c.policy.compute_dtype, c.policy.matmul_dtype) == (jnp.bfloat16, jnp.bfloat16)
    assert any(n.startswith("layers: unrolled") for n in c.notes)
    assert any(n.startswith("matmul outputs: bf16") for n in c.notes)


@pytest.mark.parametrize("dtype, cudnn, given, expected", [
    ("bf16", True, None, "cudnn"),      # the headline command on an H100
    ("bf16", False, None, "einsum"),    # a GPU without cuDNN's fused attention
    ("fp32", True, None, "einsum"),     # cuDNN's kernel takes 16-bit inputs only
    ("fp16", True, None, "einsum"),     # not measured: the reference path
    ("bf16", True, "einsum", "einsum"),  # explicit flags win
    ("bf16", True, "xla", "xla")])
def test_attention_is_cudnn_only_where_measured(dtype, cudnn, given, expected):
    c = backend.resolve(dtype, "default", None, "gpu", attention=given, cudnn=cudnn)
    assert c.attention == expected
    assert any(n.startswith("attention: cuDNN") for n in c.notes) == (given is None
                                                                      and expected == "cudnn")


class _Device:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


@pytest.mark.parametrize("device, runs", [
    (_Device(compute_capability="9.0"), True), (_Device(compute_capability="8.0"), True),
    (_Device(compute_capability="7.5"), False), (_Device(compute_capability="12.0"), True),
    (_Device(compute_capability="gfx90a"), False), (_Device(), False)])
def test_cudnn_attention_needs_a_cuda_device_of_capability_8(device, runs):
    assert backend.cudnn_attention_runs(device) == runs


@pytest.mark.parametrize("flags", [BF16_CPU, AVX2_CPU])
def test_cpu_keeps_f32_matmul_outputs_and_says_when_bf16_is_emulated(flags):
    c = backend.resolve("bf16", "default", None, "cpu", flags)
    assert not c.scan and c.policy.matmul_dtype == jnp.float32
    emulated = any("no bf16 arithmetic" in n for n in c.notes)
    assert emulated == (flags == AVX2_CPU)


@pytest.mark.parametrize("platform, flags, dtype", [
    ("cpu", BF16_CPU, jnp.bfloat16), ("cpu", AVX2_CPU, jnp.float32),
    ("gpu", None, jnp.bfloat16), ("tpu", None, jnp.bfloat16)])
def test_dtype_auto(platform, flags, dtype):
    c = backend.resolve("auto", "default", None, platform, flags)
    assert c.policy.compute_dtype == dtype
    assert any(n.startswith("dtype: ") for n in c.notes)


def test_explicit_choices_win():
    c = backend.resolve("p=f32,c=bf16,o=f32,m=f32", "default", True, "gpu")
    assert c.scan and c.policy.matmul_dtype == jnp.float32
    assert not any(n.startswith(("layers", "matmul")) for n in c.notes)
    assert backend.resolve("fp32", "default", None, "tpu").scan  # not measured: scan stays
    tf32 = backend.resolve("fp32", "default", None, "gpu")
    assert tf32.policy.matmul_dtype == jnp.float32 and any("TF32" in n for n in tf32.notes)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n")
    assert backend.cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert backend.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_the_scripts_parser_leaves_these_to_the_hardware():
    """What `python train_shardmap.py --batch 4096 --dtype bf16` parses to, resolved as
    settings.step_config does for a GPU; `--recipe cpu-quick` asks for --dtype auto."""
    args = cli.parse_args(cli.build_parser("t"), ["--batch", "4096", "--dtype", "bf16"])
    assert args.scan is None and args.attention is None
    sc = settings.step_config(args, platform="gpu")
    assert not sc.execution.scan and sc.policy.matmul_dtype == jnp.bfloat16 and sc.notes
    assert sc.execution.packed_masks  # and on a CPU a byte a mask element, said:
    assert sc.execution.attention == "einsum"  # this CPU's device: no NVIDIA GPU
    h100 = settings.step_config(args, platform="gpu", device=_Device(compute_capability="9.0"))
    assert h100.execution.attention == "cudnn"
    cpu = settings.step_config(args, platform="cpu")
    assert not cpu.execution.packed_masks
    assert any(n.startswith("dropout masks: kept a byte an element") for n in cpu.notes)
    quick = cli.parse_args(cli.build_parser("t"), ["--recipe", "cpu-quick"])
    assert quick.dtype == "auto"


def test_nvidia_gpu_visible_reads_the_device_file_and_the_path(tmp_path):
    device = tmp_path / "nvidia0"
    assert not backend.nvidia_gpu_visible(str(device), which=lambda name: None)
    assert backend.nvidia_gpu_visible(str(device), which=lambda name: "/usr/bin/" + name)
    device.write_text("")
    assert backend.nvidia_gpu_visible(str(device), which=lambda name: None)


@pytest.mark.parametrize("platform, visible, jax_platforms, says", [
    ("cpu", True, "", True),          # a GPU, and the CPU build of jax: say how to install
    ("cpu", True, "cuda,cpu", True),  # asked for CUDA too, and it is not there
    ("gpu", True, "", False),         # JAX runs on the GPU
    ("cpu", False, "", False),        # no GPU
    ("cpu", True, "cpu", False),      # the CPU asked for (--cpu-devices sets this)
])
def test_cuda_missing_note(platform, visible, jax_platforms, says):
    note = backend.cuda_missing_note(platform, visible, jax_platforms)
    assert (note is not None) == says
    if says:
        assert "\n" not in note and backend.CUDA_INSTALL in note and platform in note


def test_note_missing_cuda_prints_one_line_on_this_cpu(monkeypatch, capsys):
    """The scripts' start-up call, with the GPU probe injected: on this CPU-only jax it
    prints the install line when a GPU is 'visible', and nothing when none is."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    backend.note_missing_cuda(gpu_visible=lambda: True)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -r requirements-gpu.txt" in err
    backend.note_missing_cuda(gpu_visible=lambda: False)
    assert capsys.readouterr().err == ""


def test_gpu_requirements_install_the_cuda_build_of_jax():
    """README's GPU command installs requirements-gpu.txt: it must ask for JAX's CUDA build
    (the jax[cuda12] extra pins the plugin to the jax version) on top of requirements.txt."""
    root = pathlib.Path(__file__).resolve().parents[1]
    lines = [line.split("#")[0].strip() for line in
             (root / "requirements-gpu.txt").read_text().splitlines()]
    assert "-r requirements.txt" in lines
    assert any(line.startswith("jax[cuda12]") for line in lines)
    readme = (root / "README.md").read_text()
    assert "pip install -r requirements-gpu.txt && python train_shardmap.py --batch 4096" in readme
