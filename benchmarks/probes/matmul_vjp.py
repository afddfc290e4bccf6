"""The float32-output matmul's backward pass: policy.py's custom VJP against plain autodiff.

    python -m benchmarks.probes.matmul_vjp --model vit-cifar --batch 32 --steps 5

Under a bf16 policy with float32 matmul outputs (``m=f32``, the CPU default), plain
autodiff hands each matmul's backward products a float32 cotangent, so they run with
float32 operands; `policy._einsum_f32_out`'s custom VJP casts the cotangent to bf16 first,
so they take bf16 operands (accumulating in float32) like the forward product. Which is
faster depends on the hardware: bf16 arithmetic (avx512_bf16, accelerators) favours the
custom VJP, a CPU that emulates bf16 favours plain autodiff.

Compiles the gradient step of one device (step.local_grads, the kit's real loss and
augmentation) both ways in one process, then times them alternately, one warm-up call
each, and prints the median step time and images per second of each, and their ratio.
"""
from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import harness
from vit_pure import policy as policy_lib
from vit_pure import step
from vit_pure.config import PRESETS
from vit_pure.policy import LossScale, Policy
from vit_pure.run import cli


def _plain_f32_out(spec, a, b, precision=None):
    """The same product with plain autodiff: float32 out, float32 cotangent backward."""
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def build(cfg, batch: int, plain: bool):
    """The compiled gradient step and its params, with the custom VJP or plain autodiff."""
    ((images, labels),) = harness.host_batches(batch, n=1, classes=cfg.num_classes)
    ids = np.arange(batch, dtype=np.int32)
    sc = step.StepConfig(cfg, Policy.parse("p=f32,c=bf16,o=f32,m=f32"))
    params = step.init_state(jax.random.key(0), cfg, sc.policy, optax.sgd(0.1))["params"]
    original = policy_lib._einsum_f32_out
    if plain:  # only while tracing: the compiled program keeps what it traced
        policy_lib._einsum_f32_out = _plain_f32_out
    try:
        f = jax.jit(lambda p: step.local_grads(sc, p, LossScale.create(False), images, labels,
                                               ids, step.step_key(0, 0, 0)))
        compiled = f.lower(params).compile()
    finally:
        policy_lib._einsum_f32_out = original
    return compiled, params


def main(argv=None) -> dict:
    p = cli.doc_parser(__doc__)
    p.add_argument("--model", default="vit-cifar", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=5, help="timed calls of each (median)")
    args = p.parse_args(argv)
    cli.require_positive(p, args, "batch", "steps")
    cfg = PRESETS[args.model]
    variants = {"custom VJP (bf16 backward)": build(cfg, args.batch, plain=False),
                "plain autodiff (f32 backward)": build(cfg, args.batch, plain=True)}
    times = {name: [] for name in variants}
    for _ in range(args.steps + 1):  # alternate, so both see the same machine load
        for name, (compiled, params) in variants.items():
            times[name] += harness.time_calls(lambda: compiled(params), jax.block_until_ready,
                                              1, warmup=0).wall
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    print(f"{args.model}, batch {args.batch}, one {jax.devices()[0].platform} device, "
          f"policy p=f32,c=bf16,o=f32,m=f32, median of {args.steps} after 1 warm-up")
    for name, m in medians.items():
        print(f"  {name:32s} {m * 1e3:9.1f} ms/step  {args.batch / m:8.1f} img/s")
    custom, plain = medians.values()
    print(f"  custom VJP / plain autodiff step time: {custom / plain:.2f}")
    return medians


if __name__ == "__main__":
    main()
