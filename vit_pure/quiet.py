"""JAX's CUDA plugin on a machine without an NVIDIA GPU: quiet, and off.

With `requirements-gpu.txt` installed where no driver is (a laptop, a deviceless `--plan`),
the plugin's libraries print "Could not find cuda drivers" (and absl's "All log messages
before absl::InitializeLog()") to file descriptor 2 each time one loads, and its start-up
check adds a traceback. Only where no NVIDIA GPU is visible, this module sets
`JAX_PLATFORMS=cpu` unless it is set (the deviceless plan still names the plugin itself),
and `filtered()` drops those two lines from what a block writes to file descriptor 2.

vit_pure/__init__.py imports jax through it, first thing; the training scripts import
vit_pure before jax, and `cli.start_runtime` starts the backends inside `filtered()`.
Standard library only: it runs before jax exists.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile

# The two kinds of line the plugin's libraries write where no driver is (nothing else).
NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
                   r"|[IWE]\d{4} .*cudart_stub\.cc:\d+\] Could not find cuda drivers)")


def nvidia_gpu_visible(device_file: str = "/dev/nvidia0", which=shutil.which) -> bool:
    """Whether this machine shows an NVIDIA GPU: its device file, or nvidia-smi on the PATH."""
    return os.path.exists(device_file) or which("nvidia-smi") is not None


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA 12 plugin can be imported (not whether a GPU is there)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all: no plugin
        return False


def plugin_without_gpu() -> bool:
    """The case this module is for: the plugin installed, no NVIDIA GPU to use it on."""
    return cuda_plugin_installed() and not nvidia_gpu_visible()


@contextlib.contextmanager
def filtered(active: bool | None = None):
    """File descriptor 2 into a temporary file for the block; then its lines written back
    to stderr, less the plugin's `NOISE`. Does nothing unless `active` (default:
    `plugin_without_gpu()`)."""
    if not (plugin_without_gpu() if active is None else active):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not NOISE.match(line))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


def import_jax_quietly() -> None:
    """Import jax (once, before anything else does) with the plugin kept quiet and, where
    no NVIDIA GPU is visible, JAX on the CPU unless JAX_PLATFORMS says otherwise."""
    if "jax" in sys.modules or not plugin_without_gpu():
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with filtered(active=True):
        importlib.import_module("jax")
