"""Hugging Face ``config.json`` <-> :class:`~jaxpar.models.TransformerConfig`.

One table per supported architecture says how its config keys map onto the reference
decoder's fields (the families with options beyond Llama's through
:mod:`jaxpar.hf.variants`); options the decoder cannot express (a bias on ``o_proj``,
sliding windows in no regular pattern, YaRN RoPE, ...) are errors that name the key, never
silently dropped.
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
from jaxpar.hf import variants
from jaxpar.models.config import TransformerConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""Supported ``architectures[0]`` -> ``model_type``."""

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
_ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def architecture_of(hf: dict[str, Any], source: str = "config.json") -> str:
    """The supported architecture named by a Hugging Face config, or an error naming it."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise JaxparError(f"{source}: architectures={archs!r} must be a list of names, "
                          'e.g. ["LlamaForCausalLM"]')
    arch = archs[0] if archs else next(
        (a for a, t in ARCHITECTURES.items() if t == hf.get("model_type")), None)
    if arch not in ARCHITECTURES:
        shown = arch or hf.get("model_type") or "unknown"
        raise JaxparError(f"{source}: architecture {shown!r} is not supported; jaxpar reads "
                          f"{', '.join(ARCHITECTURES)}")
    return arch


def _positive_int(hf: dict[str, Any], key: str, source: str, where: str = "") -> int | None:
    """``hf[key]`` as a positive whole number (None when absent or null)."""
    value = hf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise JaxparError(f"{source}: {where}{key}={value!r} must be a positive whole number")
    return value


def _positive_number(hf: dict[str, Any], key: str, source: str, default: float,
                     where: str = "") -> float:
    """``hf[key]`` as a positive finite number (``default`` when absent or null)."""
    value = hf.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 < value < float("inf")):
        raise JaxparError(f"{source}: {where}{key}={value!r} must be a positive number")
    return float(value)


def _rope(hf: dict[str, Any], source: str) -> dict[str, Any]:
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise JaxparError(f"{source}: {key}={hf[key]!r} must be a mapping (or null)")
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    typed = lambda d: d.get("rope_type", d.get("type", "default")) not in ("default", None)
    # Name the mapping that sets the type: its keys are the ones the message is about.
    where = "rope_parameters" if typed(params) or not typed(scaling) else "rope_scaling"
    params = {**scaling, **params}
    theta = _positive_number({**hf, **params}, "rope_theta", source, 10000.0)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    out: dict[str, Any] = {"rope_theta": theta}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        raise JaxparError(f"{source}: rope type {kind!r} is not supported (jaxpar has "
                          "default, linear and llama3)")
    needed = ["factor"]
    if kind == "llama3":
        needed += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    missing = [k for k in needed if params.get(k) is None]
    if missing:
        also = f" (type {kind!r} needs {', '.join(needed)})" if len(needed) > 1 else ""
        raise JaxparError(f"{source}: {where} of type {kind!r} has no {missing[0]!r}{also}")
    at = f"{where}."
    out["rope_scaling"] = kind
    out["rope_factor"] = _positive_number(params, "factor", source, 1.0, at)
    if kind == "llama3":
        out["rope_low_freq_factor"] = _positive_number(params, "low_freq_factor", source, 1.0,
                                                       at)
        out["rope_high_freq_factor"] = _positive_number(params, "high_freq_factor", source,
                                                        4.0, at)
        out["rope_original_max_len"] = _positive_int(
            params, "original_max_position_embeddings", source, at)
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
    if not isinstance(hf, dict):
        raise JaxparError(f"{source}: holds a JSON {type(hf).__name__}, not the object of "
                          "keys a Hugging Face config.json is")
    if hf.get("quantization_config"):
        method = hf["quantization_config"]
        method = method.get("quant_method", "?") if isinstance(method, dict) else method
        raise JaxparError(f"{source}: quantization_config (quant_method {method!r}): "
                          "jaxpar reads unquantized float checkpoints only")
    arch = architecture_of(hf, source)
    family = ARCHITECTURES[arch]
    hf = variants.with_defaults(arch, hf)
    sizes = {}
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in hf:
            raise JaxparError(f"{source}: missing {key!r}")
        sizes[key] = _positive_int(hf, key, source)
        if sizes[key] is None:
            raise JaxparError(f"{source}: {key}=null must be a positive whole number")
    _refuse(hf, source, attention_bias=False, mlp_bias=False, pretraining_tp=(1, None),
            use_sliding_window=(False, None), use_bidirectional_attention=(False, None))
    act_key = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
    act = hf.get(act_key, "silu")
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        raise JaxparError(f"{source}: {act_key}={act!r} is not supported (jaxpar has "
                          f"{', '.join(_ACTIVATIONS)})")
    tie = hf.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        raise JaxparError(f"{source}: tie_word_embeddings={tie!r} must be true or false")
    heads, d = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = _positive_int(hf, "num_key_value_heads", source) or heads
    head_dim = _positive_int(hf, "head_dim", source)
    if head_dim is None and d % heads:
        raise JaxparError(f"{source}: hidden_size={d} is not divisible by "
                          f"num_attention_heads={heads} (and there is no head_dim)")
    if heads % kv_heads:
        raise JaxparError(f"{source}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv_heads}")
    head_dim = head_dim or d // heads
    if head_dim % 2:
        raise JaxparError(f"{source}: head_dim={head_dim} must be even (rotary embeddings "
                          "rotate pairs of dimensions)")
    max_len = _positive_int(hf, "max_position_embeddings", source)
    fields: dict[str, Any] = dict(
        vocab_size=sizes["vocab_size"], d_model=d, d_ff=sizes["intermediate_size"],
        n_layers=sizes["num_hidden_layers"], n_heads=heads, n_kv_heads=kv_heads,
        head_dim=head_dim, max_seq_len=max_len or 2048,
        norm_eps=_positive_number(hf, "rms_norm_eps", source, 1e-6),
        tie_embeddings=tie if tie is not None else family.startswith("gemma"),
        mlp_activation=_ACTIVATIONS[act],
        **_rope(variants.global_rope(arch, hf), source),
    )
    if family == "qwen2":
        fields["qkv_bias"] = True
    if family == "qwen3":
        fields["qk_norm"] = True
    if family == "mistral" and hf.get("sliding_window"):
        fields["sliding_window"] = _positive_int(hf, "sliding_window", source)
    if family == "gemma":
        fields.update(norm_offset=1.0, embed_scale=True)
    fields.update(variants.read_options(arch, hf, source, sizes["num_hidden_layers"],
                                        head_dim))
    if fields.get("query_pre_attn_scalar") == head_dim:  # the usual scale: stored as 0
        fields["query_pre_attn_scalar"] = 0.0
    try:
        return TransformerConfig(**fields), arch
    except JaxparError as err:  # what is left: a combination the decoder refuses
        raise JaxparError(f"{source}: {err}") from None


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


COMPATIBLE_FIELDS = (*RUNTIME_FIELDS, "max_seq_len", "expert_capacity", "router_aux_loss",
                     "router_z_loss")
"""Decoder fields an override may set on a Hugging Face model: they change neither its
weights nor what it computes (``max_seq_len`` only bounds the sequence length; the
experts' capacity only drops tokens in training, the router losses only add to it)."""

HF_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "d_ff": "intermediate_size",
           "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
           "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta",
           "norm_eps": "rms_norm_eps", "sliding_window": "sliding_window"}
