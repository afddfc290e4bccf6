r"""ViT training with `jax.shard_map` over a named Mesh: every collective written out.

    python train_shardmap.py --batch 4096 --dtype bf16 --data-dir ./data
    python train_shardmap.py --model tiny --dataset synthetic --steps 20 --cpu-devices 8 \
        --mesh data=2,model=4 --fsdp

`--mesh data=D,model=M,pipe=S`: 'data' splits the batch (with `--fsdp` also the weights and
their optimizer state, ZeRO-3: `fsdp_gather`); 'model' is Megatron-style tensor
parallelism (its two operators in vit_pure/model.py); 'pipe' is pipeline parallelism
(`--microbatches K`, vit_pure/pipeline/). Which array splits over which axis: the rule
tables `TP_RULES` and `FSDP_RULES`. Inside `shard_map` nothing moves unless a collective
says so; the data-parallel and FSDP ones are in this file. The gradient pitfall (a
replicated parameter's gradient comes back already summed over 'data') is handled at
`global_grads`; tests/test_train.py and tests/test_model_parallel.py check it.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import sys

# isort: off
if __name__ == "__main__" and not {"-h", "--help"} & set(sys.argv) and (
        "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", "")):
    # The first line, before JAX loads (seconds on a busy CPU). The restart with huge
    # pages (vit_pure/run/hostmem.py) sets that tunable, so it is said once.
    print(f"{os.path.basename(__file__)}: starting: loading JAX", flush=True)
import vit_pure  # noqa: E402, F401 (before jax: JAX's CUDA plugin without a GPU, quiet.py)
# isort: on
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from vit_pure import layout, pipeline, step
from vit_pure.layout import entry_axes, mesh_axes
from vit_pure.layout import is_spec as _is_spec
from vit_pure.layout import like_param as _like_param
from vit_pure.model import Parallel, init_params, param_axes
from vit_pure.run import accum, cli, distributed, entry, hostmem

DATA, MODEL, PIPE = "data", "model", "pipe"

# ------------------------------------------------------------------------ sharding rules
# Logical axis name -> mesh axis. Every axis not named here is replicated.
#
# Tensor parallelism: attention heads (q/k/v kernels and biases, the output projection's
# input) and MLP hidden units (fc1's output, fc2's input) are split over 'model'.
TP_RULES = {"heads": MODEL, "mlp": MODEL}
# FSDP (--fsdp): the embedding axis of every weight *matrix* (the kernels and the position
# embedding) is split over 'data', if it divides. Vectors (biases, LayerNorm, the class
# token) stay replicated: well under 1% of the bytes, and each would cost a collective.
FSDP_RULES = {"embed": DATA}
FSDP_MIN_RANK = 2  # a leaf counts as a matrix if it has >= 2 axes besides 'layers'
# Pipeline parallelism (pipe=S > 1): the stacked blocks' layer axis is split over 'pipe',
# so each stage holds depth/S contiguous layers. Everything else is replicated over 'pipe'.
PIPE_RULES = {"layers": PIPE}


def parse_mesh(text: str | None, n_devices: int) -> dict[str, int]:
    """`data=D[,model=M][,pipe=S]` -> {'data': D, 'model': M, 'pipe': S}; D*M*S must
    equal the device count (D defaults to what is left)."""
    sizes = {DATA: None, MODEL: 1, PIPE: 1}
    seen = set()
    if text:
        for item in text.split(","):
            name, sep, value = item.partition("=")
            name = name.strip()
            problem = (f"{item.strip()!r} is not AXIS=SIZE" if not sep else
                       f"unknown axis {name!r}" if name not in sizes else
                       f"axis {name!r} given twice" if name in seen else
                       f"{name}={value.strip()!r} is not a positive integer"
                       if not value.strip().isdigit() or int(value) < 1 else None)
            if problem is not None:
                raise cli.UsageError(
                    f"--mesh {text!r}: expected data=D,model=M,pipe=S with positive "
                    f"integers; {problem}")
            seen.add(name)
            sizes[name] = int(value)
    if sizes[DATA] is None:
        rest = sizes[MODEL] * sizes[PIPE]
        if n_devices % rest:
            what = f"model={rest}" if sizes[PIPE] == 1 else f"model*pipe = {rest}"
            raise cli.UsageError(f"--mesh: {what} does not divide the {n_devices} devices")
        sizes[DATA] = n_devices // rest
    total = sizes[DATA] * sizes[MODEL] * sizes[PIPE]
    if total != n_devices:
        what = "data*model" if sizes[PIPE] == 1 else "data*model*pipe"
        raise cli.UsageError(
            f"--mesh {text}: {what} = {total} but there "
            + ("is 1 device" if n_devices == 1 else f"are {n_devices} devices"))
    return sizes


def param_specs(cfg, mesh_sizes: dict[str, int], fsdp: bool = False) -> dict:
    """Each parameter's PartitionSpec, from its logical axis names and the rule tables."""
    m, d = mesh_sizes[MODEL], mesh_sizes[DATA]
    if m > 1:
        if cfg.heads % m:
            raise cli.UsageError(f"--mesh model={m}: {cfg.heads} heads do not divide by {m}")
        if cfg.mlp_dim % m:
            raise cli.UsageError(
                f"--mesh model={m}: MLP width {cfg.mlp_dim} does not divide by {m}")
    pipe = mesh_sizes.get(PIPE, 1)
    if pipe > 1:  # the pipeline's own rule (it checks again inside the schedule)
        try:
            pipeline.check_pipeline(cfg, pipe, 1)
        except ValueError as e:
            raise cli.UsageError(f"--mesh pipe={pipe}: {e}") from None
    shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))

    def spec(names, shape):
        is_matrix = sum(n != "layers" for n in names) >= FSDP_MIN_RANK
        axes = []
        for name, size in zip(names, shape.shape):
            axis = TP_RULES.get(name) if m > 1 else None
            if axis is None and pipe > 1:
                axis = PIPE_RULES.get(name)
            if axis is None and fsdp and d > 1 and is_matrix and size % d == 0:
                axis = FSDP_RULES.get(name)
            axes.append(axis)
        return P(*axes)

    return jax.tree.map(spec, param_axes(cfg), shapes, is_leaf=lambda x: isinstance(x, tuple))


