"""Runs that survive: checkpoints, exact resume, preemption, non-finite loss, profiling.

Every run here is the tiny model on 80 synthetic training images with a global batch of 16:
5 steps per epoch, 6 steps in all, so a resume from step 1..3 crosses an epoch boundary.
Two straight runs (one per script, a checkpoint after every step) are the references.
Flip + crop, dropout and stochastic depth are on (keyed by step and example id, as
RandAugment is); RandAugment itself is off, to compile in about half the time
(tests/test_randaugment.py covers it).
"""
import dataclasses
import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import train_pmap
import train_shardmap
from vit_pure.config import get_preset
from vit_pure.model import init_params
from vit_pure.run import checkpoint, checkpoint_arrays, cli, evaluate, loop, monitor, resume

REPO = pathlib.Path(__file__).resolve().parents[1]
BASE = ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "80",
        "--synthetic-val", "16", "--synthetic-test", "16", "--steps", "6", "--batch", "16",
        "--no-progress", "--eval-every", "0", "--randaugment", "0",
        "--accum-steps", "1"]  # not auto: its choice depends on the free memory
MESH = ["--mesh", "data=4,model=2"]  # tensor parallel: a different layout from pmap's
SUBPROCESS_TIMEOUT_S = 300


def leaves(state) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state)}


def assert_bitwise(got, want):
    got, want = leaves(got), leaves(want)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


def assert_close(got, want, atol):
    got, want = leaves(got), leaves(want)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=atol, err_msg=k)


