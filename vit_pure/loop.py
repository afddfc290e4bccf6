"""The training loop both scripts share: data, progress, logging, evaluation.

A script hands `run` its parallel mechanics as a `Strategy` (how state and batches are
placed on devices, and its compiled train / eval steps); everything else is here.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Protocol

import jax
import numpy as np
import optax

from vit_pure import data as data_lib
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
        sums = strategy.eval_step(state, *strategy.put_batch(images, labels, mask))
        if previous is not None:  # one batch in flight while the host fetches the last
            for k, v in strategy.metrics_to_host(previous).items():
                totals[k] += v
        previous = sums
    for k, v in strategy.metrics_to_host(previous).items():
        totals[k] += v
    count = max(totals["count"], 1.0)
    return {"loss": totals["loss"] / count, "accuracy": totals["correct"] / count,
            "count": int(totals["count"])}


def run(args, make_strategy: Callable[[optax.GradientTransformation], Strategy], *,
        is_main: bool = True) -> dict:
    """Train, evaluating on validation each `--eval-every` epochs and on test at the end.

    `make_strategy(optimizer)` builds the script's parallel mechanics. Returns the final
    metrics, and the host copy of the final state under "state".
    """
    log = Logger(args.log_json, enabled=is_main)
    try:
        return _run(args, make_strategy, log, is_main)
    finally:
        log.close()


def _run(args, make_strategy, log: Logger, is_main: bool) -> dict:
    cfg, policy = args.cfg, args.policy_obj
    splits = data_lib.load_dataset(args.dataset, args.data_dir, log=log)
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

    optimizer, schedule = make_optimizer(args, total_steps)
    strategy = make_strategy(optimizer)
    data_lib.check_batch(args.batch, strategy.batch_divisor)
    eval_batch = args.eval_batch or args.batch
    data_lib.check_batch(eval_batch, strategy.batch_divisor, flag="--eval-batch")
    host_state = init_state(jax.random.key(args.seed), cfg, policy, optimizer)
    log(f"{strategy.name}: {strategy.describe()}")
    log(f"model {cfg.name}: {count_params(host_state['params']):,} params, policy {policy} "
        f"(matmul precision {policy.matmul_precision}), global batch {args.batch}, "
        f"{total_steps} steps ({steps_per_epoch}/epoch, {epochs} epochs)",
        event="config", model=cfg.name, policy=str(policy), batch=args.batch,
        matmul_precision=policy.matmul_precision, steps=total_steps,
        devices=strategy.batch_divisor, strategy=strategy.name)
    state = strategy.put_state(host_state)
    example_ids = np.arange(args.batch, dtype=np.int32)

    step, last, metrics = 0, {}, None
    t_log, n_since = time.perf_counter(), 0
    for epoch in range(epochs):
        batches = data_lib.train_batches(train, args.batch, seed=args.seed, epoch=epoch)
        todo = min(steps_per_epoch, total_steps - step)
        bar = _progress(todo, f"epoch {epoch + 1}/{epochs}", is_main and not args.no_progress)
        for _ in range(todo):
            images, labels = next(batches)
            key = strategy.put_replicated(step_key(args.seed, epoch, step))
            previous = metrics
            state, metrics = strategy.train_step(
                state, *strategy.put_batch(images, labels, example_ids), key)
            # At most two steps in flight: XLA:CPU's collectives can deadlock when many
            # multi-device programs are queued at once, and on accelerators one step of
            # look-ahead is all the overlap there is to gain.
            if previous is not None:
                jax.block_until_ready(previous)
            step += 1
            n_since += args.batch
            if bar is not None:
                bar.update(1)
            if step % log_every == 0 or step == total_steps:
                m = strategy.metrics_to_host(metrics)  # the only host sync of the loop
                now = time.perf_counter()
                ips = n_since / (now - t_log)
                t_log, n_since = now, 0
                last = {"step": step, "epoch": epoch, "loss": m["loss"],
                        "accuracy": m["accuracy"], "lr": float(schedule(step - 1)),
                        "images_per_s": ips}
                if bar is not None:
                    bar.set_postfix(loss=f"{m['loss']:.4f}", img_s=f"{ips:.1f}")
                log(f"step {step:6d}  loss {m['loss']:.4f}  acc {m['accuracy']:.3f}  "
                    f"{ips:8.1f} img/s" if bar is None else "", **last)
                if not np.isfinite(m["loss"]) and not state_has_dynamic_scale(host_state):
                    raise FloatingPointError(f"non-finite loss {m['loss']} at step {step}")
        if bar is not None:
            bar.close()
        if args.eval_every and (epoch + 1) % args.eval_every == 0 and step < total_steps:
            res = evaluate(strategy, state, splits["val"], eval_batch)
            log(f"epoch {epoch + 1}: val loss {res['loss']:.4f}  accuracy {res['accuracy']:.4f}",
                split="val", step=step, epoch=epoch, **res)
    final = {"train": last}
    for split in ("val", "test"):
        res = evaluate(strategy, state, splits[split], eval_batch)
        log(f"final {split}: loss {res['loss']:.4f}  accuracy {res['accuracy']:.4f} "
            f"({res['count']} images)", split=split, step=step, **res)
        final[split] = res
    final["state"] = strategy.host_state(state)
    return final


def state_has_dynamic_scale(state) -> bool:
    return state["loss_scale"].dynamic


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)


