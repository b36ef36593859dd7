"""Hugging Face checkpoints in and out of jaxpar's reference decoder.

:func:`load` builds a :class:`~jaxpar.models.Transformer` from a Hugging Face folder.
With a plan, each parameter is created by ``jax.make_array_from_callback`` in the
sharding the plan's rules give it: this process reads from the memory-mapped safetensors
only the box spanning its own devices' shards, row-contiguously and in the stored layout,
each device takes its part of that, and the devices transpose to jaxpar's layout (XLA's
transpose, under a sharding that moves nothing between devices). No host holds more than
its share of any array, nor more than one array at a time beyond what its devices hold;
the per-layer tensors are stacked (or laid out by pipeline stage) as they are read.
:func:`save` writes the reverse, one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxpar.adapters.lora import adapted
from jaxpar.errors import JaxparError
from jaxpar.hf import families, layout
from jaxpar.hf.families import read_config
from jaxpar.models.transformer import Transformer, TransformerConfig
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.sharding.partitioning import prepare_model, state_shardings, warn_if_replicated
from jaxpar.sharding.paths import path_str
from jaxpar.sharding.plan import Plan
from jaxpar.storage.safetensors_io import SafetensorsFolder, write_hf_folder

MAX_SHARD_BYTES = 5 * 10**9
"""Largest safetensors shard :func:`save` writes (Hugging Face's default, 5 GB)."""

_IGNORED = ("rotary_emb.inv_freq",)
"""Stored buffers that are not parameters."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "chat_template.jinja")
"""The tokenizer files copied along (``chat_template.jinja``: where newer ``transformers``
saves the chat template)."""


def _np_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jnp.dtype(dtype)) if dtype is not None else np.dtype(np.float32)


def _concrete(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


class _Reader:
    """Reads parts of one array at a time, in the Hugging Face view layout (stack dims
    first), each distinct part once; :meth:`start` forgets the previous array's parts, so
    host memory holds at most one array's share beside the devices'."""

    def __init__(self, folder: SafetensorsFolder, stack: tuple[int, ...],
                 layer_at: Callable[[int, int], int] | None = None):
        self.folder, self.stack, self.layer_at = folder, stack, layer_at
        self._cache: dict[tuple, np.ndarray] = {}

    def start(self) -> None:
        self._cache.clear()

    def _layer_part(self, tensor: layout.Tensor, layer: int | None,
                    index: tuple[slice, ...]) -> np.ndarray:
        if tensor.experts:  # one stored tensor per expert, stacked on the first axis
            one = tensor.expert()
            slices, finish = layout.source_slices(one, index[1:])
            return np.stack([finish(self.folder.read(layout.layer_name(tensor, layer, j),
                                                     slices))
                             for j in range(index[0].start, index[0].stop)])
        name = tensor.name if layer is None else layout.layer_name(tensor, layer)
        slices, finish = layout.source_slices(tensor, index)
        return finish(self.folder.read(name, slices))

    def part(self, tensor: layout.Tensor, shape: tuple[int, ...],
             index: tuple[slice, ...]) -> np.ndarray:
        """The part ``index`` of the array of ``shape`` (stack dims + ``tensor.view``)."""
        index = _concrete(index, shape)
        key = tuple((s.start, s.stop) for s in index)
        if key in self._cache:
            return self._cache[key]
        size = tuple(s.stop - s.start for s in index)
        if not tensor.per_layer:
            out = np.ascontiguousarray(self._layer_part(tensor, None, index))
        else:
            # Stacked layout: layer l at [l]; pipeline layout: Schedule.position(l).
            # Each layer's rows are copied (and cast) once, contiguously, into place.
            depth = len(self.stack)
            ranges = [range(s.start, s.stop) for s in index[:depth]]
            out = None
            for a, r in enumerate(ranges[0]):
                for b, st in enumerate(ranges[1] if depth == 2 else [None]):
                    layer = r if st is None else self.layer_at(r, st)
                    where = (a,) if st is None else (a, b)
                    part = self._layer_part(tensor, layer, index[depth:])
                    if out is None:  # in the stored dtype: the devices cast
                        out = np.empty(size, part.dtype)
                    out[where] = part
        self._cache[key] = out
        return out


def _view_sharding(sharding: jax.sharding.Sharding, tensor: layout.Tensor, lead: int
                   ) -> jax.sharding.Sharding:
    """The sharding of the view-layout array whose transpose has ``sharding``: the same
    mesh axes on the same logical dimensions, so the transpose moves no data between
    devices."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (lead + len(tensor.perm) - len(sharding.spec))
    view = [None] * len(tensor.view)
    for j, p in enumerate(tensor.perm):
        view[p] = spec[lead + j]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:lead], *view))


