"""Hugging Face ``config.json`` <-> :class:`~jaxpar.models.TransformerConfig`.

One table per supported architecture says how its config keys map onto the reference
decoder's fields; options the decoder cannot express (a bias on ``o_proj``, per-layer
sliding windows, YaRN RoPE, ...) are errors that name the key, never silently dropped.
Both the ``rope_parameters`` dict of transformers 5 and the older ``rope_theta`` /
``rope_scaling`` keys are read; ``rope_theta`` / ``rope_scaling`` are written, which every
transformers version reads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.models.config import TransformerConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
}
"""Supported ``architectures[0]`` -> ``model_type``."""

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
_ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def architecture_of(hf: dict[str, Any], source: str = "config.json") -> str:
    """The supported architecture named by a Hugging Face config, or an error naming it."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else next(
        (a for a, t in ARCHITECTURES.items() if t == hf.get("model_type")), None)
    if arch not in ARCHITECTURES:
        shown = arch or hf.get("model_type") or "unknown"
        raise JaxparError(f"{source}: architecture {shown!r} is not supported; jaxpar reads "
                          f"{', '.join(ARCHITECTURES)}")
    return arch


def _rope(hf: dict[str, Any], source: str) -> dict[str, Any]:
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        raise JaxparError(f"{source}: rope type {kind!r} is not supported (jaxpar has "
                          "default, linear and llama3)")
    out["rope_scaling"] = kind
    out["rope_factor"] = float(params["factor"])
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        out["rope_original_max_len"] = int(params["original_max_position_embeddings"])
    return out


def _refuse(hf: dict[str, Any], source: str, **unsupported: Any) -> None:
    """An error for the first key whose value is set to something jaxpar cannot express."""
    for key, ok in unsupported.items():
        if key in hf and hf[key] not in (ok if isinstance(ok, tuple) else (ok,)):
            raise JaxparError(f"{source}: {key}={hf[key]!r} is not supported by jaxpar's "
                              "decoder")


def to_jaxpar(hf: dict[str, Any], source: str = "config.json") -> tuple[TransformerConfig, str]:
    """``(TransformerConfig, architecture)`` of a Hugging Face config dict.

    Raises:
      JaxparError: for an unsupported architecture or option, naming it.
    """
    arch = architecture_of(hf, source)
    family = ARCHITECTURES[arch]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in hf:
            raise JaxparError(f"{source}: missing {key!r}")
    _refuse(hf, source, attention_bias=False, mlp_bias=False, pretraining_tp=(1, None),
            use_sliding_window=(False, None), use_bidirectional_attention=(False, None))
    act_key = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
    act = hf.get(act_key, "silu")
    if act not in _ACTIVATIONS:
        raise JaxparError(f"{source}: {act_key}={act!r} is not supported (jaxpar has "
                          f"{', '.join(_ACTIVATIONS)})")
    heads = hf["num_attention_heads"]
    fields: dict[str, Any] = dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], d_ff=hf["intermediate_size"],
        n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma")),
        mlp_activation=_ACTIVATIONS[act],
        **_rope(hf, source),
    )
    if family == "qwen2":
        fields["qkv_bias"] = True
    if family == "qwen3":
        fields["qk_norm"] = True
    if family == "mistral" and hf.get("sliding_window"):
        fields["sliding_window"] = int(hf["sliding_window"])
    if family == "gemma":
        fields.update(norm_offset=1.0, embed_scale=True)
    return TransformerConfig(**fields), arch


def read_config(path: str | Path) -> tuple[TransformerConfig, str]:
    """``(TransformerConfig, architecture)`` of the Hugging Face folder ``path``."""
    folder = Path(path)
    file = folder / "config.json"
    if not folder.is_dir():
        raise JaxparError(f"{folder}: not a Hugging Face model folder")
    if not file.is_file():
        raise JaxparError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        hf = json.loads(file.read_text())
    except ValueError as err:
        raise JaxparError(f"{file}: not valid JSON ({err})") from None
    return to_jaxpar(hf, str(file))


RUNTIME_FIELDS = ("init_std", "attention", "attention_block", "loss_chunk")
"""Decoder fields that say how to initialise or compute, not what the model is; a
Hugging Face config neither has nor needs them."""


def runtime_fields(cfg: TransformerConfig) -> dict[str, Any]:
    """``cfg``'s :data:`RUNTIME_FIELDS`."""
    return {k: getattr(cfg, k) for k in RUNTIME_FIELDS}


def family_of(cfg: TransformerConfig) -> str:
    """The architecture a jaxpar decoder config is saved as: the one family whose options
    it uses (Llama when it uses none)."""
    if cfg.norm_offset or cfg.embed_scale:
        arch = "GemmaForCausalLM"
        if not (cfg.norm_offset == 1.0 and cfg.embed_scale):
            raise JaxparError("a model with norm_offset or embed_scale is saved as Gemma, "
                              "which needs norm_offset=1 and embed_scale=true together")
    elif cfg.qk_norm:
        arch = "Qwen3ForCausalLM"
    elif cfg.qkv_bias:
        arch = "Qwen2ForCausalLM"
    elif cfg.sliding_window:
        arch = "MistralForCausalLM"
    else:
        arch = "LlamaForCausalLM"
    clash = {"qkv_bias": cfg.qkv_bias and arch != "Qwen2ForCausalLM",
             "qk_norm": cfg.qk_norm and arch != "Qwen3ForCausalLM",
             "sliding_window": bool(cfg.sliding_window) and arch != "MistralForCausalLM",
             "rope_scaling=llama3": cfg.rope_scaling == "llama3" and arch not in (
                 "LlamaForCausalLM", "MistralForCausalLM")}
    bad = [k for k, v in clash.items() if v]
    if bad:
        raise JaxparError(f"no Hugging Face architecture has this decoder's combination of "
                          f"options: {arch} cannot express {', '.join(bad)}")
    return arch


def to_hf(cfg: TransformerConfig, architecture: str | None = None,
          dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` dict that makes ``transformers`` build the same model as ``cfg``."""
    arch = architecture or family_of(cfg)
    if arch not in ARCHITECTURES:
        raise JaxparError(f"architecture {arch!r} is not supported; choose one of "
                          f"{list(ARCHITECTURES)}")
    hf: dict[str, Any] = {
        "architectures": [arch], "model_type": ARCHITECTURES[arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": _ACTIVATION_NAMES[cfg.mlp_activation],
        "torch_dtype": dtype, "use_cache": True,
    }
    if arch == "GemmaForCausalLM":
        hf["hidden_activation"] = hf["hidden_act"]
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM"):
        hf["attention_bias"] = False
    if arch == "MistralForCausalLM":
        hf["sliding_window"] = cfg.sliding_window or None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        hf.update(use_sliding_window=False, sliding_window=None,
                  max_window_layers=cfg.n_layers)
    if cfg.rope_scaling != "none":
        scaling: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
        if cfg.rope_scaling == "llama3":
            scaling.update(low_freq_factor=cfg.rope_low_freq_factor,
                           high_freq_factor=cfg.rope_high_freq_factor,
                           original_max_position_embeddings=cfg.rope_original_max_len)
        hf["rope_scaling"] = scaling
    back, _ = to_jaxpar(hf, "generated config")
    if dataclasses.replace(back, **runtime_fields(cfg)) != cfg:
        raise JaxparError(f"{arch} cannot express this decoder config exactly")
    return hf
