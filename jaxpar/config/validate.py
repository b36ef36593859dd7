"""Checking a run config whole, before anything heavy (devices, model, compile) starts.

:func:`check_config` range-checks every field and cross-checks the fields that constrain
each other (sequence length and the model's context, the global batch and the
data-parallel size, pipeline stages and layers). Each failure is one
:class:`~jaxpar.errors.JaxparError` naming the key, its value and what would be valid, e.g.
``train.lr=-1.0: must be a positive number``. The checks that need the device count (the
mesh, the batch split) run when it is given; reading it does not start a model.

``jaxpar train``, ``jaxpar inspect`` and :func:`jaxpar.config.assembly.assemble` all run it, so a
run that starts has a config that makes sense.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.sharding import AbstractMesh

from jaxpar.config.schema import (
    HF_PREFIX,
    MESH_SIZE_KEYS,
    Config,
    DataConfig,
    PlanConfig,
    hf_folder,
)
from jaxpar.data.documents import document_files, uses_documents
from jaxpar.data.shards import TOKEN_DTYPES, names_shards, shard_paths
from jaxpar.errors import JaxparError, JaxparWarning
from jaxpar.models.config import TransformerConfig
from jaxpar.parallel.pipeline import KINDS as PIPELINE_KINDS
from jaxpar.parallel.pipeline import Schedule
from jaxpar.sharding.annotations import pairs
from jaxpar.sharding.mesh import MESH_AXES, mesh_sizes
from jaxpar.sharding.plan import check_knob, check_knob_pairs, knobs
from jaxpar.sharding.rules import PRESETS, preset
from jaxpar.storage.folders import refuse_url
from jaxpar.storage.remote import check_bucket, check_url, filesystem, is_remote
from jaxpar.training.optimizer import OPTIMIZERS


def _bad(key: str, value: Any, valid: str) -> JaxparError:
    return JaxparError(f"{key}={value!r}: {valid}")


_Check = tuple[Callable[[Any], bool], str]

_AT_LEAST_1: _Check = (lambda v: v >= 1, "must be at least 1")
_AT_LEAST_0: _Check = (lambda v: v >= 0, "must be 0 or more")
_POSITIVE: _Check = (lambda v: math.isfinite(v) and v > 0, "must be a positive number")
_NON_NEGATIVE: _Check = (lambda v: math.isfinite(v) and v >= 0, "must be 0 or a positive number")
_FRACTION: _Check = (lambda v: 0 <= v < 1, "must be a fraction in [0, 1)")

_RANGES: dict[str, _Check] = {
    "pipeline.microbatches": (lambda v: v >= 0, "must be 0 (one per stage) or more"),
    "pipeline.repeats": (lambda v: v >= 0, "must be 0 (as many as the layers allow) or more"),
    "pipeline.layers_per_stage": (lambda v: v >= 0, "must be 0 (from the schedule) or more"),
    "train.steps": _AT_LEAST_1,
    "train.global_batch": _AT_LEAST_1,
    "train.seq_len": _AT_LEAST_1,
    "train.lr": _POSITIVE,
    "train.warmup_steps": _AT_LEAST_0,
    "train.weight_decay": _NON_NEGATIVE,
    "train.grad_clip": (lambda v: math.isfinite(v) and v >= 0,
                        "must be 0 (no clipping) or a positive number"),
    "train.seed": _AT_LEAST_0,
    "train.log_every": _AT_LEAST_1,
    "train.eval_every": (lambda v: v >= 0, "must be 0 (no evaluation) or more"),
    "train.eval_batches": _AT_LEAST_1,
    "data.max_bytes": _AT_LEAST_1,
    "data.holdout_fraction": _FRACTION,
    "checkpoint.every": (lambda v: v >= 0, "must be 0 (only at the end) or more"),
    "checkpoint.keep": _AT_LEAST_1,
    "checkpoint.local_every": (lambda v: v >= 0, "must be 0 (only on SIGTERM) or more"),
    "checkpoint.local_keep": _AT_LEAST_1,
    "checkpoint.preempt_grace_s": _POSITIVE,
    "lora.alpha": _POSITIVE,
    "diloco.sync_every": (lambda v: v >= 0, "must be 0 (off) or more"),
    "diloco.outer_lr": _POSITIVE,
    "diloco.outer_momentum": (lambda v: 0 <= v < 1, "must be a fraction in [0, 1)"),
    "diloco.fragments": _AT_LEAST_1,
    "diloco.staleness": _AT_LEAST_0,
    "diloco.outer_bits": (lambda v: v in (8, 32), "must be 32 (float32) or 8 (int8)"),
}


def _value(config: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _check_ranges(config: Config) -> None:
    for key, (ok, valid) in _RANGES.items():
        value = _value(config, key)
        if not ok(value):
            raise _bad(key, value, valid)
    m = config.mesh
    for name in MESH_SIZE_KEYS:
        size = getattr(m, name)
        if size == 0 or size < -1:
            raise _bad(f"mesh.{name}", size, "must be at least 1, or -1 (filled from the "
                       "device count)")
    free = [a for a in MESH_AXES if getattr(m, a) == -1]
    if len(free) > 1:
        raise JaxparError(f"mesh axes {', '.join(f'mesh.{a}' for a in free)} are all -1: at "
                          "most one axis may be filled from the device count")
    if any(getattr(m, f"dcn_{a}") == -1 for a in MESH_AXES):
        raise JaxparError("mesh.dcn_* sizes must be given (at least 1), not -1")


def _check_choices(config: Config) -> None:
    p, t = config.plan, config.train
    if p.rules not in PRESETS:
        raise _bad("plan.rules", p.rules, f"choose one of {list(PRESETS)}")
    for knob in knobs():
        check_knob(knob.name, getattr(p, knob.name), f"plan.{knob.name}")
    check_knob_pairs(p)
    if config.pipeline.schedule not in PIPELINE_KINDS:
        raise _bad("pipeline.schedule", config.pipeline.schedule,
                   f"choose one of {list(PIPELINE_KINDS)}")
    if p.offload_params and config.mesh.stage > 1:
        raise _bad("plan.offload_params", True, "streams the layers of one layer loop; it "
                   "does not combine with pipeline stages (mesh.stage > 1)")
    layouts = () if p.layouts == "auto" else p.layouts
    for key, items in (("plan.annotations", p.annotations), ("plan.layouts", layouts)):
        for pattern, _ in pairs(items, key):
            if isinstance(pattern, str) and not pattern.startswith("type:"):
                _regex(key, pattern)
    if t.optimizer not in OPTIMIZERS:
        raise _bad("train.optimizer", t.optimizer, f"choose one of {list(OPTIMIZERS)}")
    if t.trainable not in ("", "lora", "all"):
        _regex("train.trainable", t.trainable)
    if config.pipeline.split and not config.model.factory:
        raise _bad("pipeline.split", config.pipeline.split, "divides a model.factory model "
                   "into stages; the built-in model needs none")
    for key in ("train.loss", "model.factory", "pipeline.split"):
        spec = _value(config, key)
        if spec and not re.fullmatch(r"[\w.]+[:.][\w.]+", spec):
            raise _bad(key, spec, "must look like package.module:function")
    if t.profile_steps:
        check_profile_steps(list(t.profile_steps))
    check_trackers(list(t.trackers) if isinstance(t.trackers, list | tuple) else t.trackers)
    if not (math.isfinite(t.peak_flops) and (t.peak_flops == 0 or t.peak_flops >= 1e9)):
        raise _bad("train.peak_flops", t.peak_flops, "must be 0 (the catalog's) or the "
                   "peak FLOP/s of one device, at least 1e9 (an H100's bf16 is 9.89e14)")


def check_profile_steps(steps: Any) -> None:
    """Validate ``train.profile_steps``: None or empty (off), or ``[a, b]``, two ints with
    ``1 <= a <= b`` (trace steps a..b inclusive); else a :class:`JaxparError` naming the key,
    the value and what is valid."""
    if steps is None or (isinstance(steps, list | tuple) and not steps):
        return
    if not (isinstance(steps, list | tuple) and len(steps) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
            and 1 <= steps[0] <= steps[1]):
        raise JaxparError(f"train.profile_steps={steps!r} is invalid; expected [a, b], two "
                          "integer step numbers with 1 <= a <= b (empty turns it off)")


def _regex(key: str, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as err:
        raise _bad(key, pattern, f"is not a valid regular expression ({err})") from None


def _check_relations(config: Config) -> None:
    t, d, model = config.train, config.data, config.model
    if not model.factory and t.seq_len > model.max_seq_len:
        raise JaxparError(f"train.seq_len={t.seq_len} is longer than model.max_seq_len="
                          f"{model.max_seq_len}: lower train.seq_len or raise "
                          "model.max_seq_len")
    if t.eval_every > 0 and d.holdout_fraction == 0:
        raise JaxparError(f"train.eval_every={t.eval_every} evaluates held-out data, but "
                          "data.holdout_fraction=0 holds none out: set a fraction such as "
                          "0.05, or train.eval_every=0")
    if t.global_batch % config.plan.microbatches:
        raise JaxparError(f"train.global_batch={t.global_batch} does not split into "
                          f"plan.microbatches={config.plan.microbatches} equal microbatches")
    if d.eos_id < -1 or (not config.model.factory and d.eos_id >= config.model.vocab_size):
        raise _bad("data.eos_id", d.eos_id, f"must be -1 (no document masks) or an id below "
                   f"model.vocab_size={config.model.vocab_size}")
    if d.eos_id >= 0 and config.mesh.stage > 1:
        raise JaxparError(f"packed documents (data.eos_id={d.eos_id}) with mesh.stage > 1 "
                          "are not supported yet: set data.eos_id to -1 or mesh.stage to 1")
    if d.eos_id >= 0 and config.mesh.context > 1 and config.plan.context_balance:
        raise JaxparError(f"packed documents (data.eos_id={d.eos_id}) under context "
                          "parallelism need the natural sequence order: set "
                          "plan.context_balance=false (or data.eos_id to -1)")
    for i, entry in enumerate(d.sources):
        if isinstance(entry, dict):
            check_url(entry.get("path", ""), f"data.sources[{i}].path")
    check_url(d.source, "data.source")
    check_url(config.init_from, "init_from")
    if config.init_from.startswith(HF_PREFIX):
        refuse_url(config.init_from[len(HF_PREFIX):], "init_from hf:")
    if d.chat:
        _check_chat(config)
    documents = not d.chat and uses_documents(d.source, d.sources, d.tokenizer)
    shards = not d.chat and not documents and (bool(d.sources) or names_shards(d.source))
    _check_data_knobs(config, documents, shards)
    if documents:
        _check_documents(config)
    elif shards:
        _check_sources(config)
    elif d.source != "stdlib" and not Path(d.source).exists():
        raise _bad("data.source", d.source, "is neither 'stdlib' nor an existing file or "
                   "folder (or a glob of token shards)")
    if d.tokenizer:
        _check_tokenizer(d.tokenizer, d.source if not d.sources else "", d.field)
    elif d.field != DataConfig.field:
        raise JaxparError(f"data.field={d.field!r} picks the text of .jsonl records for "
                          "data.tokenizer, which is not set: set data.tokenizer (without "
                          "one, the file's raw bytes are the tokens)")
    _check_unused_model_knobs(config)
    dl = config.diloco
    if dl.sync_every and dl.sync_every % dl.fragments:
        raise _bad("diloco.fragments", dl.fragments, f"must divide diloco.sync_every="
                   f"{dl.sync_every} (each fragment meets once every sync_every steps)")
    if dl.overlap and dl.staleness:
        raise _bad("diloco.overlap", dl.overlap, f"applies each outer gradient one inner "
                   f"step late; diloco.staleness={dl.staleness} delays it by meetings: "
                   f"choose one")
    if dl.sync_every and config.mesh.data * config.mesh.dcn_data < 2:
        raise JaxparError("diloco.sync_every runs one replica per index of the data axis: "
                          "give the mesh data >= 2 (on a multislice machine, mesh.dcn_data "
                          "= the slices)")
    hf = hf_folder(config.init_from)
    if hf is not None and not (hf / "config.json").is_file():
        raise _bad("init_from", config.init_from, "is not a Hugging Face model folder (no "
                   "config.json)")
    if is_remote(config.init_from):
        check_bucket(config.init_from, "init_from")
        if not filesystem(config.init_from, "init_from").isdir(config.init_from):
            raise _bad("init_from", config.init_from, "is not a folder in the bucket (give a "
                       "run folder or its checkpoints/ folder)")
    elif config.init_from and hf is None and not Path(config.init_from).expanduser().is_dir():
        raise _bad("init_from", config.init_from, "is not a folder (give a run folder or its "
                   "checkpoints/ folder, or hf:PATH for a Hugging Face model)")


def _check_chat(config: Config) -> None:
    """``data.chat``: conversations in ``data.source`` (a .jsonl file or a folder, local or
    in a bucket, whose objects are listed when read), the template of ``data.tokenizer``,
    segments kept apart by the loader itself."""
    d = config.data
    if not d.tokenizer:
        raise JaxparError("data.chat=true renders conversations with a chat template: set "
                          "data.tokenizer to a Hugging Face tokenizer folder (tokenizer.json "
                          "and tokenizer_config.json with its chat_template)")
    if d.sources:
        raise JaxparError("data.chat=true reads the conversations of data.source; "
                          "data.sources mixes token shards or documents: drop it")
    if d.eos_id != -1 or d.cross_document:
        raise JaxparError("data.chat=true puts one conversation in a row, kept apart from "
                          "its padding: drop data.eos_id and data.cross_document")
    if d.source == "stdlib" or not (is_remote(d.source) or Path(d.source).is_dir()
                                    or Path(d.source).suffix == ".jsonl"):
        raise _bad("data.source", d.source, "with data.chat=true, must be a .jsonl file of "
                   "conversations or a folder of them")
    if config.mesh.stage > 1:
        raise JaxparError("data.chat=true with mesh.stage > 1 is not supported yet (the "
                          "rows are packed): set mesh.stage to 1")
    if config.mesh.context > 1 and config.plan.context_balance:
        raise JaxparError("data.chat=true under context parallelism needs the natural "
                          "sequence order: set plan.context_balance=false")


def _check_data_knobs(config: Config, documents: bool, shards: bool) -> None:
    """Knobs that would do nothing for this kind of data are mistakes, not no-ops:
    ``data.token_dtype`` on text (it reads ``.bin`` ids), ``data.cross_document``
    beside anything but documents tokenized as read."""
    d = config.data
    text = d.source == "stdlib" or Path(d.source).suffix not in (".bin", ".npy")
    if d.token_dtype != DataConfig.token_dtype and (documents or d.tokenizer
                                                    or (not shards and text)):
        raise JaxparError(f"data.token_dtype={d.token_dtype} is the id type of .bin token "
                          f"shards, but data.source {d.source!r} is text: drop it")
    if d.cross_document and not documents:
        raise JaxparError("data.cross_document=true applies to documents tokenized as read "
                          "(data.tokenizer with document files); other data runs across "
                          "documents with data.eos_id=-1: drop it")


def _check_sources(config: Config) -> None:
    """``data.sources`` (or a glob as ``data.source``): entries ``{path, weight}`` whose
    shards exist, and no text-only knob beside them."""
    d = config.data
    if d.token_dtype not in TOKEN_DTYPES:
        raise _bad("data.token_dtype", d.token_dtype, f"choose one of {list(TOKEN_DTYPES)}")
    if d.tokenizer:
        raise JaxparError("data.tokenizer reads text; token shards (data.sources, or a glob "
                          "as data.source) hold ids already: drop one")
    if d.sources and d.source != DataConfig.source:
        raise JaxparError(f"data.sources replaces data.source={d.source!r}: give one")
    for i, entry in enumerate(d.sources or [{"path": d.source}]):
        key = f"data.sources[{i}]" if d.sources else "data.source"
        _check_entry(key, entry, "GLOB_OR_FOLDER")
        shard_paths(entry["path"])


_MOE_KNOBS = ("experts_per_token", "expert_d_ff", "expert_capacity", "n_shared_experts",
              "router_aux_loss", "router_z_loss", "renormalize_gates")


def _check_unused_model_knobs(config: Config) -> None:
    """Knobs that would do nothing in this model are mistakes, not no-ops."""
    model = config.model
    if model.factory:
        return
    defaults = TransformerConfig()
    if not model.n_experts:
        for name in _MOE_KNOBS:
            if getattr(model, name) != getattr(defaults, name):
                raise JaxparError(f"model.{name}={getattr(model, name)!r} configures experts, "
                                  "but model.n_experts=0 (a dense model): set "
                                  "model.n_experts or drop the knob")


def _check_documents(config: Config) -> None:
    """Document sources (``data.sources`` or a ``data.source`` of document files, with
    ``data.tokenizer``): entries ``{path, weight}`` whose files exist and are documents."""
    d = config.data
    if d.sources and d.source != DataConfig.source:
        raise JaxparError(f"data.sources replaces data.source={d.source!r}: give one")
    if d.workers < 1:
        raise _bad("data.workers", d.workers, "must be at least 1")
    for i, entry in enumerate(d.sources or [{"path": d.source}]):
        key = f"data.sources[{i}]" if d.sources else "data.source"
        _check_entry(key, entry, "GLOB_FOLDER_OR_FILE")
        document_files(entry["path"])


def _check_entry(key: str, entry: object, what: str) -> None:
    """A mixture entry: ``{path: ..., weight: positive number}``."""
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or set(
            entry) - {"path", "weight"}:
        raise _bad(key, entry, f"must be {{path: {what}, weight: NUMBER}}")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not (
            math.isfinite(weight) and weight > 0):
        raise _bad(f"{key}.weight", weight, "must be a positive number")


def _check_tokenizer(tokenizer: str, source: str, field: str) -> None:
    """With ``data.tokenizer``: a tokenizer that exists, over text (not ids or the corpus)."""
    if source == "stdlib" or Path(source).suffix in (".npy", ".bin"):
        raise _bad("data.source", source, "with data.tokenizer set, must be a text file, a "
                   "folder or a .jsonl file (not 'stdlib', a .npy or a .bin of token ids)")
    path = Path(tokenizer).expanduser()
    if not (path / "tokenizer.json" if path.is_dir() else path).is_file():
        raise _bad("data.tokenizer", tokenizer, "is neither a tokenizer.json file nor a "
                   "folder holding one")
    if not field:
        raise _bad("data.field", field, "must name the key of each .jsonl record's text")


def _check_layout(config: Config, devices: int, processes: int) -> None:
    """The checks that need the device count: mesh, batch split, pipeline, strict rules."""
    m, t, p = config.mesh, config.train, config.plan
    if devices < 1:
        raise JaxparError(f"{devices} devices: a run needs at least one")
    ici, dcn = mesh_sizes(m.ici(), m.dcn(), devices)
    sizes = {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn, strict=True)}
    if t.global_batch % processes:
        raise JaxparError(f"train.global_batch={t.global_batch} is not divisible by the "
                          f"{processes} processes of this run")
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    param_rules, act_rules = preset(p.rules, strict=p.strict)
    batch_axes = [a for r in act_rules.resolve(("batch",), mesh) for a in r.mesh_axes]
    dp = math.prod(sizes[a] for a in batch_axes)
    micro = t.global_batch // p.microbatches
    if micro % dp:
        split = f" (each of plan.microbatches={p.microbatches} holds {micro})" if (
            p.microbatches > 1) else ""
        axes = " x ".join(f"{a}={sizes[a]}" for a in batch_axes)
        raise JaxparError(
            f"train.global_batch={t.global_batch}{split} is not divisible by the "
            f"data-parallel size {dp} ({axes} under plan.rules={p.rules}): use a multiple "
            f"of {dp * p.microbatches}")
    _check_sequence_and_experts(config, sizes)
    if config.model.attention == "cudnn" and not config.model.factory \
            and jax.default_backend() != "gpu":
        raise JaxparError(f"model.attention='cudnn' needs an NVIDIA GPU (cuDNN), but this "
                          f"run's backend is {jax.default_backend()}: use "
                          "model.attention=auto (the best this backend has)")
    if sizes["context"] > 1 and (config.diloco.sync_every or p.compress_gradients != "none"):
        other = ("diloco.sync_every" if config.diloco.sync_every
                 else f"plan.compress_gradients={p.compress_gradients}")
        raise JaxparError(f"{other} runs the step manual over the data axis, and "
                          "context-parallel attention cannot run inside it (XLA's SPMD "
                          "partitioner aborts on the nested shard_map): set mesh.context "
                          "to 1, or drop one")
    if sizes["stage"] > 1:
        if config.model.factory and not config.pipeline.split:
            raise JaxparError(STAGES_NEED_SPLIT)
        kind = config.pipeline.schedule
        if kind in ("1f1b", "interleaved_1f1b") and (
                config.diloco.sync_every or p.compress_gradients != "none"):
            other = ("diloco.sync_every" if config.diloco.sync_every
                     else f"plan.compress_gradients={p.compress_gradients}")
            raise JaxparError(f"pipeline.schedule={kind} runs the backward pass inside its "
                              f"own shard_map, which {other} cannot enter: use "
                              "pipeline.schedule=circular or gpipe")
        pipe_microbatches = (config.pipeline.microbatches or sizes["stage"]
                             if config.model.factory
                             else pipeline_for(config, sizes["stage"]).microbatches)
        if micro % (pipe_microbatches * dp):
            raise JaxparError(
                f"train.global_batch={t.global_batch} does not split into "
                f"{pipe_microbatches} pipeline microbatches (pipeline.microbatches) of "
                f"equal size on each of the {dp} data-parallel devices: use a multiple of "
                f"{pipe_microbatches * dp * p.microbatches}")
    if p.strict and not config.model.factory:
        model = config.model
        dims = {"vocab": ("model.vocab_size", model.vocab_size),
                "mlp": ("model.d_ff", model.d_ff),
                "heads": ("model.n_heads", model.n_heads),
                "kv_heads": ("model.n_kv_heads", model.n_kv_heads),
                "embed": ("model.d_model", model.d_model)}
        for name, (key, size) in dims.items():
            try:
                param_rules.resolve((name,), mesh, shape=(size,), path=key)
            except JaxparError as err:
                raise JaxparError(f"plan.strict=true: {err}") from None


STAGES_NEED_SPLIT = ("mesh.stage > 1 with a model.factory model needs pipeline.split: "
                     "package.module:NAME of a jaxpar.StageSplit saying where the model's "
                     "embedding, blocks and head are (or set mesh.stage=1)")
"""The refusal of pipeline stages for a model jaxpar cannot divide into them."""


def pipeline_for(config: Config, stages: int) -> Schedule:
    """The config's pipeline schedule on ``stages`` stages (``pipeline.*`` filled in)."""
    pipe = config.pipeline
    return Schedule.for_model(config.model.n_layers, stages, pipe.microbatches, pipe.repeats,
                              pipe.layers_per_stage, pipe.schedule)


