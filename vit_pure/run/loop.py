"""The training loop both scripts share: data, the step loop, evaluation, stopping.

A script hands `run` its parallel mechanics as a `Strategy` (how state and batches are
placed on devices, and its compiled train / eval steps); the rest of a run is here, with
two neighbours:

* run/resume.py: checkpoints, saved unsharded so any script, device count or layout
  resumes them exactly (the run is a function of (seed, epoch, step)).
* run/monitor.py: the log, the NaN / inf check of every step's loss, profiling, memory.

SIGTERM / SIGINT finish the current step, write a checkpoint and return (run/signals.py).
Evaluation: run/evaluate.py. A non-finite loss stops the run naming the step; in fp16 the
dynamic loss scale skips steps whose gradients are not finite and the run goes on.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import pathlib
import signal
from typing import Callable

import jax
import numpy as np

from vit_pure.data import cifar10 as data_lib
from vit_pure.errors import DataError, Interrupted, UsageError
from vit_pure.model import count_params
from vit_pure.run import accum, distributed, probe
from vit_pure.run.evaluate import evaluate_checkpoint, evaluate_split
from vit_pure.run.monitor import (
    Heartbeat,
    Logger,
    LossWatch,
    NoBar,
    Profiler,
    Throughput,
    compile_seconds,
    compiling,
    log_memory,
    progress_bar,
)
from vit_pure.run.resume import Checkpoints, first_difference
from vit_pure.run.settings import (
    CheckpointSettings,
    DataSettings,
    LogSettings,
    RunConfig,
    ScheduleSettings,
)
from vit_pure.run.signals import StopRequest
from vit_pure.run.strategy import Strategy
from vit_pure.step import StepConfig, init_state, make_optimizer, step_key


def run(rc: RunConfig, sc: StepConfig, make_strategy: Callable[..., Strategy], *,
        is_main: bool | None = None, init_params: dict | None = None) -> dict:
    """Train, evaluating on validation each `--eval-every` epochs and on test at the end.

    `sc` is the step's settings (step.StepConfig); `make_strategy(sc, optimizer)` builds
    the script's parallel mechanics. Returns the final metrics, and the host copy of the
    final state under "state". A run that stops early (SIGTERM / SIGINT with a
    --ckpt-dir, or --stop-after) returns without the final evaluation and with "stopped":
    {"step", "reason", "checkpoint"}; SIGTERM / SIGINT without a --ckpt-dir raises
    cli.Interrupted. The signal handlers are installed only while `run` runs, and the
    previous ones put back.

    With several processes (vit_pure/run/distributed.py) every process calls `run` with the
    same flags; only the main one (default: process 0) logs and writes checkpoints, and
    all of them return the same result.

    `init_params`: a fresh run starts from these params (a host tree like
    `model.init_params`'s: --init-from's weights, vit_pure/weights/) instead of a random
    initialisation; placed like any checkpoint's (`strategy.put_state`). A resumed run
    ignores them.
    """
    if is_main is None:
        is_main = jax.process_index() == 0
    log = Logger(rc.logging.log_json, enabled=is_main)
    profiler = Profiler(rc.logging.profile, rc.logging.profile_range, log)
    stop = StopRequest()
    try:
        with stop.handling_signals():
            if rc.logging.eval_only:
                result = evaluate_checkpoint(rc, sc, make_strategy, log)
            else:
                result = _run(rc, sc, make_strategy, log, is_main, stop, profiler, init_params)
            # No process leaves (and takes its part of the runtime with it) before all are
            # done; a signal that arrives in the barrier finds the handler still installed
            # (StopRequest.finished: the run already ended cleanly, so it is ignored).
            stop.finished = True
            distributed.barrier("end of run")
        distributed.Watch.finish()
        return result
    finally:
        profiler.close()
        log.close()


def _run(rc: RunConfig, sc: StepConfig, make_strategy, log: Logger, is_main: bool,
         stop: StopRequest, profiler: Profiler, init_params: dict | None = None) -> dict:
    # One function on purpose: the whole loop reads top to bottom, like
    # nanoGPT's train.py; what is not the loop itself is in the short helpers below.
    # ---- Setup: data, the step count, the checkpoint to start from, the strategy, state.
    data = rc.data
    splits = data_lib.load_dataset(data.dataset, data.data_dir, log=log, **data.dataset_sizes)
    train = splits["train"]
    plan = plan_steps(rc.schedule, rc.logging, len(train))
    # The schedule depends on total_steps, so a resumed run must have the same total (the
    # checkpoint's trajectory check sees to it); --stop-after leaves it alone.
    optimizer, schedule = make_optimizer(rc.schedule.optim, plan.total_steps)
    # The checkpoint to start from, and whether it belongs to this run: before compiling.
    ckpts = Checkpoints(rc, sc, train, plan.steps_per_epoch, plan.total_steps, log, is_main)
    _agree_on_trajectory(ckpts.trajectory)  # several processes: the same run in every one
    resume_from = ckpts.find_resume_point()
    # K micro-batches per step (--accum-steps; auto: the smallest K that fits in memory),
    # after checking that --batch and --eval-batch split over processes and devices.
    # The step is measured for the images the loop feeds (the dataset's, resized on the
    # device to the model's input size), so the loop's first step reuses that compile.
    compiled = compile_seconds()
    strategy, sc = accum.build_strategy(rc, sc, make_strategy, optimizer,
                                        image_shape=train.images.shape[1:], log=log)
    # --accum-steps auto compiled the step that runs: the first step's figure counts it.
    compiled_before = compile_seconds() - compiled if rc.schedule.accum_steps == "auto" else 0.0
    eval_batch = rc.data.eval_batch
    host_state, step = _start_state(rc.data, sc, optimizer, ckpts, resume_from,
                                    init_params, log)
    del init_params
    if is_main:  # describe() may compile and place a whole state: once, and where it is read
        _log_setup(log, rc.data, sc, strategy, ckpts, plan, host_state, step)
    state = strategy.put_state(host_state)
    losses = LossWatch(strategy, sc.policy.needs_loss_scaling,
                       min_scale=host_state["loss_scale"].min_scale)
    # --trainable head: the frozen backbone's features once, then the head alone on them
    # (probe.py); the step loop below then has no step left to run.
    state, step, probe_metrics = _probe(rc.schedule, rc.data, rc.logging, sc, strategy, host_state,
                                        state, splits, plan, step, ckpts, log, is_main)
    del host_state
    first_step, memory_step = step, None
    metrics, bar = None, NoBar()
    # --no-progress: a line at least once a minute between the log points.
    beat = Heartbeat(None if rc.logging.progress else log, "training", plan.total_steps,
                     "steps")
    # Each step's inputs, placed on the devices two steps ahead of the step that runs.
    inputs = _device_inputs(rc.data, strategy, train, plan, step, depth=2)
    mixing = MixSchedule(rc.schedule, sc, plan, lambda sc: make_strategy(sc, optimizer), log)
    train_step = mixing.train_step(strategy, step)
    if (not compiled_before and hasattr(train_step, "lower")  # a jitted step (both scripts')
            and step < plan.total_steps):
        inputs, compiled_before = _compile_first_step(log, sc, plan, train_step, state, inputs)
    speed = Throughput(rc.schedule.batch, step, compiled_before)
    points = LogPoints(log, strategy, losses, speed)
    if probe_metrics is not None:
        points.last = probe_metrics

    # ---- The step loop. The host waits for the step it has just dispatched only once, at
    # the first (its time and compile apart, then the memory): it reads a step's metrics
    # (log points, the NaN check) once the next step is queued behind it, and waits
    # only where it must read the state (checkpoints, evaluation).
    while step < plan.total_steps and _stop_reason(stop, rc.schedule, step) is None:
        epoch = step // plan.steps_per_epoch
        if step == first_step or step % plan.steps_per_epoch == 0:
            bar = plan.progress_bar(step, epoch, is_main and rc.logging.progress)
        profiler.before_step(step + 1, state)
        previous = metrics
        train_step = mixing.train_step(strategy, step)  # --mix-off-epochs: the unmixed one
        state, metrics = train_step(state, *next(inputs))
        points.read(ckpts.describe_last())  # the last log point's metrics, while this step runs
        # At most two steps in flight: XLA:CPU's collectives can deadlock when many are
        # queued, and on accelerators one step of look-ahead is all the overlap to gain.
        if previous is not None:
            jax.block_until_ready(previous)
        step += 1
        losses.add(step, metrics)
        bar.update(1)
        beat.update(step)
        if step == first_step + 1:  # the first step, waited for: its time, compile apart
            _log_first_step(log, speed, metrics, step)
            log_memory(log, step)  # after it ran: the peak includes compiling
            memory_step = step

        if step % plan.log_every == 0 or step == plan.total_steps:
            # Read after the next step is dispatched, once this one has finished (its
            # img/s too); the learning rate is computed on the device now, between the
            # steps, and read with them.
            points.mark(metrics, state, bar, ckpts.describe_last(), step=step, epoch=epoch,
                        lr=schedule(step - 1))
        profiler.after_step(step, state)
        end_of_epoch = step % plan.steps_per_epoch == 0
        if end_of_epoch:
            bar.close()
        why = _checkpoint_reason(rc.checkpoints, plan, step, end_of_epoch) if ckpts.dir else None
        if why:
            with speed.paused(metrics):  # the logged img/s counts training steps only
                points.read(ckpts.describe_last())
                # Never save a state that came from a NaN (the check raises) or a step whose
                # loss was not finite (fp16: the loss scale skipped it).
                losses.check(ckpts.describe_last(), _loss_scale(strategy, state, losses))
                if losses.last_loss_finite:
                    ckpts.save(strategy, state, step, why, points.last)
                else:
                    log(f"checkpoint of step {step} not written: its loss is not finite",
                        event="checkpoint_skipped", step=step)
        if (end_of_epoch and rc.logging.eval_every and (epoch + 1) % rc.logging.eval_every == 0
                and step < plan.total_steps and _stop_reason(stop, rc.schedule, step) is None):
            with speed.paused(metrics):
                points.read(ckpts.describe_last())
                evaluate_split(strategy, state, splits, "val", eval_batch, log,
                               f"epoch {epoch + 1}: ", step=step, epoch=epoch)

    # ---- The end: the last checks, then stopped early (saved), or the final evaluation.
    del inputs  # the batches placed ahead of a run that stopped early
    points.read(ckpts.describe_last())
    bar.close()
    losses.check(ckpts.describe_last(), _loss_scale(strategy, state, losses))
    profiler.finish(step, state)
    if step not in (first_step, memory_step):
        jax.block_until_ready(state)  # the figures of the steps done, not of those queued
        log_memory(log, step)
    reason = _stop_reason(stop, rc.schedule, step) if step < plan.total_steps else None
    if reason is not None:
        return _stopped(strategy, state, step, reason, ckpts, log, points.last)
    return _final(rc.logging, strategy, state, splits, eval_batch, log, step, points.last)


# --------------------------------------------------------------------------- the helpers
def _probe(schedule: ScheduleSettings, data: DataSettings, logging: LogSettings,
           sc: StepConfig, strategy: Strategy, host_state: dict, state, splits: dict,
           plan: "StepPlan", step: int, ckpts: Checkpoints, log: Logger,
           is_main: bool) -> tuple:
    """--trainable head with a features step: the head fitted on cached features
    (probe.py) and checkpointed at the last step; returns (state, step, the last metrics)
    or, for any other run, (state, step, None) unchanged."""
    if sc.trainable != "head" or step >= plan.total_steps:
        return state, step, None
    if strategy.features_step is None:
        log("--trainable head: this strategy has no features step (a pipeline): the frozen "
            "backbone runs forward in every training step", event="probe_setup", images=0)
        return state, step, None
    state, metrics = probe.run(
        strategy, host_state, state, splits, sc=sc, optim=schedule.optim,
        batch=plan.batch, eval_batch=data.eval_batch, steps_per_epoch=plan.steps_per_epoch,
        total_steps=plan.total_steps, start=step, seed=data.seed,
        eval_every=logging.eval_every, log=log, progress=is_main and logging.progress)
    if ckpts.dir:
        ckpts.save(strategy, state, plan.total_steps, "end of run", metrics)
    return state, plan.total_steps, metrics


def _compile_first_step(log: Logger, sc: StepConfig, plan: "StepPlan", train_step, state,
                        inputs):
    """The training step compiled before the loop, said before and after, not silently
    inside step 1 (the step's call then finds it in jit's cache). Returns the inputs (the
    batch it compiled for put back in front) and the compile's seconds."""
    batch = next(inputs)
    with compiling(log, f"the training step for {sc.cfg.name}, global batch {plan.batch}, "
                        f"K={sc.accum_steps} micro-batches per device") as done:
        train_step.lower(state, *batch).compile()
    return itertools.chain([batch], inputs), done["seconds"]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How many steps of how many images, in how many epochs, and how often the loop logs."""
    batch: int                      # the global batch of a step
    steps_per_epoch: int
    total_steps: int
    epochs: int
    log_every: int

    def progress_bar(self, step: int, epoch: int, enabled: bool):
        """The bar for the epoch `step` is in: its remaining steps."""
        todo = min(self.steps_per_epoch - step % self.steps_per_epoch, self.total_steps - step)
        return progress_bar(todo, f"epoch {epoch + 1}/{self.epochs}", enabled)


def plan_steps(schedule: ScheduleSettings, logging: LogSettings, n_train: int) -> StepPlan:
    """--epochs, capped by --steps; every step is a full batch (the remainder is dropped)."""
    s = schedule
    steps_per_epoch = data_lib.steps_per_epoch(n_train, s.batch)
    if steps_per_epoch == 0:
        raise DataError(
            f"--batch {s.batch} is larger than the {n_train} training images")
    total_steps = s.epochs * steps_per_epoch
    if s.steps is not None:
        total_steps = min(total_steps, s.steps)
    # cli checks these against --steps; the length that --epochs gives is known only here.
    ends = (f"the run ends sooner, at step {total_steps:,} "
            f"({s.epochs} epoch{'s' * (s.epochs != 1)} x {steps_per_epoch:,} steps)")
    if s.stop_after is not None and s.stop_after > total_steps:
        raise UsageError(f"--stop-after {s.stop_after}: {ends}")
    if logging.profile_range is not None and logging.profile_range[0] > total_steps:
        first, last = logging.profile_range
        raise UsageError(f"--profile-steps {first}:{last}: {ends}")
    return StepPlan(s.batch, steps_per_epoch, total_steps,
                    epochs=-(-total_steps // steps_per_epoch),
                    log_every=1 if total_steps <= 100 else logging.log_every)


def _device_inputs(data: DataSettings, strategy: Strategy, train: data_lib.Split, plan: StepPlan,
                   start: int, depth: int):
    """The inputs of every step from `start` on, placed on the devices `depth` steps ahead.

    Each item is (images, labels, example ids, key) as the strategy's train step takes
    them. The data position is a pure function of the step (epoch, and batch within it),
    so a resumed run gets the batches the uninterrupted one had. Every process builds the
    same global batch and feeds only its own rows. Placing a batch while the steps before
    it run keeps the host-to-device copy off the device's critical path.
    """
    example_ids = np.arange(plan.batch, dtype=np.int32)

    def placed():
        step = start
        while step < plan.total_steps:
            epoch, index = divmod(step, plan.steps_per_epoch)
            for images, labels in data_lib.train_batches(
                    train, plan.batch, seed=data.seed, epoch=epoch, start=index,
                    repeat=data.repeat_aug):
                if step == plan.total_steps:
                    return
                local = distributed.local_rows(images, labels, example_ids)
                yield (*strategy.put_batch(*local),
                       strategy.put_replicated(step_key(data.seed, epoch, step)))
                step += 1

    steps = placed()
    queue = collections.deque(itertools.islice(steps, depth))
    while queue:
        yield queue.popleft()
        queue.extend(itertools.islice(steps, 1))


class LogPoints:
    """The loop's log points, read one step late.

    At a log point (`mark`) the step's metrics stay on the device; `read`, which the loop
    calls once the next step is dispatched (or before it reads the state anyway: a
    checkpoint, an evaluation, the end), fetches them, checks every loss since the last
    log point for NaN / inf (monitor.LossWatch) and logs the line. So the device never
    idles while the host logs, and a bad loss still stops the run naming its step,
    before a checkpoint could save it. fp16: the loss scale lives in the state, which the
    next step consumes (donation), so a loss-scaled run reads its log point at once.
    """

    def __init__(self, log: Logger, strategy: Strategy, losses: LossWatch, speed: Throughput):
        self.log, self.strategy, self.losses, self.speed = log, strategy, losses, speed
        self.pending: dict | None = None
        self.last: dict = {}  # the last log point read: checkpoints and the result keep it

    def mark(self, metrics, state, bar, last_checkpoint, **point) -> None:
        self.pending = {"metrics": metrics, "bar": bar, **point}
        if self.losses.loss_scaled:
            self.read(last_checkpoint, state)

    def read(self, last_checkpoint, state=None) -> None:
        if self.pending is not None:
            p, self.pending = self.pending, None
            jax.block_until_ready(p["metrics"])  # the step has finished: now its img/s
            rate = self.speed.rate(p["step"])
            self.last = _log_point(self.log, self.strategy, state, p.pop("metrics"),
                                   self.losses, p.pop("bar"), last_checkpoint,
                                   **{**p, "lr": float(p["lr"]), "rate": rate})


class MixSchedule:
    """--mix-off-epochs N: mixup / CutMix for all but the last N epochs of the run.

    Two variants of the train step, each compiled once: the run's own (`strategy`), and,
    from the first step of the last N epochs on, a second strategy built by
    `make_strategy(sc without mixing)`. Both lay the state out the same way (the mixing
    is no part of it), so the state passes from one to the other as it is. (A traced
    on/off argument would avoid the second compile but change every strategy's step
    signature; a second compile of the same step costs what the first did, once.)
    The first unmixed step is a pure function of the plan: (epochs - N) * steps per
    epoch, so a resumed run switches at the same step.
    """

    def __init__(self, schedule: ScheduleSettings, sc: StepConfig, plan: StepPlan, make_strategy,
                 log: Logger):
        n = schedule.mix_off_epochs
        mixes = sc.augment and (sc.mixup_alpha > 0 or sc.cutmix_alpha > 0)
        self.off_from = (max(plan.epochs - n, 0) * plan.steps_per_epoch if n and mixes
                         else None)
        self.epochs, self.make_strategy, self.log = n, make_strategy, log
        self.unmixed = None

    def mixes_at(self, step: int) -> bool:
        """Does the step after `step` steps done mix (given mixing is configured)?"""
        return self.off_from is None or step < self.off_from

    def train_step(self, strategy: Strategy, step: int):
        """The train step to run after `step` steps done."""
        if self.mixes_at(step):
            return strategy.train_step
        if self.unmixed is None:
            self.unmixed = self.make_strategy(
                dataclasses.replace(strategy.sc, mixup_alpha=0.0, cutmix_alpha=0.0))
            self.log(f"mixup / cutmix off from step {step + 1} on, for the last "
                     f"{self.epochs} epochs (--mix-off-epochs); compiling the unmixed training "
                     f"step", event="mix_off", step=step)
        return self.unmixed.train_step


def _start_state(data: DataSettings, sc: StepConfig, optimizer, ckpts: Checkpoints,
                 resume_from: pathlib.Path | None, init_params: dict | None = None,
                 log: Logger | None = None) -> tuple[dict, int]:
    """(host state, step): from the checkpoint, or at step 0 from `init_params` (imported
    weights) or a fresh initialisation."""
    if resume_from is None:
        if log is not None:  # one compile (model.init_params, step.init_state)
            log(f"initialising the {sc.cfg.name} state"
                + (" around the --init-from weights" if init_params is not None else ""))
        host_state = init_state(jax.random.key(data.seed), sc.cfg, sc.policy, optimizer,
                                ema=sc.ema_decay > 0, params=init_params)
        step = 0
    else:
        # Only shapes and dtypes are needed to read the checkpoint back: no initialisation.
        template = jax.eval_shape(
            lambda: init_state(jax.random.key(data.seed), sc.cfg, sc.policy, optimizer,
                               ema=sc.ema_decay > 0))
        host_state, step = ckpts.load(resume_from, template)
    # Several processes must start from the same step: the same checkpoint, read by each.
    lowest, highest = -distributed.agree_max(-step), distributed.agree_max(step)
    if lowest != highest:
        raise UsageError(f"the processes start from different steps ({lowest} to {highest}): "
                         f"--ckpt-dir must be a directory every process sees")
    return host_state, step


def _log_setup(log: Logger, data: DataSettings, sc: StepConfig, strategy: Strategy,
               ckpts: Checkpoints, plan: StepPlan, host_state: dict, step: int) -> None:
    """The strategy's layout and the run's configuration, at the top of the log."""
    layout = strategy.describe()
    # The checkpoints' meta says it: the layout's first line, less the table's heading.
    ckpts.set_writer(strategy.name, layout.split("\n")[0].removesuffix("; layout:"))
    log(f"{strategy.name}: {layout}")
    policy = sc.policy
    pool = "" if sc.cfg.pool == "cls" else f" (pool {sc.cfg.pool}: {sc.cfg.seq_len} tokens)"
    log(f"model {sc.cfg.name}{pool}: {count_params(host_state['params']):,} params, policy "
        f"{policy} (matmul precision {policy.matmul_precision}), global batch {plan.batch}, "
        f"{plan.total_steps} steps ({plan.steps_per_epoch}/epoch, {plan.epochs} epochs)",
        event="config", model=sc.cfg.name, pool=sc.cfg.pool, policy=str(policy),
        batch=plan.batch, matmul_precision=policy.matmul_precision, steps=plan.total_steps,
        devices=strategy.batch_divisor, strategy=strategy.name, start_step=step)
    for note in sc.notes:  # what the hardware chose for the flags left to it (run/backend.py)
        log(f"chosen for this hardware: {note}", event="hardware_choice", note=note)
    log(f"execution: {sc.execution.describe()}", event="execution",
        **dataclasses.asdict(sc.execution))


def _log_first_step(log: Logger, speed: Throughput, metrics, step: int) -> None:
    """Wait for the run's first step, and say how long it took and how much of that was
    compiling (which no img/s figure counts). The compile figure counts the step's compile
    wherever it happened: before the loop (its own "compiling" lines, or --accum-steps
    auto's) and in the step (JSON: compile_s the whole, compile_before_s before the loop)."""
    jax.block_until_ready(metrics)
    seconds, compiling = speed.first_step()
    before = speed.compiled_before
    log(f"step {step} done in {seconds:.2f} s; compiling the training step took "
        f"{before + compiling:.2f} s, {compiling:.2f} s of it in the step (left out of "
        f"img/s)", event="first_step", step=step, seconds=seconds,
        compile_s=before + compiling, compile_before_s=before)


def _log_point(log: Logger, strategy: Strategy, state, metrics, losses: LossWatch, bar,
               last_checkpoint, *, step: int, epoch: int, lr: float, rate: float) -> dict:
    """A log point's host sync (LogPoints.read): every loss since the last log point
    checked for NaN / inf (monitor.LossWatch), then the step's metrics fetched and logged
    (line and JSON). `state` is read only for the loss scale (fp16)."""
    losses.check(last_checkpoint, _loss_scale(strategy, state, losses))
    m = strategy.metrics_to_host(metrics)
    last = {"step": step, "epoch": epoch, "loss": m["loss"], "accuracy": m["accuracy"],
            "lr": lr, "images_per_s": rate}
    text = (f"step {step:6d}  loss {m['loss']:.4f}  acc {m['accuracy']:.3f}  "
            f"{rate:8.1f} img/s")
    if losses.loss_scaled:
        last["loss_scale"] = _loss_scale(strategy, state, losses)
        last["skipped_steps"] = losses.skipped
        text += f"  loss scale {last['loss_scale']:g} ({losses.skipped} steps skipped)"
    if not bar.disable:  # an open bar shows it (not the line); the JSON record still gets it
        bar.set_postfix(loss=f"{m['loss']:.4f}", img_s=f"{rate:.1f}")
        text = ""
    log(text, **last)
    return last


def _agree_on_trajectory(trajectory: dict) -> None:
    """Every process must run the same trajectory (the flags a resume compares, the model,
    the dtype policy, the data): before anything compiles, each compares its own with
    every other's; a difference is one UsageError line, the same on every process."""
    everyone = [json.loads(text) for text in
                distributed.exchange("trajectory", json.dumps(trajectory, sort_keys=True))]
    for p, other in enumerate(everyone[1:], 1):
        difference = first_difference(everyone[0], other, ("process 0", f"process {p}"))
        if difference is not None:
            raise UsageError(f"the processes disagree on the run: {difference}; every "
                             f"process must be given the same flags")


def _loss_scale(strategy: Strategy, state, losses: LossWatch) -> float | None:
    """The loss scale now, on the host (fp16; None otherwise or with no state at hand)."""
    if not losses.loss_scaled or state is None:
        return None
    return strategy.metrics_to_host({"s": state["loss_scale"].scale})["s"]


def _checkpoint_reason(ckpt: CheckpointSettings, plan: StepPlan, step: int,
                       end_of_epoch: bool) -> str | None:
    """Why to save after `step` (None: don't)."""
    if end_of_epoch:
        return "end of epoch"
    if step == plan.total_steps:
        return "end of run"
    if ckpt.ckpt_every and step % ckpt.ckpt_every == 0:
        return f"every {ckpt.ckpt_every} steps"
    return None


def _stop_reason(stop: StopRequest, schedule: ScheduleSettings, step: int) -> str | None:
    """Why to stop before the next step (None: go on). Every process calls it at the same
    points (a signal is agreed between them: see StopRequest.agreed)."""
    signum = stop.agreed(step)
    if signum is not None:
        return signal.Signals(signum).name
    if schedule.stop_after is not None and step >= schedule.stop_after:
        return "--stop-after"
    return None


def _final(logging: LogSettings, strategy: Strategy, state, splits: dict, eval_batch: int,
           log: Logger, step: int, last: dict) -> dict:
    """The run's result: the last train metrics, val and test, the host state."""
    final = {"train": last}
    # --no-final-eval skips the val / test passes (runs that only measure the steps).
    for split in ("val", "test") if logging.final_eval else ():
        res = evaluate_split(strategy, state, splits, split, eval_batch, log, "final ",
                             step=step)
        if res is not None:
            final[split] = res
            if "raw" in res:  # --ema: val also with the raw weights (see evaluate_split)
                final[f"{split}_raw"] = res.pop("raw")
    final["state"] = strategy.host_state(state)
    return final


def _stopped(strategy: Strategy, state, step: int, reason: str, ckpts: Checkpoints,
             log: Logger, last: dict) -> dict:
    """A run stopped before its last step: save where it is, or say nothing was saved."""
    path = None
    if ckpts.dir is not None:
        path = (ckpts.last if ckpts.saved_step == step
                else ckpts.save(strategy, state, step, reason, last))
        again = ("the same command with --resume and without --stop-after (or with a later "
                 "step)" if reason == "--stop-after" else "the same command with --resume")
        log(f"stopped by {reason} after step {step}; checkpoint {path}; run {again} to "
            f"continue",
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


# --------------------------------------------------------------------------- evaluation
