"""The ``jaxpar`` command line.

``jaxpar train --config configs/tiny.yaml [--devices N] [--out DIR] [--resume] [key=value ...]``
``jaxpar plan --model configs/llama-7b.yaml --chips tpu-v5p:256 --global-batch 512 --seq 4096``
``jaxpar inspect --config configs/tiny.yaml --devices 8 [--json]``
``jaxpar calibrate [--out chip.yaml] [--name NAME] [--devices N] [--quick]``
``jaxpar launch --processes 2 --devices-per-process 4 -- train --config ...``
``jaxpar sample --run runs/tiny --prompt "def " [--max-tokens 64] [--temperature 0] [--top-k 0]``
``jaxpar convert --from-hf HF_FOLDER --out RUN [--devices N] [key=value ...]``
``jaxpar export --run RUN --to-hf DIR [--merge-lora | --adapters] [--dtype bfloat16]``

``--devices N`` simulates N CPU devices; it must be handled before JAX starts a backend,
which is why this module imports the heavy parts of jaxpar only inside the commands.
Options and ``section.key=value`` overrides may come in any order.

A mistake in the input (a config key, a value out of range, a file, a folder, a device
count) is reported as one line, ``jaxpar: error: ...``, with exit status 2, before any
heavy work; an interrupted run exits with 130 (Ctrl-C) or 143 (SIGTERM) after finishing
its checkpoint. Anything else that goes wrong is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxpar.config import Config

_OVERRIDE = re.compile(r"^[A-Za-z_][\w.\-]*=")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump) with exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _devices(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: simulate at least 1 device")
    return n


def _simulate_devices(n: int | None) -> None:
    if n is None:
        return
    import jax

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """jaxpar's own warnings as one line, without the source line that raised them."""
    from jaxpar.errors import JaxparWarning

    if issubclass(category, JaxparWarning):
        print(f"jaxpar: warning: {message}", file=file or sys.stderr)
    else:
        _DEFAULT_SHOW(message, category, filename, lineno, file, line)


_DEFAULT_SHOW = warnings.showwarning


def checked_train_config(args: argparse.Namespace) -> Config:
    """The config of a parsed ``jaxpar train`` command, checked with its run folder before
    JAX starts (the checks that need the device count come once it is known)."""
    from jaxpar.config import load_config
    from jaxpar.run import check_run_folder
    from jaxpar.validate import check_config

    source = args.config
    saved = Path(args.out) / "config.yaml" if args.out else None
    if source is None and args.resume and saved is not None and saved.is_file():
        source = saved  # a resumed run continues under the config it was started with
    config = load_config(source, args.overrides, keep_mesh=args.keep_mesh)
    check_config(config)
    check_run_folder(args.out, resume=args.resume, config=config)
    return config