def _check_sequence_and_experts(config: Config, sizes: dict[str, int]) -> None:
    """Context parallelism splits the sequence, expert parallelism the experts: both must
    divide evenly (a silent fallback would replicate what the user asked to split)."""
    m, t, model = config.mesh, config.train, config.model
    c = sizes["context"]
    if c > 1:
        chunks = 2 * c if config.plan.context_balance else c
        if t.seq_len % chunks:
            why = (" (plan.context_balance lays it out in 2 x context chunks)"
                   if config.plan.context_balance else "")
            raise JaxparError(f"train.seq_len={t.seq_len} does not split into {chunks} equal "
                              f"chunks over mesh.context={m.context}{why}: use a multiple "
                              f"of {chunks}")
        if sizes["stage"] > 1:
            raise JaxparError("mesh.context > 1 with mesh.stage > 1 is not supported yet: "
                              "use context parallelism without pipeline stages")
    if sizes["stage"] > 1 and model.n_experts and not model.factory:
        raise JaxparError("model.n_experts > 0 with mesh.stage > 1 is not supported yet: "
                          "train a mixture of experts with expert, fsdp, tensor or context "
                          "parallelism")
    if sizes["expert"] > 1 and model.n_experts and not model.factory \
            and model.expert_capacity == 0:
        raise JaxparError(f"model.expert_capacity=0 (dropless experts) with mesh.expert="
                          f"{sizes['expert']} is not supported: the dropless path would "
                          "gather every expert on every device; give a capacity factor "
                          "(e.g. model.expert_capacity=1.25) or set mesh.expert=1")
    if (sizes["expert"] > 1 and model.n_experts and not model.factory
            and model.n_experts % sizes["expert"]):
        raise JaxparError(f"model.n_experts={model.n_experts} is not divisible by "
                          f"mesh.expert={sizes['expert']}: every device must hold the "
                          "same number of experts")


