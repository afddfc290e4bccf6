"""The training loop both scripts share: data, progress, logging, evaluation, checkpoints.

A script hands `run` its parallel mechanics as a `Strategy` (how state and batches are
placed on devices, and its compiled train / eval steps); everything else is here:

* Checkpoints (`--ckpt-dir`, `--ckpt-every`, `--ckpt-keep`, `--resume`): the state is
  saved *unsharded*, as `strategy.host_state` returns it, in the plain format of
  vit_pure/checkpoint.py, so any script and any device count or mesh layout can resume it
  (`strategy.put_state` lays it out again). Resuming is exact: the run is a function of
  (seed, epoch, step) -- the batch order, each step's random key, the learning rate -- so
  the state plus the step number is all there is to restore.
* Preemption: SIGTERM / SIGINT finish the current step, write a checkpoint and return.
* A non-finite loss stops an fp32 / bf16 run with an error naming the step; in fp16 the
  dynamic loss scale skips such steps (vit_pure/step.py) and the run goes on.
* Profiling (`--profile`, `--profile-steps`) and memory figures in the log.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import resource
import signal
import sys
import threading
import time
from typing import Any, Callable, Protocol

import jax
import numpy as np
import optax

from vit_pure import accum, checkpoint
from vit_pure import data as data_lib
from vit_pure import distributed
from vit_pure.cli import Interrupted, UsageError
from vit_pure.model import count_params
from vit_pure.step import init_state, make_optimizer, step_key


class Strategy(Protocol):
    """The parallel mechanics a script provides to `run`."""
    name: str
    batch_divisor: int  # the global batch must divide by this (the data-parallel degree)

    def describe(self) -> str: ...
    def put_state(self, state: dict) -> Any: ...
    def put_batch(self, *arrays: np.ndarray) -> tuple: ...
    def put_replicated(self, x) -> Any: ...
    def train_step(self, state, images, labels, example_ids, key) -> tuple[Any, dict]: ...
    def eval_step(self, params, images, labels, mask) -> dict: ...
    def host_state(self, state) -> dict: ...
    def metrics_to_host(self, metrics: dict) -> dict: ...


class Logger:
    """Human lines on stdout (through tqdm when a bar is open), JSON lines to a file."""

    def __init__(self, path: str | None, enabled: bool = True):
        self.enabled = enabled
        self.file = open(path, "a", buffering=1) if (path and enabled) else None

    def __call__(self, text: str = "", **record):
        if not self.enabled:
            return
        if text:
            try:
                from tqdm import tqdm
                tqdm.write(text)
            except ImportError:  # pragma: no cover
                print(text, flush=True)
        if record and self.file:
            self.file.write(json.dumps(record) + "\n")

    def close(self):
        if self.file:
            self.file.close()


def evaluate(strategy: Strategy, state, split: data_lib.Split, batch: int) -> dict:
    totals = {"loss": 0.0, "correct": 0.0, "count": 0.0}
    previous = None
    for images, labels, mask in data_lib.eval_batches(split, batch):
        # Each process feeds its own rows of the batch (all of them with one process).
        local = distributed.local_rows(images, labels, mask)
        sums = strategy.eval_step(state, *strategy.put_batch(*local))
        if previous is not None:  # one batch in flight while the host fetches the last
            for k, v in strategy.metrics_to_host(previous).items():
                totals[k] += v
        previous = sums
    for k, v in strategy.metrics_to_host(previous).items():
        totals[k] += v
    count = max(totals["count"], 1.0)
    return {"loss": totals["loss"] / count, "accuracy": totals["correct"] / count,
            "count": int(totals["count"])}


def evaluate_split(strategy: Strategy, state, splits: dict, name: str, batch: int,
                   log: "Logger", prefix: str, **record) -> dict | None:
    """Evaluate one split and log it; an empty split is skipped with one log line (None)."""
    if len(splits[name]) == 0:
        log(f"{prefix}{name}: skipped, the split is empty", event="eval_skipped", name=name,
            **record)
        return None
    res = evaluate(strategy, state, splits[name], batch)
    log(f"{prefix}{name}: loss {res['loss']:.4f}  accuracy {res['accuracy']:.4f} "
        f"({res['count']} images)", split=name, **record, **res)
    return res


def run(args, make_strategy: Callable[[optax.GradientTransformation], Strategy], *,
        is_main: bool | None = None) -> dict:
    """Train, evaluating on validation each `--eval-every` epochs and on test at the end.

    `make_strategy(optimizer)` builds the script's parallel mechanics. Returns the final
    metrics, and the host copy of the final state under "state". A run that stops early
    (SIGTERM / SIGINT with a --ckpt-dir, or --stop-after) returns without the final
    evaluation and with "stopped": {"step", "reason", "checkpoint"}; SIGTERM / SIGINT
    without a --ckpt-dir raises cli.Interrupted. The signal handlers are installed only
    while `run` runs, and the previous ones put back.

    With several processes (vit_pure/distributed.py) every process calls `run` with the
    same flags; only the main one (default: process 0) logs and writes checkpoints, and
    all of them return the same result.
    """
    if is_main is None:
        is_main = jax.process_index() == 0
    log = Logger(args.log_json, enabled=is_main)
    profiler = Profiler(args.profile, args.profile_range, log)
    stop = StopRequest()
    try:
        with stop.handling_signals():
            if getattr(args, "eval_only", False):
                result = evaluate_checkpoint(args, make_strategy, log)
            else:
                result = _run(args, make_strategy, log, is_main, stop, profiler)
        # No process leaves (and takes its part of the runtime with it) before all are done.
        distributed.barrier("end of run")
        return result
    finally:
        profiler.close()
        log.close()


def _run(args, make_strategy, log: Logger, is_main: bool, stop: "StopRequest",
         profiler: "Profiler") -> dict:
    cfg, policy = args.cfg, args.policy_obj
    splits = data_lib.load_dataset(args.dataset, args.data_dir, log=log, **args.synthetic_sizes)
    train = splits["train"]
    steps_per_epoch = data_lib.steps_per_epoch(len(train), args.batch)
    if steps_per_epoch == 0:
        raise data_lib.DataError(
            f"--batch {args.batch} is larger than the {len(train)} training images")
    total_steps = args.epochs * steps_per_epoch
    if args.steps is not None:
        total_steps = min(total_steps, args.steps)
    epochs = -(-total_steps // steps_per_epoch)
    log_every = 1 if total_steps <= 100 else args.log_every

    # The schedule depends on total_steps, so a resumed run must have the same total (the
    # checkpoint's trajectory check below sees to it); --stop-after leaves it alone.
    optimizer, schedule = make_optimizer(args, total_steps)
    # Which checkpoint to start from, and whether it belongs to this run: settled before
    # anything is compiled.
    ckpts = Checkpoints(args, log, is_main, trajectory=trajectory(args, train, total_steps),
                        steps_per_epoch=steps_per_epoch, total_steps=total_steps)
    resume_from = ckpts.find_resume_point()
    # --accum-steps: build the strategy with K micro-batches per step (auto: the
    # smallest K whose compiled step fits in memory; K is written to args.accum_steps).
    strategy = accum.build_strategy(args, make_strategy, optimizer, log=log)
    data_lib.check_batch(args.batch, strategy.batch_divisor)
    eval_batch = args.eval_batch or args.batch
    data_lib.check_batch(eval_batch, strategy.batch_divisor, flag="--eval-batch")
    distributed.check_batch(args.batch)
    distributed.check_batch(eval_batch, flag="--eval-batch")

    # Start from the checkpoint, or from a fresh initialisation.
    if resume_from is None:
        host_state = init_state(jax.random.key(args.seed), cfg, policy, optimizer)
        step = 0
    else:
        # Only shapes and dtypes are needed to read the checkpoint back: no initialisation.
        template = jax.eval_shape(
            lambda: init_state(jax.random.key(args.seed), cfg, policy, optimizer))
        host_state, step = ckpts.load(resume_from, template)
    # Several processes must start from the same step: the same checkpoint, read by each.
    lowest, highest = -distributed.agree_max(-step), distributed.agree_max(step)
    if lowest != highest:
        raise UsageError(f"the processes start from different steps ({lowest} to {highest}): "
                         f"--ckpt-dir must be a directory every process sees")
    log(f"{strategy.name}: {strategy.describe()}")
    log(f"model {cfg.name}: {count_params(host_state['params']):,} params, policy {policy} "
        f"(matmul precision {policy.matmul_precision}), global batch {args.batch}, "
        f"{total_steps} steps ({steps_per_epoch}/epoch, {epochs} epochs)",
        event="config", model=cfg.name, policy=str(policy), batch=args.batch,
        matmul_precision=policy.matmul_precision, steps=total_steps,
        devices=strategy.batch_divisor, strategy=strategy.name, start_step=step)
    state = strategy.put_state(host_state)
    del host_state
    example_ids = np.arange(args.batch, dtype=np.int32)
    losses = LossWatch(strategy, policy.needs_loss_scaling)
    first_step = step

    def stop_reason() -> str | None:  # called at the same points by every process
        signum = stop.agreed()
        if signum is not None:
            return signal.Signals(signum).name
        if args.stop_after is not None and step >= args.stop_after:
            return "--stop-after"
        return None

    last, metrics, batches, bar, memory_step = {}, None, None, None, None
    t_log, n_since = time.perf_counter(), 0
    while step < total_steps and stop_reason() is None:
        # The data position is a pure function of the step: epoch, and batch within it.
        epoch, index = divmod(step, steps_per_epoch)
        if batches is None or index == 0:
            batches = data_lib.train_batches(train, args.batch, seed=args.seed, epoch=epoch,
                                             start=index)
            todo = min(steps_per_epoch - index, total_steps - step)
            bar = _progress(todo, f"epoch {epoch + 1}/{epochs}",
                            is_main and not args.no_progress)
        images, labels = next(batches)
        profiler.before_step(step + 1, state)
        key = strategy.put_replicated(step_key(args.seed, epoch, step))
        previous = metrics
        # Every process built the same global batch; each feeds only its own rows.
        local = distributed.local_rows(images, labels, example_ids)
        state, metrics = strategy.train_step(state, *strategy.put_batch(*local), key)
        # At most two steps in flight: XLA:CPU's collectives can deadlock when many
        # multi-device programs are queued at once, and on accelerators one step of
        # look-ahead is all the overlap there is to gain.
        if previous is not None:
            jax.block_until_ready(previous)
        step += 1
        losses.add(step, metrics)
        n_since += args.batch
        if bar is not None:
            bar.update(1)

        if step % log_every == 0 or step == total_steps:
            # The host syncs of the loop: the metrics, and every loss since the last log
            # point, checked for NaN / inf (see LossWatch).
            m = strategy.metrics_to_host(metrics)
            losses.check(ckpts.last)
            now = time.perf_counter()
            ips = n_since / (now - t_log)
            t_log, n_since = now, 0
            last = {"step": step, "epoch": epoch, "loss": m["loss"],
                    "accuracy": m["accuracy"], "lr": float(schedule(step - 1)),
                    "images_per_s": ips}
            if policy.needs_loss_scaling:
                last["loss_scale"] = strategy.metrics_to_host(
                    {"s": state["loss_scale"].scale})["s"]
                last["skipped_steps"] = losses.skipped
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.4f}", img_s=f"{ips:.1f}")
            log(f"step {step:6d}  loss {m['loss']:.4f}  acc {m['accuracy']:.3f}  "
                f"{ips:8.1f} img/s" + (f"  loss scale {last['loss_scale']:g} ({losses.skipped} "
                                       f"steps skipped)" if "loss_scale" in last else "")
                if bar is None else "", **last)
            if memory_step is None:  # the first log point: the peak includes compiling
                log_memory(log, step)
                memory_step = step

        profiler.after_step(step, state)
        end_of_epoch = step % steps_per_epoch == 0
        if end_of_epoch and bar is not None:
            bar.close()
        if ckpts.dir is not None:
            why = ("end of epoch" if end_of_epoch else "end of run" if step == total_steps
                   else f"every {args.ckpt_every} steps"
                   if args.ckpt_every and step % args.ckpt_every == 0 else None)
            if why:
                losses.check(ckpts.last)  # never save a state that came from a NaN
                ckpts.save(strategy, state, step, why, last)
        if (end_of_epoch and args.eval_every and (epoch + 1) % args.eval_every == 0
                and step < total_steps and stop_reason() is None):
            evaluate_split(strategy, state, splits, "val", eval_batch, log,
                           f"epoch {epoch + 1}: ", step=step, epoch=epoch)
    if bar is not None:
        bar.close()
    losses.check(ckpts.last)
    profiler.finish(step, state)
    if step not in (first_step, memory_step):
        log_memory(log, step)

    reason = stop_reason() if step < total_steps else None
    if reason is not None:
        return _stopped(args, strategy, state, step, reason, ckpts, log, last)
    final = {"train": last}
    # --no-final-eval skips the val / test passes (runs that only measure the steps).
    for split in () if getattr(args, "no_final_eval", False) else ("val", "test"):
        res = evaluate_split(strategy, state, splits, split, eval_batch, log, "final ",
                             step=step)
        if res is not None:
            final[split] = res
    final["state"] = strategy.host_state(state)
    return final


def _stopped(args, strategy, state, step, reason, ckpts, log, last) -> dict:
    """A run stopped before its last step: save where it is, or say nothing was saved."""
    path = None
    if ckpts.dir is not None:
        path = (ckpts.last if ckpts.saved_step == step
                else ckpts.save(strategy, state, step, reason, last))
        log(f"stopped by {reason} after step {step}; checkpoint {path}; "
            "run the same command with --resume to continue",
            event="stopped", step=step, reason=reason, checkpoint=str(path))
    elif reason == "--stop-after":
        log(f"stopped by --stop-after after step {step}; no --ckpt-dir, nothing saved",
            event="stopped", step=step, reason=reason, checkpoint=None)
    else:
        log(event="stopped", step=step, reason=reason, checkpoint=None)  # main_guard says it
        raise Interrupted(f"interrupted by {reason} at step {step}; no --ckpt-dir, nothing saved",
                          signal.Signals[reason])
    return {"train": last, "stopped": {"step": step, "reason": reason,
                                       "checkpoint": None if path is None else str(path)},
            "state": strategy.host_state(state)}


# --------------------------------------------------------------------------- resuming
# Flags that may differ between a checkpoint and the run that resumes it: *where and how*
# the same computation runs (devices, mesh layout, FSDP, accumulation, scan / remat --
# the same math, though float sums may round differently), what is logged and evaluated,
# and the checkpoint / profiling plumbing. Every other flag fixes the trajectory and must
# match; a flag added later is compared unless it is listed here.
RESUMABLE_ACROSS = frozenset({
    "cpu_devices", "mesh", "fsdp", "microbatches", "accum_steps", "memory_budget", "scan", "remat",
    "eval_only",
    "eval_every", "eval_batch", "no_final_eval", "log_json", "log_every", "no_progress",
    "ckpt_dir", "ckpt_every", "ckpt_keep", "resume", "stop_after",
    "profile", "profile_steps", "profile_range",
    "coordinator", "num_processes", "process_id", "distributed",
    # Compared through what they determine (see `trajectory`):
    "epochs", "steps",                                 # -> total steps
    "dtype", "policy", "matmul_precision",             # -> dtype policy
    "data_dir", "synthetic_train", "synthetic_val", "synthetic_test", "synthetic_sizes",
})


def run_config(args) -> dict:
    """Every flag's value (JSON), as recorded in each checkpoint's meta."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(vars(args).items())
            if isinstance(v, (str, int, float, bool, type(None), list, tuple))}