def _cmd_train(args: argparse.Namespace) -> int:
    from jaxpar.validate import check_config

    config = checked_train_config(args)
    _simulate_devices(args.devices)
    from jaxpar.launch import initialize

    initialize(args.coordinator, args.num_processes, args.process_id)
    import jax

    from jaxpar.mesh import describe, make_mesh
    from jaxpar.run import summarize, train

    check_config(config, devices=jax.device_count(), processes=jax.process_count())
    mesh = make_mesh(config.mesh.ici(), dcn=config.mesh.dcn())
    writer = jax.process_index() == 0
    if writer:
        procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
        model = ("" if config.model.factory  # counted once built (jaxpar.run)
                 else f", model {config.model.param_count() / 1e6:.2f}M params")
        print(f"jaxpar: {jax.device_count()} {jax.devices()[0].platform} devices{procs}, "
              f"mesh {describe(mesh)}, rules {config.plan.rules}{model}", flush=True)
    if mesh.shape["stage"] > 1 and writer:
        from jaxpar.pipeline import Schedule

        print(Schedule.for_model(config.model.n_layers, mesh.shape["stage"],
                                 config.pipeline.microbatches, config.pipeline.repeats
                                 ).describe())
    _, history = train(config, args.out, resume=args.resume)
    if writer and history:
        s = summarize(history)
        print(f"done: {len(history)} steps, final loss {s['final_loss']:.4f}, "
              f"{s['mean_tokens_per_s']:,.0f} tokens/s, "
              f"{s['mean_step_time_s'] * 1e3:.1f} ms/step"
              + (f"; wrote {args.out}/metrics.jsonl and checkpoints/" if args.out else ""))
    elif writer:
        print(f"done: already at step {config.train.steps}; nothing to train")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from jaxpar.planner import command as plan_command

    return plan_command(args)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from jaxpar.errors import JaxparError

    if args.out:
        folder = Path(args.out).parent
        if not folder.is_dir():
            raise JaxparError(f"--out {args.out}: folder {str(folder)!r} does not exist")
        if Path(args.out).is_dir():
            raise JaxparError(f"--out {args.out} is a folder; give a file name")
    if args.name is not None and not re.fullmatch(r"[a-z0-9][a-z0-9._\-]*", args.name):
        raise JaxparError(f"--name {args.name!r}: use lower-case letters, digits, '.', '_' "
                          "and '-'")
    _simulate_devices(args.devices)
    import jax
    import yaml

    from jaxpar.planner.calibrate import calibrate, default_name, summary, write_entry

    devices = jax.devices()
    name = args.name or default_name(devices)
    if devices[0].platform == "cpu" and not name.startswith("cpu"):
        raise JaxparError(f"--name {name!r}: the planner prices chips named cpu* as XLA:CPU "
                          "(blocking collectives); name CPU entries cpu...")
    print(f"jaxpar: calibrating {len(devices)} {devices[0].platform} devices "
          f"({devices[0].device_kind}){' (quick)' if args.quick else ''}...", flush=True)
    entry = calibrate(devices, quick=args.quick)
    print(summary(entry))
    if args.out:
        raw = write_entry(entry, name, args.out)
        print(f"jaxpar: wrote {args.out} (entry {name!r}) and {raw}; use it with "
              f"jaxpar plan --catalog {args.out} --chips {name}:{len(devices)} ...")
    else:
        figures = {k: v for k, v in entry.items() if k != "measurements"}
        print("\n" + yaml.safe_dump({name: figures}, sort_keys=False), end="")
    return 0


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine's devices and write a "
                         "catalog entry for jaxpar plan --catalog")
    cal.add_argument("--out", help="catalog YAML to write (raw timings go beside it, in "
                                   "OUT.measurements.json); default: print the entry")
    cal.add_argument("--name", help="catalog key (default: cpuN for N CPU devices, else "
                                    "the device kind)")
    cal.add_argument("--devices", type=_devices, help="simulate N CPU devices")
    cal.add_argument("--quick", action="store_true",
                     help="a smaller grid and shorter timings (a few seconds)")
    cal.set_defaults(func=_cmd_calibrate)


def _cmd_inspect(args: argparse.Namespace) -> int:
    _simulate_devices(args.devices)
    from jaxpar.inspect import command as inspect_command

    return inspect_command(args)


def _cmd_launch(args: argparse.Namespace) -> int:
    from jaxpar.launch import command as launch_command

    return launch_command(args)


