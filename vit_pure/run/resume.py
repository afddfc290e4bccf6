"""Resuming a run: which checkpoint belongs to it, and writing its checkpoints.

The files themselves are vit_pure/run/checkpoint.py's plain format; this is the policy on top,
used by the training loop (vit_pure/run/loop.py):

* A run is a function of (seed, epoch, step) -- the batch order, each step's random key,
  the learning rate -- so the state plus the step number is all there is to restore.
* The state is saved *unsharded* (`strategy.host_state`), so any script and any device
  count or mesh layout can resume it (`strategy.put_state` lays it out again).
* `--resume` continues from the newest intact checkpoint in `--ckpt-dir`, but only one of
  the same run: every flag that fixes the trajectory must match (`trajectory`), while
  those that only say where and how it runs may differ (`RESUMABLE_ACROSS`).
* A state with a NaN / inf is never saved.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from typing import Callable

import jax
import numpy as np

from vit_pure.data import cifar10 as data_lib
from vit_pure.errors import UsageError
from vit_pure.run import checkpoint
from vit_pure.run.checks import flag_name
from vit_pure.run.settings import RunConfig
from vit_pure.step import StepConfig

# Flags that may differ between a checkpoint and the run that resumes it: *where and how*
# the same computation runs (devices, mesh layout, FSDP, accumulation, scan / remat, the
# attention implementation, the last block's rows -- the same math, though float sums may
# round differently), what is logged and evaluated, and the checkpoint / profiling
# plumbing. Every other flag fixes the trajectory and must match; a flag added later is
# compared unless it is listed here. A checkpoint written while one of these was still
# compared records it: it is ignored there too (`first_difference`).
RESUMABLE_ACROSS = frozenset({
    "cpu_devices", "mesh", "fsdp", "microbatches", "accum_steps", "memory_budget", "scan", "remat",
    "attention", "last_block", "biases", "fc1_output", "layer_norm", "pipeline_schedule",
    "virtual_stages",
    "eval_only", "eval_flip", "eval_corners",
    "eval_every", "eval_batch", "no_final_eval", "log_json", "log_every", "no_progress",
    "ckpt_dir", "ckpt_every", "ckpt_keep", "resume", "stop_after",
    "profile", "profile_steps", "profile_range",
    "coordinator", "num_processes", "process_id", "distributed",
    # The communication plan's flags (vit_pure/run/planning.py): `--plan N` trains nothing.
    "plan", "plan_json", "hardware", "gpus_per_node", "efficiency", "peak_tflops",
    "intra_gbps", "inter_gbps", "latency_us",
    # Compared through what they determine (see `trajectory`):
    "epochs", "steps",                                 # -> total steps
    "dtype", "policy", "matmul_precision",             # -> dtype policy
    "data_dir", "subset", "synthetic_train", "synthetic_val", "synthetic_test",
    "synthetic_sizes",                                 # -> training set
})


_RESUMABLE_FLAGS = frozenset(flag_name(name) for name in RESUMABLE_ACROSS)


def move_aside(path: pathlib.Path) -> pathlib.Path:
    """Rename a corrupt checkpoint to ``corrupt-<name>`` beside it, kept for inspection; a
    name already taken (the same step corrupted again after a fallback) gets ``.2``, ``.3``,
    ... so moving aside never fails on, or overwrites, an earlier one. Returns the new path."""
    aside, n = path.with_name(f"corrupt-{path.name}"), 1
    while True:
        try:
            os.rename(path, aside)  # atomic; refuses a non-empty directory that exists
            return aside
        except OSError:
            if not aside.exists():
                raise  # not a name collision: a real I/O error
        n += 1
        aside = path.with_name(f"corrupt-{path.name}.{n}")


def trajectory(rc: RunConfig, sc: StepConfig, train: data_lib.Split, total_steps: int) -> dict:
    """What a checkpoint must share with this run to continue it, by display name."""
    flags = {flag_name(k): v for k, v in rc.flags
             if k not in RESUMABLE_ACROSS}
    labels = np.ascontiguousarray(train.labels)
    derived = {
        "model config": dataclasses.asdict(sc.cfg),
        # The matmul output dtype (m=) is left out: chosen per backend, it only moves where
        # products round (like the mesh), so a run may continue on another kind of device.
        "dtype policy": f"{str(sc.policy).rpartition(',m=')[0]} "
                        f"(matmul precision {sc.policy.matmul_precision})",
        "total steps": total_steps,  # fixes the learning-rate schedule
        # Which data (not a hash of every image: the labels and the count tell sets apart).
        "training set": f"{len(train)} images, labels sha256 "
                        f"{hashlib.sha256(labels.tobytes()).hexdigest()[:16]}",
    }
    return json.loads(json.dumps({**flags, **derived}))


class Checkpoints:
    """This run's checkpoint directory: where to resume from, and writing new ones."""

    def __init__(self, rc: RunConfig, sc: StepConfig, train: data_lib.Split, steps_per_epoch: int,
                 total_steps: int, log: Callable, is_main: bool):
        ckpt_dir = rc.checkpoints.ckpt_dir
        self.dir = None if ckpt_dir is None else pathlib.Path(ckpt_dir)
        self.rc, self.sc, self.log, self.is_main = rc, sc, log, is_main
        self.trajectory = trajectory(rc, sc, train, total_steps)
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        # The run's randomness is key(seed) folded with (epoch, step) at each step
        # (step.step_key), so this base key is the RNG state; stored, and compared on
        # resume (it also catches a different jax PRNG implementation).
        self.rng = np.asarray(jax.random.key_data(jax.random.key(rc.data.seed)))
        self.last: pathlib.Path | None = None  # the newest checkpoint written or resumed
        self.saved_step: int | None = None
        self.last_loss: float | None = None  # the training loss logged before it was written
        # Which script and layout wrote the checkpoints (meta only): `set_writer`, once.
        self.written_by = {"strategy": "?", "layout": "?"}

    def describe_last(self) -> str:
        """The newest checkpoint this run can fall back to, and how good it is: its step and
        the training loss logged before it was written (for error messages)."""
        if self.last is None:
            return "none"
        loss = "not logged" if self.last_loss is None else f"{self.last_loss:.4f}"
        return f"{self.last} (step {self.saved_step}, logged loss {loss})"

    def set_writer(self, strategy_name: str, layout: str) -> None:
        self.written_by = {"strategy": strategy_name, "layout": layout}

    def find_resume_point(self) -> pathlib.Path | None:
        """The checkpoint to start from (--resume): the newest intact one, which must
        belong to this run (same trajectory); None to start from scratch."""
        if self.dir is None:
            return None
        existing = checkpoint.list_checkpoints(self.dir)
        if not self.rc.checkpoints.resume:
            if existing:
                raise UsageError(
                    f"--ckpt-dir {self.dir} already holds checkpoints (newest "
                    f"{existing[-1].name}); add --resume to continue from them, or use "
                    f"another directory")
            return None
        path = checkpoint.latest(self.dir, log=self.log)
        if path is None:
            if existing:
                raise UsageError(
                    f"--resume: none of the {len(existing)} checkpoints in {self.dir} is "
                    f"intact (see above); move them away to start from scratch")
            self.log(f"--resume: no checkpoint in {self.dir} yet; starting from step 0")
            return None
        saved = checkpoint.read_meta(path).get("trajectory", {})
        difference = first_difference(saved, self.trajectory)
        if difference is not None:
            raise UsageError(f"cannot resume from {path}: {difference}")
        # Corrupt checkpoints newer than the one resumed would shadow the ones this run
        # writes (retention counts them); move them aside, kept for inspection.
        for newer in existing[existing.index(path) + 1:]:
            if self.is_main:
                aside = move_aside(newer)
                self.log(f"moved corrupt checkpoint {newer} to {aside}")
        return path

    def load(self, path: pathlib.Path, template: dict) -> tuple[dict, int]:
        """(host state, step) from the checkpoint `find_resume_point` chose."""
        meta = checkpoint.read_meta(path)
        restored = checkpoint.restore(path, {**template, "rng": self.rng})
        if not np.array_equal(restored.pop("rng"), self.rng):
            raise UsageError(f"cannot resume from {path}: its base random key differs "
                             f"(another jax PRNG implementation?)")
        step = int(restored["step"])  # the optimizer steps taken; the data position follows
        where = meta.get("written_by", {})
        epoch, done = divmod(step, self.steps_per_epoch)
        self.log(f"resumed from {path}: step {step}, epoch {epoch + 1} with {done} of its "
                 f"{self.steps_per_epoch} batches done; written by {where.get('strategy', '?')}"
                 f" ({where.get('layout', '?').removesuffix('; layout:')})",
                 event="resume", step=step, checkpoint=str(path))
        self.last, self.saved_step = path, step
        self.last_loss = meta.get("metrics", {}).get("loss")
        return restored, step

    def save(self, strategy, state, step: int, why: str,
             metrics: dict) -> pathlib.Path:
        """Write `state` (on devices) as the checkpoint of `step`; never a non-finite one."""
        # Every process fetches the unsharded state (multi-process: a gather), so every
        # process can check it; one writes it.
        host = strategy.host_state(state)
        bad = _first_non_finite(host)
        if bad is not None:
            raise FloatingPointError(
                f"the state after step {step} has non-finite values ({bad}); not saved. "
                f"Last checkpoint: {self.describe_last()}")
        path = self.dir / checkpoint.step_dir_name(step)
        if self.is_main:
            epoch, index = divmod(step, self.steps_per_epoch)
            meta = {
                "trajectory": self.trajectory,
                "data": {"epoch": epoch, "batch_in_epoch": index,
                         "steps_per_epoch": self.steps_per_epoch},
                "total_steps": self.total_steps,
                "config": dict(self.rc.flags),
                "model_config": dataclasses.asdict(self.sc.cfg),
                # The dtype policy as this run resolved it (--eval-only reads it back).
                "policy": str(self.sc.policy),
                "matmul_precision": self.sc.policy.matmul_precision,
                "written_by": self.written_by,
                "reason": why,
                "metrics": metrics,
            }
            path = checkpoint.save(self.dir, step, {**host, "rng": self.rng}, meta,
                                   keep=self.rc.checkpoints.ckpt_keep)
            self.log(f"checkpoint {path} ({why})", event="checkpoint", step=step,
                     path=str(path), reason=why)
        self.last, self.saved_step = path, step
        self.last_loss = metrics.get("loss") if metrics else None
        return path


