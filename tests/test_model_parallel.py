"""Model parallelism in train_shardmap.py: tensor parallelism (TP) over 'model' and FSDP
over 'data' on a 2-D mesh, each layout checked against a single-device reference.

For the layouts data=D,model=M of the 8 fake CPU devices 8x1, 2x4 and 1x8 (4x2 with
`-m exhaustive`), with and without --fsdp:

* the loss and every gradient equal plain `jax.grad` of the mean loss on one device
  (float32, max |difference| <= 1e-5 x the gradient norm), and so does the global norm;
* the parameters after 5 AdamW steps (dropout and augmentation on, keyed by example id)
  equal the single-device run's;
* the collectives in the compiled step are the ones the code writes, and no more;
* the measured bytes of params + optimizer state per device drop by M (TP) and by D (FSDP).

The test model has odd, distinct sizes that divide as needed: width E=40 (FSDP over 8
divides it), 8 heads of 5 (TP over 1, 2, 4, 8), MLP M=56 (= 7 x 8), depth 3, 17 tokens,
10 classes, 192-pixel patches. The steps are compiled with cheaper XLA:CPU code generation
(`FAST`): the same lowered program as `strategy.train_step`, compiled faster.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST, REPO, grads_step
from jax import lax
from jax.sharding import PartitionSpec as P

import train_shardmap as ts
from vit_pure import layout as layout_lib
from vit_pure import step
from vit_pure.config import PRESETS, Execution
from vit_pure.policy import LossScale, Policy
from vit_pure.run import cli

CFG = PRESETS["tiny"].replace(name="mp-test", width=40, heads=8, mlp_dim=56, depth=3)
# The layer scan: the collective counts below are per loop body (one layer's collectives,
# run depth times); the unrolled loop computes the same numbers (test_model.py).
SC = step.StepConfig(CFG, Policy(), execution=Execution(scan=True))
BATCH, STEPS = 16, 5
MESHES = ["data=8", "data=4,model=2", "data=2,model=4", "data=1,model=8"]
# data=4,model=2 is data=2,model=4 with the factors swapped: the wider sweep
# (`-m exhaustive`), every test of it at once so that its programs are not built.
WIDER = "data=4,model=2"


def _cells(layouts):
    return [pytest.param(m, f, marks=pytest.mark.exhaustive if m == WIDER else ())
            for m, f in layouts]


LAYOUTS = _cells((mesh, fsdp) for mesh in MESHES for fsdp in (False, True))


def make_optimizer(total_steps: int = STEPS):
    return step.make_optimizer(step.OptimConfig(warmup_steps=1), total_steps)[0]


def fixed_batches(n: int, batch: int = BATCH, seed: int = 0) -> list[tuple]:
    """n fixed (uint8 images, labels, global example ids, step key) training batches."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, (batch, 32, 32, 3), dtype=np.uint8),
             rng.integers(0, 10, (batch,), dtype=np.int32),
             np.arange(batch, dtype=np.int32),
             step.step_key(seed, 0, i)) for i in range(n)]


def initial_state(sc: step.StepConfig, optimizer, seed: int = 0) -> dict:
    """A fresh training state on the host (numpy), so that placing it always copies."""
    return jax.device_get(step.init_state(jax.random.key(seed), sc.cfg, sc.policy, optimizer))


# ------------------------------------------------------------------ single-device reference
def reference_grads(sc: step.StepConfig, params, batch) -> tuple[dict, float]:
    """jax.grad of the mean loss over the whole batch on one device, no collectives:
    (host grads, loss). Same keys and example ids as the parallel step."""
    images, labels, ids, key = batch
    f = jax.jit(lambda p: step.local_grads(sc, p, LossScale.create(dynamic=False),
                                           images, labels, ids, key))
    grads, metrics = f.lower(params).compile(FAST)(params)
    return jax.device_get(grads), float(metrics["loss"])


