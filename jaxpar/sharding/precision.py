"""Mixed-precision policies and dynamic loss scaling.

A :class:`Policy` names three dtypes, jmp-style: ``params`` (how master weights are
stored), ``compute`` (what the forward and backward passes run in) and ``output`` (what the
model's outputs are cast to before the loss). It is written as a string such as
``"params=float32,compute=bfloat16,output=float32"`` or ``"p=f32,c=bf16,o=f32"``.

With ``compute=float16`` the trainer also applies :class:`DynamicLossScale`: the loss is
multiplied by the scale, gradients divided by it; a step whose gradients are not finite is
skipped (parameters and optimizer state unchanged) and the scale halved; after
``period`` finite steps in a row the scale doubles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.errors import JaxparError

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16, "float16": jnp.float16, "f16": jnp.float16}
_KEYS = {"params": "params", "p": "params", "compute": "compute", "c": "compute",
         "output": "output", "o": "output"}


@dataclass(frozen=True)
class Policy:
    """Dtypes of master parameters, compute, and outputs."""

    params: Any = jnp.float32
    compute: Any = jnp.float32
    output: Any = jnp.float32

    @classmethod
    def parse(cls, text: str) -> Policy:
        """Parse ``"params=float32,compute=bfloat16,output=float32"`` (or ``p=f32,c=bf16``)."""
        fields: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key.strip() not in _KEYS or value.strip() not in _DTYPES:
                raise JaxparError(
                    f"bad precision policy part {part!r} in {text!r}; expected "
                    f"params|compute|output (or p|c|o) = one of {sorted(set(_DTYPES))}"
                )
            fields[_KEYS[key.strip()]] = _DTYPES[value.strip()]
        return cls(**fields)

    def __str__(self) -> str:
        name = lambda d: jnp.dtype(d).name
        return f"params={name(self.params)},compute={name(self.compute)},output={name(self.output)}"

    @property
    def mixed(self) -> bool:
        """True when compute runs in a narrower dtype than the master weights."""
        return jnp.dtype(self.compute) != jnp.dtype(self.params)

    @property
    def needs_loss_scaling(self) -> bool:
        """float16 compute underflows without loss scaling."""
        return jnp.dtype(self.compute) == jnp.float16

    def cast_to_compute(self, tree: Any) -> Any:
        """Cast floating-point leaves to the compute dtype."""
        return _cast_floats(tree, self.compute)

    def narrow_to_compute(self, tree: Any) -> Any:
        """Cast floating-point leaves wider than the compute dtype down to it, never up: a
        frozen base stored in bf16 stays bf16 under an f32 policy."""
        width = jnp.dtype(self.compute).itemsize

        def cast(x):
            floating = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
            return x.astype(self.compute) if floating and x.dtype.itemsize > width else x

        return jax.tree.map(cast, tree)

    def cast_to_params(self, tree: Any) -> Any:
        """Cast floating-point leaves to the parameter dtype."""
        return _cast_floats(tree, self.params)

    def cast_to_output(self, tree: Any) -> Any:
        """Cast floating-point leaves to the output dtype."""
        return _cast_floats(tree, self.output)


def _cast_floats(tree: Any, dtype: Any) -> Any:
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


@dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling for float16 training.

    The state is a dict ``{"scale": f32 scalar, "good_steps": i32 scalar}`` carried in the
    trainer state, so it survives checkpoints and stays functional under ``jax.jit``.
    """

    initial: float = 2.0**15
    period: int = 2000
    factor: float = 2.0
    minimum: float = 1.0

    def init(self) -> dict[str, jax.Array]:
        """The starting state."""
        return {"scale": jnp.asarray(self.initial, jnp.float32),
                "good_steps": jnp.zeros((), jnp.int32)}

    @staticmethod
    def all_finite(tree: Any) -> jax.Array:
        """True when every element of every leaf is finite."""
        leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
        return jnp.stack(leaves).all() if leaves else jnp.asarray(True)

    def adjust(self, state: dict[str, jax.Array], finite: jax.Array) -> dict[str, jax.Array]:
        """Next state: grow after ``period`` finite steps, halve on a non-finite one."""
        good = jnp.where(finite, state["good_steps"] + 1, 0)
        grow = good >= self.period
        scale = jnp.where(finite, jnp.where(grow, state["scale"] * self.factor, state["scale"]),
                          jnp.maximum(state["scale"] / self.factor, self.minimum))
        return {"scale": scale, "good_steps": jnp.where(grow, 0, good).astype(jnp.int32)}
