"""``jaxpar train``: a run from a config, on this machine's devices or simulated ones, alone
or as one process of several."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jaxpar.config.yaml_files import read_yaml
from jaxpar.runs import goodput
from jaxpar.runs.run_folder import FINISHED, folder_bytes
from jaxpar.storage.remote import is_remote
from jaxpar.storage.run_mirror import RunMirror

if TYPE_CHECKING:
    from jaxpar.config.schema import Config


def checked_train_config(args: argparse.Namespace) -> Config:
    """The config of a parsed ``jaxpar train`` command, checked with its run folder before
    JAX starts (the checks that need the device count come once it is known)."""
    from jaxpar.config.schema import load_config
    from jaxpar.config.validate import check_config
    from jaxpar.runs.run_folder import check_run_folder

    source = args.config
    saved = Path(args.out) / "config.yaml" if args.out and not is_remote(args.out) else None
    if source is None and args.resume and is_remote(args.out):
        saved = RunMirror(args.out).fetch("config.yaml")
    if source is None and args.resume and saved is not None and saved.is_file():
        source = saved  # a resumed run continues under the config it was started with
    config = load_config(source, args.overrides, keep_mesh=args.keep_mesh)
    check_config(config)
    check_run_folder(args.out, resume=args.resume, config=config)
    return config


def finished_step(out: str | None) -> int | None:
    """The step a run folder finished at, when nothing changed since: ``FINISHED`` names
    the step and the byte size of its checkpoint, written at the end of a run, and the
    newest checkpoint still is that one, of that size (a truncated or replaced file sends
    the resume down the full path, which reads the checkpoint and falls back past a
    damaged one). In a bucket, the newest uploaded step. None otherwise."""
    if not out:
        return None
    if is_remote(out):
        return max(RunMirror(out).remote_steps(), default=None)
    try:
        done = json.loads((Path(out) / FINISHED).read_text())
    except (OSError, ValueError):
        return None
    folder = Path(out) / "checkpoints"
    steps = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if (
        folder.is_dir()) else []
    if not steps or steps[-1] != done.get("step"):
        return None
    return steps[-1] if folder_bytes(folder / str(steps[-1])) == done.get("bytes") else None


def command(args: argparse.Namespace) -> int:
    """``jaxpar train``: check the config and run folder, start the devices, train."""
    if sys.argv[1:2] == ["train"]:  # this process runs this command: count from its start
        goodput.count_from_process_start()  # (starting Python and JAX are startup)
    if args.config:  # a missing or broken file is named before anything starts JAX
        read_yaml(args.config)
    config = checked_train_config(args)
    done = finished_step(args.out) if args.resume else None
    if done is not None and done >= config.train.steps:  # nothing to build or compile
        print(f"done: already at step {done} of train.steps={config.train.steps}; nothing "
              "to train (raise train.steps to continue)")
        return 0
    import jax

    from jaxpar.config.validate import check_config, pipeline_for
    from jaxpar.runs.distributed import ENV_NUM_PROCESSES, initialize, simulate_devices
    from jaxpar.runs.host_memory import local_gpu_count, size_device_pool, size_host_pool
    from jaxpar.runs.loop import summarize, train
    from jaxpar.sharding.mesh import describe, make_mesh

    gpus = local_gpu_count()
    if gpus:  # the planner's HBM, not JAX's default three quarters of it
        size_device_pool()
    if gpus or args.devices:  # GPUs read the pool's size once, as their backend starts
        size_host_pool(config, args.devices or gpus, args.num_processes or int(
            os.environ.get(ENV_NUM_PROCESSES) or 1))
    simulate_devices(args.devices)
    initialize(args.coordinator, args.num_processes, args.process_id)
    check_config(config, devices=jax.device_count(), processes=jax.process_count())
    mesh = make_mesh(config.mesh.ici(), dcn=config.mesh.dcn())
    writer = jax.process_index() == 0
    if writer:
        procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
        model = ("" if config.model.factory  # counted once built (jaxpar.runs.loop)
                 else f", model {config.model.param_count() / 1e6:.2f}M params")
        print(f"jaxpar: {jax.device_count()} {jax.devices()[0].platform} devices{procs}, "
              f"mesh {describe(mesh)}, rules {config.plan.rules}{model}", flush=True)
    if mesh.shape["stage"] > 1 and writer and not config.model.factory:
        print(pipeline_for(config, mesh.shape["stage"]).describe())
    dl = config.diloco
    if dl.sync_every and writer:
        print(f"diloco: {mesh.shape['data']} replicas over data, each fragment meets every "
              f"{dl.sync_every} steps ({dl.fragments} fragment{'s' * (dl.fragments > 1)}, "
              f"staleness {dl.staleness}), outer SGD lr {dl.outer_lr} momentum "
              f"{dl.outer_momentum}{' nesterov' * dl.nesterov}"
              f"{', meetings overlapped with the next step' * dl.overlap}")
    _, history = train(config, args.out, resume=args.resume, compiled=args.compiled,
                       max_steps=getattr(args, "max_steps", None))
    if writer and history:
        s = summarize(history)
        spent = goodput.describe(goodput.final_figures(args.out, history[-1]))
        print(f"done: {len(history)} steps, final loss {s['final_loss']:.4f}, "
              f"{s['mean_tokens_per_s']:,.0f} tokens/s, "
              f"{s['mean_step_time_s'] * 1e3:.1f} ms/step"
              + (f"; {spent}" if spent else "")
              + (f"; wrote {args.out}/metrics.jsonl and checkpoints/" if args.out else ""))
    elif writer:
        print(f"done: already at step {config.train.steps}; nothing to train")
    return 0
