"""Quantized matmuls in training: int8 or fp8 forward and backward, through Qwix.

``plan.quantize`` (``none``, ``int8``, ``fp8``) makes every matmul of the model whose
module path matches ``plan.quantize_target`` and not ``plan.quantize_exclude`` run on
quantized operands, forward and backward, with Qwix's quantized-training provider (the
library MaxText trains with in int8 and fp8): both operands are scaled per channel by
their absolute maximum and rounded to the 8-bit type, the product is taken in that type
(int8 x int8 -> int32, fp8 x fp8) and rescaled; the backward pass quantizes the incoming
gradients the same way (int8, or fp8 e5m2 for the wider range gradients need). The
weights themselves stay in their stored dtype, so checkpoints, LoRA, ZeRO and every
sharding are unchanged; only the arithmetic is.

Qwix intercepts ``jax.lax.dot_general`` and ``jnp.einsum`` while a wrapped method runs and
finds the module making the call on the stack. :func:`quantized_loss` wraps the Trainer's
loss call: the user's model is held by a one-field module (``model``), so its matmuls are
matched by their path in the model, e.g. ``blocks/mlp/w_up``. Matmuls of the model's root
module (a tied output projection, the loss), of modules matching ``quantize_exclude`` (by
default embeddings, the LM head and attention modules' own score and value products,
whose projections stay included), the output head whatever it is called
(:func:`head_paths`) and LoRA's low-rank updates (an int8 or fp8 base, the adapters in the
compute dtype) run unquantized. A linen model (``jaxpar.from_linen``) quantizes its linen
module with the same rules on the linen paths (:func:`linen_provider`).
"""

from __future__ import annotations

import contextvars
import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.sharding.annotations import logical_names
from jaxpar.sharding.blocks import repeated_blocks

MODES: tuple[str, ...] = ("none", "int8", "fp8")
DEFAULT_TARGET = ".*"
DEFAULT_EXCLUDE = (r"(.*/)?(embed|embed_tokens|embedding|wte|wpe|lm_head|head|attn|attention"
                   r"|self_attn)")
"""Module paths left in the compute dtype unless the plan says otherwise: embeddings, the
output head, and attention modules' own products (scores and values; their q/k/v/o
projections are submodules and stay quantized)."""

