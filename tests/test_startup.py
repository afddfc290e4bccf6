"""A run's start is quick and never silent, and a signal is heard at once.

* A fresh initialisation compiles one program (model.init_params, step.init_state), not
  one random sampler per parameter shape.
* A signal during a long compile is acknowledged at once (signals.py's watcher thread),
  and a second one ends the process (130), even while XLA still compiles.
* The front-door run (vit-cifar, batch 256, fp32, synthetic data, one CPU device, with its
  progress bar): every pause longer than SILENCE_S follows a line that says what is being
  computed or compiled. Each output line (stdout and stderr, a bar's redraw included) is
  time-stamped when its first byte arrives.

The subprocess cases are slow (a compile of vit-cifar's step); `-m slow` runs them.
"""
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, subprocess_env

from vit_pure import PRESETS, Policy, init_params, step
from vit_pure.run import monitor

SILENCE_S = 5.0
TIMEOUT_S = 900
# An odd-sized model no other test compiles, so its init programs are compiled here.
CFG = dataclasses.replace(PRESETS["tiny"], name="startup-odd", width=26, heads=2,
                          mlp_dim=38, depth=3)


def _compiles(fn) -> int:
    """How many programs XLA compiled while `fn()` ran (JAX's compile events)."""
    seen = []

    def on_event(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(seconds)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    return len(seen)


def test_a_fresh_state_is_one_compile():
    """init_state draws the params and builds the optimizer's state in one program, and
    init_params alone is one program too: the cost no longer grows with the number of
    distinct parameter shapes (seven weight shapes here, more biases)."""
    key = jax.random.key(0)
    optimizer = step.make_optimizer(step.OptimConfig(), 10)[0]
    assert _compiles(lambda: step.init_state(key, CFG, Policy(), optimizer, ema=True)) == 1
    assert _compiles(lambda: init_params(key, CFG)) == 1
    assert _compiles(lambda: init_params(key, CFG)) == 0  # in jit's cache


def test_init_draws_follow_the_documented_distribution():
    """Every weight matrix drawn flat (then reshaped) from a truncated normal: std 0.02,
    nothing beyond two standard deviations of the untruncated normal, each from its own
    key (no two start alike); biases zero, LayerNorm scales one."""
    cfg = PRESETS["vit-cifar"]
    p = init_params(jax.random.key(0), cfg)
    weights = [p["patch_embed"]["kernel"], p["pos_embed"], p["blocks"]["attn"]["qkv"]["kernel"],
               p["blocks"]["attn"]["out"]["kernel"], p["blocks"]["mlp"]["fc1"]["kernel"],
               p["blocks"]["mlp"]["fc2"]["kernel"], p["head"]["kernel"]]
    bound = 2 * 0.02 / 0.87962566
    for w in weights:
        w = np.asarray(w)
        assert abs(w.std() - 0.02) < 0.002 and np.abs(w).max() <= bound, w.shape
    firsts = {float(np.asarray(w).ravel()[0]) for w in weights}
    assert len(firsts) == len(weights)
    assert not np.any(np.asarray(p["blocks"]["mlp"]["fc1"]["bias"]))
    assert np.all(np.asarray(p["blocks"]["ln1"]["scale"]) == 1)
    # A stem and registers draw from keys of their own: the other params are unchanged.
    extra = init_params(jax.random.key(0), cfg.replace(stem=(8, 16), registers=2))
    np.testing.assert_array_equal(extra["blocks"]["mlp"]["fc2"]["kernel"],
                                  p["blocks"]["mlp"]["fc2"]["kernel"])
    assert extra["stem"]["conv1"]["kernel"].dtype == jnp.float32


def test_long_work_without_a_bar_says_how_far_it_is_once_a_minute(monkeypatch):
    """Evaluation (and feature extraction under --no-progress) show no bar: a Heartbeat
    line once `every_s` has passed since the last, none sooner, none without a log."""
    now = [100.0]
    monkeypatch.setattr(monitor.time, "monotonic", lambda: now[0])
    lines = []
    beat = monitor.Heartbeat(lambda text, **record: lines.append((text, record)),
                             "final test: evaluating", 10_000, "images")
    for done, at in ((1_000, 130.0), (2_000, 161.0), (3_000, 200.0), (4_000, 222.0)):
        now[0] = at
        beat.update(done)
    assert [text for text, _ in lines] == [
        "final test: evaluating: 2,000 of 10,000 images (20%), 61 s",
        "final test: evaluating: 4,000 of 10,000 images (40%), 122 s"]
    assert lines[0][1] == {"event": "progress", "what": "final test: evaluating",
                           "done": 2_000, "total": 10_000}
    silent = monitor.Heartbeat(None, "features", 10, "images")
    now[0] = 1e6
    silent.update(5)  # no log: nothing to call


# --------------------------------------------------------------------------- subprocesses
def _start(args: list[str]) -> subprocess.Popen:
    # No compilation cache: the compile must really happen, and take its time.
    return subprocess.Popen([sys.executable, "-u", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=subprocess_env(cache=False),
                            start_new_session=True)


def _lines(proc: subprocess.Popen):
    """(seconds since the start, line) of every line the process writes, stamped when its
    first byte arrives: a line ends at a newline or at a carriage return, and a progress
    bar writes its text after the return, so its line is shown long before it ends."""
    start, buf, since = time.monotonic(), b"", 0.0
    while chunk := os.read(proc.stdout.fileno(), 4096):
        now = time.monotonic() - start
        older, buf = len(buf), buf + chunk
        if not older:
            since = now
        while (ends := [i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0]):
            line, buf = buf[:min(ends)], buf[min(ends) + 1:]
            older -= min(ends) + 1
            if line.strip():
                yield since, line.decode(errors="replace").strip()
            if older <= 0:  # what is left came in this chunk
                since = now


def _watchdog(proc: subprocess.Popen) -> threading.Timer:
    timer = threading.Timer(TIMEOUT_S, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    return timer


def test_a_bar_is_stamped_when_it_is_drawn_not_when_it_is_redrawn():
    """A progress bar draws its text after a carriage return and ends it only at its next
    redraw: the reader stamps the text when it arrives, so the pause after it is seen."""
    script = ("import sys, time; sys.stderr.write('\\repoch 1/1: 0%'); sys.stderr.flush(); "
              "time.sleep(1.5); sys.stderr.write('\\repoch 1/1: 100%\\n'); print('done')")
    proc = _start(["-c", script])
    stamped = list(_lines(proc))
    proc.wait()
    assert [line for _, line in stamped] == ["epoch 1/1: 0%", "epoch 1/1: 100%", "done"]
    (drawn, _), (redrawn, _), _ = stamped
    assert redrawn - drawn > 1.0, stamped


@pytest.mark.slow
def test_signal_during_a_compile_is_heard_at_once_and_a_second_stops_it():
    """SIGTERM as the training step starts compiling: the acknowledgement comes before the
    compile ends (the main thread is inside XLA, where Python runs no handler); a second
    SIGTERM ends the process, 130, without waiting for the compile."""
    proc = _start(["train_shardmap.py", "--model", "vit-cifar", "--batch", "8", "--dataset",
                   "synthetic", "--synthetic-train", "16", "--synthetic-val", "8",
                   "--synthetic-test", "8", "--steps", "2", "--cpu-devices", "1",
                   "--accum-steps", "1", "--no-progress"])
    timer, lines = _watchdog(proc), []
    try:
        for _, line in _lines(proc):
            lines.append(line)
            if line.startswith("compiling the training step"):
                proc.send_signal(signal.SIGTERM)
            elif line.startswith("SIGTERM: stopping after this step; again to stop now"):
                proc.send_signal(signal.SIGTERM)
        code = proc.wait()
    finally:
        timer.cancel()
    out = "\n".join(lines)
    assert code == 130, out
    ack = lines.index("SIGTERM: stopping after this step; again to stop now")
    assert lines[ack - 1].startswith("compiling the training step"), out
    assert not any(ln.startswith("compiled the training step") for ln in lines), out
    assert lines[-1] == ("interrupted: stopped at once; nothing saved since the last "
                         "checkpoint"), out


def _announces(line: str) -> bool:
    """Does this output line say what the run does next (or is it the bar's redraw)?"""
    return bool(re.match(r"(train_shardmap\.py: starting|compiling |initialising |"
                         r"epoch \d+/\d+:|step +\d+ |memory after step )", line)
                or re.search(r": evaluating [\d,]+ images", line))


@pytest.mark.slow
def test_the_front_door_run_is_never_silent():
    proc = _start(["train_shardmap.py", "--model", "vit-cifar", "--batch", "256", "--dtype",
                   "fp32", "--dataset", "synthetic", "--synthetic-train", "512",
                   "--synthetic-val", "256", "--synthetic-test", "256", "--steps", "2",
                   "--cpu-devices", "1"])
    timer, stamped = _watchdog(proc), []
    try:
        stamped = list(_lines(proc))
        code = proc.wait()
    finally:
        timer.cancel()
    out = "\n".join(f"{t:7.2f} {line}" for t, line in stamped)
    assert code == 0, out
    assert any(line.startswith("final test:") for _, line in stamped), out
    silent = [(line, t1 - t0) for (t0, line), (t1, _) in zip(stamped, stamped[1:])
              if t1 - t0 > SILENCE_S and not _announces(line)]
    assert not silent, f"{silent}\n{out}"
