"""Every layout under every dtype policy, layer loop and remat mode matches data parallel.

The matrix: layouts {TP, FSDP, PP, PP+TP+FSDP, pmap} x policies {fp32; bf16 with float32
matmul outputs (m=f32, the CPU default, which runs policy.py's custom VJP); bf16 with bf16
matmul outputs (m=bf16, the GPU default); fp16 with its dynamic loss scale} x four (loop,
remat) pairs: {unrolled, scan} x remat {none, gelu, block-save-dots} (`LOOPS`). Each cell
runs two training steps of a small model (dropout and stochastic depth on) on 8 fake CPU
devices and compares them with the shard_map data-parallel step (data=8) under the same
policy, loop and remat mode:

* the loss and the global gradient norm of both steps, relative to the reference, and
* the parameters after the two steps, relative to how far the reference moved them,

within a tolerance proportional to the compute dtype's machine epsilon (`tolerance`).
Different layouts sum in different orders (per-device partial sums, all-reduces, TP
partial products), so low-precision policies agree to a few roundings, not bit for bit.

The model with a convolutional stem, a mean-pooling head and locality self-attention
(ViTConfig.stem, .pool and .lsa: `STEM_CFG`) runs too. 100 cells in all: the full
product for the model without a stem (80) and a Latin square for the model with one (20).

Which cells run where (`_cells`): a Latin square per model gives pairwise coverage (each
model meets every layout x policy, layout x loop pair and policy x loop pair, and the two
squares share no triple). CI runs 25: the plain model's square (20) and the stem model's
fp32 row of its square (5). The default run takes 10 of them: each layout under fp32 (the
stem model) and under one low-precision policy (the plain model), which meets every policy
and every (loop, remat) pair; `python -m pytest -m slow` runs the other 15. The other 75
cells (the rest of the stem model's square, and of the full product) are marked
`exhaustive`: `python -m pytest -m exhaustive tests/test_layout_matrix.py` runs them. The
cells are grouped in one test class per policy (`TestFp32`, ...), so that the test
workers can share them out.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST

import train_pmap
import train_shardmap as ts
from vit_pure import step
from vit_pure.config import PRESETS, Execution
from vit_pure.policy import Policy

# Depth 2 splits into 2 pipeline stages, 4 heads and MLP 40 over model=2, width 24 over
# FSDP's data=8; 17 tokens of 8x8 patches.
CFG = PRESETS["tiny"].replace(name="matrix-test", depth=2)
# The same model behind a two-layer convolutional stem: 32x32 -> 16x16x8 -> 8x8x12, then
# the image's 8-pixel patches are 2x2 positions of the stem's output (48 values each); its
# head reads the mean of the patch tokens (pool "mean") and its attention is locality
# self-attention (lsa: per-head temperatures, split over "model" with the heads): the
# small-data model paths.
STEM_CFG = CFG.replace(name="matrix-test-stem", stem=(8, 12), pool="mean", lsa=True)
BATCH, STEPS = 16, 2
LAYOUTS = {  # name -> (mesh, fsdp); None: pmap
    "tp": ("data=4,model=2", False),
    "fsdp": ("data=8", True),
    "pp": ("data=4,pipe=2", False),
    "pp+tp+fsdp": ("data=2,model=2,pipe=2", True),
    "pmap": None,
}
POLICIES = {
    "fp32": "fp32",
    "bf16,m=f32": "p=f32,c=bf16,o=f32,m=f32",
    "bf16,m=bf16": "p=f32,c=bf16,o=f32,m=bf16",
    "fp16": "fp16",
}
LOOPS = [(False, "none"), (True, "block-save-dots"), (False, "gelu"),
         (True, "none")]  # (scan, remat)


def _cells(policy: str) -> list:
    """The cells of one policy: the default 10 unmarked, the other 15 of CI's 25 `slow`,
    the remaining 75 `exhaustive`.

    Each model runs a Latin square over (layout, policy) -> loop pair, 20 cells: layout i
    under policy j runs loop pair (i + j) mod 4 for the model with a stem and (i + j + 2)
    mod 4 for the model without. So each model meets every (layout, policy), every
    (layout, loop pair) and every (policy, loop pair), and the two squares share no
    (layout, policy, loop pair) triple: 40 of the 80. CI runs the plain model's square and
    the stem model's fp32 row; the stem model's other 15 cells and the 60 cells of the
    model without a stem that complete the full product are `exhaustive`.

    The default run takes two cells of the squares per layout: the stem model under fp32,
    and the model without a stem under one of the three low-precision policies (layout i
    under low-precision policy i mod 3). So each layout meets fp32 and a low precision,
    every policy runs, every (loop, remat) pair runs at least twice, and both models run."""
    low = [p for p in POLICIES if p != "fp32"]
    j = list(POLICIES).index(policy)
    cells = []
    for (i, layout), (k, (scan, remat)) in itertools.product(enumerate(LAYOUTS),
                                                             enumerate(LOOPS)):
        name = f"{layout}-{'scan' if scan else 'unrolled'}-{remat}"
        if k == (i + j + 2) % len(LOOPS):
            marks = () if policy == low[i % len(low)] else (pytest.mark.slow,)
        else:
            marks = (pytest.mark.exhaustive,)
        cells.append(pytest.param(layout, scan, remat, False, marks=marks, id=name))
        if k == (i + j) % len(LOOPS):
            marks = () if policy == "fp32" else (pytest.mark.exhaustive,)
            cells.append(pytest.param(layout, scan, remat, True, marks=marks,
                                      id=f"{name}-stem"))
    return cells


def tolerances(policy: Policy) -> tuple[float, float]:
    """(metrics, params) relative tolerances for a policy, from the machine epsilon of its
    compute dtype (fp32 1.2e-7, fp16 9.8e-4, bf16 7.8e-3) and of float32.

    Loss and gradient norm: half an eps of the compute dtype (one rounding) plus 4 float32
    eps. The params: 32 eps of the compute dtype plus 256 float32 eps, relative to the
    distance the reference moved them: Adam divides each gradient by its own magnitude,
    so a gradient element near zero that two summation orders round differently moves its
    parameter by a different fraction of the learning rate. (On 8 fake CPU devices the
    largest differences seen were 0.95 float32 eps in the metrics under fp32, 0.24 bf16
    eps under bf16; in the params 125 float32 eps under fp32, 7 bf16 eps, 19 fp16 eps.)"""
    eps, eps32 = float(jnp.finfo(policy.compute_dtype).eps), float(jnp.finfo(jnp.float32).eps)
    return eps / 2 + 4 * eps32, 32 * eps + 256 * eps32


def _optimizer():
    return step.make_optimizer(step.OptimConfig(warmup_steps=1), STEPS)[0]


def _batches():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 256, (BATCH, 32, 32, 3), dtype=np.uint8),
             rng.integers(0, 10, (BATCH,), dtype=np.int32),
             np.arange(BATCH, dtype=np.int32) + i * BATCH,
             step.step_key(0, 0, i)) for i in range(STEPS)]


@functools.cache
def _initial_state(policy_text: str, cfg=CFG) -> dict:
    policy = Policy.parse(policy_text)
    # Built in one compile, not op by op.
    state = jax.jit(lambda key: step.init_state(key, cfg, policy, _optimizer()))(
        jax.random.key(0))
    if state["loss_scale"].dynamic:
        # float16: start the dynamic loss scale where these gradients do not overflow, so
        # that both steps update the params (from 2^15 both would be skipped).
        state["loss_scale"] = dataclasses.replace(state["loss_scale"],
                                                  scale=jnp.asarray(2.0 ** 6, jnp.float32))
    return jax.device_get(state)


@functools.cache
def run(layout: str, policy_text: str, scan: bool, remat: str, cfg=CFG,
        attention: str = "einsum", dropout_masks: str = "bernoulli") -> dict:
    """Two steps of one cell from the same initial state and batches: the host metrics
    of each step and the final host params. layout "dp" is the reference, data=8. The
    last block on the class token, as the scripts run it (the pipelines, which keep its
    every row, then check that too)."""
    execution = Execution(scan=scan, remat=remat, attention=attention,
                          dropout_masks=dropout_masks, last_block="class-token")
    sc = step.StepConfig(cfg, Policy.parse(policy_text), execution=execution)
    optimizer = _optimizer()
    if layout == "pmap":
        strategy = train_pmap.PmapStrategy(sc, optimizer, devices=jax.devices()[:8])
    else:
        mesh, fsdp = LAYOUTS.get(layout) or ("data=8", False)
        strategy = ts.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp)
    state = strategy.put_state(_initial_state(policy_text, cfg))
    compiled, metrics = None, []
    for images, labels, ids, key in _batches():
        args = (state, *strategy.put_batch(images, labels, ids), strategy.put_replicated(key))
        compiled = compiled or strategy.train_step.lower(*args).compile(FAST)
        state, m = compiled(*args)
        metrics.append(strategy.metrics_to_host(m))
    return {"metrics": metrics, "params": strategy.host_state(state)["params"]}


def _distance(a, b) -> float:
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(x, np.float64)
                                                - np.asarray(y, np.float64))))
                         for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)))


def assert_matches(ref: dict, got: dict, policy_text: str, cfg=CFG) -> None:
    """`got` (a `run`) equals the reference `ref` within `tolerances`: the loss and
    gradient norm of each step, and the final params relative to how far the reference
    moved them."""
    tol_metrics, tol_params = tolerances(Policy.parse(policy_text))
    for i, (r, g) in enumerate(zip(ref["metrics"], got["metrics"], strict=True)):
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert g["loss"] == pytest.approx(r["loss"], rel=tol_metrics), f"step {i + 1} loss"
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=tol_metrics), \
            f"step {i + 1} gradient norm"
    moved = _distance(ref["params"], _initial_state(policy_text, cfg)["params"])
    assert moved > 0  # both steps were taken (none skipped by the loss scale)
    assert _distance(got["params"], ref["params"]) <= tol_params * moved


# One class per policy, the columns of the matrix: pytest-xdist (pyproject.toml: `--dist
# loadscope`) gives a class's cells, which share the policy's reference runs, to one
# worker, and the four classes to whichever worker is free, so the matrix spreads over
# the workers instead of running all on one.
class _PolicyColumn:
    POLICY = ""

    def test_layout_matches_data_parallel(self, layout, scan, remat, stem):
        """The reference is the plain data-parallel step (unrolled, no remat) under the
        same policy, of the same model: the layer scan and remat give the same numbers, so
        one reference per policy and model checks them too."""
        text, cfg = POLICIES[self.POLICY], STEM_CFG if stem else CFG
        assert_matches(run("dp", text, False, "none", cfg),
                       run(layout, text, scan, remat, cfg), text, cfg)


def pytest_generate_tests(metafunc):
    if metafunc.definition.name == "test_layout_matches_data_parallel":
        metafunc.parametrize("layout, scan, remat, stem", _cells(metafunc.cls.POLICY))


class TestFp32(_PolicyColumn):
    POLICY = "fp32"


class TestBf16MatmulF32(_PolicyColumn):
    POLICY = "bf16,m=f32"


class TestBf16MatmulBf16(_PolicyColumn):
    POLICY = "bf16,m=bf16"

    def test_tolerances_separate_a_real_difference(self):
        """The check can fail: a real change of the program (the same data-parallel step with
        dropout and stochastic depth off) leaves the tolerance in the loss and gradient norm
        of the first step, under bf16, the loosest policy."""
        text = POLICIES["bf16,m=bf16"]
        tol_metrics, _ = tolerances(Policy.parse(text))
        ref = run("dp", text, False, "none")["metrics"][0]
        off = run("dp", text, False, "none", cfg=CFG.replace(dropout=0.0, drop_path=0.0))
        for name in ("loss", "grad_norm"):
            print(name, off["metrics"][0][name] / ref[name] - 1, tol_metrics)
            assert off["metrics"][0][name] != pytest.approx(ref[name], rel=tol_metrics)


class TestFp16(_PolicyColumn):
    POLICY = "fp16"


def test_gap_pool_under_pipeline_tensor_and_fsdp_matches_data_parallel():
    """The model without a class token (pool "gap": 16 tokens, no cls_token parameter, the
    head on the mean of every token) under the layout that splits the most (pipeline x
    tensor x FSDP, where the embedding and the head sit on different stages) matches data
    parallel."""
    cfg = CFG.replace(name="matrix-test-gap", pool="gap")
    assert_matches(run("dp", "fp32", False, "none", cfg),
                   run("pp+tp+fsdp", "fp32", False, "none", cfg), "fp32", cfg)


def test_ci_cells_cover_every_pair():
    """The 25 cells CI runs (all but the `exhaustive` ones) cover, for the model without a
    stem, every (layout, policy), (layout, loop) and (policy, loop) pair, and for the stem
    model every layout and loop pair under fp32; the two models' squares share no
    (policy, layout, loop) triple; the 10 default cells run every layout, policy and loop
    pair; all 100 are distinct."""
    cells = {policy: _cells(policy) for policy in POLICIES}
    rows = [(policy, *c.values, {m.name for m in c.marks}) for policy in POLICIES
            for c in cells[policy]]
    assert len({r[:5] for r in rows}) == len(rows) == 100
    square = [r for r in rows if r[4] or "exhaustive" not in r[5]]  # both squares
    assert len(square) == 40
    squares = []
    for stem in (False, True):
        got = [(policy, layout, (scan, remat)) for policy, layout, scan, remat, s, _ in square
               if s == stem]
        assert len(got) == 20
        for a, b in ((0, 1), (0, 2), (1, 2)):
            want = len(POLICIES), len(LAYOUTS), len(LOOPS)
            assert len({(g[a], g[b]) for g in got}) == want[a] * want[b]
        squares.append(set(got))
    assert not squares[0] & squares[1]  # the two models' squares share no triple
    ci = [r for r in rows if "exhaustive" not in r[5]]
    assert len(ci) == 25 and {r[:4] for r in ci if not r[4]} == {
        (p, layout, scan, remat) for p, layout, (scan, remat) in squares[0]}
    stem_ci = [r for r in ci if r[4]]
    assert {r[0] for r in stem_ci} == {"fp32"} and {r[1] for r in stem_ci} == set(LAYOUTS)
    assert {(r[2], r[3]) for r in stem_ci} == set(LOOPS)
    default = [r for r in rows if not r[5]]
    assert len(default) == 10
    assert {r[1] for r in default} == set(LAYOUTS)
    assert {r[0] for r in default} == set(POLICIES)
    assert {(r[2], r[3]) for r in default} == set(LOOPS)
