"""Hugging Face models in and out: ``jaxpar.hf.load(path, plan=...)``,
``jaxpar.hf.save(model, path)`` and ``jaxpar.hf.save_adapters(model, path)`` (PEFT).

Supported architectures: Llama (incl. Llama 3.1 RoPE scaling), Mistral, Qwen2, Qwen3,
Gemma, Gemma 2, Gemma 3 (text), Phi-3, Mixtral, Qwen2-MoE and Qwen3-MoE, all as jaxpar's
one reference decoder configured by :class:`~jaxpar.models.TransformerConfig` fields (the
options beyond Llama's in :mod:`jaxpar.hf.variants`).
"""

from jaxpar.hf.convert import MAX_SHARD_BYTES, load, save
from jaxpar.hf.families import ARCHITECTURES, read_config, to_hf, to_jaxpar
from jaxpar.hf.peft import save_adapters

__all__ = ["ARCHITECTURES", "MAX_SHARD_BYTES", "load", "read_config", "save",
           "save_adapters", "to_hf", "to_jaxpar"]
