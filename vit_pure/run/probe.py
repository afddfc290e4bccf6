"""A linear probe on cached features (--trainable head): the backbone runs once, not per step.

A frozen backbone's output for an image never changes, so a probe need not run it in every
step. `extract` runs it once over a split, through the strategy's `features_step` (the
evaluation forward pass stopped before the head), for each image and its mirror, and keeps
the head's inputs on the host: (N, 2, F) float32. `fit_head` trains the head alone on
them with the run's optimizer, schedule, clipping and label smoothing. `run` is what the
loop calls: features, the head fitted, and the state with it put back in place at the
run's last step, which the loop's final evaluation then scores with the backbone. Nothing
here emits a collective: the features step is the script's, and every process fits the
same head on the same rows.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from vit_pure.data import cifar10 as data_lib
from vit_pure.model import classify
from vit_pure.run import distributed
from vit_pure.run.monitor import Heartbeat, Logger, compiling, progress_bar
from vit_pure.run.strategy import Strategy
from vit_pure.step import (
    OptimConfig,
    StepConfig,
    apply_gradients,
    cross_entropy,
    make_optimizer,
    sum_of_squares,
)

F32 = jnp.float32


def extract(strategy: Strategy, state, split: data_lib.Split, batch: int,
            progress: bool, log: Logger | None = None) -> np.ndarray:
    """The head's inputs of every image of `split` and of its mirror: (N, 2, F) float32,
    on every process, in the split's order. A bar shows the progress; without one (and
    with `log`), a line at least once a minute."""
    rows = []
    bar = progress_bar(-(-len(split) // batch), "features", progress)
    beat = Heartbeat(None if progress else log, "features", len(split), "images")
    for images, _, mask in data_lib.eval_batches(split, batch):
        local = distributed.local_rows(images)
        out = strategy.batch_to_host(strategy.features_step(state, *strategy.put_batch(*local)))
        rows.append(out[mask.astype(bool)])  # the padding of the last batch left out
        bar.update(1)
        beat.update(sum(len(r) for r in rows))
    bar.close()
    return np.concatenate(rows)


def head_step(sc: StepConfig, optimizer):
    """One optimizer step of the head alone on a batch of features: (state, features (b,
    F), labels (b,)) -> (state, {"loss", "accuracy"}); `state` is {"params": the head,
    "opt_state", "loss_scale", "step"} (and "ema", the head's, with --ema)."""
    def loss_fn(head, x, labels):
        logits = classify(head, x, sc.policy)
        loss = cross_entropy(logits, labels, sc.cfg.num_classes, sc.label_smoothing).mean()
        return loss, jnp.mean((jnp.argmax(logits, -1) == labels).astype(F32))

    def one(state, x, labels):
        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], x, labels)
        norm = jnp.sqrt(sum_of_squares(grads))
        state, _ = apply_gradients(sc, state, grads, norm, optimizer)
        return state, {"loss": loss, "accuracy": accuracy}
    return jax.jit(one, donate_argnums=0)


def accuracy(head, feats: np.ndarray, labels: np.ndarray, sc: StepConfig) -> float:
    """Accuracy of `head` on cached features, each image scored as evaluation scores it
    (with --eval-flip, the mean of its two views' logits)."""
    logits = classify(head, jnp.asarray(feats[:, 0]), sc.policy).astype(F32)
    if sc.eval_flip:
        logits = (logits + classify(head, jnp.asarray(feats[:, 1]), sc.policy)) / 2
    return float(np.mean(np.asarray(jnp.argmax(logits, -1)) == labels))


