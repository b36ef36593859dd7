"""The ``jaxpar`` command line.

``jaxpar train --config configs/tiny.yaml [--devices N] [--out DIR] [key=value ...]``

``--devices N`` simulates N CPU devices; it must be handled before JAX starts a backend,
which is why this module imports the heavy parts of jaxpar only inside the commands.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _simulate_devices(n: int | None) -> None:
    if n is None:
        return
    import jax

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def _cmd_train(args: argparse.Namespace) -> int:
    _simulate_devices(args.devices)
    import jax

    from jaxpar.config import load_config
    from jaxpar.mesh import describe, make_mesh
    from jaxpar.run import summarize, train

    config = load_config(args.config, args.overrides)
    mesh = make_mesh(config.mesh.ici(), dcn=config.mesh.dcn())
    print(f"jaxpar: {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"mesh {describe(mesh)}, rules {config.plan.rules}, "
          f"model {config.model.param_count() / 1e6:.2f}M params")
    if mesh.shape["stage"] > 1:
        from jaxpar.pipeline import Schedule

        print(Schedule.for_model(config.model.n_layers, mesh.shape["stage"],
                                 config.pipeline.microbatches, config.pipeline.repeats
                                 ).describe())
    _, history = train(config, args.out)
    s = summarize(history)
    print(f"done: {len(history)} steps, final loss {s['final_loss']:.4f}, "
          f"{s['mean_tokens_per_s']:,.0f} tokens/s, {s['mean_step_time_s'] * 1e3:.1f} ms/step"
          + (f"; wrote {args.out}/metrics.jsonl" if args.out else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every jaxpar command."""
    parser = argparse.ArgumentParser(prog="jaxpar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a config")
    train.add_argument("--config", help="YAML config file (defaults apply without one)")
    train.add_argument("--devices", type=int, help="simulate N CPU devices")
    train.add_argument("--out", help="run folder for config.yaml and metrics.jsonl")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. mesh.tensor=2 train.steps=50")
    train.set_defaults(func=_cmd_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxpar`` command; user errors print one line and exit 2."""
    args = build_parser().parse_args(argv)
    from jaxpar.errors import JaxparError

    try:
        return args.func(args)
    except JaxparError as err:
        print(f"jaxpar: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxpar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
