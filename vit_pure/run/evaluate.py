"""Evaluation: a split's loss and accuracy under a strategy (`evaluate`, `evaluate_split`,
what the loop calls after its epochs and at the end), and `--eval-only`: the newest
checkpoint, evaluated with the model and dtype policy it was trained with.
"""
from __future__ import annotations

import dataclasses
import pathlib
import weakref

import jax
import numpy as np

from vit_pure.config import ViTConfig
from vit_pure.data import cifar10 as data_lib
from vit_pure.errors import UsageError
from vit_pure.policy import LossScale, Policy
from vit_pure.run import checkpoint, distributed
from vit_pure.run.monitor import Heartbeat, Logger, compiling
from vit_pure.run.settings import RunConfig
from vit_pure.run.strategy import Strategy
from vit_pure.step import StepConfig, init_state, make_optimizer


def evaluate(strategy: Strategy, state, split: data_lib.Split, batch: int,
             log: Logger | None = None, what: str = "") -> dict:
    """Mean loss and accuracy over a (non-empty) split, each image counted once.

    With `log`: the evaluation step's first compile for this batch is said before and
    after (`compiling`), then the pass itself ("WHAT: evaluating N images ..."), and a
    long pass says how far it is at least once a minute (`Heartbeat`: evaluation has no
    progress bar)."""
    totals = {"loss": 0.0, "correct": 0.0, "count": 0.0}
    previous = None
    beat = Heartbeat(log, f"{what}: evaluating", len(split), "images")
    for i, (images, labels, mask) in enumerate(data_lib.eval_batches(split, batch)):
        # Each process feeds its own rows of the batch (all of them with one process).
        local = strategy.put_batch(*distributed.local_rows(images, labels, mask))
        if i == 0 and log is not None:
            _compile_eval_step(strategy, state, local, batch, log)
            log(f"{what}: evaluating {len(split):,} images ...")
        sums = strategy.eval_step(state, *local)
        if previous is not None:  # one batch in flight while the host fetches the last
            for k, v in strategy.metrics_to_host(previous).items():
                totals[k] += v
        previous = sums
        beat.update(min((i + 1) * batch, len(split)))
    for k, v in strategy.metrics_to_host(previous).items():
        totals[k] += v
    count = max(totals["count"], 1.0)
    return {"loss": totals["loss"] / count, "accuracy": totals["correct"] / count,
            "count": int(totals["count"])}


# The batch shapes each strategy's evaluation step has been compiled for (by
# `_compile_eval_step`), so that only a first compile is announced.
_EVAL_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compile_eval_step(strategy: Strategy, state, batch_arrays: tuple, batch: int,
                       log: Logger) -> None:
    """The evaluation step compiled before its first batch, said before and after (the
    call then finds it in jit's cache), once per strategy and batch shape."""
    step = strategy.eval_step
    shapes = tuple(a.shape for a in batch_arrays)
    try:
        done = _EVAL_COMPILED.setdefault(strategy, set())
    except TypeError:  # a strategy that cannot be a weak key: each pass says it compiles
        done = set()
    if shapes in done or not hasattr(step, "lower"):
        return
    with compiling(log, f"the evaluation step for {strategy.sc.cfg.name}, batch {batch}"):
        step.lower(state, *batch_arrays).compile()
    done.add(shapes)


def evaluate_split(strategy: Strategy, state, splits: dict, name: str, batch: int,
                   log: Logger, prefix: str, **record) -> dict | None:
    """Evaluate one split and log it; an empty split is skipped with one log line (None).

    With an EMA of the weights in the state (--ema), the split is evaluated with the EMA
    weights: that is the run's result, logged as "<split> (EMA weights)" (JSON: split,
    weights "ema"). The validation split is evaluated with the raw weights too, logged on
    a second line (JSON: split "val-raw", weights "raw") and returned under "raw", so a
    run shows whether the EMA helps; the test split only with the EMA weights, once.
    With --eval-flip / --eval-corners every line says so (JSON: eval_flip / eval_corners
    true).
    """
    if len(splits[name]) == 0:
        log(f"{prefix}{name}: skipped, the split is empty", event="eval_skipped", name=name,
            **record)
        return None
    # --eval-flip, --eval-corners: each image is scored on several views (step.eval_sums);
    # every line says which.
    sc = strategy.sc
    views = {**({"eval_flip": True} if sc.eval_flip else {}),
             **({"eval_corners": True} if sc.eval_corners else {})}
    how = {(True, False): ", each with its mirror",
           (False, True): ", each with four corner crops",
           (True, True): ", each with four corner crops and the five views' mirrors",
           }.get((sc.eval_flip, sc.eval_corners), "")

    def run(state, label: str, **fields) -> dict:
        res = evaluate(strategy, state, splits[name], batch, log, f"{prefix}{name}{label}")
        log(f"{prefix}{name}{label}: loss {res['loss']:.4f}  accuracy {res['accuracy']:.4f} "
            f"({res['count']} images{how})",
            **fields, **views, **record, **res)
        return res

    if "ema" not in state:
        return run(state, "", split=name)
    res = run(ema_weights(state), " (EMA weights)", split=name, weights="ema")
    if name == "val":
        res = {**res, "raw": run(state, " (raw weights)", split=f"{name}-raw", weights="raw")}
    return res