def reference_run(sc: step.StepConfig, optimizer, state, batches) -> dict:
    """len(batches) training steps on one device; returns the host params."""
    def one_step(state, images, labels, ids, key):
        grads, _ = step.local_grads(sc, state["params"], state["loss_scale"], images, labels,
                                    ids, key)
        norm = jnp.sqrt(step.sum_of_squares(grads))
        return step.apply_gradients(sc, state, grads, norm, optimizer)[0]

    compiled = jax.jit(one_step).lower(state, *batches[0]).compile(FAST)
    for batch in batches:
        state = compiled(state, *batch)
    return jax.device_get(state["params"])


# ------------------------------------------------------------------ the parallel strategies
def strategy_args(strategy, state_on_device, batch) -> tuple:
    images, labels, ids, key = batch
    return (state_on_device, *strategy.put_batch(images, labels, ids),
            strategy.put_replicated(key))


def run_steps(strategy, state, batches, *, compiled=None) -> dict:
    """Run len(batches) steps of `strategy` (its train_step, or `compiled`, a compiled
    lowering of it) from host `state` on fixed data; returns the host params."""
    train_step = compiled or strategy.train_step
    state = strategy.put_state(state)
    for batch in batches:
        state, _ = train_step(*strategy_args(strategy, state, batch))
    return strategy.host_state(state)["params"]


@functools.cache
def reference() -> dict:
    optimizer = make_optimizer()
    state, batches = initial_state(SC, optimizer), fixed_batches(STEPS)
    grads, loss = reference_grads(SC, state["params"], batches[0])
    return {"grads": grads, "loss": loss, "params": reference_run(SC, optimizer, state, batches)}


def layout(mesh: str, fsdp: bool, remat: str = "none") -> dict:
    """Build one layout, take its gradients on batch 0 and run 5 steps; keep the programs.
    With data=1 there is nothing to split over 'data': --fsdp gives the very same
    layout (test_layouts_really_shard checks it), so that program is built once."""
    return _layout(mesh, fsdp and not mesh.startswith("data=1,"), remat)


@functools.cache
def _layout(mesh: str, fsdp: bool, remat: str) -> dict:
    sc = dataclasses.replace(SC, execution=SC.execution.replace(remat=remat))
    optimizer = make_optimizer()
    strategy = ts.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp)
    state, batches = initial_state(sc, optimizer), fixed_batches(STEPS)
    args = strategy_args(strategy, strategy.put_state(state), batches[0])
    train_lowered = strategy.train_step.lower(*args)
    out = {"strategy": strategy, "stablehlo": train_lowered.as_text()}
    if remat != "none":  # only the collective inventory is wanted
        return out
    grads, metrics = grads_step(strategy).lower(*args).compile(FAST)(*args)
    train_compiled = train_lowered.compile(FAST)
    out.update(grads=jax.device_get(grads), metrics=strategy.metrics_to_host(metrics),
               compiled=train_compiled.as_text(),
               params=run_steps(strategy, state, batches, compiled=train_compiled))
    return out


def max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def norm(tree) -> float:
    return math.sqrt(sum(float(np.sum(np.square(x, dtype=np.float64)))
                         for x in jax.tree.leaves(tree)))


