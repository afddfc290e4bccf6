"""What both training scripts' `main` does around their own strategy: with `--plan N`,
compile the step for N devices and print the plan; else start the runtime, turn the flags
into the two frozen values (run/settings.py) and train (run/loop.py)."""
from __future__ import annotations

import argparse
import functools
from typing import Callable

from vit_pure.run import backend, cli, loop, planning
from vit_pure.run.settings import PlanConfig, RunConfig, pretrained_weights, step_config


def main(args: argparse.Namespace, make_strategy: Callable, script: str) -> dict:
    """Plan or train with `make_strategy(sc, optimizer, devices=None)`, the script's strategy
    over `devices` (all of JAX's when None). `script` names the script in the plan."""
    if args.plan is not None:  # compile for --plan N devices and print the plan; no training
        pretrained_weights(args, fit=False)  # --init-from's model, not its weights
        return planning.run(PlanConfig.from_args(args), functools.partial(step_config, args),
                            make_strategy, script)
    cli.start_runtime(args)  # --cpu-devices, then join the processes of a multi-process job
    backend.note_missing_cuda()  # a GPU this jax cannot use: one line naming the install
    # --init-from: the file's weights fitted to the model (which it may change), or None.
    pretrained = pretrained_weights(args)
    # The flags become two frozen values, here, once: nothing below reads `args`.
    sc, rc = step_config(args), RunConfig.from_args(args)
    return loop.run(rc, sc, make_strategy, init_params=pretrained)
