"""Reference models, annotated with logical axis names."""

from typing import Any

__all__ = ["Block", "Transformer", "TransformerConfig"]


def __getattr__(name: str) -> Any:  # imported on use: configs need no model code
    if name in ("Block", "Transformer"):
        from jaxpar.models import transformer

        return getattr(transformer, name)
    if name == "TransformerConfig":
        from jaxpar.models.config import TransformerConfig

        return TransformerConfig
    raise AttributeError(f"module 'jaxpar.models' has no attribute {name!r}")
