"""LoRA's config and its adapter layer: a projection plus a low-rank update sharded like
the kernel it adapts (see :mod:`jaxpar.adapters.lora`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpar.adapters import quant
from jaxpar.errors import JaxparError
from jaxpar.models import projections
from jaxpar.sharding.annotations import logical_names

DEFAULT_TARGET = r"(attn/w[qkvo]|mlp/w_(gate|up|down))$"
"""Attention (q, k, v, o) and MLP (gate, up, down) projections of the reference model."""

RANK_AXIS = "lora_rank"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The ``lora`` section of a run config.

    Attributes:
      enabled: whether to fine-tune with adapters at all.
      target: regex searched in each projection's module path (``blocks/attn/wq``).
      rank: adapter rank ``r``.
      alpha: scaling numerator; the update is ``B @ A * alpha / rank``.
      dropout: dropout rate on the adapter input (0 disables it).
      base_dtype: storage of the frozen base: ``float32``, ``bfloat16`` or ``int8``.
    """

    enabled: bool = False
    target: str = DEFAULT_TARGET
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    base_dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_args(self.target, self.rank, self.dropout, "lora.")
        if self.base_dtype not in quant.BASE_DTYPES:
            raise JaxparError(f"lora.base_dtype={self.base_dtype!r}; choose one of "
                              f"{quant.BASE_DTYPES}")


def _check_args(target: str, rank: int, dropout: float, prefix: str = "") -> re.Pattern:
    if rank <= 0:
        raise JaxparError(f"{prefix}rank={rank}: must be at least 1")
    if not 0.0 <= dropout < 1.0:
        raise JaxparError(f"{prefix}dropout={dropout}: must be a fraction in [0, 1)")
    try:
        return re.compile(target)
    except re.error as e:
        raise JaxparError(f"{prefix}target={target!r}: is not a valid regular expression "
                          f"({e})") from None


class LoraDropoutKey(nnx.Variable):
    """Raw key data of an adapter's dropout stream (stacked like the adapter)."""


class LoraDropoutCount(nnx.RngCount):
    """Counter folded into the dropout key, advanced by each call (an RNG counter, so
    whatever carries ``nnx.RngCount`` state across steps or scans carries it too)."""


def _strip(sub: str, letters: str) -> str:
    return "".join(c for c in sub if c not in letters)


