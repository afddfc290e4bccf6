"""The residual ring: what a pipeline stage keeps of each chunk's pull-back between its F
and its B, and the typing helpers a ring inside `shard_map` needs.

A pull-back's residuals fall into three kinds: made from neither the chunk's input nor
the micro-batch (the weights, their casts and reshapes: traced again at B, not kept); an
earlier residual under another shape (kept once, reshaped at B); the rest, kept in the
ring, one slot per residual set (`schedules.residual_slots` says which slot when).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex


# ------------------------------------------------------------------------- typing helpers
def varying(x) -> frozenset:
    """The mesh axes x varies over (inside shard_map)."""
    return jax.typeof(x).manual_axis_type.varying


def vary_like(x, axes):
    """x made varying over `axes` (a mesh axis name, another array's varying axes, or a
    set of names) where it is not yet: the type a lax.cond branch or a scan's carry must
    match. A pcast to varying moves no data (its transpose is a psum)."""
    axes = frozenset([axes] if isinstance(axes, str) else () if axes is None else
                     axes if isinstance(axes, (set, frozenset)) else varying(axes))
    missing = tuple(sorted(axes - varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def zeros_ring(x, slots: int, axis: str | None = None):
    """A ring of `slots` zero copies of x's type (zeros_like keeps its varying axes,
    which a scan's carry must keep), made varying over `axis` too."""
    return vary_like(jnp.zeros_like(jnp.broadcast_to(x, (slots, *x.shape))), axis)


def _is_key(a) -> bool:
    return jnp.issubdtype(a.dtype, jax.dtypes.prng_key)


def _bits(a):
    """a, or a PRNG key array's raw bits (what the ring holds of a key)."""
    return jax.random.key_data(a) if _is_key(a) else a


# --------------------------------------------------------------- reading a pull-back
def input_free(fn, *inputs) -> list[bool]:
    """Per output leaf of fn(*inputs): True where no path of its trace leads from inputs to
    it (a weight, a reshape of one: what a ring need not keep, as it can be made again)."""
    jaxpr = jax.make_jaxpr(fn)(*inputs).jaxpr
    dep = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(isinstance(a, jex.Var) and a in dep for a in eqn.invars):
            dep.update(eqn.outvars)
    return [not (isinstance(o, jex.Var) and o in dep) for o in jaxpr.outvars]


# Equations whose result holds its operand's elements in the same (row-major) order.
_SAME_ELEMENTS = frozenset({"reshape", "squeeze"})


def same_data(fn, *inputs) -> list[int | None]:
    """Per output leaf of fn(*inputs): the index of an earlier output leaf that holds the
    same elements (the same value, or a reshape of the same value), else None. Such a
    leaf is a reshape of the earlier one (a ring keeps the earlier one alone)."""
    jaxpr = jax.make_jaxpr(fn)(*inputs).jaxpr
    base = {}  # a variable -> the variable whose elements it holds
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _SAME_ELEMENTS and isinstance(eqn.invars[0], jex.Var):
            base[eqn.outvars[0]] = base.get(eqn.invars[0], eqn.invars[0])
    first, out = {}, []
    for i, o in enumerate(jaxpr.outvars):
        earlier = None
        if isinstance(o, jex.Var):
            earlier = first.setdefault(base.get(o, o), i)
        out.append(None if earlier in (None, i) else earlier)
    return out


# ---------------------------------------------------------------------------- the layout
@dataclasses.dataclass(frozen=True, eq=False)
class ResidualLayout:
    """Which of a chunk's pull-back residuals the ring keeps, and how to rebuild the
    pull-back at B from them. A PRNG key residual (a rematerialised block's dropout keys)
    is kept as its raw bits: a ring of keys would not keep the varying type that the
    branches need."""
    fixed: tuple          # per pull-back leaf: True = traced again at B, not kept
    same: tuple           # per pull-back leaf: an earlier kept leaf holding its elements
                          # (it is that leaf reshaped: not kept), or None
    tree: object          # the pull-back's tree structure
    impls: tuple          # per kept pull-back leaf: its PRNG key implementation, or None
    entries: tuple        # one traced value per ring entry: its shape and type
    outputs: tuple        # the traced F's outputs: (y, F's sums)
    x: jax.Array          # the traced F's input (its shape and type)

    @property
    def kept(self) -> tuple:
        """Per pull-back leaf: True where the ring keeps it."""
        return tuple(not f and s is None for f, s in zip(self.fixed, self.same))

    @property
    def n_pull(self) -> int:
        """The ring's first n_pull entries are the pull-back's; the rest W's operands."""
        return self.kept.count(True)

    def pack(self, pull, acts) -> list:
        """What the ring keeps of one F: its kept residuals (keys as bits), acts."""
        leaves = jax.tree.leaves(pull)
        return [_bits(a) for a, k in zip(leaves, self.kept) if k] + list(acts)

    def unpack(self, again, stored):
        """The pull-back of the F whose ring entries are `stored`, from `again`, the
        pull-back of the same chunk traced again at B (on any input: its fixed leaves)."""
        it = iter(a if k is None else jax.random.wrap_key_data(a, impl=k)
                  for a, k in zip(stored[:self.n_pull], self.impls))
        leaves = list(jax.tree.leaves(again))
        for i, (fixed, same) in enumerate(zip(self.fixed, self.same)):
            if not fixed:  # an earlier leaf's elements, or the ring's next entry
                leaves[i] = next(it) if same is None else leaves[same].reshape(leaves[i].shape)
        return jax.tree.unflatten(self.tree, leaves)

    def rings(self, slots: int, axis: str) -> list:
        """The ring: `slots` zero copies of each entry, varying over `axis`."""
        return [zeros_ring(a, slots, axis) for a in self.entries]


def residual_layout(pulled, zero, x0) -> ResidualLayout:
    """The layout of `pulled(v, mb, x) -> (outputs, pull-back, acts)`'s residuals, from
    traces at v = mb = `zero` and x = `x0`."""
    def residuals(mb, x):
        return jax.tree.leaves(pulled(zero, mb, x)[1])

    fixed = input_free(residuals, zero, x0)
    # A leaf that is another kept leaf reshaped (the same value under two shapes, as an
    # attention's output and the next matmul's operand) is made from it at B.
    same = [None if f or s is None or fixed[s] else s
            for f, s in zip(fixed, same_data(residuals, zero, x0))]
    out, pull, acts = pulled(zero, zero, x0)
    leaves, tree = jax.tree.flatten(pull)
    layout = ResidualLayout(tuple(fixed), tuple(same), tree, (), (), tuple(out), x0)
    impls = tuple(jax.random.key_impl(a) if _is_key(a) else None
                  for a, k in zip(leaves, layout.kept) if k)
    return dataclasses.replace(layout, impls=impls, entries=tuple(layout.pack(pull, acts)))
