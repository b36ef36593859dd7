"""A run described in YAML: the schema (:mod:`~jaxpar.config.schema`), the whole-config
check (:mod:`~jaxpar.config.validate`) and the assembly of a run from it
(:mod:`~jaxpar.config.assembly`).
"""

from typing import Any

__all__ = ["Config", "load_config"]


def __getattr__(name: str) -> Any:  # the schema imports JAX: only when it is used
    if name in __all__:
        from jaxpar.config import schema

        return getattr(schema, name)
    raise AttributeError(f"module 'jaxpar.config' has no attribute {name!r}")
