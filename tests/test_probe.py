"""--trainable head: the linear probe on cached features (vit_pure/run/probe.py).

The features step stops where the head begins (`features` then `classify` is `apply`); a
probe run never compiles the training step, leaves the backbone as it was, and its fitted
head scores through the strategy's evaluation step what it scores on the cached features;
every layout and both scripts fit the same head.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_pmap
import train_shardmap
from vit_pure import weights
from vit_pure.config import ViTConfig, get_preset
from vit_pure.data import cifar10 as data_lib
from vit_pure.model import apply, classify, features, init_params
from vit_pure.policy import Policy
from vit_pure.run import checkpoint, cli, probe
from vit_pure.step import OptimConfig, StepConfig, init_state, local_features, make_optimizer

CFG = ViTConfig(name="p", image_size=16, patch_size=8, num_classes=4, width=16, depth=2,
                heads=2, mlp_dim=24)

FLAGS = ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "96",
         "--synthetic-val", "32", "--synthetic-test", "48", "--batch", "16", "--epochs", "3",
         "--lr", "1e-2", "--trainable", "head", "--eval-flip", "--eval-every", "1",
         "--no-progress", "--accum-steps", "1"]
TINY = get_preset("tiny")


@pytest.fixture(scope="module")
def RUN(tmp_path_factory):
    """The probe's flags, its backbone from --init-from: the tiny model's initialisation
    of seed 0, exported as timm's files (a probe needs pretrained weights)."""
    folder = tmp_path_factory.mktemp("backbone")
    weights.save(folder, TINY, jax.tree.map(np.asarray, init_params(jax.random.key(0), TINY)),
                 "timm")
    return FLAGS + ["--init-from", str(folder / "model.safetensors")]


@pytest.mark.parametrize("pool", ["cls", "mean", "cls+mean"])
def test_features_then_classify_is_apply(pool):
    cfg = CFG.replace(pool=pool)
    params = init_params(jax.random.key(0), cfg)
    params["head"]["kernel"] = jax.random.normal(jax.random.key(1), params["head"]["kernel"].shape)
    x = jax.random.normal(jax.random.key(2), (3, 16, 16, 3))
    np.testing.assert_allclose(
        jax.jit(lambda p, x: classify(p["head"], features(p, x, cfg)))(params, x),
        jax.jit(lambda p, x: apply(p, x, cfg))(params, x), rtol=1e-6, atol=1e-6)


