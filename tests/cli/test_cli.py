"""``jaxpar``'s entry point (jaxpar.cli.main): what each command's outcome becomes (exit
status and the line on stderr) and how jaxpar's warnings are shown. The commands are
replaced by stand-ins, so nothing heavy runs."""

import warnings

import pytest

from jaxpar import cli
from jaxpar.errors import JaxparError, JaxparWarning, RunStopped

CALIBRATE = ["calibrate"]  # a command with no required argument


def _replace(monkeypatch, behaviour):
    """Make ``jaxpar calibrate`` run ``behaviour(args)`` instead."""
    real = cli.command_for
    monkeypatch.setattr(cli, "command_for",
                        lambda name: behaviour if name == "calibrate" else real(name))


def test_each_command_runs_its_module():
    import importlib

    modules = {"train": "train", "plan": "plan", "inspect": "inspection",
               "compile": "inspection", "calibrate": "calibrate", "launch": "launch",
               "sample": "sample", "convert": "convert", "export": "export",
               "tokenize": "tokenize_corpus", "goodput": "goodput"}
    assert modules == cli.COMMANDS
    for name, module in modules.items():
        assert cli.command_for(name) is importlib.import_module(
            f"jaxpar.cli.{module}").command


def test_the_command_gets_the_parsed_arguments_and_its_status_is_returned(monkeypatch):
    seen = []

    def command(args):
        seen.append(args)
        return 7

    _replace(monkeypatch, command)
    assert cli.main([*CALIBRATE, "--quick", "--name", "cpu8"]) == 7
    assert seen[0].command == "calibrate" and seen[0].quick and seen[0].name == "cpu8"


def test_a_user_error_is_one_line_and_exit_status_2(monkeypatch, capsys):
    def command(args):
        raise JaxparError("mesh.data=3 does not divide 8 devices")

    _replace(monkeypatch, command)
    shown = warnings.showwarning
    assert cli.main(CALIBRATE) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "jaxpar: error: mesh.data=3 does not divide 8 devices\n"
    assert warnings.showwarning is shown


def test_a_stopped_run_and_an_interrupt(monkeypatch, capsys):
    def stopped(args):
        raise RunStopped("SIGTERM: stopped after step 4, checkpoint 4 saved", 143)

    _replace(monkeypatch, stopped)
    assert cli.main(CALIBRATE) == 143
    assert capsys.readouterr().err == (
        "jaxpar: SIGTERM: stopped after step 4, checkpoint 4 saved\n")

    def interrupted(args):
        raise KeyboardInterrupt

    _replace(monkeypatch, interrupted)
    assert cli.main(CALIBRATE) == 130
    assert capsys.readouterr().err == "jaxpar: interrupted\n"


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(args):
        raise ZeroDivisionError("a bug")

    _replace(monkeypatch, broken)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        cli.main(CALIBRATE)


def test_jaxpar_warnings_are_one_line_and_others_go_through(monkeypatch, capsys):
    def noisy(args):
        warnings.warn("the pattern 'blocks/*/w_q' matched nothing", JaxparWarning,
                      stacklevel=1)
        warnings.warn("from another library", UserWarning, stacklevel=1)
        return 0

    _replace(monkeypatch, noisy)
    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        # The other library's warning takes Python's usual path (here: pytest records it).
        with pytest.warns(UserWarning, match="from another library") as caught:
            assert cli.main(CALIBRATE) == 0
    assert capsys.readouterr().err == (
        "jaxpar: warning: the pattern 'blocks/*/w_q' matched nothing\n")
    assert [w.category for w in caught] == [UserWarning]
    assert warnings.showwarning is shown  # put back after the command
