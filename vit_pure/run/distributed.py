"""Several processes, one program: JAX's multi-process ("multi-controller") runtime.

Every process (one per host, usually) runs the same script with the same flags, plus where
it is in the job (`--coordinator HOST:PORT --num-processes N --process-id I`;
docs/multihost.md). `initialize` connects them; after it a jitted program over a mesh of
every process's devices runs on all of them at once, the scripts' collectives crossing
hosts. The step does not change; the host side does, here or in vit_pure/run/loop.py:
data (each process takes its own rows of one global batch order: `local_rows`,
`global_batch`); state (each places the blocks its devices hold; `to_host` gathers them
back); control flow (a decision that changes the steps is agreed first: `agree_max`;
process 0 alone logs and writes checkpoints; `barrier`); failures (`Watch` makes every
process exit in one line, with EXIT_PEER_FAILED, within seconds of another's error or
death, instead of waiting in a collective until JAX's timeouts abort it; the error or
abort a peer's death causes here waits for its verdict: `wait_for_peer_failure`).
"""
from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time

import jax
import numpy as np
from jax._src import distributed as _jax_distributed  # the key-value store: no public API yet
from jax.experimental import multihost_utils

from vit_pure.data import cifar10 as data_lib
from vit_pure.errors import DataError

# The exit code of a process that stops because another one failed (its own errors keep
# theirs: 2 for bad input, 130 / 143 for signals, ...). Not a signal's 128 + n.
EXIT_PEER_FAILED = 3
_KEYS = "vit_pure/"  # this kit's keys in the job's coordination key-value store


def initialize(coordinator: str | None, num_processes: int | None,
               process_id: int | None, *, init_timeout: float = 60.0,
               heartbeat_timeout: float = 20.0, shutdown_timeout: float = 60.0) -> None:
    """Join the job: `jax.distributed.initialize`, before anything touches a device.

    Arguments left None are filled in by JAX's cluster detection (SLURM, Open MPI,
    Cloud TPU; the coordinator also from $JAX_COORDINATOR_ADDRESS); it raises
    ValueError when it cannot. Detection also limits each process to the GPU of its local
    rank: one process per GPU (docs/multihost.md, with the variables it reads). On CPU
    the collectives between processes use gloo, JAX's default there
    (`jax_cpu_collectives_implementation`), so nothing else is needed.

    Timeouts (seconds; the --*-timeout flags): the other processes must join within
    `init_timeout`, and a process whose heartbeat stops for `heartbeat_timeout` counts as
    gone (`Watch`). JAX's own limits are set above the kit's, since JAX ends a process
    that reaches them with abort() (exit 134 and a C++ trace): the kit's one-line exit
    comes first. `shutdown_timeout` bounds JAX's end-of-job barrier.
    """
    where = f"process {process_id if process_id is not None else '?'}"

    def did_not_join():
        _die(f"{where}: the job's {num_processes or 'other'} processes did not all join "
             f"within {init_timeout:g} s (--init-timeout); is every process started, with "
             f"the same --coordinator?")
    timer = threading.Timer(init_timeout, did_not_join)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes,
            process_id=process_id, initialization_timeout=int(init_timeout) + 30,
            heartbeat_timeout_seconds=int(2 * heartbeat_timeout) + 30,
            shutdown_timeout_seconds=max(1, int(shutdown_timeout)))
    finally:
        timer.cancel()
    Watch.start(heartbeat_timeout)
    _wait_before_aborting()