def test_fit_head_learns_separable_features():
    """The head's own loop: four well-separated clusters are learnt (the two views of an
    example differ, as an image's and its mirror's features do)."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 256).astype(np.int32)
    centres = 3.0 * rng.standard_normal((4, 32)).astype(np.float32)
    feats = (centres[labels][:, None] + rng.standard_normal((256, 2, 32))).astype(np.float32)
    cfg = CFG.replace(pool="cls+mean")  # F = 2E = 32
    sc = StepConfig(cfg=cfg, policy=Policy(), eval_flip=True)
    optim = OptimConfig(lr=3e-2, weight_decay=0.0, warmup_steps=2)
    optimizer, _ = make_optimizer(optim, 64)
    host = jax.tree.map(np.asarray, init_state(jax.random.key(0), cfg, sc.policy, optimizer))
    lines = []

    def log(text, **record):
        lines.append(text)
    state, last = probe.fit_head(sc, optim, host, feats, labels, batch=32, steps_per_epoch=8,
                                 total_steps=64, start=0, seed=0, log=log, progress=False,
                                 eval_every=4, val=(feats[:64], labels[:64]))
    assert last["step"] == 64 and int(state["step"]) == 64
    assert probe.accuracy(state["params"], feats, labels, sc) > 0.95
    assert len(lines) == 2 and last["val_accuracy"] > 0.95  # epochs 4 and 8


def _backbone(params):
    return {k: v for k, v in params.items() if k != "head"}


def test_probe_run_scores_its_head_through_the_evaluation_step(RUN, capsys):
    """... and --accum-steps auto measures no training step: the probe never runs one."""
    result = train_shardmap.main(RUN + ["--mesh", "data=4,model=2", "--accum-steps", "auto"])
    out = capsys.readouterr().out
    assert "compiling the features step" in out and "compiling the training step" not in out
    assert "--accum-steps auto: K=1; --trainable head trains the head on cached" in out
    assert out.count("(cached features)") == 3  # every epoch, --eval-every 1
    params = result["state"]["params"]
    # The backbone is the --init-from file's, bit for bit; the head moved.
    tiny = TINY
    start = init_state(jax.random.key(0), tiny, Policy(), make_optimizer(
        OptimConfig(trainable="head"), 1)[0])["params"]
    for a, b in zip(jax.tree.leaves(_backbone(params)), jax.tree.leaves(_backbone(start))):
        np.testing.assert_array_equal(a, b)
    assert np.any(params["head"]["kernel"] != start["head"]["kernel"])
    assert int(result["state"]["step"]) == 18  # 96 / 16 x 3 epochs
    # The evaluation step (the backbone again, each image with its mirror) agrees with the
    # cached features' accuracy of the same head.
    test = data_lib.synthetic_cifar10(n_train=96, n_val=32, n_test=48)["test"]
    sc = StepConfig(cfg=tiny, policy=Policy(), eval_flip=True)
    feats = np.asarray(jax.jit(local_features, static_argnums=0)(sc, params,
                                                                 jnp.asarray(test.images)))
    assert result["test"]["accuracy"] == pytest.approx(
        probe.accuracy(params["head"], feats, test.labels, sc), abs=1e-6)


@pytest.mark.slow
def test_every_layout_fits_the_same_head(RUN):
    """pmap, shard_map data / TP / FSDP: the same features, the same head, to float32
    rounding. (A pipeline, pipe > 1, has no features step: it runs the per-step probe.)"""
    heads = {}
    for name, main, extra in [
            ("pmap", train_pmap.main, []),
            ("data=8", train_shardmap.main, []),
            ("data=2,model=4", train_shardmap.main, ["--mesh", "data=2,model=4"]),
            ("fsdp", train_shardmap.main, ["--mesh", "data=4,model=2", "--fsdp"])]:
        heads[name] = main(RUN + extra)["state"]["params"]["head"]
    for name, head in heads.items():
        for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(heads["pmap"])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_probe_checkpoint_resumes_and_evaluates_to_the_same_figures(RUN, tmp_path):
    """The probe saves the state with its fitted head at the last step: --resume finds
    nothing left to do, and --eval-only scores the same test accuracy."""
    run = RUN + ["--ckpt-dir", str(tmp_path)]
    first = train_shardmap.main(run)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000018"]
    # The optimizer state is the head's: one element a frozen leaf, not its moments.
    saved = checkpoint.load_numpy(tmp_path / "step_00000018")
    frozen = [k for k in saved if k.startswith("opt_state/") and "/head/" not in k]
    assert frozen and all(saved[k].size == 1 for k in frozen), frozen
    again = train_shardmap.main(run + ["--resume"])
    assert again["test"] == first["test"]
    evaluated = train_shardmap.main(run + ["--eval-only"])
    assert evaluated["test"]["accuracy"] == first["test"]["accuracy"]


def test_trainable_head_without_init_from_is_one_line(capsys):
    assert cli.main_guard(lambda: train_pmap.main(FLAGS)) == 2
    err = capsys.readouterr().err
    assert err == ("error: --trainable head trains the head alone on a frozen backbone: give "
                   "--init-from FILE, its pretrained weights (a random backbone's features "
                   "are noise)\n")


def test_trainable_head_keeps_optimizer_state_for_the_head_only():
    params = init_params(jax.random.key(0), TINY)
    for name in ("adamw", "sgd"):
        optimizer, _ = make_optimizer(OptimConfig(optimizer=name, trainable="head"), 10)
        state = optimizer.init(params)
        head = sum(x.size for x in jax.tree.leaves(params["head"]))
        leaves = {jax.tree_util.keystr(p): x for p, x in
                  jax.tree_util.tree_leaves_with_path(state) if x.ndim}  # not the counts
        assert sum(x.size for k, x in leaves.items() if "'head'" in k) == \
            head * (2 if name == "adamw" else 1), name
        frozen = [x for k, x in leaves.items() if "'head'" not in k]
        assert frozen and all(x.size == 1 for x in frozen), name
