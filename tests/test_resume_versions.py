"""Resuming a checkpoint of an older kit (run/resume.py `compare`).

The golden checkpoint in tests/data/resume-golden was written by an earlier kit (its
README says which; write.py how): step 3 of the tiny model's 6-step pmap run, with the losses
of that run's steps 4-6. A copy of it, with one field of its stored config removed (a flag
the kit had not yet), resumes and continues those losses; with a field no kit knows it
resumes too; with another model shape it is refused in one line, before compiling.
The field-by-field rule itself is checked on plain dicts below.
"""
import json
import pathlib
import shutil

import numpy as np
import pytest

import train_pmap
from vit_pure.config import get_preset
from vit_pure.policy import Policy
from vit_pure.run import checkpoint, cli, evaluate, loop, resume
from vit_pure.step import StepConfig

GOLDEN = pathlib.Path(__file__).resolve().parent / "data" / "resume-golden"
RECORD = json.loads((GOLDEN / "losses.json").read_text())
STEP = RECORD["resumed_step"]


def golden_copy(dst: pathlib.Path, edit) -> pathlib.Path:
    """The golden checkpoint copied into `dst`, its stored trajectory passed to `edit`
    (which changes it in place). The manifest's checksums cover the arrays, not the meta."""
    name = checkpoint.step_dir_name(STEP)
    shutil.copytree(GOLDEN / name, dst / name)
    manifest_path = dst / name / checkpoint.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    edit(manifest["meta"]["trajectory"])
    manifest_path.write_text(json.dumps(manifest, indent=1))
    checkpoint.verify(dst / name)
    return dst / name


def resume_golden(tmp_path, edit, *extra):
    ckpts, log = tmp_path / "ckpts", tmp_path / "log.jsonl"
    path = golden_copy(ckpts, edit)
    argv = RECORD["flags"] + ["--ckpt-dir", str(ckpts), "--resume", "--log-json", str(log),
                              *extra]
    return path, argv, log


def test_a_checkpoint_that_predates_a_flag_continues_the_run(tmp_path, capsys):
    """The stored config without --layer-decay (as every checkpoint written before the flag
    existed): taken as its default, said in one line, and the run continues the
    uninterrupted run's losses (the golden run's, on this kit)."""
    path, argv, log = resume_golden(tmp_path, lambda t: t.pop("--layer-decay"),
                                    "--no-final-eval")
    train_pmap.main(argv)
    out = capsys.readouterr().out
    assert "--resume: checkpoint predates --layer-decay: taken as 1.0\n" in out, out
    assert f"resumed from {path}: step {STEP}," in out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    got = {str(r["step"]): r["loss"] for r in records if "loss" in r and "split" not in r}
    assert sorted(got) == sorted(RECORD["losses"])
    # Not bitwise: another CPU or XLA may round the sums differently. A wrong resume (the
    # data position, the schedule, the state) moves the loss by far more than this.
    np.testing.assert_allclose([got[k] for k in sorted(got)],
                               [RECORD["losses"][k] for k in sorted(got)], rtol=1e-4)
    assert "None" not in out


def test_a_checkpoint_with_fields_no_kit_knows_resumes_naming_them(tmp_path, capsys):
    def add_unknown(t):
        t["--frobnicate"] = 3
        t["model config"]["frob_depth"] = None

    path, argv, _ = resume_golden(tmp_path, add_unknown, "--stop-after", str(STEP + 1))
    got = train_pmap.main(argv)
    out = capsys.readouterr().out
    assert ("--resume: checkpoint records --frobnicate 3, which this kit does not know: "
            "ignored\n") in out, out
    assert ("--resume: checkpoint records the model config's frob_depth none, which this "
            "kit does not know: ignored\n") in out, out
    assert got["stopped"]["step"] == STEP + 1
    # The hint does not loop: the same command would stop at the same step again.
    assert (f"stopped by --stop-after after step {STEP + 1}; checkpoint "
            f"{path.parent / checkpoint.step_dir_name(STEP + 1)}; run the same command with "
            f"--resume and without --stop-after (or with a later step) to continue") in out


@pytest.fixture
def compile_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled a step for a checkpoint it must refuse")
    monkeypatch.setattr(loop.accum, "build_strategy", refuse)


@pytest.mark.parametrize("stop_after", [STEP - 1, STEP])
def test_stop_after_at_or_below_the_resumed_step_is_refused_before_compiling(
        stop_after, tmp_path, capsys, compile_nothing):
    path, argv, _ = resume_golden(tmp_path, lambda t: None, "--stop-after", str(stop_after))
    assert cli.main_guard(lambda: train_pmap.main(argv)) == 2
    assert capsys.readouterr().err == (
        f"error: --stop-after {stop_after}: {path} is at step {STEP} already; drop "
        f"--stop-after (or give a later step) to continue the run\n")


def test_a_checkpoint_of_another_model_shape_is_refused_in_one_line(tmp_path, capsys,
                                                                     compile_nothing):
    path, argv, _ = resume_golden(tmp_path, lambda t: t["model config"].update(width=32))
    assert cli.main_guard(lambda: train_pmap.main(argv)) == 2
    err = capsys.readouterr().err
    assert err == (f"error: cannot resume from {path}: model config differs in width "
                   f"(checkpoint 32, this run 24)\n")