# ---------------------------------------------------------------------------------- FSDP
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fsdp_gather(shard: jax.Array, axis: int, dtype) -> jax.Array:
    """FSDP's collective pair for one weight: this device's shard -> the whole weight.

    Forward: cast the (float32 master) shard to the compute `dtype`, then all-gather over
    'data' along `axis`: the weight travels in the compute dtype. Backward
    (`_fsdp_gather_bwd`): the matching reduce-scatter of the whole weight's gradient, in
    float32, so each device receives the gradient of its own shard averaged over 'data'
    in the shard's own dtype: float32 master weights get a float32 mean, exactly as the
    data-parallel `pmean` gives the replicated ones (never a bf16-rounded mean).

    Autodiff would derive the same reduce-scatter by itself (under check_vma the transpose
    of a varying all_gather is psum_scatter, a *sum*); the custom VJP writes it here so
    that the backward collective, its float32 accumulation and the division that makes it
    the mean over 'data' are all in the code, not implied. tests/test_model_parallel.py
    checks the result against data-parallel and single-device gradients.

    The backward pass needs the whole weights again. By default autodiff keeps the gathered
    copies (they are residuals of the matmuls), so the forward gathers once and peak memory
    holds every layer's whole weights for a moment. With `--remat block` each block is
    recomputed in the backward pass, this gather included: the weights are gathered a
    second time there and only one layer's whole weights exist at a time (ZeRO-3's memory
    profile, for one more all-gather per weight). In a pipeline each stage gathers its own
    layers once per step, before the tick loop.
    """
    # All-gather over 'data': the D shards of this weight, concatenated along `axis`.
    return lax.all_gather(shard.astype(dtype), DATA, axis=axis, tiled=True)


def _fsdp_gather_fwd(shard, axis, dtype):
    # Residual: a zero-size array carrying the shard's dtype (the gradient's dtype).
    return fsdp_gather(shard, axis, dtype), jnp.zeros((0,), shard.dtype)


def _fsdp_gather_bwd(axis, dtype, like, grad_whole):
    # Reduce-scatter over 'data': sum the D devices' gradients of the whole weight (in
    # float32) and give each device the slice for its shard; / D makes it the mean.
    grad_shard = lax.psum_scatter(grad_whole.astype(jnp.float32), DATA,
                                  scatter_dimension=axis, tiled=True)
    return ((grad_shard / lax.axis_size(DATA)).astype(like.dtype),)


fsdp_gather.defvjp(_fsdp_gather_fwd, _fsdp_gather_bwd)


