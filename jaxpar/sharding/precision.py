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

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

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


def _kernel_gradient_in_f32(wrt_kernel: Any, kernel: jax.Array, g: jax.Array) -> jax.Array:
    """The float32 gradient of ``wrt_kernel`` (a matmul of float32 operands holding the
    compute dtype's values exactly) at the float32 ``kernel``: formed, and summed over the
    devices that split the contraction, in float32. A TPU's default precision multiplies
    such operands in one bf16 pass, accumulating in float32: the bf16 matmul's cost."""
    _, pull = jax.vjp(wrt_kernel, kernel)
    return pull(g.astype(jnp.float32))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _widened(matmul: Any, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``matmul(x, kernel, preferred)`` with the float32 ``kernel`` cast to ``x``'s dtype;
    its gradient for the kernel formed and summed in float32 (``matmul(a, b, None)``)."""
    return matmul(x, kernel.astype(x.dtype), True)


def _widened_fwd(matmul, x, kernel):
    return _widened(matmul, x, kernel), (x, kernel)


def _widened_bwd(matmul, residuals, g):
    x, kernel = residuals
    narrow = kernel.astype(x.dtype)
    _, pull = jax.vjp(lambda v: matmul(v, narrow, True), x)
    wide = x.astype(jnp.float32)
    return pull(g)[0], _kernel_gradient_in_f32(lambda k: matmul(wide, k, False), kernel, g)


_widened.defvjp(_widened_fwd, _widened_bwd)


def widened_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                        precision: Any = None, preferred_element_type: Any = None,
                        out_sharding: Any = None) -> jax.Array:
    """``lax.dot_general`` of an input and a float32 kernel cast to the input's dtype,
    whose gradient for the kernel is formed and summed in float32 (see
    :func:`widen_weight_gradients`)."""
    del out_sharding  # (placed by the layouts around the layer)

    def matmul(a, b, preferred):
        return jax.lax.dot_general(a, b, dimension_numbers, precision=precision,
                                   preferred_element_type=(preferred_element_type
                                                           if preferred else None))

    return _widened(matmul, lhs, rhs)


def widened_einsum(equation: str, x: jax.Array, kernel: jax.Array, precision: Any = None,
                   preferred_element_type: Any = None, out_sharding: Any = None
                   ) -> jax.Array:
    """``jnp.einsum`` of an input and a float32 kernel cast to the input's dtype, whose
    gradient for the kernel is formed and summed in float32 (see
    :func:`widen_weight_gradients`)."""
    del out_sharding

    def matmul(a, b, preferred):
        return jnp.einsum(equation, a, b, precision=precision,
                          preferred_element_type=preferred_element_type if preferred else None)

    return _widened(matmul, x, kernel)


def _projections(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    """The projection layers whose matmul is the default one (not quantized or adapted)."""
    return [(path, m) for path, m in nnx.iter_modules(model)
            if (isinstance(m, nnx.Einsum) and m.einsum_op is jnp.einsum)
            or (isinstance(m, nnx.Linear | nnx.LinearGeneral)
                and m.dot_general is jax.lax.dot_general)]


def widened_kernel_paths(model: nnx.Module) -> set[tuple]:
    """The state paths of the kernels :func:`widen_weight_gradients` keeps in float32."""
    return {(*path, "kernel") for path, _ in _projections(model)}


def widen_weight_gradients(model: nnx.Module, compute: Any) -> int:
    """Make ``model``'s projection layers (``nnx.Linear``, ``nnx.LinearGeneral``,
    ``nnx.Einsum``) take their kernels in float32 and cast them to ``compute`` inside the
    matmul, so that each kernel's gradient is formed, and summed over the devices that
    split the batch, in float32 (``plan.grad_dtype=float32``; a compiler cannot narrow
    the sum, whose result stays float32). Inputs and biases are cast to ``compute``.
    Returns how many layers were changed."""
    def promote(arrays, dtype=None):
        del dtype
        x, kernel, *rest = arrays
        return (x.astype(compute), kernel,
                *(None if b is None else b.astype(compute) for b in rest))

    layers = _projections(model)
    for _, m in layers:
        m.promote_dtype = promote
        if isinstance(m, nnx.Einsum):
            m.einsum_op = widened_einsum
        else:
            m.dot_general = widened_dot_general
    return len(layers)


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