def trajectory(args, train: data_lib.Split, total_steps: int) -> dict:
    """What a checkpoint must share with this run to continue it, by display name."""
    flags = {f"--{k.replace('_', '-')}": v for k, v in run_config(args).items()
             if k not in RESUMABLE_ACROSS}
    labels = np.ascontiguousarray(train.labels)
    derived = {
        "model config": dataclasses.asdict(args.cfg),
        "dtype policy": f"{args.policy_obj} (matmul precision {args.policy_obj.matmul_precision})",
        "total steps": total_steps,  # fixes the learning-rate schedule
        # Which data (not a hash of every image: the labels and the count tell sets apart).
        "training set": f"{len(train)} images, labels sha256 "
                        f"{hashlib.sha256(labels.tobytes()).hexdigest()[:16]}",
    }
    return json.loads(json.dumps({**flags, **derived}))


class Checkpoints:
    """This run's checkpoint directory: where to resume from, and writing new ones."""

    def __init__(self, args, log: Logger, is_main: bool, *,
                 trajectory: dict, steps_per_epoch: int, total_steps: int):
        self.dir = None if args.ckpt_dir is None else pathlib.Path(args.ckpt_dir)
        self.args, self.log, self.is_main = args, log, is_main
        self.trajectory = trajectory
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        # The run's randomness is key(seed) folded with (epoch, step) at each step
        # (step.step_key), so this base key is the RNG state; stored, and compared on
        # resume (it also catches a different jax PRNG implementation).
        self.rng = np.asarray(jax.random.key_data(jax.random.key(args.seed)))
        self.last: pathlib.Path | None = None  # the newest checkpoint written or resumed
        self.saved_step: int | None = None

    def find_resume_point(self) -> pathlib.Path | None:
        """The checkpoint to start from (--resume): the newest intact one, which must
        belong to this run (same trajectory); None to start from scratch."""
        if self.dir is None:
            return None
        existing = checkpoint.list_checkpoints(self.dir)
        if not self.args.resume:
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
        for name in [*self.trajectory, *(k for k in saved if k not in self.trajectory)]:
            if saved.get(name, "<absent>") != self.trajectory.get(name, "<absent>"):
                raise UsageError(
                    f"cannot resume from {path}: {_difference(name, saved, self.trajectory)}")
        # Corrupt checkpoints newer than the one resumed would shadow the ones this run
        # writes (retention counts them); move them aside, kept for inspection.
        for newer in existing[existing.index(path) + 1:]:
            if self.is_main:
                aside = newer.with_name(f"corrupt-{newer.name}")
                os.rename(newer, aside)
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
                 f" ({where.get('layout', '?')})",
                 event="resume", step=step, checkpoint=str(path))
        self.last, self.saved_step = path, step
        return restored, step

    def save(self, strategy: Strategy, state, step: int, why: str,
             metrics: dict) -> pathlib.Path:
        """Write `state` (on devices) as the checkpoint of `step`; never a non-finite one."""
        # Every process fetches the unsharded state (multi-process: a gather), so every
        # process can check it; one writes it.
        host = strategy.host_state(state)
        bad = _first_non_finite(host)
        if bad is not None:
            raise FloatingPointError(
                f"the state after step {step} has non-finite values ({bad}); not saved. "
                f"Last good checkpoint: {self.last or 'none'}")
        path = self.dir / checkpoint.step_dir_name(step)
        if self.is_main:
            epoch, index = divmod(step, self.steps_per_epoch)
            meta = {
                "trajectory": self.trajectory,
                "data": {"epoch": epoch, "batch_in_epoch": index,
                         "steps_per_epoch": self.steps_per_epoch},
                "total_steps": self.total_steps,
                "config": run_config(self.args),
                "model_config": dataclasses.asdict(self.args.cfg),
                "written_by": {"strategy": strategy.name,
                               "layout": strategy.describe().split("\n")[0]},
                "reason": why,
                "metrics": metrics,
            }
            path = checkpoint.save(self.dir, step, {**host, "rng": self.rng}, meta,
                                   keep=self.args.ckpt_keep)
            self.log(f"checkpoint {path} ({why})", event="checkpoint", step=step,
                     path=str(path), reason=why)
        self.last, self.saved_step = path, step
        return path


