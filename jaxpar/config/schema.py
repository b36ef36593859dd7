"""Run configuration: typed dataclasses loaded from YAML plus ``dotted.key=value`` overrides.

Sections: ``model`` (the :class:`~jaxpar.models.TransformerConfig` fields, or a user's
model: ``model.factory: package.module:function``), ``mesh`` (axis sizes), ``plan`` (rules
preset, annotations, layouts, ZeRO, precision, remat), ``train`` (steps, batch, optimizer,
loss) and ``data`` (the corpus), ``lora``, ``pipeline``, ``checkpoint``, and the top-level
``init_from`` (weights to start from). An unknown key anywhere is an error that names it
and suggests the closest valid key. Turning a config into a run is
:mod:`jaxpar.config.assembly`'s job.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from jaxpar.adapters.lora import LoraConfig
from jaxpar.config.yaml_files import read_yaml
from jaxpar.errors import JaxparError
from jaxpar.hf.families import merge_model, read_config
from jaxpar.models.config import TransformerConfig
from jaxpar.sharding.mesh import MESH_AXES
from jaxpar.sharding.plan import AUTO_KNOBS, Plan, knobs


@dataclasses.dataclass(frozen=True)
class ModelConfig(TransformerConfig):
    """The ``model`` section: the built-in decoder's sizes, or a model of the user's own.

    ``factory``: ``package.module:function`` returning a Flax NNX model; it is called with
    ``kwargs`` as keyword arguments, plus ``rngs=nnx.Rngs(train.seed)`` when it takes
    ``rngs``. With a factory, the built-in decoder's fields are unused except
    ``vocab_size``, against which the token data are checked.
    """

    factory: str = ""
    kwargs: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments ``factory`` is called with (a mapping of the user's own keys)."""

    def transformer(self) -> TransformerConfig:
        """The built-in decoder's own config (without the factory fields)."""
        names = {f.name for f in dataclasses.fields(TransformerConfig)}
        return TransformerConfig(**{k: v for k, v in vars(self).items() if k in names})


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes within a slice (one may be -1) and, for multi-slice runs, across slices.

    ``explicit``: JAX's explicit sharding mode (``AxisType.Explicit``) for models that call
    ``jax.sharding.reshard`` or pass ``out_sharding=``."""

    data: int = -1
    """Data-parallel replicas (each a copy of the model, its own share of the batch); -1:
    the devices the other axes leave."""
    stage: int = 1
    """Pipeline stages (see the ``pipeline`` section)."""
    fsdp: int = 1
    """Fully sharded data parallelism: weights (and optimizer state) split over this axis,
    gathered layer by layer."""
    expert: int = 1
    """Expert parallelism: a mixture of experts' experts split over this axis."""
    context: int = 1
    """Context parallelism: each sequence split over this axis
    (``plan.context_attention``)."""
    tensor: int = 1
    """Tensor (Megatron) parallelism: each layer's matmuls split over this axis."""
    dcn_data: int = 1
    """Slices (over the data-center network) the ``data`` axis also spans; 1: one slice."""
    dcn_stage: int = 1
    """Slices the ``stage`` axis also spans."""
    dcn_fsdp: int = 1
    """Slices the ``fsdp`` axis also spans."""
    dcn_expert: int = 1
    """Slices the ``expert`` axis also spans."""
    dcn_context: int = 1
    """Slices the ``context`` axis also spans."""
    dcn_tensor: int = 1
    """Slices the ``tensor`` axis also spans."""
    explicit: bool = False

    def ici(self) -> dict[str, int]:
        """Axis sizes inside one slice."""
        return {a: getattr(self, a) for a in MESH_AXES}

    def dcn(self) -> dict[str, int] | None:
        """Slices per axis, or None for a single slice."""
        d = {a: getattr(self, f"dcn_{a}") for a in MESH_AXES}
        return d if any(v != 1 for v in d.values()) else None


