"""LoRA the SPMD way: low-rank adapters placed by a path filter, sharded like their weights.

:func:`apply` wraps every ``nnx.Linear``/``nnx.LinearGeneral``/``nnx.Einsum`` whose module
path matches a regex in a :class:`LoraProjection`: ``y = base(x) + (dropout(x) @ A @ B) *
alpha / rank``, with ``A`` (input dims x rank) random and ``B`` (rank x output dims) zero,
both ``nnx.LoRAParam``. Which kernel dimensions are "input" and "output" is read from the
layer's einsum (``nnx.Linear`` is ``...i,io->...o``; ``enh`` in ``bse,enh->bsnh`` splits
into input ``e`` and output ``nh``; an ``nnx.LinearGeneral``'s comes from its ``axis``),
so multi-dimensional projections, such as all four of ``nnx.MultiHeadAttention``, work
unchanged. A matched module that holds parameters but is none of these (``nnx.Conv``,
``nnx.Embed``, a norm) is an error, never skipped silently; model code reading the
wrapped layer's attributes (``proj.kernel.shape``, ``proj.in_features``) keeps working.

The adapters carry the base kernel's logical names (``A``: its input names plus
``"lora_rank"``; ``B``: ``"lora_rank"`` plus its output names, every rules preset maps
``lora_rank`` to None), so the plan shards them like the weights they adapt with no extra
annotation. Layers stacked with a leading ``layers`` axis (``nnx.vmap``) get adapters
stacked the same way, and scan with their blocks.

Train them with ``jaxpar.Trainer(model, opt, plan, trainable=nnx.LoRAParam)`` (or
:func:`trainable_filter`): gradients and optimizer state then exist for the adapters
only. :func:`merge` folds them into the base weights; :func:`save_adapters` /
:func:`load_adapters` checkpoint them alone with orbax. The frozen base can be stored in
bfloat16 or int8 (see :mod:`jaxpar.quant`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpar import quant
from jaxpar.annotate import logical_names
from jaxpar.errors import JaxparError
from jaxpar.linen import LinenModel
from jaxpar.partitioning import path_str, state_shardings
from jaxpar.plan import Plan, current_plan

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
        :class:`~jaxpar.quant.QuantizedProjection`), unchanged.
      lora_a: ``nnx.LoRAParam`` of shape ``(*stack, *shared, *in_dims, rank)``.
      lora_b: ``nnx.LoRAParam`` of shape ``(*stack, *shared, rank, *out_dims)``, zero at init.
      deterministic: disables dropout (set by ``model.eval()`` / ``model.train()``).
    """

    def __init__(self, base: nnx.Module, *, rank: int, alpha: float, dropout: float = 0.0,
                 key: jax.Array):
        spec = quant.projection_spec(base)
        kernel = base.kernel
        w = kernel.get_value()
        lead = quant.stack_depth(w.ndim, spec)
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


# --- applying, finding, merging -----------------------------------------------------------


