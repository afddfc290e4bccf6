"""Where a layout puts the bytes: per parameter its PartitionSpec and bytes per device,
computed from the specs and measured on placed arrays. train_shardmap.py prints both at
start; nothing here moves data between devices.
"""
from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None, 'data', or ('data', 'model')."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def mesh_axes(spec: P) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec splits an array over, e.g. ('data', 'model')."""
    return tuple(axis for entry in spec for axis in entry_axes(entry))


def is_spec(x):
    return isinstance(x, P)


def like_param(state_leaf, spec: P) -> P:
    """The PartitionSpec of an optimizer-state leaf that belongs to a param laid out with
    `spec`: the param's, except that axes of size 1 stay whole (--layer-decay's factors,
    step.layer_factors: (L, 1, ..., 1) for the stacked blocks, split over 'pipe' with them,
    and (1, ..., 1) for the others). A param-shaped leaf (Adam's mu, nu) gets `spec`."""
    return P(*(None if n == 1 else entry for n, entry in zip(state_leaf.shape, spec)))


def _bytes(shape_dtype, spec, mesh_shape) -> int:
    """Bytes of one device's block of an array with this shape, dtype and spec."""
    shards = math.prod(mesh_shape[a] for a in mesh_axes(spec))
    return math.prod(shape_dtype.shape) * jnp.dtype(shape_dtype.dtype).itemsize // shards


def bytes_per_device(tree, device) -> int:
    """Measured: the bytes of `tree`'s arrays that actually sit on `device`."""
    return sum(shard.data.nbytes for x in jax.tree.leaves(tree)
               for shard in x.addressable_shards if shard.device == device)


def format_table(specs, params_shapes, opt_state_shapes, opt_specs, optimizer,
                 mesh_shape: dict) -> str:
    """Per parameter its PartitionSpec and bytes per device, for the parameter and its
    optimizer state, next to pure data parallelism (everything replicated)."""
    flat = jax.tree_util.tree_flatten_with_path(params_shapes)[0]
    names = ["/".join(str(k.key) for k in path) for path, _ in flat]
    # The optimizer state holds its own copies of param-shaped arrays (Adam: mu, nu);
    # tree_map_params finds them, so each can be charged to its parameter's row.
    name_tree = jax.tree.unflatten(jax.tree.structure(params_shapes), names)
    opt_rows = collections.Counter()
    owners = optax.tree_map_params(optimizer, lambda _, name: name, opt_state_shapes,
                                   name_tree, transform_non_params=lambda _: "(other)")
    for owner, x, spec in zip(jax.tree.leaves(owners), jax.tree.leaves(opt_state_shapes),
                              jax.tree.leaves(opt_specs, is_leaf=is_spec)):
        opt_rows[owner] += _bytes(x, spec, mesh_shape)

    rows = [f"  {'parameter':<24} {'PartitionSpec':<44} {'params B/dev':>13} "
            f"{'opt state B/dev':>16} {'params, DP':>14}"]
    dp_params = sum(_bytes(x, P(), mesh_shape) for _, x in flat)
    dp_opt = sum(_bytes(x, P(), mesh_shape) for x in jax.tree.leaves(opt_state_shapes))
    total = 0
    for name, (_, x), spec in zip(names, flat, jax.tree.leaves(specs, is_leaf=is_spec)):
        b = _bytes(x, spec, mesh_shape)
        total += b
        rows.append(f"  {name:<24} {str(spec):<44} {b:>13,} {opt_rows[name]:>16,} "
                    f"{_bytes(x, P(), mesh_shape):>14,}")
    if opt_rows["(other)"]:
        rows.append(f"  {'(optimizer step counts)':<24} {'P()':<44} {0:>13,} "
                    f"{opt_rows['(other)']:>16,} {0:>14,}")
    opt_total = sum(opt_rows.values())
    rows.append(f"  total: params {total:,} B/device (data parallel {dp_params:,}: "
                f"/{dp_params / total:.2f}); optimizer state {opt_total:,} B/device "
                f"(data parallel {dp_opt:,}: /{dp_opt / max(opt_total, 1):.2f})")
    return "\n".join(rows)


def measure(mesh, specs: dict, shapes: dict) -> str:
    """Place zeros with these specs on the mesh and count the bytes on each of this
    process's devices: the layout as the runtime holds it, not as `format_table`
    computes it. specs / shapes: {"params": ..., "opt_state": ...}."""
    shardings = {k: jax.tree.map(lambda s: NamedSharding(mesh, s), specs[k], is_leaf=is_spec)
                 for k in shapes}
    placed = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
                     out_shardings=shardings)()
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    p = [bytes_per_device(placed["params"], d) for d in local]
    o = [bytes_per_device(placed["opt_state"], d) for d in local]
    jax.tree.map(lambda x: x.delete(), placed)
    return (f"measured on the placed arrays, per device (min..max over {len(local)}): "
            f"params {min(p):,}..{max(p):,} B, optimizer state {min(o):,}..{max(o):,} B")