def _difference(name: str, saved: dict, current: dict) -> str:
    """One line naming what differs, e.g. "--lr differs (checkpoint 0.001, this run 0.002)"."""
    a, b = saved.get(name, "<absent>"), current.get(name, "<absent>")
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return f"{name} differs in {k} (checkpoint {a.get(k)!r}, this run {b.get(k)!r})"
    hint = "; --epochs / --steps must give the same total" if name == "total steps" else ""
    return f"{name} differs (checkpoint {a!r}, this run {b!r}{hint})"


def _first_non_finite(host_state) -> str | None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(host_state):
        a = np.asarray(leaf)
        if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
            if not np.isfinite(a.astype(np.float32)).all():
                return jax.tree_util.keystr(path)
    return None


# --------------------------------------------------------------------------- non-finite loss
class LossWatch:
    """Every step's loss and gradient norm, checked for NaN / inf at the loop's host syncs.

    The loop fetches metrics only every --log-every steps, so each step's two scalars stay
    on the device until the next log point or checkpoint and are checked then: the error
    names the first bad step exactly, and no per-step host sync is added.
    fp32 / bf16: any non-finite loss or gradient norm is a FloatingPointError.
    fp16 (dynamic loss scale): a step whose gradients were not finite was skipped by
    `step.apply_gradients` and the scale shrank; it is counted (`skipped`), whatever its
    loss. A non-finite *loss* with finite gradients is a FloatingPointError here too:
    that update was applied (the scale skips only non-finite gradients), so it is never
    passed over silently.
    """

    def __init__(self, strategy: Strategy, loss_scaled: bool):
        self.strategy, self.loss_scaled = strategy, loss_scaled
        self.pending: list[tuple[int, dict]] = []
        self.skipped = 0  # fp16: steps the loss scale skipped so far in this process

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, {k: metrics[k] for k in ("loss", "grad_norm") if k in metrics}))

    def check(self, last_checkpoint) -> None:
        """Fetch and check the pending steps: raise (fp32 / bf16), or count (fp16)."""
        pending, self.pending = self.pending, []
        for step, scalars in pending:
            m = self.strategy.metrics_to_host(scalars)
            loss, norm = m["loss"], m.get("grad_norm", 0.0)
            if np.isfinite(loss) and np.isfinite(norm):
                continue
            if self.loss_scaled and not np.isfinite(norm):
                self.skipped += 1  # the loss scale skipped this step
                continue
            what = (f"non-finite loss ({loss}) at step {step}" if not np.isfinite(loss) else
                    f"non-finite gradient norm ({norm}, loss {loss:.4f}) at step {step}")
            if self.loss_scaled:  # only a non-finite loss gets here
                what += (f" with a finite gradient norm ({norm:g}), so the loss scale did not "
                         "skip its update")
            raise FloatingPointError(
                f"{what}; stopped without saving it. Last good checkpoint: "
                f"{last_checkpoint or 'none'}")