def _plan_section() -> type:
    """The ``plan`` section's dataclass: the rules preset, then one field per Plan knob
    (:func:`jaxpar.sharding.plan.knobs`, with its default; a knob read from text, the
    precision policy, is a string here), then ``strict``. Defined by the Plan alone, so a
    new knob needs no change here."""
    hints = typing.get_type_hints(Plan)
    fields: list[tuple[str, Any, Any]] = [("rules", str, dataclasses.field(default="fsdp_tp"))]
    for f in knobs():
        textual = f.metadata["knob"].parse is not None
        default = "auto" if f.name in AUTO_KNOBS else str(f.default) if textual else f.default
        fields.append((f.name, str if textual else hints[f.name],
                       dataclasses.field(default=default)))
    fields.append(("strict", bool, dataclasses.field(default=False)))
    return dataclasses.make_dataclass("PlanConfig", fields, frozen=True, namespace={
        "__doc__": _PLAN_DOC, "__module__": __name__})


_PLAN_DOC = """Layout and memory knobs: rules preset (dp, fsdp, tp, fsdp_tp), ZeRO stage, precision
    policy, remat policy and gradient-accumulation microbatches.

    ``rules``: the preset of logical-name-to-mesh-axis rules: ``dp``, ``fsdp``, ``tp`` or
    ``fsdp_tp`` (see :mod:`jaxpar.sharding.rules`).

    ``annotations``: ``[[path regex, [logical names]], ...]`` for variables (see
    :func:`jaxpar.annotate`). ``layouts``: ``[[path regex or "type:ClassName", [logical
    names]], ...]`` for module outputs (see :func:`jaxpar.constrain_outputs`); ``auto``
    (the default) pins the outputs of a model's repeated blocks, ``[]`` nothing. ``strict``:
    a dimension its rule's mesh axes do not divide is an error instead of falling through
    to the next rule. ``sequence_parallel``: split the residual stream's sequence over the
    tensor axis (Megatron sequence parallelism). ``context_attention``: ``allgather`` or
    ``ring``, how attention spans a sequence split over the ``context`` mesh axis;
    ``context_balance``: reorder sequence chunks so causal work is even across it.
    ``vocab_over_fsdp``: split the vocabulary (embedding table, output head, logits) over
    ``fsdp`` (and ``stage``) as well as ``tensor``, so the head is never gathered;
    ``auto`` (the default): what the planner picks for the model, mesh and batch,
    resolved when the run is assembled (``jaxpar train``, ``compile`` and ``inspect``,
    ``jaxpar.assemble``, ``jaxpar.build_trainer``) and said in one line (see
    :mod:`jaxpar.planner.auto`)."""