# --------------------------------------------------------------------------- the rule
NOW = {"--lr": 0.001, "--layer-decay": 1.0, "--warmup-steps": 3, "--dropout-masks": "bernoulli",
       "--init-from": None,
       "model config": {"width": 24, "registers": 0, "layer_scale": None},
       "total steps": 60}
DEFAULTS = {"--lr": 1e-3, "--layer-decay": 1.0, "--warmup-steps": None,
            "--dropout-masks": None, "--init-from": None}
NONE_MEANS = {"--warmup-steps": 3, "--dropout-masks": "bernoulli"}


def compare(saved, now=NOW):
    return resume.compare(saved, now, defaults=DEFAULTS, none_means=NONE_MEANS)


def without(d, *keys):
    return {k: v for k, v in d.items() if k not in keys}


def test_same_trajectory_has_no_notes():
    assert compare(NOW) == (None, [])


def test_a_missing_flag_takes_its_default_and_a_missing_resolved_flag_what_none_means():
    assert compare(without(NOW, "--layer-decay", "--warmup-steps")) == (None, [
        "checkpoint predates --layer-decay: taken as 1.0",
        "checkpoint predates --warmup-steps: taken as not given (3)"])


def test_a_missing_flag_whose_default_is_not_this_runs_value_is_refused():
    difference, notes = compare(without(NOW, "--layer-decay"), {**NOW, "--layer-decay": 0.75})
    assert difference == ("--layer-decay differs (checkpoint predates it: taken as 1.0, "
                          "this run 0.75)") and notes == []


def test_a_recorded_none_equals_the_value_it_resolves_to():
    """An older kit recorded the text given (None: not given); this one records the value
    the run used: the same run either way."""
    assert compare({**NOW, "--warmup-steps": None, "--dropout-masks": None}) == (None, [])
    difference, _ = compare({**NOW, "--dropout-masks": None},
                            {**NOW, "--dropout-masks": "threefry16"})
    assert difference == ("--dropout-masks differs (checkpoint not given ('bernoulli'), "
                          "this run 'threefry16'); give --dropout-masks bernoulli to continue "
                          "it")
    # A run on another backend, whose default masks are another kind: the line says how.
    difference, _ = compare({**NOW, "--dropout-masks": "threefry16"})
    assert difference == ("--dropout-masks differs (checkpoint 'threefry16', this run "
                          "'bernoulli'); give --dropout-masks threefry16 to continue it")


def test_a_missing_model_field_takes_the_models_default():
    saved = {**NOW, "model config": without(NOW["model config"], "registers")}
    assert compare(saved) == (None, ["checkpoint predates the model config's registers: "
                                     "taken as 0"])
    difference, _ = compare(saved, {**NOW, "model config": {**NOW["model config"],
                                                            "registers": 4}})
    assert difference == ("model config differs in registers (checkpoint predates it: "
                          "taken as 0, this run 4)")


def test_a_model_field_without_a_default_is_refused_when_missing_without_printing_none():
    saved = {**NOW, "model config": without(NOW["model config"], "width")}
    difference, _ = compare(saved)
    assert difference == "model config differs in width (checkpoint absent, this run 24)"


@pytest.mark.parametrize("saved, now, want", [
    ({**NOW, "--init-from": "vit.npz"}, NOW,
     "--init-from differs (checkpoint 'vit.npz', this run not given)"),
    ({**NOW, "model config": {**NOW["model config"], "layer_scale": 0.1}}, NOW,
     "model config differs in layer_scale (checkpoint 0.1, this run none)"),
    (without(NOW, "total steps"), NOW, "total steps differs (checkpoint absent, this run 60"),
])
def test_differences_never_print_none(saved, now, want):
    difference, _ = compare(saved, now)
    assert difference.startswith(want) and "None" not in difference, difference


def test_unknown_fields_are_named_and_ignored_resumable_ones_silently():
    saved = {**NOW, "--frobnicate": 2, "--efficiency": 0.3,
             "model config": {**NOW["model config"], "frob": True}}
    assert compare(saved) == (None, [
        "checkpoint records the model config's frob True, which this kit does not know: "
        "ignored",
        "checkpoint records --frobnicate 2, which this kit does not know: ignored"])


def test_every_flag_default_is_known():
    """flag_defaults covers the flags a trajectory compares: a checkpoint that predates any
    of them resumes."""
    defaults = resume.flag_defaults()
    assert defaults["--layer-decay"] == 1.0 and defaults["--warmup-steps"] is None
    assert defaults["--randaugment"] == [2, 9]
    golden = checkpoint.read_meta(GOLDEN / checkpoint.step_dir_name(STEP))["trajectory"]
    compared = [k for k in golden if k.startswith("--")
                and k[2:].replace("-", "_") not in resume.RESUMABLE_ACROSS]
    assert compared and all(k in defaults for k in compared)


def test_eval_only_reads_the_model_config_of_another_kit_version():
    """--eval-only builds the model from the checkpoint's config: a field it predates at
    its default, one no kit knows left out."""
    meta = checkpoint.read_meta(GOLDEN / checkpoint.step_dir_name(STEP))
    saved = {k: v for k, v in meta["model_config"].items() if k != "registers"}
    meta = {**meta, "model_config": {**saved, "frob_depth": 3}}
    sc = StepConfig(get_preset("vit-cifar"), Policy())
    assert evaluate.saved_step_config(meta, sc).cfg == get_preset("tiny")
