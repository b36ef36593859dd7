"""Batches made ahead of the step that needs them, on a background thread.

A training step is dispatched to the devices and returns at once; while it runs, the host
can read the next batch and copy it to the devices. :class:`Prefetcher` does that: a
thread calls ``make(step)`` for the coming steps (reading rows, assembling the global
array in its sharding) and keeps up to ``depth`` of them ready, so the input pipeline
overlaps the step instead of following it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_DONE = object()


class Prefetcher:
    """Iterates over ``make(step)`` for ``step`` in ``range(start, end)``, made ahead.

    Args:
      make: builds the batch of one step (called on the background thread, in order).
      start, end: the steps to make.
      depth: batches kept ready (at least 1).

    An exception raised by ``make`` is raised again by the iteration, at the step that
    failed. :meth:`close` (or leaving a ``with`` block) stops the thread early.
    """

    def __init__(self, make: Callable[[int], Any], start: int, end: int, *, depth: int = 2):
        self.last_wait_s = 0.0
        """How long the last batch was waited for (0 when it was ready): the time a step
        lost to the input pipeline."""
        self._ready: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(make, start, end),
                                        name="jaxpar-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, make: Callable[[int], Any], start: int, end: int) -> None:
        for step in range(start, end):
            try:
                item = (step, make(step), None)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer
                self._put((step, None, err))
                return
            if not self._put(item):
                return
        self._put(_DONE)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        while True:
            begin = time.perf_counter()
            item = self._ready.get()
            self.last_wait_s = time.perf_counter() - begin
            if item is _DONE:
                return
            step, batch, err = item
            if err is not None:
                raise err
            yield step, batch

    def close(self) -> None:
        """Stop making batches and wait for the thread to finish."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
