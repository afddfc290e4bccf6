"""vit_pure/quiet.py: JAX's CUDA plugin where no NVIDIA GPU is. The filter drops exactly
the plugin's two kinds of start-up line from file descriptor 2 and keeps every other."""
import os
import subprocess
import sys

from vit_pure import quiet

NOISE = ("WARNING: All log messages before absl::InitializeLog() is called are written to "
         "STDERR\n"
         "I0000 00:00:1795753574.298002   22274 cudart_stub.cc:31] Could not find cuda "
         "drivers on your machine, GPU will not be used.\n")
CHILD = f"""
import os, sys
from vit_pure import quiet
with quiet.filtered(active=sys.argv[1] == "on"):
    os.write(2, {NOISE!r}.encode())
    os.write(2, b"error: a line of the run's own\\n")
    print("python's own stderr line", file=sys.stderr)
print("after", file=sys.stderr)
"""


def _stderr(active: str) -> list[str]:
    run = subprocess.run([sys.executable, "-c", CHILD, active], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)), timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stderr.splitlines()


def test_filter_drops_only_the_plugin_lines():
    assert _stderr("on") == ["error: a line of the run's own", "python's own stderr line",
                             "after"]
    assert _stderr("off") == [*NOISE.splitlines(), "error: a line of the run's own",
                              "python's own stderr line", "after"]


def test_noise_pattern_matches_the_two_kinds_only():
    assert all(quiet.NOISE.match(line) for line in NOISE.splitlines())
    assert not quiet.NOISE.match("error: Could not find cuda drivers")
    assert not quiet.NOISE.match("WARNING: something else")


def test_a_visible_gpu_is_never_hidden(tmp_path):
    device = tmp_path / "nvidia0"
    device.write_text("")
    assert quiet.nvidia_gpu_visible(str(device), which=lambda name: None)
    assert not quiet.nvidia_gpu_visible(str(tmp_path / "none"), which=lambda name: None)