# --------------------------------------------------------------------------- preemption
class StopRequest:
    """SIGTERM / SIGINT: finish the current step, checkpoint, stop. A second one: stop now.

    The handler only records the signal; the loop looks at it between steps, so a
    preempted job loses at most the step it was in.
    """
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @contextlib.contextmanager
    def handling_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # Python delivers signals to the main thread only; nothing to install
            return
        previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        for s in self.SIGNALS:
            signal.signal(s, self._handle)
        try:
            yield
        finally:
            for s, handler in previous.items():
                if handler is not None:
                    signal.signal(s, handler)

    def agreed(self) -> int | None:
        """The signal to stop for, the same on every process (None: go on).

        A SIGTERM may reach the processes of a job at different times, but they must all
        stop after the same step (each step is a collective program all of them run), so
        with several processes each process's signal number is all-gathered and the
        largest wins. Every process calls this between the same steps; it costs one tiny
        collective, which also waits for the step in flight (one step less of overlap).
        """
        return distributed.agree_max(self.signum or 0) or None

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt  # the second signal: stop at once, save nothing
        self.signum = signum


# --------------------------------------------------------------------------- profiling
class Profiler:
    """A jax.profiler trace of steps first..last (as numbered in the log), if asked for."""

    def __init__(self, directory: str | None, step_range: tuple[int, int] | None, log: Logger):
        self.directory, self.log = directory, log
        self.first, self.last = step_range or (0, -1)
        self.started_at: int | None = None
        self.done = directory is None

    def before_step(self, step: int, state) -> None:
        if not self.done and self.started_at is None and self.first <= step <= self.last:
            jax.block_until_ready(state)  # keep the earlier steps out of the trace
            jax.profiler.start_trace(self.directory)
            self.started_at = step

    def after_step(self, step: int, state) -> None:
        if self.started_at is not None and step >= self.last:
            self.finish(step, state)

    def finish(self, step: int, state) -> None:
        """Stop the trace after `step` (the loop's end); say where it is."""
        if self.done:
            return
        self.done = True
        if self.started_at is None:
            self.log(f"--profile-steps {self.first}:{self.last}: no such step ran; no trace "
                     "written")
            return
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.log(f"profile of steps {self.started_at}-{step} in {self.directory} (TensorBoard's "
                 "profile plugin, or the trace.json.gz in ui.perfetto.dev)",
                 event="profile", first=self.started_at, last=step, dir=str(self.directory))
        log_memory(self.log, step)

    def close(self) -> None:
        """After an error: stop a trace still running."""
        if not self.done and self.started_at is not None:
            self.done = True
            jax.profiler.stop_trace()