def adapted(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """``(path, module)`` of every adapter in ``model``: each :class:`LoraProjection`, and
    a linen model's adapters by their linen path (:mod:`jaxpar.linen`)."""
    found = [(path_str(p), m) for p, m in nnx.iter_graph(model)
             if isinstance(m, LoraProjection)]
    if isinstance(model, LinenModel):
        found += [(f"linen/{p}", m) for p, m in model.adapters.items()]
    return found


def _shown(path: tuple) -> str:
    return path_str(path) or "<root>"


def _scan(model: nnx.Module) -> tuple[list[tuple[tuple, nnx.Module]],
                                      list[tuple[tuple, nnx.Module]]]:
    """``(adaptable, others)``: the projections not yet adapted, and every other module
    that holds an ``nnx.Param`` itself (through plain attributes, lists or dicts, not
    through a child module). Adapters and what they wrap are in neither list."""
    nodes = [(tuple(p), n) for p, n in nnx.iter_graph(model)]
    modules = {p: n for p, n in nodes if isinstance(n, nnx.Module)}
    wrapped = [p for p, m in modules.items() if isinstance(m, LoraProjection)]

    def inside(path: tuple) -> bool:
        return any(path[:len(w)] == w for w in wrapped)

    owners = set()
    for path, node in nodes:
        if isinstance(node, nnx.Param) and not inside(path):
            owners.add(next((path[:k] for k in range(len(path) - 1, -1, -1)
                             if path[:k] in modules), None))
    adaptable = [(p, m) for p, m in modules.items()
                 if isinstance(m, quant.ADAPTABLE_TYPES) and not inside(p)]
    others = [(p, m) for p, m in modules.items()
              if p in owners and not isinstance(m, quant.ADAPTABLE_TYPES)]
    return adaptable, others


def apply(
    model: nnx.Module,
    target: str = DEFAULT_TARGET,
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    *,
    rngs: nnx.Rngs | int = 0,
    base_dtype: str = "float32",
    plan: Plan | None = None,
) -> nnx.Module:
    """Add LoRA adapters to every projection of ``model`` whose path matches ``target``.

    Works in place and returns ``model``. Usable on a concrete (already sharded) model or
    inside a factory given to :func:`jaxpar.init_sharded`, so adapters are born sharded.

    Args:
      model: any Flax NNX model with ``nnx.Linear``/``nnx.LinearGeneral``/``nnx.Einsum``
        projections.
      target: regex searched (``re.search``) in module paths like ``blocks/attn/wq``.
        Container modules it matches (those holding no parameter themselves, such as an
        ``nnx.MultiHeadAttention`` at ``attn``) are passed over; their projections are
        matched by their own paths.
      rank: adapter rank ``r``.
      alpha: the update is scaled by ``alpha / rank``.
      dropout: dropout rate on the adapter input (0 disables it).
      rngs: seed or ``nnx.Rngs`` for ``A``'s initialisation (and the dropout stream).
      base_dtype: store the frozen base as ``float32``, ``bfloat16`` or ``int8``
        (see :func:`jaxpar.quant.convert_frozen`).
      plan: place the new variables by this plan's rules (default: the active plan, if
        any; skipped while tracing).

    Raises:
      JaxparError: if ``target`` matches no projection (the message lists them all), if
        it matches a module that holds parameters but cannot be adapted (``nnx.Conv``,
        ``nnx.Embed``, a norm; the message lists those and the adaptable paths), or for a
        bad rank, dropout, regex or base_dtype; the model is left unchanged.
    """
    pattern = _check_args(target, rank, dropout)
    if isinstance(model, LinenModel):  # linen projections, adapted by interception
        if dropout or base_dtype != "float32":
            raise JaxparError("LoRA on a linen model takes no dropout or base_dtype (its "
                              "adapters are added to the linen layers' outputs as they run)")
        key = rngs.params() if isinstance(rngs, nnx.Rngs) else jax.random.key(rngs)
        model.add_adapters(target, rank, alpha, key)
        return place(model, plan)
    if base_dtype not in quant.BASE_DTYPES:
        raise JaxparError(f"unknown base_dtype {base_dtype!r}; choose one of "
                          f"{quant.BASE_DTYPES}")
    candidates, others = _scan(model)
    chosen = [(p, m) for p, m in candidates if pattern.search(path_str(p))]
    available = [_shown(p) for p, _ in candidates]
    bad = [f"{_shown(p)} ({type(m).__module__}.{type(m).__qualname__})"
           for p, m in others if pattern.search(path_str(p))]
    if bad:
        raise JaxparError(
            f"LoRA target {target!r} matches modules that hold parameters but are not "
            f"projections LoRA can adapt (nnx.Linear, nnx.LinearGeneral, nnx.Einsum): "
            f"{', '.join(bad)}; narrow the regex (e.g. anchor it with '$'). Adaptable "
            f"paths: {available}"
        )
    if not chosen:
        done = [p for p, _ in adapted(model)]
        raise JaxparError(
            f"LoRA target {target!r} matches no projection; available paths: {available}"
            + (f"; already adapted: {done}" if done else "")
        )
    if any(not p for p, _ in chosen):
        raise JaxparError("cannot adapt the root module itself; wrap it in a parent module")
    wrappers = []  # all built before the model changes, so a layer that fails leaves it intact
    for i, (_, module) in enumerate(chosen):
        if isinstance(rngs, nnx.Rngs):
            key = rngs.params()
        else:
            key = jax.random.fold_in(jax.random.key(rngs), i)
        wrappers.append(LoraProjection(module, rank=rank, alpha=alpha, dropout=dropout,
                                       key=key))
    for (path, _), wrapper in zip(chosen, wrappers, strict=True):
        quant.replace_module(model, path, wrapper)
    quant.convert_frozen(model, base_dtype)
    return place(model, plan)


def apply_config(model: nnx.Module, config: LoraConfig, *, rngs: nnx.Rngs | int = 0,
                 plan: Plan | None = None) -> nnx.Module:
    """:func:`apply` with the settings of a :class:`LoraConfig` (no-op if not enabled)."""
    if not config.enabled:
        return model
    return apply(model, config.target, config.rank, config.alpha, config.dropout, rngs=rngs,
                 base_dtype=config.base_dtype, plan=plan)


def place(model: nnx.Module, plan: Plan | None = None) -> nnx.Module:
    """Move every variable of ``model`` to its sharding under ``plan`` (default: the active
    plan). No-op without a plan or while tracing; arrays already in place are not copied."""
    plan = plan or current_plan()
    if plan is None:
        return model
    state = nnx.state(model)
    leaves = jax.tree.leaves(state)
    if not leaves or not all(isinstance(x, jax.Array) and not quant.is_tracing(x)
                             for x in leaves):
        return model
    with plan.activate():
        nnx.update(model, jax.device_put(state, state_shardings(plan, state)))
    return model


def merge(model: nnx.Module, *, dtype: Any = None, plan: Plan | None = None) -> nnx.Module:
    """Fold every adapter into its base weight (``W + A @ B * alpha / rank``), in place.

    Each :class:`LoraProjection` is replaced by its base layer, so the result has the
    original model's structure and paths. An int8 base becomes a float layer again.

    Args:
      model: a model with adapters.
      dtype: dtype of the merged kernels (default: the base kernel's own dtype, float32
        for an int8 base). Use ``jnp.float32`` to merge a bf16 base without rounding.
      plan: re-place the merged kernels by this plan (default: the active plan, if any).
    """
    if isinstance(model, LinenModel):  # adapters held by the wrapper, folded into kernels
        model.merge_adapters(dtype)
        return place(model, plan)
    found = [(p, m) for p, m in nnx.iter_graph(model) if isinstance(m, LoraProjection)]
    if not found:
        raise JaxparError("model has no LoRA adapters to merge")
    for path, lp in found:
        delta = lp.weight_delta()
        base = lp.base
        if isinstance(base, quant.QuantizedProjection):
            w = base.dequantize(jnp.float32) + delta
            merged = quant.rebuild_projection(base, w.astype(dtype or base.orig_dtype))
        else:
            w = base.kernel[...]
            base.kernel.set_value((w.astype(jnp.float32) + delta).astype(dtype or w.dtype))
            merged = base
        quant.replace_module(model, tuple(path), merged)
    return place(model, plan)


def advance_dropout(tree: Any) -> Any:
    """Advance every adapter's dropout counter by one, so the next step draws new masks.

    Takes a model (updated in place) or an ``nnx.State`` (returns a new one, usable inside
    a jitted train step on the frozen state).
    """
    if isinstance(tree, nnx.Module):
        for _, node in nnx.iter_graph(tree):
            if isinstance(node, LoraDropoutCount):
                node.set_value(node[...] + 1)
        return tree
    return jax.tree.map(
        lambda v: v.replace(v.get_value() + 1) if isinstance(v, LoraDropoutCount) else v,
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


# --- parameter filters --------------------------------------------------------------------


def path_filter(pattern: str) -> Callable[[tuple, Any], bool]:
    """An nnx filter selecting ``nnx.Param``s (adapters included) whose path matches."""
    rx = _check_args(pattern, 1, 0.0, "train.trainable ")

    def select(path: tuple, value: Any) -> bool:
        return isinstance(value, nnx.Param) and rx.search(path_str(path)) is not None

    return select


def trainable_filter(spec: str | None = None, *, lora: bool = False) -> Any:
    """Turn a config string into an nnx filter for ``Trainer(..., trainable=...)``.

    ``"lora"``: the adapters (``nnx.LoRAParam``). ``"all"``: every ``nnx.Param`` (adapters
    included; an int8 base is never trainable). Anything else is a regex over parameter
    paths (``blocks/attn/wq/lora_a``, ``final_norm/scale``). ``None``/``""``/``"auto"``
    means ``"lora"`` when LoRA is on, else ``"all"``.
    """
    spec = (spec or "auto").strip()
    if spec == "auto":
        spec = "lora" if lora else "all"
    if spec == "lora":
        return nnx.LoRAParam
    if spec == "all":
        return nnx.Param
    return path_filter(spec)


def select_trainable(model: nnx.Module, spec: str | None = None) -> Any:
    """:func:`trainable_filter` for ``model`` (LoRA counts as on if it has adapters),
    checked: a filter that selects no parameter is an error listing the parameter paths."""
    filt = trainable_filter(spec, lora=bool(adapted(model)))
    if not jax.tree.leaves(nnx.state(model, filt)):
        paths = [path_str(p) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
        raise JaxparError(f"train.trainable={spec!r} selects no parameter; parameters: {paths}")
    return filt


def count_params(model: nnx.Module, filt: Any = nnx.Param) -> int:
    """Number of elements in the variables ``filt`` selects (works on abstract models)."""
    return sum(int(math.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, filt)))


def _bytes(tree: Any) -> int:
    return sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


# --- checkpoints --------------------------------------------------------------------------


def lora_state(model: nnx.Module) -> nnx.State:
    """The adapters alone (an ``nnx.State`` of ``nnx.LoRAParam``)."""
    return nnx.state(model, nnx.LoRAParam)


def save_adapters(model: nnx.Module, path: str | Path) -> Path:
    """Write the adapters alone to an orbax checkpoint at ``path`` (must not exist)."""
    import orbax.checkpoint as ocp

    state = lora_state(model)
    if not jax.tree.leaves(state):
        raise JaxparError("model has no LoRA adapters to save")
    path = Path(path).absolute()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, nnx.to_pure_dict(state))
    ckptr.wait_until_finished()
    return path


def load_adapters(model: nnx.Module, path: str | Path) -> nnx.Module:
    """Restore adapters saved by :func:`save_adapters` into ``model`` (in place).

    ``model`` must already have adapters of the same paths and shapes (apply LoRA with the
    same target and rank first); each restored array keeps the sharding of the one it
    replaces.
    """
    import orbax.checkpoint as ocp

    state = lora_state(model)
    if not jax.tree.leaves(state):
        raise JaxparError("model has no LoRA adapters to load into; call jaxpar.lora.apply first")
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        nnx.to_pure_dict(state))
    path = Path(path).absolute()
    try:
        restored = ocp.StandardCheckpointer().restore(path, target)
    except Exception as e:  # orbax raises many types; report them as one user error
        raise JaxparError(f"cannot load LoRA adapters from {path}: {e}") from e
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)
    return model


