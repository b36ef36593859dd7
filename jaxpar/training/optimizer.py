"""The optimizer of a run: AdamW (or Adam, SGD, Lion, Adafactor) behind global-norm
clipping, on a linear-warmup, cosine-decay learning-rate schedule.

Both functions take any object with the fields of the config's ``train`` section
(:class:`OptimizerSettings`), so this module knows nothing of configs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from jaxpar.errors import JaxparError
from jaxpar.sharding.paths import key_str

OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "lion", "adafactor")
"""Values of ``train.optimizer``."""


class OptimizerSettings(Protocol):
    """What :func:`make_optimizer` reads (``train.*`` in a config)."""

    optimizer: str
    lr: float
    warmup_steps: int
    steps: int
    weight_decay: float
    grad_clip: float


def learning_rate(cfg: OptimizerSettings) -> optax.Schedule:
    """The learning-rate schedule: linear warmup to ``train.lr``, cosine decay to a tenth."""
    warmup = max(cfg.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.lr * 0.1,
    )


def _decays(path: tuple, param: Any) -> bool:
    """Weight decay applies to matrices, not to norm scales or biases, which stay vectors
    per layer even when the layers are stacked into one array (so ``ndim`` cannot tell)."""
    names = [key_str(k) for k in path]
    while names and names[-1] == "value":  # an nnx.Variable's own leaf
        names.pop()
    return (param.ndim >= 2 and bool(names) and names[-1] not in ("scale", "bias")
            and not any("norm" in n for n in names))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """Gradients scaled by ``min(1, max_norm / global norm)``: ``optax.clip_by_global_norm``'s
    result (to rounding), as one scalar factor the optimizer's update multiplies in, where
    optax selects between the gradient and a divided copy per element, a pass over every
    gradient that XLA:CPU does not fuse into the update (``benchmarks/overhead.py --clip``
    measures the difference).

    The norm is the gradients' own unless the update is given ``global_norm`` (an extra
    argument): the streamed update of offloaded state (:mod:`jaxpar.parallel.
    streamed_update`) applies the optimizer to a slab of the gradients at a time and
    passes the norm of all of them."""
    def update(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        factor = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def make_optimizer(cfg: OptimizerSettings) -> optax.GradientTransformation:
    """Optimizer from the config: warmup + cosine schedule, global-norm clipping."""
    schedule = learning_rate(cfg)
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(_decays, params)
    makers: dict[str, Callable[[], optax.GradientTransformation]] = {
        "adamw": lambda: optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask),
        "adam": lambda: optax.adam(schedule),
        "sgd": lambda: optax.sgd(schedule, momentum=0.9),
        "lion": lambda: optax.lion(schedule, weight_decay=cfg.weight_decay, mask=decay_mask),
        "adafactor": lambda: optax.adafactor(schedule),
    }
    if cfg.optimizer not in makers:
        raise JaxparError(
            f"unknown train.optimizer {cfg.optimizer!r}; choose from {list(OPTIMIZERS)}"
        )
    parts = [clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    return optax.chain(*parts, makers[cfg.optimizer]())
