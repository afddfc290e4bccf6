"""Time jitted RandAugment (and mix_batch) on one device, and each op on its own.

    python -m benchmarks.probes.bench_randaugment [--batch 1024] [--repeats 10]

Under vmap, `lax.switch` evaluates every op and selects one per image, so a RandAugment
layer should cost about the sum of the single-op times; the printout shows both, and
rand_augment with one warp per op slot (its default) against a warp per geometric op.
Prints timings only; asserts nothing.
"""
import jax
import jax.numpy as jnp

from benchmarks import harness
from vit_pure.data import augment as aug
from vit_pure.data import randaugment as ra
from vit_pure.run import cli


def time_jitted(fn, *args, repeats):
    """(compile + first run seconds, median seconds per later run)."""
    return harness.first_and_median(lambda: fn(*args), jax.block_until_ready, repeats)


def main(argv=None):
    parser = cli.doc_parser(__doc__)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num-ops", type=int, default=2)
    parser.add_argument("--magnitude", type=float, default=9)
    parser.add_argument("--skip-ops", action="store_true", help="skip the per-op timings")
    args = parser.parse_args(argv)
    cli.require_positive(parser, args, "batch", "repeats")
    if args.num_ops < 0 or not 0 <= args.magnitude <= 10:
        parser.error(f"--num-ops must be >= 0 and --magnitude in [0, 10], got {args.num_ops} "
                     f"and {args.magnitude}")

    device = jax.devices()[0]
    print(f"device: {device.platform} {device.device_kind}, jax {jax.__version__}")
    key = jax.random.key(0)
    images = jax.random.uniform(jax.random.key(1), (args.batch, 32, 32, 3))
    ids = jnp.arange(args.batch, dtype=jnp.int32)
    labels = jax.nn.one_hot(jnp.arange(args.batch) % 10, 10)

    per_call = {}
    for one_warp in (True, False):  # the default, then a warp per geometric op
        rand_augment = jax.jit(lambda k, x, i, w=one_warp: ra.rand_augment(
            k, x, i, num_ops=args.num_ops, magnitude=args.magnitude, one_warp=w))
        first, per_call[one_warp] = time_jitted(rand_augment, key, images, ids,
                                                repeats=args.repeats)
        print(f"rand_augment  one_warp={one_warp!s:5}  batch {args.batch} x 32x32x3, num_ops "
              f"{args.num_ops}: {per_call[one_warp] * 1e3:8.2f} ms/batch  "
              f"({args.batch / per_call[one_warp]:9.0f} img/s), compile+first {first:.2f} s")
    print(f"one warp per slot: {per_call[False] / per_call[True]:.2f}x the img/s of five")

    mix = jax.jit(lambda k, x, y: aug.mix_batch(k, x, y, mixup_alpha=0.8, cutmix_alpha=1.0))
    first, per_call = time_jitted(mix, key, images, labels, repeats=args.repeats)
    print(f"mix_batch     batch {args.batch}: {per_call * 1e3:8.2f} ms/batch, "
          f"compile+first {first:.1f} s")

    if args.skip_ops:
        return
    keys = jax.random.split(key, args.batch)
    m = args.magnitude / ra.MAX_LEVEL
    total = 0.0
    for op in ra.DEFAULT_OPS:
        batched = jax.jit(jax.vmap(lambda x, k, op=op: op(x, m, k)))
        _, per_call = time_jitted(batched, images, keys, repeats=args.repeats)
        total += per_call
        print(f"  {op.__name__:14s} {per_call * 1e3:8.2f} ms/batch")
    print(f"  sum of DEFAULT_OPS: {total * 1e3:.2f} ms/batch; x num_ops = "
          f"{total * args.num_ops * 1e3:.2f} ms (what an all-branches switch would cost)")


if __name__ == "__main__":
    main()
