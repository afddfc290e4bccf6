"""Both training scripts' command line: parsed and checked (the flags themselves are in
vit_pure/run/flags.py), the runtime it starts, and one-line errors for bad input."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from typing import Any, Callable

import jax

from vit_pure import quiet
from vit_pure.config import get_preset
from vit_pure.errors import CheckpointError, DataError, Interrupted, UsageError
from vit_pure.policy import Policy
from vit_pure.run import distributed
from vit_pure.run.checks import (
    check_checkpoint_flags,
    check_device_counts,
    check_model_flags,
    check_numbers,
    check_paths,
    check_process_flags,
    check_profile_flags,
    check_split_and_views,
    check_synthetic_flags,
    flag_name,
)
from vit_pure.run.flags import (  # noqa: F401 (used as cli.build_parser, cli.RECIPES, ...)
    DEFAULT_EFFICIENCY,
    RECIPES,
    OneLineErrorParser,
    add_plan_flags,
    build_parser,
)


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    recipe = parser.parse_known_args(argv)[0].recipe
    if recipe is not None:  # the recipe's values become defaults: explicit flags win
        parser.set_defaults(**RECIPES[recipe])
    args = parser.parse_args(argv)
    check_numbers(parser, args)
    check_device_counts(parser, args)  # before start_runtime or the plan creates them
    check_checkpoint_flags(parser, args)
    check_profile_flags(parser, args)
    check_synthetic_flags(parser, args)
    check_split_and_views(parser, args)
    try:
        if (args.policy or args.dtype) != "auto":  # checked here; built by settings.step_config
            Policy.parse(args.policy or args.dtype, args.matmul_precision)
    except ValueError as e:
        parser.error(f"--policy: {e}")
    args.cfg = get_preset(args.model)
    for name in ("dropout", "drop_path"):  # the model preset's rates, unless given
        rate = getattr(args, name)
        if rate is not None:
            if not 0.0 <= rate < 1.0:
                parser.error(f"{flag_name(name)} must be in [0, 1), got {rate}")
            args.cfg = args.cfg.replace(**{name: rate})
    if args.pool is not None:
        args.cfg = args.cfg.replace(pool=args.pool)
    check_model_flags(parser, args)
    check_process_flags(parser, args)
    check_paths(parser, args)
    return args


def start_runtime(args: argparse.Namespace) -> None:
    """The flags' side effects on the JAX runtime, in the order they must happen, before
    anything touches a device (the scripts' main() calls this right after parse_args):
    the random bits the program needs (`pin_randomness`), --cpu-devices (fake CPU
    devices), then joining a multi-process job (jax.distributed), then starting JAX's
    backends (vit_pure/quiet.py: where JAX's CUDA plugin has no GPU, the lines it prints
    then are left out).
    """
    pin_randomness()
    if args.cpu_devices is not None:
        use_cpu_devices(args.cpu_devices)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.distributed or args.coordinator is not None:  # (parse_args checked the trio)
        try:
            distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                   init_timeout=args.init_timeout,
                                   heartbeat_timeout=args.heartbeat_timeout,
                                   shutdown_timeout=args.shutdown_timeout)
        except ValueError as e:  # JAX's cluster detection found nothing to fill in
            raise UsageError(f"--distributed: {e} (give --coordinator, --num-processes and "
                             f"--process-id outside SLURM / Open MPI / Cloud TPU)") from None
    with quiet.filtered():  # the backends start now, without the CUDA plugin's noise
        jax.devices()


def pin_randomness() -> None:
    """Set `jax_threefry_partitionable`, which a user may have turned off
    (JAX_THREEFRY_PARTITIONABLE=0), to what the kit's programs need: on, JAX's default.

    With it on, the bits `jax.random` draws for each element of an array depend on the
    element's index alone, so an example's dropout mask over the class token's row is the
    first row of its mask over every row: the last block on the class token alone
    (Execution.last_block "class-token") then computes the whole block's loss and
    gradients, under either mask kind (tests/test_randomness.py). Off, `bernoulli`'s masks
    of the two programs differ, and so do their losses. One line says when it was off.
    """
    if not jax.config.jax_threefry_partitionable:
        print("note: jax_threefry_partitionable was off (JAX_THREEFRY_PARTITIONABLE=0?); "
              "turned on: the kit's dropout masks need it (vit_pure/run/cli.py "
              "pin_randomness)", file=sys.stderr, flush=True)
        jax.config.update("jax_threefry_partitionable", True)


def use_cpu_devices(n: int) -> None:
    """Ask XLA for n fake CPU devices (only the CPU backend reads it). XLA reads XLA_FLAGS
    when the backend starts, i.e. at jax's first device query: call this before it."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def doc_parser(doc: str) -> OneLineErrorParser:
    """The parser of a tool run as a module, from its docstring: the first paragraph is the
    description, the rest (usage lines, notes) the epilog, kept as written."""
    head, _, rest = doc.strip().partition("\n\n")
    return OneLineErrorParser(description=head, epilog=rest or None,
                              formatter_class=argparse.RawDescriptionHelpFormatter)


def require_positive(parser, args, *names: str) -> None:
    """A tool's counts and durations: a one-line parser.error for the first of `names`
    whose value is not positive (NaN is not)."""
    for name in names:
        value = getattr(args, name)
        if not value > 0:
            parser.error(f"{flag_name(name)} must be positive, got {value}")


def main_guard(fn: Callable[[], Any]) -> int:
    """Run a script's main; bad input becomes one line on stderr and exit code 2.

    A run stopped by SIGINT or SIGTERM exits 128 + the signal number (130, 143), whether it
    saved a checkpoint (loop.run returns "stopped") or had no --ckpt-dir (Interrupted): the
    shell's "stopped by this signal", so no wrapper takes it for a finished run; its log
    says whether it saved. A second signal stops at once without saving: 130. A run that
    --stop-after ends exits 0.

    In a multi-process job every failure is also reported to the other processes, which
    stop with it (distributed.Watch), and the process leaves at once: Python's clean-up
    would wait in JAX's shutdown barrier for processes that are stopping too. Any other
    exception is reported the same way before its traceback; a JaxRuntimeError only after
    distributed.wait_for_peer_failure, since another process's death breaks the collective
    this one is in with such an error, before the Watch can name it.
    """
    try:
        result = fn()
    except (DataError, UsageError, FloatingPointError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return _leave(2, str(e))
    except Interrupted as e:  # the agreed stop, in every process alike: not a failure
        print(e, file=sys.stderr)
        distributed.Watch.finish()
        return e.exit_code
    except KeyboardInterrupt:  # a second SIGTERM / SIGINT (or one before run() started)
        print("interrupted: stopped at once; nothing saved since the last checkpoint",
              file=sys.stderr)
        return _leave(130, "interrupted by a second signal")
    except Exception as e:  # a bug or an unforeseen failure: its traceback, then as above
        if isinstance(e, jax.errors.JaxRuntimeError):  # perhaps a collective a peer broke
            distributed.wait_for_peer_failure()  # (its death named instead: exit 3)
        if distributed.report_failure(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"):
            traceback.print_exc()
            return _leave(1, "")
        raise
    stopped = result.get("stopped") if isinstance(result, dict) else None
    if stopped and stopped["reason"] in signal.Signals.__members__:  # saved, then stopped
        return 128 + signal.Signals[stopped["reason"]]
    return 0


def _leave(code: int, cause: str) -> int:
    """`code`, after telling a multi-process job's other processes why this one stops (an
    empty `cause`: already told)."""
    if not cause or distributed.report_failure(cause):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not Python's exit: its clean-up waits for the other processes
    return code
