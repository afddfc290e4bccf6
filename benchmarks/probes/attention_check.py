r"""Check and time the attention implementations (--attention) against the einsum path.

    python -m benchmarks.probes.attention_check --attention xla,cudnn --batch 4096 --dtype bf16
    python -m benchmarks.probes.attention_check --attention xla --model tiny --batch 32 \
        --check-batch 16 --steps 3 --warmup 1                 # a CPU smoke check

The first is the measurement this script exists for (a GPU, vit-cifar, one device; cuDNN
needs an NVIDIA GPU: asking for it elsewhere is a one-line error). Two parts, one process:
gradients (`check_gradients`: each implementation's against a float32 einsum reference, in
machine epsilons; it passes "within bf16 rounding" of the einsum path) and time
(`time_steps`: the real training step with each implementation, einsum first). Exit
status 1 if an implementation fails the gradient check.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import train_shardmap
from benchmarks import bench
from vit_pure import step
from vit_pure.config import ATTENTION_IMPLS, Execution
from vit_pure.model import apply, init_params
from vit_pure.policy import Policy
from vit_pure.run import cli


def build_parser() -> argparse.ArgumentParser:
    p = cli.OneLineErrorParser(description=__doc__.split("\n")[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--attention", default="xla,cudnn",
                   help="comma-separated implementations to compare with einsum "
                        f"(of {', '.join(ATTENTION_IMPLS[1:])})")
    p.add_argument("--model", default="vit-cifar")
    p.add_argument("--batch", type=int, default=4096, help="training batch of the timed steps")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16", "auto"])
    p.add_argument("--check-batch", type=int, default=256,
                   help="images in the gradient check (0: skip it)")
    p.add_argument("--steps", type=int, default=30, help="timed steps (0: skip timing)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--flags", default="",
                   help="more training-script flags for every timed step, e.g. '--dropout 0'")
    return p


def step_config(args, attention: str, batch: int):
    """(StepConfig, optimizer) as train_shardmap.main builds them; --attention cudnn off a
    GPU is a UsageError."""
    argv = ["--model", args.model, "--batch", str(batch), "--dtype", args.dtype,
            "--dataset", "synthetic", "--accum-steps", "1", "--attention", attention,
            *shlex.split(args.flags)]
    return bench.script_setup(argv, parser=train_shardmap.build_parser())


def gradients(sc: step.StepConfig, policy: Policy, attention: str, params, images, labels):
    def loss(p):
        logits = apply(p, images, sc.cfg, policy, train=True, rng=jax.random.key(1),
                       execution=Execution(attention=attention))
        return step.cross_entropy(logits, labels, sc.cfg.num_classes).mean()
    return jax.device_get(jax.jit(jax.grad(loss))(params))


def worst_error(ref, got) -> float:
    """Largest |got - ref| over the largest |ref|, per leaf; the worst leaf."""
    worst = 0.0
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        if not np.all(np.isfinite(g)):
            return float("inf")
        worst = max(worst, float(np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30)))
    return worst


def check_gradients(args, impls) -> bool:
    """Gradients. For one batch of --check-batch random images and labels (training mode:
    dropout and stochastic depth on, the same masks for every implementation), the
    gradients of the mean cross-entropy with respect to every parameter, from the einsum
    path and from each --attention implementation under the run's policy (--dtype; the
    matmul output dtype per backend, as the training scripts choose it), and from the
    einsum path in float32 at matmul precision "highest" (the reference). Each error is
    the largest |difference| of a leaf over that leaf's largest |reference| entry, the
    worst leaf, in units of the compute dtype's machine epsilon (bf16: 2^-7). An
    implementation passes if it is no further from the reference than twice the einsum
    path's own error, or 2 eps, whichever is larger: "within bf16 rounding" of the
    einsum path. Its distance to the einsum path under the same policy is printed too.
    """
    sc, _ = step_config(args, "einsum", args.check_batch)
    policy = sc.policy
    print(f"gradient check: compiling the {sc.cfg.name} gradients, the einsum path in float32 "
          f"and under {policy}, then each of {', '.join(impls)} ...", flush=True)
    eps = float(jnp.finfo(policy.compute_dtype).eps)
    params = init_params(jax.random.key(0), sc.cfg)
    kx, ky = jax.random.split(jax.random.key(2))
    size = sc.cfg.image_size
    images = jax.random.normal(kx, (args.check_batch, size, size, sc.cfg.channels))
    labels = jax.random.randint(ky, (args.check_batch,), 0, sc.cfg.num_classes)
    reference = gradients(sc, Policy.parse("fp32", "highest"), "einsum", params, images,
                          labels)
    einsum = gradients(sc, policy, "einsum", params, images, labels)
    einsum_error = worst_error(reference, einsum)
    print(f"gradient check: {sc.cfg.name}, {args.check_batch} images, policy {policy}; "
          f"errors vs einsum in float32 (precision highest), in eps = {eps:.3g}")
    print(f"  einsum  {einsum_error / eps:7.2f} eps")
    ok = True
    for impl in impls:
        got = gradients(sc, policy, impl, params, images, labels)
        error = worst_error(reference, got)
        passed = error <= max(2 * einsum_error, 2 * eps)
        ok &= passed
        print(f"  {impl:7s} {error / eps:7.2f} eps   vs einsum under {policy}: "
              f"{worst_error(einsum, got) / eps:.2f} eps   {'ok' if passed else 'FAILED'}")
    return ok


def time_steps(args, impls) -> None:
    """Time. The real training step, built as `train_shardmap.py --batch B --dtype D
    --dataset synthetic --accum-steps 1 --attention IMPL [--flags ...]` builds it, on one
    device, timed by benchmarks/bench.py's measure_train_step (the median of --steps
    steps after --warmup); einsum first, then each implementation in the order given.
    Printed: median step ms, img/s, the ratio to einsum, XLA's temporary-memory size of
    the compiled step, and the compile time.
    """
    rows = []
    for impl in ["einsum", *impls]:
        sc, optimizer = step_config(args, impl, args.batch)
        strategy = train_shardmap.ShardMapStrategy(sc, optimizer, None,
                                                   devices=jax.devices()[:1])
        res = bench.measure_train_step(strategy, sc, optimizer, args.batch, steps=args.steps,
                                       warmup=args.warmup)
        memory = res["compiled"].memory_analysis()
        temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
        rows.append((impl, statistics.median(res["step_s"]), temp, res["compile_s"]))
        del res, strategy  # the next implementation's state and temporaries replace these
    base = rows[0][1]
    print(f"training step: {args.model}, batch {args.batch}, --dtype {args.dtype}"
          f"{' ' + args.flags if args.flags else ''}; median of {args.steps} steps after "
          f"{args.warmup}; "
          f"{jax.devices()[0].device_kind}")
    print(f"  {'attention':9s} {'step ms':>9s} {'img/s':>9s} {'vs einsum':>9s} "
          f"{'temp GiB':>9s} {'compile s':>9s}")
    for impl, median, temp, compile_s in rows:
        temp_text = "?" if temp is None else f"{temp / 2 ** 30:.2f}"
        print(f"  {impl:9s} {median * 1e3:9.2f} {args.batch / median:9.0f} "
              f"{base / median:9.3f} {temp_text:>9s} {compile_s:9.1f}")


def main(argv=None) -> bool:
    """Both parts; True if every implementation passed the gradient check."""
    parser = build_parser()
    args = parser.parse_args(argv)
    impls = [a.strip() for a in args.attention.split(",") if a.strip()]
    for impl in impls:
        if impl not in ATTENTION_IMPLS[1:]:
            parser.error(f"--attention: {impl!r} is not one of "
                         f"{', '.join(ATTENTION_IMPLS[1:])}")
    for name in ("batch", "check_batch", "steps", "warmup"):
        if getattr(args, name) < 0 or (name == "batch" and args.batch < 1):
            parser.error(f"{cli.flag_name(name)} must be "
                         f"{'positive' if name == 'batch' else '>= 0'}")
    for impl in impls:  # refuse what cannot run here before any compile
        step_config(args, impl, 1 if args.check_batch == 0 else args.check_batch)
    ok = check_gradients(args, impls) if args.check_batch else True
    if args.steps:
        time_steps(args, impls)
    return ok


if __name__ == "__main__":
    passed = []
    code = cli.main_guard(lambda: passed.append(main()))  # bad input: one line, exit 2
    sys.exit(code or (0 if passed == [True] else 1))
