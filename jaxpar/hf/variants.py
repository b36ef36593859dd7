"""The options of the families beyond Llama's core: Phi-3, the mixtures of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE) and Gemma 2 and 3.

:func:`read_options` turns a family's own ``config.json`` keys into decoder fields;
:func:`write_options` writes them back. Every key whose value the decoder cannot express
(an MoE layer every other layer, per-layer windows in no regular pattern, partial
rotary embeddings, ...) is refused in one line that names it.
"""

from __future__ import annotations

from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.models.config import TransformerConfig

MOE = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
GEMMA2 = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")

DEFAULTS = {
    "MixtralForCausalLM": {"rope_theta": 1e6},
    "Gemma2ForCausalLM": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0, "sliding_window": 4096},
    "Gemma3ForCausalLM": {"query_pre_attn_scalar": 256, "sliding_window": 4096,
                          "rope_theta": 1e6},
}
"""What transformers' config classes take for keys a ``config.json`` leaves out, where
that differs from the Llama core's defaults (a key present as null keeps its null)."""


def with_defaults(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` with :data:`DEFAULTS` for the keys it does not have."""
    return {**DEFAULTS.get(arch, {}), **hf}


def _int(hf: dict[str, Any], key: str, source: str, default: int | None = None) -> int | None:
    value = hf.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise JaxparError(f"{source}: {key}={value!r} must be a whole number")
    return value


def _number(hf: dict[str, Any], key: str, source: str) -> float:
    """``hf[key]`` as a number >= 0 (0 when absent or null)."""
    value = hf.get(key)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise JaxparError(f"{source}: {key}={value!r} must be a positive number (or null)")
    return float(value)


def _flag(hf: dict[str, Any], key: str, source: str, default: bool) -> bool:
    value = hf.get(key, default)
    if not isinstance(value, bool):
        raise JaxparError(f"{source}: {key}={value!r} must be true or false")
    return value


def partial_rotary(arch: str, hf: dict[str, Any], source: str, head_dim: int) -> int:
    """The ``rotary_dim`` of ``partial_rotary_factor`` (0: the whole head), which only
    Phi-3 among the families honours: elsewhere a factor below 1 is refused."""
    for where, mapping in (("rope_parameters.", hf.get("rope_parameters") or {}),
                           ("rope_scaling.", hf.get("rope_scaling") or {}), ("", hf)):
        value = mapping.get("partial_rotary_factor") if isinstance(mapping, dict) else None
        if value in (None, 1, 1.0):
            continue
        if arch != "Phi3ForCausalLM":
            raise JaxparError(f"{source}: {where}partial_rotary_factor={value!r} is not "
                              f"supported ({arch} rotates whole heads)")
        dim = (int(head_dim * value) if isinstance(value, int | float)
               and not isinstance(value, bool) and 0 < value < 1 else 1)
        if dim % 2:
            raise JaxparError(f"{source}: {where}partial_rotary_factor={value!r} is not "
                              f"supported (it must rotate an even number of head_dim="
                              f"{head_dim}'s dimensions)")
        return dim
    return 0


def _moe(arch: str, hf: dict[str, Any], source: str) -> dict[str, Any]:
    experts = _int(hf, "num_local_experts" if arch == "MixtralForCausalLM" else "num_experts",
                   source) or _int(hf, "num_local_experts", source) or _int(hf, "num_experts",
                                                                             source)
    if not experts:
        raise JaxparError(f"{source}: no number of experts (num_local_experts / num_experts)")
    fields: dict[str, Any] = dict(
        n_experts=experts, experts_per_token=_int(hf, "num_experts_per_tok", source, 2),
        expert_capacity=0.0)  # transformers drops no token: dropless
    if hf.get("router_aux_loss_coef") is not None:
        fields["router_aux_loss"] = _number(hf, "router_aux_loss_coef", source)
    if arch == "MixtralForCausalLM":
        return fields
    if hf.get("mlp_only_layers"):
        raise JaxparError(f"{source}: mlp_only_layers={hf['mlp_only_layers']!r} is not "
                          "supported (jaxpar's decoder has experts in every layer)")
    if hf.get("decoder_sparse_step", 1) != 1:
        raise JaxparError(f"{source}: decoder_sparse_step={hf['decoder_sparse_step']!r} is not "
                          "supported (jaxpar's decoder has experts in every layer)")
    width = _int(hf, "moe_intermediate_size", source)
    if not width:
        raise JaxparError(f"{source}: missing 'moe_intermediate_size'")
    fields["expert_d_ff"] = width
    fields["renormalize_gates"] = _flag(hf, "norm_topk_prob", source, False)
    if arch == "Qwen2MoeForCausalLM":
        shared = _int(hf, "shared_expert_intermediate_size", source)
        if not shared or shared % width:
            raise JaxparError(f"{source}: shared_expert_intermediate_size={shared!r} is not "
                              f"supported (jaxpar's shared experts are a whole multiple of "
                              f"moe_intermediate_size={width})")
        fields.update(n_shared_experts=shared // width, shared_expert_gate=True,
                      qkv_bias=_flag(hf, "qkv_bias", source, True))
    return fields


def _pattern(arch: str, hf: dict[str, Any], n_layers: int, source: str) -> int:
    """``global_every`` of a Gemma 2 / 3 ``layer_types`` list (every N-th layer global)."""
    kinds = hf.get("layer_types")
    given = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern"))
    if kinds is None:
        return given or (2 if arch == "Gemma2ForCausalLM" else 6)
    if not isinstance(kinds, list) or len(kinds) != n_layers or not set(kinds) <= {
            "sliding_attention", "full_attention"}:
        raise JaxparError(f"{source}: layer_types={kinds!r} must list 'sliding_attention' or "
                          f"'full_attention' for each of the {n_layers} layers")
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    every = full[0] + 1 if full else (given if isinstance(given, int) and given > n_layers
                                      else n_layers + 1)
    if kinds != ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(n_layers)]:
        raise JaxparError(f"{source}: layer_types={kinds!r} is not supported (jaxpar's "
                          "decoder makes every N-th layer global, the others local)")
    return every


def _gemma(arch: str, hf: dict[str, Any], source: str, n_layers: int) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        norm_offset=1.0, embed_scale=True, post_norms=True,
        attn_logit_softcap=_number(hf, "attn_logit_softcapping", source),
        final_logit_softcap=_number(hf, "final_logit_softcapping", source),
        query_pre_attn_scalar=_number(hf, "query_pre_attn_scalar", source))
    window = _int(hf, "sliding_window", source)
    if window:
        fields.update(sliding_window=window, global_every=_pattern(arch, hf, n_layers, source))
    if arch == "Gemma3ForCausalLM":
        fields["qk_norm"] = True
        local = (hf.get("rope_parameters") or {}).get("sliding_attention")
        if local is not None:
            if not isinstance(local, dict) or local.get("rope_type", "default") != "default":
                raise JaxparError(f"{source}: rope_parameters.sliding_attention={local!r} is "
                                  "not supported (jaxpar's local layers use plain RoPE)")
            theta = local.get("rope_theta", 10000.0)
        else:
            theta = hf.get("rope_local_base_freq", 10000.0)
        if window:
            fields["rope_local_theta"] = _number({"rope_local_base_freq": theta},
                                                 "rope_local_base_freq", source)
    return fields


def global_rope(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` with Gemma 3's nested ``rope_parameters`` replaced by its global layers'
    (what the generic RoPE reader reads); other configs as they are."""
    params = hf.get("rope_parameters")
    if arch == "Gemma3ForCausalLM" and isinstance(params, dict) and (
            "full_attention" in params or "sliding_attention" in params):
        return {**hf, "rope_parameters": params.get("full_attention") or {}}
    return hf


def read_options(arch: str, hf: dict[str, Any], source: str, n_layers: int, head_dim: int
                 ) -> dict[str, Any]:
    """Decoder fields of the options of ``arch`` beyond the Llama core (read from ``hf``).

    Raises:
      JaxparError: for a key whose value the decoder cannot express, naming it.
    """
    fields: dict[str, Any] = {}
    rotary_dim = partial_rotary(arch, hf, source, head_dim)
    if rotary_dim:
        fields["rotary_dim"] = rotary_dim
    if arch == "Phi3ForCausalLM" and hf.get("sliding_window"):
        fields["sliding_window"] = _int(hf, "sliding_window", source)
    if arch in MOE:
        fields.update(_moe(arch, hf, source))
        if arch == "MixtralForCausalLM" and hf.get("sliding_window"):
            fields["sliding_window"] = _int(hf, "sliding_window", source)
        if arch == "Qwen3MoeForCausalLM":
            fields["qk_norm"] = True
    if arch in GEMMA2:
        fields.update(_gemma(arch, hf, source, n_layers))
    return fields


def family_of_options(cfg: TransformerConfig) -> str | None:
    """The architecture of this module's families that ``cfg``'s options ask for, or None
    (a Llama-core family)."""
    if cfg.n_experts:
        if cfg.n_shared_experts or cfg.shared_expert_gate:
            return "Qwen2MoeForCausalLM"
        return "Qwen3MoeForCausalLM" if cfg.qk_norm else "MixtralForCausalLM"
    if (cfg.post_norms or cfg.attn_logit_softcap or cfg.final_logit_softcap
            or cfg.global_every or cfg.query_pre_attn_scalar or cfg.rope_local_theta):
        if not (cfg.norm_offset == 1.0 and cfg.embed_scale and cfg.post_norms):
            raise JaxparError("a model with Gemma 2 / 3 options (soft-capping, global_every, "
                              "query_pre_attn_scalar, rope_local_theta) is saved as Gemma 2 "
                              "or 3, which need norm_offset=1, embed_scale=true and "
                              "post_norms=true together")
        return "Gemma3ForCausalLM" if cfg.qk_norm else "Gemma2ForCausalLM"
    if cfg.rotary_dim and cfg.rotary_dim != cfg.head_dim:
        return "Phi3ForCausalLM"
    return None


def _whole(value: float) -> float | int:
    """``value`` as an int when it is one (transformers' strict configs want an int)."""
    return int(value) if float(value).is_integer() else value


def write_options(arch: str, cfg: TransformerConfig, hf: dict[str, Any]) -> None:
    """Add to the ``config.json`` dict ``hf`` the keys of ``arch``'s own options."""
    if arch == "Phi3ForCausalLM":  # (Phi-3's default pad id, 32000, is a row of its table)
        hf.update(sliding_window=cfg.sliding_window or None, pad_token_id=None)
        if cfg.rotary_dim and cfg.rotary_dim != cfg.head_dim:  # as transformers reads it back
            factor = cfg.rotary_dim / cfg.head_dim
            if int(cfg.head_dim * factor) != cfg.rotary_dim:
                factor = (cfg.rotary_dim + 0.5) / cfg.head_dim
            hf["partial_rotary_factor"] = factor
    if arch in MOE:
        hf.update(num_experts_per_tok=cfg.experts_per_token,
                  router_aux_loss_coef=cfg.router_aux_loss, output_router_logits=False)
    if arch == "MixtralForCausalLM":
        hf.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.moe_d_ff,
                  sliding_window=cfg.sliding_window or None, router_jitter_noise=0.0)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        hf.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.moe_d_ff,
                  norm_topk_prob=cfg.renormalize_gates, decoder_sparse_step=1,
                  mlp_only_layers=[], use_sliding_window=False, sliding_window=None,
                  max_window_layers=cfg.n_layers)
    if arch == "Qwen2MoeForCausalLM":
        hf.update(shared_expert_intermediate_size=cfg.n_shared_experts * cfg.moe_d_ff,
                  qkv_bias=cfg.qkv_bias)
    if arch == "Qwen3MoeForCausalLM":
        hf["attention_bias"] = False
    if arch in GEMMA2:
        every = cfg.global_every
        hf.update(hidden_activation=hf["hidden_act"], attention_bias=False,
                  query_pre_attn_scalar=_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
                  attn_logit_softcapping=cfg.attn_logit_softcap or None,
                  final_logit_softcapping=cfg.final_logit_softcap or None,
                  sliding_window=cfg.sliding_window or None)
        if cfg.sliding_window:
            every = every or cfg.n_layers + 1
            hf["layer_types"] = ["full_attention" if (i + 1) % every == 0
                                 else "sliding_attention" for i in range(cfg.n_layers)]
            hf["sliding_window_pattern"] = every
    if arch == "Gemma3ForCausalLM" and cfg.sliding_window:
        hf["rope_local_base_freq"] = cfg.rope_local_theta or cfg.rope_theta