# ------------------------------------------------------------------ equal to one device
@pytest.mark.parametrize("mesh, fsdp", LAYOUTS)
def test_loss_and_gradients_equal_single_device(mesh, fsdp):
    ref, got = reference(), layout(mesh, fsdp)
    ref_norm = norm(ref["grads"])
    assert jax.tree.structure(got["grads"]) == jax.tree.structure(ref["grads"])
    assert max_abs_diff(got["grads"], ref["grads"]) <= 1e-5 * ref_norm
    assert got["metrics"]["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert got["metrics"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)


@pytest.mark.parametrize("mesh, fsdp", LAYOUTS)
def test_params_after_five_steps_equal_single_device(mesh, fsdp):
    ref, got = reference(), layout(mesh, fsdp)
    moved = max_abs_diff(ref["params"], initial_state(SC, make_optimizer())["params"])
    assert moved > 1e-3  # the steps did change the params (lr 1e-3, 5 Adam steps)
    assert max_abs_diff(got["params"], ref["params"]) <= 1e-5


def test_layouts_really_shard():
    """The comparisons above are against params that really are split as the rules say."""
    specs = layout("data=2,model=4", True)["strategy"].param_specs
    assert specs["blocks"]["attn"]["qkv"]["kernel"] == P(None, "data", None, "model", None)
    assert specs["blocks"]["attn"]["out"]["kernel"] == P(None, "model", None, "data")
    assert specs["blocks"]["mlp"]["fc1"]["kernel"] == P(None, "data", "model")
    assert specs["blocks"]["mlp"]["fc2"]["kernel"] == P(None, "model", "data")
    assert specs["blocks"]["mlp"]["fc1"]["bias"] == P(None, "model")
    assert specs["patch_embed"]["kernel"] == P(None, "data")
    assert specs["blocks"]["ln1"]["scale"] == P(None, None)  # vectors stay replicated
    no_fsdp = layout("data=2,model=4", False)["strategy"].param_specs
    assert no_fsdp["blocks"]["mlp"]["fc1"]["kernel"] == P(None, None, "model")
    assert no_fsdp["patch_embed"]["kernel"] == P(None, None)
    one_data = [ts.ShardMapStrategy(SC, make_optimizer(), "data=1,model=8", fsdp=f).param_specs
                for f in (False, True)]
    assert one_data[0] == one_data[1]


# ------------------------------------------------------------------ FSDP's backward collective
def test_fsdp_gather_backward_is_autodiffs_reduce_scatter_over_d():
    """fsdp_gather's custom VJP writes the reduce-scatter that autodiff would derive from
    all_gather by itself (a sum), divided by D: the mean over 'data'."""
    mesh = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    w = jnp.linspace(-1.0, 1.0, 24).reshape(3, 8)
    x = jnp.arange(4 * 8.0).reshape(4, 8) / 10

    def grad_of(gather):
        def local(w_shard, x_row):  # a loss that depends on every element of w
            return jnp.sum(jnp.sin(gather(w_shard) * x_row[0]))
        return jax.jit(jax.shard_map(jax.grad(local), mesh=mesh,
                                     in_specs=(P(None, "data"), P("data")),
                                     out_specs=P(None, "data")))

    written = grad_of(lambda s: ts.fsdp_gather(s, 1, jnp.float32))
    autodiff = grad_of(lambda s: lax.all_gather(s, "data", axis=1, tiled=True))
    mean = jax.grad(lambda w: jnp.mean(jnp.stack(
        [jnp.sum(jnp.sin(w * x[i])) for i in range(4)])))(w)
    np.testing.assert_allclose(written(w, x), mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(autodiff(w, x), 4 * mean, rtol=1e-6, atol=4e-7)
    for f in (written, autodiff):
        text = f.lower(w, x).as_text()
        assert text.count("stablehlo.reduce_scatter") == 1
        assert "stablehlo.all_reduce" not in text


# ------------------------------------------------------------------ collective inventory
_STABLEHLO_OP = re.compile(
    r'"stablehlo\.(all_reduce|all_gather|reduce_scatter|collective_permute|all_to_all)"'
    r'.*?replica_groups = dense<(.*?)> : tensor')


def _axes_spanned(groups: list[list[int]], mesh_shape: dict) -> str:
    """Which mesh axes a collective's replica groups run along, e.g. 'data', 'model',
    'data+model', or '' for a no-op over a size-1 axis. Device i sits at mesh position
    divmod(i, M) (the mesh is built in device order)."""
    m = mesh_shape["model"]
    group = groups[0]
    axes = [name for name, coord in (("data", lambda i: i // m), ("model", lambda i: i % m))
            if len({coord(i) for i in group}) > 1]
    return "+".join(axes)


def stablehlo_inventory(text: str, mesh_shape: dict) -> collections.Counter:
    """Count (op, mesh axes) of the collectives in a lowered program's StableHLO text."""
    inventory = collections.Counter()
    for op, groups in _STABLEHLO_OP.findall(text):
        groups = eval(groups if groups.startswith("[[") else f"[{groups}]")  # numbers only
        inventory[op, _axes_spanned(groups, mesh_shape)] += 1
    return inventory


# The StableHLO of train_step (remat none), before XLA combines anything: one op per array
# each collective in the code is applied to, counted once per program text (the layer scan's
# body appears once, whatever the depth; the last block, on the class token's row alone as
# the scripts run it, sits outside the scan and appears once more). The test model has 20
# parameter arrays; FSDP splits 7 of them over 'data' (the 4 block kernels,
# patch_embed/kernel, pos_embed, head/kernel), so 13 stay data-replicated. Where the
# numbers come from:
#   all_reduce 'data':  pmean of each data-replicated gradient (20, or 13 under FSDP)
#                       + pmean of the 2 metrics + 1 grad-norm psum if some leaf is split
#                       over 'data' alone (FSDP's patch_embed, pos_embed, head kernels)
#   all_reduce 'model': TP's 2 forward psums ("g": after the attention output projection
#                       and after fc2) and 2 backward psums (the transpose of "f" before
#                       qkv and fc1), in the scan body and in the last block (2 x 4), + 1
#                       grad-norm psum over 'model'
#   all_reduce 'data+model': 1 grad-norm psum for the leaves split over both (FSDP x TP)
#   all_gather / reduce_scatter 'data': FSDP, one of each per FSDP-split array: the
#                       all-gather before use, the reduce-scatter in its backward pass; the
#                       4 block kernels in the scan body and in the last block (7 + 4)
#   '' (no axis): pmeans over a size-1 'data' axis; the code writes them, they move nothing
TP = 2 * 4 + 1
FSDP = {("all_gather", "data"): 7 + 4, ("reduce_scatter", "data"): 7 + 4}
EXPECTED_TRAIN_STEP = {
    ("data=8", False): {("all_reduce", "data"): 20 + 2},
    ("data=8", True): {("all_reduce", "data"): 13 + 2 + 1, **FSDP},
    ("data=4,model=2", False): {("all_reduce", "data"): 20 + 2, ("all_reduce", "model"): TP},
    ("data=4,model=2", True): {("all_reduce", "data"): 13 + 2 + 1, ("all_reduce", "model"): TP,
                               ("all_reduce", "data+model"): 1, **FSDP},
    ("data=2,model=4", False): {("all_reduce", "data"): 20 + 2, ("all_reduce", "model"): TP},
    ("data=2,model=4", True): {("all_reduce", "data"): 13 + 2 + 1, ("all_reduce", "model"): TP,
                               ("all_reduce", "data+model"): 1, **FSDP},
    # data=1: nothing to split over 'data', so --fsdp changes nothing.
    ("data=1,model=8", False): {("all_reduce", ""): 20 + 2, ("all_reduce", "model"): TP},
    ("data=1,model=8", True): {("all_reduce", ""): 20 + 2, ("all_reduce", "model"): TP},
}


@pytest.mark.parametrize("mesh, fsdp", LAYOUTS)
def test_collective_inventory_matches_the_code(mesh, fsdp):
    """Exact counts at the StableHLO level (`lower().as_text()`), where each collective the
    code writes is one op. The compiled HLO is not exact: XLA's all-reduce combiner merges
    the data-parallel gradient all-reduces into one tuple-shaped all-reduce (bytes are
    conserved, checked in the next test)."""
    got = layout(mesh, fsdp)
    strategy = got["strategy"]
    assert stablehlo_inventory(got["stablehlo"], dict(strategy.mesh.shape)) == \
        collections.Counter(EXPECTED_TRAIN_STEP[mesh, fsdp])


def test_fsdp_with_remat_gathers_block_weights_again_in_the_backward_pass():
    """--fsdp keeps the gathered weights for the backward pass; with --remat block each
    layer's 4 kernels are all-gathered again there (the top-level ones stay kept), and
    TP's first forward psum is recomputed (the second one's output is not needed): in the
    scan body and again in the last block (the inventory above, plus 2 x 4 gathers and
    2 x 1 psums)."""
    got = layout("data=2,model=4", True, remat="block")
    inv = stablehlo_inventory(got["stablehlo"], {"data": 2, "model": 4})
    assert inv["all_gather", "data"] == 7 + 4 + 2 * 4
    assert inv["reduce_scatter", "data"] == 7 + 4
    assert inv["all_reduce", "model"] == TP + 2 * 1


_HLO_SIZES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1}


def _compiled_all_reduce_bytes(text: str, mesh_shape: dict) -> collections.Counter:
    """Bytes per device reduced by the compiled program's all-reduces, by mesh axes."""
    out = collections.Counter()
    for line in text.splitlines():
        match = re.search(r"= (.*?) all-reduce(?:-start)?\(.*replica_groups=(\{\{[\d,{}]*\}\})",
                          line)
        if match:
            groups = eval(match.group(2).replace("{", "[").replace("}", "]"))
            nbytes = sum(_HLO_SIZES[t] * math.prod(int(d) for d in dims.split(",") if d)
                         for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1)))
            out[_axes_spanned(groups, mesh_shape)] += nbytes
    return out


@pytest.mark.parametrize("mesh, fsdp", _cells((m, f) for m in MESHES if m != "data=1,model=8"
                                              for f in (False, True)))
def test_compiled_step_all_reduces_only_data_replicated_gradients_over_data(mesh, fsdp):
    """In the compiled program (after XLA's combiner), the all-reduces over 'data' move
    exactly this device's blocks of the data-replicated gradients plus a few scalars: under
    FSDP no weight matrix's gradient is all-reduced (they are reduce-scattered instead)."""
    got = layout(mesh, fsdp)
    strategy = got["strategy"]
    mesh_shape = dict(strategy.mesh.shape)
    replicated = sum(layout_lib._bytes(x, spec, mesh_shape) for x, spec in zip(
        jax.tree.leaves(strategy.params_shapes),
        jax.tree.leaves(strategy.param_specs, is_leaf=lambda s: isinstance(s, P)))
        if "data" not in ts.mesh_axes(spec))
    scalars = 2 + (1 if fsdp else 0)  # loss, accuracy; FSDP's grad-norm psum over 'data'
    assert _compiled_all_reduce_bytes(got["compiled"], mesh_shape)["data"] == \
        replicated + 4 * scalars
    if fsdp:
        assert "reduce-scatter(" in got["compiled"] and "all-gather(" in got["compiled"]
    else:
        assert "reduce-scatter(" not in got["compiled"] and "all-gather(" not in got["compiled"]


# ------------------------------------------------------------------ memory per device
MEMORY_LAYOUTS = [("data=8", False, 1), ("data=1,model=8", False, 8),
                  ("data=2,model=4", False, 4), ("data=8", True, 8),
                  ("data=2,model=4", True, 8)]


@pytest.fixture(scope="module")
def vit_cifar_state():
    """vit-cifar's training state as host zeros (only the shapes matter here)."""
    sc = step.StepConfig(PRESETS["vit-cifar"], Policy())
    optimizer = make_optimizer()
    shapes = jax.eval_shape(lambda: step.init_state(jax.random.key(0), sc.cfg, sc.policy,
                                                    optimizer))
    return sc, optimizer, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)