@functools.partial(jax.jit, static_argnums=(1, 2, 3), static_argnames=("out_sharding",))
def _to_jaxpar_layout(array: jax.Array, perm: tuple[int, ...], dtype: np.dtype, lead: int, *,
                      out_sharding) -> tuple[jax.Array, jax.Array]:
    """The array in jaxpar's layout and dtype, and how many of its values are not finite
    (one count per layer of a stacked array: the ``lead`` stack dimensions), replicated."""
    out = jax.lax.with_sharding_constraint(array.transpose(perm).astype(dtype), out_sharding)
    bad = jnp.sum(~jnp.isfinite(out), axis=tuple(range(lead, out.ndim)), dtype=jnp.int32)
    if isinstance(out_sharding, NamedSharding):
        bad = jax.lax.with_sharding_constraint(bad, NamedSharding(out_sharding.mesh,
                                                                  PartitionSpec()))
    return out, bad


def _read_array(reader: _Reader, tensor: layout.Tensor, shape: tuple[int, ...],
                sharding: jax.sharding.Sharding, dtype: np.dtype
                ) -> tuple[jax.Array, jax.Array]:
    """One parameter of ``shape`` and ``dtype`` in ``sharding``: this process reads (once)
    the box spanning its devices' shards of the Hugging Face view-layout array, each device
    takes its part of that in the stored dtype, and the devices transpose and cast. With it,
    its count of values that are not finite (per layer: see :func:`_to_jaxpar_layout`)."""
    lead = len(shape) - len(tensor.perm)
    view_shape = shape[:lead] + tensor.view
    view_sharding = _view_sharding(sharding, tensor, lead)
    local = [_concrete(i, view_shape) for i in
             view_sharding.addressable_devices_indices_map(view_shape).values()]
    box = tuple(slice(min(i[d].start for i in local), max(i[d].stop for i in local))
                for d in range(len(view_shape)))
    reader.start()
    held = reader.part(tensor, view_shape, box)

    def cut(index: tuple[slice, ...]) -> np.ndarray:
        index = _concrete(index, view_shape)
        return held[tuple(slice(i.start - b.start, i.stop - b.start)
                          for i, b in zip(index, box, strict=True))]

    view = jax.make_array_from_callback(view_shape, view_sharding, cut)
    reader.start()
    perm = tuple(range(lead)) + tuple(lead + p for p in tensor.perm)
    return _to_jaxpar_layout(view, perm, dtype, lead, out_sharding=sharding)


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
"""Stored dtypes read as weights; integer, boolean and 8-bit float tensors are refused."""


def _check_finite(folder: Path, counts: list[tuple[layout.Tensor, jax.Array]],
                  layer_at: Callable[[int, int], int] | None) -> None:
    """Refuse weights with NaN or infinite values, naming the first tensor that has some."""
    bad = [(t, np.asarray(c.addressable_data(0))) for t, c in counts]
    bad = [(t, c) for t, c in bad if c.any()]
    if not bad:
        return
    tensor, count = bad[0]
    name = tensor.name
    if tensor.per_layer:  # the first layer with any: stacked [l] or pipelined [r, s]
        where = tuple(int(i) for i in np.argwhere(count)[0])
        layer = where[0] if len(where) == 1 else layer_at(where[0], where[1])
        name, count = layout.layer_name(tensor, layer), count[where]
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    n = int(count.sum())
    raise JaxparError(f"{folder}: tensor {name!r} holds {n} NaN or infinite "
                      f"value{'s' if n > 1 else ''}{more}; jaxpar refuses weights that are not "
                      "finite (a damaged checkpoint, or one saved in a dtype too narrow for "
                      "its values)")


def _check_names(folder: SafetensorsFolder, tensors: list[layout.Tensor],
                 cfg: TransformerConfig) -> None:
    """Every expected tensor present with its shape, and none left over."""
    expected = {}
    for t in tensors:
        for name, _, _ in layout.stored_names(t, cfg.n_layers):
            expected[name] = t.stored_shape
    present = set(folder.names())
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise JaxparError(f"{folder.folder}: tensor {missing[0]!r}{more} missing for the "
                          "architecture its config.json describes")
    extra = sorted(n for n in present - set(expected)
                   if not n.endswith(_IGNORED) and not (cfg.tie_embeddings
                                                       and n == "lm_head.weight"))
    if extra:
        raise JaxparError(f"{folder.folder}: tensor {extra[0]!r} is not part of jaxpar's "
                          f"decoder ({len(extra)} unexpected tensors)")
    for name, shape in expected.items():
        stored, dtype = folder.info(name)
        if dtype not in FLOAT_DTYPES:
            raise JaxparError(f"{folder.folder}: tensor {name!r} is stored as {dtype}; jaxpar "
                              f"reads float weights ({', '.join(FLOAT_DTYPES)}), not integer "
                              "or quantized ones")
        if stored != shape:
            raise JaxparError(f"{folder.folder}: tensor {name!r} has shape {stored}, the "
                              f"config implies {shape}")


