"""Bad input on the command line: one line on stderr that names the flag, a non-zero exit.

Every flag of both scripts, with wrong values: negative, zero, NaN / inf, out of range,
unknown names, malformed text, values that do not divide (batch over devices, micro-
batches, heads over `model=`, depth over `pipe=`), pairs that do not go together, and
paths the run could not write. None may end in a traceback, and none may run silently.

Most cases fail while the flags are parsed, or while the step is built (before any
compile), so they run in this process through the script's own `main` and
`cli.main_guard`, on conftest's 8 fake devices (`--cpu-devices 8` matches them). A few run
as real processes, to show the exit code and the whole of stderr end to end.
"""
import argparse
import errno
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

import train_pmap
import train_shardmap
from vit_pure import step, weights
from vit_pure.data import download
from vit_pure.run import checkpoint_arrays, checks, cli, settings

REPO = pathlib.Path(__file__).resolve().parents[1]
# A run that would finish in seconds, were its input good (a case that runs fails).
TINY = ["--model", "tiny", "--steps", "1", "--batch", "16", "--no-final-eval",
        "--no-progress", "--randaugment", "0", "--cpu-devices", "8", "--accum-steps", "1"]
SYNTHETIC = ["--dataset", "synthetic", "--synthetic-train", "64", "--synthetic-val", "16",
             "--synthetic-test", "16"]
BASE = TINY + SYNTHETIC
SCRIPTS = {"shardmap": train_shardmap, "pmap": train_pmap}

