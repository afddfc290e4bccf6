"""The training loop does not wait for the device between log points.

A log point's metrics are read once the next step is queued (loop.LogPoints), every input
is placed ahead of its step, and several processes agree on a stop signal every
StopRequest.AGREE_EVERY steps, not every step. These tests pin down what must not change
with it: the logged metrics are those of the same steps read at once, a NaN still stops
the run naming its step before a checkpoint could save it, and between log points no
value comes back from the device.

The runs: the tiny model, batch 8, one device, 24 steps, all with one strategy (so one
compiled step: the runs differ only in what the loop does around it). A run of 100 steps
or fewer logs every step (loop.plan_steps); the tests set that rule aside so that a short
run has log points --log-every apart.
"""
import dataclasses
import json

import jax
import numpy as np
import pytest
from jax._src import array as jax_array

import train_shardmap
from vit_pure import step as step_lib
from vit_pure.data import cifar10 as data_lib
from vit_pure.run import checkpoint, cli, loop, settings, signals
from vit_pure.run.settings import RunConfig

STEPS, LOG_EVERY = 24, 4
BASE = ["--model", "tiny", "--dataset", "synthetic", "--synthetic-train", "400",
        "--synthetic-val", "8", "--synthetic-test", "8", "--batch", "8", "--steps",
        str(STEPS), "--log-every", str(LOG_EVERY), "--eval-every", "0", "--no-final-eval",
        "--no-progress", "--accum-steps", "1", "--randaugment", "0"]
_STRATEGIES = {}


def _strategy(sc, optimizer):
    """The strategy of these runs' step settings, built (and its step compiled) once."""
    if repr(sc) not in _STRATEGIES:
        _STRATEGIES[repr(sc)] = train_shardmap.ShardMapStrategy(sc, optimizer, None,
                                                                devices=jax.devices()[:1])
    return _STRATEGIES[repr(sc)]


class _Wrapped:
    """A strategy whose train_step calls `before(n)` (n: the steps dispatched so far,
    this one included) and passes the metrics through `metrics(n, m)`."""

    def __init__(self, strategy, before=lambda n: None, metrics=lambda n, m: m):
        self._strategy, self._before, self._metrics, self._n = strategy, before, metrics, 0

    def __getattr__(self, name):
        return getattr(self._strategy, name)

    def train_step(self, *args):
        self._n += 1
        self._before(self._n)
        state, metrics = self._strategy.train_step(*args)
        return state, self._metrics(self._n, metrics)


@pytest.fixture
def log_every_as_given(monkeypatch):
    """loop.plan_steps without its rule that runs of <= 100 steps log every step."""
    plan_steps = loop.plan_steps
    monkeypatch.setattr(loop, "plan_steps", lambda schedule, logging, n: dataclasses.replace(
        plan_steps(schedule, logging, n), log_every=logging.log_every))


def _run(argv, make_strategy=_strategy):
    """loop.run as the script runs it, on one device; returns main_guard's exit code."""
    args = cli.parse_args(train_shardmap.build_parser(), argv)
    return cli.main_guard(lambda: loop.run(RunConfig.from_args(args),
                                           settings.step_config(args), make_strategy))


def _counting(monkeypatch):
    """(events, make_strategy): each device-to-host read of any jax.Array (the property
    every fetch goes through: float(), np.asarray, jax.device_get) is recorded as the
    number of train steps dispatched so far."""
    events, dispatched = [], [0]
    value = jax_array.ArrayImpl._value

    def read(self):
        events.append(dispatched[0])
        return value.fget(self)
    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(read))

    def make_strategy(sc, optimizer):
        return _Wrapped(_strategy(sc, optimizer), before=lambda n: dispatched.__setitem__(0, n))
    return events, make_strategy


def _nan_at(step: int):
    """make_strategy whose step number `step` returns a NaN loss (the same compiled step;
    the real blow-up of a huge learning rate is tests/test_resume.py's)."""
    return lambda sc, optimizer: _Wrapped(
        _strategy(sc, optimizer),
        metrics=lambda n, m: {**m, "loss": m["loss"] * np.nan} if n == step else m)


def _reference_losses(argv) -> dict[int, dict]:
    """The same steps, each step's metrics read as soon as it is dispatched."""
    args = cli.parse_args(train_shardmap.build_parser(), argv)
    sc, rc = settings.step_config(args), RunConfig.from_args(args)
    data = rc.data
    train = data_lib.load_dataset(data.dataset, data.data_dir, **data.dataset_sizes)["train"]
    plan = loop.plan_steps(rc.schedule, rc.logging, len(train))
    optimizer, schedule = step_lib.make_optimizer(rc.schedule.optim, plan.total_steps)
    strategy = _strategy(sc, optimizer)
    state = strategy.put_state(step_lib.init_state(jax.random.key(args.seed), sc.cfg,
                                                   sc.policy, optimizer))
    ids = np.arange(args.batch, dtype=np.int32)
    out, s = {}, 0
    while s < plan.total_steps:
        epoch = s // plan.steps_per_epoch
        for images, labels in data_lib.train_batches(train, args.batch, seed=args.seed,
                                                     epoch=epoch):
            if s == plan.total_steps:
                break
            key = strategy.put_replicated(step_lib.step_key(args.seed, epoch, s))
            state, metrics = strategy.train_step(
                state, *strategy.put_batch(images, labels, ids), key)
            s += 1
            out[s] = {**strategy.metrics_to_host(metrics), "lr": float(schedule(s - 1))}
    return out


