"""Throughput of the data path: device-side normalisation + augmentation, host-side batching.

    python -m benchmarks.probes.bench_data --batch 4096
    python -m benchmarks.probes.bench_data --batch 4096 --data-dir ../shared/data/cifar10-subset

Prints one table row (images/s, median of --runs timed runs after a warm-up):
  normalize+augment  jax.jit(step.prepare_images) on uint8 NHWC, as the training step runs it
  augment            jax.jit(augment) alone on float32 NHWC
  train batches      train_batches(): shuffled gather of global batches on the host
  eval batches       eval_batches(): in-order slices, last one padded
"""

import jax
import jax.numpy as jnp

from benchmarks import harness
from vit_pure import step as S
from vit_pure.data import augment as A
from vit_pure.data import cifar10 as D
from vit_pure.run import cli


def main(argv=None):
    ap = cli.doc_parser(__doc__)
    ap.add_argument("--batch", type=int, default=4096, help="global batch (images)")
    ap.add_argument("--runs", type=int, default=10, help="timed runs (median reported)")
    ap.add_argument("--data-dir", default=None,
                    help="CIFAR-10 folder for the host batching figure (default: synthetic "
                         "45,000-image train split)")
    args = ap.parse_args(argv)
    cli.require_positive(ap, args, "batch", "runs")

    b = args.batch
    x_u8 = jax.device_put(harness.host_batches(b, n=1)[0][0])
    ids = jnp.arange(b, dtype=jnp.int32)
    key = A.augment_key(0, 0, 0)

    norm_aug = jax.jit(lambda k, x, i: S.prepare_images(x, k, i, train=True, image_size=32))
    aug = jax.jit(A.augment)
    x_f32 = jax.block_until_ready(jax.jit(
        lambda x: S.prepare_images(x, key, ids, train=False, image_size=32))(x_u8))
    wait = jax.block_until_ready
    t_norm_aug = harness.median_seconds(lambda: norm_aug(key, x_u8, ids), wait, args.runs)
    t_aug = harness.median_seconds(lambda: aug(key, x_f32, ids), wait, args.runs)

    if args.data_dir:
        splits = D.load_cifar10(args.data_dir, download=False, log=lambda s: None)
    else:
        splits = D.synthetic_cifar10(n_train=45000, n_val=0, n_test=10000)
    train, test = splits["train"], splits["test"]
    steps = D.steps_per_epoch(len(train), b)
    if steps == 0:
        ap.error(f"--batch {b} is larger than the {len(train)} training images")
    epochs = iter(range(10**9))

    def one_train_epoch():
        for _ in D.train_batches(train, b, seed=0, epoch=next(epochs)):
            pass

    def one_eval_pass():
        for _ in D.eval_batches(test, b):
            pass

    runs = max(1, args.runs // 2)
    t_train = harness.median_seconds(one_train_epoch, wait, runs) / (steps * b)
    t_eval = harness.median_seconds(one_eval_pass, wait, runs) / len(test)

    dev = jax.devices()[0]
    print(harness.markdown_table(
        ["device", "batch", "normalize+augment img/s (ms/batch)", "augment img/s",
         "host train batches img/s", "host eval batches img/s"],
        [[f"{dev.platform}:{dev.device_kind} x{jax.device_count()}", b,
          f"{b / t_norm_aug:,.0f} ({1e3 * t_norm_aug:.1f})", f"{b / t_aug:,.0f}",
          f"{1 / t_train:,.0f}", f"{1 / t_eval:,.0f}"]]))


if __name__ == "__main__":
    main()