def check_tensors(path: str | Path) -> None:
    """Check the Hugging Face folder ``path`` without reading any weight: its config, and
    every tensor it needs present with its shape and a float dtype (see :func:`load`).

    Raises:
      JaxparError: naming the key or tensor that does not fit.
    """
    cfg, arch = read_config(path)
    with SafetensorsFolder(path) as folder:
        _check_names(folder, layout.tensors(cfg, arch), cfg)


def load(path: str | Path, *, plan: Plan | None = None, dtype: Any = None,
         pipeline: pipeline_lib.Schedule | None = None, stats: dict | None = None,
         config: TransformerConfig | None = None) -> Transformer:
    """The jaxpar decoder of a Hugging Face folder (``config.json`` + safetensors).

    Args:
      path: a folder with ``config.json`` and ``model.safetensors`` or sharded files with
        ``model.safetensors.index.json`` (any of :data:`~jaxpar.hf.families.ARCHITECTURES`;
        a mixture of experts is built dropless, ``expert_capacity=0``, as transformers
        runs it).
      plan: place every parameter by this plan, each process reading only the slices its
        devices hold; without one the model is on the default device.
      dtype: parameter dtype (default float32, jaxpar's master weights).
      pipeline: the pipeline schedule when the plan's mesh has stages (default: one
        microbatch per stage, as many repeats as layers allow).
      stats: if given, receives ``bytes_read`` (what this process read).
      config: the decoder config to build (default: the folder's); it must describe the
        folder's model, and may differ only in fields that leave the weights and what they
        compute alone (:data:`~jaxpar.hf.families.COMPATIBLE_FIELDS`: how attention and the
        loss are computed, ``max_seq_len``).

    Raises:
      JaxparError: naming the file, architecture, option or tensor that does not fit, a
        tensor stored as integers or holding NaN or infinite values, or a ``config`` field
        that conflicts with the folder's.
    """
    cfg, arch = read_config(path)
    if config is not None:
        fields = [f.name for f in dataclasses.fields(TransformerConfig)]
        cfg = families.merge_model(
            cfg, config, [n for n in fields if getattr(config, n) != getattr(cfg, n)],
            str(Path(path) / "config.json"))
    stages = plan.mesh.shape.get("stage", 1) if plan is not None else 1
    if stages > 1 and pipeline is None:
        pipeline = pipeline_lib.Schedule.for_model(cfg.n_layers, stages)
    make = lambda: Transformer(cfg, rngs=nnx.Rngs(0), pipeline=pipeline)
    if plan is not None:
        with plan.activate():
            abstract = nnx.eval_shape(lambda: prepare_model(make(), plan))
            graphdef, state = nnx.split(abstract)
            shardings = state_shardings(plan, state)
    else:
        abstract = nnx.eval_shape(make)
        graphdef, state = nnx.split(abstract)
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, state)
    np_dtype = _np_dtype(dtype)
    stack = ((pipeline.repeats * pipeline.layers_per_stage, pipeline.stages)
             if pipeline is not None else (cfg.n_layers,))
    layer_at = pipeline.layer_at if pipeline is not None else None
    by_path = {t.path: t for t in layout.tensors(cfg, arch)}
    flat_state = dict(jax.tree_util.tree_leaves_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    flat_shardings = dict(jax.tree_util.tree_leaves_with_path(
        shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    with SafetensorsFolder(path) as folder:
        _check_names(folder, list(by_path.values()), cfg)
        reader = _Reader(folder, stack, layer_at)
        counts = []
        for key, variable in flat_state.items():
            name = path_str(key)
            if name not in by_path:
                raise AssertionError(f"no Hugging Face tensor for jaxpar parameter {name}")
            tensor, shape = by_path[name], variable.get_value().shape
            sharding = flat_shardings[key].get_value()
            array, bad = _read_array(reader, tensor, shape, sharding, np_dtype)
            variable.set_value(array)
            counts.append((tensor, bad))
        _check_finite(folder.folder, counts, layer_at)
        if stats is not None:
            stats["bytes_read"] = folder.bytes_read
    model = nnx.merge(graphdef, state)
    if plan is not None:
        warn_if_replicated(plan, state)
    return model


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _to_hf_layout(array: jax.Array, where: jax.Array, perm: tuple[int, ...],
                  shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    """``array[*where]`` (a layer of a stacked array; ``where`` traced, so one compile
    serves every layer) in the Hugging Face layout and dtype."""
    for k in range(where.shape[0]):
        array = array[where[k]]
    return array.transpose(perm).reshape(shape).astype(dtype)


def host_array(x: jax.Array) -> np.ndarray:
    """The whole of ``x`` on this host (gathered from other processes if it must be)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save(model: Transformer, path: str | Path, *, dtype: Any = None,
         architecture: str | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
         tokenizer: str | Path | None = None) -> Path:
    """Write ``model`` as a Hugging Face folder that ``transformers`` loads.

    ``config.json`` plus safetensors shards of at most ``max_shard_bytes`` (with
    ``model.safetensors.index.json`` when there are several). Tensors are gathered one
    layer at a time and written by process 0; every process must call it. A model with
    LoRA adapters must be merged first (:func:`jaxpar.lora.merge`), or its adapters saved
    alone with :func:`jaxpar.hf.save_adapters`.

    Args:
      dtype: dtype of the stored tensors (default: each parameter's own).
      architecture: e.g. ``"LlamaForCausalLM"``; default: the family whose options the
        config uses (a Phi-3 model, whose options are Llama's, is saved as Phi-3 only when
        asked: ``architecture="Phi3ForCausalLM"``).
      tokenizer: a ``tokenizer.json`` or a folder with tokenizer files to copy alongside.
    """
    if not isinstance(model, Transformer):
        raise JaxparError(f"jaxpar.hf.save writes jaxpar's reference decoder, not a "
                          f"{type(model).__name__}")
    if adapted(model):
        raise JaxparError("the model has LoRA adapters: merge them first (jaxpar.lora.merge) "
                          "or save the adapters alone (jaxpar.hf.save_adapters)")
    cfg = model.config
    # Refused before anything is gathered or written.
    arch = families.to_hf(cfg, architecture)["architectures"][0]
    schedule = getattr(model, "pipeline_schedule", None)
    params = {path_str(k): v for k, v in jax.tree_util.tree_leaves_with_path(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))}
    entries, sources = [], {}
    for t in layout.tensors(cfg, arch):
        array = params[t.path].get_value()
        out_dtype = np.dtype(jnp.dtype(dtype or array.dtype))
        for name, i, j in layout.stored_names(t, cfg.n_layers):
            if name not in sources:  # a fused tensor: listed once, its parts gathered
                entries.append((name, t.stored_shape, out_dtype))
            sources.setdefault(name, []).append((t, array, i, j, out_dtype))

    def part(t: layout.Tensor, array: jax.Array, i: int | None, j: int | None,
             out_dtype: np.dtype) -> np.ndarray:
        where = () if i is None else schedule.position(i) if schedule else (i,)
        if j is not None:  # one expert of the layer's stack
            where, t = (*where, j), t.expert()
        # Slice, transpose and cast on the devices (XLA's transpose is far faster than
        # numpy's strided copy), then fetch one layer's tensor.
        return host_array(_to_hf_layout(array, np.array(where, np.int32),
                                        tuple(int(k) for k in np.argsort(t.perm)), t.shape,
                                        out_dtype))

    def produce(name: str) -> np.ndarray:
        parts = sorted(sources[name], key=lambda s: s[0].rows or (0,))
        if len(parts) == 1:
            return part(*parts[0])
        return np.concatenate([part(*p) for p in parts], axis=0)

    def finish(staging: Path) -> None:
        stored = str(entries[0][2]) if entries else "float32"
        hf = families.to_hf(cfg, architecture, dtype=stored)
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if tokenizer:
            copy_tokenizer(tokenizer, staging)

    return write_hf_folder(Path(path), entries, produce, finish,
                           max_shard_bytes=max_shard_bytes)


def copy_tokenizer(source: str | Path, folder: Path) -> None:
    """Copy a ``tokenizer.json`` (or a folder's tokenizer files) into ``folder``."""
    source = Path(source)
    files = [source] if source.is_file() else [source / f for f in TOKENIZER_FILES
                                               if (source / f).is_file()]
    for f in files:
        if f.resolve() != (folder / f.name).resolve():
            shutil.copyfile(f, folder / f.name)


__all__ = ["MAX_SHARD_BYTES", "check_tensors", "copy_tokenizer", "load", "save"]
