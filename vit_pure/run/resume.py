"""Resuming a run: which checkpoint belongs to it, and writing its checkpoints.

The files are vit_pure/run/checkpoint.py's plain format; this is the policy on top, used by
the training loop. A run is a function of (seed, epoch, step), so the state plus the step
is all there is to restore. The state is saved unsharded (`strategy.host_state`), so any
script, device count or mesh resumes it. `--resume` continues from the newest intact
checkpoint of the same run: every flag that fixes the trajectory must match
(`trajectory`), those that say only where and how it runs may differ (`RESUMABLE_ACROSS`).
A checkpoint of an older kit resumes (`compare`): a flag or model field it predates is
taken at its default, said in one line; one this kit no longer knows is named and
ignored. A state with a NaN / inf is never saved.
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

from vit_pure.config import ViTConfig
from vit_pure.data import cifar10 as data_lib
from vit_pure.errors import UsageError
from vit_pure.run import backend, checkpoint
from vit_pure.run.checks import flag_name
from vit_pure.run.flags import build_parser
from vit_pure.run.settings import RunConfig
from vit_pure.step import OptimConfig, StepConfig, warmup_steps

# Flags that may differ between a checkpoint and the run that resumes it: *where and how*
# the same computation runs (devices, mesh layout, FSDP, accumulation, scan / remat, the
# attention implementation, the last block's rows -- the same math, though float sums may
# round differently), what is logged and evaluated, and the checkpoint / profiling
# plumbing. Every other flag fixes the trajectory and must match; a flag added later is
# compared unless it is listed here. A checkpoint written while one of these was still
# compared records it: it is ignored there too (`first_difference`).
RESUMABLE_ACROSS = frozenset({
    "cpu_devices", "mesh", "fsdp", "microbatches", "accum_steps", "memory_budget", "scan", "remat",
    "attention", "last_block", "biases", "fc1_output", "layer_norm", "qkv_data_grads",
    "pipeline_schedule",
    "virtual_stages",
    "eval_only", "eval_flip", "eval_corners",
    "eval_every", "eval_batch", "no_final_eval", "log_json", "log_every", "no_progress",
    "ckpt_dir", "ckpt_every", "ckpt_keep", "resume", "stop_after",
    "profile", "profile_steps", "profile_range",
    "coordinator", "num_processes", "process_id", "distributed",
    "init_timeout", "heartbeat_timeout", "shutdown_timeout",
    # The communication plan's flags (vit_pure/run/planning.py): `--plan N` trains nothing.
    "plan", "plan_json", "hardware", "gpus_per_node", "efficiency", "peak_tflops",
    "intra_gbps", "inter_gbps", "latency_us", "fabric", "algo",
    # Compared through what they determine (see `trajectory`):
    "epochs", "steps",                                 # -> total steps
    "dtype", "policy", "matmul_precision",             # -> dtype policy
    "pool", "image_size", "dropout", "drop_path",      # -> model config
    "data_dir", "subset", "val_fraction", "synthetic_train", "synthetic_val",
    "synthetic_test", "synthetic_sizes",               # -> training set
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


def _json(value):
    """`value` as a checkpoint's JSON meta holds it (tuples as lists)."""
    return json.loads(json.dumps(value))


def flag_defaults() -> dict:
    """Every flag's default, by display name ("--layer-decay": 1.0), as JSON holds it: what
    a checkpoint that predates a flag is taken to have run with."""
    actions = build_parser("")._actions
    return _json({flag_name(a.dest): a.default for a in actions if a.dest != "help"
                  and isinstance(a.default, (str, int, float, bool, type(None), list, tuple))})


# The model's fields, by name, and the defaults that a checkpoint written before a field
# existed is taken to have (a field without a default has none to take).
MODEL_DEFAULTS = _json({f.name: f.default for f in dataclasses.fields(ViTConfig)
                        if f.default is not dataclasses.MISSING})


def resolved_flags(sc: StepConfig, optim: OptimConfig, total_steps: int,
                   given: dict) -> dict:
    """The flags whose "not given" (None) the run resolves, at the value the run uses, by
    display name; `given` is the command line's values (RunConfig.flags). The trajectory
    records these, not the text given: a run that gives the value a None resolves to is
    the same run."""
    resolved = {"--warmup-steps": warmup_steps(optim, total_steps),
                "--dropout-masks": sc.execution.dropout_masks}
    return {k: v for k, v in resolved.items() if k[2:].replace("-", "_") in given}


def none_means(optim: OptimConfig, total_steps: int, platform: str) -> dict:
    """What a None that a checkpoint recorded for a resolved flag (an older kit recorded
    the text given) means for this run: its value when not given, by display name."""
    masks = backend.resolve("fp32", "default", None, platform, flags=frozenset()).dropout_masks
    return {"--warmup-steps": warmup_steps(dataclasses.replace(optim, warmup_steps=None),
                                           total_steps),
            "--dropout-masks": masks}


