"""What `cli.parse_args` refuses: flag values that parse but make no run, each reported by
argparse as one line and exit code 2 (docs/testing.md, "Bad input").
"""
from __future__ import annotations

import math
import os

from vit_pure.run.accum import SAFETY, mem_available_bytes

# What one device costs in host memory, as a bound `--cpu-devices N` and `--plan N` are
# refused against: a fake CPU device that runs a program, and one that `--plan N` only
# compiles for (fake CPU or deviceless GPU), with room for growth at large N. The
# measurements behind both: docs/performance.md, "Host memory a device costs".
RUN_DEVICE_BYTES = int(1.2 * 2**20)
PLAN_DEVICE_BYTES = 2**18


def flag_name(name: str) -> str:
    """The flag an argparse attribute comes from: "drop_path" -> "--drop-path"."""
    return "--" + name.replace("_", "-")


def check_numbers(parser, args) -> None:
    """Every numeric flag within its range: counts, rates, coefficients (NaN never is)."""
    def at_least(name, low, what):  # None means "not given" (a default chosen later)
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= low):
            parser.error(f"{flag_name(name)} must be {what}, got {value}")

    for name in ("batch", "epochs", "log_every", "steps", "eval_batch", "stop_after"):
        at_least(name, 1, "positive")
    for name in ("warmup_steps", "eval_every", "weight_decay", "grad_clip", "mixup", "cutmix",
                 "ckpt_every"):
        at_least(name, 0, ">= 0")
    at_least("ckpt_keep", 1, ">= 1")
    check_levers(parser, args)
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    if not 0.0 <= args.label_smoothing < 1.0:
        parser.error(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    if not 0 <= args.seed < 2 ** 63:  # jax.random.key takes a 64-bit signed seed
        parser.error(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.memory_budget is not None:
        if not (math.isfinite(args.memory_budget) and args.memory_budget > 0):
            parser.error(f"--memory-budget must be positive, got {args.memory_budget}")
        if args.accum_steps != "auto":
            parser.error(f"--memory-budget is the budget of --accum-steps auto; with "
                         f"--accum-steps {args.accum_steps} nothing reads it")


def device_limit(per_device: int, available: int | None = None) -> int:
    """How many devices of `per_device` bytes this host's memory holds: SAFETY of the
    available RAM (MemAvailable), the share --accum-steps auto plans with."""
    if available is None:
        available = mem_available_bytes()
    return max(1, int(SAFETY * available // per_device))


def check_device_counts(parser, args, available: int | None = None) -> None:
    """--cpu-devices N and --plan N against what this host's memory holds, before any
    device exists: XLA creates the N devices at JAX's first device query, and a count
    past the memory would take minutes and then the machine (RUN_DEVICE_BYTES,
    PLAN_DEVICE_BYTES above)."""
    for name, per_device, what in (
            ("cpu_devices", RUN_DEVICE_BYTES, "fake CPU devices that run the step"),
            ("plan", PLAN_DEVICE_BYTES, "devices to compile the plan for")):
        n = getattr(args, name, None)  # (a tool may have one of the two flags)
        if n is None:
            continue
        if n < 1:
            parser.error(f"{flag_name(name)} must be positive, got {n}")
        if available is None:
            available = mem_available_bytes()
        limit = device_limit(per_device, available)
        if n > limit:
            parser.error(
                f"{flag_name(name)} {n:,}: this machine holds at most {limit:,} {what} "
                f"(about {per_device / 2**20:.2g} MiB of host memory each; "
                f"{SAFETY:.0%} of its {available / 2**30:.1f} GiB available)")


def check_levers(parser, args) -> None:
    """--ema, --mix-off-epochs, --repeat-aug: the small-data levers (docs/training.md)."""
    if not (math.isfinite(args.ema) and 0.0 <= args.ema < 1.0):
        parser.error(f"--ema must be a decay in [0, 1) (0: off), got {args.ema}")
    if args.mix_off_epochs < 0:
        parser.error(f"--mix-off-epochs must be >= 0, got {args.mix_off_epochs}")
    if args.mix_off_epochs and not (args.mixup or args.cutmix):
        parser.error(f"--mix-off-epochs {args.mix_off_epochs}: there is no mixing to turn "
                     f"off (add --mixup or --cutmix)")
    if args.mix_off_epochs and args.mix_off_epochs >= args.epochs:
        parser.error(f"--mix-off-epochs {args.mix_off_epochs} must be less than --epochs "
                     f"{args.epochs} (or mixing never runs)")
    if args.repeat_aug < 1:
        parser.error(f"--repeat-aug must be >= 1, got {args.repeat_aug}")
    if args.batch % args.repeat_aug:
        parser.error(f"--repeat-aug {args.repeat_aug} does not divide --batch {args.batch}")


def check_paths(parser, args) -> None:
    """Where the run will write: fail now, not after the first epoch's training.
    --eval-only only reads --ckpt-dir: a read-only folder will do."""
    for flag, path in (("--ckpt-dir", args.ckpt_dir), ("--profile", args.profile)):
        if path is None:
            continue
        if flag == "--ckpt-dir" and args.eval_only:
            if not os.path.isdir(path):
                parser.error(f"--ckpt-dir {path}: no such directory (--eval-only reads "
                             f"its checkpoints)")
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            parser.error(f"{flag} {path}: exists and is not a directory")
        parent = os.path.abspath(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            parser.error(f"{flag} {path}: cannot create or write it ({parent} is not a "
                         f"writable directory)")
    for flag, path in (("--log-json", args.log_json),
                       ("--plan-json", getattr(args, "plan_json", None))):
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            parser.error(f"{flag} {path}: is a directory, expected a file")
        if not os.path.isdir(parent):
            parser.error(f"{flag} {path}: directory {parent} does not exist")
    if (args.dataset == "cifar10" and os.path.exists(args.data_dir)
            and not os.path.isdir(args.data_dir)):
        parser.error(f"--data-dir {args.data_dir}: exists and is not a directory")
    init_from = getattr(args, "init_from", None)  # a URL is fetched later (vit_pure/weights/)
    if init_from and "://" not in init_from and not os.path.exists(os.path.expanduser(init_from)):
        parser.error(f"--init-from {init_from}: no such file or folder")


def check_model_flags(parser, args) -> None:
    """Flags that only make sense together: an explicit --last-block class-token needs the
    class-token pool (with another pool it would be ignored). Call after args.cfg holds
    --pool. (--trainable head without --init-from: settings.pretrained_weights.)"""
    if args.last_block == "class-token" and args.cfg.pool != "cls":
        parser.error(f"--last-block class-token: the head of --pool {args.cfg.pool} reads "
                     f"every token, so every row of the last block is needed (drop the flag "
                     f"or give --last-block all)")


def check_checkpoint_flags(parser, args) -> None:
    if args.stop_after is not None and args.steps is not None and args.stop_after > args.steps:
        parser.error(f"--stop-after {args.stop_after}: the run ends sooner, at --steps "
                     f"{args.steps}")
    if args.ckpt_dir is None:
        for flag, given in (("--resume", args.resume), ("--ckpt-every", args.ckpt_every),
                            ("--eval-only", args.eval_only)):
            if given:
                parser.error(f"{flag} needs --ckpt-dir")


def check_profile_flags(parser, args) -> None:
    """--profile-steps A:B -> args.profile_range = (A, B), 1 <= A <= B (default 3:5)."""
    args.profile_range = None
    if args.profile is None:
        if args.profile_steps is not None:
            parser.error("--profile-steps needs --profile")
        return
    text = args.profile_steps or "3:5"
    first, sep, last = text.partition(":")
    if not (sep and first.strip().isdigit() and last.strip().isdigit()
            and 1 <= int(first) <= int(last)):
        parser.error(f"--profile-steps {text!r}: expected A:B with 1 <= A <= B, e.g. 3:5")
    args.profile_range = (int(first), int(last))
    if args.steps is not None and args.profile_range[0] > args.steps:  # nothing to trace
        parser.error(f"--profile-steps {text}{'' if args.profile_steps else ' (the default)'}"
                     f": the run has only --steps {args.steps}")


def check_synthetic_flags(parser, args) -> None:
    """args.synthetic_sizes: the load_dataset keywords of the --synthetic-* flags."""
    sizes = {f"n_{name}": getattr(args, f"synthetic_{name}") for name in ("train", "val", "test")}
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if sizes and args.dataset != "synthetic":
        parser.error("--synthetic-train/--synthetic-val/--synthetic-test need --dataset synthetic")
    for k, v in sizes.items():
        if v < 0:
            parser.error(f"--synthetic-{k[2:]} must be >= 0")
    args.synthetic_sizes = sizes


def check_split_and_views(parser, args) -> None:
    """--val-fraction (CIFAR-10 only, in [0, 0.5]) and --eval-corners (not with
    --trainable head, whose cached features hold two views of each image)."""
    if args.val_fraction is not None:
        if args.dataset != "cifar10":
            parser.error("--val-fraction needs --dataset cifar10 (the synthetic set's sizes: "
                         "--synthetic-val)")
        if not 0.0 <= args.val_fraction <= 0.5:
            parser.error(f"--val-fraction must be in [0, 0.5], got {args.val_fraction:g}")
    if args.eval_corners and args.trainable == "head":
        parser.error("--eval-corners: not with --trainable head, whose cached features "
                     "hold each image and its mirror only")


def check_process_flags(parser, args) -> None:
    """--coordinator / --num-processes / --process-id: all three or none (unless
    --distributed lets JAX detect them); `start_runtime` joins the job. The timeouts are
    checked whether or not the run has several processes."""
    for name in ("init_timeout", "heartbeat_timeout", "shutdown_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 1):
            parser.error(f"{flag_name(name)} must be a number of seconds >= 1, got {value:g}")
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
             "--process-id": args.process_id}
    if not args.distributed and all(v is None for v in given.values()):
        return  # one process
    if not args.distributed and None in given.values():
        missing = ", ".join(k for k, v in given.items() if v is None)
        parser.error(f"a multi-process run needs --coordinator, --num-processes and "
                     f"--process-id (missing {missing}); or --distributed, to let JAX detect "
                     f"them from the cluster (SLURM, Open MPI, Cloud TPU)")
    if args.coordinator is not None:
        host, _, port = args.coordinator.rpartition(":")
        if not (host and port.isdigit() and 1 <= int(port) <= 65535):
            parser.error(f"--coordinator {args.coordinator!r}: expected HOST:PORT with a "
                         f"port in 1..65535")
    if args.num_processes is not None and args.num_processes < 1:
        parser.error("--num-processes must be >= 1")
    if args.process_id is not None and args.process_id < 0:
        parser.error(f"--process-id must be >= 0, got {args.process_id}")
    if (args.process_id is not None and args.num_processes is not None
            and not 0 <= args.process_id < args.num_processes):
        parser.error(f"--process-id must be in 0..{args.num_processes - 1}")
