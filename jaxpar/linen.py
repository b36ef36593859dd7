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
  way linen models name repeated blocks) are pinned, as :mod:`jaxpar.layouts` does for
  NNX models.
* **LoRA** on ``nn.Dense`` layers by path (:meth:`LinenModel.add_adapters`, reached
  through :func:`jaxpar.lora.apply`): ``nnx.LoRAParam`` adapters held by the wrapper, named
  like the kernel they adapt (so sharded like it), added to the layer's output by the same
  interception.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

from jaxpar.annotate import logical_names, path_str
from jaxpar.errors import JaxparError
from jaxpar.layouts import BLOCK_OUTPUT, _constrain_leaf

MODE_ARGS = {"deterministic": False, "train": True, "training": True, "is_training": True}
"""Call-time mode arguments linen modules take, and whether ``True`` means training."""

_NUMBERED = re.compile(r"(^|_)\d+$")


class LoraAdapter(nnx.Module):
    """Low-rank adapter of one linen ``nn.Dense``: ``y += dropout-free x @ A @ B * scale``."""

    def __init__(self, kernel: nnx.Variable, rank: int, alpha: float, key: jax.Array):
        w = kernel.get_value()
        names = logical_names(kernel, w.ndim) or (None, None)
        fan_in, fan_out = w.shape
        a = jax.random.normal(key, (fan_in, rank), jnp.float32) / math.sqrt(fan_in)
        annotated = any(n is not None for n in names)
        with nnx.use_eager_sharding(False):
            self.lora_a = nnx.LoRAParam(a.astype(w.dtype), **(
                {"out_sharding": (names[0], "lora_rank")} if annotated else {}))
            self.lora_b = nnx.LoRAParam(jnp.zeros((rank, fan_out), w.dtype), **(
                {"out_sharding": ("lora_rank", names[1])} if annotated else {}))
        self.scale = float(alpha) / rank

    def delta(self, x: jax.Array) -> jax.Array:
        a, b = self.lora_a[...], self.lora_b[...]
        dtype = jnp.result_type(x.dtype, a.dtype)
        return (x.astype(dtype) @ a.astype(dtype)) @ b.astype(dtype) * self.scale


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
    """

    def __init__(self, module: nn.Module, *example_args: Any, rngs: nnx.Rngs,
                 layouts: Sequence[tuple[str, Sequence[Any]]] | str = "auto",
                 mode_arg: str | None = None, **example_kwargs: Any):
        self.linen = bridge.ToNNX(module, rngs=rngs)
        bridge.lazy_init(self.linen, *example_args, **example_kwargs)
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
    def dense_paths(self) -> list[str]:
        """Paths of the linen ``nn.Dense``-shaped kernels (2-D ``kernel`` variables)."""
        out = []
        for path, var in nnx.to_flat_state(nnx.state(self.linen, nnx.Param)):
            if path[-1] == "kernel" and getattr(var.get_value(), "ndim", 0) == 2:
                out.append(path_str(path[:-1]))
        return out

    def add_adapters(self, target: str, rank: int, alpha: float, key: jax.Array) -> list[str]:
        """Adapters for the ``nn.Dense`` layers whose path ``target`` matches; returns
        their paths.

        Raises:
          JaxparError: when it matches none (the message lists the paths it could).
        """
        pattern = re.compile(target)
        paths = [p for p in self.dense_paths() if pattern.search(p)]
        if not paths:
            raise JaxparError(f"LoRA target {target!r} matches no nn.Dense layer of the linen "
                              f"model; available paths: {self.dense_paths()}")
        flat = dict(nnx.to_flat_state(nnx.state(self.linen, nnx.Param)))
        for i, p in enumerate(paths):
            kernel = flat[(*p.split("/"), "kernel")]
            self.adapters[p] = LoraAdapter(kernel, rank, alpha, jax.random.fold_in(key, i))
        return paths

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
        logical names under the activation rules, as :mod:`jaxpar.layouts` pins an
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
        adapter = self.adapters.get(path) if isinstance(module, nn.Dense) else None
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
        with nn.intercept_methods(self._interceptor):
            return self.linen(*args, **kwargs)


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
