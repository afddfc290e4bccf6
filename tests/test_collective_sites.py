"""Where every collective of a training step comes from, read off its jaxpr.

The layout rule of the kit: collectives are written in exactly three kinds of place, the
two training scripts, the model's two tensor-parallel operators (`_copy_to_tp`,
`_reduce_from_tp`) and the pipeline (vit_pure/pipeline/program.py's sums over 'pipe' and
parameters' preparation; vit_pure/pipeline/tick.py's sends, `exchange`). Nothing else
dtype policy, the step math, accumulation, data) may emit one, not even implicitly: an
implicit broadcast of a replicated value to "varying" inside shard_map is free in the
forward pass but its transpose is a psum in the backward pass, the gradient pitfall.

JAX records, for every equation of a traced program, the user source line it came from,
and the backward pass's equations carry the line of the forward operation they
transpose. So walking the whole jaxpr of a training step (forward, backward, update) and
asking each data-moving collective for its line finds any hidden one.
"""
from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import source_info_util
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

import train_pmap
import train_shardmap as ts
from vit_pure import step
from vit_pure.config import PRESETS, Execution
from vit_pure.policy import Policy

# Primitives that move data between devices (pvary / pcast move nothing; their
# transposes, psums, are counted where they appear).
COLLECTIVES = {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
               "reduce_scatter", "ppermute", "all_to_all", "pbroadcast"}
ALLOWED = {
    "train_pmap.py": None,  # any function
    "train_shardmap.py": None,
    # vit_pure/pipeline/: the sums over 'pipe' and the parameters' preparation (FSDP's
    # gather), then the schedules' sends
    "program.py": {"pipeline_grads", "pipeline_eval", "prepare_params"},
    "tick.py": {"exchange"},
    "model.py": {"_copy_to_tp", "_reduce_from_tp"},
}
CFG = PRESETS["tiny"]
BATCH = 8


def collective_sites(closed_jaxpr) -> collections.Counter:
    """(primitive, file, function, line) of every collective in the jaxpr, nested
    jaxprs (jit, shard_map, pmap, scan, remat, custom VJPs) included."""
    sites = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in COLLECTIVES:
                frame = source_info_util.user_frame(eqn.source_info.traceback)
                where = ((os.path.basename(frame.file_name), frame.function_name,
                          frame.start_line) if frame else ("?", "?", 0))
                sites[(eqn.primitive.name, *where)] += 1
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return sites


def misplaced(sites) -> list:
    return [site for site in sites
            if site[1] not in ALLOWED or (ALLOWED[site[1]] is not None
                                          and site[2].split(".")[0] not in ALLOWED[site[1]])]


def _optimizer():
    return step.make_optimizer(step.OptimConfig(warmup_steps=1), 5)[0]


def _step_jaxpr(strategy, sc, optimizer):
    state = jax.device_get(step.init_state(jax.random.key(0), sc.cfg, sc.policy, optimizer))
    batch = strategy.put_batch(np.zeros((BATCH, 32, 32, 3), np.uint8),
                               np.zeros(BATCH, np.int32), np.arange(BATCH, dtype=np.int32))
    args = (strategy.put_state(state), *batch, strategy.put_replicated(step.step_key(0, 0, 0)))
    return jax.make_jaxpr(strategy.train_step)(*args)


@pytest.mark.parametrize("mesh, fsdp, policy, scan, schedule", [
    ("data=4,model=2", True, "bf16", False, "gpipe"),      # TP + FSDP, m=f32 custom VJPs
    ("data=2,model=4", False, "c=bf16,m=bf16", True, "gpipe"),  # TP in a layer scan
    ("data=2,model=2,pipe=2", True, "bf16", False, "gpipe"),  # pipeline + TP + FSDP, m=f32
    # the table-driven program (vit_pure/pipeline/tick.py): explicit vjps in lax.cond
    # branches, ppermutes outside them; interleaved's ring sends (each stage stores its
    # own chunks: no gather over 'pipe')
    ("data=2,model=2,pipe=2", True, "bf16", False, "interleaved"),
    # zb-h1 re-runs the chunk through pipeline/split.py's interpreter: the model's
    # tensor-parallel collectives must still be the model's
    ("data=2,model=2,pipe=2", True, "bf16", False, "zb-h1"),
])
def test_shard_map_step_collectives_are_where_the_code_writes_them(mesh, fsdp, policy, scan,
                                                                   schedule):
    sc = step.StepConfig(CFG, Policy.parse(policy), execution=Execution(scan=scan))
    optimizer = _optimizer()
    strategy = ts.ShardMapStrategy(sc, optimizer, mesh, fsdp=fsdp, schedule=schedule,
                                   virtual_stages=2 if schedule == "interleaved" else 1)
    sites = collective_sites(_step_jaxpr(strategy, sc, optimizer))
    print("\n".join(f"{n:3d} x {prim:15s} {f}:{line} ({fn})"
                    for (prim, f, fn, line), n in sorted(sites.items())))
    assert sites, "no collective found: the walk is broken"
    assert not misplaced(sites)
    files = {site[1] for site in sites}
    assert "train_shardmap.py" in files and "model.py" in files  # the pmean, TP's f/g
    if "pipe" in mesh:
        assert {"program.py", "tick.py"} <= files


def test_pmap_step_collectives_are_in_train_pmap():
    sc = step.StepConfig(CFG, Policy.parse("bf16"), execution=Execution(scan=False))
    optimizer = _optimizer()
    strategy = train_pmap.PmapStrategy(sc, optimizer, devices=jax.devices()[:2])
    sites = collective_sites(_step_jaxpr(strategy, sc, optimizer))
    assert sites and {site[1] for site in sites} == {"train_pmap.py"}


def test_the_walk_finds_an_implicit_collective():
    """The check can fail: a replicated weight multiplied with the per-device batch inside
    shard_map is broadcast implicitly, and its gradient's psum is charged to that line
    (here, this file)."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])

    def local_loss(w, x):
        return jnp.sum(jnp.matmul(x, w))  # w invariant, x varying: an implicit pvary

    f = jax.shard_map(lambda w, x: lax.pmean(jax.grad(local_loss)(w, x), "data"), mesh=mesh,
                      in_specs=(P(), P("data")), out_specs=P())
    sites = collective_sites(jax.make_jaxpr(f)(jnp.ones((3, 2)), jnp.ones((4, 3))))
    hidden = [site for site in misplaced(sites) if site[2].endswith("local_loss")]
    assert [site[:2] for site in hidden] == [("psum_invariant", "test_collective_sites.py")]
