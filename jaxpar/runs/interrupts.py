"""Stopping a run cleanly: Ctrl-C and SIGTERM become a request to stop between steps.

Inside :class:`StopOnSignal`, the first SIGINT (Ctrl-C) or SIGTERM (what a scheduler sends
a preempted job) does not raise: it records the request, and the run loop stops after the
step in flight, finishes the checkpoint being written and exits. A second signal while
the run is finishing says what it is waiting for and keeps waiting (a checkpoint left half
written would cost every step since the previous one); a third abandons the wait at once
(the unfinished checkpoint is a temporary folder that resuming ignores and deletes).

In a multi-process run every process must stop at the same step, since saving is
collective: :meth:`StopOnSignal.agreed` combines the processes' requests.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np

SIGNAL_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""Exit status for a run stopped by each signal (128 + the signal number, as shells say)."""


class StopOnSignal:
    """Context manager that turns SIGINT/SIGTERM into :attr:`requested`.

    Args:
      say: prints a one-line notice (called from the signal handler).
      waiting_for: returns what the run is finishing (``"checkpoint 40"``) or None; used in
        the notice of a second signal.
    """

    def __init__(self, say: Callable[[str], None],
                 waiting_for: Callable[[], str | None] = lambda: None):
        self.say = say
        self.waiting_for = waiting_for
        self.signal: int | None = None
        self.since: float | None = None
        """When (``time.monotonic``) the stop was requested here, or learnt from another
        process; a preemption's grace period runs from then."""
        self.count = 0
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop was requested in this process."""
        return self.signal is not None

    @property
    def status(self) -> int:
        """The exit status for the signal received (130 when none was)."""
        return SIGNAL_STATUS.get(self.signal, 130)

    @property
    def name(self) -> str:
        """``"Ctrl-C"`` or ``"SIGTERM"``."""
        return "SIGTERM" if self.signal == signal.SIGTERM else "Ctrl-C"

    def elapsed(self) -> float:
        """Seconds since the stop was requested (0 when it was not)."""
        return time.monotonic() - self.since if self.since is not None else 0.0

    def agreed(self, process_count: int) -> bool:
        """Whether any process has a stop request (collective across processes)."""
        if process_count <= 1:
            return self.requested
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.requested))
        if np.any(flags) and self.signal is None:
            self.signal = signal.SIGTERM  # another process was told to stop
            self.since = time.monotonic()
        return bool(np.any(flags))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1:
            self.signal, self.since = signum, time.monotonic()
            self.say(f"{self.name} received: stopping after the current step "
                     "(again: show progress; a third time: stop without waiting)")
            return
        pending = self.waiting_for()
        if self.count == 2 and pending:
            self.say(f"still finishing {pending}; a checkpoint is written whole or not at "
                     "all, so waiting for it (Ctrl-C once more to abandon it)")
            return
        if self.count == 2:
            self.say("stopping after the current step")
            return
        self.say(f"abandoning {pending}; --resume starts from the checkpoint before it"
                 if pending else "stopping now")
        sys.stderr.flush()
        os._exit(SIGNAL_STATUS.get(signum, 130))

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNAL_STATUS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