def local_rows(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """This process's rows of each global-batch array (all of them with one process)."""
    return tuple(data_lib.process_slice(a, jax.process_index(), jax.process_count())
                 for a in arrays)


@functools.lru_cache(maxsize=64)
def _check_rows(sharding: jax.sharding.Sharding, n_rows: int) -> None:
    """DataError unless this process's devices hold exactly rows [i*n/P, (i+1)*n/P)."""
    i, p = jax.process_index(), jax.process_count()
    blocks = {idx[0].indices(n_rows)[:2]
              for idx in sharding.addressable_devices_indices_map((n_rows,)).values()}
    lo, hi = min(b[0] for b in blocks), max(b[1] for b in blocks)
    want = (i * n_rows // p, (i + 1) * n_rows // p)
    if (lo, hi) != want or sum(stop - start for start, stop in blocks) != hi - lo:
        raise DataError(
            f"process {i}'s devices hold rows {sorted(blocks)} of a batch of {n_rows}, not "
            f"its own share [{want[0]}, {want[1]}): the batch axis of the mesh must be split "
            f"across the {p} processes (e.g. --mesh data=D with D a multiple of {p})")


def global_batch(local: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """One global array, split over the batch axis by `sharding`, from each process's rows.

    Every process passes its own `local_rows` share; the result has P times as many rows,
    and each process's devices hold its own rows (checked once per sharding and size).
    With one process this is `jax.device_put(local, sharding)`.
    """
    n_rows = local.shape[0] * jax.process_count()
    _check_rows(sharding, n_rows)
    return jax.make_array_from_process_local_data(sharding, local, (n_rows, *local.shape[1:]))


def put_global(tree, shardings):
    """Place host values that every process holds identically (the state, a key).

    `shardings`: one sharding, or a tree of them matching a prefix of `tree` (like
    `jax.device_put`). Each process builds only the blocks of its own devices (`idx` is
    a device's block index); `jax.device_put` would first check, across processes, that
    every process passed the same value.
    """
    def put(x, sharding):
        is_key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        host = x if is_key else np.asarray(x)  # (a key's blocks are sliced as a jax array)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.tree.map(lambda sharding, sub: jax.tree.map(lambda x: put(x, sharding), sub),
                        shardings, tree)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of `x` as a numpy array, on every process."""
    if x.is_fully_addressable:  # one process: every block is here
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:  # each device holds all of it: read one of ours
        return np.asarray(x.addressable_data(0))
    # All-gather across processes: the blocks held by other processes' devices. Every
    # process must call this, for the same arrays in the same order.
    return multihost_utils.process_allgather(x, tiled=True)


def agree_max(value: int) -> int:
    """The largest of the processes' `value`s, on every process (a small all-gather).

    Every process must call this at the same point of the run; with one process it is
    `value` itself and moves nothing.
    """
    if jax.process_count() == 1:
        return value
    # All-gather of one int32 per process (through the devices), then the max on the host.
    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier of this name (no-op with one)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------ failures across processes
def _die(line: str) -> None:
    """Print `line` as this process's one error line and leave at once (no Python clean-up,
    which would wait in JAX's shutdown barrier for processes that are gone)."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_FAILED)


class Watch:
    """A daemon thread per process that ends it when another process fails.

    Through the job's coordination key-value store (JAX's distributed client; process 0
    serves it), every second each process bumps its heartbeat key and reads the others'
    and the job's error key:
    * an error another process reported (`report_failure`, called by `cli.main_guard` on
      any error) -> this process prints it in one line and exits EXIT_PEER_FAILED;
    * a process whose heartbeat has not moved for `heartbeat_timeout` s and that did not
      finish (`finish`) -> the same, naming it as gone (killed, crashed, hung).
    If process 0 dies, the store goes with it: JAX itself then ends the other processes
    with abort() (exit 134), which the kit cannot turn into a line (docs/multihost.md).

    A peer's death also breaks the collective this process is in, before its heartbeat
    is missed: `wait_for_peer_failure` holds the error (cli.main_guard) or the C++ abort
    (`_wait_before_aborting`) that follows until this thread has named the peer.
    """
    _thread: threading.Thread | None = None
    _stopped = threading.Event()
    heartbeat_timeout = 20.0
    in_touch_at = 0.0  # time.monotonic() of its last round through the store

    @classmethod
    def start(cls, heartbeat_timeout: float) -> None:
        if jax.process_count() == 1 or cls._thread is not None:
            return
        cls.heartbeat_timeout, cls.in_touch_at = heartbeat_timeout, time.monotonic()
        cls._thread = threading.Thread(target=cls._run, args=(heartbeat_timeout,),
                                       name="vit_pure-watch", daemon=True)
        cls._thread.start()

    @classmethod
    def _run(cls, heartbeat_timeout: float) -> None:
        client, me, n = _client(), jax.process_index(), jax.process_count()
        beat, seen = 0, {p: (None, time.monotonic()) for p in range(n) if p != me}
        while not cls._stopped.wait(1.0):
            beat += 1
            try:
                client.key_value_set(f"{_KEYS}beat/{me}", str(beat), allow_overwrite=True)
                error = _try_get(client, f"{_KEYS}error")
                if error is not None and not cls._stopped.is_set():
                    # Say it was seen: a failing process 0 serves the store and waits
                    # for this before it leaves (`report_failure`).
                    client.key_value_set(f"{_KEYS}seen/{me}", "1", allow_overwrite=True)
                    _die(f"{error}; this process stops too")
                now = time.monotonic()
                for p, (last, since) in seen.items():
                    value = _try_get(client, f"{_KEYS}beat/{p}")
                    if value != last:
                        seen[p] = (value, now)
                    elif (now - since > heartbeat_timeout and not cls._stopped.is_set()
                          and _try_get(client, f"{_KEYS}done/{p}") is None):
                        _die(f"process {p} of {n} stopped responding (no heartbeat for "
                             f"{heartbeat_timeout:g} s: killed, crashed or hung); this "
                             f"process stops too")
                cls.in_touch_at = now
            except Exception as e:  # noqa: BLE001 - the store is gone with process 0
                if not cls._stopped.is_set():
                    _die(f"lost the job's coordinator (process 0 of {n}: "
                         f"{type(e).__name__}); this process stops too")

    @classmethod
    def finish(cls) -> None:
        """This process ended its run (success or a clean stop): the others may stop
        hearing from it; stop watching them."""
        if cls._thread is None:
            return
        cls._stopped.set()
        try:
            _client().key_value_set(f"{_KEYS}done/{jax.process_index()}", "1",
                                    allow_overwrite=True)
        except Exception:  # noqa: BLE001 - nothing left to tell
            pass


# How long past `heartbeat_timeout` a failure elsewhere may take to be named: the peer's
# last beat is up to a second older than its death, and this process reads it once a second.
# And how long the Watch may go without a round through the store (once a second) before
# the store counts as gone: process 0 died, and JAX's own abort is the end (multihost.md).
PEER_VERDICT_MARGIN_S = 5.0
STORE_SILENT_S = 5.0


def wait_for_peer_failure() -> None:
    """Give `Watch` the time to name a failure of another process before this process
    reports one of its own: `heartbeat_timeout` + PEER_VERDICT_MARGIN_S seconds, or none
    where no Watch runs (one process, or this one's run ended or failed already). A
    process that dies mid-collective (kill -9) breaks the collective in every other
    process at once, seconds before its heartbeat is missed: gloo's "Connection reset by
    peer" comes back as a JaxRuntimeError, or a C++ abort (below). If the Watch names the
    failure meanwhile, it ends this process with EXIT_PEER_FAILED and its line; otherwise
    this returns, and the caller goes on as it would have: sooner once the Watch has not
    reached the store for STORE_SILENT_S (it went with process 0: nothing to name)."""
    if Watch._thread is None or Watch._stopped.is_set():
        return
    deadline = time.monotonic() + Watch.heartbeat_timeout + PEER_VERDICT_MARGIN_S
    while time.monotonic() < deadline and not Watch._stopped.is_set():
        if time.monotonic() - Watch.in_touch_at > STORE_SILENT_S:
            return
        time.sleep(0.1)


# A C++ abort() in a multi-process job: gloo's checks fail in its I/O thread when a peer's
# death leaves a collective half done (XLA:CPU goes on with the collective's next operand,
# whose first message then meets a reply meant for another one: "op.preamble.length <=
# op.nbytes"), and abort() would end this process with SIGABRT (exit 134, a C++ trace)
# before its Watch can say why. This handler, run in the aborting thread, waits for the
# Watch's verdict first (`wait_for_peer_failure`), then aborts as before. A C function of
# its own, through ctypes: Python's `signal.signal` handlers run later, in the main thread,
# and abort() does not wait for them.
_LIBC = ctypes.CDLL(None)
_LIBC.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
_LIBC.signal.restype = ctypes.c_void_p


@ctypes.CFUNCTYPE(None, ctypes.c_int)
def _on_abort(signum: int) -> None:
    wait_for_peer_failure()
    _LIBC.signal(signal.SIGABRT, None)  # SIG_DFL, then abort: what a SIGABRT would have done
    os.abort()


def _wait_before_aborting() -> None:
    """Install `_on_abort` for SIGABRT (a multi-process job only: with one process there
    is no peer to wait for)."""
    if Watch._thread is not None:
        _LIBC.signal(signal.SIGABRT, ctypes.cast(_on_abort, ctypes.c_void_p))


def report_failure(cause: str) -> bool:
    """Tell the other processes that this one stops because of `cause` (one line); they
    exit with it (`Watch`). The first report of a job wins. False (nothing to tell) with
    one process."""
    if Watch._thread is None:
        return False
    Watch._stopped.set()  # this process's own error line is the one it prints
    me, n = jax.process_index(), jax.process_count()
    line = f"process {me} of {n} stopped ({cause})"
    try:
        client = _client()
        client.key_value_set(f"{_KEYS}error", line)
        if me == 0:
            # The store lives in this process and dies with it, and JAX aborts the others
            # the moment it does: stay until each has seen the error (or is gone).
            deadline = time.monotonic() + Watch.heartbeat_timeout + 2.0
            waiting = set(range(1, n))
            while waiting and time.monotonic() < deadline:
                waiting = {p for p in waiting
                           if _try_get(client, f"{_KEYS}seen/{p}") is None
                           and _try_get(client, f"{_KEYS}done/{p}") is None}
                time.sleep(0.2)
    except Exception:  # noqa: BLE001 - another process reported first, or the store is gone
        pass
    return True


def exchange(name: str, text: str) -> list[str]:
    """Every process's `text` for `name`, in process order, on every process: a small
    all-gather through the key-value store (no devices, so it works before the first
    compile). Every process must call it with the same `name`; with one process, [text]."""
    if jax.process_count() == 1:
        return [text]
    client = _client()
    client.key_value_set(f"{_KEYS}{name}/{jax.process_index()}", text, allow_overwrite=True)
    # A process that never arrives is gone: Watch ends this one meanwhile.
    return [client.blocking_key_value_get(f"{_KEYS}{name}/{p}", 24 * 3600 * 1000)
            for p in range(jax.process_count())]


def _client():
    return _jax_distributed.global_state.client


def _try_get(client, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception as e:  # noqa: BLE001
        if "NOT_FOUND" in str(e):
            return None
        raise
