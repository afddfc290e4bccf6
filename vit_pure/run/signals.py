"""SIGTERM / SIGINT during a run: finish the current step, checkpoint, stop; a second
signal stops at once. With several processes the stop is agreed between them.
"""
from __future__ import annotations

import contextlib
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
            raise KeyboardInterrupt  # the second signal: stop at once, save nothing
        self.signum = signum