def _cmd_sample(args: argparse.Namespace) -> int:
    """``jaxpar sample``: the prompt, then the model's continuation as it is generated.

    Prompt text the tokenizer has no token for is read as its unknown token (or left
    out, by tokenizers without one) and said in one warning line; generated ids the
    tokenizer has no text for print nothing and are counted in one warning line at the
    end. ``--max-tokens`` is bounded by what the model attends to after the prompt
    (``model.max_seq_len``); without it, 64 or what room is left.
    """
    from jaxpar.errors import JaxparError
    from jaxpar.generate import check_run

    if not args.prompt:
        raise JaxparError("--prompt is empty: give the text to continue")
    if args.max_tokens is not None and args.max_tokens < 0:
        raise JaxparError(f"--max-tokens {args.max_tokens}: must be 0 or more")
    if not 0 <= args.temperature < float("inf"):
        raise JaxparError(f"--temperature {args.temperature}: must be 0 (greedy) or positive")
    if args.top_k < 0:
        raise JaxparError(f"--top-k {args.top_k}: must be 0 (every token) or positive")
    check_run(args.run)
    from jaxpar import generate as gen

    config = gen.run_config(args.run)
    codec = gen.TextCodec.for_config(config)
    ids = gen.prompt_ids(codec, args.prompt, "--prompt")

    def budget(room: tuple[int, str] | None) -> int | None:
        """--max-tokens checked against the room after the prompt (None: not known yet)."""
        if room is None:
            return None
        left, limit = room
        if args.max_tokens is None and left > 0:
            return min(64, left)
        if left == 0 and args.max_tokens != 0:
            raise JaxparError(f"--prompt is {len(ids)} tokens, which leaves no room to "
                              f"generate within {limit}: shorten --prompt")
        if args.max_tokens > left:
            raise JaxparError(f"--max-tokens {args.max_tokens} is more than the model can "
                              f"attend to after the prompt: {limit} minus the prompt's "
                              f"{len(ids)} tokens leaves {left}")
        return args.max_tokens

    max_tokens = budget(gen.context_room(config, len(ids)))  # before the model is built
    model, _ = gen.load_run_model(args.run)
    if max_tokens is None:  # a model.factory model: its limit is known once built
        max_tokens = budget(gen.context_room(config, len(ids), model))
    tokens = gen.generate_iter(model, ids, max_new_tokens=max_tokens,
                               temperature=args.temperature, top_k=args.top_k,
                               seed=args.seed, eos_id=codec.eos_id)
    stream = gen.TextStream(codec, ids)
    print(args.prompt, end="", flush=True)
    for token in tokens:
        piece = stream.push(token)
        if piece:
            print(piece, end="", flush=True)
    print(stream.finish(), flush=True)
    return 0


def _add_sample(sub: argparse._SubParsersAction) -> None:
    sample = sub.add_parser("sample", help="continue a prompt with a trained run's model")
    sample.add_argument("--run", required=True, help="run folder (the --out of jaxpar train)")
    sample.add_argument("--prompt", required=True, help="text to continue")
    sample.add_argument("--max-tokens", type=int, default=None,
                        help="tokens to generate, at most model.max_seq_len minus the "
                             "prompt's (default: 64, or fewer when that is less)")
    sample.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (the most likely token); higher: more random")
    sample.add_argument("--top-k", type=int, default=0,
                        help="sample among the K most likely tokens only (0: all)")
    sample.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    sample.set_defaults(func=_cmd_sample)