def fsdp_gather_axes(specs) -> dict[str, int]:
    """For the model's `gather` hook: the FSDP-sharded parameters by full path
    ("patch_embed/kernel", "blocks/mlp/fc1/kernel", ...) -> the axis to all-gather over
    'data' *as the model sees the leaf at the gather*. Parameters not split over 'data'
    are absent. The blocks are gathered one layer at a time, after the leading layer
    axis is sliced off (model.compute_params), so their axis is the spec's minus one."""
    table = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]:
        name = "/".join(str(k.key) for k in path)
        where = [i for i, entry in enumerate(spec) if DATA in entry_axes(entry)]
        if where:
            table[name] = where[0] - (1 if name.startswith("blocks/") else 0)
    return table


def make_gather(axes_table: dict[str, int], dtype):
    """The model's `gather(tree, path)` hook: all-gather, in the compute `dtype`, every
    FSDP-sharded leaf of the params subtree at `path` ("" or "blocks"); leave the rest."""
    def gather(tree, path):
        def one(key_path, x):
            name = "/".join([path] * bool(path) + [str(k.key) for k in key_path])
            axis = axes_table.get(name)
            return x if axis is None else fsdp_gather(x, axis, dtype)
        return jax.tree_util.tree_map_with_path(one, tree)
    return gather


def over_data(spec) -> bool:
    """Whether a leaf laid out as `spec` is split over 'data' (FSDP)."""
    return DATA in mesh_axes(spec)


def global_norm(grads, specs):
    """The global gradient norm (for clipping and the overflow check), inside shard_map.
    Each device holds blocks of the sharded gradients (laid out as `specs`): sum the
    squares of each group of leaves locally, then all-reduce (sum) that scalar over the
    mesh axes the group is split over ('model' for TP, 'data' for FSDP, 'pipe' for the
    blocks of a pipeline, or several)."""
    groups = collections.defaultdict(list)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=_is_spec)):
        groups[tuple(sorted(mesh_axes(s)))].append(g)
    total = jnp.zeros((), jnp.float32)
    for axes, leaves in sorted(groups.items()):
        sq = step.sum_of_squares(leaves)
        total = total + (lax.psum(sq, axes) if axes else sq)
    return jnp.sqrt(total)


