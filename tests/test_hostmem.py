"""vit_pure.run.hostmem: the scripts restart once with glibc's huge-page malloc tunable."""
import os
import subprocess
import sys
import textwrap

import pytest

from vit_pure.run import hostmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from vit_pure.run import hostmem
    print("start", os.getpid(), flush=True)
    hostmem.use_huge_pages()
    print("tunables", os.environ.get("GLIBC_TUNABLES"), "argv", sys.argv[1:], os.getpid())
""")


def _run(tmp_path, env_extra, *args):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(root=ROOT))
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "VIT_PURE_HUGEPAGES")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-u", str(probe), *args], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return out.splitlines()


@pytest.mark.skipif(not (sys.platform == "linux" and hostmem._glibc_supports_hugetlb()
                         and hostmem._kernel_thp_available()),
                    reason="needs Linux, glibc >= 2.35 and transparent huge pages")
def test_restarts_once_with_the_tunable_same_pid_same_args(tmp_path):
    lines = _run(tmp_path, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, "--a", "b c")
    starts = [ln for ln in lines if ln.startswith("start")]
    assert len(starts) == 2  # the original process, then the restarted one
    assert len({ln.split()[1] for ln in starts}) == 1  # execve keeps the PID
    last = lines[-1].split(" argv ")
    # The user's own tunables are kept, ours appended.
    assert last[0] == f"tunables glibc.malloc.arena_max=4:{hostmem.TUNABLE}"
    assert last[1].startswith("['--a', 'b c']")


def test_opt_out_and_already_set_do_nothing(tmp_path):
    for env in ({"VIT_PURE_HUGEPAGES": "0"}, {"GLIBC_TUNABLES": hostmem.TUNABLE}):
        lines = _run(tmp_path, env)
        assert sum(ln.startswith("start") for ln in lines) == 1, env
    assert lines[-1].startswith(f"tunables {hostmem.TUNABLE} argv []")
