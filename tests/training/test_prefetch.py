"""The prefetcher: batches in order, made ahead on a thread, errors raised at their step."""

import threading

import pytest

from jaxpar.training.prefetch import Prefetcher


def test_batches_come_in_order_and_are_made_ahead():
    made: list[int] = []
    ready = threading.Event()

    def make(step):
        made.append(step)
        if len(made) == 3:
            ready.set()
        return step * 10

    with Prefetcher(make, 5, 12, depth=2) as batches:
        assert ready.wait(10), "the thread did not make batches ahead of the consumer"
        assert list(batches) == [(s, s * 10) for s in range(5, 12)]
    assert made == list(range(5, 12))


def test_an_error_is_raised_at_the_step_that_failed():
    def make(step):
        if step == 3:
            raise ValueError("bad batch 3")
        return step

    got = []
    with Prefetcher(make, 0, 10) as batches, pytest.raises(ValueError, match="bad batch 3"):
        for _step, batch in batches:
            got.append(batch)
    assert got == [0, 1, 2]


def test_close_stops_the_thread_early():
    batches = Prefetcher(lambda step: step, 0, 10**9, depth=2)
    assert next(iter(batches)) == (0, 0)
    batches.close()
    assert not batches._thread.is_alive()