# ------------------------------------------------------------------------------ strategy
class ShardMapStrategy:
    name = "shard_map"

    def __init__(self, sc: step.StepConfig, optimizer, mesh_text: str | None = None,
                 devices=None, fsdp: bool = False, microbatches: int | None = None,
                 schedule: str = "gpipe", virtual_stages: int = 1):
        devices = jax.devices() if devices is None else devices
        sizes = parse_mesh(mesh_text, len(devices))
        # 'model' innermost: neighbouring devices (the fastest links) carry tensor
        # parallelism's all-reduces in every layer; 'pipe' moves one activation per tick.
        self.mesh = jax.make_mesh((sizes[DATA], sizes[PIPE], sizes[MODEL]), (DATA, PIPE, MODEL),
                                  axis_types=(AxisType.Auto,) * 3, devices=devices)
        self.batch_divisor, self.fsdp, self.optimizer = sizes[DATA], fsdp, optimizer
        self.tp_axis = MODEL if sizes[MODEL] > 1 else None
        self._set_pipeline(sc, sizes[PIPE], microbatches, schedule, virtual_stages)
        if self.stages > 1:  # what the pipeline runs of it (every row of the last block)
            sc = pipeline.step_config(sc)
        self.sc = sc
        self._set_state_specs(sizes)
        self._build(optimizer)

    def _set_pipeline(self, sc, stages: int, microbatches: int | None, schedule: str,
                      virtual_stages: int) -> None:
        """The pipeline's S stages, K micro-batches per device slice (default K = S), its
        schedule's table (vit_pure/pipeline/schedules.py) and the blocks' order on the
        devices; a UsageError for flags that ask for a pipeline without one, or for a
        schedule the stages, micro-batches and depth do not allow."""
        self.stages, self.schedule, self.virtual_stages = stages, schedule, virtual_stages
        if microbatches is not None and stages == 1:
            raise cli.UsageError("--microbatches needs a pipeline: add pipe=S to --mesh")
        self.microbatches = stages if microbatches is None else microbatches
        if self.microbatches < 1:
            raise cli.UsageError(f"--microbatches must be >= 1, got {self.microbatches}")
        if stages == 1 and (schedule != "gpipe" or virtual_stages != 1):
            raise cli.UsageError("--pipeline-schedule / --virtual-stages need a pipeline: "
                                 "add pipe=S to --mesh")
        try:
            pipeline.schedules.check_schedule(schedule, stages, self.microbatches,
                                              virtual_stages)
            if (sc.cfg.depth // stages) % virtual_stages:
                raise ValueError(f"--virtual-stages {virtual_stages}: the "
                                 f"{sc.cfg.depth // stages} blocks per stage do not "
                                 f"split into {virtual_stages} chunks")
        except ValueError as e:
            if stages > 1:
                raise cli.UsageError(str(e)) from None
        # Interleaved: each stage's slice of the stacked blocks is its V chunks (virtual
        # stages s, S + s, ...: pipeline.block_order), so the blocks are stored in that
        # order on the devices. put_state applies it, host_state undoes it: checkpoints
        # and exports keep the layers in order.
        self.block_order = (pipeline.block_order(sc.cfg.depth, stages, virtual_stages)
                            if stages > 1 and virtual_stages > 1 else None)

    def _set_state_specs(self, sizes: dict[str, int]) -> None:
        """Where every array of the training state lives on the mesh (`state_specs`), and
        the layout table the start-up log prints."""
        sc, optimizer = self.sc, self.optimizer
        self.param_specs = param_specs(sc.cfg, sizes, self.fsdp)
        self.params_shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), sc.cfg))
        self.opt_state_shapes = jax.eval_shape(optimizer.init, self.params_shapes)
        # The optimizer state is laid out like the parameters it belongs to (Adam's mu and
        # nu; --layer-decay's factors, whose size-1 axes stay whole); its other leaves
        # (the step count) are replicated.
        self.opt_specs = optax.tree_map_params(
            optimizer, _like_param, self.opt_state_shapes, self.param_specs,
            transform_non_params=lambda _: P(), is_leaf=_is_spec)
        self.state_specs = {"params": self.param_specs, "opt_state": self.opt_specs,
                            "loss_scale": P(), "step": P()}
        if sc.ema_decay > 0:  # --ema: the weights' moving average, sharded like the weights
            self.state_specs["ema"] = self.param_specs
        self._measured_line = None
        self.layout = layout.format_table(self.param_specs, self.params_shapes,
                                          self.opt_state_shapes, self.opt_specs, optimizer,
                                          dict(self.mesh.shape))

    def describe(self) -> str:
        fsdp = "on" if any(DATA in mesh_axes(s) for s in
                           jax.tree.leaves(self.param_specs, is_leaf=_is_spec)) else "off"
        schedule = ("\n" + pipeline.describe(self.sc.cfg.depth, self.stages, self.microbatches,
                                              self.schedule, self.virtual_stages)
                    if self.stages > 1 else "")
        if 1 < self.stages and self.microbatches < self.stages:  # most ticks idle
            schedule += (f"\nwarning: --microbatches {self.microbatches} is fewer than the "
                         f"{self.stages} pipeline stages, so each stage waits most of the "
                         f"step (the bubble above); give --microbatches {self.stages} or more")
        return (f"mesh {dict(self.mesh.shape)} over {self.mesh.devices.size} "
                f"{self.mesh.devices.flat[0].platform} devices, tensor parallel "
                f"{'on' if self.tp_axis else 'off'}, FSDP {fsdp}; layout:\n{self.layout}\n"
                f"  {self._measured()}{schedule}")

    def check_batch(self, global_batch: int, flag: str = "--batch", accum_steps: int = 1) -> None:
        """UsageError unless the global batch splits over the processes and the 'data'
        axis, each device's slice into `accum_steps` micro-batches, and each of those
        into the pipeline's micro-batches (accumulation nests outside the pipeline)."""
        per = accum.check_accum_steps(accum_steps, global_batch, self.batch_divisor, flag)
        per //= accum_steps
        if self.stages > 1 and per % self.microbatches:
            raise cli.UsageError(
                f"{flag} {global_batch}: the per-device batch {per} (over data="
                f"{self.batch_divisor}"
                + (f" and {accum_steps} accumulation steps" if accum_steps > 1 else "")
                + f") does not divide into --microbatches {self.microbatches}")

    def _measured(self) -> str:  # measured once per strategy: describe() may be called again
        if self._measured_line is None:
            self._measured_line = self.measure_layout()
        return self._measured_line

    def measure_layout(self) -> str:
        shapes = {"params": self.params_shapes, "opt_state": self.opt_state_shapes}
        return layout.measure(self.mesh, {k: self.state_specs[k] for k in shapes}, shapes)

    # -------------------------------------------------------------------- the two steps
    def _build(self, optimizer):
        sc, specs = self.sc, self.param_specs
        # Where the model's own collectives go: tensor parallelism's axis, FSDP's gather
        # hook, the pipeline's axis (model.Parallel).
        par = Parallel(tp_axis=self.tp_axis,
                       gather=(make_gather(fsdp_gather_axes(specs), sc.policy.compute_dtype)
                               if self.fsdp else None),
                       pipe_axis=PIPE if self.stages > 1 else None)

        def global_grads(state, images, labels, example_ids, key):
            # THE GRADIENT PITFALL. With check_vma=True shard_map tracks which values vary
            # across each mesh axis. Replicated params (P() over 'data') are *invariant*;
            # multiplying them with the per-device (varying) batch broadcasts them to
            # varying, and the transpose of that broadcast in the backward pass is a psum:
            # grad of the local loss would already be the *sum* over devices, and the
            # pmap-style pmean(grad(local_loss)) N times too large, silently. So mark them
            # varying *before* differentiating (autodiff then reduces nothing), and write
            # the one pmean below. FSDP shards already vary over 'data' (each device holds
            # another shard); their reduction is fsdp_gather's reduce-scatter.
            params = jax.tree.map(
                lambda x, s: x if over_data(s) else lax.pcast(x, DATA, to="varying"),
                state["params"], specs)
            if self.stages > 1:  # pipelined over 'pipe' (vit_pure/pipeline/)
                grads, metrics = pipeline.pipeline_grads(
                    sc, params, state["loss_scale"], images, labels, example_ids, key,
                    par=par, microbatches=self.microbatches, schedule=self.schedule,
                    virtual=self.virtual_stages)
            else:
                grads, metrics = step.local_grads(
                    sc, params, state["loss_scale"], images, labels, example_ids, key,
                    par=par)
            # All-reduce (mean) over 'data' of the gradients of the data-replicated params:
            # local -> global mean loss. FSDP shards skip this: their gradients were
            # reduce-scattered (mean) over 'data' in fsdp_gather's backward pass. (The
            # reductions over 'model' happened inside the model's f/g operators.)
            grads = jax.tree.map(lambda g, s: g if over_data(s) else lax.pmean(g, DATA),
                                 grads, specs)
            # All-reduce (mean) of the scalar metrics, for logging.
            metrics = lax.pmean(metrics, DATA)
            return grads, {**metrics, "grad_norm": global_norm(grads, specs)}

        def train_step(state, images, labels, example_ids, key):
            grads, metrics = global_grads(state, images, labels, example_ids, key)
            # Each device updates its own block of the params and optimizer state.
            state, _ = step.apply_gradients(sc, state, grads, metrics["grad_norm"], optimizer)
            return state, metrics

        def eval_step(state, images, labels, mask):
            if self.stages > 1:
                sums = pipeline.pipeline_eval(sc, state["params"], images, labels, mask,
                                              par=par, microbatches=self.microbatches,
                                              virtual=self.virtual_stages)
            else:
                sums = step.local_eval(sc, state["params"], images, labels, mask, par=par)
            # All-reduce (sum) of loss / correct / count over 'data' (padding is masked).
            return lax.psum(sums, DATA)

        def features_step(state, images):
            # A frozen backbone's features (--trainable head: vit_pure/run/probe.py), each
            # device's rows of the batch; no collective beyond the model's own.
            return step.local_features(sc, state["params"], images, par=par)

        batch = P(DATA)
        self.train_step = jax.jit(jax.shard_map(
            train_step, mesh=self.mesh,
            in_specs=(self.state_specs, batch, batch, batch, P()),
            out_specs=(self.state_specs, P())), donate_argnums=0)
        # The per-device function of train_step's first half (the gradients of the global
        # mean loss, laid out like the params, and the metrics), not compiled here: tests
        # wrap it in shard_map with the same specs to compare gradients across layouts.
        self.global_grads = global_grads
        self.eval_step = jax.jit(jax.shard_map(
            eval_step, mesh=self.mesh,
            in_specs=(self.state_specs, batch, batch, batch), out_specs=P()))
        # Through a pipeline the features would need a schedule of their own: a probe
        # with pipe > 1 runs the frozen backbone in every training step instead.
        self.features_step = None if self.stages > 1 else jax.jit(jax.shard_map(
            features_step, mesh=self.mesh, in_specs=(self.state_specs, batch),
            out_specs=batch))

    # -------------------------------------------------------------------- placement
    def _sharding(self, spec):
        return NamedSharding(self.mesh, spec)

    def _in_block_order(self, state, order):
        """`state` (or the part of it given) with the layer axis of every stacked-block
        leaf (params, EMA, their optimizer state) taken in `order`; None: as it is."""
        if order is None:
            return state
        axes = jax.tree.map(lambda names: names.index("layers") if "layers" in names else -1,
                            param_axes(self.sc.cfg), is_leaf=lambda x: isinstance(x, tuple))

        def take(x, axis):  # (a size-1 axis: a state leaf of a frozen param, whole)
            if axis < 0 or np.shape(x)[axis] == 1:
                return x
            return np.take(np.asarray(x), order, axis=axis)
        out = dict(state)
        for k in ("params", "ema"):
            if k in out:
                out[k] = jax.tree.map(take, out[k], axes)
        if "opt_state" in out:
            out["opt_state"] = optax.tree_map_params(self.optimizer, take, out["opt_state"],
                                                     axes, transform_non_params=lambda x: x)
        return out

    def put_state(self, state):
        # Each process places the blocks its own devices hold (every process has the
        # whole host state; with several processes some devices belong to others).
        shardings = jax.tree.map(self._sharding, self.state_specs, is_leaf=_is_spec)
        return distributed.put_global(self._in_block_order(state, self.block_order),
                                      shardings)

    def put_batch(self, *arrays):
        # This process's rows of the global batch (all of it with one process) -> the
        # global batch, split over 'data' (and replicated over 'model' and 'pipe').
        return tuple(distributed.global_batch(a, self._sharding(P(DATA))) for a in arrays)

    def put_replicated(self, x):
        return distributed.put_global(x, self._sharding(P()))

    def host_state(self, state) -> dict:
        # The whole state on every process: blocks on other processes are all-gathered;
        # the layers back in order (the inverse of put_state's block order).
        return self._in_block_order(jax.tree.map(distributed.to_host, state),
                                    None if self.block_order is None
                                    else np.argsort(self.block_order))

    def batch_to_host(self, x) -> np.ndarray:
        # Rows split over 'data': the whole batch on every process (other processes'
        # rows all-gathered).
        return distributed.to_host(x)

    def metrics_to_host(self, metrics) -> dict:
        # The metrics are replicated (P()): every process reads its own copy.
        return {k: float(distributed.to_host(v)) for k, v in metrics.items()}


