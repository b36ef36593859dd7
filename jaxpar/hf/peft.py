"""LoRA adapters in PEFT's format, for ``peft.PeftModel.from_pretrained``.

jaxpar's adapter on a projection is ``A`` (input dims x rank) and ``B`` (rank x output
dims) with update ``x @ A @ B * alpha / rank``; PEFT's is ``lora_A.weight`` (rank x in)
and ``lora_B.weight`` (out x rank) with the same scaling, on the Hugging Face module the
projection maps to (``blocks/attn/wq`` -> ``model.layers.{i}.self_attn.q_proj``). Input
and output dimensions flatten in the order the Hugging Face weight uses (heads major),
so the folder written here is what PEFT itself writes for that model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.adapters.lora import adapted
from jaxpar.errors import JaxparError
from jaxpar.hf import families, layout
from jaxpar.hf.convert import host_array
from jaxpar.models.transformer import Transformer
from jaxpar.storage.folders import staged_folder
from jaxpar.storage.safetensors_io import save_file, writing

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _modules(model: Transformer, architecture: str | None = None
             ) -> dict[str, layout.Tensor]:
    """jaxpar projection path (``blocks/attn/wq``) -> its kernel's :class:`layout.Tensor`,
    for the projections that are one Hugging Face module each (not a part of a fused
    projection, not experts stacked in jaxpar and apart in Hugging Face)."""
    arch = architecture or families.family_of(model.config)
    return {t.path.rsplit("/", 1)[0]: t for t in layout.tensors(model.config, arch)
            if t.path.endswith("/kernel") and not t.rows and not t.experts}


def _why(model: Transformer, owner: str, architecture: str | None) -> str:
    """Why the projection ``owner`` has no PEFT module of its own, if it is one of the
    model's: a part of a fused module, or experts."""
    arch = architecture or families.family_of(model.config)
    for t in layout.tensors(model.config, arch):
        if t.path.rsplit("/", 1)[0] == owner and (t.rows or t.experts):
            module = t.name.rsplit(".", 1)[0].format(i="{i}", j="{j}")
            kind = "one part of the fused" if t.rows else "the experts, apart in"
            return f" ({kind} {arch} module {module})"
    return ""


def save_adapters(model: Transformer, path: str | Path, *, base_model: str = "",
                  dtype: Any = jnp.float32, architecture: str | None = None) -> Path:
    """Write the model's LoRA adapters as a PEFT adapter folder
    (``adapter_config.json`` + ``adapter_model.safetensors``).

    Args:
      model: jaxpar's decoder with adapters (see :func:`jaxpar.lora.apply`).
      path: the folder to write (process 0 writes; every process must call).
      base_model: recorded as ``base_model_name_or_path`` (e.g. the Hugging Face folder
        the base weights came from).
      dtype: dtype of the stored adapter weights.
      architecture: the Hugging Face family of the base model (default: the one whose
        options the config uses, as :func:`jaxpar.hf.save` picks it). Adapters on a
        projection that family fuses with others (Phi-3's q/k/v and gate/up) or on
        experts are refused: PEFT has no module for them alone.
    """
    if not isinstance(model, Transformer):
        raise JaxparError(f"save_adapters writes adapters of jaxpar's reference decoder, not "
                          f"of a {type(model).__name__}")
    found = adapted(model)
    if not found:
        raise JaxparError("the model has no LoRA adapters to save")
    modules = _modules(model, architecture)
    cfg = model.config
    schedule = getattr(model, "pipeline_schedule", None)
    tensors: dict[str, np.ndarray] = {}
    targets, ranks, alphas, dropouts = [], set(), set(), set()
    out_dtype = np.dtype(jnp.dtype(dtype))
    for owner, lp in found:
        if owner not in modules:
            why = _why(model, owner, architecture)
            raise JaxparError(f"adapter on {owner}: PEFT has no module for it{why} (adapters "
                              f"on {', '.join(sorted(modules))} can be exported)")
        t = modules[owner]
        hf_module = t.name.rsplit(".", 1)[0]
        targets.append(hf_module.rsplit(".", 1)[-1])
        ranks.add(lp.rank)
        alphas.add(lp.alpha)
        dropouts.add(lp.dropout)
        a, b = lp.lora_a.get_value(), lp.lora_b.get_value()
        for i in range(cfg.n_layers):
            where = schedule.position(i) if schedule is not None else i
            a_i, b_i = host_array(a[where]), host_array(b[where])
            name = PREFIX + hf_module.format(i=i)
            # Contiguous copies: safetensors writes an array's buffer as if it were C-ordered.
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(
                a_i.reshape(-1, lp.rank).T, dtype=out_dtype)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(
                b_i.reshape(lp.rank, -1).T, dtype=out_dtype)
    if len(ranks) > 1 or len(alphas) > 1 or len(dropouts) > 1:
        raise JaxparError("adapters with different ranks, alphas or dropouts cannot share "
                          "one PEFT adapter config")
    rank, alpha, dropout = ranks.pop(), alphas.pop(), dropouts.pop()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": dropout, "target_modules": sorted(set(targets)), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": base_model or None,
    }
    folder = Path(path)
    with writing(folder), staged_folder(folder, write=jax.process_index() == 0) as staging:
        if jax.process_index() == 0:
            save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
            (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def adapter_names(model: Transformer) -> list[str]:
    """PEFT tensor names the adapters of ``model`` are written under (for tests/docs)."""
    modules = _modules(model)
    return [PREFIX + modules[p].name.rsplit(".", 1)[0].format(i=i) + f".lora_{x}.weight"
            for p, _ in adapted(model) for i in range(model.config.n_layers) for x in "AB"]


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "adapter_names", "save_adapters"]
