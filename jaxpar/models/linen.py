"""Flax linen models under jaxpar: one NNX module around a linen module, trained like any.

:func:`from_linen` wraps a linen module (a Hugging Face Flax model's ``.module``, or one of
your own) in a :class:`LinenModel`: Flax's ``nnx.bridge.ToNNX`` initialised on an example
input, plus what jaxpar needs to reach inside it:

* **Modes.** linen takes ``deterministic=`` (or ``train=``) at call time; the wrapper has a
  ``deterministic`` attribute that ``model.train()`` / ``model.eval()`` (and so the
  Trainer's steps and ``eval_loss``) set, and passes it on unless the caller does.
* **Names by path.** The linen variables become NNX variables under ``linen/``
  (``linen/h_0/attn/c_attn/kernel``), so ``plan.annotations`` regexes reach them as they
  reach any NNX model's. ``nn.with_logical_partitioning`` names are kept.
* **Layouts** by linen module class name (``"type:FlaxGPT2Block"``) or path regex
  (``h_\\d+$``), applied by intercepting the linen modules' ``__call__``; by default
  (``"auto"``) the outputs of numbered user blocks (``h_0``, ``layers_3``, ``"0"``: the
  way linen models name repeated blocks) are pinned, as :mod:`jaxpar.sharding.layouts` does for
  NNX models.
* **LoRA** on ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Einsum`` layers by path
  (:meth:`LinenModel.add_adapters`, reached through :func:`jaxpar.lora.apply`):
  ``nnx.LoRAParam`` adapters held by the wrapper, ``A`` over the kernel's contracted
  input dimensions and ``B`` over its output dimensions, named like the kernel's own
  dimensions plus ``"lora_rank"`` (so sharded like it), added to the layer's output by the
  same interception. :func:`jaxpar.lora.merge` folds them into the kernels.
* **Export.** :meth:`LinenModel.linen_params` gives the trained weights back as the
  linen params tree (host arrays, adapters folded in), for ``module.apply`` or a
  Hugging Face Flax model's ``save_pretrained(folder, params=...)``;
  :meth:`LinenModel.save_hf` writes them as a PyTorch ``transformers`` folder (safetensors
  named by the rule transformers' own Flax-to-PyTorch conversion follows).
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx, traverse_util
from flax.nnx import bridge, variablelib
from jax.experimental import multihost_utils

from jaxpar.errors import JaxparError
from jaxpar.models import projections
from jaxpar.models.projections import ProjectionSpec
from jaxpar.sharding import quantization
from jaxpar.sharding.annotations import logical_names
from jaxpar.sharding.layouts import BLOCK_OUTPUT, _constrain_leaf
from jaxpar.storage.safetensors_io import write_hf_folder

MODE_ARGS = {"deterministic": False, "train": True, "training": True, "is_training": True}
"""Call-time mode arguments linen modules take, and whether ``True`` means training."""

_NUMBERED = re.compile(r"(^|_)\d+$")

PROJECTIONS = (nn.Dense, nn.DenseGeneral, nn.Einsum)
"""The linen layers LoRA adapts."""

RANK_AXIS = "lora_rank"
"""Logical name of the adapters' rank dimension (as :mod:`jaxpar.lora` names it)."""


class LinenRngKey(nnx.Variable):
    """Raw key data of one of the linen module's RNG streams (``params``, ``dropout``)."""


class LinenRngCount(nnx.RngCount):
    """Calls made with that stream, folded into its key (an RNG counter, so whatever
    carries ``nnx.RngCount`` state across steps carries it too)."""