def _check_local_tier(config: Config) -> None:
    """The fast checkpoint tier: a local folder (``{process}`` the one placeholder)."""
    c = config.checkpoint
    if c.local_every and not c.local_dir:
        raise _bad("checkpoint.local_every", c.local_every, "needs checkpoint.local_dir (a "
                   "folder on each host's own disk for the fast tier)")
    if not c.local_dir:
        return
    refuse_url(c.local_dir, "checkpoint.local_dir")
    other = re.findall(r"\{(?!process\})[^}]*\}?", c.local_dir)
    if other:
        raise _bad("checkpoint.local_dir", c.local_dir, f"{other[0]} is no placeholder: "
                   "{process} (the process index) is the only one")


def check_config(config: Config, *, devices: int | None = None, processes: int = 1) -> None:
    """Check every field of ``config`` and how they fit together.

    Args:
      config: the run config (its types were checked when it was loaded).
      devices: the number of devices the run will use; with it, the mesh, the batch split
        over the data-parallel axes, the pipeline schedule and (``plan.strict``) the
        divisibility of the model's dimensions are checked too.
      processes: processes of a multi-process run (the global batch must split over them).

    Raises:
      JaxparError: for the first problem found, naming the key, its value and what would
        be valid.
    """
    _check_ranges(config)
    _check_choices(config)
    _check_relations(config)
    _check_local_tier(config)
    if devices is not None:
        _check_layout(config, devices, processes)
    for text in no_op_knobs(config):  # shown once a process however often it is checked
        warnings.warn(text, JaxparWarning, stacklevel=1)


