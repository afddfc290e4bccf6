"""Two processes, one run: JAX's multi-process runtime gives what one process gives.

Each case launches two processes on 127.0.0.1 (`--coordinator`, `--num-processes 2`,
`--process-id 0/1`), each with 2 fake CPU devices, so the run spans 4 devices and the
step's collectives cross the process boundary (gloo). Each process loads only its half
of every batch. The reference is the same run in this (single) process on 4 of
conftest's 8 devices. Compared: every logged training loss, the final validation and
test metrics (the evaluation batch of 24 is padded, so the masks are split too), and
the final checkpoint, which process 0 writes from the state `host_state` gathers.

Not bitwise in general: a 4-way all-reduce across two processes (gloo) may add in
another order than one inside a process, so losses can differ in the last bit; with
2-way all-reduces (the tensor-parallel case) the runs have come out bitwise equal.

The same comparison runs once more with the processes started by a real launcher,
`mpirun -np 2` (Open MPI), and only `--distributed` on the command line: jax's cluster
detection reads the process count, the rank and the coordinator's host from Open MPI's
environment (docs/multihost.md). It skips where Open MPI is not installed.
"""
import errno
import itertools
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from conftest import subprocess_env

import train_pmap
import train_shardmap

# Six jax processes on a 2-core machine: minutes. Run with `python -m pytest -m slow`.
from vit_pure.run import checkpoint, cli, loop, settings
from vit_pure.run.settings import RunConfig

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[1]
# --accum-steps auto, the default a user runs. RandAugment off (--randaugment 0): it
# doubles the tiny step's compile time, in each of the six processes and the references,
# and has no part in what two processes change: its draws are keyed by the examples'
# global ids, as the flip and crop's are, which stay on (that RandAugment does not depend
# on how the batch is split: tests/test_randaugment.py).
BASE = ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "64",
        "--synthetic-val", "32", "--synthetic-test", "32", "--steps", "3", "--batch", "16",
        "--eval-batch", "24", "--no-progress", "--randaugment", "0"]
CASES = {  # name: (script, extra flags)
    # pmap: 4 devices on 'data', two per process.
    "pmap": ("train_pmap.py", []),
    # shard_map, tensor parallel inside each process and data parallel across the two:
    # the state is split over 'model', so `host_state` all-gathers blocks from the other
    # process. (The plain `--mesh data=4` run passes too; left out to keep this file
    # within its time on a loaded 2-core machine: add "shard_map": ("train_shardmap.py", []).)
    "shard_map-tp": ("train_shardmap.py", ["--mesh", "data=2,model=2"]),
}
# Per run; generous because the six processes and the references share 2 cores (seen:
# the stop case's step 50 at ~200 s under a load average of 12-17).
TIMEOUT_S = 420


def _ports():
    """Coordinator ports that parallel pytest workers do not share.

    Binding port 0 and closing it leaves a window in which another worker's bind(0), or
    any outgoing connection (gloo opens many), may be handed the same port before the
    coordinator listens on it. So each pytest-xdist worker counts through its own block
    of ports below the kernel's ephemeral range (32768 and up by default, which bind(0)
    and connect() draw from), starting at an offset from its pid (two pytest runs side
    by side), and takes a port only if it can bind it now, on every interface, as jax's
    coordinator will ([::]:PORT).
    """
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
    start = 20000 + 500 * (worker % 24) + 10 * (os.getpid() % 40)
    for port in itertools.chain(range(start, 20000 + 500 * (worker % 24 + 1)),
                                range(20000, 32768)):
        if _can_bind(port):
            yield port


def _can_bind(port: int) -> bool:
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            with socket.socket(family) as s:
                s.bind((host, port))  # IPv6's any-address is dual-stack: IPv4's too
            return True
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False  # (any other error: no IPv6 here, try IPv4)
    return False


_PORTS = _ports()


def _free_port() -> int:
    return next(_PORTS)


