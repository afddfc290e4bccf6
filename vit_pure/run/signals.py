"""SIGTERM / SIGINT during a run: finish the current step, checkpoint, stop; a second
signal stops at once. With several processes the stop is agreed between them.

Python runs a signal handler only in the main thread, between two bytecodes: while the
main thread is inside a long call into XLA (a compile can take a minute), `_handle` waits.
So each signal is also written to a pipe (`signal.set_wakeup_fd`, done by the interpreter's
C-level handler the moment the signal arrives) and a watcher thread reads it: it says at
once that the signal was heard, and ends the process itself when a second signal finds the
main thread unable to act on it.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import jax

from vit_pure.run import distributed


class StopRequest:
    """SIGTERM / SIGINT: finish the current step, checkpoint, stop. A second one: stop now.

    The handler only records the signal; the loop looks at it between steps, so a
    preempted job loses at most the step it was in.
    """
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    # With several processes, agree every this many steps: a signal stops the run at most
    # AGREE_EVERY - 1 steps later than with one process.
    AGREE_EVERY = 10

    def __init__(self):
        self.signum: int | None = None
        self.finished = False  # the run ended (trained, or stopped with its checkpoint)
        self._agreed: tuple[int, int | None] | None = None  # (step, what was agreed there)
        self.stopping_now = threading.Event()  # `_handle` has acted on a second signal

    @contextlib.contextmanager
    def handling_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # Python delivers signals to the main thread only; nothing to install
            return
        previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        for s in self.SIGNALS:
            signal.signal(s, self._handle)
        watcher = _Watcher(self)
        try:
            yield
        finally:
            watcher.close()
            for s, handler in previous.items():
                if handler is not None:
                    signal.signal(s, handler)

    def agreed(self, step: int) -> int | None:
        """The signal to stop for after `step` steps, the same on every process (None: go on).

        A SIGTERM may reach the processes of a job at different times, but they must all
        stop after the same step (each step is a collective program all of them run), so
        with several processes each process's signal number is all-gathered and the
        largest wins. That is a tiny collective, and it waits for the step in flight, so
        the processes agree only after every AGREE_EVERY-th step (between the others,
        every process goes on): the same steps on every process, as the collectives need.
        A step is agreed once; asked again, the answer is the same. One process: no
        collective, every step.
        """
        if jax.process_count() == 1:
            return self.signum
        if step % self.AGREE_EVERY:
            return None
        if self._agreed is None or self._agreed[0] != step:
            self._agreed = (step, distributed.agree_max(self.signum or 0) or None)
        return self._agreed[1]

    def _handle(self, signum, frame):
        if self.finished:  # the run's end is reached and saved: let it finish cleanly
            print(f"{signal.Signals(signum).name} after the run ended: finishing",
                  file=sys.stderr, flush=True)
            return
        if self.signum is not None:
            self.stopping_now.set()
            raise KeyboardInterrupt  # the second signal: stop at once, save nothing
        self.signum = signum


class _Watcher:
    """The thread that hears each signal at once (see the module docstring).

    The first signal: one line on stderr, "SIGTERM: stopping after this step; again to stop
    now" (the loop stops at the next step boundary, `StopRequest.agreed`). The second: the
    main thread's `_handle` stops the run (KeyboardInterrupt, cli's exit 130); if it has
    not done so within GRACE_S (the main thread is inside XLA), this thread does what cli
    does then: the same line, the other processes of a job told, exit 130.
    """
    GRACE_S = 1.0

    def __init__(self, request: StopRequest):
        self.request, self.closing = request, False
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._run, name="signal-watcher", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop watching: the signals that came are still acknowledged, none ends the
        process from here on."""
        signal.set_wakeup_fd(self.previous_fd)
        self.closing = True
        os.close(self.write_fd)  # the thread reads what is left, then the end of the pipe
        self.thread.join()
        os.close(self.read_fd)

    def _run(self) -> None:
        heard = 0
        numbers = {int(s) for s in StopRequest.SIGNALS}
        while data := os.read(self.read_fd, 64):
            for signum in (n for n in data if n in numbers):
                heard += 1
                if self.request.finished:  # `_handle` says what happens then
                    continue
                if heard == 1:
                    print(f"{signal.Signals(signum).name}: stopping after this step; again "
                          f"to stop now", file=sys.stderr, flush=True)
                elif not self.request.stopping_now.wait(self.GRACE_S) and not self.closing:
                    print("interrupted: stopped at once; nothing saved since the last "
                          "checkpoint", file=sys.stderr, flush=True)
                    distributed.report_failure("interrupted by a second signal")  # as cli's
                    sys.stdout.flush()
                    os._exit(130)