"""Decoder fields -> the ``config.json`` keys they are read from, for messages."""


def check_overrides(hf_cfg: TransformerConfig, given: dict[str, Any], source: str
                    ) -> dict[str, Any]:
    """The overrides in ``given`` (decoder field -> value) that a model read from a Hugging
    Face config may take (:data:`COMPATIBLE_FIELDS`); the others must equal ``hf_cfg``'s.

    Raises:
      JaxparError: for the first override that conflicts with the checkpoint's config,
        naming both values (``model.d_model=64 conflicts with hidden_size=32 in ...``).
    """
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    compatible = {}
    for name, value in given.items():
        if name in COMPATIBLE_FIELDS:
            compatible[name] = value
            continue
        if name not in names:
            raise JaxparError(f"model.{name}: the model is the one {source} "
                              "describes (jaxpar's decoder), which has no such setting")
        have = getattr(hf_cfg, name)
        if name == "head_dim" and value == 0:  # 0: d_model // n_heads, as the config's
            value = hf_cfg.d_model // hf_cfg.n_heads
        if value != have:
            where = (f"{HF_KEYS[name]}={_shown(have)} in {source}" if name in HF_KEYS
                     else f"model.{name}={_shown(have)} of the model {source} describes")
            raise JaxparError(f"model.{name}={_shown(given[name])} conflicts with {where}; "
                              "the model's shape and kind come from the checkpoint (only "
                              f"{', '.join('model.' + k for k in COMPATIBLE_FIELDS)} may be "
                              "set)")
    return compatible


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def merge_model(hf_cfg: TransformerConfig, model: TransformerConfig, given: Any = (),
                source: str = "config.json") -> TransformerConfig:
    """The model of a run that starts from a Hugging Face checkpoint: ``hf_cfg`` with
    ``model``'s :data:`RUNTIME_FIELDS` and the fields named in ``given`` (the ``model.*``
    overrides the user gave) when they are compatible (see :func:`check_overrides`).

    When ``model`` already is ``hf_cfg``'s model (every field outside
    :data:`COMPATIBLE_FIELDS` equal: a config merged before, or a run's saved config), its
    compatible fields are kept too, so merging again changes nothing.
    """
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    values = {n: getattr(model, n) if n in names else None for n in given}
    kept = dict(runtime_fields(model))
    if all(getattr(model, n) == getattr(hf_cfg, n) for n in names - set(COMPATIBLE_FIELDS)):
        kept.update({n: getattr(model, n) for n in COMPATIBLE_FIELDS})
    kept.update(check_overrides(hf_cfg, values, source))
    return dataclasses.replace(hf_cfg, **kept)