def build_parser():
    parser = cli.build_parser(__doc__.splitlines()[0])
    g = parser.add_argument_group("parallelism (the mesh)")
    g.add_argument("--mesh", default=None,
                   help="mesh sizes, e.g. data=8 or data=2,model=4 or "
                        "data=2,model=2,pipe=2 (default: all devices on data); model "
                        "splits heads and MLP width, pipe the layers into stages")
    g.add_argument("--microbatches", type=int, default=None, metavar="K",
                   help="pipeline (pipe=S > 1): each device's batch slice runs as K "
                        "micro-batches; bubble fraction (S-1)/(K+S-1) (default: S)")
    g.add_argument("--pipeline-schedule", default="gpipe", choices=pipeline.SCHEDULES,
                   help="pipeline schedule (vit_pure/pipeline/schedules.py): gpipe (all "
                        "forwards, then all backwards), 1f1b (each stage holds at most "
                        "S micro-batches, not K), interleaved (with --virtual-stages), "
                        "zb-h1 (weight gradients fill the bubble)")
    g.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="interleaved schedule: V chunks of layers per stage (default 1)")
    g.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=False,
                   help="shard weight matrices and their optimizer state over 'data' "
                        "(ZeRO-3); the gathered weights are kept for the backward "
                        "pass, add --remat block to gather them again there instead "
                        "(default: off)")
    return parser


def strategy_from_args(args: argparse.Namespace, sc, optimizer, devices=None):
    """The strategy the parsed flags ask for (mesh, FSDP, pipeline), over all of JAX's
    devices unless `devices` is given."""
    return ShardMapStrategy(sc, optimizer, args.mesh, devices=devices, fsdp=args.fsdp,
                            microbatches=args.microbatches, schedule=args.pipeline_schedule,
                            virtual_stages=args.virtual_stages)


def main(argv=None) -> dict:
    args = cli.parse_args(build_parser(), argv)
    # Train (or, with --plan N, compile for N devices and print the plan): vit_pure/run/entry.py.
    return entry.main(args, functools.partial(strategy_from_args, args), "train_shardmap.py")


if __name__ == "__main__":
    hostmem.use_huge_pages()  # restarts once; see vit_pure/run/hostmem.py
    sys.exit(cli.main_guard(main))
