"""benchmarks/gpu_accuracy.py, the accuracy check of a GPU loan, cannot rot between loans:
every run's flags parse with the training script's parser (`--dry-run`), the default runs
fit the loan's six minutes and hold the validation images out, and the figures are read
from a run's JSON log as the training script writes it."""
from __future__ import annotations

import json

import pytest

import train_shardmap
from benchmarks import gpu_accuracy
from vit_pure.errors import UsageError
from vit_pure.run import cli


def test_the_dry_run_parses_every_run(tmp_path, capsys):
    names = ",".join(gpu_accuracy.BY_NAME)
    assert gpu_accuracy.main(["--out", str(tmp_path), "--dry-run", "--only", names]) == 0
    record = json.loads((tmp_path / "gpu_accuracy.json").read_text())
    assert list(record["runs"]) == list(gpu_accuracy.BY_NAME) and record["dry_run"]
    for name, run in record["runs"].items():
        assert run["status"] == "flags parsed", name
        assert run["command"][1] == "train_shardmap.py" and "--log-json" in run["command"]
    summary = (tmp_path / "summary.md").read_text()
    assert "| dinov2 | finetune-dinov2-s14-gpu, 400 held out |" in summary
    assert "small-data-long: flags parsed" in capsys.readouterr().out


def test_the_default_runs_fit_the_loan_and_hold_out_the_validation_images():
    default = [r for r in gpu_accuracy.RUNS if r.default]
    assert sum(r.limit_s for r in default) <= gpu_accuracy.BUDGET_S == 360
    assert {r.name for r in default} == {"dinov2", "dinov2-first", "small-data"}
    for run in default:
        args = cli.parse_args(train_shardmap.build_parser(), list(run.flags))
        assert args.val_fraction == 0.1, run.name


def test_the_first_dinov2_recipe_differs_from_the_shipped_one_where_it_says():
    """The comparison run keeps the first recipe's flags; the shipped recipe changed these."""
    first = vars(cli.parse_args(train_shardmap.build_parser(),
                                gpu_accuracy.FIRST_DINOV2.split()))
    shipped = vars(cli.parse_args(train_shardmap.build_parser(),
                                  ["--recipe", "finetune-dinov2-s14-gpu"]))
    differ = {k for k in shipped if k not in ("recipe", "cfg") and shipped[k] != first[k]}
    assert differ == {"image_size", "epochs", "warmup_steps", "layer_decay", "randaugment",
                      "mixup", "cutmix", "ema", "eval_corners", "val_fraction"}
    assert (first["image_size"], first["layer_decay"], first["epochs"]) == (224, 0.75, 50)


def test_flags_that_do_not_parse_are_refused_in_one_line():
    bad = gpu_accuracy.Run("bad", "x", ("--recipe", "gpu-small-data", "--epochs", "many"), 1,
                           False)
    argv = gpu_accuracy.command(bad, "data", None, gpu_accuracy.harness.REPO)
    with pytest.raises(UsageError, match="bad: its flags do not parse"):
        gpu_accuracy.check_flags(bad, argv)


@pytest.mark.parametrize("argv, message", [
    (["--only", "dinov2,nope"], "--only dinov2,nope: unknown run nope"),
    (["--init-from", "/nonexistent/dinov2"], "no such file or folder"),
    (["--data-dir", "/nonexistent/data"], "--data-dir /nonexistent/data: no such folder"),
])
def test_bad_input_exits_2_in_one_line(argv, message, tmp_path, capsys):
    code = cli.main_guard(lambda: gpu_accuracy.main(["--out", str(tmp_path), *argv]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err


def test_the_dinov2_runs_are_skipped_without_weights(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    gpu_accuracy.main(["--out", str(tmp_path / "out"), "--data-dir", str(data), "--only",
                       "dinov2,dinov2-first"])
    record = json.loads((tmp_path / "out" / "gpu_accuracy.json").read_text())
    assert {r["status"] for r in record["runs"].values()} == {"skipped: no --init-from"}


def test_figures_are_read_from_the_json_log(tmp_path):
    """Lines as train_shardmap.py --log-json writes them (a DINOv2 fine-tune's, cut), the
    last one cut short by a time limit."""
    lines = [
        {"event": "compiled", "what": "the training step", "compile_s": 26.4},
        {"step": 50, "epoch": 1, "loss": 1.8, "images_per_s": 4866.5},
        {"step": 100, "epoch": 3, "loss": 1.4, "images_per_s": 5552.9},
        {"step": 150, "epoch": 5, "loss": 0.9, "images_per_s": 5583.7},
        {"split": "val", "eval_flip": True, "step": 280, "accuracy": 0.925, "count": 400},
        {"event": "compiled", "what": "the unmixed step", "compile_s": 3.6},
        {"event": "memory", "step": 1400, "device_peak_bytes_in_use_max": 6030629376},
        {"split": "val", "weights": "ema", "step": 1400, "accuracy": 0.95, "count": 400},
        {"split": "test", "weights": "ema", "step": 1400, "accuracy": 0.936, "count": 1000},
    ]
    log = tmp_path / "run.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"step": 14')
    got = gpu_accuracy.figures(log)
    assert (got["test"], got["val"], got["test_step"], got["weights"]) == \
        (0.936, 0.95, 1400, "ema")
    assert (got["compile_s"], got["images_per_s"], got["peak_gib"]) == (30.0, 5553, 5.62)
    assert gpu_accuracy.figures(tmp_path / "missing.jsonl") == {}
