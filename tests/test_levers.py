"""The small-data levers do what their flags say (docs/training.md, "Levers for small data").

* `--ema DECAY`: after K steps the EMA is the closed-form weighted average of the params
  trajectory; it is the same under data parallel, tensor parallel, FSDP and a pipeline;
  evaluation reports it; it is checkpointed, and a resumed run continues it bitwise;
  `--eval-only` evaluates it.
* `--mix-off-epochs N`: the steps of the last N epochs run the unmixed train step (one-hot
  targets), the earlier ones the mixed step; each step variant compiles once.
* `--repeat-aug R`: each batch holds R copies of batch/R distinct images, each copy with
  its own augmentation, and the step does not depend on the device count.
* `--eval-flip`: evaluation scores each image by the mean of its logits and its mirror
  image's; the result is the same for an image and its mirror, and the same under tensor
  parallel and a pipeline as on one device.
* `--eval-corners`: four corner crops of each image join the views (ten with the flip).

Small model (tiny, depth 2, as tests/test_layout_matrix.py) and few steps.
"""
import dataclasses
import math
import shutil

import jax
import numpy as np
import pytest
from test_layout_matrix import CFG, FAST, tolerances

import train_shardmap as ts
from vit_pure import apply, step
from vit_pure.data import cifar10 as data
from vit_pure.policy import Policy
from vit_pure.run import checkpoint, loop, settings
from vit_pure.run.settings import RunConfig

DECAY = 0.9
BATCH, R, STEPS = 16, 2, 3
POLICY = Policy.parse("fp32")
# No dropout: the levers do not touch it, and the model compiles in about half the time.
MODEL = CFG.replace(dropout=0.0, drop_path=0.0)
SC = step.StepConfig(MODEL, POLICY, mixup_alpha=0.8, ema_decay=DECAY)
SPLITS = data.synthetic_cifar10(n_train=64, n_val=16, n_test=16, seed=0)


def _optimizer():
    return step.make_optimizer(step.OptimConfig(warmup_steps=1), STEPS)[0]


def _batches():
    """STEPS global batches as the loop draws them with --repeat-aug R."""
    batches = data.train_batches(SPLITS["train"], BATCH, seed=0, epoch=0, repeat=R)
    return [(images, labels, np.arange(BATCH, dtype=np.int32), step.step_key(0, 0, i))
            for i, (images, labels) in zip(range(STEPS), batches)]


def _leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


@dataclasses.dataclass
class Run:
    losses: list
    params: list  # host params before the first step and after each step
    ema: dict


_RUNS = {}


def run(mesh: str, fsdp: bool = False, devices: int = 8) -> Run:
    """STEPS steps of SC (EMA on, mixup on, repeated batches) under one layout."""
    if (mesh, fsdp, devices) in _RUNS:
        return _RUNS[mesh, fsdp, devices]
    optimizer = _optimizer()
    strategy = ts.ShardMapStrategy(SC, optimizer, mesh, fsdp=fsdp,
                                   devices=jax.devices()[:devices])
    host = jax.device_get(step.init_state(jax.random.key(0), MODEL, POLICY, optimizer,
                                          ema=True))
    state, compiled = strategy.put_state(host), None
    losses, params = [], [host["params"]]
    for images, labels, ids, key in _batches():
        args = (state, *strategy.put_batch(images, labels, ids), strategy.put_replicated(key))
        compiled = compiled or strategy.train_step.lower(*args).compile(FAST)
        state, metrics = compiled(*args)
        losses.append(strategy.metrics_to_host(metrics)["loss"])
        params.append(strategy.host_state(state)["params"])
    _RUNS[mesh, fsdp, devices] = Run(losses, params, strategy.host_state(state)["ema"])
    return _RUNS[mesh, fsdp, devices]