def ema_weights(state) -> dict:
    """The state with its EMA (--ema) in place of the params, for evaluation: the same
    pytree and layout (the EMA is laid out like the params), so the same eval step runs.
    The EMA is float32; params of another dtype (a p=bf16 policy) get it cast to theirs."""
    ema = jax.tree.map(lambda e, p: e if e.dtype == p.dtype else e.astype(p.dtype),
                       state["ema"], state["params"])
    return {**state, "params": ema}


def evaluate_checkpoint(rc: RunConfig, sc: StepConfig, make_strategy, log: Logger) -> dict:
    """--eval-only: the newest intact checkpoint in --ckpt-dir, evaluated on the test split.

    The model and dtype policy come from the checkpoint's own record, so
    `--eval-only --ckpt-dir DIR` is all it needs; the strategy (script, devices, mesh) is
    this run's, since checkpoints are stored unsharded.
    """
    if rc.checkpoints.ckpt_dir is None:
        raise UsageError("--eval-only needs --ckpt-dir")
    path = checkpoint.latest(pathlib.Path(rc.checkpoints.ckpt_dir), log=log)
    if path is None:
        raise UsageError(f"--eval-only: no intact checkpoint in {rc.checkpoints.ckpt_dir}")
    meta = checkpoint.read_meta(path)
    sc = saved_step_config(meta, sc)
    optimizer, _ = make_optimizer(rc.schedule.optim, 1)
    # A full state for the strategy's placement, its shapes only (no random draw): the
    # params are read back, the optimizer's state is zeros the evaluation never reads.
    template = jax.eval_shape(
        lambda: init_state(jax.random.key(0), sc.cfg, sc.policy, optimizer))
    host_state = {**jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), template),
                  "loss_scale": LossScale.create(dynamic=sc.policy.needs_loss_scaling)}
    # A run trained with --ema is evaluated with its EMA weights, as its final test was.
    name = "ema" if meta.get("config", {}).get("ema") else "params"
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(
        p.shape, np.float32 if name == "ema" else p.dtype), template["params"])
    host_state["params"] = jax.tree.map(lambda w, p: w.astype(p.dtype),
                                        checkpoint.restore(path, {name: shapes})[name],
                                        template["params"])
    strategy = make_strategy(sc, optimizer)
    eval_batch = rc.data.eval_batch
    strategy.check_batch(eval_batch, "--eval-batch")
    data = rc.data
    splits = data_lib.load_dataset(data.dataset, data.data_dir, log=log, **data.dataset_sizes)
    step = int(checkpoint.restore(path, {"step": 0})["step"])
    log(f"evaluating {path} ({sc.cfg.name}, policy {sc.policy}"
        f"{', EMA weights' if name == 'ema' else ''}) on the test split")
    res = evaluate_split(strategy, strategy.put_state(host_state), splits, "test", eval_batch,
                         log, "", step=step, checkpoint=str(path))
    return {} if res is None else {"test": res}


def saved_step_config(meta: dict, sc: StepConfig) -> StepConfig:
    """`sc` with the model and dtype policy a checkpoint was trained with (its meta), no
    accumulation (evaluation does not accumulate) and no EMA in the state (an --ema run's
    EMA is evaluated in place of the params, see `evaluate_checkpoint`). A model field the
    checkpoint predates takes ViTConfig's default; one this kit does not know is left out
    (as --resume does: run/resume.py `compare`)."""
    cfg = sc.cfg
    if "model_config" in meta:  # fields of another kit version: those this kit knows
        known = {f.name for f in dataclasses.fields(ViTConfig)}
        cfg = ViTConfig(**{k: tuple(v) if isinstance(v, list) else v  # JSON's lists: stem
                           for k, v in meta["model_config"].items() if k in known})
    saved = meta.get("config", {})  # the flags; older checkpoints record no "policy"
    text = meta.get("policy") or saved.get("policy") or saved.get("dtype", "fp32")
    policy = Policy.parse(text, meta.get("matmul_precision",
                                         saved.get("matmul_precision", "default")))
    return dataclasses.replace(sc, cfg=cfg, policy=policy, accum_steps=1, ema_decay=0.0)


# --------------------------------------------------------------------------- preemption