def trajectory(rc: RunConfig, sc: StepConfig, train: data_lib.Split, total_steps: int) -> dict:
    """What a checkpoint must share with this run to continue it, by display name."""
    given = dict(rc.flags)
    flags = {flag_name(k): v for k, v in rc.flags
             if k not in RESUMABLE_ACROSS}
    flags.update(resolved_flags(sc, rc.schedule.optim, total_steps, given))
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
        self.none_means = none_means(rc.schedule.optim, total_steps, jax.default_backend())
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
        difference, notes = compare(saved, self.trajectory, defaults=flag_defaults(),
                                    none_means=self.none_means)
        if difference is not None:
            raise UsageError(f"cannot resume from {path}: {difference}")
        for note in notes:  # an older kit's checkpoint: what was assumed, what ignored
            self.log(f"--resume: {note}", event="resume_note", note=note)
        stop_after, step = self.rc.schedule.stop_after, checkpoint.step_of(path)
        if stop_after is not None and stop_after <= step:  # it would stop at once, again
            raise UsageError(f"--stop-after {stop_after}: {path} is at step {step} already; "
                             f"drop --stop-after (or give a later step) to continue the run")
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
    """None if a trajectory `saved` may be continued by a run with trajectory `current`
    (both of this kit: two processes of one job), else one line naming the first
    difference, the two sides called `names`."""
    return compare(saved, current, names=names)[0]


def compare(saved: dict, current: dict, *, defaults: dict | None = None,
            none_means: dict | None = None,
            names: tuple[str, str] = ("checkpoint", "this run")) -> tuple[str | None, list]:
    """(None, notes) if a checkpoint's trajectory `saved` may be continued by a run with
    trajectory `current`, else (one line naming the first difference, []).

    Field by field, so that a checkpoint of an older kit resumes:
    * a flag that `saved` lacks (it predates the flag) is taken at its default
      (`defaults`, by display name), a model field it lacks at ViTConfig's; a note says so;
    * a None that `saved` records for a flag the run resolves means what `none_means` says
      (an older kit recorded "not given", this one the value used);
    * a flag `saved` records that this kit neither compares nor knows is named in a note
      and ignored (one now in RESUMABLE_ACROSS is not compared, without a note);
    * every other field must be equal.
    """
    defaults, none_means = defaults or {}, none_means or {}
    notes = []
    for name, now in current.items():
        predates = name not in saved
        if predates and name not in defaults:
            return _difference(name, _ABSENT, _shown(now, name, none_means), names), []
        recorded = defaults[name] if predates else saved[name]
        was = none_means[name] if recorded is None and name in none_means else recorded
        if isinstance(was, dict) and isinstance(now, dict):
            difference = _compare_fields(name, was, now, names, notes)
            if difference is not None:
                return difference, []
        elif was != now:
            shown = _shown(recorded, name, none_means)
            difference = _difference(name, f"predates it: taken as {shown}" if predates
                                     else shown, _shown(now, name, none_means), names)
            if name in none_means and was is not None:  # e.g. another backend's default
                difference += f"; give {name} {was} to continue it"
            return difference, []
        if predates:
            notes.append(f"checkpoint predates {name}: taken as "
                         f"{_shown(recorded, name, none_means)}")
    for name, was in saved.items():
        if name not in current and name not in _RESUMABLE_FLAGS:
            notes.append(f"checkpoint records {name} {_shown(was, name)}, which this kit "
                         f"does not know: ignored")
    return None, notes


_ABSENT = "absent"  # how a side that does not hold a field is shown


def _compare_fields(name: str, was: dict, now: dict, names: tuple[str, str],
                    notes: list) -> str | None:
    """A nested field (the model config): the checkpoint's fields one by one, a field it
    predates at its default (MODEL_DEFAULTS), one this kit does not know named and
    ignored. None if they agree, else one line."""
    for k, value in now.items():
        if k not in was:
            if k not in MODEL_DEFAULTS or MODEL_DEFAULTS[k] != value:
                saved = (f"predates it: taken as {_shown(MODEL_DEFAULTS[k])}"
                         if k in MODEL_DEFAULTS else _ABSENT)
                return (f"{name} differs in {k} ({names[0]} {saved}, "
                        f"{names[1]} {_shown(value)})")
            notes.append(f"checkpoint predates the {name}'s {k}: taken as {_shown(value)}")
        elif was[k] != value:
            return (f"{name} differs in {k} ({names[0]} {_shown(was[k])}, "
                    f"{names[1]} {_shown(value)})")
    for k in was:
        if k not in now:
            notes.append(f"checkpoint records the {name}'s {k} {_shown(was[k])}, which this "
                         f"kit does not know: ignored")
    return None


def _shown(value, name: str | None = None, none_means: dict | None = None) -> str:
    """A value in a line: repr, but never a bare None: a flag's None is "not given", with
    what that means for this run where it resolves (`none_means`); a model field's None
    is its "none"."""
    if value is None:
        if name is not None and none_means and name in none_means:
            return f"not given ({none_means[name]!r})"
        return "not given" if name is not None else "none"
    return repr(value)


def _difference(name: str, a: str, b: str, names: tuple[str, str]) -> str:
    """One line naming what differs, e.g. "--lr differs (checkpoint 0.001, this run 0.002)",
    from the two sides as shown."""
    hint = "; --epochs / --steps must give the same total" if name == "total steps" else ""
    return f"{name} differs ({names[0]} {a}, {names[1]} {b}{hint})"


def _first_non_finite(host_state) -> str | None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(host_state):
        a = np.asarray(leaf)
        if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
            if not np.isfinite(a.astype(np.float32)).all():
                return jax.tree_util.keystr(path)
    return None
