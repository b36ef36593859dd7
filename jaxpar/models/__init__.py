"""Reference models, annotated with logical axis names."""

from jaxpar.models.transformer import Block, Transformer, TransformerConfig

__all__ = ["Block", "Transformer", "TransformerConfig"]
