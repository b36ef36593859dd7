"""Every ``jaxpar`` command's arguments, in one place: :func:`build_parser` and
:func:`parse_args`. Parsing imports nothing heavy, and a bad argument is one line with exit
status 2 (argparse's usage dump left out)."""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Sequence

_OVERRIDE = re.compile(r"^[A-Za-z_][\w.\-]*=")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump) with exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")

    def format_help(self) -> str:
        text = super().format_help()
        if self.prog.split()[-1] in ("train", "inspect", "compile"):  # takes key=value
            text += "\n" + config_keys_help()
        return text


def config_keys_help() -> str:
    """Every config key a ``key=value`` override can set, by section, with its default
    (read from the schema's dataclasses when help is asked for: the schema imports JAX)."""
    import dataclasses

    from jaxpar.config.schema import Config

    lines = ["config keys (section.key=value; defaults shown):"]
    for field in dataclasses.fields(Config):
        default = getattr(Config(), field.name)
        if not dataclasses.is_dataclass(default):
            lines.append(f"  {field.name}={default!r}")
            continue
        items = [f"{f.name}={getattr(default, f.name)!r}"
                 for f in dataclasses.fields(default)]
        lines.append(textwrap.fill(", ".join(items), width=100, break_long_words=False,
                                   initial_indent=f"  {field.name}: ",
                                   subsequent_indent="      "))
    return "\n".join(lines) + "\n"


def _at_least_one(text: str, why: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: {why}")
    return n


def device_count(text: str) -> int:
    return _at_least_one(text, "simulate at least 1 device")


def positive_count(text: str) -> int:
    return _at_least_one(text, "give at least 1")


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine's devices and write a "
                         "catalog entry for jaxpar plan --catalog")
    cal.add_argument("--out", help="catalog YAML to write (raw timings go beside it, in "
                                   "OUT.measurements.json); default: print the entry")
    cal.add_argument("--name", help="catalog key (default: cpuN for N CPU devices, else "
                                    "the device kind)")
    cal.add_argument("--devices", type=device_count, help="simulate N CPU devices")
    cal.add_argument("--quick", action="store_true",
                     help="a smaller grid and shorter timings (a few seconds)")
    cal.set_defaults(command="calibrate")


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
    sample.add_argument("--int8", action="store_true",
                        help="LLM.int8 inference: int8 projection weights, input features "
                             "beyond 6.0 multiplied in floats (the output head stays float)")
    sample.add_argument("--chat", action="store_true",
                        help="--prompt is a user message: render it with the chat template "
                             "of the run's data.tokenizer (a Hugging Face folder) and a "
                             "generation prompt, print the reply, stop at its end of turn")
    sample.add_argument("--system", default=None,
                        help="with --chat: a system message before the user's")
    sample.set_defaults(command="sample")