PlanConfig = _plan_section()


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism, used when the mesh's ``stage`` axis is larger than 1.

    ``schedule``: ``circular`` or ``gpipe`` (forward pass pipelined, ``jax.grad`` runs it
    back: activations of all microbatches kept), ``1f1b`` or ``interleaved_1f1b`` (forward
    and backward one microbatch each per tick: activations of about ``stages``
    microbatches kept). ``microbatches`` 0: one per stage (M = S). ``repeats``: chunks per
    stage (``circular``, ``interleaved_1f1b``; 0: as many as the layers allow, 1 for the
    others). ``layers_per_stage``: layers in each chunk (0: all of a stage's layers for
    ``gpipe`` and ``1f1b``, 1 otherwise); n_layers = stages x repeats x layers_per_stage.
    ``split``: for a ``model.factory`` model, ``package.module:NAME`` of a
    :class:`jaxpar.StageSplit` (or a function returning one) saying where its
    embedding, blocks and head are (see :mod:`jaxpar.parallel.staged`); the number of
    blocks then stands for ``model.n_layers``.
    """

    schedule: str = "circular"
    microbatches: int = 0
    """Microbatches each step's batch is split into for the pipeline; 0: one per stage."""
    repeats: int = 0
    layers_per_stage: int = 0
    split: str = ""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and schedule. ``trainable``: which parameters train: ``lora``, ``all``,
    or a regex over parameter paths; empty means ``lora`` when LoRA is enabled, else all.
    ``eval_every``: every this many steps (and at the end) log ``eval_loss``, the mean loss
    on the first ``eval_batches`` batches of the held-out data; 0 turns it off.
    ``loss``: ``package.module:function`` with ``fn(model, batch) -> scalar``; empty means
    next-token cross-entropy (:func:`jaxpar.training.trainer.lm_loss`). ``profile_steps``:
    ``[a, b]`` writes a ``jax.profiler`` trace of steps a..b to ``OUT/profile``.
    ``compile_cache``: JAX's persistent compilation cache (see
    :mod:`jaxpar.runs.compile_cache`): ``auto`` (``~/.cache/jaxpar/xla``, or
    ``$JAX_COMPILATION_CACHE_DIR``), ``off``, or a folder; a rerun loads its compiled
    step out of that folder instead of compiling it again."""

    steps: int = 200
    """Optimizer steps of the whole run (a resumed run continues to this step)."""
    global_batch: int = 16
    """Sequences per step over all devices (split over the data-parallel axes and
    processes)."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 3e-3
    """Peak learning rate: linear warmup to it over ``warmup_steps``, cosine decay to a
    tenth of it by ``steps``."""
    warmup_steps: int = 10
    """Steps of the learning rate's linear warmup."""
    weight_decay: float = 0.01
    """Decoupled weight decay (``adamw``, ``lion``) of the weight matrices (not of norm
    scales and biases)."""
    grad_clip: float = 1.0
    """Clip the gradients' global norm to this; 0: no clipping."""
    optimizer: str = "adamw"
    """``adamw``, ``adam``, ``sgd`` (momentum 0.9), ``lion`` or ``adafactor``."""
    seed: int = 0
    """Seed of the initial weights and the data order."""
    log_every: int = 1
    """Log a metrics row every this many steps (and the first, the last and any evaluated
    step)."""
    trainable: str = ""
    eval_every: int = 0
    eval_batches: int = 4
    """Held-out batches each evaluation (``eval_every``) averages over."""
    loss: str = ""
    profile_steps: tuple = ()
    compile_cache: str = "auto"
    trackers: tuple = ("tensorboard",)
    """Where metrics go: ``jsonl`` (``OUT/metrics.jsonl``, always written: the run's own
    record), ``tensorboard``, ``wandb`` (see :mod:`jaxpar.runs.trackers`)."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU, given by hand; 0: from ``train.catalog``, else
    the built-in chip catalog (GPUs and TPUs it knows), else no MFU."""
    catalog: str = ""
    """A chip catalog YAML (what ``jaxpar calibrate --out`` writes): MFU and the planner's
    prediction use its entry for this run's devices (by device kind; CPU devices: the
    entry ``jaxpar calibrate`` names ``cpuN`` for N devices, or the file's only entry)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from: ``stdlib`` (built in) or a text file, folder, .npy or .bin;
    or token shards (a glob, a folder of ``.bin``/``.npy`` files, local or ``s3://``, a
    weighted mixture of them in ``sources``), read in shuffled epochs
    (:mod:`jaxpar.data.mixture`); or, with ``tokenizer``, documents tokenized as they are
    read (globs of ``.jsonl``/``.jsonl.gz``/``.jsonl.zst``, Parquet, Arrow, ArrayRecord,
    Hugging Face ``datasets`` folders; :mod:`jaxpar.data.streams`)."""

    source: str = "stdlib"
    """Where the tokens come from (see above): ``stdlib`` (the Python standard library's
    source, built in), a text file, a folder, ``.npy``/``.bin`` token files, token shards or
    document files."""
    max_bytes: int = 8_000_000
    """Bytes read from ``stdlib`` or untokenized text (not from tokenized data, .npy or .bin)."""
    holdout_fraction: float = 0.05
    """The fraction of the data held out for evaluation (``train.eval_every``), never
    trained on."""
    tokenizer: str = ""
    """A ``tokenizer.json`` file or a folder holding one. Document files (see above) are
    tokenized with it as they are read; a text file, folder of text or one ``.jsonl`` once,
    into a cache beside the data (see :mod:`jaxpar.data.tokenizer`). Empty: text is read
    as bytes."""
    field: str = "text"
    """The key of each ``.jsonl`` record that holds its text (with ``tokenizer``)."""
    sources: list = dataclasses.field(default_factory=list)
    """A weighted mixture of token-shard sources, ``[{path: "web/*.bin", weight: 3},
    {path: "code/", weight: 1}]`` (each path a glob, a folder of shards or one file; see
    :mod:`jaxpar.data.mixture`); replaces ``source``. A glob or a folder of shards as
    ``source`` is a mixture of one."""
    workers: int = 4
    """Threads tokenizing documents as they are read (with ``tokenizer`` and document
    files)."""
    token_dtype: str = "uint16"
    """The id type of ``.bin`` token files and shards: ``uint16`` or ``uint32``. Shards
    ``jaxpar tokenize`` wrote must be read with the type their ``tokenize.json`` records
    (another is refused, as is this knob on text)."""
    eos_id: int = -1
    """The end-of-document id. With one (>= 0), rows are packed: each token gets its
    document's segment id, attention never crosses a document, RoPE positions restart at
    each, and the target after an end of document does not count. -1: rows run across
    documents. Documents tokenized as read are always packed, each ended by this id (-1:
    the tokenizer's EOS)."""
    cross_document: bool = False
    """Documents tokenized as read: rows without segment ids, attention running across
    documents (each still ended by EOS), for a model whose ``__call__`` takes no
    ``segment_ids``; the run says so in one warning line."""
    chat: bool = False
    """Supervised fine-tuning on conversations: ``source`` is a ``.jsonl`` file (or a
    folder of them) of ``{"messages": [{"role", "content"}, ...]}`` records, rendered with
    the chat template of ``tokenizer`` (a Hugging Face tokenizer folder), one
    conversation a row, the loss on the assistant's turns only
    (:mod:`jaxpar.data.conversations`)."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints under ``OUT/checkpoints`` (see :mod:`jaxpar.checkpoint`): a save every
    ``every`` steps (0: only at the end) and at the end, the newest ``keep`` kept, written
    in the background while training goes on when ``async_save``. ``on_preempt``: on
    SIGTERM (a preempted machine), save the current step before exiting, within
    ``preempt_grace_s`` seconds of the signal (what the scheduler allows before it kills).

    ``local_dir``: the fast tier (see :mod:`jaxpar.checkpoint.local_tier`; empty: off), a
    folder on each host's own disk (``{process}`` is replaced by the process index) where
    each process saves its own shards every ``local_every`` steps (0: only on SIGTERM),
    its newest ``local_keep`` kept. ``--resume`` takes the newest step of either tier."""

    every: int = 100
    """Save every this many steps (and at the end); 0: only at the end."""
    keep: int = 3
    """How many of the newest checkpoints are kept."""
    async_save: bool = True
    """Write checkpoints in the background while training goes on."""
    on_preempt: bool = True
    local_dir: str = ""
    """The fast tier's folder on each host's own disk (``{process}``: the process index);
    empty: no fast tier."""
    local_every: int = 0
    """Save to the fast tier (``local_dir``) every this many steps; 0: only on SIGTERM."""
    local_keep: int = 2
    """How many of the fast tier's newest steps each host keeps."""
    preempt_grace_s: float = 30.0
    """Seconds after SIGTERM within which ``on_preempt``'s save must finish (what the
    scheduler allows before it kills)."""


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
    """DiLoCo across the ``data`` axis (see :mod:`jaxpar.training.diloco`): each data
    index a replica that meets the others every ``sync_every`` steps (0: off, synchronous
    data parallelism); the outer optimizer is SGD at ``outer_lr`` with (Nesterov)
    momentum; ``fragments`` > 1 is streaming DiLoCo; ``staleness`` applies each outer
    gradient that many meetings late; ``outer_bits`` 8 sends outer gradients as int8;
    ``overlap`` runs each meeting inside the next inner step, its all-reduce beside that
    step's compute (applied one inner step late)."""

    sync_every: int = 0
    """Inner steps between the replicas' meetings; 0: DiLoCo off (synchronous data
    parallelism)."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD applied to the averaged outer gradient at each
    meeting."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD."""
    fragments: int = 1
    """Streaming DiLoCo: the weights meet in this many fragments, each at its own step
    within the ``sync_every`` steps (a meeting moves 1/fragments of the bytes); 1: whole."""
    staleness: int = 0
    """Meetings late each outer gradient is applied (0: at once)."""
    outer_bits: int = 32
    """Bits a value of the outer gradients is sent in: 32 (float32) or 8 (int8)."""
    overlap: bool = False
    """Run each meeting inside the next inner step, its all-reduce beside that step's
    compute (applied one inner step late)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    plan: PlanConfig = dataclasses.field(default_factory=PlanConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    diloco: DiLoCoConfig = dataclasses.field(default_factory=DiLoCoConfig)
    init_from: str = ""
    """Checkpoint folder (``RUN/checkpoints``) whose model weights initialise this run's
    (base) model, or ``hf:PATH``, a Hugging Face model folder (whose ``config.json`` then
    also gives the ``model`` section); optimizer and step start fresh."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (what ``config.yaml`` holds)."""
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the resolved config as YAML."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _leaf_types(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every dotted leaf key of a config dataclass with its type (sections recursed)."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out.update(_leaf_types(t, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = t
    return out


def _valid_keys(cls: type) -> list[str]:
    return list(_leaf_types(cls))


def _mapping_keys(cls: type) -> list[str]:
    """Keys of free-form mapping fields (``model.kwargs``), whose sub-keys are the user's."""
    return [k for k, t in _leaf_types(cls).items() if t is dict]


def _unknown_key(key: str) -> JaxparError:
    close = difflib.get_close_matches(key, _valid_keys(Config), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return JaxparError(f"unknown config key {key!r}{hint}")


def _coerce(value: Any, kind: Any, key: str) -> Any:
    if isinstance(value, str) and value.lower() == "auto" and kind == bool | str:
        return "auto"  # an auto knob (see jaxpar.sharding.plan.AUTO_KNOBS)
    if kind == bool | str:
        kind = bool
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() in ("true", "yes", "1", "on"):
                    return True
                if value.lower() in ("false", "no", "0", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if kind is float:
            return float(value)
        if kind is str:
            if (isinstance(value, Mapping) and len(value) == 1
                    and next(iter(value.values())) is None):
                # YAML reads "offload:" (a word and a colon) as {"offload": None}
                raise JaxparError(f"config key {key!r} got {next(iter(value))}: with "
                                  "nothing after the colon; quote the value, or complete "
                                  "it (e.g. plan.remat=offload:layer_input)")
            if isinstance(value, Mapping | list):
                raise ValueError(value)
            if isinstance(value, bool):  # YAML 1.1 reads off/on/no/yes as booleans
                return "on" if value else "off"
            return str(value)
        if kind is tuple:
            if not isinstance(value, list | tuple):
                raise ValueError(value)
            return tuple(value)
        if kind is dict:
            if not isinstance(value, Mapping):
                raise ValueError(value)
            return dict(value)
    except (TypeError, ValueError):
        raise JaxparError(f"config key {key!r} expects {kind.__name__}, got {value!r}") from None
    return value


def from_dict(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """The config dataclass ``cls`` (a section, or the whole :class:`Config`) from a nested
    mapping such as a saved ``config.yaml``: unknown keys refused with the closest valid
    one, values coerced to each field's type (``prefix`` names the section in errors)."""
    if not isinstance(data, Mapping):
        raise JaxparError(f"config section {prefix.rstrip('.') or '<root>'!r} must be a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise _unknown_key(f"{prefix}{key}")
    kwargs = {}
    for key, value in data.items():
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            kwargs[key] = from_dict(kind, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, kind, f"{prefix}{key}")
    return cls(**kwargs)


MESH_SIZE_KEYS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(MeshConfig) if f.name != "explicit")
"""The ``mesh`` keys that size axes: overriding any of them replaces all of them."""


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=1e-3"`` -> ``("train.lr", 0.001)``; the value is read as YAML."""
    if "=" not in text:
        raise JaxparError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or "not valid YAML"
        raise JaxparError(f"override {text!r}: the value is not valid YAML ({problem})"
                          ) from None


def apply_overrides(data: dict[str, Any], overrides: Iterable[str], *,
                    keep_mesh: bool = False) -> dict[str, Any]:
    """Set each ``dotted.key=value`` in the nested dict ``data`` (in place) and return it.

    Overriding any mesh axis size (``mesh.data``, ``mesh.fsdp``, ``mesh.dcn_data``, ...)
    replaces the config's whole mesh: the sizes ``data`` held are dropped first, so axes
    not overridden take their defaults (``data: -1``, the others 1). ``keep_mesh`` keeps
    them and changes only the axes given.
    """
    valid = set(_valid_keys(Config))
    free = _mapping_keys(Config)
    parsed = [parse_override(text) for text in overrides]
    for key, _ in parsed:
        if key not in valid and not any(key.startswith(f + ".") for f in free):
            raise _unknown_key(key)
    sizes = {f"mesh.{k}" for k in MESH_SIZE_KEYS}
    if not keep_mesh and any(key in sizes for key, _ in parsed) and isinstance(
            data.get("mesh"), dict):
        data["mesh"] = {k: v for k, v in data["mesh"].items() if k not in MESH_SIZE_KEYS}
    for key, value in parsed:
        *sections, leaf = key.split(".")
        node = data
        for s in sections:
            if not isinstance(node.get(s), dict):
                node[s] = {}
            node = node[s]
        node[leaf] = value
    return data


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (), *,
                keep_mesh: bool = False) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None) and apply overrides
    (see :func:`apply_overrides` for the mesh rule and ``keep_mesh``).

    Only types are checked here; ranges and cross-field rules are
    :func:`jaxpar.config.validate.check_config`'s.

    Raises:
      JaxparError: for an unknown key (with the closest valid key), a value of the wrong
        type, a missing file or invalid YAML (with its line).
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = read_yaml(path) or {}
        if not isinstance(data, dict):
            raise JaxparError(f"config file {str(path)!r} must hold a mapping of sections")
    data = apply_overrides(data, overrides, keep_mesh=keep_mesh)
    given = [key[len("model."):] for key, _ in map(parse_override, overrides)
             if key.startswith("model.")]
    return with_hf_model(from_dict(Config, data), given)


HF_PREFIX = "hf:"


def hf_folder(init_from: str) -> Path | None:
    """The folder of ``init_from: hf:PATH``, or None for any other ``init_from``."""
    return Path(init_from[len(HF_PREFIX):]).expanduser() if init_from.startswith(
        HF_PREFIX) else None


def with_hf_model(config: Config, given: Iterable[str] = ()) -> Config:
    """With ``init_from: hf:PATH``, the config whose ``model`` section is the model of
    ``PATH/config.json`` (architecture and sizes replace the YAML's; how attention and the
    loss are computed stay the YAML's); any other config unchanged. ``given``: the
    ``model.*`` keys set by overrides, each of which must agree with ``config.json`` or
    leave the weights alone (see :func:`jaxpar.hf.families.merge_model`). A missing folder
    is left for the validator to report."""
    folder = hf_folder(config.init_from)
    if folder is None or not (folder / "config.json").is_file():
        return config
    if config.model.factory:
        raise JaxparError(f"init_from={config.init_from!r} loads into jaxpar's decoder; it "
                          f"cannot initialise model.factory={config.model.factory!r}")
    hf_model, _ = read_config(folder)
    model = merge_model(hf_model, config.model, given, str(folder / "config.json"))
    return dataclasses.replace(config, model=ModelConfig(**vars(model)))