def _env() -> dict:
    # Not this process's 8 devices: each process asks for 2 with --cpu-devices.
    return subprocess_env(JAX_PLATFORMS="cpu")


def _records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _reference(name: str, out: pathlib.Path) -> None:
    """The same run in this process, on 4 of its 8 devices."""
    script, extra = CASES[name]
    module = train_pmap if script == "train_pmap.py" else train_shardmap
    parser = cli.build_parser("") if module is train_pmap else train_shardmap.build_parser()
    args = cli.parse_args(parser, BASE + extra + [
        "--log-json", str(out / "log.jsonl"), "--ckpt-dir", str(out / "ckpt")])
    devices = jax.devices()[:4]

    def make_strategy(sc, optimizer):
        if module is train_pmap:
            return train_pmap.PmapStrategy(sc, optimizer, devices=devices)
        return train_shardmap.ShardMapStrategy(sc, optimizer, args.mesh, devices=devices)
    loop.run(RunConfig.from_args(args), settings.step_config(args), make_strategy)


# SIGTERM reaches process 1 only, once process 0 has logged a step (every 50 steps here):
# both must stop after the same step, with one checkpoint, and exit 0. (--accum-steps 1:
# this case is about signals; skipping auto's compile keeps its step 50 within TIMEOUT_S
# while the other two pairs and the references share the machine.)
STOP_CASE = ("train_shardmap.py", ["--synthetic-train", "16000", "--steps", "1000",
                                   "--eval-every", "0", "--accum-steps", "1"])


def _launch_pair(out: pathlib.Path, script: str, flags: list[str]) -> list:
    """Two processes of one run: [(log file, Popen)] for process 0 and 1."""
    out.mkdir()
    port = _free_port()
    pair = []
    for pid in (0, 1):
        cmd = [sys.executable, "-u", script, *BASE, *flags, "--cpu-devices", "2",
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
               "--process-id", str(pid), "--log-json", str(out / f"log{pid}.jsonl"),
               "--ckpt-dir", str(out / "ckpt")]
        log = open(out / f"out{pid}.txt", "w")
        pair.append((log, subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log,
                                           stderr=subprocess.STDOUT,
                                           start_new_session=True)))  # a group to kill
    return pair


def _signal_when_logged(log_json: pathlib.Path, proc, deadline: float) -> None:
    """SIGTERM to `proc` once a training step appears in `log_json` (a watcher thread)."""
    while time.monotonic() < deadline and proc.poll() is None:
        if log_json.exists() and '"lr"' in log_json.read_text():
            proc.send_signal(signal.SIGTERM)
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every two-process run at once, compute the references meanwhile, wait.

    Returns the root folder and each process's exit code, by (case, process id)."""
    root = tmp_path_factory.mktemp("multiprocess")
    pairs = {}
    try:
        for name, (script, extra) in CASES.items():
            pairs[name] = _launch_pair(root / name, script, extra)
        pairs["stop"] = _launch_pair(root / "stop", *STOP_CASE)
        deadline = time.monotonic() + TIMEOUT_S
        watcher = threading.Thread(target=_signal_when_logged, daemon=True,
                                   args=(root / "stop" / "log0.jsonl", pairs["stop"][1][1],
                                         deadline))
        watcher.start()
        for name in CASES:
            (root / name / "ref").mkdir()
            _reference(name, root / name / "ref")
        codes = {}
        for name, pair in pairs.items():
            for pid, (_, proc) in enumerate(pair):
                try:
                    codes[name, pid] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    codes[name, pid] = "timed out"
        yield root, codes
    finally:
        for pair in pairs.values():
            for log, proc in pair:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                log.close()


def _output(root, name) -> str:
    return "\n".join(f"--- process {pid}:\n" + (root / name / f"out{pid}.txt").read_text()
                     for pid in (0, 1))


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_match_one(runs, name):
    root, codes = runs
    out = root / name
    assert (codes[name, 0], codes[name, 1]) == (0, 0), _output(root, name)
    # Process 0 logs; process 1 writes no log at all.
    assert not (out / "log1.jsonl").exists(), _output(root, name)
    _assert_same_run(out / "log0.jsonl", out / "ckpt", out / "ref", name)


