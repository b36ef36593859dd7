"""Ctrl-C and SIGTERM as a request to stop (jaxpar.runs.interrupts.StopOnSignal), with real
signals sent to this process: the first is recorded, the second says what the run waits
for, the third leaves at once (``os._exit`` replaced, so the test process goes on)."""

import signal
import threading
from types import SimpleNamespace

import pytest

import jaxpar.runs.interrupts as interrupts
from jaxpar.runs.interrupts import SIGNAL_STATUS, StopOnSignal

FIRST = ("received: stopping after the current step (again: show progress; a third time: "
         "stop without waiting)")


class Exited(Exception):
    """Raised by the stand-in for os._exit, with the status the process would exit with."""


@pytest.fixture
def no_exit(monkeypatch):
    def _exit(status):
        raise Exited(status)

    monkeypatch.setattr(interrupts, "os", SimpleNamespace(_exit=_exit))


def test_exit_status_is_128_plus_the_signal_number():
    assert SIGNAL_STATUS == {signal.SIGINT: 128 + 2, signal.SIGTERM: 128 + 15}
    fresh = StopOnSignal(print)
    assert not fresh.requested and fresh.signal is None
    assert fresh.status == 130 and fresh.name == "Ctrl-C"  # what an interrupt reports


@pytest.mark.parametrize("sig, name, status", [(signal.SIGINT, "Ctrl-C", 130),
                                               (signal.SIGTERM, "SIGTERM", 143)])
def test_the_first_signal_is_recorded_not_raised(sig, name, status):
    said = []
    with StopOnSignal(said.append) as stop:
        signal.raise_signal(sig)  # no KeyboardInterrupt, no termination
        assert stop.requested and stop.signal == sig
        assert stop.agreed(1) and stop.agreed(0)  # one process: its own request
    assert (stop.name, stop.status) == (name, status)
    assert said == [f"{name} {FIRST}"]


def test_the_second_signal_says_what_the_run_waits_for(no_exit):
    said, pending = [], ["checkpoint 40"]
    with StopOnSignal(said.append, lambda: pending[0]) as stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert stop.count == 2
        # The stop keeps the first signal's name and status.
        assert (stop.name, stop.status) == ("SIGTERM", 143)
        with pytest.raises(Exited) as exited:
            signal.raise_signal(signal.SIGINT)
    assert exited.value.args == (130,)  # the status of the signal that ended it
    assert said[1:] == [
        "still finishing checkpoint 40; a checkpoint is written whole or not at all, so "
        "waiting for it (Ctrl-C once more to abandon it)",
        "abandoning checkpoint 40; --resume starts from the checkpoint before it"]


def test_with_nothing_pending_the_third_signal_stops_now(no_exit):
    said = []
    with StopOnSignal(said.append) as stop:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(Exited) as exited:
            signal.raise_signal(signal.SIGTERM)
    assert stop.signal == signal.SIGINT and exited.value.args == (143,)
    assert said == [f"Ctrl-C {FIRST}", "stopping after the current step", "stopping now"]


def test_the_previous_handlers_come_back():
    # Python's own Ctrl-C handler first (a test worker may have replaced it).
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = {sig: signal.getsignal(sig) for sig in SIGNAL_STATUS}
        with StopOnSignal(print) as stop:
            for sig in SIGNAL_STATUS:
                assert signal.getsignal(sig) == stop._handle
        assert {sig: signal.getsignal(sig) for sig in SIGNAL_STATUS} == before
        # Outside, Ctrl-C is Python's own again.
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, original)


def test_outside_the_main_thread_nothing_is_installed():
    before = {sig: signal.getsignal(sig) for sig in SIGNAL_STATUS}
    seen, errors = [], []

    def enter_and_leave():
        try:
            with StopOnSignal(print):
                seen.append({sig: signal.getsignal(sig) for sig in SIGNAL_STATUS})
        except Exception as err:  # signal.signal would raise ValueError off the main thread
            errors.append(err)

    thread = threading.Thread(target=enter_and_leave)
    thread.start()
    thread.join()
    assert errors == [] and seen == [before]