def _cmd_convert(args: argparse.Namespace) -> int:
    from jaxpar.hf.commands import check_hf_folder, convert_to_run

    check_hf_folder(args.from_hf)
    _simulate_devices(args.devices)
    out = convert_to_run(args.from_hf, args.out, args.overrides)
    print(f"jaxpar: wrote {out}/checkpoints/0 from {args.from_hf}; continue with "
          f"jaxpar train --out {out} --resume, or start runs from it with init_from={out}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from jaxpar.generate import check_run
    from jaxpar.hf.commands import check_export_target, export_run

    check_export_target(args.to_hf, merge_lora=args.merge_lora, adapters=args.adapters)
    check_run(args.run)
    out = export_run(args.run, args.to_hf, merge_lora=args.merge_lora,
                     adapters=args.adapters, dtype=args.dtype)
    kind = "PEFT adapters" if args.adapters else "a Hugging Face model"
    print(f"jaxpar: wrote {kind} to {out}")
    return 0


def _add_hf(sub: argparse._SubParsersAction) -> None:
    convert = sub.add_parser("convert", help="a Hugging Face model folder -> a jaxpar run")
    convert.add_argument("--from-hf", required=True, help="folder with config.json and "
                         "safetensors (Llama, Mistral, Qwen2, Qwen3, Gemma)")
    convert.add_argument("--out", required=True, help="run folder to write")
    convert.add_argument("--devices", type=_devices, help="simulate N CPU devices")
    convert.add_argument("overrides", nargs="*", metavar="key=value",
                         help="config overrides (mesh, plan, ...) stored with the run")
    convert.set_defaults(func=_cmd_convert)
    export = sub.add_parser("export", help="a jaxpar run -> a Hugging Face folder")
    export.add_argument("--run", required=True, help="run folder (the --out of jaxpar train)")
    export.add_argument("--to-hf", required=True, help="folder to write")
    export.add_argument("--merge-lora", action="store_true",
                        help="fold LoRA adapters into the weights and write the whole model")
    export.add_argument("--adapters", action="store_true",
                        help="write the LoRA adapters alone, in PEFT's format")
    export.add_argument("--dtype", default="float32",
                        choices=["float32", "bfloat16", "float16"],
                        help="dtype of the written tensors")
    export.set_defaults(func=_cmd_export)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="choose a mesh, ZeRO stage, remat and microbatches")
    plan.add_argument("--model", required=True, help="run or model config YAML")
    plan.add_argument("--chips", required=True,
                      help="chip kind and count, e.g. tpu-v5p:256, h100:64, cpu:8")
    plan.add_argument("--slices", type=int, default=1, help="slices joined by DCN")
    plan.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    plan.add_argument("--seq", type=int, required=True, help="sequence length")
    plan.add_argument("--catalog", help="YAML file with extra chip kinds")
    plan.add_argument("--context", metavar="SIZES",
                      help="context-axis sizes to consider, e.g. 1,4,8 (default: 1, and "
                           "powers of two for sequences of 16384 or more)")
    plan.add_argument("--expert", metavar="SIZES",
                      help="expert-axis sizes to consider (default: the divisors of "
                           "model.n_experts)")
    plan.add_argument("--top", type=int, default=5, help="plans to show")
    plan.add_argument("--write", metavar="FILE", help="write the winner as a run config")
    plan.add_argument("--json", action="store_true", help="print the plans as JSON")
    plan.add_argument("overrides", nargs="*", metavar="key=value",
                      help="model overrides, e.g. model.n_layers=40")
    plan.set_defaults(func=_cmd_plan)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    inspect = sub.add_parser("inspect", help="compile one train step and report what XLA did")
    inspect.add_argument("--config", help="YAML config file")
    inspect.add_argument("--devices", type=_devices, help="simulate N CPU devices")
    inspect.add_argument("--keep-mesh", action="store_true",
                         help="mesh overrides change only the axes given (default: they "
                              "replace the config's mesh)")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    inspect.set_defaults(func=_cmd_inspect)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    launch = sub.add_parser("launch", help="run a jaxpar command as several local processes")
    launch.add_argument("--processes", type=int, required=True, help="processes to start")
    launch.add_argument("--devices-per-process", type=int, default=1,
                        help="simulated CPU devices in each process")
    launch.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    launch.add_argument("command_args", nargs=argparse.REMAINDER,
                        help="-- then the jaxpar command, e.g. -- train --config ...")
    launch.set_defaults(func=_cmd_launch)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every jaxpar command."""
    parser = _Parser(prog="jaxpar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a config")
    train.add_argument("--config", help="YAML config file (without one: the run folder's "
                       "config.yaml with --resume, else the defaults)")
    train.add_argument("--devices", type=_devices, help="simulate N CPU devices")
    train.add_argument("--out", help="run folder for config.yaml, metrics.jsonl, checkpoints/")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in OUT/checkpoints")
    train.add_argument("--keep-mesh", action="store_true",
                       help="mesh overrides change only the axes given (default: they "
                            "replace the config's mesh)")
    train.add_argument("--coordinator", help="multi-process: coordinator host:port")
    train.add_argument("--num-processes", type=int, help="multi-process: process count")
    train.add_argument("--process-id", type=int, help="multi-process: this process's index")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. mesh.tensor=2 train.steps=50")
    train.set_defaults(func=_cmd_train)
    _add_plan(sub)
    _add_inspect(sub)
    _add_calibrate(sub)
    _add_launch(sub)
    _add_sample(sub)
    _add_hf(sub)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line, options and ``key=value`` overrides in any order."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        stray = [a for a in extra if not _OVERRIDE.match(a)]
        if stray or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` command; user errors print one line and exit 2."""
    args = parse_args(argv)
    from jaxpar.errors import JaxparError, RunStopped

    shown = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        return args.func(args)
    except JaxparError as err:
        print(f"jaxpar: error: {err}", file=sys.stderr)
        return 2
    except RunStopped as stop:
        print(f"jaxpar: {stop}", file=sys.stderr)
        return stop.status
    except KeyboardInterrupt:
        print("jaxpar: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