def memory_figures() -> dict:
    """Device memory (where the backend reports it) and this process's peak host RSS."""
    figures: dict[str, Any] = {}
    stats = [d.memory_stats() for d in jax.local_devices()]
    if all(stats):
        for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
            values = [s[key] for s in stats if key in s]
            if values:
                figures[f"device_{key}_max"] = max(values)  # the fullest device
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    figures["host_peak_rss_bytes"] = rss if sys.platform == "darwin" else rss * 1024  # KiB
    return figures


def log_memory(log: Logger, step: int) -> None:
    f = memory_figures()
    mib = lambda key: f"{f[key] / 2**20:,.1f} MiB"  # noqa: E731
    if "device_peak_bytes_in_use_max" in f:
        device = (f"device peak {mib('device_peak_bytes_in_use_max')} (fullest device"
                  + (f", limit {mib('device_bytes_limit_max')}"
                     if "device_bytes_limit_max" in f else "") + ")")
    else:
        device = f"device figures not reported by {jax.default_backend()}"
    log(f"memory after step {step}: {device}; host peak RSS {mib('host_peak_rss_bytes')}",
        event="memory", step=step, **f)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)


def evaluate_checkpoint(args, make_strategy, log: Logger) -> dict:
    """--eval-only: the newest intact checkpoint in --ckpt-dir, evaluated on the test split.

    The model and dtype policy come from the checkpoint's own record of its flags, so
    `--eval-only --ckpt-dir DIR` is all it needs; the strategy (script, devices, mesh) is
    this run's, since checkpoints are stored unsharded.
    """
    from vit_pure.config import ViTConfig
    from vit_pure.policy import Policy

    if args.ckpt_dir is None:
        raise UsageError("--eval-only needs --ckpt-dir")
    path = checkpoint.latest(pathlib.Path(args.ckpt_dir), log=log)
    if path is None:
        raise UsageError(f"--eval-only: no intact checkpoint in {args.ckpt_dir}")
    meta = checkpoint.read_meta(path)
    saved = meta.get("config", {})
    args.cfg = ViTConfig(**meta["model_config"]) if "model_config" in meta else args.cfg
    args.model = args.cfg.name
    args.policy_obj = Policy.parse(saved.get("policy") or saved.get("dtype", "fp32"),
                                   saved.get("matmul_precision", "default"))
    optimizer, _ = make_optimizer(args, 1)
    # A full state for the strategy's placement; only the params are read back.
    host_state = init_state(jax.random.key(0), args.cfg, args.policy_obj, optimizer)
    host_state["params"] = checkpoint.restore(path, {"params": host_state["params"]})["params"]
    args.accum_steps = 1
    strategy = make_strategy(optimizer)
    eval_batch = args.eval_batch or args.batch
    data_lib.check_batch(eval_batch, strategy.batch_divisor, flag="--eval-batch")
    splits = data_lib.load_dataset(args.dataset, args.data_dir, log=log, **args.synthetic_sizes)
    step = int(checkpoint.restore(path, {"step": 0})["step"])
    log(f"evaluating {path} ({args.cfg.name}, policy {args.policy_obj}) on the test split")
    res = evaluate_split(strategy, strategy.put_state(host_state), splits, "test", eval_batch,
                         log, "", step=step, checkpoint=str(path))
    return {} if res is None else {"test": res}