# --- reporting ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FinetuneReport:
    """Trainable parameters and memory of LoRA versus full fine-tuning (whole model, bytes
    summed over devices; divide by the shard count for per-device figures)."""

    total_params: int
    lora_trainable: int
    full_trainable: int
    lora_optimizer_bytes: int
    full_optimizer_bytes: int
    lora_frozen_bytes: int
    lora_adapter_bytes: int
    full_param_bytes: int

    @property
    def trainable_fraction(self) -> float:
        """LoRA trainable parameters as a fraction of full fine-tuning's."""
        return self.lora_trainable / max(self.full_trainable, 1)

    def __str__(self) -> str:
        mib = 1 / 2**20
        return "\n".join([
            f"parameters: {self.total_params:,}",
            f"trainable: LoRA {self.lora_trainable:,} ({100 * self.trainable_fraction:.2f}%)"
            f" vs full {self.full_trainable:,}",
            f"optimizer state: LoRA {self.lora_optimizer_bytes * mib:.1f} MiB vs full "
            f"{self.full_optimizer_bytes * mib:.1f} MiB",
            f"gradients: LoRA {self.lora_adapter_bytes * mib:.1f} MiB vs full "
            f"{self.full_param_bytes * mib:.1f} MiB",
            f"weights: LoRA frozen base {self.lora_frozen_bytes * mib:.1f} MiB + adapters "
            f"{self.lora_adapter_bytes * mib:.1f} MiB vs full {self.full_param_bytes * mib:.1f}"
            " MiB",
        ])


