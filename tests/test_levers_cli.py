"""Bad values of the small-data levers (--ema, --mix-off-epochs, --repeat-aug): one line on
stderr naming the flag, exit 2, before anything compiles (tests/test_cli_errors.py's rule
for every other flag; these cases live here, beside the levers' own tests/test_levers.py)."""
import pytest

import train_pmap
import train_shardmap
from vit_pure import cli

BASE = ["--model", "tiny", "--steps", "1", "--batch", "16", "--no-final-eval",
        "--no-progress", "--randaugment", "0", "--accum-steps", "1",
        "--dataset", "synthetic", "--synthetic-train", "64", "--synthetic-val", "16",
        "--synthetic-test", "16"]

CASES = [
    (["--ema", "-0.1"], "--ema must be a decay in [0, 1) (0: off), got -0.1"),
    (["--ema", "1"], "--ema must be a decay in [0, 1) (0: off), got 1.0"),
    (["--ema", "1.5"], "--ema must be a decay in [0, 1)"),
    (["--ema", "nan"], "--ema must be a decay in [0, 1)"),
    (["--ema", "inf"], "--ema must be a decay in [0, 1)"),
    (["--ema", "x"], "argument --ema: invalid float value: 'x'"),
    (["--mix-off-epochs", "-1", "--mixup", "0.8"], "--mix-off-epochs must be >= 0, got -1"),
    (["--mix-off-epochs", "2"], "--mix-off-epochs 2: there is no mixing to turn off"),
    (["--mix-off-epochs", "5", "--epochs", "5", "--cutmix", "1"],
     "--mix-off-epochs 5 must be less than --epochs 5"),
    (["--mix-off-epochs", "1.5"], "argument --mix-off-epochs: invalid int value: '1.5'"),
    (["--repeat-aug", "0"], "--repeat-aug must be >= 1, got 0"),
    (["--repeat-aug", "-3"], "--repeat-aug must be >= 1, got -3"),
    (["--repeat-aug", "3"], "--repeat-aug 3 does not divide --batch 16"),
    (["--repeat-aug", "two"], "argument --repeat-aug: invalid int value: 'two'"),
]


@pytest.mark.parametrize("script", [train_shardmap, train_pmap], ids=["shardmap", "pmap"])
@pytest.mark.parametrize("flags, message", CASES, ids=[" ".join(f) for f, _ in CASES])
def test_bad_lever_value_is_one_line_and_exit_2(script, flags, message, capsys):
    try:
        code = cli.main_guard(lambda: script.main(BASE + flags))
    except SystemExit as e:  # argparse and the parse_args checks exit 2 themselves
        code = e.code
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], (code, lines)


def test_good_lever_values_parse():
    args = cli.parse_args(train_shardmap.build_parser(), BASE + [
        "--ema", "0.999", "--mixup", "0.8", "--epochs", "3", "--mix-off-epochs", "2",
        "--repeat-aug", "4"])
    assert (args.ema, args.mix_off_epochs, args.repeat_aug) == (0.999, 2, 4)
    defaults = cli.parse_args(cli.build_parser("train_pmap.py's flags"), BASE)
    assert (defaults.ema, defaults.mix_off_epochs, defaults.repeat_aug) == (0.0, 0, 1)
