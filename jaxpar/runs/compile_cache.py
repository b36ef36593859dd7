"""Compile time for users: JAX's persistent compilation cache, on by default for runs, and
what a run spent compiling.

``train.compile_cache`` chooses the folder: ``auto`` (the default) is
``$JAX_COMPILATION_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/jaxpar/xla`` (``~/.cache``
without it); ``off`` turns the cache off; anything else is the folder. A second run of the
same program (same model, layout, shapes, jax version and devices) loads its compiled
step out of that folder instead of compiling it. A URL (``gs://``, ``s3://``) is refused in
one line: read as a path it would fill a local folder named ``gs:``.
:class:`CompileWatch` counts, from JAX's monitoring events, the seconds spent compiling
and the programs found in the cache.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from jaxpar.errors import JaxparWarning
from jaxpar.storage.folders import refuse_url

OFF = "off"
AUTO = "auto"

_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"
_COMPILE = "/jax/core/compile/backend_compile_duration"
_READ = "/jax/compilation_cache/cache_retrieval_time_sec"


def cache_folder(setting: str) -> Path | None:
    """The folder ``train.compile_cache`` names (None: off).

    Raises:
      JaxparError: for a URL, in the setting or in ``$JAX_COMPILATION_CACHE_DIR``.
    """
    setting = (setting or AUTO).strip()
    if setting.lower() == OFF:
        return None
    if setting.lower() == AUTO:
        env = os.environ.get("JAX_COMPILATION_CACHE_DIR", "").strip()
        if env:
            refuse_url(env, "train.compile_cache=auto: JAX_COMPILATION_CACHE_DIR")
            return Path(env)
        base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
        return Path(base) / "jaxpar" / "xla"
    refuse_url(setting, "train.compile_cache")
    return Path(setting).expanduser()


def enable(setting: str) -> Path | None:
    """Point JAX's persistent compilation cache at :func:`cache_folder` (or turn it off);
    returns the folder in use. A folder that cannot be created only warns: a run without
    the cache is slower to start, not wrong."""
    import jax

    folder = cache_folder(setting)
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        warnings.warn(f"train.compile_cache: cannot use {str(folder)!r} ({err.strerror}); "
                      "compiling without the cache", JaxparWarning, stacklevel=2)
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    return folder


class CompileWatch:
    """Counts compilations while open: ``compile_s`` (seconds XLA spent compiling),
    ``hits`` (programs loaded from the persistent cache, ``read_s`` seconds reading them)
    and ``misses`` (programs compiled and written to it). A context manager."""

    def __init__(self) -> None:
        self.compile_s = self.read_s = 0.0
        self.hits = self.misses = 0

    def _event(self, event: str, **_: Any) -> None:
        if event == _HIT:
            self.hits += 1
        elif event == _MISS:
            self.misses += 1

    def _duration(self, event: str, duration: float, **_: Any) -> None:
        if event == _COMPILE:
            self.compile_s += duration
        elif event == _READ:
            self.read_s += duration

    def __enter__(self) -> CompileWatch:
        import jax.monitoring

        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def __exit__(self, *exc: Any) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_listener(self._event)
        jax.monitoring.unregister_event_duration_listener(self._duration)

    def metrics(self) -> dict[str, float]:
        """The counts as run-log figures."""
        return {"compile_s": round(self.compile_s, 3), "compile_cache_hits": self.hits,
                "compile_cache_misses": self.misses}

    def describe(self) -> str:
        """E.g. ``compiled 3 programs in 12.4 s; 2 loaded from the compile cache``."""
        return (f"compiling took {self.compile_s:.1f} s ({self.misses} program"
                f"{'s' * (self.misses != 1)} compiled and cached); {self.hits} loaded from "
                f"the compile cache in {self.read_s:.1f} s")
