"""The arguments of every jaxpar command (jaxpar.cli.parser): one error line and exit
status 2 for a bad argument, options and ``key=value`` overrides in any order."""

import argparse

import pytest

from jaxpar.cli.parser import build_parser, device_count, parse_args

COMMANDS = {"train", "plan", "inspect", "compile", "calibrate", "launch", "sample", "convert",
            "export", "tokenize", "goodput"}
"""Every subcommand of the jaxpar command."""


@pytest.mark.parametrize("argv, line", [
    (["train", "--devices", "0"],
     "jaxpar train: error: argument --devices: 0: simulate at least 1 device"),
    (["inspect", "--devices", "two"],
     "jaxpar inspect: error: argument --devices: 'two' is not a whole number"),
    (["train", "--devices"], "jaxpar train: error: argument --devices: expected one argument"),
    (["train", "--bogus"], "jaxpar: error: unrecognized arguments: --bogus"),
    (["train", "--bogus=1", "a=1"], "jaxpar: error: unrecognized arguments: --bogus=1"),
    (["calibrate", "model.d_model=8"],  # calibrate takes no overrides
     "jaxpar: error: unrecognized arguments: model.d_model=8"),
    ([], "jaxpar: error: the following arguments are required: command"),
    (["plan", "--model", "m.yaml"],
     "jaxpar plan: error: the following arguments are required: --chips, --global-batch, "
     "--seq"),
    (["launch", "--", "train"],
     "jaxpar launch: error: one of the arguments --processes --replicas is required"),
    (["sample", "--run", "r", "--prompt", "p", "--top-k", "many"],
     "jaxpar sample: error: argument --top-k: invalid int value: 'many'"),
])
def test_a_bad_argument_is_one_line_and_exit_status_2(argv, line, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err == line + "\n"  # no usage dump


@pytest.mark.parametrize("argv, start", [
    (["fly"], "jaxpar: error: argument command: invalid choice: 'fly'"),
    (["export", "--run", "r", "--to-hf", "d", "--dtype", "int8"],
     "jaxpar export: error: argument --dtype: invalid choice: 'int8'"),
])
def test_an_invalid_choice_is_one_line(argv, start, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(start) and err.count("\n") == 1, err


def test_options_and_overrides_come_in_any_order():
    args = parse_args(["train", "mesh.data=2", "--devices", "8", "train.steps=3", "--resume",
                       "--out=runs/x", "plan.rules=fsdp_tp", "model.rope-theta=1e4"])
    assert args.command == "train" and args.devices == 8 and args.resume
    assert args.out == "runs/x" and args.config is None and not args.keep_mesh
    assert args.overrides == ["mesh.data=2", "train.steps=3", "plan.rules=fsdp_tp",
                              "model.rope-theta=1e4"]
    assert parse_args(["convert", "a.b=1", "--from-hf", "hf", "--out", "o"]).overrides == [
        "a.b=1"]
    assert parse_args(["inspect"]).overrides == []


def test_launch_keeps_everything_after_the_separator():
    args = parse_args(["launch", "--processes", "2", "--", "train", "--devices", "4",
                       "train.steps=2"])
    assert args.command_args == ["--", "train", "--devices", "4", "train.steps=2"]
    assert args.processes == 2 and args.devices_per_process == 1 and args.port == 0


def test_defaults_of_each_command():
    sample = parse_args(["sample", "--run", "r", "--prompt", "p"])
    assert (sample.max_tokens, sample.temperature, sample.top_k, sample.seed) == (None, 0.0,
                                                                                  0, 0)
    plan = parse_args(["plan", "--model", "m", "--chips", "h100:8", "--global-batch", "8",
                       "--seq", "128"])
    assert (plan.slices, plan.top, plan.json, plan.write) == (1, 5, False, None)
    assert plan.context is None and plan.expert is None
    export = parse_args(["export", "--run", "r", "--to-hf", "d"])
    assert (export.dtype, export.merge_lora, export.adapters) == ("float32", False, False)
    calibrate = parse_args(["calibrate"])
    assert (calibrate.out, calibrate.name, calibrate.devices, calibrate.quick) == (
        None, None, None, False)


def test_every_command_has_a_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == COMMANDS
    for name in COMMANDS:
        assert sub.choices[name].prog == f"jaxpar {name}"


def test_device_count():
    assert device_count("3") == 3 and device_count(" 16 ") == 16
    for bad in ("0", "-2", "1.5", "", "eight"):
        with pytest.raises(argparse.ArgumentTypeError):
            device_count(bad)
