"""Time and check the ways the kit's dropout masks can be drawn.

    python -m benchmarks.probes.dropout_masks                            # vit-cifar, batch 128
    python -m benchmarks.probes.dropout_masks --batch 4096 --dtype bf16  # the GPU's headline shape

The model draws each dropout mask from per-example keys (layers.dropout.dropout: fold_in of
the example id, the layer and the site, then dropout.keep_mask under a vmap), by one of two
methods (--dropout-masks): "threefry16", four 16-bit uniforms per Threefry hash of the key,
or "bernoulli", `jax.random.bernoulli` with whatever PRNG implementation the keys carry.
One table row per method and implementation: per-example masks, shard_map, forward and
backward times (the columns: the comment above IMPLS). Results of one run on a CPU:
docs/performance.md, "Dropout masks on a CPU".
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import harness
from vit_pure import model
from vit_pure.config import PRESETS, get_preset
from vit_pure.layers import dropout
from vit_pure.run import cli

# The table's columns, one row for threefry16, then one for bernoulli with each
# implementation named in --impls:
#   per example  does example i get the same mask in a batch of 4 as in a batch of 2?
#                The kit's rule (1, 2 or 8 devices give the same numbers) needs "yes".
#   shard_map    does one dropout site compile and run inside `jax.shard_map` over two
#                CPU devices, where the kit's training step runs? (Always checked on two
#                fake CPU devices, whatever the default backend.)
#   fwd ms       median time of one dropout site as the model runs it, on a (batch,
#                tokens, width) activation of the --model preset in --dtype, on the default
#                backend: the keys, the mask and the scaled select
#   fwd+bwd ms   the same with the backward pass (`jax.vjp`): the mask as the gradient
#                needs it, and the select of the cotangent
IMPLS = ("threefry2x32", "philox4x32", "rbg")


def build_parser() -> argparse.ArgumentParser:
    p = cli.doc_parser(__doc__)
    p.add_argument("--model", default="vit-cifar", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=128, help="examples in the timed activation")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the activation's dtype")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated PRNG implementations (JAX's names): {IMPLS}")
    p.add_argument("--steps", type=int, default=20, help="timed calls (median reported)")
    return p


def parse(argv):
    p = build_parser()
    args = p.parse_args(argv)
    cli.require_positive(p, args, "batch", "steps")
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    unknown = [s for s in args.impls if s not in IMPLS]
    if unknown or not args.impls:
        p.error(f"--impls {','.join(unknown)}: choose from {','.join(IMPLS)}")
    return args


def example_keys(impl: str, ids):
    """Per-example keys of implementation `impl`, as model.dropout_keys makes them."""

    return dropout.example_keys(jax.random.key(0, impl=impl), ids)


def site(x, keys, rate, masks):
    """One dropout site, exactly as the model runs it on a CPU (layer 1, the attention
    branch; masks kept a byte an element, as vit_pure/run/backend.py resolves there).
    The training step has 1 + 2 x depth such sites (13 for vit-cifar)."""
    return dropout.dropout(x, rate, keys, 1, model._SITE_ATTN, masks, packed=False)


def per_example(masks: str, impl: str, rate: float) -> bool:
    keys = example_keys(impl, jnp.arange(4))
    x = jnp.ones((4, 17, 24), jnp.float32)
    return bool(jnp.array_equal(site(x, keys, rate, masks)[2:],
                                site(x[2:], keys[2:], rate, masks)))


def under_shard_map(masks: str, impl: str, rate: float) -> str:
    """"yes", or the first line of the error."""
    cpus = jax.devices("cpu")[:2]
    if len(cpus) < 2:
        return "not checked: one CPU device"
    mesh = Mesh(np.array(cpus), ("data",))
    split = NamedSharding(mesh, P("data"))
    with jax.default_device(cpus[0]):
        keys = jax.device_put(example_keys(impl, jnp.arange(4)), split)
        x = jax.device_put(jnp.ones((4, 17, 24), jnp.float32), split)
    f = jax.jit(jax.shard_map(lambda x, k: site(x, k, rate, masks), mesh=mesh,
                              in_specs=(P("data"), P("data")), out_specs=P("data")))
    try:
        jax.block_until_ready(f(x, keys))
        return "yes"
    except Exception as e:  # noqa: BLE001 - the failure is the result
        return "no: " + " ".join(str(e).split("\n")[0].split())[:100]


def timed(masks: str, impl: str, args, cfg) -> tuple[float, float]:
    """Median ms of one site forward, and forward + backward."""
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    x = jnp.ones((args.batch, cfg.seq_len, cfg.width), dtype)
    keys = example_keys(impl, jnp.arange(args.batch))
    fwd = jax.jit(lambda x, k: site(x, k, cfg.dropout, masks))

    @jax.jit
    def fwd_bwd(x, k):
        y, vjp = jax.vjp(lambda x: site(x, k, cfg.dropout, masks), x)
        return y, vjp(y)[0]

    return tuple(1e3 * harness.median_seconds(lambda f=f: f(x, keys), jax.block_until_ready,
                                              args.steps) for f in (fwd, fwd_bwd))


def main(argv=None) -> list[dict]:
    args = parse(argv)
    cfg = get_preset(args.model)
    rate = cfg.dropout or 0.1
    cfg = cfg.replace(dropout=rate)
    print(f"# dropout masks: {args.model}, activation ({args.batch}, {cfg.seq_len}, "
          f"{cfg.width}) {args.dtype}, rate {rate}, {args.steps} timed calls; "
          f"device {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    rows = []
    for masks, impl in [("threefry16", "threefry2x32")] + [("bernoulli", i) for i in args.impls]:
        row = {"masks": masks, "impl": impl, "per_example": per_example(masks, impl, rate),
               "shard_map": under_shard_map(masks, impl, rate)}
        row["fwd_ms"], row["fwd_bwd_ms"] = timed(masks, impl, args, cfg)
        rows.append(row)
        print(f"# {masks}, {impl}: done", flush=True)
    print()
    print(harness.markdown_table(
        ["masks", "PRNG", "per example", "shard_map (2 CPU devices)", "fwd ms", "fwd+bwd ms"],
        [[r["masks"], r["impl"], "yes" if r["per_example"] else "no", r["shard_map"],
          f"{r['fwd_ms']:.2f}", f"{r['fwd_bwd_ms']:.2f}"] for r in rows], numeric=(4, 5)))
    return rows


if __name__ == "__main__":
    cli.use_cpu_devices(2)  # for the shard_map check (only the CPU backend reads it)
    main()
