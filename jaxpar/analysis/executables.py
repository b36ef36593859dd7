"""Compiled training steps saved to a folder and loaded back: ``jaxpar compile --save DIR``
compiles a run's step for its target ahead of time (a TPU slice, from this host), and
``jaxpar train --compiled DIR`` on that target runs it without compiling.

The folder holds the serialized executable (``jax.experimental.serialize_executable``),
the run config it was compiled from, the target and the versions of jax, jaxlib, libtpu
and jaxpar, written whole or not at all (a staged folder swapped in). Loading refuses, in
one line, a damaged folder, or an executable whose config, devices or versions differ
from the run's: an executable compiled for other shapes or another compiler would fail
at the first step, or worse, run a different program.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import pickle
from pathlib import Path
from typing import Any

import yaml

from jaxpar.analysis.inspection import CompiledStep
from jaxpar.config.schema import Config, from_dict
from jaxpar.errors import JaxparError
from jaxpar.sharding.plan import AUTO_KNOBS
from jaxpar.storage.folders import staged_folder, write_file

EXECUTABLE = "executable.pkl"
MANIFEST = "manifest.json"
CONFIG = "config.yaml"


def versions() -> dict[str, str]:
    """The versions of the packages a compiled executable depends on."""
    out = {}
    for name in ("jax", "jaxlib", "libtpu", "jaxpar"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def _devices(devices: Any) -> dict[str, Any]:
    return {"n_devices": len(devices), "device_kind": str(devices[0].device_kind),
            "platform": devices[0].platform}


def save_compiled(step: CompiledStep, folder: Path) -> None:
    """Write ``step``'s executable, config, target and versions into ``folder``."""
    from jax.experimental.serialize_executable import serialize

    payload, in_tree, out_tree = serialize(step.compiled)
    executable = pickle.dumps({"payload": payload, "in_tree": in_tree, "out_tree": out_tree})
    config = yaml.safe_dump(step.run.config.to_dict(), sort_keys=False)
    manifest = {"target": step.target.name, "topology": step.target.topology,
                "slices": step.target.slices, **_devices(step.target.devices),
                "batch": {"shape": list(step.batch.shape), "dtype": str(step.batch.dtype)},
                "versions": versions(),
                "executable_sha256": hashlib.sha256(executable).hexdigest(),
                "config_sha256": hashlib.sha256(config.encode()).hexdigest()}
    with staged_folder(folder) as staging:  # whole or not at all: a full disk leaves none
        write_file(staging / EXECUTABLE, executable)
        write_file(staging / CONFIG, config)
        write_file(staging / MANIFEST, json.dumps(manifest, indent=1))