def _host(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` on this host (gathered from other processes if it must be)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


_TORCH_LEAF = {"embedding": "weight", "scale": "weight"}


def _torch_name(path: tuple[str, ...], ndim: int) -> tuple[str, tuple[int, ...]]:
    """The PyTorch name of a linen param and the permutation that lays it out so."""
    leaf, perm = path[-1], tuple(range(ndim))
    if leaf == "kernel":
        if ndim not in (2, 4):
            raise JaxparError(f"save_hf: {'/'.join(path)} is a {ndim}-D kernel, which has no "
                              "PyTorch layout (2-D Dense and 4-D Conv kernels have)")
        leaf, perm = "weight", (1, 0) if ndim == 2 else (3, 2, 0, 1)
    return ".".join((*path[:-1], _TORCH_LEAF.get(leaf, leaf))), perm


def _tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, Sequence) else (x,)


def projection_spec(module: nn.Module, args: tuple = (), kwargs: dict | None = None
                    ) -> ProjectionSpec | None:
    """The einsum view of a linen ``nn.Dense`` (``...i,io->...o``), ``nn.DenseGeneral``
    (input ``axis`` contracted, ``batch_dims`` shared) or ``nn.Einsum`` (its equation,
    given at construction or at call time), as :mod:`jaxpar.adapters.quant` describes NNX
    projections; None for any other module."""
    if isinstance(module, nn.Dense):
        return projections.LINEAR_SPEC
    if isinstance(module, nn.DenseGeneral):
        return projections.linear_general_spec(_tuple(module.axis), len(_tuple(module.features)),
                                         _tuple(module.batch_dims))
    if isinstance(module, nn.Einsum):
        kwargs = kwargs or {}
        equation = kwargs.get("einsum_str") or (args[1] if len(args) > 1 else None)
        return projections.parse_einsum(equation or module.einsum_str)
    return None


class LoraAdapter(nnx.Module):
    """Low-rank adapter of one linen projection: ``y += einsum(einsum(x, A), B) * scale``.

    ``A`` is ``(*shared, *in_dims, rank)`` and ``B`` is ``(*shared, rank, *out_dims)``,
    where ``in_dims`` are the kernel dimensions the layer contracts with its input,
    ``out_dims`` those that reach only its output and ``shared`` those in input, kernel
    and output alike (``nn.DenseGeneral``'s ``batch_dims``); each carries the kernel's own
    logical name for that dimension, the rank ``"lora_rank"``.
    """

    def __init__(self, kernel: nnx.Variable, spec: ProjectionSpec, rank: int, alpha: float,
                 key: jax.Array, path: str = ""):
        w = kernel.get_value()
        if w.ndim != len(spec.kernel):
            raise JaxparError(f"cannot adapt {path}: its {w.ndim}-D kernel does not fit its "
                              f"einsum {spec.equation!r} (layers stacked by nn.scan or "
                              "nn.vmap are not supported)")
        names = logical_names(kernel, w.ndim) or (None,) * w.ndim
        size = dict(zip(spec.kernel, w.shape, strict=True))
        name = dict(zip(spec.kernel, names, strict=True))
        r = spec.free_letters(1)
        a_dims = spec.shared + spec.in_letters
        b_dims = spec.shared + r + spec.out_letters
        fan_in = math.prod(size[c] for c in spec.in_letters)
        dtype = w.dtype if jnp.issubdtype(w.dtype, jnp.floating) else jnp.float32
        a = jax.random.normal(key, tuple(size[c] for c in a_dims) + (rank,), jnp.float32)
        b_shape = tuple(rank if c == r else size[c] for c in b_dims)
        annotated = any(n is not None for n in names)

        def sharding(dims: str) -> dict:
            return ({"out_sharding": tuple(RANK_AXIS if c == r else name[c] for c in dims)}
                    if annotated else {})

        with nnx.use_eager_sharding(False):
            self.lora_a = nnx.LoRAParam((a / math.sqrt(fan_in)).astype(dtype),
                                        **sharding(a_dims + r))
            self.lora_b = nnx.LoRAParam(jnp.zeros(b_shape, dtype), **sharding(b_dims))
        self.scale = float(alpha) / rank
        low = "".join(c for c in spec.x if c not in spec.in_letters) + r
        self.equation_a = f"{spec.x},{a_dims}{r}->{low}"
        self.equation_b = f"{low},{b_dims}->{spec.out}"
        self.equation_w = f"{a_dims}{r},{b_dims}->{spec.kernel}"

    def delta(self, x: jax.Array) -> jax.Array:
        """The adapter's contribution to the layer's output for input ``x``."""
        a, b = self.lora_a[...], self.lora_b[...]
        dtype = jnp.result_type(x.dtype, a.dtype)
        low = jnp.einsum(self.equation_a, x.astype(dtype), a.astype(dtype))
        return jnp.einsum(self.equation_b, low, b.astype(dtype)) * self.scale

    def weight_delta(self) -> jax.Array:
        """``A @ B * scale`` laid out like the kernel (float32)."""
        a, b = self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32)
        return jnp.einsum(self.equation_w, a, b) * self.scale


class LinenModel(nnx.Module):
    """A linen module as an NNX model (see the module docstring); build it with
    :func:`from_linen`.

    Attributes:
      linen: the ``nnx.bridge.ToNNX`` holding the linen variables.
      deterministic: set by ``train()``/``eval()``; passed to the linen call as its mode
        argument (:attr:`mode_arg`) unless the caller gives it.
      layouts: ``(linen class name as "type:Name", or path regex; logical names)`` pairs,
        or ``"auto"``.
      adapters: LoRA adapters by linen module path (``h_0/attn/c_attn``).
      rng_keys, rng_counts: the linen RNG streams (raw key data, calls made) by name.
      linen_modules: ``(path, class name, einsum view or None)`` of every linen module the
        example call ran, the projections LoRA can adapt having an einsum view.
    """

    def __init__(self, module: nn.Module, *example_args: Any, rngs: nnx.Rngs,
                 layouts: Sequence[tuple[str, Sequence[Any]]] | str = "auto",
                 mode_arg: str | None = None, **example_kwargs: Any):
        self.linen = bridge.ToNNX(module, rngs=rngs)
        seen: dict[str, tuple[str, ProjectionSpec | None]] = {}

        def record(next_fun, args, kwargs, context):
            sub = context.module
            path = "/".join(str(p) for p in sub.path)
            if context.method_name == "__call__" or path not in seen:
                seen[path] = (type(sub).__qualname__, projection_spec(sub, args, kwargs))
            return next_fun(*args, **kwargs)

        try:
            with nn.intercept_methods(record):
                bridge.lazy_init(self.linen, *example_args, **example_kwargs)
        except (IndexError, TypeError, ValueError) as err:  # the example does not fit
            shapes = [getattr(a, "shape", type(a).__name__) for a in example_args]
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise JaxparError(
                f"jaxpar.from_linen: {type(module).__name__} failed on the example "
                f"arguments of shapes {shapes} ({type(err).__name__}: {first}): pass "
                "examples shaped as training calls it, e.g. token ids (batch, seq)"
            ) from None
        # The RNG streams, held as raw key data and a counter (the way jaxpar.lora holds
        # adapter dropout keys) instead of typed keys, so a checkpoint stores them as it
        # stores any array; each call folds the counter in and advances it.
        streams = dict(self.linen.to_nnx__rngs.items()) if self.linen.to_nnx__rngs else {}
        self.rng_keys = nnx.Dict({name: LinenRngKey(jax.random.key_data(stream.key[...]))
                                  for name, stream in streams.items()})
        self.rng_counts = nnx.Dict({name: LinenRngCount(stream.count[...])
                                    for name, stream in streams.items()})
        # The streams' names, apart: a Dict's items can include attributes a library
        # sets on every module (Qwix does, when it quantizes).
        self.rng_names = tuple(streams)
        self.linen.to_nnx__rngs = None
        self.linen_modules = tuple((p, cls, spec) for p, (cls, spec) in sorted(seen.items()))
        if mode_arg is None:
            params = inspect.signature(module.__call__).parameters
            mode_arg = next((name for name in MODE_ARGS if name in params), None)
        elif mode_arg not in MODE_ARGS:
            raise JaxparError(f"mode_arg={mode_arg!r}: choose one of {list(MODE_ARGS)}")
        self.mode_arg = mode_arg
        self.deterministic = False
        self.layouts = layouts if layouts == "auto" else tuple(
            (target, tuple(names)) for target, names in layouts)
        self.adapters = nnx.Dict()

    # --- LoRA -----------------------------------------------------------------------------
    def _params(self) -> dict[tuple[str, ...], nnx.Variable]:
        return {tuple(str(k) for k in p): v
                for p, v in nnx.to_flat_state(nnx.state(self.linen, nnx.Param))}

    def head_paths(self) -> list[str]:
        """Paths of the linen layers projecting to the vocabulary (``lm_head``): a weight
        named ``vocab``, or whose last dimension is an ``nn.Embed`` table's row count.
        Quantized training leaves them in the compute dtype."""
        params = self._params()
        shapes = {p: v.get_value().shape for p, v in params.items()}
        named = {p[:-1] for p, v in params.items()
                 if "vocab" in (logical_names(v, len(shapes[p])) or ())
                 and p[-1] != "embedding"}
        rows = {shapes[p][0] for p in params if p[-1] == "embedding" and len(shapes[p]) == 2}
        found = named or {p[:-1] for p in params if p[-1] != "embedding"
                          and len(shapes[p]) >= 2 and shapes[p][-1] in rows}
        return sorted("/".join(p) for p in found)

    def projection_paths(self) -> list[str]:
        """Paths of the linen ``nn.Dense``, ``nn.DenseGeneral`` and ``nn.Einsum`` layers
        LoRA can adapt (``h_0/attn/query``)."""
        return [p for p, _, spec in self.linen_modules if spec is not None]

    def add_adapters(self, target: str, rank: int, alpha: float, key: jax.Array) -> list[str]:
        """Adapters for the projections whose path ``target`` matches (``re.search``);
        returns their paths. Modules holding no parameter themselves (an
        ``nn.MultiHeadDotProductAttention`` at ``attn``, a block) are passed over: their
        projections are matched by their own paths.

        Raises:
          JaxparError: when it matches none (the message lists the paths it could), or a
            module that holds parameters but is not a projection (``nn.Conv``,
            ``nn.Embed``, a norm, a Hugging Face ``FlaxConv1D``); nothing is added then.
        """
        pattern = re.compile(target)
        params = self._params()
        specs = {p: spec for p, _, spec in self.linen_modules if spec is not None}
        classes = {p: cls for p, cls, _ in self.linen_modules}
        owners = {"/".join(path[:-1]) for path in params}
        bad = [f"{p or '<root>'} ({classes.get(p, 'unknown')})" for p in sorted(owners)
               if p not in specs and pattern.search(p)]
        if bad:
            raise JaxparError(
                f"LoRA target {target!r} matches linen modules that hold parameters but are "
                f"not nn.Dense, nn.DenseGeneral or nn.Einsum: {', '.join(bad)}; narrow the "
                f"regex (e.g. anchor it with '$'). Adaptable paths: {list(specs)}")
        paths = [p for p in specs if pattern.search(p) and p in owners and p not in self.adapters]
        if not paths:
            done = list(self.adapters)
            raise JaxparError(f"LoRA target {target!r} matches no nn.Dense, nn.DenseGeneral or "
                              f"nn.Einsum layer of the linen model; available paths: "
                              f"{[p for p in specs if p not in self.adapters]}"
                              + (f"; already adapted: {done}" if done else ""))
        new = {p: LoraAdapter(params[(*p.split("/"), "kernel")], specs[p], rank, alpha,
                              jax.random.fold_in(key, i), p) for i, p in enumerate(paths)}
        for p, adapter in new.items():  # all built first: a failure leaves the model as it was
            self.adapters[p] = adapter
        return paths

    def merge_adapters(self, dtype: Any = None) -> list[str]:
        """Fold every adapter into its kernel (``W + A @ B * scale``, computed in float32,
        stored as ``dtype`` or the kernel's own) and drop the adapters; returns their
        paths. :func:`jaxpar.lora.merge` calls it for a linen model.

        Raises:
          JaxparError: when the model has no adapters.
        """
        if not self.adapters:
            raise JaxparError("model has no LoRA adapters to merge")
        params = self._params()
        paths = list(self.adapters)
        for p in paths:
            kernel = params[(*p.split("/"), "kernel")]
            w = kernel.get_value()
            merged = w.astype(jnp.float32) + self.adapters[p].weight_delta()
            kernel.set_value(merged.astype(dtype or w.dtype))
        self.adapters = nnx.Dict()
        return paths

    # --- export ---------------------------------------------------------------------------
    def _weights(self) -> dict[tuple[str, ...], jax.Array]:
        """Every param as the linen module computes with it (adapters folded in, float32
        sums cast back to the kernel's dtype), on the devices."""
        out = {path: var.get_value() for path, var in self._params().items()}
        for p, adapter in self.adapters.items():
            key = (*p.split("/"), "kernel")
            w = out[key]
            out[key] = (w.astype(jnp.float32) + adapter.weight_delta()).astype(w.dtype)
        return out

    def linen_params(self) -> dict[str, Any]:
        """The trained weights as the linen ``params`` collection: a nested dict of numpy
        arrays (gathered whole onto this host), laid out as the linen module expects,
        LoRA adapters folded into their kernels (the model itself is left as it is).

        ``module.apply({"params": model.linen_params()}, x)`` computes what the model
        computes; a Hugging Face Flax model writes them with
        ``hf_model.save_pretrained(folder, params=model.linen_params())``.
        """
        nested: dict[str, Any] = {}
        for path, value in self._weights().items():
            node = nested
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = _host(value)
        return nested

    def load_linen_params(self, params: Any) -> None:
        """Overwrite the weights with a linen ``params`` tree (a pretrained model's, e.g. a
        Hugging Face Flax model's ``.params``, or :meth:`linen_params` of another run),
        each array placed in the sharding of the weight it replaces, in its dtype.

        Raises:
          JaxparError: naming the paths missing from ``params``, not in the model, or of
            another shape (nothing is changed then).
        """
        given = {tuple(str(k) for k in path): value for path, value
                 in traverse_util.flatten_dict(dict(params.get("params", params))).items()}
        mine = dict(nnx.to_flat_state(nnx.state(self.linen, nnx.Param)))
        mine = {tuple(str(k) for k in path): var for path, var in mine.items()}
        missing = sorted("/".join(p) for p in mine.keys() - given.keys())
        extra = sorted("/".join(p) for p in given.keys() - mine.keys())
        wrong = sorted(f"{'/'.join(p)} {tuple(np.shape(given[p]))} (model: "
                       f"{tuple(mine[p].get_value().shape)})" for p in mine.keys() & given.keys()
                       if tuple(np.shape(given[p])) != tuple(mine[p].get_value().shape))
        if missing or extra or wrong:
            parts = [f"{what}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
                     for what, items in (("missing", missing), ("not in the model", extra),
                                         ("other shapes", wrong)) if items]
            raise JaxparError("the linen params do not fit the model: " + "; ".join(parts))
        for path, var in mine.items():
            old = var.get_value()
            var.set_value(jax.device_put(jnp.asarray(given[path], old.dtype), old.sharding))

    def save_hf(self, folder: str | Path, config: Any, *, dtype: Any = None,
                max_shard_bytes: int = 5 * 10**9) -> Path:
        """Write the weights (adapters folded in) as a Hugging Face PyTorch folder:
        ``config.json`` and safetensors that ``transformers.AutoModelFor...
        .from_pretrained(folder)`` loads, for a linen model laid out as a Hugging Face Flax
        model of that family (its ``.module``, or your own port with the same names).

        Tensors are named by the rule transformers' own Flax-to-PyTorch conversion follows:
        the path joined by dots (``model/layers/0/mlp/up_proj/kernel`` ->
        ``model.layers.0.mlp.up_proj.weight``), a 2-D ``kernel`` transposed to
        ``weight``, a 4-D (convolution) kernel from ``HWIO`` to ``OIHW``, ``embedding``
        and ``scale`` renamed ``weight``. Written by process 0, one tensor gathered at a
        time; every process must call it.

        Args:
          config: the family's config: a ``transformers`` config object (``to_dict()``) or a
            dict with ``model_type``, written as ``config.json``.
          dtype: dtype of the stored tensors (default: each parameter's own).
          max_shard_bytes: safetensors shard size (an index is written for several).

        Raises:
          JaxparError: for a config without ``model_type``, or a kernel that is not 2-D or
            4-D (no PyTorch layout to give it).
        """
        hf = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if not hf.get("model_type"):
            raise JaxparError("save_hf needs the Hugging Face config of the model's family "
                              "(a transformers config, or a dict with 'model_type')")
        weights = self._weights()
        sources, entries = {}, []
        for path, value in weights.items():
            name, perm = _torch_name(path, value.ndim)
            out_dtype = np.dtype(jnp.dtype(dtype or value.dtype))
            shape = tuple(value.shape[i] for i in perm)
            sources[name] = (value, perm, out_dtype)
            entries.append((name, shape, out_dtype))

        def produce(name: str) -> np.ndarray:
            value, perm, out_dtype = sources[name]
            return np.ascontiguousarray(_host(value).transpose(perm).astype(out_dtype))

        def finish(staging: Path) -> None:
            (staging / "config.json").write_text(json.dumps(hf, indent=2, default=str) + "\n")

        return write_hf_folder(Path(folder), entries, produce, finish,
                               max_shard_bytes=max_shard_bytes)

    # --- calling ------------------------------------------------------------------------------
    def _pin(self, module: nn.Module) -> tuple | None:
        if not isinstance(self.layouts, tuple):  # "auto": numbered user blocks
            user = not type(module).__module__.startswith("flax.")
            named = module.name is not None and _NUMBERED.search(str(module.name))
            return BLOCK_OUTPUT if user and named else None
        path = "/".join(str(p) for p in module.path)
        for target, names in self.layouts:
            if target.startswith("type:"):
                if any(c.__name__ == target[5:] for c in type(module).__mro__):
                    return names
            elif re.search(target, path):
                return names
        return None

    def _embed(self, module: nn.Embed, method: str, args: tuple, kwargs: dict) -> Any:
        """``nn.Embed``'s lookup (or tied ``attend``) with its table pinned to its own
        logical names under the activation rules, as :mod:`jaxpar.sharding.layouts` pins an
        ``nnx.Embed``'s: FSDP then gathers the table for the lookup instead of
        exchanging the looked-up rows with all-to-alls."""
        table = module.embedding
        path = tuple(str(p) for p in module.path) + ("embedding",)
        var = dict(nnx.to_flat_state(nnx.state(self.linen, nnx.Param))).get(path)
        names = logical_names(var, table.ndim) if var is not None else None
        if names and any(n is not None for n in names):
            table = _constrain_leaf(table, names)
        if method == "attend":
            query, table = nn.dtypes.promote_dtype(args[0], table, dtype=module.dtype)
            return _constrain_leaf(jnp.dot(query, table.T), ("batch", "seq", "vocab"))
        (table,) = nn.dtypes.promote_dtype(table, dtype=module.dtype, inexact=False)
        rows = jnp.take(table, args[0], axis=0)
        return _constrain_leaf(rows, BLOCK_OUTPUT)

    def _interceptor(self, next_fun, args, kwargs, context):
        module = context.module
        if (isinstance(module, nn.Embed) and not isinstance(self.layouts, tuple)
                and context.method_name in ("__call__", "attend")):
            return self._embed(module, context.method_name, args, kwargs)
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        path = "/".join(str(p) for p in module.path)
        adapter = self.adapters.get(path) if isinstance(module, PROJECTIONS) else None
        if adapter is not None:
            out = out + adapter.delta(args[0]).astype(out.dtype)
        names = self._pin(module)
        if names is not None:
            out = jax.tree.map(lambda x: _constrain_leaf(x, names), out)
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.mode_arg and self.mode_arg not in kwargs:
            training = not self.deterministic
            kwargs[self.mode_arg] = training if MODE_ARGS[self.mode_arg] else not training
        keys = {}
        for name in self.rng_names:
            data, count = self.rng_keys[name], self.rng_counts[name]
            keys[name] = jax.random.fold_in(jax.random.wrap_key_data(data[...]), count[...])
            count.set_value(count[...] + 1)
        # Applied here rather than through ToNNX's call, to hand the linen module plain
        # arrays: ToNNX boxes an annotated variable, which breaks linen code that reads
        # ``self.variables`` itself (Hugging Face's tied heads do). Collections other than
        # params (batch statistics) are mutable and written back.
        variables, targets = {}, {}
        for path, var in nnx.to_flat_state(nnx.state(self.linen)):
            key = (variablelib.variable_name_from_type(type(var)), *map(str, path))
            variables[key], targets[key] = var.get_value(), var
        variables = traverse_util.unflatten_dict(variables)
        mutable = [c for c in variables if c != "params"]
        module = self.linen.to_nnx__module
        quantized = quantization.linen_provider()
        if quantized is not None:  # plan.quantize: Qwix reaches linen matmuls this way
            import qwix

            module = qwix.quantize_model(module, quantized)
        with nn.intercept_methods(self._interceptor):
            out = module.apply(variables, *args, rngs=keys, mutable=mutable or False,
                               **kwargs)
        if not mutable:
            return out
        out, updates = out
        for key, value in traverse_util.flatten_dict(dict(updates)).items():
            if key in targets:
                targets[key].set_value(value)
        return out


def from_linen(module: nn.Module, *example_args: Any, rngs: nnx.Rngs | int = 0,
               layouts: Sequence[tuple[str, Sequence[Any]]] | str = "auto",
               mode_arg: str | None = None, **example_kwargs: Any) -> LinenModel:
    """Wrap a linen ``module`` as an NNX model jaxpar can shard, train, adapt and
    checkpoint, its variables initialised on ``example_args`` (e.g. a token batch).

    Use it inside the factory given to :func:`jaxpar.init_sharded`, so the weights are
    born sharded: ``init_sharded(lambda: from_linen(GPT2(), tokens, rngs=0), plan)``.

    Args:
      module: the linen module (for a Hugging Face Flax model, its ``.module``).
      rngs: seeds of the ``params`` and ``dropout`` streams (an int seeds both).
      layouts: linen module outputs to pin (``("type:ClassName" or path regex, names)``),
        or ``"auto"``: the numbered blocks (see the module docstring), or ``()``.
      mode_arg: the call argument that switches dropout (default: the first of
        :data:`MODE_ARGS` the module's ``__call__`` takes).
    """
    if not isinstance(module, nn.Module):
        raise JaxparError(f"from_linen takes a flax.linen Module, got {type(module).__name__}"
                          " (an NNX model needs no wrapping)")
    if isinstance(rngs, int):
        rngs = nnx.Rngs(params=rngs, dropout=rngs + 1)
    return LinenModel(module, *example_args, rngs=rngs, layouts=layouts, mode_arg=mode_arg,
                      **example_kwargs)
