"""Frozen-base storage: keep the weights LoRA does not train in bfloat16 or int8.

``int8`` is QLoRA-style: every ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Einsum``
kernel is replaced by a
:class:`QuantizedProjection` holding the kernel as int8 with one float32 scale per output
channel (symmetric absmax), dequantized on the fly in compute. The quantized kernel keeps
the logical names of the weight it replaces, so it is sharded exactly like it; the scale's
input dimensions have size 1 and are unnamed (replicated). Embeddings and norms are left
as they are. ``bfloat16`` stores every frozen float matrix in bfloat16.

Both are stored as non-``nnx.Param`` variables (int8) or as ``nnx.Param`` (bf16), so a
trainer with ``trainable=nnx.LoRAParam`` leaves them out of the gradient and optimizer.

Which kernel dimensions a scale spans is read from the layer's einsum view
(:class:`~jaxpar.models.projections.ProjectionSpec`), as LoRA reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.adapters.surgery import replace_module
from jaxpar.errors import JaxparError
from jaxpar.models.projections import (
    LINEAR_SPEC,
    PROJECTION_TYPES,
    ProjectionSpec,
    letters,
    linear_general_spec,
    parse_einsum,
    stack_depth,
)
from jaxpar.sharding.annotations import logical_names

BASE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "int8")
_INT8_MAX = 127.0
STACK_AXES = frozenset({"layers", "stage", "repeat"})
"""Logical names of stacking dimensions (not part of a weight's own shape)."""


class QuantizedKernel(nnx.Variable):
    """An int8 kernel of a frozen projection (never trained: not an ``nnx.Param``)."""


class QuantScale(nnx.Variable):
    """Per-output-channel float32 scales of a :class:`QuantizedKernel`."""


def projection_spec(module: nnx.Module) -> ProjectionSpec:
    """The :class:`ProjectionSpec` of an ``nnx.Linear``, ``nnx.LinearGeneral``,
    ``nnx.Einsum`` or :class:`QuantizedProjection`."""
    if isinstance(module, QuantizedProjection):
        return parse_einsum(module.equation)
    if isinstance(module, nnx.Einsum):
        if module.einsum_str is None:
            raise JaxparError("cannot adapt an nnx.Einsum whose equation is given at call time")
        return parse_einsum(module.einsum_str)
    if isinstance(module, nnx.Linear):
        return LINEAR_SPEC
    if isinstance(module, nnx.LinearGeneral):
        return linear_general_spec(module.axis, len(module.out_features),
                                   tuple(module.batch_axis))
    raise JaxparError(f"{type(module).__name__} is not a projection (nnx.Linear, "
                      "nnx.LinearGeneral or nnx.Einsum)")



def is_tracing(x: Any) -> bool:
    """Whether ``x`` is a tracer (inside ``jit``/``eval_shape``) rather than a concrete array."""
    return isinstance(x, jax.core.Tracer)


# --- int8 storage -------------------------------------------------------------------------


def quantize_int8(w: jax.Array, in_axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax int8 quantization, one scale per slice along ``in_axes``.

    Returns ``(q, scale)`` with ``w ~= q * scale``; ``scale`` keeps ``in_axes`` as size 1.
    """
    w32 = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w32), axis=in_axes, keepdims=True)
    scale = jnp.maximum(absmax / _INT8_MAX, jnp.finfo(jnp.float32).smallest_normal)
    q = jnp.clip(jnp.round(w32 / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q, scale


class QuantizedProjection(nnx.Module):
    """A frozen ``nnx.Linear``/``nnx.LinearGeneral``/``nnx.Einsum`` whose kernel is stored
    in int8.

    The forward dequantizes (``q * scale``) in the compute dtype and runs the layer's own
    einsum; the bias (if any) is kept as it was. Works on stacked kernels (leading
    ``layers`` axis) because scales are stacked the same way.

    Attributes:
      kind: the layer it replaces: ``"linear"``, ``"linear_general"`` or ``"einsum"``.
      layout: for ``"linear_general"``, ``(in_features, out_features, axis, batch_axis)``
        (the batch axes as ``((axis, size), ...)``), to rebuild the float layer.
    """

    def __init__(self, module: nnx.Linear | nnx.LinearGeneral | nnx.Einsum):
        spec = projection_spec(module)
        kernel = module.kernel
        w = kernel.get_value()
        lead = stack_depth(w.ndim, spec)
        in_axes = tuple(lead + spec.kernel.index(c) for c in spec.in_letters)
        q, scale = quantize_int8(w, in_axes)
        names = logical_names(kernel, w.ndim)
        meta: dict[str, Any] = {}
        scale_meta: dict[str, Any] = {}
        if names is not None:
            meta["out_sharding"] = names
            scale_meta["out_sharding"] = tuple(
                None if i in in_axes else n for i, n in enumerate(names))
        with nnx.use_eager_sharding(False):
            self.kernel = QuantizedKernel(q, **meta)
            self.scale = QuantScale(scale, **scale_meta)
        self.bias = module.bias
        self.equation = spec.equation
        if isinstance(module, nnx.Einsum):
            self.kind, self.layout = "einsum", None
        elif isinstance(module, nnx.LinearGeneral):
            self.kind = "linear_general"
            self.layout = (tuple(module.in_features), tuple(module.out_features),
                           tuple(module.axis), tuple(sorted(module.batch_axis.items())))
        else:
            self.kind, self.layout = "linear", None
        self.orig_dtype = str(w.dtype)
        self.dtype = getattr(module, "dtype", None)
        self.precision = getattr(module, "precision", None)
        self.preferred_element_type = getattr(module, "preferred_element_type", None)

    @property
    def is_linear(self) -> bool:
        """Whether it replaces an ``nnx.Linear``."""
        return self.kind == "linear"

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """The kernel as floats (``q * scale``), stacked like the stored kernel."""
        return self.kernel[...].astype(dtype) * self.scale[...].astype(dtype)

    def __call__(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
        dtype = self.dtype or jnp.result_type(x.dtype, self.scale[...].dtype)
        if getattr(self, "outlier_threshold", 0.0) > 0:
            return self._llm_int8(x, dtype)
        w = self.dequantize(dtype)
        kwargs: dict[str, Any] = {}
        if self.preferred_element_type is not None:
            kwargs["preferred_element_type"] = self.preferred_element_type
        if out_sharding is not None:
            kwargs["out_sharding"] = out_sharding
        y = jnp.einsum(self.equation, x.astype(dtype), w, precision=self.precision, **kwargs)
        if self.bias is not None:
            y = y + _broadcast_bias(self.bias[...].astype(y.dtype), self.equation, w.shape,
                                    y.ndim)
        return y

    def _llm_int8(self, x: jax.Array, dtype: Any) -> jax.Array:
        """LLM.int8: the input's feature columns holding a value beyond
        ``outlier_threshold`` (in magnitude) are multiplied in the compute dtype against
        the dequantized kernel; the rest is quantized to int8 one scale per row (vector-
        wise), multiplied with the int8 kernel into int32 and rescaled by row times
        output-channel scale."""
        lhs, rhs, out = _explicit(self.equation, x.ndim)
        contracted = [c for c in rhs if c in lhs and c not in out]
        x_axes = tuple(lhs.index(c) for c in contracted)
        w_axes = tuple(rhs.index(c) for c in contracted)
        others = tuple(i for i in range(x.ndim) if i not in x_axes)
        x32 = x.astype(jnp.float32)
        outlier = jnp.max(jnp.abs(x32), axis=others, keepdims=True) > self.outlier_threshold
        regular = jnp.where(outlier, 0.0, x32)
        sx = jnp.maximum(jnp.max(jnp.abs(regular), axis=x_axes, keepdims=True) / _INT8_MAX,
                         jnp.finfo(jnp.float32).smallest_normal)
        xq = jnp.clip(jnp.round(regular / sx), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
        y = jnp.einsum(f"{lhs},{rhs}->{out}", xq, self.kernel[...],
                       preferred_element_type=jnp.int32)
        keep_x = "".join(c for c in lhs if c not in contracted)
        keep_w = "".join(c for c in rhs if c not in contracted)
        scales = jnp.einsum(f"{keep_x},{keep_w}->{out}", jnp.squeeze(sx, x_axes),
                            jnp.squeeze(self.scale[...].astype(jnp.float32), w_axes))
        wide = jnp.einsum(f"{lhs},{rhs}->{out}", jnp.where(outlier, x32, 0.0).astype(dtype),
                          self.dequantize(dtype))
        y = (y.astype(jnp.float32) * scales + wide.astype(jnp.float32)).astype(dtype)
        if self.bias is not None:
            y = y + _broadcast_bias(self.bias[...].astype(y.dtype), self.equation,
                                    self.kernel[...].shape, y.ndim)
        return y

    def to_float(self, dtype: Any = None) -> nnx.Linear | nnx.LinearGeneral | nnx.Einsum:
        """An equivalent float layer of the kind it replaced (dequantized kernel)."""
        return rebuild_projection(self, self.dequantize(dtype or self.orig_dtype))


def _explicit(equation: str, x_ndim: int) -> tuple[str, str, str]:
    """``equation``'s input, kernel and output subscripts with ``...`` spelled out for an
    input of ``x_ndim`` dimensions."""
    lhs, rest = equation.replace(" ", "").split(",")
    rhs, out = rest.split("->")
    if "..." in lhs:
        used = set(lhs + rhs + out)
        free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in used]
        dots = "".join(free[:x_ndim - len(lhs.replace("...", ""))])
        lhs, out = lhs.replace("...", dots), out.replace("...", dots)
    return lhs, rhs, out


def llm_int8(model: nnx.Module, threshold: float = 6.0,
             skip: Callable[[tuple, nnx.Variable], bool] | None = None) -> nnx.Module:
    """LLM.int8 inference, in place: every projection (but those ``skip`` exempts by
    kernel path) stored in int8 (:func:`convert_frozen`) and run as
    :meth:`QuantizedProjection._llm_int8` with outlier columns beyond ``threshold``
    (6.0, the paper's) kept in the compute dtype. Returns ``model``."""
    convert_frozen(model, "int8", skip=skip)
    for _, mod in projections(model):
        if isinstance(mod, QuantizedProjection):
            mod.outlier_threshold = float(threshold)
    return model


def _broadcast_bias(bias: jax.Array, equation: str, kernel_shape: tuple[int, ...],
                    out_ndim: int) -> jax.Array:
    spec = parse_einsum(equation)
    if spec.x.startswith("...") and spec.out.startswith("..."):
        return bias  # trailing output dims: plain broadcasting
    sizes = dict(zip(spec.kernel, kernel_shape, strict=True))
    n_ellipsis = out_ndim - len(letters(spec.out))
    shape = [sizes.get(c, 1) for c in spec.out.replace("...", "." * n_ellipsis)]
    return bias.reshape(shape)


def rebuild_projection(
    q: QuantizedProjection, kernel: jax.Array
) -> nnx.Linear | nnx.LinearGeneral | nnx.Einsum:
    """A float layer of ``q``'s original kind, equivalent to ``q`` with the given kernel."""
    spec = parse_einsum(q.equation)
    names = logical_names(q.kernel, kernel.ndim)
    meta = {} if names is None else {"out_sharding": names}
    common = dict(dtype=q.dtype, precision=q.precision,
                  preferred_element_type=q.preferred_element_type)
    with nnx.use_eager_sharding(False):
        if q.kind == "linear":
            lead = kernel.ndim - 2
            mod = nnx.eval_shape(lambda: nnx.Linear(
                kernel.shape[lead], kernel.shape[lead + 1], use_bias=False, rngs=nnx.Rngs(0),
                **common))
        elif q.kind == "linear_general":
            in_features, out_features, axis, batch_axis = q.layout
            mod = nnx.eval_shape(lambda: nnx.LinearGeneral(
                in_features, out_features, axis=axis, batch_axis=dict(batch_axis),
                use_bias=False, rngs=nnx.Rngs(0), **common))
        else:
            lead = stack_depth(kernel.ndim, spec)
            mod = nnx.eval_shape(lambda: nnx.Einsum(
                q.equation, kernel.shape[lead:], None, rngs=nnx.Rngs(0), **common))
        mod.kernel = nnx.Param(kernel, **meta)
    mod.bias = q.bias
    if q.kind != "einsum":
        mod.use_bias = q.bias is not None
    return mod


# --- converting a whole model -------------------------------------------------------------


ADAPTABLE_TYPES: tuple[type, ...] = (*PROJECTION_TYPES, QuantizedProjection)
"""Every layer LoRA can wrap: the float projections and their int8 form."""


def projections(model: nnx.Module) -> list[tuple[tuple, nnx.Module]]:
    """``(path, module)`` of every ``nnx.Linear``/``nnx.LinearGeneral``/``nnx.Einsum``/
    :class:`QuantizedProjection`."""
    return [(tuple(p), m) for p, m in nnx.iter_graph(model) if isinstance(m, ADAPTABLE_TYPES)]



def convert_frozen(
    model: nnx.Module,
    base_dtype: str,
    *,
    skip: Callable[[tuple, nnx.Variable], bool] | None = None,
) -> nnx.Module:
    """Store the frozen base of ``model`` in ``base_dtype``, in place; returns ``model``.

    ``"float32"`` leaves it alone. ``"bfloat16"`` casts every float ``nnx.Param`` that is a
    matrix (two or more dimensions besides stacking axes such as ``layers``; not
    ``nnx.LoRAParam``) to bfloat16; vectors (norm scales, biases) stay as they are. Models
    that compute in their weights' dtype then run in bfloat16. ``"int8"`` replaces every
    projection with a :class:`QuantizedProjection` (dequantized to the dtype of the
    activations and scales, so compute precision is unchanged) and leaves everything else
    (embeddings, norms) as it is. ``skip(path, variable)`` exempts variables (and
    projections, by their kernel).
    """
    if base_dtype not in BASE_DTYPES:
        raise JaxparError(f"unknown base_dtype {base_dtype!r}; choose one of {BASE_DTYPES}")
    if base_dtype == "float32":
        return model
    if base_dtype == "int8":
        for path, mod in projections(model):
            if isinstance(mod, QuantizedProjection):
                continue
            if skip is not None and skip(path + ("kernel",), mod.kernel):
                continue
            replace_module(model, path, QuantizedProjection(mod))
        return model
    for path, var in list(nnx.iter_graph(model)):
        if not isinstance(var, nnx.Param) or isinstance(var, nnx.LoRAParam):
            continue
        if skip is not None and skip(tuple(path), var):
            continue
        value = var.get_value()
        names = logical_names(var, value.ndim) or (None,) * value.ndim
        matrix_dims = sum(n not in STACK_AXES for n in names)
        if matrix_dims >= 2 and jnp.issubdtype(value.dtype, jnp.floating):
            var.set_value(value.astype(jnp.bfloat16))
    return model


def describe_storage(model: nnx.Module) -> dict[str, int]:
    """Bytes of the model's state by dtype, e.g. ``{"int8": ..., "float32": ...}``."""
    out: dict[str, int] = {}
    for _, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        if hasattr(value, "dtype") and hasattr(value, "size"):
            key = str(value.dtype)
            out[key] = out.get(key, 0) + int(value.size) * value.dtype.itemsize
    return out


__all__ = [
    "ADAPTABLE_TYPES",
    "BASE_DTYPES",
    "QuantScale",
    "QuantizedKernel",
    "QuantizedProjection",
    "convert_frozen",
    "describe_storage",
    "projection_spec",
    "projections",
    "quantize_int8",
    "rebuild_projection",
]
