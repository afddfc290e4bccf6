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
"""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

import train_pmap
import train_shardmap
from vit_pure import checkpoint, cli, loop, step

# Six jax processes on a 2-core machine: minutes. Run with `python -m pytest -m slow`.
pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).resolve().parents[1]
BASE = ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "64",
        "--synthetic-val", "32", "--synthetic-test", "32", "--steps", "3", "--batch", "16",
        "--eval-batch", "24", "--no-progress"]  # --accum-steps auto, the default a user runs
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # Not this process's 8-device XLA_FLAGS: each process asks for 2 with --cpu-devices.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return env


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
    loop.run(args, step.StepConfig.from_args(args), make_strategy)


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
    got, want = _records(out / "log0.jsonl"), _records(out / "ref" / "log.jsonl")
    config = [r for r in got if r.get("event") == "config"]
    assert config and config[0]["devices"] == (2 if "tp" in name else 4)  # data-parallel

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
    got_ckpt = checkpoint.load_numpy(out / "ckpt" / checkpoint.step_dir_name(3))
    want_ckpt = checkpoint.load_numpy(out / "ref" / "ckpt" / checkpoint.step_dir_name(3))
    assert got_ckpt.keys() == want_ckpt.keys()
    for k in want_ckpt:
        assert got_ckpt[k].dtype == want_ckpt[k].dtype, k
        # (seen: at most 9e-8 apart with pmap; a wrong batch split moves them by ~1e-4)
        np.testing.assert_allclose(got_ckpt[k], want_ckpt[k], rtol=1e-5, atol=1e-6, err_msg=k)


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
    assert (codes["stop", 0], codes["stop", 1]) == (0, 0), _output(root, "stop")
    stopped = [r for r in _records(root / "stop" / "log0.jsonl") if r.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["reason"] == "SIGTERM", _output(root, "stop")
    k = stopped[0]["step"]
    assert 50 <= k < 1000
    assert checkpoint.latest(root / "stop" / "ckpt") == \
        root / "stop" / "ckpt" / checkpoint.step_dir_name(k)
    assert int(checkpoint.load_numpy(checkpoint.latest(root / "stop" / "ckpt"))["step"]) == k
