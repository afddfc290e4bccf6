"""bench.py's FLOP count, the dtype/precision study (study.py) and the trace-time probe,
on the tiny model."""
import math

import jax
import numpy as np
import pytest

from benchmarks import bench, study
from benchmarks.probes import trace_time
from train_shardmap import ShardMapStrategy
from vit_pure import PRESETS, apply, init_params, step
from vit_pure.config import Execution
from vit_pure.xla import flops, hlo

TINY = PRESETS["tiny"]


def _lowered_train_step(policy: str, *, precision="default", scan: bool, batch: int = 8,
                        devices=2):
    """The training scripts' own step (their defaults, shard_map over `devices`), lowered."""
    sc, optimizer = bench.training_setup("tiny", batch, policy, precision=precision, scan=scan)
    strategy = ShardMapStrategy(sc, optimizer, None, devices=jax.devices()[:devices])
    state = strategy.put_state(step.init_state(jax.random.key(0), TINY, sc.policy, optimizer))
    return strategy.train_step.lower(state, *bench.step_inputs(strategy, batch)(0))


def test_analytic_flops_by_hand_and_for_vit_cifar():
    # tiny: 17 tokens, width 24, MLP 40, 16 patches of 192 pixels, 10 classes, depth 4.
    block = 17 * 24 * 72 + 2 * 17 * 17 * 24 + 17 * 24 * 24 + 2 * 17 * 24 * 40
    every = Execution(last_block="all")
    assert flops.forward_flops_per_image(TINY, every) == 2 * (16 * 192 * 24 + 4 * block
                                                              + 24 * 10)
    # The reference model, vit-cifar: about 4.26 GFLOP per training image (docs/performance.md).
    assert flops.train_flops_per_image(PRESETS["vit-cifar"], every) / 1e9 == pytest.approx(
        4.26, abs=0.01)
    # The last block on the class token (the scripts' default): k and v on 17 rows, the
    # query, both attention products, the output projection and the MLP on one.
    last = 17 * 24 * 48 + 24 * 24 + 2 * 17 * 24 + 24 * 24 + 2 * 24 * 40
    cls = Execution()
    assert flops.forward_flops_per_image(TINY, cls) == 2 * (16 * 192 * 24 + 3 * block + last
                                                            + 24 * 10)
    assert flops.train_flops_per_image(PRESETS["vit-cifar"], cls) / 1e9 == pytest.approx(
        3.68, abs=0.01)
    # Other pools read every token: the count is the whole block's.
    assert flops.forward_flops_per_image(TINY.replace(pool="mean"), cls) == \
        flops.forward_flops_per_image(TINY, every)


@pytest.fixture(scope="module")
def unrolled_step():
    """The lowered float32 training step of the tiny model, layers unrolled, batch 8 on
    2 devices (4 each)."""
    return _lowered_train_step("fp32", scan=False, batch=8, devices=2)


def test_analytic_flops_equal_the_dots_jax_emits(unrolled_step):
    """Every dot_general of the lowered (unrolled) programs, counted: the forward pass is
    exactly the analytic count; the training step is 3x that minus the patch embedding's
    input gradient, which autodiff does not compute (nothing needs it); both plus the ones
    columns through which `dense` adds its biases. The training
    step's program is one device's: 4 of the 8 images."""
    params = init_params(jax.random.key(0), TINY)
    images = np.zeros((6, 32, 32, 3), np.float32)
    fwd = jax.jit(lambda p, x: apply(p, x, TINY)).lower(params, images).as_text()
    assert hlo.stablehlo_dot_flops(fwd) == 6 * (flops.forward_flops_per_image(TINY)
                                                + flops.bias_column_flops_per_image(TINY, False))

    # With a convolutional stem: its two layers (16x16 x 27 x 8, 8x8 x 72 x 12 multiply-
    # adds per image) count as dots of the forward pass too.
    stem = TINY.replace(name="tiny-stem", stem=(8, 12), patch_size=16)
    fwd = jax.jit(lambda p, x: apply(p, x, stem)).lower(init_params(jax.random.key(0), stem),
                                                        images).as_text()
    assert hlo.stablehlo_dot_flops(fwd) == 6 * (flops.forward_flops_per_image(stem)
                                                + flops.bias_column_flops_per_image(stem, False))
    assert flops.forward_flops_per_image(stem) - flops.forward_flops_per_image(
        stem.replace(stem=())) == 2 * (256 * 27 * 8 + 64 * 72 * 12) + 2 * 4 * (192 - 768) * 24

    # The scripts' step runs the last block on the class token.
    patch_input_grad = 2 * TINY.num_patches * TINY.patch_dim * TINY.width
    cls = Execution(last_block="class-token")
    assert hlo.stablehlo_dot_flops(unrolled_step.as_text()) == 4 * (
        flops.train_flops_per_image(TINY, cls) - patch_input_grad
        + flops.bias_column_flops_per_image(TINY, True, cls))