def no_op_knobs(config: Config) -> list[str]:
    """One line for each knob that would do nothing in the run as configured (set, but
    its feature is off, or it would never act): a warning at start, not a silent no-op."""
    p, pipe, found = config.plan, config.pipeline, []
    if p.quantize == "none":
        changed = [k for k in ("quantize_target", "quantize_exclude")
                   if getattr(p, k) != getattr(PlanConfig, k)]
        if changed:
            found.append(f"plan.{changed[0]} picks the matmuls plan.quantize quantizes, but "
                         "plan.quantize is none: it does nothing")
    if p.remat_blocks and p.remat == "none":
        found.append(f"plan.remat_blocks={p.remat_blocks!r} picks the blocks plan.remat "
                     "recomputes, but plan.remat is none: it does nothing (set plan.remat, "
                     "e.g. plan.remat=full)")
    elif p.remat_blocks and not config.model.factory:
        found.append(f"plan.remat_blocks={p.remat_blocks!r} picks a model.factory model's "
                     "blocks; jaxpar's own model applies plan.remat to each of its blocks "
                     "itself: it does nothing")
    if config.mesh.stage == 1 and config.mesh.dcn_stage == 1:
        set_ = [f"pipeline.{f.name}" for f in dataclasses.fields(pipe)
                if getattr(pipe, f.name) != f.default]
        if set_:
            found.append(f"{', '.join(set_)} configure pipeline stages, but mesh.stage is 1: "
                         "they do nothing")
    dl = config.diloco
    if dl.sync_every and dl.sync_every > config.train.steps:
        found.append(f"diloco.sync_every={dl.sync_every} is more than train.steps="
                     f"{config.train.steps}: the replicas never meet in this run")
    return found


TRACKERS: tuple[str, ...] = ("jsonl", "tensorboard", "wandb")


def check_trackers(names: Any) -> None:
    """Refuse, in one line, an unknown tracker or a missing ``wandb`` package."""
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise JaxparError(f"train.trackers={names!r}: give a list of {', '.join(TRACKERS)}")
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise JaxparError(f"train.trackers: {unknown[0]!r} is not a tracker; choose from "
                          f"{', '.join(TRACKERS)}")
    if "wandb" in names:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise JaxparError("train.trackers: wandb needs the wandb package (pip install "
                              "wandb)") from None
