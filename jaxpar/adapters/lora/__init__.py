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
bfloat16 or int8 (see :mod:`jaxpar.adapters.quant`).

The package's modules: :mod:`~jaxpar.adapters.lora.layers` (the config and the adapter
layer), :mod:`~jaxpar.adapters.lora.wrapping` (applying, placing, merging),
:mod:`~jaxpar.adapters.lora.files` (adapters saved alone) and
:mod:`~jaxpar.adapters.lora.report` (LoRA against full fine-tuning); the trainable filters
live with the Trainer (:mod:`jaxpar.training.trainable`) and are re-exported here.
"""

from jaxpar.adapters.lora.files import load_adapters, lora_state, save_adapters
from jaxpar.adapters.lora.layers import (
    DEFAULT_TARGET,
    LoraConfig,
    LoraDropoutCount,
    LoraDropoutKey,
    LoraProjection,
)
from jaxpar.adapters.lora.report import FinetuneReport, finetune_report
from jaxpar.adapters.lora.wrapping import (
    adapted,
    advance_dropout,
    apply,
    apply_config,
    merge,
    place,
)
from jaxpar.training.trainable import (
    count_params,
    path_filter,
    select_trainable,
    trainable_filter,
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
