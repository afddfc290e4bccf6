"""Does the Pallas attention kernel compile for an H100, and what does it move and compute?

    python -m benchmarks.probes.pallas_attention                 # vit-cifar's attention
    python -m benchmarks.probes.pallas_attention --batch 8 --tokens 128 --heads 8 --head-dim 64

Without a GPU: the kernel's forward and its forward + backward (vit_pure/layers/
attention_pallas.py) lowered through Mosaic GPU and compiled by XLA:GPU for the H100's
description (vit_pure/plan/targets/), with JAX's CUDA plugin (`pip install -r
requirements-gpu.txt`; without it this stops with one line). Mosaic GPU checks layouts,
tiles and shared memory when it lowers the kernel; register pressure is not checked here.
Per layer, the kernel's HBM bytes and FLOPs as issued (the padded rows included) and
the FLOPs the einsum path needs, from `attention_pallas.attention_cost`, with the bytes'
time at the H100's bandwidth: XLA's cost analysis does not see inside the kernel.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU backend to start: a deviceless compile

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from vit_pure import quiet  # noqa: E402
from vit_pure.layers import attention_pallas as ap  # noqa: E402
from vit_pure.plan import targets  # noqa: E402
from vit_pure.run import cli  # noqa: E402


def main(argv=None) -> int:
    p = cli.doc_parser(__doc__)
    p.prog = "python -m benchmarks.probes.pallas_attention"
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=65)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=48)
    p.add_argument("--hardware", default="h100", choices=sorted(targets.GPU_TARGETS))
    args = p.parse_args(argv)
    target = targets.gpu_target(args.hardware)
    if target is None:
        print("error: the deviceless compile needs JAX's CUDA plugin: "
              "pip install -r requirements-gpu.txt", file=sys.stderr)
        return 2
    B, T, H, D = args.batch, args.tokens, args.heads, args.head_dim
    try:
        ap.check_shape(T, D, jnp.bfloat16)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with quiet.filtered():
        device = targets.gpu_devices(target, 1, 1)[0]
    x = jax.ShapeDtypeStruct((B, T, 3 * H * D), jnp.bfloat16,
                             sharding=SingleDeviceSharding(device))

    def loss(qkv):
        return ap.attention_pallas(qkv, D).astype(jnp.float32).sum()

    print(f"{device.device_kind}, deviceless; jax {jax.__version__}; batch {B}, {T} tokens "
          f"(token 0 apart, the rest padded on chip to {ap.padded_rest(T)}), {H} heads of {D}, "
          f"bf16")
    for name, fn in (("forward", lambda q: ap.attention_pallas(q, D)),
                     ("forward + backward", jax.grad(loss))):
        try:
            compiled = jax.jit(fn).trace(x).lower().compile()
            kernels = compiled.as_text().count('custom_call_target="mosaic_gpu')
            print(f"  {name}: compiles ({kernels} Mosaic GPU kernel{'s' * (kernels > 1)})")
        except Exception as e:  # noqa: BLE001 (the finding is the message)
            print(f"  {name}: does not compile: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:300]}")
    cost = ap.attention_cost(B, T, H, D, jnp.bfloat16)
    bandwidth = targets.memory_bandwidth(args.hardware)
    for part in ("forward", "backward"):
        nbytes, flops = cost[f"{part}_bytes"], cost[f"{part}_flops"]
        print(f"  {part} per layer: {nbytes / 1e9:.3f} GB ({nbytes / bandwidth * 1e3:.3f} ms "
              f"at {bandwidth / 1e12:.2f} TB/s), {flops / 1e12:.3f} TFLOP issued")
    print(f"  useful forward FLOPs (the einsums' products): "
          f"{cost['useful_forward_flops'] / 1e12:.3f} TFLOP; issued / useful "
          f"{cost['forward_flops'] / cost['useful_forward_flops']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