def _add_hf(sub: argparse._SubParsersAction) -> None:
    convert = sub.add_parser("convert", help="a Hugging Face model folder -> a jaxpar run")
    convert.add_argument("--from-hf", required=True, help="folder with config.json and "
                         "safetensors (Llama, Mistral, Qwen2, Qwen3, Gemma, "
                         "Gemma 2, Gemma 3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE)")
    convert.add_argument("--out", required=True, help="run folder to write")
    convert.add_argument("--devices", type=device_count, help="simulate N CPU devices")
    convert.add_argument("overrides", nargs="*", metavar="key=value",
                         help="config overrides (mesh, plan, ...) stored with the run")
    convert.set_defaults(command="convert")
    export = sub.add_parser("export", help="a jaxpar run -> a Hugging Face folder")
    export.add_argument("--run", required=True, help="run folder (the --out of jaxpar train)")
    export.add_argument("--to-hf", required=True,
                        help="folder to write (a model.factory model: model.safetensors "
                             "under its own parameter names)")
    export.add_argument("--merge-lora", action="store_true",
                        help="fold LoRA adapters into the weights and write the whole model")
    export.add_argument("--adapters", action="store_true",
                        help="write the LoRA adapters alone, in PEFT's format")
    export.add_argument("--dtype", default="float32",
                        choices=["float32", "bfloat16", "float16"],
                        help="dtype of the written tensors")
    export.set_defaults(command="export")


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
    plan.add_argument("--quantize", choices=("none", "int8", "fp8"), default="none",
                      help="int8 or fp8 matmuls in the decoder layers (plan.quantize), "
                           "priced at the chip's 8-bit rate")
    plan.add_argument("--offload", choices=("never", "auto", "always"), default="auto",
                      help="host offload as a search dimension: never, when nothing fits "
                           "without it (auto, the default), or always")
    plan.add_argument("--top", type=int, default=5, help="plans to show")
    plan.add_argument("--write", metavar="FILE", help="write the winner as a run config")
    plan.add_argument("--force", action="store_true",
                      help="with --write: replace an existing file")
    plan.add_argument("--verify", type=int, default=0, metavar="K",
                      help="compile the first K plans with the TPU or GPU compiler (TPU "
                           "chips, a100, h100, h200; no TPU or GPU needed), drop those it "
                           "says do not fit, and print its memory beside the planner's")
    plan.add_argument("--json", action="store_true", help="print the plans as JSON")
    plan.add_argument("overrides", nargs="*", metavar="key=value",
                      help="model overrides, e.g. model.n_layers=40")
    plan.set_defaults(command="plan")


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    inspect = sub.add_parser("inspect", help="compile one train step and report what XLA did")
    inspect.add_argument("--config", help="YAML config file")
    inspect.add_argument("--devices", type=device_count, help="simulate N CPU devices")
    inspect.add_argument("--keep-mesh", action="store_true",
                         help="mesh overrides change only the axes given (default: they "
                              "replace the config's mesh)")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_target(inspect)
    inspect.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    inspect.set_defaults(command="inspect")

    compile_ = sub.add_parser(
        "compile", help="compile one train step for a TPU slice or GPUs you do not have (or "
                        "this machine) and report memory against HBM, collectives and FLOPs")
    compile_.add_argument("--config", help="YAML config file")
    compile_.add_argument("--devices", type=device_count, help="with --target cpu: simulate "
                                                               "N CPU devices")
    compile_.add_argument("--keep-mesh", action="store_true",
                          help="mesh overrides change only the axes given")
    compile_.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_target(compile_, required=True)
    compile_.add_argument("--save", metavar="DIR",
                          help="write the compiled executable, its config and versions to DIR "
                               "(jaxpar train --compiled DIR runs it on the target)")
    compile_.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    compile_.set_defaults(command="compile")


def _add_target(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument("--peak-buffers", type=positive_count, metavar="N",
                        help="list the N largest buffers of the compiled step's device "
                             "memory, and the values that use each (XLA's memory-usage "
                             "report)")
    parser.add_argument("--target", required=required,
                        help="devices to compile for: tpu-GEN:TOPOLOGY (e.g. tpu-v5p:4x4x4, "
                             "tpu-v6e:2x4; the TPU compiler runs here, no TPU needed), "
                             "GPUs as KIND:COUNT (h100:16, nodes of 8; a100, h200; XLA's GPU "
                             "compiler, no GPU needed) or cpu (this machine)"
                             + ("" if required else "; default: cpu"))
    parser.add_argument("--slices", type=int, default=1,
                        help="TPU slices joined by DCN (a mesh without DCN axes puts them on "
                             "data)")
    parser.add_argument("--dump-hlo", metavar="PATH",
                        help="write the compiled program's optimized HLO text to PATH")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --dump-hlo file" + (
                            "" if not required else " or a non-empty --save folder"))