def test_analytic_flops_match_xla_cost_analysis():
    """XLA's own count (cost_analysis) of the model's forward + backward pass (scan off:
    XLA counts a loop body once) also counts the elementwise work (LayerNorm, softmax,
    GELU, bias adds), which for the 24-wide tiny model is 10-15% on top of the matmuls:
    tolerance [1.0, 1.2] x the analytic count. (For vit-cifar it is 1.5%; the whole
    training step adds augmentation and AdamW, and bench.py's "XLA GFLOP/img" column
    reports that ratio for the real step.)"""
    params = init_params(jax.random.key(0), TINY)
    images = np.zeros((8, 32, 32, 3), np.float32)
    grad = jax.jit(jax.grad(lambda p, x: apply(p, x, TINY).sum()))
    xla_flops = grad.lower(params, images).compile().cost_analysis()["flops"]
    ratio = xla_flops / 8 / flops.train_flops_per_image(TINY)
    assert 1.0 <= ratio <= 1.2, ratio


@pytest.mark.parametrize("precision, expected", [("highest", "HIGHEST"), ("default", "DEFAULT")])
def test_matmul_precision_reaches_every_dot(precision, expected):
    """--matmul-precision sets Policy.matmul_precision; every dot_general of the training
    step (forward, both backward matmuls of each layer, the attention einsums and their
    gradients) must carry it."""
    lowered = _lowered_train_step("bf16", precision=precision, scan=True).as_text()
    # With scan the layer is written once: 6 forward dots (qkv, scores, probs.v, out,
    # fc1, fc2) and 12 backward ones (2 per dot); outside it the last block, on the class
    # token (k, v and q each its own product: 8 forward, 16 backward), the patch embedding
    # (forward + weight gradient) and the head (forward + 2): 18 + 24 + 5.
    assert hlo.dot_precisions(lowered) == {expected: 47}


def test_parse_configs_and_bad_input():
    cs = bench.parse_configs(["pmap:2:fp32; shard_map:data=4,model=2:p=f32,c=bf16,o=f32:scan=0",
                              "shard_map::bf16:accum=2,remat=block"])
    assert [c.strategy for c in cs] == ["pmap", "shard_map", "shard_map"]
    assert cs[1].layout == "data=4,model=2" and cs[1].policy == "p=f32,c=bf16,o=f32"
    assert cs[1].options == {"scan": "0"} and cs[2].options == {"accum": "2", "remat": "block"}
    assert bench.layout_devices("data=4,model=2", None) == 8
    assert bench.layout_devices("", 3) == 3
    pipe, fsdp = bench.parse_configs(
        ["shard_map:data=2,pipe=2:fp32:mb=4; shard_map:data=4:bf16:fsdp=1"])
    assert pipe.layout == "data=2,pipe=2" and pipe.options == {"mb": "4"}
    assert fsdp.options == {"fsdp": "1"}
    (saves,) = bench.parse_configs(["shard_map:1:bf16:remat=block-save:dot+mask,accum=2"])
    assert saves.options == {"remat": "block-save:dot+mask", "accum": "2"}
    assert bench.layout_devices("data=2,model=2,pipe=2", None) == 8
    for bad in ["pmap:fp32", "jit:1:fp32", "pmap:1:fp64", "pmap:data=2:fp32", "shard_map:x:fp32",
                "pmap:1:fp32:speed=fast", "shard_map:data=2,stage=2:fp32", "pmap:8:fp32:fsdp=1",
                "pmap:2:fp32:mb=2"]:
        with pytest.raises(bench.cli.UsageError):
            bench.parse_configs([bad])


