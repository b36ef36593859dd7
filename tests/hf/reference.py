"""What the family tests share: a tiny random ``transformers`` model of a family, saved
with ``save_pretrained``, and the four comparisons each family passes (logits on a batch
padded on the right and on the left, greedy generation, export read back by
``transformers``, bit-exact round trip).

Not a test module: ``tests/hf/test_phi3.py``, ``test_moe_families.py`` and
``test_gemma2_gemma3.py`` import it (they skip without torch and transformers).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from jaxpar import hf
from jaxpar.runs.generate import generate

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64, initializer_range=0.1, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
"""The tiny shape of every family's test model (f32)."""

TOL = 1e-5
"""Largest logit difference allowed against transformers (float32)."""

IDS = np.random.default_rng(0).integers(3, SIZES["vocab_size"], (2, 12))
MASK = np.ones_like(IDS)
MASK[1, 8:] = 0  # the second row is 8 tokens and 4 of padding
IDS[1, 8:] = SIZES["pad_token_id"]
LEFT_IDS, LEFT_MASK = np.roll(IDS, 4, axis=1), np.roll(MASK, 4, axis=1)
LEFT_IDS[0], LEFT_MASK[0] = IDS[0], MASK[0]
"""The batch left-padded as batched generation pads it: the second row's 4 pads first."""
PROMPT = IDS[0, :5]
NEW_TOKENS = 16


@dataclasses.dataclass
class Reference:
    """A family's saved test model: its folder, architecture and transformers' outputs."""

    folder: Path
    architecture: str
    logits: np.ndarray
    generated: list[int]
    left_logits: np.ndarray | None = None


def random_model(config_cls: str, model_cls: str, **config: Any) -> Any:
    """A ``transformers`` model of ``model_cls`` built from ``config_cls(**config)``,
    float32, seeded, with its norms and biases moved away from their initial values."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
    model = model.float().eval()
    with torch.no_grad():  # norms and biases away from their init too
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def make_reference(folder: Path, config_cls: str, model_cls: str, **options: Any
                   ) -> Reference:
    """A random ``transformers`` model (``config_cls(**SIZES, **options)``) saved to
    ``folder``, its logits on the padded batch and its greedy continuation of
    :data:`PROMPT`."""
    model = random_model(config_cls, model_cls, **{**SIZES, **options})
    model.save_pretrained(folder)
    return Reference(folder, model_cls, hf_logits(model), hf_generate(model),
                     hf_left_logits(model))


def hf_logits(model) -> np.ndarray:
    """transformers' logits on the padded batch (pad positions zeroed)."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits
    return out.float().numpy() * MASK[..., None]


def hf_left_logits(model) -> np.ndarray:
    """transformers' logits on the left-padded batch, positions counted from each row's
    first token as ``generate`` counts them (pad positions zeroed)."""
    import torch

    positions = np.maximum(np.cumsum(LEFT_MASK, axis=1) - 1, 0)
    with torch.no_grad():
        out = model(torch.tensor(LEFT_IDS), attention_mask=torch.tensor(LEFT_MASK),
                    position_ids=torch.tensor(positions)).logits
    return out.float().numpy() * LEFT_MASK[..., None]


def hf_generate(model) -> list[int]:
    """transformers' greedy continuation of :data:`PROMPT`, :data:`NEW_TOKENS` ids."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(PROMPT[None]), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             pad_token_id=SIZES["pad_token_id"])
    return [int(i) for i in out[0, len(PROMPT):]]


def jaxpar_logits(model) -> np.ndarray:
    """jaxpar's logits on the padded batch (right padding: causal attention keeps the pads
    out of every real position; pad positions zeroed)."""
    return np.asarray(model(jnp.asarray(IDS))) * MASK[..., None]


def jaxpar_left_logits(model) -> np.ndarray:
    """jaxpar's logits on the left-padded batch: the attention mask given as segment ids
    (the pads one document, the row another: attention and positions start over at the
    row's first token). Pad positions zeroed."""
    return np.asarray(model(jnp.asarray(LEFT_IDS), segment_ids=jnp.asarray(LEFT_MASK))
                      ) * LEFT_MASK[..., None]


def max_error(model, ref: Reference) -> float:
    """Largest logit difference between ``model`` (jaxpar) and transformers, on the batch
    padded on the right and (when ``ref`` has it) on the left."""
    error = float(np.abs(jaxpar_logits(model) - ref.logits).max())
    if ref.left_logits is not None:
        error = max(error, float(np.abs(jaxpar_left_logits(model) - ref.left_logits).max()))
    return error


def jaxpar_generate(model) -> list[int]:
    """jaxpar's greedy continuation of :data:`PROMPT` (``jaxpar.runs.generate``)."""
    return generate(model, PROMPT, max_new_tokens=NEW_TOKENS)


def check_round_trip(ref: Reference, model, out: Path) -> None:
    """``model`` (loaded from ``ref``) saved by jaxpar holds exactly the original tensors
    under the original names, and transformers reads the folder back as the same
    architecture with identical logits."""
    import transformers

    hf.save(model, out, architecture=ref.architecture)
    original, saved = load_file(ref.folder / "model.safetensors"), load_file(
        out / "model.safetensors")
    if model.config.tie_embeddings:
        original.pop("lm_head.weight", None)
    assert sorted(saved) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=name)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(back).__name__ == ref.architecture
    np.testing.assert_array_equal(hf_logits(back), ref.logits)


def check_peft(ref: Reference, model, out: Path, **save_options: Any) -> float:
    """Random LoRA adapters on ``model`` (loaded from ``ref``, adapters applied) saved as a
    PEFT folder, which ``peft`` loads onto the transformers model: the logits agree with
    jaxpar's within :data:`TOL` and differ from the base model's. Returns the error."""
    import peft
    import torch
    import transformers

    import jaxpar

    rng = np.random.default_rng(0)
    for _, lp in jaxpar.lora.adapted(model):  # B starts at zero, which would hide mistakes
        b = lp.lora_b.get_value()
        lp.lora_b.set_value(jnp.asarray(0.5 * rng.standard_normal(b.shape), jnp.float32))
    want = jaxpar_logits(model)
    hf.save_adapters(model, out, base_model=str(ref.folder), **save_options)
    base = transformers.AutoModelForCausalLM.from_pretrained(ref.folder, dtype=torch.float32)
    got = hf_logits(peft.PeftModel.from_pretrained(base, out).eval())
    assert np.abs(got - ref.logits).max() > 100 * TOL  # the adapters matter
    error = float(np.abs(got - want).max())
    assert error < TOL
    return error
