"""ViT training with `jax.shard_map` over a named Mesh: every collective written in this file.

    python train_shardmap.py --batch 4096 --dtype bf16 --data-dir ./data
    python train_shardmap.py --model tiny --dataset synthetic --steps 20 --cpu-devices 8 \
        --mesh data=2,model=4

The mesh has a 'data' axis (the batch is split over it) and a 'model' axis (tensor
parallelism: attention heads and MLP hidden units split over it, Megatron style). Inside
`shard_map` the step sees only its device's block of every array, and nothing moves
between devices unless a collective below (or the model's two tensor-parallel operators,
`_copy_to_tp` / `_reduce_from_tp` in vit_pure/model.py) says so.

THE GRADIENT PITFALL. With `check_vma=True` (the default), shard_map tracks which values
vary across each mesh axis. Parameters enter replicated (P() over 'data'): *invariant*.
Multiplying them with the per-device (varying) batch implicitly broadcasts them to
varying, and the transpose of that broadcast, in the backward pass, is a psum. So
`jax.grad` of the local loss already returns the *sum* of the devices' gradients, and the
pmap-style `pmean(grad(local_loss))` comes out N times too large, silently. This script
makes the broadcast explicit instead: `lax.pcast(params, 'data', to='varying')` before
taking the gradient (so autodiff reduces nothing), then one `lax.pmean(grads, 'data')`,
written here. tests/test_train.py pins the naive recipe's factor of N down.
"""
from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from vit_pure import cli, loop, step
from vit_pure.model import init_params, param_axes

DATA, MODEL = "data", "model"

# Logical axis -> mesh axis: the tensor-parallel sharding rules. Attention heads and MLP
# hidden units are split over 'model'; every other axis is replicated.
TP_RULES = {"heads": MODEL, "mlp": MODEL}


def parse_mesh(text: str | None, n_devices: int) -> dict[str, int]:
    """`data=D[,model=M]` -> {'data': D, 'model': M}; D*M must equal the device count."""
    sizes = {DATA: None, MODEL: 1}
    if text:
        for item in text.split(","):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in sizes or not value.strip().isdigit() or int(value) < 1:
                raise cli.UsageError(
                    f"--mesh {text!r}: expected data=D,model=M with positive integers")
            sizes[name] = int(value)
    if sizes[DATA] is None:
        if n_devices % sizes[MODEL]:
            raise cli.UsageError(
                f"--mesh: model={sizes[MODEL]} does not divide the {n_devices} devices")
        sizes[DATA] = n_devices // sizes[MODEL]
    if sizes[DATA] * sizes[MODEL] != n_devices:
        raise cli.UsageError(
            f"--mesh {text}: data*model = {sizes[DATA] * sizes[MODEL]} but there are "
            f"{n_devices} devices")
    return sizes


def param_specs(cfg, mesh_sizes: dict[str, int]) -> dict:
    """Each parameter's PartitionSpec, from its logical axis names and TP_RULES."""
    m = mesh_sizes[MODEL]
    if m > 1:
        if cfg.heads % m:
            raise cli.UsageError(f"--mesh model={m}: {cfg.heads} heads do not divide by {m}")
        if cfg.mlp_dim % m:
            raise cli.UsageError(f"--mesh model={m}: MLP width {cfg.mlp_dim} does not divide by {m}")
    rules = TP_RULES if m > 1 else {}
    return jax.tree.map(lambda names: P(*(rules.get(n) for n in names)), param_axes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


def format_layout(specs, params_shapes, opt_state_shapes, mesh: jax.sharding.Mesh) -> str:
    """Per parameter its PartitionSpec and per-device bytes; totals vs pure data parallel."""
    rows, total_dev, total_full = [], 0, 0
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    flat = jax.tree_util.tree_flatten_with_path(params_shapes)[0]
    for (path, x), spec in zip(flat, flat_specs):
        full = math.prod(x.shape) * x.dtype.itemsize
        shards = math.prod(mesh.shape[a] for a in spec if a is not None)
        total_dev += full // shards
        total_full += full
        name = "/".join(str(k.key) for k in path)
        rows.append(f"  {name:<24} {str(spec):<40} {full // shards:>12,} B/device")
    opt_full = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(opt_state_shapes))
    ratio = total_dev / total_full
    rows.append(f"  params: {total_dev:,} B/device (pure data parallel: {total_full:,}); "
                f"optimizer state: {int(opt_full * ratio):,} B/device (pure data parallel: "
                f"{opt_full:,})")
    return "\n".join(rows)