@pytest.mark.parametrize("mesh, fsdp, factor", MEMORY_LAYOUTS)
def test_measured_bytes_per_device_drop_by_the_sharding_factor(vit_cifar_state, mesh, fsdp,
                                                               factor):
    """vit-cifar (10.7 M params): the bytes of params and of optimizer state that really
    sit on each device, measured from the placed shards, are data-parallel's / factor
    (M under TP, D under FSDP, D*M for both) to within 5%: the part that stays replicated
    (biases, LayerNorms; under TP alone also the embeddings and the head) is under 5%.
    The script's own layout printout reports the same measured numbers."""
    sc, optimizer, state = vit_cifar_state
    strategy = ts.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp)
    placed = strategy.put_state(state)
    full = {k: sum(x.nbytes for x in jax.tree.leaves(state[k])) for k in ("params", "opt_state")}
    printed = strategy.measure_layout()
    for device in strategy.mesh.devices.flat:
        for k in ("params", "opt_state"):
            measured = layout_lib.bytes_per_device(placed[k], device)
            assert full[k] / factor <= measured <= 1.05 * full[k] / factor, (k, device)
            assert f"{measured:,}" in printed
    jax.tree.map(lambda x: x.delete(), placed)


def _documented_bytes() -> list[tuple[str, bool, int]]:
    """docs/parallelism.md's table of vit-cifar's parameter bytes per device: (mesh,
    fsdp, bytes) of each row."""
    text = (REPO / "docs" / "parallelism.md").read_text()
    rows = re.findall(r"^\| (data=[\w=,]+) \| (yes|no) \| ([\d,]+) \|", text, re.MULTILINE)
    return [(mesh, fsdp == "yes", int(n.replace(",", ""))) for mesh, fsdp, n in rows]