def family_of(cfg: TransformerConfig) -> str:
    """The architecture a jaxpar decoder config is saved as: the one family whose options
    it uses (Llama when it uses none; Phi-3, which has Llama's options, only on request or
    for a partial ``rotary_dim``)."""
    arch = variants.family_of_options(cfg)
    if arch is not None:
        pass
    elif cfg.norm_offset or cfg.embed_scale:
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
    windowed = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM",
                *variants.GEMMA2)
    clash = {"qkv_bias": cfg.qkv_bias and arch not in ("Qwen2ForCausalLM",
                                                       "Qwen2MoeForCausalLM"),
             "qk_norm": cfg.qk_norm and arch not in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                                     "Gemma3ForCausalLM"),
             "sliding_window": bool(cfg.sliding_window) and arch not in windowed,
             "rope_scaling=llama3": cfg.rope_scaling == "llama3" and arch not in (
                 "LlamaForCausalLM", "MistralForCausalLM")}
    bad = [k for k, v in clash.items() if v]
    if bad:
        raise JaxparError(f"no Hugging Face architecture has this decoder's combination of "
                          f"options: {arch} cannot express {', '.join(bad)}")
    return arch


EXPORT_FREE = ("expert_capacity", "router_z_loss")
"""Fields a Hugging Face config has no key for that leave the weights and the model alone
(transformers runs experts without capacity: the export is the dropless model)."""


def _canonical(cfg: TransformerConfig) -> TransformerConfig:
    """``cfg`` with the fields that do not change what it computes in one spelling: an
    MLP width no layer uses (every layer has experts), the default attention scale."""
    if cfg.n_experts and cfg.moe_d_ff != cfg.d_ff:
        cfg = dataclasses.replace(cfg, d_ff=cfg.moe_d_ff, expert_d_ff=0)
    if cfg.n_experts and not cfg.expert_d_ff:
        cfg = dataclasses.replace(cfg, expert_d_ff=cfg.d_ff)
    if cfg.query_pre_attn_scalar == cfg.head_dim:
        cfg = dataclasses.replace(cfg, query_pre_attn_scalar=0.0)
    if cfg.rotary_dim == cfg.head_dim:
        cfg = dataclasses.replace(cfg, rotary_dim=0)
    return cfg


def to_hf(cfg: TransformerConfig, architecture: str | None = None,
          dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` dict that makes ``transformers`` build the same model as ``cfg``.

    Raises:
      JaxparError: when no supported architecture expresses ``cfg`` exactly (a mixture of
        experts, a combination of options no one family has).
    """
    arch = family_of(cfg) if architecture is None else architecture
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
    if cfg.n_experts and arch not in variants.MOE:
        raise JaxparError(f"model.n_experts={cfg.n_experts}: {arch} has no experts; a "
                          f"mixture of experts is saved as one of {', '.join(variants.MOE)}")
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
    variants.write_options(arch, cfg, hf)
    back, _ = to_jaxpar(hf, "generated config")
    free = {k: getattr(cfg, k) for k in (*RUNTIME_FIELDS, *EXPORT_FREE)}
    if _canonical(dataclasses.replace(back, **free)) != _canonical(cfg):
        raise JaxparError(f"{arch} cannot express this decoder config exactly")
    return hf