class LoraProjection(nnx.Module):
    """A projection plus a low-rank update: ``base(x) + dropout(x) @ A @ B * alpha / rank``.

    Attribute reads it cannot answer itself (``kernel``, ``in_features``, ``use_bias``,
    ...) are forwarded to ``base``, so model code written against the plain layer keeps
    working after LoRA wraps it; assignments are not forwarded.

    Attributes:
      base: the wrapped ``nnx.Linear``/``nnx.LinearGeneral``/``nnx.Einsum`` (or its int8
        :class:`~jaxpar.adapters.quant.QuantizedProjection`), unchanged.
      lora_a: ``nnx.LoRAParam`` of shape ``(*stack, *shared, *in_dims, rank)``.
      lora_b: ``nnx.LoRAParam`` of shape ``(*stack, *shared, rank, *out_dims)``, zero at init.
      deterministic: disables dropout (set by ``model.eval()`` / ``model.train()``).
    """

    def __init__(self, base: nnx.Module, *, rank: int, alpha: float, dropout: float = 0.0,
                 key: jax.Array):
        spec = quant.projection_spec(base)
        kernel = base.kernel
        w = kernel.get_value()
        lead = projections.stack_depth(w.ndim, spec)
        names = logical_names(kernel, w.ndim) or (None,) * w.ndim
        sizes = dict(zip(spec.kernel, w.shape[lead:], strict=True))
        kname = dict(zip(spec.kernel, names[lead:], strict=True))
        stack_shape, stack_names = tuple(w.shape[:lead]), tuple(names[:lead])
        a_letters = spec.shared + spec.in_letters
        a_shape = stack_shape + tuple(sizes[c] for c in a_letters) + (rank,)
        a_names = stack_names + tuple(kname[c] for c in a_letters) + (RANK_AXIS,)
        b_shape = (stack_shape + tuple(sizes[c] for c in spec.shared) + (rank,)
                   + tuple(sizes[c] for c in spec.out_letters))
        b_names = (stack_names + tuple(kname[c] for c in spec.shared) + (RANK_AXIS,)
                   + tuple(kname[c] for c in spec.out_letters))
        fan_in = math.prod(sizes[c] for c in spec.in_letters)
        dtype = getattr(base, "param_dtype", jnp.float32)
        if not jnp.issubdtype(dtype, jnp.floating):
            dtype = jnp.float32
        k_a, k_drop = jax.random.split(key)
        a = jax.random.normal(k_a, a_shape, jnp.float32) / math.sqrt(fan_in)
        annotated = any(n is not None for n in names)
        with nnx.use_eager_sharding(False):
            self.lora_a = nnx.LoRAParam(
                a.astype(dtype), **({"out_sharding": a_names} if annotated else {}))
            self.lora_b = nnx.LoRAParam(
                jnp.zeros(b_shape, dtype), **({"out_sharding": b_names} if annotated else {}))
            if dropout > 0:
                n = max(math.prod(stack_shape), 1)
                data = jax.random.key_data(jax.random.split(k_drop, n))
                self.dropout_key = LoraDropoutKey(data.reshape(stack_shape + data.shape[1:]))
                self.dropout_count = LoraDropoutCount(jnp.zeros(stack_shape, jnp.int32))
        self.base = base
        self.rank = rank
        self.alpha = float(alpha)
        self.dropout = float(dropout)
        self.deterministic = False
        r = spec.free_letters(1)
        t = _strip(spec.x, spec.in_letters) + r
        self.equation_a = f"{spec.x},{a_letters}{r}->{t}"
        self.equation_b = f"{t},{spec.shared}{r}{spec.out_letters}->{spec.out}"

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails. Private and dunder names are never
        # forwarded (pickling, copying and NNX's graph machinery probe for those), and
        # nothing is forwarded before ``base`` exists (e.g. while NNX rebuilds the node).
        base = vars(self).get("base") if not name.startswith("_") else None
        if base is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(base, name)

    def _dropout(self, x: jax.Array) -> jax.Array:
        if self.dropout <= 0 or self.deterministic:
            return x
        key = jax.random.wrap_key_data(self.dropout_key[...])
        count = self.dropout_count[...]
        key = jax.random.fold_in(key, count)
        keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
        # Each call draws a new mask, as nnx.Dropout does; the Trainer keeps the counter.
        self.dropout_count.set_value(count + 1)
        return jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x))

    def delta(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
        """The adapter's contribution ``dropout(x) @ A @ B * alpha / rank``.

        On an explicit-sharding mesh the low-rank product keeps ``x``'s sharding on the
        dimensions it does not contract (the rank is never split), and the result takes
        ``out_sharding``, the one the model asked of the base projection; with neither,
        JAX would refuse an einsum over a sharded contraction as ambiguous."""
        a, b = self.lora_a[...], self.lora_b[...]
        dtype = jnp.result_type(x.dtype, a.dtype)
        mid = _low_rank_sharding(x, self.equation_a)
        t = jnp.einsum(self.equation_a, self._dropout(x).astype(dtype), a.astype(dtype),
                       **({"out_sharding": mid} if mid is not None else {}))
        kw = {"out_sharding": out_sharding} if out_sharding is not None and mid else {}
        return jnp.einsum(self.equation_b, t, b.astype(dtype), **kw) * self.scale

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        y = self.base(x, *args, **kwargs)
        return y + self.delta(x, kwargs.get("out_sharding")).astype(y.dtype)

    def weight_delta(self) -> jax.Array:
        """``A @ B * alpha / rank`` laid out like the base kernel (stacked if it is)."""
        spec = quant.projection_spec(self.base)
        a = self.lora_a[...].astype(jnp.float32)
        lead = a.ndim - len(spec.shared) - len(spec.in_letters) - 1
        free = spec.free_letters(lead + 1)
        s, r = free[:lead], free[lead]
        eq = (f"{s}{spec.shared}{spec.in_letters}{r},{s}{spec.shared}{r}{spec.out_letters}"
              f"->{s}{spec.kernel}")
        return jnp.einsum(eq, a, self.lora_b[...].astype(jnp.float32)) * self.scale


def _low_rank_sharding(x: jax.Array, equation: str) -> P | None:
    """On an explicit mesh, the sharding of ``einsum(equation, x, A)``: ``x``'s own on the
    dimensions kept, nothing on the rank; None where the mesh is not explicit (GSPMD
    places the product itself)."""
    try:
        sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    x_subs, rest = equation.split(",", 1)
    out_subs = rest.split("->", 1)[1]
    named = x_subs.replace("...", "")
    labels = list(x_subs.replace("...", "." * (x.ndim - len(named))))
    by_letter = {c: spec[i] for i, c in enumerate(labels) if c != "."}
    lead = [spec[i] for i, c in enumerate(labels) if c == "."]
    out: list[Any] = []
    for c in out_subs.replace("...", "."):
        out.extend(lead if c == "." else [by_letter.get(c)])
    return P(*out)
