"""The zero-bubble split of a backward pass into I (input gradient) and W (weight gradient).

B does two kinds of work: the cotangent chain from the stage's output back to its input
(sent upstream at once) and, for each weight matmul y_l = a_l @ w_l, the weight gradient
a_l^T dy_l, which nobody waits for: a zero-bubble schedule runs it later, as W.

    split = Split(fn, params, x, *others)   # traces fn(params, x, *others) once
    out, pull, acts = split.forward(params, x, *others)        # F
    g_params, dx, dys = split.input_grads(pull(cotangent))     # I
    g_weights = split.weight_grads(params, acts, dys, *others)  # W

`Split` traces fn to a jaxpr and binds its equations again; `Split._classify` says which
matmuls are weight matmuls. No collective of its own: the model's tensor-parallel ones are
bound where the model wrote them.
"""
from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
from jax.extend import core as jex
from jax.extend import source_info_util

from vit_pure.pipeline.ring import vary_like

# Calls walked into: their equations join the flat list (jnp.einsum's jit, for one).
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
# What may surround the dot_general inside a custom-VJP matmul (policy._einsum_f32_out).
_PLUMBING = frozenset({"convert_element_type", "transpose", "reshape", "broadcast_in_dim",
                       "squeeze", "expand_dims", "copy"})


@dataclasses.dataclass(frozen=True, eq=False)
class _Lit:
    """A constant operand: a jaxpr literal or a closed-over value (maybe a tracer: never
    compared or hashed by value)."""
    val: object


@dataclasses.dataclass(frozen=True, eq=False)
class _Node:
    """One equation of the flattened jaxpr: operands and results are integer keys (or
    _Lit), fresh per walk, so a jaxpr called twice gets two sets."""
    prim: object
    params: dict
    ins: tuple
    outs: tuple
    out_avals: tuple
    source_info: object  # where the equation was written: kept when it is bound again


def _flatten(jaxpr, consts, ins, nodes, fresh):
    """Append jaxpr's equations to `nodes`, with calls walked into; returns its outputs."""
    env = dict(zip(jaxpr.constvars, [_Lit(c) for c in consts]))
    env.update(zip(jaxpr.invars, ins))

    def read(a):
        return _Lit(a.val) if isinstance(a, jex.Literal) else env[a]

    for eqn in jaxpr.eqns:
        operands = [read(a) for a in eqn.invars]
        if eqn.primitive.name in _CALLS:
            inner = eqn.params["jaxpr"]
            outs = _flatten(inner.jaxpr, inner.consts, operands, nodes, fresh)
        else:
            outs = [next(fresh) for _ in eqn.outvars]
            nodes.append(_Node(eqn.primitive, eqn.params, tuple(operands), tuple(outs),
                               tuple(v.aval for v in eqn.outvars), eqn.source_info))
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]


def _is_matmul(node: _Node) -> bool:
    """A dot_general, or a custom VJP of two operands around exactly one dot_general."""
    if node.prim.name == "dot_general":
        return True
    if node.prim.name != "custom_vjp_call" or node.params.get("num_consts", 0) or \
            len(node.ins) != 2:
        return False
    inner: list[_Node] = []
    call = node.params["call_jaxpr"]
    _flatten(call.jaxpr, call.consts, [object(), object()], inner, itertools.count())
    names = [n.prim.name for n in inner]
    return names.count("dot_general") == 1 and set(names) <= _PLUMBING | {"dot_general"}


def _bind(node: _Node, operands):
    """The equation bound again, under its own source: what it emits (the model's
    tensor-parallel collectives among them) is still attributed to the line that wrote it,
    in the program's metadata and in the plan, not to this interpreter."""
    where = node.source_info
    with source_info_util.user_context(where.traceback, name_stack=where.name_stack):
        out = node.prim.bind(*operands, **node.prim.get_bind_params(node.params))
    return list(out) if node.prim.multiple_results else [out]