def test_logged_metrics_are_the_steps_and_nothing_is_read_between_log_points(
        tmp_path, monkeypatch, log_every_as_given):
    events, make_strategy = _counting(monkeypatch)
    argv = BASE + ["--log-json", str(tmp_path / "log.jsonl")]
    assert _run(argv, make_strategy) == 0
    monkeypatch.undo()

    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in records if "images_per_s" in r}
    assert sorted(logged) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    want = _reference_losses(argv)  # the same compiled step
    for s, r in logged.items():  # the same values, at the same step numbers
        for k in ("loss", "accuracy", "lr"):
            np.testing.assert_allclose(r[k], want[s][k], rtol=1e-6, err_msg=f"step {s} {k}")

    # Reads happen only in the iteration after a log point (its metrics, its losses, its
    # learning rate) and after the last step: none in the steps between.
    allowed = {s + 1 for s in logged if s < STEPS} | {STEPS}
    by_step = {d: events.count(d) for d in set(events) if 0 < d <= STEPS}
    assert set(by_step) <= allowed, sorted(set(by_step) - allowed)
    between = [d for d in range(1, STEPS + 1) if d not in allowed]
    assert len(between) == STEPS - len(allowed) and all(by_step.get(d, 0) == 0
                                                         for d in between)
    # Every log point read its LOG_EVERY losses and gradient norms (one fetch each).
    assert all(by_step[d] >= 2 * LOG_EVERY for d in allowed)


def test_nan_between_log_points_stops_naming_its_step_before_any_checkpoint(
        tmp_path, capsys, log_every_as_given):
    """Step 2's loss is NaN; the log points are 10 steps apart. With a checkpoint due at
    step 3, that save checks the losses first and stops; without checkpoints, the first
    log point (step 10, read once step 11 is dispatched) finds it. Both name step 2."""
    nan = BASE + ["--log-every", "10"]
    assert _run(nan + ["--ckpt-dir", str(tmp_path), "--ckpt-every", "3"], _nan_at(2)) == 2
    assert capsys.readouterr().err.strip() == (
        "error: non-finite loss (nan) at step 2; stopped without saving it. "
        "Last checkpoint: none")
    assert checkpoint.list_checkpoints(tmp_path) == []

    assert _run(nan, _nan_at(2)) == 2
    out, err = capsys.readouterr()
    assert err.strip().startswith("error: non-finite loss (nan) at step 2; ")
    assert "step     10" not in out  # a log point with a NaN behind it is not logged


def test_processes_agree_on_a_stop_every_few_steps(monkeypatch):
    """With several processes the agreement (a collective) runs after every
    AGREE_EVERY-th step only, the same steps everywhere, once per step."""
    calls = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(loop.distributed, "agree_max", lambda v: calls.append(v) or v)
    stop = signals.StopRequest()
    every = signals.StopRequest.AGREE_EVERY
    assert [stop.agreed(s) for s in range(every + 1)] == [None] * (every + 1)
    stop.signum = 15  # a SIGTERM arrives after step every + 1
    got = [stop.agreed(s) for s in range(every + 1, 2 * every + 1)]
    assert got == [None] * (every - 1) + [15]
    assert stop.agreed(2 * every) == 15  # asked again: the same answer, no collective
    assert calls == [0, 0, 15]
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert signals.StopRequest().agreed(3) is None  # one process: every step, no collective


@pytest.mark.parametrize("depth", [1, 2])
def test_inputs_placed_ahead_are_the_steps_batches(depth):
    """_device_inputs yields, for every step from a mid-epoch start, the batch and key
    the step would get (data.train_batches, step.step_key), however deep it places."""
    args = cli.parse_args(train_shardmap.build_parser(), BASE)
    rc = RunConfig.from_args(args)
    train = data_lib.synthetic_cifar10(n_train=40, n_val=0, n_test=0)["train"]
    plan = loop.StepPlan(batch=rc.schedule.batch, steps_per_epoch=5, total_steps=12, epochs=3,
                         log_every=1)
    strategy = _strategy(settings.step_config(args),
                         step_lib.make_optimizer(rc.schedule.optim, 12)[0])
    got = list(loop._device_inputs(rc.data, strategy, train, plan, start=3, depth=depth))
    assert len(got) == 9
    for s, (images, labels, _, key) in enumerate(got, start=3):
        epoch, index = divmod(s, 5)
        want = list(data_lib.train_batches(train, 8, seed=0, epoch=epoch))[index]
        assert np.array_equal(np.asarray(images), want[0])
        assert np.array_equal(np.asarray(labels), want[1])
        assert np.array_equal(jax.random.key_data(key),
                              jax.random.key_data(step_lib.step_key(0, epoch, s)))