# --------------------------------------------------------------------------------- EMA
def test_ema_is_the_closed_form_average_of_the_params_trajectory():
    """ema_K = w_0 p_0 + sum_t w_t p_t, w_t = (1 - d_{t-1}) prod_{s >= t} d_s, with the
    warmed-up decays d_t = min(DECAY, (1 + t) / (10 + t)) for t = 0..K-1."""
    got = run("data=8")
    d = [min(DECAY, (1 + t) / (10 + t)) for t in range(STEPS)]
    weights = [math.prod(d)] + [(1 - d[t - 1]) * math.prod(d[t:]) for t in range(1, STEPS + 1)]
    assert sum(weights) == pytest.approx(1.0)
    assert [float(step.ema_decay_at(DECAY, t)) for t in range(STEPS)] == pytest.approx(d)
    want = [sum(w * p for w, p in zip(weights, leaf))
            for leaf in zip(*(_leaves(p) for p in got.params))]
    for g, w, last in zip(_leaves(got.ema), want, _leaves(got.params[-1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * max(1.0, np.abs(w).max()))
    # ... and it is an average, not the last params (the params moved).
    assert max(np.abs(g - p).max() for g, p in zip(_leaves(got.ema),
                                                   _leaves(got.params[-1]))) > 1e-5


# The pipeline is the layout whose EMA update runs per stage; tp and fsdp split it as they
# split the params (the layout matrix's claim): the wider sweep (`-m exhaustive`).
@pytest.mark.parametrize("mesh, fsdp", [
    pytest.param("data=4,model=2", False, id="tp", marks=pytest.mark.exhaustive),
    pytest.param("data=8", True, id="fsdp", marks=pytest.mark.exhaustive),
    pytest.param("data=4,pipe=2", False, id="pp")])
def test_ema_under_tensor_parallel_fsdp_and_pipeline_equals_data_parallel(mesh, fsdp):
    """The EMA is laid out like the params (split over 'model' / 'data' / 'pipe' like them) and
    updated elementwise; it matches data parallel as the params do (test_layout_matrix's
    tolerance, relative to how far the params moved)."""
    ref, got = run("data=8"), run(mesh, fsdp)
    tol_metrics, tol_params = tolerances(POLICY)
    assert got.losses == pytest.approx(ref.losses, rel=tol_metrics)
    moved = math.dist(np.concatenate([x.ravel() for x in _leaves(ref.ema)]),
                      np.concatenate([x.ravel() for x in _leaves(ref.params[0])]))
    diff = math.dist(np.concatenate([x.ravel() for x in _leaves(got.ema)]),
                     np.concatenate([x.ravel() for x in _leaves(ref.ema)]))
    assert moved > 0 and diff <= tol_params * moved


def test_ema_state_is_sharded_like_the_params():
    strategy = ts.ShardMapStrategy(SC, _optimizer(), "data=4,model=2", fsdp=True)
    assert strategy.state_specs["ema"] == strategy.param_specs
    off = ts.ShardMapStrategy(dataclasses.replace(SC, ema_decay=0.0), _optimizer(), "data=8")
    assert "ema" not in off.state_specs


# ----------------------------------------------------------------------- repeated aug
def test_repeated_batches_hold_r_copies_of_batch_over_r_images():
    n = len(SPLITS["train"])
    plain = list(data.train_batches(SPLITS["train"], BATCH, seed=0, epoch=1))
    rep = list(data.train_batches(SPLITS["train"], BATCH, seed=0, epoch=1, repeat=4))
    assert len(rep) == len(plain) == n // BATCH  # an epoch keeps its step count
    m = BATCH // 4
    seen = []
    for images, labels in rep:
        for r in range(1, 4):  # block r repeats block 0, row for row
            np.testing.assert_array_equal(images[r * m:(r + 1) * m], images[:m])
            np.testing.assert_array_equal(labels[r * m:(r + 1) * m], labels[:m])
        seen += [im.tobytes() for im in images[:m]]
    assert len(set(seen)) == len(seen) == n // BATCH * m  # distinct images: about N/R
    # The distinct images are the epoch's permutation, in order: the R = 1 batches' rows.
    first = np.concatenate([x for x, _ in plain])[:len(seen)]
    assert [im.tobytes() for im in first] == seen
    # A resumed epoch (start) gets the same batches.
    tail = list(data.train_batches(SPLITS["train"], BATCH, seed=0, epoch=1, start=2, repeat=4))
    np.testing.assert_array_equal(tail[0][0], rep[2][0])


def test_repeated_copies_get_distinct_augmentations():
    """Every copy has its own global example id, so its own flip / crop (and RandAugment):
    no two copies of an image come out the same; mixup partners (2k, 2k+1) are different
    images."""
    images, labels, ids, key = _batches()[0]
    sc = dataclasses.replace(SC, mixup_alpha=0.0)  # flip + crop
    out = np.asarray(jax.jit(lambda x, k: step.prepare_batch(sc, x, labels, ids, k)[0])(
        images, key))
    m = BATCH // R
    for i in range(m):
        assert np.abs(out[i] - out[i + m]).max() > 1e-3, i
    assert all(not np.array_equal(images[2 * k], images[2 * k + 1]) for k in range(BATCH // 2))


def test_repeated_augmentation_step_is_the_same_on_1_and_8_devices():
    """The same repeated, mixed batches (and the EMA) on 1 and 8 fake devices."""
    one, eight = run("data=1", devices=1), run("data=8")
    tol_metrics, tol_params = tolerances(POLICY)
    assert eight.losses == pytest.approx(one.losses, rel=tol_metrics)
    for a, b in zip(_leaves(eight.params[-1]), _leaves(one.params[-1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------ mix schedule
def test_unmixed_variant_sees_one_hot_targets_and_the_mixed_one_mixed_targets():
    images, labels, ids, key = _batches()[0]
    def targets(sc):
        return np.asarray(jax.jit(lambda x, k: step.prepare_batch(sc, x, labels, ids, k)[1])(
            images, key))

    on = targets(dataclasses.replace(SC, label_smoothing=0.0))
    off = targets(dataclasses.replace(SC, label_smoothing=0.0, mixup_alpha=0.0))
    np.testing.assert_array_equal(off, np.eye(10, dtype=np.float32)[labels])
    assert np.sum(on.max(axis=1) < 0.99) >= BATCH // 2


def test_mix_schedule_switches_for_the_last_n_epochs():
    plan = loop.StepPlan(batch=8, steps_per_epoch=5, total_steps=23, epochs=5, log_every=1)

    class Fake:
        sc, train_step = SC, "mixed"

    built = []

    def make(sc):
        built.append(sc)
        return type("Unmixed", (), {"sc": sc, "train_step": "unmixed"})

    rc = RunConfig.from_args(ts.cli.parse_args(ts.build_parser(),
                                               ["--mix-off-epochs", "2", "--mixup", "0.8"]))
    mixing = loop.MixSchedule(rc.schedule, SC, plan, make, log=lambda *a, **k: None)
    variants = [mixing.train_step(Fake, s) for s in range(23)]
    assert variants == ["mixed"] * 15 + ["unmixed"] * 8  # epochs 4 and 5 (the last, short)
    assert len(built) == 1 and built[0].mixup_alpha == built[0].cutmix_alpha == 0.0
    assert dataclasses.replace(built[0], mixup_alpha=SC.mixup_alpha) == SC
    none = loop.MixSchedule(dataclasses.replace(rc.schedule, mix_off_epochs=0), SC, plan, make,
                            log=lambda *a, **k: None)
    assert all(none.mixes_at(s) for s in range(23))


# ---------------------------------------------------- the loop: evaluated, checkpointed
BASE = ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "80",
        "--synthetic-val", "16", "--synthetic-test", "16", "--steps", "6", "--batch", "16",
        "--no-progress", "--eval-every", "0", "--accum-steps", "1", "--randaugment", "0",
        "--mesh", "data=8",
        "--ema", "0.8", "--mixup", "0.8", "--epochs", "2", "--mix-off-epochs", "1",
        "--repeat-aug", "2", "--eval-flip"]


@pytest.fixture(autouse=True)
def small_model(monkeypatch):
    """--model tiny runs as MODEL (depth 2, no dropout): half the compile time."""
    monkeypatch.setattr(ts.cli, "get_preset", lambda name: MODEL)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps (2 epochs of 5 and 1 step: the second one unmixed), checkpointed each step;
    the strategies it built, and the mixing of each trace of the gradient step (Python
    runs `local_grads` only while tracing: once per compiled variant)."""
    root = tmp_path_factory.mktemp("levers")
    built, traced = [], []
    make, local_grads = ts.ShardMapStrategy, step.local_grads

    def spy(*a, **k):
        built.append(make(*a, **k))
        return built[-1]

    def tracing(sc, *a, **k):
        traced.append(sc.mixup_alpha)
        return local_grads(sc, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ts.cli, "get_preset", lambda name: MODEL)  # (the module fixture's own)
        mp.setattr(ts, "ShardMapStrategy", spy)
        mp.setattr(step, "local_grads", tracing)
        result = ts.main(BASE + ["--ckpt-dir", str(root / "ckpt"), "--ckpt-every", "1",
                                 "--ckpt-keep", "10", "--log-json", str(root / "log.jsonl")])
    return {"root": root, "result": result, "built": built, "traced": traced}


# One compiled evaluation per step config (sc is static and hashable).
_local_eval = jax.jit(step.local_eval, static_argnums=0)


def _eval_sums(sc, params, split) -> dict:
    """One device's evaluation sums over `split`, as floats."""
    sums = _local_eval(sc, params, split.images, split.labels, np.ones(len(split), np.float32))
    return {k: float(v) for k, v in jax.device_get(sums).items()}


def test_loop_evaluates_the_ema_and_logs_both_on_val(straight):
    import json
    result = straight["result"]
    state = result["state"]
    records = [json.loads(line) for line in (straight["root"] / "log.jsonl").open()]
    evals = [(r["split"], r.get("weights"), r.get("eval_flip")) for r in records if "split" in r]
    assert evals == [("val", "ema", True), ("val-raw", "raw", True), ("test", "ema", True)]
    # The final test figures are those of the EMA weights, not of the raw ones, each image
    # scored with its mirror (--eval-flip).
    splits = data.synthetic_cifar10(n_train=80, n_val=16, n_test=16)
    test = splits["test"]
    sc = step.StepConfig(MODEL, POLICY, eval_flip=True)
    ema = _eval_sums(sc, state["ema"], test)
    raw = _eval_sums(sc, state["params"], test)
    assert result["test"]["loss"] == pytest.approx(ema["loss"] / 16, rel=1e-5)
    assert result["test"]["loss"] != pytest.approx(raw["loss"] / 16, rel=1e-4)
    unflipped = _eval_sums(dataclasses.replace(sc, eval_flip=False), state["ema"], test)
    assert result["test"]["loss"] != pytest.approx(unflipped["loss"] / 16, rel=1e-4)
    assert result["val_raw"]["loss"] != result["val"]["loss"]


def test_loop_compiles_each_step_variant_once_and_switches_at_the_last_epoch(straight):
    import json
    records = [json.loads(line) for line in (straight["root"] / "log.jsonl").open()]
    switch = [r for r in records if r.get("event") == "mix_off"]
    assert len(switch) == 1 and switch[0]["step"] == 5  # after 5 steps: epoch 2 of 2
    mixed, unmixed = straight["built"]  # the run's strategy and the unmixed one
    assert mixed.sc.mixup_alpha == 0.8 and unmixed.sc.mixup_alpha == 0.0
    assert mixed.sc.ema_decay == unmixed.sc.ema_decay == 0.8
    assert straight["traced"] == [0.8, 0.0]  # each variant traced (and compiled) once


def test_ema_is_checkpointed_and_resumes_bitwise(straight, tmp_path):
    """Resume from step 5 (the end of epoch 1: the switch to the unmixed step) to the
    end: the state, EMA included, is the straight run's bit for bit."""
    saved = checkpoint.load_numpy(straight["root"] / "ckpt" / "step_00000005")
    assert any(k.startswith("ema/") for k in saved)
    name = checkpoint.step_dir_name(5)
    shutil.copytree(straight["root"] / "ckpt" / name, tmp_path / name)
    got = ts.main(BASE + ["--ckpt-dir", str(tmp_path), "--resume", "--no-final-eval"])
    want = straight["result"]["state"]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got["state"]),
                            jax.tree.leaves(want), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), jax.tree_util.keystr(path)
    assert "ema" in got["state"]


def test_eval_only_evaluates_the_ema(straight):
    got = ts.main(BASE + ["--ckpt-dir", str(straight["root"] / "ckpt"), "--eval-only"])
    assert got["test"]["loss"] == pytest.approx(straight["result"]["test"]["loss"], rel=1e-6)


def test_flags_resumable_across_are_not_compared():
    """The communication plan's flags are in RESUMABLE_ACROSS: a checkpoint that records
    them (with any values) continues in a run that does not."""
    from vit_pure.run import resume
    args = ts.cli.parse_args(ts.build_parser(), ["--model", "tiny", "--dataset", "synthetic"])
    sc = settings.step_config(args, platform="cpu")
    train = data.synthetic_cifar10(n_train=32, n_val=0, n_test=0)["train"]
    now = resume.trajectory(RunConfig.from_args(args), sc, train, 10)
    written_with_plan_flags = {**now, "--plan": None, "--efficiency": 0.3, "--hardware": "a100"}
    assert resume.first_difference(written_with_plan_flags, now) is None
    assert "--lr differs" in resume.first_difference({**now, "--lr": 0.5}, now)


def test_eval_flip_scores_the_mean_logits_of_each_image_and_its_mirror():
    split = SPLITS["test"]
    params = jax.jit(lambda: step.init_state(jax.random.key(3), MODEL, POLICY, _optimizer(),
                                             )["params"])()
    flip = dataclasses.replace(SC, eval_flip=True)
    got = _eval_sums(flip, params, split)

    def logits(images_u8):
        images = step.prepare_images(images_u8, None, None, train=False, image_size=32)
        return np.asarray(jax.jit(lambda p, x: apply(p, x, MODEL, POLICY))(params, images),
                          np.float64)

    mean = (logits(split.images) + logits(split.images[:, :, ::-1])) / 2
    log_p = mean - mean.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    want_loss = -log_p[np.arange(len(split)), split.labels].sum()
    assert got["loss"] == pytest.approx(want_loss, rel=1e-5)
    assert got["correct"] == (mean.argmax(-1) == split.labels).sum()
    assert got["count"] == len(split)
    # An image and its mirror get the same score (the sum is the same two terms) ...
    mirrored = dataclasses.replace(split, images=np.ascontiguousarray(split.images[:, :, ::-1]))
    assert _eval_sums(flip, params, mirrored) == got
    # ... which the plain evaluation does not give.
    plain = _eval_sums(SC, params, split)
    assert plain["loss"] != pytest.approx(got["loss"], rel=1e-4)
    assert _eval_sums(SC, params, mirrored)["loss"] != pytest.approx(plain["loss"], rel=1e-4)


def test_eval_corners_scores_the_mean_logits_of_the_image_its_corners_and_mirrors():
    """--eval-corners with --eval-flip: ten views, each corner crop made here by
    jax.image.scale_and_translate (a crop of 90% of the area at each corner, resized back
    to 32 px), not by the kit's crop."""
    split = SPLITS["test"]
    params = jax.jit(lambda: step.init_state(jax.random.key(3), MODEL, POLICY, _optimizer(),
                                             )["params"])()
    ten = dataclasses.replace(SC, eval_flip=True, eval_corners=True)
    got = _eval_sums(ten, params, split)
    forward = jax.jit(lambda p, x: apply(p, x, MODEL, POLICY))
    images = step.prepare_images(split.images, None, None, train=False, image_size=32)
    side = 32 * math.sqrt(0.9)

    def corner(top, left):
        scale = jax.numpy.array([32 / side, 32 / side])
        shift = jax.numpy.array([-top * 32 / side, -left * 32 / side])
        return jax.image.scale_and_translate(images, images.shape, (1, 2), scale, shift,
                                             "linear", antialias=False)

    views = [images] + [corner(t, x) for t in (0, 32 - side) for x in (0, 32 - side)]
    views += [v[:, :, ::-1] for v in views]
    mean = sum(np.asarray(forward(params, v), np.float64) for v in views) / 10
    log_p = mean - mean.max(-1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    assert got["loss"] == pytest.approx(-log_p[np.arange(len(split)), split.labels].sum(),
                                        rel=1e-5)
    assert got["correct"] == (mean.argmax(-1) == split.labels).sum()
    # The corners change the score: the flip alone gives another loss.
    flip = _eval_sums(dataclasses.replace(SC, eval_flip=True), params, split)
    assert flip["loss"] != pytest.approx(got["loss"], rel=1e-4)


# data=2,model=2,pipe=2 splits the views over every axis; data=4,model=2 is the wider
# sweep (`-m exhaustive`).
@pytest.mark.parametrize("mesh", [pytest.param("data=4,model=2", marks=pytest.mark.exhaustive),
                                  "data=2,model=2,pipe=2"])
def test_eval_views_under_tensor_parallel_and_a_pipeline_equal_one_device(mesh):
    """--eval-flip with --eval-corners (ten views) on 8 devices, as on one."""
    split = SPLITS["test"]
    flip = dataclasses.replace(SC, eval_flip=True, eval_corners=True, ema_decay=0.0)
    optimizer = _optimizer()
    host = jax.jit(lambda: step.init_state(jax.random.key(3), MODEL, POLICY, optimizer))()
    strategy = ts.ShardMapStrategy(flip, optimizer, mesh, devices=jax.devices()[:8],
                                   microbatches=2 if "pipe" in mesh else None)
    got = strategy.metrics_to_host(strategy.eval_step(
        strategy.put_state(jax.device_get(host)),
        *strategy.put_batch(split.images, split.labels, np.ones(len(split), np.float32))))
    want = _eval_sums(flip, host["params"], split)
    assert got["count"] == want["count"] and got["correct"] == want["correct"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_good_lever_values_parse():
    """The levers' values parse as given (bad ones: tests/test_cli_errors.py), and both
    scripts' parsers leave them all off by default."""
    plain = ["--model", "tiny", "--dataset", "synthetic", "--batch", "16"]
    args = ts.cli.parse_args(ts.build_parser(), plain + [
        "--ema", "0.999", "--mixup", "0.8", "--epochs", "3", "--mix-off-epochs", "2",
        "--repeat-aug", "4", "--eval-flip", "--eval-corners"])
    assert (args.ema, args.mix_off_epochs, args.repeat_aug, args.eval_flip) == (
        0.999, 2, 4, True)
    assert settings.step_config(args).eval_flip and settings.step_config(args).eval_corners
    defaults = ts.cli.parse_args(ts.cli.build_parser("train_pmap.py's flags"), plain)
    assert (defaults.ema, defaults.mix_off_epochs, defaults.repeat_aug, defaults.eval_flip) == (
        0.0, 0, 1, False)
    assert not settings.step_config(defaults).eval_flip
    assert not settings.step_config(defaults).eval_corners
