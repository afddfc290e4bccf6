"""The recipe flags: --recipe (explicit flags win), --randaugment /
--mixup parsing, and --eval-only reproducing a run's final test metrics from its checkpoint."""
import json

import pytest

import train_pmap
import train_shardmap
from vit_pure.run import cli

SMALL = ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "64",
         "--synthetic-val", "32", "--synthetic-test", "48", "--batch", "16", "--no-progress",
         "--accum-steps", "1"]


def _parse(argv):
    return cli.parse_args(train_shardmap.build_parser(), argv)


def test_recipe_sets_defaults_and_explicit_flags_win():
    args = _parse(["--recipe", "cpu-quick"])
    for name, value in cli.RECIPES["cpu-quick"].items():
        assert getattr(args, name) == value, name
    args = _parse(["--recipe", "cpu-quick", "--epochs", "3", "--model", "tiny"])
    assert args.epochs == 3 and args.model == "tiny" and args.cfg.name == "tiny"
    assert args.randaugment == cli.RECIPES["cpu-quick"]["randaugment"]


# The command that measured --recipe gpu-small-data (the results table of docs/training.md),
# less --data-dir and --no-progress: the recipe must stay that run.
GPU_SMALL_DATA_RUN = ("--model vit-cifar-quick --dtype bf16 --batch 512 --epochs 2400 --lr 4e-3 "
                      "--randaugment 2,9 --mixup 0.8 --cutmix 1.0 --ema 0.999 "
                      "--mix-off-epochs 240 --accum-steps 1 --eval-every 50 --log-every 500 "
                      "--val-fraction 0 --eval-flip --eval-corners")


# The same for --recipe cpu-quick: the flags of the measured run. It read the
# subset folder, which --subset 4000,1000 reads unchanged (tests/test_data.py).
CPU_QUICK_RUN = ("--model vit-cifar-conv-lsa --dtype auto --batch 128 --epochs 60 --lr 2e-3 "
                 "--warmup-steps 140 --weight-decay 0.05 --label-smoothing 0.1 "
                 "--randaugment 2,5 --ema 0.99 --eval-flip --eval-corners --eval-every 0 "
                 "--val-fraction 0 --cpu-devices 2 --no-scan --accum-steps 1 "
                 "--subset 4000,1000")


# And for --recipe finetune-dinov2-s14, the linear probe measured in docs/training.md.
DINOV2_PROBE_RUN = ("--model vit-s16 --dtype fp32 --image-size 112 --pool cls+mean "
                    "--trainable head --batch 128 --epochs 40 --lr 3e-3 --warmup-steps 10 "
                    "--weight-decay 0 --grad-clip 0 --label-smoothing 0 --randaugment 0 "
                    "--mixup 0 --cutmix 0 --dropout 0 --drop-path 0 --eval-every 10 "
                    "--eval-flip --eval-batch 200 --val-fraction 0 --accum-steps 1")


@pytest.mark.parametrize("recipe_name, run", [("gpu-small-data", GPU_SMALL_DATA_RUN),
                                              ("cpu-quick", CPU_QUICK_RUN),
                                              ("finetune-dinov2-s14", DINOV2_PROBE_RUN)])
def test_recipe_is_the_measured_run(recipe_name, run):
    recipe = vars(_parse(["--recipe", recipe_name]))
    measured = vars(_parse(run.split()))
    differ = {k for k in recipe if k not in ("recipe", "cfg") and recipe[k] != measured[k]}
    assert not differ, {k: (recipe[k], measured[k]) for k in differ}
    assert recipe["cfg"] == measured["cfg"]


@pytest.mark.parametrize("text, expected", [("2,9", (2, 9)), ("0", (0, 0)), ("1,0", (1, 0))])
def test_randaugment_flag(text, expected):
    assert _parse(["--randaugment", text]).randaugment == expected


@pytest.mark.parametrize("text", ["2", "2,11", "a,b", "-1,5"])
def test_bad_randaugment_flag_exits_2(text, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["--randaugment", text])
    assert e.value.code == 2 and "--randaugment" in capsys.readouterr().err


def test_eval_only_reproduces_the_final_test_metrics(tmp_path):
    log = tmp_path / "train.jsonl"
    ckpt = tmp_path / "ckpt"
    train_shardmap.main(SMALL + ["--steps", "2", "--mixup", "0.8", "--cutmix", "1.0",
                                 "--ckpt-dir", str(ckpt), "--log-json", str(log)])
    final = [json.loads(r) for r in log.read_text().splitlines() if '"split": "test"' in r][-1]
    eval_log = tmp_path / "eval.jsonl"
    # Another script, other flags for the model: the checkpoint says what it holds.
    result = train_pmap.main(["--eval-only", "--ckpt-dir", str(ckpt), "--dataset", "synthetic",
                              "--synthetic-train", "64", "--synthetic-val", "32",
                              "--synthetic-test", "48", "--batch", "16",
                              "--log-json", str(eval_log)])
    record = json.loads(eval_log.read_text().splitlines()[-1])
    assert record["split"] == "test" and record["count"] == 48
    assert record["accuracy"] == final["accuracy"]
    assert record["loss"] == pytest.approx(final["loss"], rel=1e-6)
    assert result["test"]["count"] == 48


def test_eval_only_without_checkpoints_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = cli.main_guard(lambda: train_pmap.main(
        ["--eval-only", "--ckpt-dir", str(tmp_path / "empty"), "--dataset", "synthetic"]))
    assert code == 2 and "no intact checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # no folder at all: refused while parsing
        train_pmap.main(["--eval-only", "--ckpt-dir", str(tmp_path / "none")])
    assert e.value.code == 2 and "no such directory" in capsys.readouterr().err