@pytest.mark.slow  # four compiles and runs of the benchmark: 33-38 s here
def test_study_runs_a_2x2_corner(tmp_path):
    out = tmp_path / "study.md"
    rows = study.main(["--model", "tiny", "--param-dtypes", "f32,f16", "--compute-dtypes",
                       "f32,bf16", "--batches", "16", "--precisions", "default", "--steps", "1",
                       "--warmup", "1", "--out", str(out)])
    assert [(r["param_dtype"], r["compute_dtype"]) for r in rows] == [
        ("f32", "f32"), ("f32", "bf16"), ("f16", "f32"), ("f16", "bf16")]
    assert all("error" not in r for r in rows), [r.get("error") for r in rows]
    table = out.read_text()
    header = next(line for line in table.splitlines() if line.startswith("| params"))
    for column in ("param bytes", "opt-state bytes", "peak mem/dev", "step s", "img/s",
                   "loss@N", "batch converts", "dots @precision"):
        assert column in header
    assert sum(line.startswith("| f") for line in table.splitlines()) == 4
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(
        jax.eval_shape(lambda: init_params(jax.random.key(0), TINY))))
    by = {(r["param_dtype"], r["compute_dtype"]): r for r in rows}
    assert by["f32", "f32"]["param_bytes"] == 4 * n_params
    assert by["f16", "f32"]["param_bytes"] == 2 * n_params
    # AdamW's two moments take the parameter dtype (plus two int32 step counters).
    assert by["f16", "f32"]["opt_state_bytes"] == 2 * 2 * n_params + 8
    for key in [("f32", "f32"), ("f32", "bf16")]:  # f32 master weights train
        assert np.isfinite(by[key]["loss"])
    # The input batch: uint8 -> f32 (normalisation; XLA may repeat it in more than one
    # fusion) always; f32 -> bf16 exactly once more, in model.embed, when computing in
    # bf16 (see study.batch_converts).
    assert set(by["f32", "f32"]["converts"]) == {"u8->f32"}
    assert by["f32", "bf16"]["converts"][0] == "u8->f32"
    assert by["f32", "bf16"]["converts"].count("f32->bf16") == 1
    assert all(r["dots_at_precision"] == r["dots"] > 0 for r in rows)


def test_kit_rows_take_the_training_scripts_flags():
    """`--kit LABEL=FLAGS` in bench.py: harness.parse_kit_row's grammar (the one peers and
    deviceless take), the flags checked by train_shardmap.py's own parser at once."""
    from benchmarks import harness, rows
    assert harness.parse_kit_row("tp=XLA_FLAGS=--x=1 --mesh data=1,model=2") == (
        "tp", {"XLA_FLAGS": "--x=1"}, ["--mesh", "data=1,model=2"])
    args = rows.kit_args(rows.kit_argv("tiny", 8, ["--mesh", "data=1,model=2", "--fsdp"]),
                         "tp=...")
    assert (args.model, args.batch, args.mesh, args.fsdp, args.accum_steps) == (
        "tiny", 8, "data=1,model=2", True, 1)
    with pytest.raises(bench.cli.UsageError,
                       match=r"--kit 'x=--lr 0': the training script refuses it: --lr must"):
        rows.kit_args(rows.kit_argv("tiny", 8, ["--lr", "0"]), "x=--lr 0")
    for bad in (["--kit", "no label"], ["--kit", "x=--accum-steps auto"]):
        with pytest.raises(bench.cli.UsageError, match="--kit"):
            bench.main(bad)


def test_trace_time_probe_times_the_scripts_pipeline_step(capsys):
    """The probe builds train_shardmap.py's step from its flags (here a two-stage pipeline)
    and prints the medians and the StableHLO's size after a line per repeat."""
    assert trace_time.main(["--model", "tiny", "--mesh", "data=4,pipe=2", "--batch", "16",
                            "--randaugment", "0,0", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("repeat 1/1: trace ") == 1
    row = next(line for line in out.splitlines() if line.startswith("| tiny, --mesh"))
    trace_s, lower_s, lines = (float(c) for c in row.strip("|").split("|")[1:])
    assert trace_s > 0 and lower_s > 0 and lines > 1000