def test_the_documented_byte_table_is_exact(vit_cifar_state):
    """Every row of docs/parallelism.md's bytes-per-device table, to the byte, on every
    device, and the optimizer state "twice the params plus 8 bytes" (AdamW's two moments,
    laid out as the params, and its step counts, whole on every device)."""
    sc, optimizer, state = vit_cifar_state
    rows = _documented_bytes()
    assert len(rows) == 6
    for mesh, fsdp, documented in rows:
        strategy = ts.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp)
        placed = strategy.put_state(state)
        for device in strategy.mesh.devices.flat:
            params = layout_lib.bytes_per_device(placed["params"], device)
            assert params == documented, (mesh, fsdp, device)
            assert layout_lib.bytes_per_device(placed["opt_state"], device) == 2 * params + 8
        jax.tree.map(lambda x: x.delete(), placed)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("text, message", [
    ("data=2,model=2", "data*model = 4 but there are 8 devices"),
    ("model=3", "model=3 does not divide the 8 devices"),
    ("pipe=0", "expected data=D,model=M"),
    ("data=two", "expected data=D,model=M"),
    ("data=0,model=8", "expected data=D,model=M"),
    ("data=2,data=4", "expected data=D,model=M"),
    ("garbage", "expected data=D,model=M"),
])
def test_bad_mesh_is_a_usage_error(text, message):
    with pytest.raises(cli.UsageError, match=re.escape(message)):
        ts.ShardMapStrategy(SC, make_optimizer(), text)


