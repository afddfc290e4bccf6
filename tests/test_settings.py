"""The flags become frozen values at the entry, and nothing below the entry reads them.

`RunConfig.from_args` and `step_config` (vit_pure/run/settings.py) turn the parsed
command line into two frozen values; the loop, resume, accumulation, evaluation and the
step take those. These tests pin the conversion to the parser's defaults and keep the
argparse Namespace out of the modules below the entry.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

import train_shardmap
from vit_pure.config import Execution
from vit_pure.policy import Policy
from vit_pure.run import cli, settings
from vit_pure.run.settings import PlanConfig, RunConfig
from vit_pure.step import OptimConfig, StepConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The modules that may read the parsed flags: the scripts' entry (cli parses them, checks
# refuses bad values, settings turns them into frozen values: RunConfig, PlanConfig and
# the step's StepConfig; entry hands them to the plan or the loop) and the stand-alone
# tools with parsers of their own.
ENTRY = {"vit_pure/run/cli.py", "vit_pure/run/checks.py", "vit_pure/run/settings.py",
         "vit_pure/run/entry.py",
         "vit_pure/tools/plot.py", "vit_pure/tools/params_table.py",
         "vit_pure/tools/export.py", "vit_pure/tools/price_collective.py"}


def _parse(*argv):
    return cli.parse_args(train_shardmap.build_parser(), list(argv))


def test_defaults_are_the_parsers():
    """What a user gets with no flags: the parser's defaults, carried unchanged."""
    args = _parse()
    rc = RunConfig.from_args(args)
    data, schedule, logging = rc.data, rc.schedule, rc.logging
    assert (schedule.batch, data.eval_batch, schedule.epochs, data.seed) == (128, 128, 200, 0)
    assert schedule.accum_steps == "auto" and logging.final_eval and logging.progress
    assert not rc.checkpoints.resume
    assert rc.data.synthetic_sizes == () and rc.logging.profile_range is None
    # OptimConfig's own defaults (tests build it bare) are the parser's.
    assert rc.schedule.optim == OptimConfig() == OptimConfig(args.lr, args.weight_decay,
                                                    args.warmup_steps)
    assert dict(rc.flags)["model"] == "vit-cifar" and dict(rc.flags)["batch"] == 128


def test_flags_reach_the_settings():
    rc = RunConfig.from_args(_parse(
        "--batch", "64", "--eval-batch", "32", "--dataset", "synthetic", "--synthetic-train",
        "96", "--lr", "0.01", "--warmup-steps", "3", "--no-final-eval", "--no-progress",
        "--profile", "/tmp/p", "--profile-steps", "2:4", "--accum-steps", "2",
        "--mix-off-epochs", "5", "--mixup", "0.8", "--repeat-aug", "2"))
    data, schedule, logging = rc.data, rc.schedule, rc.logging
    assert (schedule.batch, data.eval_batch) == (64, 32)
    assert (schedule.accum_steps, data.repeat_aug) == (2, 2)
    assert rc.data.dataset_sizes == {"n_train": 96}
    assert rc.schedule.optim == OptimConfig(lr=0.01, weight_decay=0.05, warmup_steps=3)
    assert not logging.final_eval and not logging.progress and logging.profile_range == (2, 4)
    assert rc.schedule.mix_off_epochs == 5
    # The record a checkpoint keeps: JSON values, tuples as lists.
    assert dict(rc.flags)["profile_range"] == [2, 4]


def test_settings_are_frozen():
    rc = RunConfig.from_args(_parse())
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.schedule.batch = 1  # type: ignore[misc]


def _reads_args(path: pathlib.Path) -> list[int]:
    """Lines where a module uses a name `args` (a parameter, a variable, an attribute of
    it) other than as a keyword argument (`threading.Thread(args=...)`)."""
    tree = ast.parse(path.read_text())
    return sorted({node.lineno for node in ast.walk(tree)
                   if (isinstance(node, ast.Name) and node.id == "args")
                   or (isinstance(node, ast.arg) and node.arg == "args")})


def test_nothing_below_the_entry_reads_the_namespace():
    """The loop, resume, accumulation, evaluation, checkpoints, the step, the model...:
    none takes or reads `args`. A new `def f(args, ...)` below the entry fails here."""
    below = [p for p in sorted((ROOT / "vit_pure").rglob("*.py"))
             if str(p.relative_to(ROOT)) not in ENTRY]
    assert len(below) > 20  # the walk found the package
    offenders = {str(p.relative_to(ROOT)): lines for p in below if (lines := _reads_args(p))}
    assert offenders == {}