def copy_checkpoint(src_dir: pathlib.Path, step: int, dst_dir: pathlib.Path) -> pathlib.Path:
    name = checkpoint.step_dir_name(step)
    shutil.copytree(src_dir / name, dst_dir / name)
    return dst_dir / name


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The references: 6 steps straight per script, checkpointed after every step.
    The pmap run also profiles steps 2-3 and writes a JSON log."""
    root = tmp_path_factory.mktemp("straight")
    every = ["--ckpt-every", "1", "--ckpt-keep", "10"]
    pmap = train_pmap.main(BASE + every + [
        "--ckpt-dir", str(root / "pmap"), "--log-json", str(root / "pmap.jsonl"),
        "--profile", str(root / "profile"), "--profile-steps", "2:3"])
    shard = train_shardmap.main(BASE + MESH + every + ["--ckpt-dir", str(root / "shard")])
    return {"root": root, "pmap": pmap, "shard": shard}


# --------------------------------------------------------------------------- exact resume
def test_shardmap_resume_mid_epoch_is_bitwise_exact(straight, tmp_path, capsys):
    """3 steps (from the straight run's checkpoint) + resume for 3 == 6 straight, bitwise."""
    copy_checkpoint(straight["root"] / "shard", 3, tmp_path)
    got = train_shardmap.main(BASE + MESH + ["--ckpt-dir", str(tmp_path), "--resume"])
    out = capsys.readouterr().out
    assert f"resumed from {tmp_path / 'step_00000003'}: step 3, epoch 1 with 3 of its 5" in out
    resumed = next(ln for ln in out.splitlines() if ln.startswith("resumed from"))
    assert resumed.endswith("FSDP off)") and "layout:" not in resumed, resumed
    assert_bitwise(got["state"], straight["shard"]["state"])
    assert_bitwise(checkpoint.load_numpy(tmp_path / "step_00000006"),
                   checkpoint.load_numpy(straight["root"] / "shard" / "step_00000006"))
    assert got["test"] == straight["shard"]["test"]


def test_sigterm_saves_exits_143_and_resume_is_bitwise_exact(straight, tmp_path, capsys):
    """SIGTERM after the first step logs: the step finishes, a checkpoint is written, exit
    143 (128 + SIGTERM, as without --ckpt-dir: one rule).
    Resuming it (past a corrupt newer checkpoint) gives the straight run's state bitwise."""
    cmd = [sys.executable, "-u", "train_pmap.py", *BASE, "--cpu-devices", "8",
           "--eval-every", "1", "--ckpt-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    watchdog = threading.Timer(SUBPROCESS_TIMEOUT_S, proc.kill)
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step      1 "):
                proc.send_signal(signal.SIGTERM)
        code = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines)
    assert code == 128 + signal.SIGTERM, out
    stopped = [ln for ln in lines if ln.startswith("stopped by SIGTERM after step ")]
    assert len(stopped) == 1, out
    k = int(stopped[0].split()[5].rstrip(";"))
    assert 1 <= k < 6, out  # the signal came after step 1 logged; the run was cut short
    assert f"checkpoint {tmp_path / checkpoint.step_dir_name(k)};" in stopped[0]
    assert checkpoint.latest(tmp_path) == tmp_path / checkpoint.step_dir_name(k)
    assert "final test" not in out

    # A newer checkpoint that is corrupt must be reported and skipped, never loaded.
    bad = copy_checkpoint(straight["root"] / "pmap", 5, tmp_path)
    with open(bad / checkpoint.ARRAYS_FILE, "r+b") as f:
        f.seek(-100, 2)
        f.write(b"\0" * 50)
    got = train_pmap.main(BASE + ["--ckpt-dir", str(tmp_path), "--resume"])
    out = capsys.readouterr().out
    assert f"skipping corrupt checkpoint {bad}" in out
    assert f"moved corrupt checkpoint {bad}" in out
    assert f"resumed from {tmp_path / checkpoint.step_dir_name(k)}: step {k}," in out
    assert_bitwise(got["state"], straight["pmap"]["state"])
    assert (tmp_path / f"corrupt-{bad.name}").is_dir()


# --------------------------------------------------------------------------- across layouts
def test_pmap_checkpoint_resumes_in_shardmap_tensor_parallel(straight, tmp_path, capsys):
    """pmap (8 devices, replicated) -> shard_map data=4,model=2, stopping with --stop-after.

    Not bitwise: the gradient all-reduce sums 8 device slices in one layout and 4 in the
    other, and tensor parallelism splits the matmul sums over 'model', so float rounding
    differs; the checkpoint itself is layout-free (unsharded arrays)."""
    copy_checkpoint(straight["root"] / "pmap", 3, tmp_path)
    got = train_shardmap.main(BASE + MESH + ["--ckpt-dir", str(tmp_path), "--resume",
                                             "--stop-after", "4"])
    out = capsys.readouterr().out
    assert f"stopped by --stop-after after step 4; checkpoint {tmp_path / 'step_00000004'}" in out
    assert got["stopped"] == {"step": 4, "reason": "--stop-after",
                              "checkpoint": str(tmp_path / "step_00000004")}
    assert "final test" not in out and "test" not in got
    want = checkpoint.load_numpy(straight["root"] / "pmap" / "step_00000004")
    saved = checkpoint.load_numpy(tmp_path / "step_00000004")
    assert_close(saved, want, atol=1e-5)
    assert checkpoint.read_meta(tmp_path / "step_00000004")["written_by"]["strategy"] == "shard_map"


def test_shardmap_checkpoint_resumes_in_pmap(straight, tmp_path):
    """shard_map data=4,model=2 -> pmap on 8 devices, to the end of the run."""
    copy_checkpoint(straight["root"] / "shard", 3, tmp_path)
    got = train_pmap.main(BASE + ["--ckpt-dir", str(tmp_path), "--resume"])
    assert_close(got["state"], straight["shard"]["state"], atol=1e-5)
    # Tolerance, not noise: the two references themselves differ by rounding only.
    assert_close(straight["pmap"]["state"], straight["shard"]["state"], atol=1e-5)


# --------------------------------------------------------------------------- refusing
@pytest.mark.parametrize("flags, message", [
    (["--lr", "0.002"], "--lr differs (checkpoint 0.001, this run 0.002)"),
    (["--seed", "1"], "--seed differs (checkpoint 0, this run 1)"),
    (["--batch", "8"], "--batch differs (checkpoint 16, this run 8)"),
    (["--dtype", "bf16"], "dtype policy differs"),
    (["--steps", "7"], "total steps differs (checkpoint 6, this run 7; --epochs / --steps"),
    (["--synthetic-train", "96"], "training set differs (checkpoint '80 images"),
])
def test_resume_refuses_another_runs_checkpoint(straight, tmp_path, capsys, flags, message):
    path = copy_checkpoint(straight["root"] / "pmap", 6, tmp_path)
    argv = BASE + ["--ckpt-dir", str(tmp_path), "--resume"] + flags
    assert cli.main_guard(lambda: train_pmap.main(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: cannot resume from {path}: ") and message in err, err
    assert "\n" not in err


def test_checkpoint_dir_in_use_without_resume_is_refused(straight, tmp_path, capsys):
    copy_checkpoint(straight["root"] / "pmap", 6, tmp_path)
    argv = BASE + ["--ckpt-dir", str(tmp_path)]
    assert cli.main_guard(lambda: train_pmap.main(argv)) == 2
    assert "already holds checkpoints (newest step_00000006); add --resume" in \
        capsys.readouterr().err


def test_resume_with_only_corrupt_checkpoints_is_refused(straight, tmp_path, capsys):
    path = copy_checkpoint(straight["root"] / "pmap", 2, tmp_path)
    (path / checkpoint.MANIFEST_FILE).unlink()
    argv = BASE + ["--ckpt-dir", str(tmp_path), "--resume"]
    assert cli.main_guard(lambda: train_pmap.main(argv)) == 2
    assert "none of the 1 checkpoints" in capsys.readouterr().err
    assert path.is_dir()  # left where it was, for the user to look at


# --------------------------------------------------------------------------- signals, cheaply
@pytest.fixture
def sigterm_while_loading(monkeypatch):
    """SIGTERM delivered to this process while the data loads, before the first step."""
    load = loop.data_lib.load_dataset

    def load_then_signal(*args, **kwargs):
        splits = load(*args, **kwargs)
        signal.raise_signal(signal.SIGTERM)
        return splits
    monkeypatch.setattr(loop.data_lib, "load_dataset", load_then_signal)


def test_sigterm_without_ckpt_dir_exits_143_and_restores_handler(sigterm_while_loading, capsys):
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main_guard(lambda: train_pmap.main(BASE)) == 128 + signal.SIGTERM
    # The watcher thread's acknowledgement (signals.py) first, as the signal came.
    assert capsys.readouterr().err == (
        "SIGTERM: stopping after this step; again to stop now\n"
        "interrupted by SIGTERM at step 0; no --ckpt-dir, nothing saved\n")
    assert signal.getsignal(signal.SIGTERM) is before


def test_second_signal_stops_at_once(monkeypatch, tmp_path, capsys):
    load = loop.data_lib.load_dataset

    def load_then_signal_twice(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        return load(*args, **kwargs)
    monkeypatch.setattr(loop.data_lib, "load_dataset", load_then_signal_twice)
    before = signal.getsignal(signal.SIGINT)
    argv = BASE + ["--ckpt-dir", str(tmp_path)]
    assert cli.main_guard(lambda: train_pmap.main(argv)) == 130
    assert "stopped at once" in capsys.readouterr().err
    assert checkpoint.list_checkpoints(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is before


def test_resume_in_empty_dir_starts_fresh_and_sigterm_saves(sigterm_while_loading, tmp_path,
                                                           capsys):
    """The same command can start a job and restart it after preemption."""
    argv = BASE + ["--ckpt-dir", str(tmp_path / "new"), "--resume"]
    assert cli.main_guard(lambda: train_pmap.main(argv)) == 128 + signal.SIGTERM
    out = capsys.readouterr().out
    assert "no checkpoint in" in out and "starting from step 0" in out
    step_0 = tmp_path / "new" / "step_00000000"
    assert f"stopped by SIGTERM after step 0; checkpoint {step_0}" in out
    want = init_params(jax.random.key(0), get_preset("tiny"))  # --seed 0, float32
    saved = checkpoint.restore(step_0, {"params": want})
    assert_bitwise(saved["params"], want)


# --------------------------------------------------------------------------- NaNs, crashes
def test_nan_loss_in_fp32_stops_naming_the_step(tmp_path, capsys):
    """A huge learning rate: step 1 is fine and saved, its update blows the params up, so
    step 2's loss is NaN. The error names step 2 and the last checkpoint, with its loss."""
    argv = BASE + ["--lr", "1e30", "--warmup-steps", "0", "--ckpt-dir", str(tmp_path),
                   "--ckpt-every", "1", "--mesh", "data=8"]
    assert cli.main_guard(lambda: train_shardmap.main(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(re.escape(f"error: non-finite loss (nan) at step 2; stopped without "
                                  f"saving it. Last checkpoint: {tmp_path / 'step_00000001'} "
                                  f"(step 1, logged loss ") + r"\d+\.\d{4}\)", err), err
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001"]
    checkpoint.verify(tmp_path / "step_00000001")


def test_fp16_goes_on_past_nan_and_never_saves_a_non_finite_step(tmp_path):
    """The blow-up above, in fp16: the loss scale skips the non-finite steps and shrinks,
    and the run goes on; a step whose loss was not finite is not checkpointed (its state is
    the skipped step's), so every checkpoint on disk logged a finite loss."""
    log = tmp_path / "log.jsonl"
    ckpts = tmp_path / "ckpts"
    train_pmap.main(BASE + ["--lr", "1e30", "--warmup-steps", "0", "--dtype", "fp16",
                            "--steps", "4", "--log-json", str(log),
                            "--ckpt-dir", str(ckpts), "--ckpt-every", "1"])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "split" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert any(np.isnan(r["loss"]) for r in steps[:-1])  # it went on after a NaN
    assert steps[-1]["skipped_steps"] >= 2
    assert steps[-1]["loss_scale"] <= 2.0 ** 15 / 4
    finite = [r["step"] for r in steps if np.isfinite(r["loss"])]
    assert [p.name for p in checkpoint.list_checkpoints(ckpts)] == [
        checkpoint.step_dir_name(k) for k in finite]
    not_written = [r["step"] for r in records if r.get("event") == "checkpoint_skipped"]
    assert sorted(not_written + finite) == [1, 2, 3, 4]
    for path in checkpoint.list_checkpoints(ckpts):
        saved = checkpoint.load_numpy(path)
        assert all(np.isfinite(v).all() for k, v in saved.items() if k.startswith("params/"))


class SimulatedCrash(BaseException):
    """The process dying mid-save (kill -9): unlike an OSError, nothing handles it."""


def test_a_crash_while_saving_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """The process dies while writing step 4's checkpoint: step 3's stays complete and
    loadable, and the half-written one is never read."""
    real = checkpoint_arrays.write_bytes

    def write_bytes(path, data):
        if ".tmp-step_00000004" in str(path):
            raise SimulatedCrash("simulated crash while writing the manifest")
        real(path, data)
    monkeypatch.setattr(checkpoint_arrays, "write_bytes", write_bytes)
    ckpts = tmp_path / "ckpts"
    with pytest.raises(SimulatedCrash, match="simulated crash"):
        train_pmap.main(BASE + ["--steps", "4", "--ckpt-dir", str(ckpts), "--ckpt-every", "1"])
    assert checkpoint.latest(ckpts) == ckpts / "step_00000003"
    assert list(ckpts.glob(".tmp-step_00000004-*"))  # the half-written one, never read
    saved = checkpoint.load_numpy(ckpts / "step_00000003")
    assert all(np.isfinite(v).all() for k, v in saved.items() if k.startswith("params/"))


def test_fp16_that_cannot_recover_stops_naming_the_last_checkpoint(tmp_path, capsys):
    """fp16 with a learning rate that diverges: every step after the first overflows, the
    scale halves to its minimum, and the run stops in one line, exit 2, naming the newest
    checkpoint with its logged loss."""
    argv = BASE + ["--lr", "1e6", "--warmup-steps", "0", "--dtype", "fp16", "--steps", "40",
                   "--ckpt-dir", str(tmp_path), "--ckpt-every", "1"]
    assert cli.main_guard(lambda: train_shardmap.main(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: the run cannot recover: the last ")
    assert "and the loss scale has reached its minimum (1)" in err
    named = re.search(r"Last checkpoint: (\S+) \(step (\d+), logged loss \d+\.\d{4}\)$", err)
    assert named, err
    saved = checkpoint.list_checkpoints(tmp_path)
    assert saved and str(saved[-1]) == named.group(1)  # the newest one, with its loss
    assert saved[-1].name == checkpoint.step_dir_name(int(named.group(2)))
    assert int(named.group(2)) < 40 - 10  # stopped long before the end


class _HostMetrics:
    """A strategy stand-in for LossWatch: the metrics are host floats already."""
    def metrics_to_host(self, metrics):
        return {k: float(v) for k, v in metrics.items()}


def test_fp16_nan_loss_with_finite_gradients_stops_the_run():
    """With a dynamic loss scale a non-finite *gradient* is a skipped step and counted;
    a non-finite *loss* whose gradients were finite was applied, so it must stop the run."""
    watch = monitor.LossWatch(_HostMetrics(), loss_scaled=True)
    watch.add(1, {"loss": 2.3, "grad_norm": 1.0})
    watch.add(2, {"loss": float("nan"), "grad_norm": float("inf")})  # skipped by the scale
    watch.check("ckpt/step_00000001")
    assert watch.skipped == 1
    watch.add(3, {"loss": float("nan"), "grad_norm": 0.5})
    with pytest.raises(FloatingPointError, match=r"^non-finite loss \(nan\) at step 3 "
                       r"with a finite gradient norm \(0.5\)"):
        watch.check("ckpt/step_00000001")


def test_fp16_skips_stop_the_run_only_at_the_scales_minimum():
    """N skipped steps in a row stop the run once the scale has reached its minimum; the
    same skips above the minimum, or a finite step in between, do not."""
    watch = monitor.LossWatch(_HostMetrics(), loss_scaled=True, min_scale=1.0, skips_at_min=3)
    for k in (1, 2, 3):
        watch.add(k, {"loss": float("nan"), "grad_norm": float("inf")})
    watch.check("none", scale=4.0)  # still shrinking: the run may recover
    watch.add(4, {"loss": 2.0, "grad_norm": 1.0})  # recovered: the count starts again
    for k in (5, 6):
        watch.add(k, {"loss": float("nan"), "grad_norm": float("inf")})
    watch.check("none", scale=1.0)  # at the minimum, but only 2 in a row
    assert watch.skipped == 5 and not watch.last_loss_finite
    watch.add(7, {"loss": float("nan"), "grad_norm": float("inf")})
    with pytest.raises(FloatingPointError, match=r"^the run cannot recover: the last 3 steps "
                       r"\(to step 7\) .* minimum \(1\); stopped without saving. "
                       r"Last checkpoint: none$"):
        watch.check("none", scale=1.0)


def test_eval_only_takes_model_and_policy_from_the_checkpoint_as_values():
    """--eval-only builds its StepConfig from the checkpoint's meta (dataclasses.replace),
    the policy as the run resolved it (m= included), without accumulation."""
    from vit_pure import step
    from vit_pure.policy import Policy
    sc = step.StepConfig(get_preset("vit-cifar"), Policy.parse("fp32"), accum_steps=4)
    tiny = get_preset("tiny")
    meta = {"model_config": dataclasses.asdict(tiny), "policy": "p=f32,c=bf16,o=f32,m=bf16",
            "matmul_precision": "high", "config": {"dtype": "fp16"}}
    got = evaluate.saved_step_config(meta, sc)
    assert got.cfg == tiny and got.accum_steps == 1 and got.label_smoothing == sc.label_smoothing
    assert got.policy == Policy.parse("p=f32,c=bf16,o=f32,m=bf16", "high")
    # Older checkpoints: no "policy" in meta, the flags say it.
    older = evaluate.saved_step_config({"config": {"dtype": "bf16"}}, sc)
    assert older.cfg == sc.cfg and older.policy == Policy.parse("bf16")


# --------------------------------------------------------------------------- profiling
def test_profile_trace_and_memory_figures(straight):
    records = [json.loads(line)
               for line in (straight["root"] / "pmap.jsonl").read_text().splitlines()]
    profile = [r for r in records if r.get("event") == "profile"]
    assert profile == [{"event": "profile", "first": 2, "last": 3,
                        "dir": str(straight["root"] / "profile")}]
    assert list((straight["root"] / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert list((straight["root"] / "profile").glob("plugins/profile/*/*.trace.json.gz"))
    memory = [r for r in records if r.get("event") == "memory"]
    assert [r["step"] for r in memory] == [1, 3, 6]  # first log point, profile end, run end
    assert all(r["host_peak_rss_bytes"] > 50 * 2**20 for r in memory)


# --------------------------------------------------------------------------- small pieces
def test_train_batches_start_skips_exactly_the_first_batches():
    split = loop.data_lib.synthetic_cifar10(n_train=70, n_val=0, n_test=0)["train"]
    full = list(loop.data_lib.train_batches(split, 16, seed=3, epoch=2))
    tail = list(loop.data_lib.train_batches(split, 16, seed=3, epoch=2, start=3))
    assert len(full) == 4 and len(tail) == 1
    assert tail[0][0].tobytes() == full[3][0].tobytes()
    assert tail[0][1].tobytes() == full[3][1].tobytes()
    assert list(loop.data_lib.train_batches(split, 16, seed=3, epoch=2, start=4)) == []
    with pytest.raises(loop.DataError, match="start batch 5 is outside"):
        loop.data_lib.train_batches(split, 16, seed=3, epoch=2, start=5)


@pytest.mark.parametrize("flags, message", [
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--ckpt-every", "5"], "--ckpt-every needs --ckpt-dir"),
    (["--ckpt-dir", "x", "--ckpt-keep", "0"], "--ckpt-keep must be >= 1"),
    (["--stop-after", "0"], "--stop-after must be positive"),
    (["--profile-steps", "2:3"], "--profile-steps needs --profile"),
    (["--profile", "x", "--profile-steps", "3:2"], "expected A:B with 1 <= A <= B"),
    (["--profile", "x", "--profile-steps", "3"], "expected A:B with 1 <= A <= B"),
    (["--dataset", "cifar10", "--synthetic-train", "80"], "need --dataset synthetic"),
])
def test_bad_checkpoint_and_profile_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(cli.build_parser("x"), flags)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_profile_steps_default_and_synthetic_sizes():
    args = cli.parse_args(cli.build_parser("x"), ["--profile", "p", "--dataset", "synthetic",
                                                  "--synthetic-train", "80"])
    assert args.profile_range == (3, 5)
    assert args.synthetic_sizes == {"n_train": 80}


def test_moving_a_corrupt_checkpoint_aside_never_collides(tmp_path):
    """The same step corrupted again after a fallback (a rerun writes step_5 anew, and it is
    corrupted too): the second move gets its own name, and both folders keep their files."""
    first = []
    for round_ in range(3):
        step = tmp_path / "step_00000005"
        step.mkdir()
        (step / "arrays.npz").write_text(f"round {round_}")
        first.append(resume.move_aside(step))
        assert not step.exists()
    assert [p.name for p in first] == ["corrupt-step_00000005", "corrupt-step_00000005.2",
                                      "corrupt-step_00000005.3"]
    assert [(p / "arrays.npz").read_text() for p in first] == ["round 0", "round 1", "round 2"]