def test_model_axis_must_divide_heads_and_mlp_width():
    with pytest.raises(cli.UsageError, match="4 heads do not divide by 8"):
        ts.ShardMapStrategy(step.StepConfig(PRESETS["tiny"], Policy()), make_optimizer(),
                            "data=1,model=8")
    odd_mlp = CFG.replace(mlp_dim=60)
    with pytest.raises(cli.UsageError, match="MLP width 60 does not divide by 8"):
        ts.ShardMapStrategy(step.StepConfig(odd_mlp, Policy()), make_optimizer(), "data=1,model=8")


def test_bad_mesh_from_the_command_line_exits_2(capsys):
    code = cli.main_guard(lambda: ts.main(
        ["--model", "tiny", "--dataset", "synthetic", "--steps", "1", "--batch", "8",
         "--mesh", "data=1,model=8", "--no-progress", "--eval-every", "0"]))
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: --mesh model=8: 4 heads do not divide by 8"


# ------------------------------------------------------------------ FSDP under bf16
def test_fsdp_gradients_are_float32_means_under_bf16():
    """Under a bf16 policy FSDP gathers the weights in bf16, but the master weights'
    gradients must come back as float32 means, exactly as data parallelism's pmean gives
    them: the same numbers up to summation order (1e-5 of the largest entry), not a mean
    rounded to bf16 (which is off by up to 2^-9 relative, ~2e-3)."""
    sc = dataclasses.replace(SC, policy=Policy.parse("bf16"))
    optimizer = make_optimizer()
    state, batch = initial_state(sc, optimizer), fixed_batches(1)[0]
    grads = {}
    for fsdp in (False, True):
        strategy = ts.ShardMapStrategy(sc, optimizer, "data=8", fsdp=fsdp)
        args = strategy_args(strategy, strategy.put_state(state), batch)
        grads[fsdp] = jax.device_get(grads_step(strategy).lower(*args).compile(FAST)(*args)[0])
    sharded = ["patch_embed/kernel", "blocks/attn/qkv/kernel", "blocks/mlp/fc1/kernel",
               "blocks/mlp/fc2/kernel", "head/kernel"]
    for name in sharded:
        dp, fs = (functools.reduce(lambda t, k: t[k], name.split("/"), grads[f])
                  for f in (False, True))
        assert fs.dtype == np.float32
        scale = float(np.max(np.abs(dp)))
        assert scale > 0
        assert float(np.max(np.abs(fs - dp))) <= 1e-5 * scale, name
