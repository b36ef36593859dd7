"""``jaxpar inspect`` and ``jaxpar compile``: compile a config's training step, for this
machine's devices or for a TPU slice that is not here, and print what XLA did."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxpar.config.schema import load_config
from jaxpar.config.validate import check_config
from jaxpar.errors import JaxparError, RunStopped
from jaxpar.runs.distributed import simulate_devices
from jaxpar.storage.folders import check_new_output, refused_write, write_file


def _checked_outputs(args: argparse.Namespace) -> None:
    """Refuse output paths that cannot be written (a URL, a missing folder, an existing
    file or non-empty folder without ``--force``), before anything is compiled."""
    if getattr(args, "dump_hlo", None):
        check_new_output(args.dump_hlo, "--dump-hlo", force=args.force)
    if getattr(args, "save", None):
        check_new_output(args.save, "--save", force=args.force, folder=True)
        if args.dump_hlo and Path(args.save).absolute() == Path(args.dump_hlo).absolute():
            raise JaxparError(f"--dump-hlo and --save both name {args.save!r}; name two paths")


def stoppable(work: Callable[[], Any], what: str) -> Any:
    """``work()`` (a compile) in a worker thread, while this thread answers SIGINT and
    SIGTERM at once with :class:`RunStopped` (130, 143): XLA's compiler holds the main
    thread for minutes otherwise, and libtpu's own SIGTERM handler prints a stack dump.
    Nothing has been written when it stops; the worker is a daemon, left to the exit."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = work()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = err

    def stop(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        raise RunStopped(f"stopped by {name} during {what}; nothing was written",
                         128 + signum)

    if threading.current_thread() is not threading.main_thread():
        return work()  # signals reach the main thread only: nothing to answer here
    worker = threading.Thread(target=run, name="jaxpar-compile", daemon=True)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in done:
        raise done["error"]
    return done["value"]


@contextlib.contextmanager
def _compile_cache_off():
    """JAX's persistent compilation cache off for a while: a step saved for later runs
    (``--save``) is compiled, not loaded from the cache, since an executable XLA:CPU read
    from the cache serializes without its functions (the saved step then fails at its
    first run: ``Function negate_power_fusion not found``); and a step whose memory report
    is asked for (``--peak-buffers``) is compiled, so that XLA writes one."""
    import jax

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)


def command(args: argparse.Namespace) -> int:
    """``jaxpar inspect`` / ``jaxpar compile``: print the report of
    :func:`~jaxpar.analysis.inspection.inspect_config` as tables or JSON."""
    target_text = getattr(args, "target", None)
    tpu = target_text is not None and target_text.strip().lower() not in ("cpu", "local")
    if tpu and args.devices:
        raise JaxparError("--devices simulates CPU devices: it goes with --target cpu, not "
                          f"--target {target_text}")
    config = load_config(args.config, args.overrides, keep_mesh=args.keep_mesh)
    check_config(config)
    _checked_outputs(args)
    peak = getattr(args, "peak_buffers", None)
    dump = None
    if peak is not None:
        import tempfile

        from jaxpar.analysis.buffers import enable_dump

        dump = tempfile.TemporaryDirectory(prefix="jaxpar-xla-dump-")
        enable_dump(dump.name)  # before JAX starts a backend: XLA reads its flags once
    if tpu:  # compile-only: this host's TPU backend (if any) is not needed
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    simulate_devices(args.devices)
    from jaxpar.analysis.inspection import compile_step, step_report
    from jaxpar.analysis.report import render_inspection, render_peak_buffers
    from jaxpar.analysis.targets import parse_target

    save = getattr(args, "save", None)  # jaxpar compile only
    target = parse_target(target_text, args.slices)
    # A saved step, or one whose memory report is read, is compiled here, not loaded
    # from the cache (a cached executable is not compiled: XLA writes no report).
    with _compile_cache_off() if save or dump is not None else contextlib.nullcontext():
        step = stoppable(lambda: compile_step(config, target), "the compile")
    report = step_report(step, source=args.config or "defaults")
    if dump is not None:
        from jaxpar.analysis.buffers import peak_buffers

        found = peak_buffers(dump.name)
        dump.cleanup()
        report["peak_buffers"] = found and {
            "total_bytes": found[0],
            "buffers": [vars(b) for b in found[1][:peak]]}
    if args.dump_hlo:
        with refused_write(args.dump_hlo, "--dump-hlo"):
            write_file(args.dump_hlo, step.compiled.as_text())
    if save:
        from jaxpar.analysis.executables import save_compiled

        with refused_write(save, "--save"):
            save_compiled(step, Path(save))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render_inspection(report))
        if peak is not None:
            print("\n" + render_peak_buffers(report["peak_buffers"]))
        if args.dump_hlo:
            print(f"\nwrote the compiled program's HLO to {args.dump_hlo}")
        if save:
            print(f"wrote the compiled step to {save}: jaxpar train --compiled {save} "
                  f"runs it on {target.name}")
    return 0
