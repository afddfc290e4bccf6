"""benchmarks/harness.py, the pieces every benchmark shares: which steps the timing loops
time (on a fake clock, so nothing here depends on the machine's speed), the child
process's result and failure lines, the Markdown table."""
import json
import time

import pytest

from benchmarks import harness


@pytest.fixture
def clock(monkeypatch):
    """A fake wall clock and CPU clock that move only when told: now[0] wall, now[1] CPU."""
    now = [100.0, 10.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(harness.time, "process_time", lambda: now[1])
    return now


def test_time_steps_keeps_one_step_in_flight_and_times_the_right_steps(clock):
    """Step i takes durations[i] (wall) and a tenth of it (CPU) from dispatch to completion;
    the loop waits for step i only after dispatching step i + 1, runs one step more than
    warmup + steps, and returns the intervals of the steps after the warm-up."""
    durations = [7.0, 5.0, 1.0, 2.0, 3.0, 11.0]
    events = []

    def dispatch(i):
        events.append(("dispatch", i))
        return i

    def wait(i):
        events.append(("wait", i))
        clock[0] += durations[i]
        clock[1] += durations[i] / 10

    times = harness.time_steps(dispatch, wait, warmup=2, steps=3)
    assert times.wall == [1.0, 2.0, 3.0]
    assert times.cpu == pytest.approx([0.1, 0.2, 0.3])
    assert events[:3] == [("dispatch", 0), ("dispatch", 1), ("wait", 0)]
    assert [i for kind, i in events if kind == "dispatch"] == [0, 1, 2, 3, 4, 5]
    assert [i for kind, i in events if kind == "wait"] == [0, 1, 2, 3, 4, 5]


def test_time_calls_waits_for_each_call_and_skips_the_warmup(clock):
    durations = iter([50.0, 1.0, 4.0, 2.0])  # the first one compiles

    def call():
        return next(durations)

    def wait(d):
        clock[0] += d

    times = harness.time_calls(call, wait, runs=3)
    assert times.wall == [1.0, 4.0, 2.0]
    assert harness.median_seconds(iter([9.0, 3.0, 1.0, 2.0]).__next__, wait, runs=3) == 2.0


def test_host_batches_are_cifar_shaped_and_reproducible():
    (x, y), (x2, _) = harness.host_batches(5, n=2, seed=3)
    assert (x.shape, x.dtype.name, y.shape, y.dtype.name) == ((5, 32, 32, 3), "uint8", (5,),
                                                              "int32")
    assert 0 <= y.min() and y.max() < 10
    assert (harness.host_batches(5, n=1, seed=3)[0][0] == x).all()
    assert not (x2 == x).all()


def test_child_main_prints_the_result_or_one_error_line(capsys):
    assert harness.child_main(lambda job: {"twice": 2 * job["x"]}, {"x": 21}) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(harness.RESULT_TAG)
    assert json.loads(out[-1][len(harness.RESULT_TAG):]) == {"twice": 42}

    def fails(job):
        raise ValueError("no\nsuch   value")

    assert harness.child_main(fails, {}) == 1
    captured = capsys.readouterr()
    assert harness.RESULT_TAG not in captured.out
    assert captured.err.splitlines()[-1] == "error: ValueError: no such value"


def test_run_child_reports_a_child_that_fails_to_start():
    row = harness.run_child("benchmarks.no_such_module", {}, timeout=60)
    assert "No module named benchmarks.no_such_module" in row["error"]
    assert row["wall_s"] > 0


def test_markdown_table_pads_short_rows_and_escapes_bars():
    table = harness.markdown_table(["name", "img/s", "note"],
                                   [["a", 12, "x|y"], ["b", "failed: it|broke"]], numeric=[1])
    assert table.splitlines() == ["| name | img/s | note |", "|---|---:|---|",
                                  "| a | 12 | x/y |", "| b | failed: it/broke |  |"]
    assert harness.cell(None, ".1f") == "n/a"
    assert harness.cell(0.25, ".0%") == "25%"
    assert harness.cell(3 * 2 ** 30, ".2f", 2.0 ** -30) == "3.00"


def test_command_line_can_be_typed_again():
    assert harness.command_line("benchmarks.peers", ["--kit", "no drop=--dropout 0"]) == (
        "python -m benchmarks.peers --kit 'no drop=--dropout 0'")


def test_one_call_timers():
    """harness.timed: the result and the call's own seconds; first_and_median: the first
    call apart (a compile: here a longer sleep), then the median of the runs after it,
    each waited for."""
    result, wall, cpu = harness.timed(lambda: time.sleep(0.02) or 7)
    assert result == 7 and 0.02 <= wall < 1 and 0 <= cpu < wall
    sleeps, waited = iter([0.06, 0.01, 0.01, 0.01]), []
    first, median = harness.first_and_median(lambda: time.sleep(next(sleeps)), waited.append,
                                             runs=3)
    assert len(waited) == 4 and 0.06 <= first < 1 and 0.01 <= median < 0.06
