"""A run described in YAML: the schema (:mod:`~jaxpar.config.schema`), the whole-config
check (:mod:`~jaxpar.config.validate`) and the assembly of a run from it
(:mod:`~jaxpar.config.assembly`).
"""

from jaxpar.config.schema import Config, load_config

__all__ = ["Config", "load_config"]