def finetune_report(
    base_factory: Callable[[], nnx.Module],
    config: LoraConfig,
    optimizer: optax.GradientTransformation | None = None,
    *,
    trainable: str | None = None,
) -> FinetuneReport:
    """Count trainable parameters and optimizer memory, LoRA versus full fine-tuning.

    Everything is computed from abstract shapes (``nnx.eval_shape``); nothing is allocated.
    ``optimizer`` defaults to ``optax.adamw`` (two float32 moments per trainable value).
    """
    optimizer = optimizer or optax.adamw(1e-4)
    cfg = dataclasses.replace(config, enabled=True)
    with nnx.use_eager_sharding(False):
        base = nnx.eval_shape(base_factory)
        lora_model = nnx.eval_shape(lambda: apply_config(base_factory(), cfg))
    full_params = nnx.state(base, nnx.Param)
    lora_params, frozen = nnx.state(lora_model, trainable_filter(trainable, lora=True), ...)
    return FinetuneReport(
        total_params=count_params(base, nnx.Param),
        lora_trainable=int(sum(math.prod(x.shape) for x in jax.tree.leaves(lora_params))),
        full_trainable=int(sum(math.prod(x.shape) for x in jax.tree.leaves(full_params))),
        lora_optimizer_bytes=_bytes(jax.eval_shape(optimizer.init, lora_params)),
        full_optimizer_bytes=_bytes(jax.eval_shape(optimizer.init, full_params)),
        lora_frozen_bytes=_bytes(frozen),
        lora_adapter_bytes=_bytes(lora_params),
        full_param_bytes=_bytes(full_params),
    )


__all__ = [
    "DEFAULT_TARGET",
    "FinetuneReport",
    "LoraConfig",
    "LoraDropoutCount",
    "LoraDropoutKey",
    "LoraProjection",
    "adapted",
    "advance_dropout",
    "apply",
    "apply_config",
    "count_params",
    "finetune_report",
    "load_adapters",
    "lora_state",
    "merge",
    "path_filter",
    "place",
    "save_adapters",
    "select_trainable",
    "trainable_filter",
]