class Split:
    """fn(params, x, *others) -> outputs, split into F, I and W (module docstring).
    `params` is any pytree; `others` are operands nothing is differentiated for (indices).

    A *weight matmul* multiplies an operand made from the parameters alone with one made
    from x: a `dot_general`, or the policy's float32-output einsum (a custom VJP around
    one). Parameters feeding only weight matmuls are the *weights*; the rest stay in I.
    F is `jax.vjp` over (other params, x, a zero tap added to each weight matmul's output)
    with the weights held constant, returning each matmul's activation a_l; I is its
    pull-back (the taps' cotangents are the dy_l); W is `jax.vjp` over the weights of the
    matmuls alone, pulled back from the dy_l: no cotangent chain again. Anything not
    walked into (a custom VJP, `jax.checkpoint`, a scan) is bound whole, its matmuls
    staying in I."""

    def __init__(self, fn, params, x, *others):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(params, x, *others)
        self.out_tree = jax.tree.structure(shapes)
        self.param_tree = jax.tree.structure(params)
        n = self.param_tree.num_leaves
        fresh = itertools.count()
        self.in_keys = [next(fresh) for _ in closed.jaxpr.invars]
        self.nodes: list[_Node] = []
        self.out_keys = _flatten(closed.jaxpr, closed.consts, self.in_keys, self.nodes, fresh)
        self.n_params, self.n_x = n, len(jax.tree.leaves(x))
        self._classify(n, n + self.n_x)

    # ------------------------------------------------------------------ which is which
    def _classify(self, n_params: int, n_x: int):
        """Find the weight matmuls and the weights (see the module docstring): from each
        key, whether it depends on x and on which parameter leaves."""
        act = {k: n_params <= i < n_x for i, k in enumerate(self.in_keys)}
        deps = {k: frozenset([i]) if i < n_params else frozenset()
                for i, k in enumerate(self.in_keys)}

        def from_x(k):  # the key's value depends on x
            return not isinstance(k, _Lit) and act[k]

        def params_of(k):  # the parameter leaves the key's value depends on
            return frozenset() if isinstance(k, _Lit) else deps[k]

        for node in self.nodes:
            for o in node.outs:
                act[o] = any(from_x(k) for k in node.ins)
                deps[o] = frozenset().union(*(params_of(k) for k in node.ins))
        demoted: set[int] = set()
        while True:
            matmuls = {}  # node index -> which operand is the activation
            for j, node in enumerate(self.nodes):
                if _is_matmul(node) and len(node.ins) == 2:
                    acts = [from_x(k) for k in node.ins]
                    w = node.ins[acts.index(False)] if acts.count(True) == 1 else None
                    if w is not None and params_of(w) and not params_of(w) & demoted:
                        matmuls[j] = acts.index(True)
            weights = frozenset().union(*(params_of(self.nodes[j].ins[1 - s])
                                          for j, s in matmuls.items()))
            # A weight may reach x's side or an output only through a weight matmul.
            bad = set()
            for j, node in enumerate(self.nodes):
                for pos, k in enumerate(node.ins):
                    if from_x(k) or not params_of(k) & weights:
                        continue
                    if any(act[o] for o in node.outs) and \
                            not (j in matmuls and pos == 1 - matmuls[j]):
                        bad |= params_of(k) & weights
            for k in self.out_keys:
                if not from_x(k):
                    bad |= params_of(k) & weights
            if not bad:
                break
            demoted |= bad
        self.matmuls = sorted(matmuls.items())
        # The activation operands kept for W, each once (matmuls may share one, as
        # separate q, k, v projections of one LayerNorm's output would).
        self.act_keys = list(dict.fromkeys(self.nodes[j].ins[s] for j, s in self.matmuls))
        self.weight_mask = [i in weights for i in range(n_params)]
        # W walks only the equations that make the weight operands from the weights.
        need = {self.nodes[j].ins[1 - s] for j, s in self.matmuls}
        keep = []
        for j in reversed(range(len(self.nodes))):
            node = self.nodes[j]
            if j not in matmuls and any(o in need for o in node.outs):
                keep.append(j)
                need.update(k for k in node.ins if not isinstance(k, _Lit))
        self.weight_side = sorted(keep)

    # ------------------------------------------------------------------------ the passes
    def _env(self, params, x, others):
        """The inputs' values by key (x None: W, which reads none of x's keys)."""
        n = self.n_params + self.n_x
        env = dict(zip(self.in_keys[:self.n_params], jax.tree.leaves(params)))
        env.update(zip(self.in_keys[n:], others))
        if x is not None:
            env.update(zip(self.in_keys[self.n_params:n], jax.tree.leaves(x)))
        return env

    @staticmethod
    def _read(env, k):
        return k.val if isinstance(k, _Lit) else env[k]

    def _run(self, env, taps):
        """Every equation, each weight matmul's output plus its tap; returns (outputs,
        the weight matmuls' activation operands)."""
        taps, it = iter(taps), dict(self.matmuls)
        for j, node in enumerate(self.nodes):
            outs = _bind(node, [self._read(env, k) for k in node.ins])
            if j in it:
                outs = [outs[0] + next(taps)]
            env.update(zip(node.outs, outs))
        return [self._read(env, k) for k in self.out_keys], [env[k] for k in self.act_keys]

    def taps(self):
        """Zeros of each weight matmul's output type (its varying mesh axes included)."""
        out = []
        for j, _ in self.matmuls:
            aval = self.nodes[j].out_avals[0]
            out.append(vary_like(jnp.zeros(aval.shape, aval.dtype),
                                 aval.manual_axis_type.varying))
        return out

    def forward(self, params, x, *others):
        """F: (outputs, pull-back, activation operands). pull(cotangent of the outputs)
        gives what `input_grads` reads."""
        leaves = jax.tree.leaves(params)
        mask = self.weight_mask

        def f(cheap, x, taps):
            it = iter(cheap)
            merged = [w if m else next(it) for w, m in zip(leaves, mask)]
            env = self._env(jax.tree.unflatten(self.param_tree, merged), x, others)
            outs, acts = self._run(env, taps)
            return jax.tree.unflatten(self.out_tree, outs), acts

        cheap = [w for w, m in zip(leaves, mask) if not m]
        out, pull, acts = jax.vjp(f, cheap, x, self.taps(), has_aux=True)
        return out, pull, acts

    def input_grads(self, pulled):
        """I, from pull(cotangent): (the params' gradients, None for the weights; dx;
        each weight matmul's output cotangent)."""
        g_cheap, dx, dys = pulled
        it = iter(g_cheap)
        grads = [None if m else next(it) for m in self.weight_mask]
        return jax.tree.unflatten(self.param_tree, grads), dx, dys

    def weight_grads(self, params, acts, dys, *others):
        """W: the weights' gradients (None for the cheap params) from the activation
        operands and output cotangents of the weight matmuls."""
        leaves = jax.tree.leaves(params)
        mask = self.weight_mask

        def products(weights):
            it = iter(weights)
            merged = [next(it) if m else w for w, m in zip(leaves, mask)]
            env = self._env(jax.tree.unflatten(self.param_tree, merged), None, others)
            for j in self.weight_side:
                node = self.nodes[j]
                env.update(zip(node.outs, _bind(node, [self._read(env, k)
                                                       for k in node.ins])))
            out = []
            kept = dict(zip(self.act_keys, acts))
            for j, s in self.matmuls:
                node, a = self.nodes[j], kept[self.nodes[j].ins[s]]
                operands = [a, self._read(env, node.ins[1 - s])][::1 if s == 0 else -1]
                out.append(_bind(node, operands)[0])
            return out

        _, pull = jax.vjp(products, [w for w, m in zip(leaves, mask) if m])
        (g,) = pull(list(dys))
        it = iter(g)
        grads = [next(it) if m else None for m in mask]
        return jax.tree.unflatten(self.param_tree, grads)