def _assert_same_run(log_json, ckpt_dir, ref, name):
    """The two-process run (its log, its final checkpoint) against the one-process
    reference run of case `name` in folder `ref`."""
    got, want = _records(log_json), _records(ref / "log.jsonl")
    config = [r for r in got if r.get("event") == "config"]
    assert len(config) == 1  # written once, by process 0
    assert config[0]["devices"] == (2 if "tp" in name else 4)  # data-parallel

    def losses(records):
        return {r["step"]: r["loss"] for r in records if "lr" in r}  # the training lines
    assert sorted(losses(got)) == [1, 2, 3]
    np.testing.assert_allclose(list(losses(got).values()), list(losses(want).values()),
                               rtol=1e-6, atol=0)  # (seen: 1 ulp apart, or bitwise)
    for split in ("val", "test"):
        g = [r for r in got if r.get("split") == split]
        w = [r for r in want if r.get("split") == split]
        assert len(g) == len(w) == 1 and g[0]["count"] == w[0]["count"] == 32
        assert g[0]["accuracy"] == w[0]["accuracy"]
        np.testing.assert_allclose(g[0]["loss"], w[0]["loss"], rtol=1e-6)

    # The final checkpoint, written by process 0 from the gathered state.
    got_ckpt = checkpoint.load_numpy(ckpt_dir / checkpoint.step_dir_name(3))
    want_ckpt = checkpoint.load_numpy(ref / "ckpt" / checkpoint.step_dir_name(3))
    assert got_ckpt.keys() == want_ckpt.keys()
    for k in want_ckpt:
        assert got_ckpt[k].dtype == want_ckpt[k].dtype, k
        # (seen: at most 9e-8 apart with pmap; a wrong batch split moves them by ~1e-4)
        np.testing.assert_allclose(got_ckpt[k], want_ckpt[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_ports_skip_one_in_use_and_never_repeat():
    ports = _ports()
    first = next(ports)
    with socket.socket() as taken:
        for held in range(first + 1, first + 100):  # the next port this test can hold
            try:
                taken.bind(("127.0.0.1", held))
                break
            except OSError:  # (in use, or closed a moment ago: TIME_WAIT)
                continue
        taken.listen()
        got = [next(ports) for _ in range(3)]
    assert held not in got and len(set(got)) == 3 and min(got) > first


# ------------------------------------------------------------ launched by mpirun (Open MPI)
MPIRUN_CASE = "shard_map-tp"  # its flags, and the reference run the `runs` fixture made


def _mpirun_problem() -> str | None:
    """Why `mpirun` cannot start a job that jax's Open MPI detection sees, or None."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return ("mpirun not found on PATH: Open MPI is not installed (Debian/Ubuntu: "
                "apt-get install openmpi-bin)")
    probe = subprocess.run([mpirun, *_MPIRUN_FLAGS, "-np", "1", "env"], capture_output=True,
                           text=True, timeout=60, env=_env())
    if probe.returncode != 0:
        return f"mpirun -np 1 env failed ({probe.returncode}): {probe.stderr.strip()[:300]}"
    # jax/_src/clusters/ompi_cluster.py: OmpiCluster.is_env_present() is exactly this test;
    # the coordinator's host comes from the same variable's tcp:// address.
    if "OMPI_MCA_orte_hnp_uri=" not in probe.stdout:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True)
        return ("jax's Open MPI detection (jax/_src/clusters/ompi_cluster.py) needs "
                "OMPI_MCA_orte_hnp_uri in each process's environment, which this mpirun ("
                f"{version.stdout.strip().splitlines()[0]}) does not set: Open MPI 5 replaced "
                "ORTE by PRRTE; launch with --coordinator/--num-processes/--process-id instead")
    return None


# As root (containers, CI) Open MPI refuses to run without --allow-run-as-root; 2 ranks
# on a 2-core machine need --oversubscribe; `oob_tcp_if_include lo` makes mpirun's own
# address, which jax's detection takes for the coordinator's host, 127.0.0.1 (loopback).
_MPIRUN_FLAGS = ["--oversubscribe", "--mca", "oob_tcp_if_include", "lo"] + (
    ["--allow-run-as-root"] if os.geteuid() == 0 else [])


@pytest.fixture(scope="module")
def mpirun_run(request):
    """`mpirun -np 2 python train_shardmap.py ... --distributed`, after the other runs
    (on 2 cores, two more processes beside them would slow the SIGTERM case). Returns
    the root folder of all runs, this run's folder, mpirun's exit code and output."""
    problem = _mpirun_problem()
    if problem:  # (before the other runs: a skip costs nothing)
        pytest.skip(problem)
    root, _ = request.getfixturevalue("runs")
    out = root / "mpirun"
    out.mkdir()
    script, extra = CASES[MPIRUN_CASE]
    cmd = ["mpirun", *_MPIRUN_FLAGS, "-np", "2", sys.executable, "-u", script, *BASE, *extra,
           "--cpu-devices", "2", "--distributed", "--log-json", str(out / "log.jsonl"),
           "--ckpt-dir", str(out / "ckpt")]
    # The port is jax's only choice left to us: by default it derives one from Open MPI's
    # job id (61440..65535), which a parallel test run could share.
    env = {**_env(), "JAX_COORDINATOR_PORT": str(_free_port())}
    with open(out / "out.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timed out"
    return root, out, code, (out / "out.txt").read_text()


def test_mpirun_launch_matches_one_process(mpirun_run):
    """No process flags: the process count, the ranks and the coordinator come from
    Open MPI's environment through jax's cluster detection."""
    root, out, code, output = mpirun_run
    assert code == 0, output
    # (Two runs of one process each could not match: `--mesh data=2,model=2` needs the
    # 4 devices of both, and each would log its own config record.)
    _assert_same_run(out / "log.jsonl", out / "ckpt", root / MPIRUN_CASE / "ref", MPIRUN_CASE)


def test_mpirun_skip_reasons(tmp_path, monkeypatch):
    """The skip says why: no mpirun at all, or one (Open MPI 5) that jax cannot detect."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert _mpirun_problem().startswith("mpirun not found on PATH")
    fake = tmp_path / "mpirun"  # prints a version; runs the command without OMPI_* variables
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "mpirun (Open MPI) 5.0.3"; '
                    'exit 0; }\nwhile [ "$1" != env ]; do shift; done\nexec /usr/bin/env\n')
    fake.chmod(0o755)
    problem = _mpirun_problem()
    assert "needs OMPI_MCA_orte_hnp_uri" in problem and "(mpirun (Open MPI) 5.0.3)" in problem


@pytest.mark.parametrize("flags, message", [
    (["--num-processes", "2"], "missing --coordinator, --process-id"),
    (["--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"],
     "expected HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in 0..1"),
])
def test_bad_process_flags_are_one_line_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(train_shardmap.build_parser(), BASE + flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_sigterm_to_one_process_stops_both_after_the_same_step(runs):
    """The processes agree on stopping (StopRequest.agreed): without it process 1 would
    leave the step loop alone and process 0 would wait in the next step's collectives."""
    root, codes = runs
    assert (codes["stop", 0], codes["stop", 1]) == (143, 143), _output(root, "stop")
    stopped = [r for r in _records(root / "stop" / "log0.jsonl") if r.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["reason"] == "SIGTERM", _output(root, "stop")
    k = stopped[0]["step"]
    assert 50 <= k < 1000
    assert checkpoint.latest(root / "stop" / "ckpt") == \
        root / "stop" / "ckpt" / checkpoint.step_dir_name(k)
    assert int(checkpoint.load_numpy(checkpoint.latest(root / "stop" / "ckpt"))["step"]) == k