def test_the_check_sees_an_args_parameter(tmp_path):
    """The static check above can fail: it finds both a parameter and a read."""
    bad = tmp_path / "bad.py"
    bad.write_text("def run(args, sc):\n    return args.batch\n")
    assert _reads_args(bad) == [1, 2]


def test_slices_carry_the_settings():
    """rc.data / .schedule / .logging / .checkpoints: RunConfig's values, each in one slice
    (no field is repeated), frozen."""
    rc = RunConfig.from_args(_parse("--batch", "64", "--seed", "3", "--steps", "9",
                                    "--log-every", "7", "--ckpt-dir", "/tmp/ck",
                                    "--ckpt-every", "5"))
    assert (rc.data.seed, rc.data.dataset) == (3, "cifar10")
    assert (rc.schedule.batch, rc.schedule.steps, rc.schedule.optim.lr) == (64, 9, 1e-3)
    assert (rc.logging.log_every, rc.logging.final_eval) == (7, True)
    assert (rc.checkpoints.ckpt_dir, rc.checkpoints.ckpt_every) == ("/tmp/ck", 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rc.schedule.batch = 1  # type: ignore[misc]
    assert not hasattr(rc.data, "ckpt_dir") and not hasattr(rc.checkpoints, "batch")
    names = [f.name for s in (rc.data, rc.schedule, rc.logging, rc.checkpoints)
             for f in dataclasses.fields(s)]
    assert len(names) == len(set(names)), names


def test_plan_config_is_the_plan_flags():
    pc = PlanConfig.from_args(_parse("--plan", "64", "--hardware", "a100", "--batch", "256",
                                     "--efficiency", "0.5", "--accum-steps", "2"))
    assert (pc.plan, pc.hardware, pc.batch, pc.efficiency, pc.accum_steps) == (
        64, "a100", 256, 0.5, 2)
    assert pc.optim == OptimConfig() and not pc.multi_process
    with pytest.raises(dataclasses.FrozenInstanceError):
        pc.plan = 8  # type: ignore[misc]


def test_loop_helpers_take_a_slice():
    """In run/loop.py only `run`, `_run` and its setup (`_set_up`, `_build_strategy`: they
    hand the rest to resume and accumulation) take the whole RunConfig; every other helper
    is given the slice it needs."""
    tree = ast.parse((ROOT / "vit_pure/run/loop.py").read_text())
    whole = sorted(node.name for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef)
                   and any(isinstance(a.annotation, ast.Name) and a.annotation.id == "RunConfig"
                           for a in node.args.args))
    assert whole == ["_build_strategy", "_run", "_set_up", "run"]


# Each execution knob's flag, and the words its --help uses for the default on a CPU.
_EXECUTION_FLAGS = {"scan": ("--scan", "{}"), "remat": ("--remat", "default: {}"),
                    "attention": ("--attention", "else {}"),
                    "dropout_masks": ("--dropout-masks", "{} on CPU"),
                    "last_block": ("--last-block", "default: {}"),
                    "biases": ("--biases", "default: {}"),
                    "fc1_output": ("--fc1-output", "default: {}"),
                    "layer_norm": ("--layer-norm", "default: {}"),
                    "qkv_data_grads": ("--qkv-data-grads", "default: {}")}


def _help_of(parser, flag: str) -> str:
    action = next(a for a in parser._actions if flag in a.option_strings)
    return " ".join((action.help % vars(action)).split())


def test_execution_defaults_live_in_one_place(capsys):
    """`config.Execution`'s defaults are what a run without flags computes: the flags only
    say "not given" (None), --help prints Execution's default, the step built from no flags
    on a CPU is `Execution()` exactly, and the start-up log says so. A default changed in
    one place and not the others fails here."""
    parser = train_shardmap.build_parser()
    args = cli.parse_args(parser, ["--model", "tiny"])
    default = Execution()
    for field, (flag, words) in _EXECUTION_FLAGS.items():
        assert getattr(args, field) is None, flag  # "not given"
        value = getattr(default, field)
        shown = ("unrolled" if not value else "scanned") if field == "scan" else value
        assert words.format(shown) in _help_of(parser, flag), (flag, _help_of(parser, flag))
    assert settings.step_config(args, platform="cpu").execution == default
    # A StepConfig built directly (as the equality tests do) runs that same program.
    assert StepConfig(args.cfg, Policy()).execution == default
    train_shardmap.main(["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "8",
                         "--synthetic-val", "0", "--synthetic-test", "0", "--batch", "8",
                         "--steps", "1", "--randaugment", "0", "--no-final-eval",
                         "--no-progress"])
    assert f"execution: {default.describe()}" in capsys.readouterr().out