def first_difference(saved: dict, current: dict,
                     names: tuple[str, str] = ("checkpoint", "this run")) -> str | None:
    """None if a checkpoint's trajectory `saved` may be continued by a run with trajectory
    `current`, else one line naming the first difference, the two sides called `names`.
    A flag the checkpoint records that is now in RESUMABLE_ACROSS is not compared."""
    for name in [*current,
                 *(k for k in saved if k not in current and k not in _RESUMABLE_FLAGS)]:
        if saved.get(name, "<absent>") != current.get(name, "<absent>"):
            return _difference(name, saved, current, names)
    return None


def _difference(name: str, saved: dict, current: dict, names: tuple[str, str]) -> str:
    """One line naming what differs, e.g. "--lr differs (checkpoint 0.001, this run 0.002)"."""
    a, b = saved.get(name, "<absent>"), current.get(name, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return (f"{name} differs in {k} ({names[0]} {a.get(k)!r}, "
                        f"{names[1]} {b.get(k)!r})")
    hint = "; --epochs / --steps must give the same total" if name == "total steps" else ""
    return f"{name} differs ({names[0]} {a!r}, {names[1]} {b!r}{hint})"


def _first_non_finite(host_state) -> str | None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(host_state):
        a = np.asarray(leaf)
        if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
            if not np.isfinite(a.astype(np.float32)).all():
                return jax.tree_util.keystr(path)
    return None