def _differences(saved: Any, now: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(now, dict):
        out = []
        for key in sorted(set(saved) | set(now)):
            out += _differences(saved.get(key), now.get(key), f"{prefix}{key}.")
        return out
    return [] if saved == now else [f"{prefix[:-1]}={now!r} (compiled with {saved!r})"]


def with_compiled_auto(folder: str | Path, config: Config) -> tuple[Config, list[str]]:
    """``config`` with each ``auto`` plan knob set to what the step saved in ``folder`` was
    compiled with (``jaxpar compile`` resolved it for its target), and a line each; as
    given when nothing is ``auto`` or the saved config cannot be read (:func:`load_compiled`
    then says why). Reads the config alone: :func:`load_compiled` checks the folder."""
    if not any(getattr(config.plan, k) == "auto" for k in AUTO_KNOBS):
        return config, []
    try:
        saved = from_dict(Config, yaml.safe_load((Path(folder) / CONFIG).read_text()))
    except (OSError, yaml.YAMLError, JaxparError, TypeError, ValueError):
        return config, []
    values = {k: getattr(saved.plan, k) for k in AUTO_KNOBS
              if getattr(config.plan, k) == "auto" and getattr(saved.plan, k) != "auto"}
    said = [f"plan.{k}=auto -> {str(v).lower()} (as compiled in {str(folder)!r})"
            for k, v in values.items()]
    return dataclasses.replace(config, plan=dataclasses.replace(config.plan, **values)), said


def load_compiled(folder: str | Path, config: Config, devices: Any) -> tuple[Any, tuple]:
    """The executable saved in ``folder`` for ``config`` on ``devices``, and the global
    batch shape it takes.

    Raises:
      JaxparError: one line, for a folder that holds no compiled step, or a damaged one
        (a file missing, cut short or garbled, or copied from another compile: the
        manifest records the executable's and the config's SHA-256), or a config, device
        set or package version that differs from the one it was compiled for.
    """
    folder = Path(folder)
    if not (folder / MANIFEST).is_file() or not (folder / EXECUTABLE).is_file():
        raise JaxparError(f"--compiled {str(folder)!r} holds no compiled step (write one "
                          "with jaxpar compile --save)")
    manifest, saved, raw = _read_folder(folder)
    changed = _differences(saved.to_dict(), config.to_dict())
    if changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise JaxparError(f"--compiled {str(folder)!r} was compiled for another config: "
                          f"{changed[0]}{more}")
    here = _devices(devices)
    for key in ("n_devices", "device_kind", "platform"):
        if manifest[key] != here[key]:
            raise JaxparError(
                f"--compiled {str(folder)!r} was compiled for {manifest['target']} "
                f"({manifest['n_devices']} {manifest['device_kind']} devices); this run has "
                f"{here['n_devices']} {here['device_kind']} devices")
    now = versions()
    for name, version in manifest["versions"].items():
        if now.get(name) != version:
            raise JaxparError(f"--compiled {str(folder)!r} was compiled with {name} "
                              f"{version}; this run has {name} {now.get(name)}: compile "
                              "it again here")
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        parts = pickle.loads(raw)
        executable = deserialize_and_load(parts["payload"], parts["in_tree"],
                                          parts["out_tree"])
    except Exception as err:  # noqa: BLE001 - any failure to read it back is a bad folder
        raise _damaged(folder, f"{EXECUTABLE} cannot be loaded ({type(err).__name__})"
                       ) from None
    return executable, tuple(manifest["batch"]["shape"])


def _damaged(folder: Path, what: str) -> JaxparError:
    return JaxparError(f"--compiled {str(folder)!r}: {what}; compile it again with "
                       f"jaxpar compile --save {str(folder)!r} --force")


def _read_folder(folder: Path) -> tuple[dict[str, Any], Config, bytes]:
    """The manifest, config and pickled executable of a ``jaxpar compile --save`` folder.

    Raises:
      JaxparError: one line, for a file missing, unreadable or not what it should be.
    """
    if not (folder / CONFIG).is_file():
        raise _damaged(folder, f"{CONFIG} is missing")
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        for key in ("target", "n_devices", "device_kind", "platform", "versions", "batch"):
            manifest[key]  # noqa: B018 - a KeyError names the missing key
        tuple(manifest["batch"]["shape"])
    except (ValueError, KeyError, TypeError) as err:
        raise _damaged(folder, f"{MANIFEST} is damaged ({type(err).__name__}: "
                               f"{(str(err) or '-').splitlines()[0]})") from None
    text = (folder / CONFIG).read_text()
    digest = manifest.get("config_sha256")
    if digest is not None and hashlib.sha256(text.encode()).hexdigest() != digest:
        raise _damaged(folder, f"{CONFIG} is not the config its {MANIFEST} was written "
                               "with (copied from another compile, or edited)")
    try:
        saved = from_dict(Config, yaml.safe_load(text))
    except (yaml.YAMLError, JaxparError, TypeError, ValueError) as err:
        first = (str(err) or type(err).__name__).splitlines()[0]
        raise _damaged(folder, f"{CONFIG} is damaged ({first})") from None
    raw = (folder / EXECUTABLE).read_bytes()
    digest = manifest.get("executable_sha256")
    if digest is not None and hashlib.sha256(raw).hexdigest() != digest:
        raise _damaged(folder, f"{EXECUTABLE} is not the executable its {MANIFEST} was "
                               "written with (copied from another compile, or cut short)")
    return manifest, saved, raw