_QTYPES = {"int8": (jnp.int8, jnp.int8), "fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}
"""Forward (weights and activations) and backward (gradients) types of each mode."""


def is_pattern(pattern: Any) -> bool:
    """Whether ``pattern`` is a string that compiles as a regular expression."""
    try:
        re.compile(pattern)
    except (re.error, TypeError):
        return False
    return True


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`."""
    if mode not in MODES:
        raise JaxparError(f"quantize={mode!r}: choose one of {list(MODES)}")
    return mode


def batched(einsum_str: str, n_operands: int) -> bool:
    """Whether an einsum multiplies anything but an activation by a weight: more or fewer
    than two operands, or a label both operands and the result carry (a batch dimension:
    attention's scores and values, a state-space scan), or operands that both broadcast
    (``...``)."""
    if n_operands != 2:
        return True
    inputs, _, output = einsum_str.replace(" ", "").partition("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        return True
    if "..." in parts[0] and "..." in parts[1]:
        return True
    a, b = (set(p.replace("...", "")) for p in parts)
    if not output and "->" not in einsum_str:  # implicit: the labels seen once
        output = "".join(sorted(c for c in a ^ b))
    return bool(a & b & set(output))


def _weight_matmul_provider():
    """Qwix's quantized-training provider, restricted to weight matmuls: a
    ``dot_general`` with batch dimensions, or an einsum :func:`batched` calls one, runs
    in the compute dtype whatever the rules say (no weight is in it)."""
    import jax
    import qwix

    def typed(plain, quantized, *operands):
        """``quantized(*operands)``; on operands with explicit sharding types, run with the
        mesh's axes automatic (Qwix's scaled products take no ``out_sharding``) and its
        result given the type ``plain``, the unquantized product, would have: the
        product is quantized where its operands lie and lands where the model asked."""
        if not any(jax.typeof(a).sharding.mesh._any_axis_explicit for a in operands):
            return quantized(*operands)
        want = jax.typeof(jax.eval_shape(plain, *operands)).sharding.spec
        return jax.sharding.auto_axes(quantized, out_sharding=want)(*operands)

    class WeightMatmuls(qwix.QtProvider):
        def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, *, out_sharding=None):
            (_, _), (lhs_batch, rhs_batch) = dimension_numbers
            plain = functools.partial(jax.lax.dot_general, dimension_numbers=dimension_numbers,
                                      precision=precision,
                                      preferred_element_type=preferred_element_type,
                                      out_sharding=out_sharding)
            if lhs_batch or rhs_batch:
                return plain(lhs, rhs)
            parent = super().dot_general
            return typed(plain, lambda a, b: parent(a, b, dimension_numbers, precision,
                                                    preferred_element_type), lhs, rhs)

        def einsum(self, einsum_str, *operands, **kwargs):
            plain = functools.partial(jnp.einsum, einsum_str, **kwargs)
            if batched(einsum_str, len(operands)):
                return plain(*operands)
            parent = super().einsum
            rest = {k: v for k, v in kwargs.items() if k != "out_sharding"}
            return typed(plain, lambda *ops: parent(einsum_str, *ops, **rest), *operands)

    return WeightMatmuls


@functools.cache
def provider(mode: str, target: str = DEFAULT_TARGET, exclude: str = DEFAULT_EXCLUDE):
    """The Qwix quantized-training provider for ``mode`` (None for ``none``): rules in
    order, the first whose path matches wins: the root module, then ``exclude``, stay
    in full precision; ``target`` is quantized. Only weight matmuls are: products with a
    batch dimension (attention's, a state-space einsum's) never are."""
    import qwix  # imported on use: runs without quantization never load it

    if check_mode(mode) == "none":
        return None
    forward, backward = _QTYPES[mode]
    ops = ("dot_general", "einsum")
    return _weight_matmul_provider()([
        qwix.QtRule(module_path="model"),
        qwix.QtRule(module_path=f"model/(?:{exclude})"),
        qwix.QtRule(module_path=f"model/(?:{target})", weight_qtype=forward,
                    act_qtype=forward, bwd_qtype=backward, op_names=ops),
    ])


@functools.cache
def linen_rules_provider(mode: str, target: str = DEFAULT_TARGET,
                         exclude: str = DEFAULT_EXCLUDE):
    """:func:`provider` for a linen module's own paths (``h_0/mlp/fc``, no ``model/``
    prefix), which a linen model applies itself (see :func:`linen_provider`)."""
    import qwix

    forward, backward = _QTYPES[check_mode(mode)]
    return _weight_matmul_provider()([
        qwix.QtRule(module_path=""),
        qwix.QtRule(module_path=f"(?:{exclude})"),
        qwix.QtRule(module_path=f"(?:{target})", weight_qtype=forward, act_qtype=forward,
                    bwd_qtype=backward, op_names=("dot_general", "einsum")),
    ])


_LINEN_PROVIDER: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxpar_linen_quantization", default=None)


def linen_provider() -> Any:
    """The Qwix provider a linen model (:class:`jaxpar.models.linen.LinenModel`) quantizes
    its linen module with while :func:`quantized_loss` runs, else None. Qwix finds the
    module making a matmul among NNX modules only, so a linen model applies
    ``qwix.quantize_model`` to its linen module itself."""
    return _LINEN_PROVIDER.get()


def head_paths(model: nnx.Module) -> tuple[str, ...]:
    """Paths of the modules that project to the vocabulary: their parameters carry the
    logical name ``vocab``, or (in a model with no such names) a weight outside the
    repeated blocks has a last dimension of an ``nnx.Embed``'s number of rows.
    Embeddings themselves are not listed. For a linen model, its linen module paths
    (from :meth:`head_paths` of the model)."""
    own = getattr(model, "head_paths", None)
    if callable(own):
        return tuple(own())
    params = []  # (module path, module, parameter) of every parameter
    for path, module in nnx.iter_modules(model):
        for var in vars(module).values():
            if isinstance(var, nnx.Param) and not isinstance(module, nnx.Embed):
                params.append((tuple(str(k) for k in path), module, var))
    ndim = lambda var: getattr(var.get_value(), "ndim", 0)
    found = {p for p, _, v in params if "vocab" in (logical_names(v, ndim(v)) or ())}
    if not found:
        rows = {m.num_embeddings for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Embed)}
        blocks = [tuple(path.split("/")) for path, _ in repeated_blocks(model)]
        found = {p for p, _, v in params if ndim(v) >= 2 and v.get_value().shape[-1] in rows
                 and not any(p[:len(b)] == b for b in blocks)}
    return tuple(sorted("/".join(p) for p in found if p))


def quantized_paths(model: nnx.Module, target: str = DEFAULT_TARGET,
                    exclude: str = DEFAULT_EXCLUDE) -> list[str]:
    """Paths of the modules holding a weight matrix whose matmuls the rules quantize
    (``target`` matches the path, ``exclude`` does not, as Qwix matches them): empty
    means ``plan.quantize`` would change nothing in this model."""
    paths = set()
    for path, module in nnx.iter_modules(model):
        if path and any(isinstance(v, nnx.Param) and getattr(v.get_value(), "ndim", 0) >= 2
                        for v in vars(module).values()):
            paths.add("/".join(str(p) for p in path))
    own = getattr(model, "projection_paths", None)  # a linen model's own layers
    if callable(own):
        paths.update(own())
    left_out = f"(?:{exclude})|" + "|".join(re.escape(p) for p in head_paths(model))
    return sorted(p for p in paths if re.fullmatch(f"(?:{target})", p)
                  and not re.fullmatch(left_out.rstrip("|"), p))


def _adapter_paths(model: nnx.Module) -> tuple[str, ...]:
    """Paths of the modules holding ``nnx.LoRAParam`` s themselves (LoRA wrappers): their
    own products, the low-rank update, stay in the compute dtype; the wrapped base
    projection, a submodule, is quantized like any other."""
    found = set()
    for path, module in nnx.iter_modules(model):
        if any(isinstance(v, nnx.LoRAParam) for v in vars(module).values()):
            found.add("/".join(str(p) for p in path))
    return tuple(sorted(found))


class _Holder(nnx.Module):
    """The user's model under one field, so Qwix sees its modules at ``model/<path>``."""

    def __init__(self, model: nnx.Module, call: Callable[[nnx.Module], Any]):
        self.model = model
        self.call = call

    def __call__(self, marker: Any = None) -> Any:
        return self.call(self.model)


def quantized_loss(model: nnx.Module, call: Callable[[nnx.Module], Any], mode: str,
                   target: str = DEFAULT_TARGET, exclude: str = DEFAULT_EXCLUDE,
                   carried: Any = None) -> Any:
    """``call(model)`` (a loss, say) with the matmuls ``mode`` quantizes; a plain call for
    ``none``. State the call changed in the model (``carried``, an nnx filter; default
    everything but parameters: dropout counters, batch statistics) is written back to
    ``model``."""
    if check_mode(mode) == "none":
        return call(model)
    left_out = (*_adapter_paths(model), *head_paths(model))
    if left_out:
        exclude = f"(?:{exclude})|" + "|".join(re.escape(p) for p in left_out)
    prov = provider(mode, target, exclude)
    import qwix

    token = _LINEN_PROVIDER.set(linen_rules_provider(mode, target, exclude))
    try:
        with warnings.catch_warnings():  # Qwix 0.1.8 uses Flax APIs that 0.12 deprecates
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"qwix\.")
            holder = qwix.quantize_model(_Holder(model, call), prov, 0, skip_nnx_init=True)
            out = holder()
    finally:
        _LINEN_PROVIDER.reset(token)
    changed = nnx.state(holder.model, carried if carried is not None else nnx.Not(nnx.Param))
    if changed:
        nnx.update(model, changed)
    return out
