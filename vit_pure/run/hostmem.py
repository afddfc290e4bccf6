"""Huge pages for the host's malloc: a measured speed-up of the CPU training step.

XLA:CPU allocates each step's temporaries (over a gigabyte a step for vit-cifar at batch
128) from malloc, and glibc serves blocks that large with fresh mmap'ed memory, so every
step faults in hundreds of thousands of new 4 KiB pages. glibc 2.35+ can back its memory
with transparent huge pages (2 MiB, the `glibc.malloc.hugetlb=1` tunable): 512x fewer
faults; the gain is measured in docs/performance.md. glibc reads its tunables at start-up,
so `use_huge_pages()` restarts the script once (os.execve: same PID, same arguments) with
the tunable added, unless off Linux/glibc >= 2.35, with transparent huge pages off, with
the tunable already set, or with VIT_PURE_HUGEPAGES=0. The training scripts,
benchmarks.bench and benchmarks.study call it first thing in their `__main__` block;
benchmarks.peers starts its kit rows with the same setting (`environ`).
"""
from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_supports_hugetlb() -> bool:
    name, version = platform.libc_ver()
    if name != "glibc":
        return False
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 35)


def _kernel_thp_available() -> bool:
    try:
        with open(_THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def wanted() -> bool:
    """Whether `use_huge_pages` would restart this process."""
    if os.environ.get("VIT_PURE_HUGEPAGES", "1") == "0":
        return False
    if "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", ""):
        return False  # set already (by us before the restart, or by the user)
    return sys.platform == "linux" and _glibc_supports_hugetlb() and _kernel_thp_available()


def environ() -> dict:
    """This process's environment with the tunable added where `wanted()`: for a child
    process that should run as the training scripts do (benchmarks.peers' kit rows)."""
    env = dict(os.environ)
    if wanted():
        env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), TUNABLE) if t)
    return env


def use_huge_pages() -> None:
    """Restart this script once with glibc's huge-page tunable (see the module docstring).
    Call it before any work: the process is replaced, and nothing done before survives."""
    if not wanted():
        return
    env = environ()
    sys.stdout.flush()
    sys.stderr.flush()
    # sys.orig_argv keeps the interpreter's own flags (-u, -m module, -X ...).
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
