"""Sharded checkpoints: save, resume and restore into any plan.

:class:`~jaxpar.checkpoint.checkpointer.Checkpointer` writes and restores a trainer's
state with orbax; :mod:`~jaxpar.checkpoint.reshard` matches saved arrays to a new layout.
"""

from jaxpar.checkpoint.checkpointer import Checkpointer, load_weights

__all__ = ["Checkpointer", "load_weights"]