def _add_launch(sub: argparse._SubParsersAction) -> None:
    launch = sub.add_parser("launch", help="run a jaxpar command as several local processes")
    procs = launch.add_mutually_exclusive_group(required=True)
    procs.add_argument("--processes", type=int, help="processes of one jax.distributed job")
    procs.add_argument("--replicas", type=int,
                       help="DiLoCo replicas as independent processes meeting every "
                            "diloco.sync_every steps through a parameter server (a replica "
                            "that dies is dropped; see --restart)")
    launch.add_argument("--resume", action="store_true",
                        help="with --replicas: continue the replica run in --out from its "
                             "last completed meeting, each replica from its checkpoint")
    launch.add_argument("--restart", type=int, default=0,
                        help="with --replicas: restarts allowed for replicas that die (a "
                             "restarted replica rejoins from the latest anchor)")
    launch.add_argument("--devices-per-process", type=int, default=1,
                        help="simulated CPU devices in each process")
    launch.add_argument("--port", type=int, default=0, help="coordinator port (0: a free one)")
    launch.add_argument("command_args", nargs=argparse.REMAINDER,
                        help="-- then the jaxpar command, e.g. -- train --config ...")
    launch.set_defaults(command="launch")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every jaxpar command."""
    parser = _Parser(prog="jaxpar", description="jaxpar: SPMD sharding for JAX and Flax")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a config")
    train.add_argument("--config", help="YAML config file (without one: the run folder's "
                       "config.yaml with --resume, else the defaults)")
    train.add_argument("--devices", type=device_count, help="simulate N CPU devices")
    train.add_argument("--out", help="run folder for config.yaml, metrics.jsonl, checkpoints/")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in OUT/checkpoints")
    train.add_argument("--max-steps", type=positive_count, metavar="N",
                       help="stop after N steps of this call, saving a checkpoint (a "
                            "time-boxed session; --resume continues, the learning-rate "
                            "schedule still spans train.steps)")
    train.add_argument("--keep-mesh", action="store_true",
                       help="mesh overrides change only the axes given (default: they "
                            "replace the config's mesh)")
    train.add_argument("--compiled", metavar="DIR",
                       help="run the step jaxpar compile --save DIR compiled ahead of time "
                            "(refused when the config, devices or versions differ)")
    train.add_argument("--coordinator", help="multi-process: coordinator host:port")
    train.add_argument("--num-processes", type=int, help="multi-process: process count")
    train.add_argument("--process-id", type=int, help="multi-process: this process's index")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. mesh.tensor=2 train.steps=50")
    train.set_defaults(command="train")
    _add_plan(sub)
    _add_inspect(sub)
    _add_calibrate(sub)
    _add_launch(sub)
    _add_sample(sub)
    _add_hf(sub)
    _add_tokenize(sub)
    _add_goodput(sub)
    return parser


def _add_goodput(sub: argparse._SubParsersAction) -> None:
    goodput = sub.add_parser("goodput", help="where a run's wall time went, across its "
                             "restarts: productive steps, compile, startup, checkpoints, "
                             "data, steps trained again")
    goodput.add_argument("run", metavar="RUN",
                         help="run folder (the --out of jaxpar train; local or in a bucket)")
    goodput.add_argument("--json", action="store_true",
                         help="print the session records and the total as JSON")
    goodput.set_defaults(command="goodput")


def _add_tokenize(sub: argparse._SubParsersAction) -> None:
    tok = sub.add_parser("tokenize", help="tokenize text corpora into token shards, in "
                         "parallel, once")
    tok.add_argument("inputs", nargs="+", metavar="INPUT",
                     help="text, .jsonl or .jsonl.gz files, folders or globs")
    tok.add_argument("--tokenizer", required=True,
                     help="a tokenizer.json file or a folder holding one")
    tok.add_argument("--out", required=True, help="folder to write the .bin shards to")
    tok.add_argument("--field", default="text", help="the text's key in .jsonl records")
    tok.add_argument("--workers", type=int, default=0,
                     help="worker processes (default: one per CPU, at most one per file)")
    tok.set_defaults(command="tokenize")


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
