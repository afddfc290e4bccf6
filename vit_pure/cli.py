"""Command-line flags shared by both training scripts, and one-line errors for bad input."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from vit_pure import data as data_lib
from vit_pure.config import PRESETS, get_preset
from vit_pure.policy import Policy


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="vit-cifar", choices=sorted(PRESETS), help="model preset")
    a("--batch", type=int, default=128, help="global batch (divisible by the device count)")
    a("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
      help="f32 master params computing in this dtype")
    a("--policy", default=None, help="full dtype policy, e.g. p=f32,c=bf16,o=f32 (wins over --dtype)")
    a("--matmul-precision", default="default", choices=["default", "high", "highest"])
    a("--epochs", type=int, default=200)
    a("--steps", type=int, default=None, help="stop after this many optimizer steps")
    a("--dataset", default="cifar10", choices=["cifar10", "synthetic"])
    a("--data-dir", default="./data")
    a("--seed", type=int, default=0)
    a("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    a("--warmup-steps", type=int, default=None,
      help="linear warm-up steps (default: 5%% of the run)")
    a("--weight-decay", type=float, default=0.05, help="AdamW decoupled weight decay")
    a("--grad-clip", type=float, default=1.0, help="global-norm gradient clipping (0: off)")
    a("--label-smoothing", type=float, default=0.0)
    a("--scan", action=argparse.BooleanOptionalAction, default=True,
      help="lax.scan over the encoder layers (faster compile) instead of a Python loop")
    a("--remat", default="none", choices=["none", "block"],
      help="recompute each encoder block in the backward pass")
    a("--eval-every", type=int, default=1, help="evaluate on the validation split every N epochs (0: never)")
    a("--eval-batch", type=int, default=None, help="evaluation batch (default: --batch)")
    a("--log-json", default=None, help="append one JSON object per log line to this file")
    a("--log-every", type=int, default=50, help="log every N steps (every step if the run has <= 100)")
    a("--cpu-devices", type=int, default=None,
      help="on a CPU-only machine, run on N fake devices")
    a("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.cpu_devices is not None:
        if args.cpu_devices < 1:
            parser.error("--cpu-devices must be >= 1")
        # XLA reads this when the backend starts, i.e. at the first device query.
        flags = os.environ.get("XLA_FLAGS", "").split()
        flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(
            flags + [f"--xla_force_host_platform_device_count={args.cpu_devices}"])
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for name in ("batch", "epochs", "log_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.steps is not None and args.steps <= 0:
        parser.error("--steps must be positive")
    try:
        args.policy_obj = Policy.parse(args.policy or args.dtype, args.matmul_precision)
    except ValueError as e:
        parser.error(f"--policy: {e}")
    args.cfg = get_preset(args.model)
    return args



class UsageError(ValueError):
    """A bad flag combination, reported as one line."""


def main_guard(fn: Callable[[], Any]) -> int:
    """Run a script's main; bad input becomes one line on stderr and exit code 2."""
    try:
        fn()
    except (data_lib.DataError, UsageError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

