"""One process of ``jaxpar launch`` (jaxpar.cli.child.child_main): ``jaxpar ARGS`` whose
failure ends the process at once (``os._exit``) with the command's exit status. The command
and ``os._exit`` are replaced, so the test process itself goes on."""

from types import SimpleNamespace

import pytest

import jaxpar.cli.child as child


class Exited(Exception):
    """What the stand-in for os._exit raises: the status the process would exit with."""


@pytest.fixture
def run_child(monkeypatch):
    """``run_child(outcome)``: child_main with a command whose outcome is ``outcome`` (a
    status to return, or an exception to raise); returns ("exit", status) for sys.exit and
    ("_exit", status) for os._exit."""
    def _exit(status):
        raise Exited(status)

    monkeypatch.setattr(child, "os", SimpleNamespace(_exit=_exit))

    def run(outcome):
        def main(argv):
            assert argv == ["train", "x=1"]
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        monkeypatch.setattr(child, "main", main)
        try:
            child.child_main(["train", "x=1"])
        except SystemExit as stop:
            return "exit", stop.code
        except Exited as stop:
            return "_exit", stop.args[0]
        raise AssertionError("child_main returned")

    return run


def test_success_exits_normally(run_child, capsys):
    assert run_child(0) == ("exit", 0)
    assert run_child(SystemExit(None)) == ("exit", 0)
    assert run_child(SystemExit(0)) == ("exit", 0)
    assert capsys.readouterr().err == ""


def test_a_failed_command_exits_at_once_with_its_status(run_child, capsys):
    assert run_child(2) == ("_exit", 2)
    assert run_child(130) == ("_exit", 130)
    assert run_child(SystemExit(2)) == ("_exit", 2)  # argparse's bad argument
    assert capsys.readouterr().err == ""


def test_an_exit_with_a_message_prints_it_and_exits_1(run_child, capsys):
    assert run_child(SystemExit("cannot go on")) == ("_exit", 1)
    assert capsys.readouterr().err == "cannot go on\n"


def test_a_bug_shows_its_traceback_and_exits_1(run_child, capsys):
    assert run_child(ZeroDivisionError("a bug")) == ("_exit", 1)
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.rstrip().endswith("ZeroDivisionError: a bug")