class ShardMapStrategy:
    name = "shard_map"

    def __init__(self, sc: step.StepConfig, optimizer, mesh_text: str | None = None,
                 devices=None):
        devices = jax.devices() if devices is None else devices
        sizes = parse_mesh(mesh_text, len(devices))
        self.mesh = jax.make_mesh((sizes[DATA], sizes[MODEL]), (DATA, MODEL),
                                  axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
        self.batch_divisor = sizes[DATA]
        self.sc = sc
        self.tp_axis = MODEL if sizes[MODEL] > 1 else None
        self.param_specs = param_specs(sc.cfg, sizes)
        params_shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), sc.cfg))
        opt_specs = optax.tree_map_params(
            optimizer, lambda _, spec: spec, jax.eval_shape(optimizer.init, params_shapes),
            self.param_specs, transform_non_params=lambda _: P(),
            is_leaf=lambda x: isinstance(x, P))
        self.state_specs = {"params": self.param_specs, "opt_state": opt_specs,
                            "loss_scale": P(), "step": P()}
        self.layout = format_layout(self.param_specs, params_shapes,
                                    jax.eval_shape(optimizer.init, params_shapes), self.mesh)
        self._build(optimizer)

    def describe(self) -> str:
        return (f"mesh {dict(self.mesh.shape)} over {self.mesh.devices.size} "
                f"{self.mesh.devices.flat[0].platform} devices; layout:\n{self.layout}")

    # -------------------------------------------------------------------- the two steps
    def _build(self, optimizer):
        sc, tp = self.sc, self.tp_axis
        is_tp = jax.tree.leaves(jax.tree.map(lambda spec: MODEL in spec, self.param_specs,
                                             is_leaf=lambda x: isinstance(x, P)))

        def sharded(tree):  # the leaves split over 'model'
            return [x for x, s in zip(jax.tree.leaves(tree), is_tp) if s]

        def replicated(tree):  # the leaves every 'model' device holds whole
            return [x for x, s in zip(jax.tree.leaves(tree), is_tp) if not s]

        def train_step(state, images, labels, example_ids, key):
            # Mark the (replicated) params as varying over 'data' *before* differentiating,
            # so autodiff inserts no hidden reduction (see THE GRADIENT PITFALL above).
            params = lax.pcast(state["params"], DATA, to="varying")
            grads, metrics = step.local_grads(
                sc, params, state["loss_scale"], images, labels, example_ids, key, tp_axis=tp)
            # All-reduce (mean) of the gradients over 'data': local -> global mean loss.
            # (With tensor parallelism each device holds only its shard's gradient; the
            # reductions over 'model' happened inside the model's f/g operators.)
            grads = lax.pmean(grads, DATA)
            # All-reduce (mean) of the scalar metrics, for logging.
            metrics = lax.pmean(metrics, DATA)
            # The global gradient norm (for clipping and the overflow check): sum the
            # squares of each device's shards of model-sharded params over 'model'.
            grad_norm = jnp.sqrt(step.sum_of_squares(replicated(grads))
                                 + lax.psum(step.sum_of_squares(sharded(grads)), MODEL))
            state, _ = step.apply_gradients(sc, state, grads, grad_norm, optimizer)
            return state, {**metrics, "grad_norm": grad_norm}

        def eval_step(state, images, labels, mask):
            sums = step.local_eval(sc, state["params"], images, labels, mask, tp_axis=tp)
            # All-reduce (sum) of loss / correct / count over 'data' (padding is masked).
            return lax.psum(sums, DATA)

        batch = P(DATA)
        self.train_step = jax.jit(jax.shard_map(
            train_step, mesh=self.mesh,
            in_specs=(self.state_specs, batch, batch, batch, P()),
            out_specs=(self.state_specs, P())), donate_argnums=0)
        self.eval_step = jax.jit(jax.shard_map(
            eval_step, mesh=self.mesh,
            in_specs=(self.state_specs, batch, batch, batch), out_specs=P()))

    # -------------------------------------------------------------------- placement
    def _sharding(self, spec):
        return NamedSharding(self.mesh, spec)

    def put_state(self, state):
        shardings = jax.tree.map(self._sharding, self.state_specs,
                                 is_leaf=lambda x: isinstance(x, P))
        return jax.device_put(state, shardings)

    def put_batch(self, *arrays):
        # The global batch, split over 'data' (and replicated over 'model').
        return tuple(jax.device_put(a, self._sharding(P(DATA))) for a in arrays)

    def put_replicated(self, x):
        return jax.device_put(x, self._sharding(P()))

    def host_state(self, state) -> dict:
        return jax.device_get(state)

    def metrics_to_host(self, metrics) -> dict:
        return {k: float(v) for k, v in metrics.items()}


def build_parser():
    parser = cli.build_parser(__doc__.splitlines()[0])
    parser.add_argument("--mesh", default=None,
                        help="mesh sizes, e.g. data=8 or data=2,model=4 (default: all devices on data)")
    return parser


def main(argv=None) -> dict:
    args = cli.parse_args(build_parser(), argv)
    return loop.run(args, lambda optimizer: ShardMapStrategy(
        step.StepConfig.from_args(args), optimizer, args.mesh))


if __name__ == "__main__":
    sys.exit(cli.main_guard(main))