# (flags added to BASE, what stderr's line must contain). Both scripts share these flags.
SHARED = [
    # counts: zero, negative, not a number
    (["--batch", "0"], "--batch must be positive"),
    (["--batch", "-8"], "--batch must be positive"),
    (["--batch", "abc"], "argument --batch: invalid int value: 'abc'"),
    (["--epochs", "0"], "--epochs must be positive"),
    (["--steps", "0"], "--steps must be positive"),
    (["--steps", "-1"], "--steps must be positive"),
    (["--log-every", "0"], "--log-every must be positive"),
    (["--eval-batch", "0"], "--eval-batch must be positive"),
    (["--eval-batch", "-4"], "--eval-batch must be positive"),
    (["--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["--cpu-devices", "0"], "--cpu-devices must be positive"),
    (["--cpu-devices", "-2"], "--cpu-devices must be positive"),
    # device counts past what this machine's memory holds: refused before any device exists
    (["--cpu-devices", "100000"], "--cpu-devices 100,000: this machine holds at most"),
    (["--plan", "100000"], "--plan 100,000: this machine holds at most"),
    (["--plan", "0"], "--plan must be positive"),
    (["--accum-steps", "0"], "argument --accum-steps: expected a positive integer or 'auto'"),
    (["--accum-steps", "-1"], "argument --accum-steps"),
    (["--accum-steps", "two"], "argument --accum-steps"),
    (["--synthetic-train", "-1"], "--synthetic-train must be >= 0"),
    (["--synthetic-val", "-1"], "--synthetic-val must be >= 0"),
    (["--synthetic-test", "-5"], "--synthetic-test must be >= 0"),
    (["--ckpt-every", "-1"], "--ckpt-every must be >= 0"),
    (["--ckpt-keep", "0"], "--ckpt-keep must be >= 1"),
    (["--stop-after", "0"], "--stop-after must be positive"),
    (["--seed", "-1"], "--seed must be in [0, 2**63)"),
    (["--seed", str(2 ** 63)], "--seed must be in [0, 2**63)"),
    # rates and coefficients: negative, NaN, inf, outside their interval
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--lr", "inf"], "--lr must be a positive number"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--weight-decay", "nan"], "--weight-decay must be >= 0"),
    (["--grad-clip", "-1"], "--grad-clip must be >= 0"),
    (["--grad-clip", "nan"], "--grad-clip must be >= 0"),
    (["--label-smoothing", "1.0"], "--label-smoothing must be in [0, 1)"),
    (["--label-smoothing", "-0.1"], "--label-smoothing must be in [0, 1)"),
    (["--label-smoothing", "nan"], "--label-smoothing must be in [0, 1)"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--dropout", "-0.1"], "--dropout must be in [0, 1)"),
    (["--dropout", "nan"], "--dropout must be in [0, 1)"),
    (["--drop-path", "1.0"], "--drop-path must be in [0, 1)"),
    (["--mixup", "-1"], "--mixup must be >= 0"),
    (["--mixup", "nan"], "--mixup must be >= 0"),
    (["--cutmix", "-0.5"], "--cutmix must be >= 0"),
    (["--cutmix", "inf"], "--cutmix must be >= 0"),
    (["--memory-budget", "0"], "--memory-budget must be positive"),
    (["--memory-budget", "-1"], "--memory-budget must be positive"),
    (["--memory-budget", "nan"], "--memory-budget must be positive"),
    (["--memory-budget", "inf"], "--memory-budget must be positive"),
    # malformed text and unknown names
    (["--randaugment", "2,11"], "argument --randaugment: expected N,M"),
    (["--randaugment", "x"], "argument --randaugment: expected N,M"),
    (["--randaugment", "1,2,3"], "argument --randaugment: expected N,M"),
    (["--randaugment", "-1,5"], "argument --randaugment"),
    (["--model", "nope"], "argument --model: invalid choice: 'nope'"),
    (["--pool", "max"], "argument --pool: invalid choice: 'max'"),
    (["--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
    (["--policy", "garbage"], "--policy: unknown dtype 'garbage'"),
    (["--policy", "p=f32,c=bf17"], "--policy: unknown dtype 'bf17'"),
    (["--policy", "p=f32,c=bf16,o=f32,m=f16"], "--policy: policy matmul dtype must be"),
    (["--matmul-precision", "ultra"], "argument --matmul-precision: invalid choice"),
    (["--remat", "nope"], "argument --remat: remat must be one of none, gelu, block, "
                          "block-save-dots "
                          "or block-save:NAMES"),
    (["--remat", "block-save:dot+foo"], "with distinct NAMES from dot+ln+gelu+mask, got "
                                        "'block-save:dot+foo'"),
    (["--dataset", "imagenet"], "argument --dataset: invalid choice"),
    (["--recipe", "nope"], "argument --recipe: invalid choice"),
    (["--preset", "cpu-quick"], "unrecognized arguments: --preset cpu-quick"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # pairs that do not go together
    (["--dataset", "cifar10"], "--synthetic-train/--synthetic-val/--synthetic-test need "
                               "--dataset synthetic"),
    (["--resume"], "--resume needs --ckpt-dir"),
    (["--eval-only"], "--eval-only needs --ckpt-dir"),
    (["--ckpt-every", "5"], "--ckpt-every needs --ckpt-dir"),
    (["--profile-steps", "3:5"], "--profile-steps needs --profile"),
    (["--memory-budget", "4"], "--memory-budget is the budget of --accum-steps auto; with "
                               "--accum-steps 1 nothing reads it"),
    (["--stop-after", "5"], "--stop-after 5: the run ends sooner, at --steps 1"),
    # the small-data levers
    (["--ema", "-0.1"], "--ema must be a decay in [0, 1) (0: off), got -0.1"),
    (["--ema", "1"], "--ema must be a decay in [0, 1) (0: off), got 1.0"),
    (["--ema", "1.5"], "--ema must be a decay in [0, 1)"),
    (["--ema", "nan"], "--ema must be a decay in [0, 1)"),
    (["--ema", "inf"], "--ema must be a decay in [0, 1)"),
    (["--ema", "x"], "argument --ema: invalid float value: 'x'"),
    (["--mix-off-epochs", "-1", "--mixup", "0.8"], "--mix-off-epochs must be >= 0, got -1"),
    (["--mix-off-epochs", "2"], "--mix-off-epochs 2: there is no mixing to turn off"),
    (["--eval-corners", "--trainable", "head"], "--eval-corners: not with --trainable head"),
    (["--val-fraction", "0.1"], "--val-fraction needs --dataset cifar10"),
    (["--mix-off-epochs", "5", "--epochs", "5", "--cutmix", "1"],
     "--mix-off-epochs 5 must be less than --epochs 5"),
    (["--mix-off-epochs", "1.5"], "argument --mix-off-epochs: invalid int value: '1.5'"),
    (["--repeat-aug", "0"], "--repeat-aug must be >= 1, got 0"),
    (["--repeat-aug", "-3"], "--repeat-aug must be >= 1, got -3"),
    (["--repeat-aug", "3"], "--repeat-aug 3 does not divide --batch 16"),
    (["--repeat-aug", "two"], "argument --repeat-aug: invalid int value: 'two'"),
    # several processes
    (["--num-processes", "2"], "missing --coordinator, --process-id"),
    (["--coordinator", "garbage"], "missing --num-processes, --process-id"),
    (["--coordinator", "garbage", "--num-processes", "2", "--process-id", "0"],
     "--coordinator 'garbage': expected HOST:PORT"),
    (["--coordinator", "127.0.0.1:99999", "--num-processes", "2", "--process-id", "0"],
     "port in 1..65535"),
    (["--coordinator", ":1234", "--num-processes", "2", "--process-id", "0"],
     "--coordinator ':1234': expected HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "0", "--process-id", "0"],
     "--num-processes must be >= 1"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in 0..1"),
    (["--distributed", "--process-id", "-1"], "--process-id must be >= 0"),
    # paths the run would write to, or read from
    (["--log-json", "/nonexistent-dir/log.jsonl"], "--log-json /nonexistent-dir/log.jsonl: "
                                                   "directory /nonexistent-dir does not exist"),
    (["--log-json", "{tmp}"], "is a directory, expected a file"),
    (["--ckpt-dir", "{file}"], "exists and is not a directory"),
    (["--ckpt-dir", "{file}/sub"], "cannot create or write it"),
    (["--profile", "{file}", "--profile-steps", "1:1"], "--profile {file}: exists and is not "
                                                        "a directory"),
    (["--profile", "{tmp}"], "--profile-steps 3:5 (the default): the run has only --steps 1"),
    (["--profile", "{tmp}", "--profile-steps", "5:3"], "--profile-steps '5:3': expected A:B"),
    (["--profile", "{tmp}", "--profile-steps", "0:2"], "--profile-steps '0:2': expected A:B"),
    (["--profile", "{tmp}", "--profile-steps", "x"], "--profile-steps 'x': expected A:B"),
    (["--profile", "{tmp}", "--profile-steps", "2:3"], "--profile-steps 2:3: the run has only "
                                                       "--steps 1"),
]

# Flags of train_shardmap.py only; most fail when the strategy is built (before compiling).
SHARDMAP = [
    (["--mesh", "data=3"], "--mesh data=3: data*model = 3 but there are 8 devices"),
    (["--mesh", "data=2,model=2"], "--mesh data=2,model=2: data*model = 4 but there are 8"),
    (["--mesh", "model=3"], "--mesh: model=3 does not divide the 8 devices"),
    (["--mesh", "pipe=3"], "--mesh: model*pipe = 3 does not divide the 8 devices"),
    (["--mesh", "model=0"], "--mesh 'model=0': expected data=D,model=M,pipe=S"),
    (["--mesh", "model=-1"], "--mesh 'model=-1': expected data=D,model=M,pipe=S"),
    (["--mesh", "foo=2"], "--mesh 'foo=2': expected data=D,model=M,pipe=S"),
    (["--mesh", "data=x"], "--mesh 'data=x': expected data=D,model=M,pipe=S"),
    (["--mesh", "data=4,data=2"], "--mesh 'data=4,data=2': expected data=D,model=M,pipe=S"),
    (["--mesh", "foo=2,data=4"], "--mesh 'foo=2,data=4': expected data=D,model=M,pipe=S "
                                 "with positive integers; unknown axis 'foo'"),
    (["--mesh", "data=4,data=2"], "axis 'data' given twice"),
    (["--mesh", "data=2,model=x"], "model='x' is not a positive integer"),
    (["--mesh", "data"], "'data' is not AXIS=SIZE"),
    (["--mesh", "data=1,model=8"], "--mesh model=8: 4 heads do not divide by 8"),
    (["--mesh", "data=1,pipe=8"], "--mesh pipe=8: pipeline: depth 4 of tiny does not split "
                                  "into 8 equal stages"),
    (["--microbatches", "2"], "--microbatches needs a pipeline: add pipe=S to --mesh"),
    (["--mesh", "data=4,pipe=2", "--microbatches", "0"], "--microbatches must be >= 1"),
    (["--mesh", "data=4,pipe=2", "--microbatches", "-1"], "--microbatches must be >= 1"),
    (["--mesh", "data=4,pipe=2", "--microbatches", "3"],
     "--batch 16: the per-device batch 4 (over data=4) does not divide into --microbatches 3"),
    (["--microbatches", "x"], "argument --microbatches: invalid int value"),
    (["--pipeline-schedule", "1f1b"],
     "--pipeline-schedule / --virtual-stages need a pipeline: add pipe=S to --mesh"),
    (["--mesh", "data=4,pipe=2", "--virtual-stages", "2"],
     "--virtual-stages 2 needs --pipeline-schedule interleaved"),
    (["--mesh", "data=4,pipe=2", "--pipeline-schedule", "interleaved", "--virtual-stages", "4"],
     "--virtual-stages 4: the 2 blocks per stage do not split into 4 chunks"),
    (["--mesh", "data=2,pipe=4", "--pipeline-schedule", "interleaved", "--virtual-stages",
      "1", "--microbatches", "2"],
     "interleaved schedule: --microbatches 2 must be a multiple of the 4 stages"),
    (["--mesh", "data=4,pipe=2", "--pipeline-schedule", "zb"],
     "argument --pipeline-schedule: invalid choice: 'zb'"),
]

# Flags of train_shardmap.py that train_pmap.py does not have.
PMAP = [
    (["--fsdp"], "unrecognized arguments: --fsdp"),
    (["--mesh", "data=8"], "unrecognized arguments: --mesh data=8"),
    (["--microbatches", "2"], "unrecognized arguments: --microbatches 2"),
]

# Both scripts: values that fail once the data is loaded or the batch split is checked.
AFTER_PARSE = [
    (["--batch", "12"], "--batch 12 is not divisible by the 8 data-parallel devices"),
    (["--eval-batch", "12"], "--eval-batch 12 is not divisible by the 8 data-parallel devices"),
    (["--accum-steps", "3"], "--accum-steps 3 does not divide the per-device batch 2"),
    (["--synthetic-train", "8"], "--batch 16 is larger than the 8 training images"),
    (["--eval-only", "--ckpt-dir", "{tmp}"], "--eval-only: no intact checkpoint in {tmp}"),
    (["--eval-only", "--ckpt-dir", "{tmp}/none"], "--ckpt-dir {tmp}/none: no such directory"),
    (["--init-from", "{tmp}/none.npz"], "--init-from {tmp}/none.npz: no such file or folder"),
    (["--subset", "4001,1000"], "argument --subset: expected TRAIN,TEST with TRAIN a multiple"),
    (["--subset", "4000"], "argument --subset: expected TRAIN,TEST image counts"),
    # past the end of a run whose length --epochs gives (64 images / 16 = 4 steps an epoch)
    (["--steps", "100", "--epochs", "1", "--stop-after", "5"],
     "--stop-after 5: the run ends sooner, at step 4 (1 epoch x 4 steps)"),
    (["--steps", "100", "--epochs", "1", "--profile", "{tmp}", "--profile-steps", "5:6"],
     "--profile-steps 5:6: the run ends sooner, at step 4 (1 epoch x 4 steps)"),
    (["--batch", "8", "--mixup", "0.2"], "mixup / CutMix pair examples 2k and 2k+1 on one "
                                         "device: the per-device batch 1 must be even"),
    # checked with the other paths, before anything compiles
    (["--plan-json", "{tmp}/no/plan.json"],
     "--plan-json {tmp}/no/plan.json: directory {tmp}/no does not exist"),
    (["--plan-json", "{tmp}"], "--plan-json {tmp}: is a directory, expected a file"),
    # an explicit value that the pool would ignore
    (["--pool", "mean", "--last-block", "class-token"],
     "--last-block class-token: the head of --pool mean reads every token"),
    (["--trainable", "head"], "--trainable head trains the head alone on a frozen backbone: "
                              "give --init-from FILE"),
]


def _cases():
    return [pytest.param(name, flags, message, id=f"{name}:{' '.join(flags)}")
            for name in SCRIPTS
            for flags, message in SHARED + AFTER_PARSE + (SHARDMAP if name == "shardmap" else PMAP)]


def _fill(items, tmp_path):
    """{tmp}: an empty folder; {file}: a plain file."""
    (tmp_path / "file").write_text("not a folder")
    return [x.format(tmp=tmp_path / "empty", file=tmp_path / "file") for x in items]


def _main(script, argv) -> int:
    """The script's `main` as its `__main__` block runs it: the exit code."""
    try:
        return cli.main_guard(lambda: SCRIPTS[script].main(argv))
    except SystemExit as e:  # argparse, and the parse_args checks
        return e.code


def _assert_one_line(code, err, message):
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], (code, err)
    assert "Traceback" not in err


@pytest.mark.parametrize("script, flags, message", _cases())
def test_bad_flag_is_one_line_and_exit_2(script, flags, message, tmp_path, capsys,
                                         monkeypatch):
    (tmp_path / "empty").mkdir()
    # start_runtime writes XLA_FLAGS (--cpu-devices): put it back afterwards.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    code = _main(script, BASE + _fill(flags, tmp_path))
    _assert_one_line(code, capsys.readouterr().err, _fill([message], tmp_path)[0])


def test_missing_data_dir_is_one_line(tmp_path, capsys, monkeypatch):
    """No CIFAR-10 folder and nowhere to download it from (a file URL that is not there)."""
    monkeypatch.setenv(download.URL_ENV, (tmp_path / "no-such-archive.tar.gz").as_uri())
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    code = _main("shardmap", TINY + ["--dataset", "cifar10", "--data-dir", str(tmp_path / "d")])
    captured = capsys.readouterr()
    _assert_one_line(code, captured.err, "without a network, pass --data-dir DIR")
    assert captured.out == ""  # the error is the only line
    assert not (tmp_path / "d").exists()  # the failed download left nothing behind


def test_disk_full_at_a_save_is_one_line(tmp_path, capsys, monkeypatch):
    """The disk fills while the step-1 checkpoint is written (the writer fault injected):
    one line, exit 2, no partial .tmp-* left in --ckpt-dir."""
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_arrays, "write_bytes", full)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    code = _main("pmap", BASE + ["--ckpt-dir", str(tmp_path / "ck")])
    _assert_one_line(code, capsys.readouterr().err,
                     f"cannot write the step-1 checkpoint in {tmp_path / 'ck'} "
                     f"(No space left on device)")
    assert os.listdir(tmp_path / "ck") == []


@pytest.mark.parametrize("microbatches, warned", [(2, True), (4, False)])
def test_fewer_microbatches_than_stages_is_warned(microbatches, warned):
    """Not an error, but never silent: the layout's description says it and what to give."""
    args = cli.parse_args(train_shardmap.build_parser(), BASE + [
        "--mesh", "data=2,pipe=4", "--microbatches", str(microbatches)])
    sc = settings.step_config(args)
    strategy = train_shardmap.ShardMapStrategy(
        sc, step.make_optimizer(settings.RunConfig.from_args(args).schedule.optim, 1)[0],
        args.mesh, microbatches=args.microbatches)
    text = strategy.describe()
    assert ("warning: --microbatches 2 is fewer than the 4 pipeline stages" in text) == warned
    assert ("give --microbatches 4 or more" in text) == warned


def test_eval_only_reads_a_read_only_ckpt_dir(tmp_path, capsys, monkeypatch):
    """--eval-only only reads --ckpt-dir: a folder this user may not write passes the
    start-up check (and fails later only for what it holds); training there does not."""
    (tmp_path / "ro").mkdir()
    access = os.access
    monkeypatch.setattr(checks.os, "access",
                        lambda p, mode: access(p, mode) and not mode & os.W_OK)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    ro = str(tmp_path / "ro")
    code = _main("shardmap", BASE + ["--eval-only", "--ckpt-dir", ro])
    _assert_one_line(code, capsys.readouterr().err, f"--eval-only: no intact checkpoint in {ro}")
    code = _main("shardmap", BASE + ["--ckpt-dir", ro])
    _assert_one_line(code, capsys.readouterr().err, f"--ckpt-dir {ro}: cannot create or write")


def test_data_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    code = _main("pmap", TINY + ["--dataset", "cifar10", "--data-dir", str(tmp_path / "file")])
    _assert_one_line(code, capsys.readouterr().err, "--data-dir {}: exists and is not a "
                                                    "directory".format(tmp_path / "file"))


def _env():
    """This environment, minus conftest's 8-device XLA_FLAGS and any cluster a launcher
    (SLURM, Open MPI) would have described to jax's detection."""
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_"))}
    env["JAX_PLATFORMS"] = "cpu"
    return env


# End to end, as a user's shell sees it: the exit code and the whole of stderr. Each of
# these needs a process of its own: a device count other than conftest's 8, or a
# jax.distributed.initialize before any backend starts.
PROCESS_CASES = [
    ("train_shardmap.py", ["--batch", "0"], "train_shardmap.py: error: --batch must be positive"),
    ("train_pmap.py", ["--fsdp"], "train_pmap.py: error: unrecognized arguments: --fsdp"),
    ("train_pmap.py", ["--cpu-devices", "3"],
     "error: --batch 16 is not divisible by the 3 data-parallel devices"),
    # Device counts past the machine's memory: one line, before XLA creates the devices
    # (which would take minutes, then the machine: the timeout below catches that).
    ("train_shardmap.py", ["--plan", "100000"], "--plan 100,000: this machine holds at most"),
    ("train_pmap.py", ["--cpu-devices", "100000"],
     "--cpu-devices 100,000: this machine holds at most"),
    # Outside SLURM / Open MPI / Cloud TPU, jax's cluster detection finds nothing.
    ("train_shardmap.py", ["--distributed"], "error: --distributed: coordinator_address "
                                             "should be defined"),
]


@pytest.mark.parametrize("script, flags, message", PROCESS_CASES,
                         ids=[f"{s}:{' '.join(f)}" for s, f, _ in PROCESS_CASES])
def test_bad_flag_in_a_real_process(script, flags, message):
    argv = BASE[:BASE.index("--cpu-devices")] + BASE[BASE.index("--cpu-devices") + 2:] + flags
    proc = subprocess.run([sys.executable, script, *argv], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=90)
    _assert_one_line(proc.returncode, proc.stderr, message)
    assert "Traceback" not in proc.stdout


TOOLS = ["benchmarks.bench", "benchmarks.study", "benchmarks.peers.driver",
         "benchmarks.profile_breakdown", "benchmarks.probes.attention_check",
         "benchmarks.probes.bench_data", "benchmarks.probes.bench_randaugment",
         "benchmarks.probes.dropout_masks", "benchmarks.probes.gemm_epilogues",
         "benchmarks.probes.loop_overhead", "benchmarks.probes.matmul_vjp",
         "benchmarks.probes.trace_time", "vit_pure.tools.params_table", "vit_pure.tools.plot"]
POSITIONAL = {"benchmarks.profile_breakdown": ["run.trace.json.gz"],
              "vit_pure.tools.plot": ["run.jsonl"]}


@pytest.mark.parametrize("module", TOOLS)
def test_tools_give_one_line_errors(module, capsys):
    """The benchmarks and the two small tools parse their flags like the training scripts:
    a flag they do not know is one line on stderr and exit code 2, no usage block."""
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main(POSITIONAL.get(module, []) + ["--no-such-flag"])
    _assert_one_line(exit_info.value.code, capsys.readouterr().err,
                     "error: unrecognized arguments: --no-such-flag")


# (tool, flags, what its one line must say): values a tool refuses before it runs anything.
TOOL_CASES = [
    ("benchmarks.bench", ["--accum-steps", "0"], "--accum-steps must be positive, got 0"),
    ("benchmarks.bench", ["--warmup", "-1"], "--warmup must be >= 0"),
    ("benchmarks.bench", ["--cpu-devices", "0"], "--cpu-devices must be positive, got 0"),
    ("benchmarks.bench", ["--cpu-devices", "100000"],
     "--cpu-devices 100,000: this machine holds at most"),
    ("benchmarks.probes.bench_data", ["--runs", "0"], "--runs must be positive, got 0"),
    ("benchmarks.probes.bench_randaugment", ["--batch", "0"], "--batch must be positive, got 0"),
    ("benchmarks.probes.bench_randaugment", ["--magnitude", "11"], "--magnitude in [0, 10]"),
    ("benchmarks.probes.dropout_masks", ["--steps", "0"], "--steps must be positive, got 0"),
    ("benchmarks.probes.gemm_epilogues", ["--batch", "-1"], "--batch must be positive, got -1"),
    ("benchmarks.probes.loop_overhead", ["--bench-steps", "0"], "--bench-steps must be positive"),
    ("benchmarks.probes.loop_overhead", ["--eval-every", "-1"], "--eval-every must be >= 0"),
    ("benchmarks.probes.loop_overhead", ["--dtype", "f33"], "--dtype: unknown dtype 'f33'"),
    ("benchmarks.probes.matmul_vjp", ["--steps", "0"], "--steps must be positive, got 0"),
    ("benchmarks.probes.trace_time", ["--repeats", "0"], "--repeats must be positive, got 0"),
    ("benchmarks.peers.driver", ["--entry-timeout", "nan"], "--entry-timeout must be positive"),
    ("vit_pure.tools.params_table", ["--param-dtype", "f32", "int3"],
     "--param-dtype: unknown dtype"),
]


@pytest.mark.parametrize("module, flags, message", TOOL_CASES,
                         ids=[f"{m}:{' '.join(f)}" for m, f, _ in TOOL_CASES])
def test_tools_refuse_bad_values_in_one_line(module, flags, message, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    _assert_one_line(exit_info.value.code, capsys.readouterr().err, message)


def test_tool_help_is_its_docstring(capsys):
    """A tool's --help opens with its docstring's first paragraph and ends with the rest
    (usage lines, notes) as written."""
    from benchmarks.probes import gemm_epilogues
    with pytest.raises(SystemExit) as exit_info:
        gemm_epilogues.main(["--help"])
    out = capsys.readouterr().out
    head, _, rest = gemm_epilogues.__doc__.strip().partition("\n\n")
    assert exit_info.value.code == 0
    assert head in out and out.rstrip().endswith(rest.rstrip())


def test_device_limit_is_the_memory_over_the_cost(capsys):
    """The bound: SAFETY of the available RAM over the measured cost of one device, for
    fake devices that run (--cpu-devices) and devices the plan compiles for (--plan)."""
    parser = train_shardmap.build_parser()
    gib8 = 8 * 2**30
    assert checks.device_limit(checks.RUN_DEVICE_BYTES, gib8) == 5461  # 0.8 * 8 GiB / 1.2 MiB
    assert checks.device_limit(checks.PLAN_DEVICE_BYTES, gib8) == 26214  # / 0.25 MiB
    for flags, ok in ((["--cpu-devices", "5461"], True), (["--cpu-devices", "5462"], False),
                      (["--plan", "26214"], True), (["--plan", "26215"], False)):
        args = parser.parse_args(flags)
        try:
            checks.check_device_counts(parser, args, available=gib8)
            code = 0
        except SystemExit as e:
            code = e.code
        assert code == (0 if ok else 2), flags
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"{parser.prog}: error: --plan 26,215: this machine holds at most 26,214 devices to "
        "compile the plan for (about 0.25 MiB of host memory each; 80% of its 8.0 GiB "
        "available)")


# A statement of a default in a flag's --help text: "(default: X)", "(default X)",
# "default: X", "Default: X".
_DEFAULT = re.compile(r"(?i)\(default\b|\bdefault:")


@pytest.mark.parametrize("parser", [train_shardmap.build_parser(),
                                    cli.build_parser(train_pmap.__doc__.splitlines()[0])],
                         ids=["train_shardmap", "train_pmap"])
def test_help_gives_every_flag_a_text_and_its_true_default(parser):
    """Every flag of both scripts (those added later too): a help text; a flag that takes
    a value (or --x/--no-x) states its default exactly once, never argparse's
    "(default: None)" (None means "decided later": the text says by what)."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        assert action.help, f"{flag} has no help text"
        text = formatter._expand_help(action)
        assert "None" not in text, (flag, text)
        takes_value = action.nargs != 0 or isinstance(action, argparse.BooleanOptionalAction)
        assert len(_DEFAULT.findall(text)) == (1 if takes_value else 0), (flag, text)
    assert "(default: None)" not in parser.format_help()


@pytest.mark.parametrize("value", ["0.7", "-0.1", "nan"])
def test_val_fraction_out_of_range_is_one_line(value, capsys):
    """--val-fraction outside [0, 0.5] on CIFAR-10 (BASE's synthetic set refuses the flag
    before its range is read)."""
    with pytest.raises(SystemExit) as excinfo:
        cli.parse_args(train_shardmap.build_parser(), ["--val-fraction", value])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"--val-fraction must be in [0, 0.5], got {float(value):g}" in err[-1]


def test_help_names_what_init_from_reads_and_how_image_size_resamples():
    parser = train_shardmap.build_parser()
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    for kind in (".npz", "model.safetensors", "Hugging Face", ".onnx"):
        assert kind in helps["--init-from"], kind
    # weights/tree.py RESAMPLERS: bilinear for big_vision, bicubic for timm and HF
    assert "bilinear for a big_vision .npz, bicubic for timm and Hugging Face" \
        in helps["--image-size"]
    assert weights.tree.RESAMPLERS["timm"].startswith("bicubic")
    assert weights.tree.RESAMPLERS["hf"].startswith("bicubic")
    assert weights.tree.RESAMPLERS["bigvision"].startswith("bilinear")


def test_pool_mean_alone_leaves_the_last_block_to_the_pool():
    args = cli.parse_args(train_shardmap.build_parser(), ["--pool", "mean"])
    assert args.last_block is None and args.cfg.pool == "mean"