# Each example of a head step is one of its image's two views (the image and its left-right
# mirror), drawn at random: the training augmentation's flip; its crop, RandAugment, mixing
# and the backbone's dropout do not apply to cached features. A step costs a (batch, F) x
# (F, K) product instead of a forward pass of the backbone.
def fit_head(sc: StepConfig, optim: OptimConfig, host_state: dict, feats: np.ndarray,
             labels: np.ndarray, *, batch: int, steps_per_epoch: int, total_steps: int,
             start: int, seed: int, log: Logger, progress: bool, eval_every: int = 0,
             val: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """Steps `start` to `total_steps` of the head on cached features (see the module
    docstring); returns the head's state after them (`head_step`'s)."""
    # The run's optimizer on the head's leaves alone ("all" of this small tree; the head's
    # layer-decay factor is 1).
    optimizer, _ = make_optimizer(dataclasses.replace(optim, trainable="all", layer_decay=1.0),
                                  total_steps)
    head = jax.tree.map(jnp.asarray, host_state["params"]["head"])
    state = {"params": head, "opt_state": optimizer.init(head),
             "loss_scale": host_state["loss_scale"], "step": jnp.asarray(start, jnp.int32)}
    if "ema" in host_state:
        state["ema"] = jax.tree.map(jnp.asarray, host_state["ema"]["head"])
    one = head_step(sc, optimizer)
    step, epochs = start, -(-total_steps // steps_per_epoch)
    while step < total_steps:
        epoch = step // steps_per_epoch
        order = data_lib.epoch_permutation(len(labels), seed=seed, epoch=epoch)
        views = np.random.default_rng([seed, epoch, 1]).integers(0, 2, len(labels))
        todo = min(steps_per_epoch, total_steps - epoch * steps_per_epoch) - step % steps_per_epoch
        bar = progress_bar(todo, f"head, epoch {epoch + 1}/{epochs}", progress)
        for _ in range(todo):
            i = step % steps_per_epoch
            rows = order[i * batch:(i + 1) * batch]
            state, metrics = one(state, feats[rows, views[rows]], labels[rows])
            step += 1
            bar.update(1)
        bar.close()
        if (eval_every and (epoch + 1) % eval_every == 0) or step == total_steps:
            m = {k: float(v) for k, v in metrics.items()}
            heads = state.get("ema", state["params"])
            text = (f"head, epoch {epoch + 1}/{epochs} (step {step}): loss {m['loss']:.4f}  "
                    f"train accuracy {m['accuracy']:.4f}")
            if val is not None and len(val[1]):
                m["val_accuracy"] = accuracy(heads, *val, sc)
                text += f"  val accuracy {m['val_accuracy']:.4f} (cached features)"
            log(text, event="probe", step=step, epoch=epoch, **m)
            if not np.isfinite(m["loss"]):
                raise FloatingPointError(f"the head's loss is {m['loss']} at step {step}")
    return state, {"step": step, "epoch": epoch, **m}


def run(strategy: Strategy, host_state: dict, state, splits: dict, *, sc: StepConfig,
        optim: OptimConfig, batch: int, eval_batch: int, steps_per_epoch: int,
        total_steps: int, start: int, seed: int, eval_every: int, log: Logger,
        progress: bool) -> tuple:
    """The probe of a run (see the module docstring): returns the state (on the devices)
    with the fitted head, at step `total_steps`, and the last step's metrics."""
    train, val = splits["train"], splits["val"]
    log(f"--trainable head: the backbone is frozen; its features of the {len(train)} "
        "training images and their mirrors are computed once, then the head trains on them "
        "(vit_pure/run/probe.py)", event="probe_setup", images=len(train))
    started = time.perf_counter()
    images = next(iter(data_lib.eval_batches(train, eval_batch)))[0]  # one padded batch
    with compiling(log, f"the features step for {sc.cfg.name}, batch {eval_batch}"):
        strategy.features_step.lower(
            state, *strategy.put_batch(*distributed.local_rows(images))).compile()
    feats = extract(strategy, state, train, eval_batch, progress, log)
    cached_val = None
    if eval_every and len(val):
        cached_val = (extract(strategy, state, val, eval_batch, progress, log), val.labels)
    log(f"features of {len(feats)} training images"
        f"{f' and {len(val)} validation images' if cached_val else ''} (each with its "
        f"mirror): {feats.shape[-1]} each, in {time.perf_counter() - started:.0f} s",
        event="probe_features", seconds=time.perf_counter() - started)
    started = time.perf_counter()
    fitted, last = fit_head(sc, optim, host_state, feats, train.labels, batch=batch,
                      steps_per_epoch=steps_per_epoch, total_steps=total_steps, start=start,
                      seed=seed, log=log, progress=progress, eval_every=eval_every,
                      val=cached_val)
    log(f"head trained for {total_steps - start} steps in {time.perf_counter() - started:.1f} s",
        event="probe_fitted", steps=total_steps - start)
    host_state = strategy.host_state(state)
    host_state["params"]["head"] = jax.tree.map(
        lambda new, old: np.asarray(new, old.dtype), fitted["params"],
        host_state["params"]["head"])
    if "ema" in host_state:
        host_state["ema"]["head"] = jax.tree.map(np.asarray, fitted["ema"])
    host_state["step"] = np.asarray(total_steps, np.asarray(host_state["step"]).dtype)
    return strategy.put_state(host_state), last
