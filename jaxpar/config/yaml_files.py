"""YAML files read with one-line errors (a light module: the CLI reads a config file
before anything starts JAX)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from jaxpar.errors import JaxparError


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """The YAML document in ``path``.

    Raises:
      JaxparError: when the file is missing, unreadable or not valid YAML (with the
        ``file:line:column`` of the problem).
    """
    p = Path(path)
    if not p.exists():
        raise JaxparError(f"{what} {str(p)!r} does not exist")
    if not p.is_file():
        raise JaxparError(f"{what} {str(p)!r} is not a file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise JaxparError(f"{what} {str(p)!r} cannot be read: {err}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        context = getattr(err, "context", None)
        raise JaxparError(f"{where}: invalid YAML: {problem}"
                          + (f" ({context})" if context else "")) from None
