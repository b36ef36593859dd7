"""Rotary position embeddings (RoPE): the frequencies of each pair of a head's
dimensions after ``rope_scaling``, the sine and cosine tables at the tokens' positions,
and the rotation of queries and keys as Hugging Face's models apply it.

Kept apart from :mod:`jaxpar.models.transformer`, which imports (and so still offers)
these names.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.models.config import TransformerConfig

__all__ = ["apply_rotary", "rope_frequencies", "rotary_tables"]


def rope_frequencies(cfg: TransformerConfig) -> jax.Array:
    """Rotation frequency of each of the ``rope_dim // 2`` pairs (``head_dim // 2`` unless
    ``rotary_dim`` says otherwise), after ``rope_scaling``."""
    h = cfg.rope_dim
    freqs = 1.0 / cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    if cfg.rope_scaling == "linear":
        return freqs / cfg.rope_factor
    if cfg.rope_scaling == "llama3":
        # Wavelengths longer than the original context / low_freq_factor are stretched by
        # the factor, those shorter than context / high_freq_factor kept, the band between
        # blended linearly in context / wavelength.
        wavelen = 2 * math.pi / freqs
        ctx, low, high = (cfg.rope_original_max_len, cfg.rope_low_freq_factor,
                          cfg.rope_high_freq_factor)
        blend = (ctx / wavelen - low) / (high - low)
        mixed = (1 - blend) * freqs / cfg.rope_factor + blend * freqs
        freqs = jnp.where(wavelen > ctx / low, freqs / cfg.rope_factor,
                          jnp.where(wavelen < ctx / high, freqs, mixed))
    return freqs


def rotary_tables(seq_len: int, head_dim: int, theta: float | None = None, *,
                  freqs: jax.Array | None = None, positions=None
                  ) -> tuple[jax.Array, jax.Array]:
    """``(sin, cos)`` of shape ``(seq_len, head_dim // 2)``: of plain RoPE with base
    ``theta``, or of the given per-pair ``freqs`` (see :func:`rope_frequencies`), at
    ``positions`` (default ``0 .. seq_len - 1``; ``(batch, seq_len)`` positions, each
    token's place in its own document, give ``(batch, seq_len, head_dim // 2)``)."""
    if freqs is None:
        freqs = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if positions is None:
        positions = jnp.arange(seq_len)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * freqs
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotate pairs (first half, second half) of the last axis of ``x`` (b, s, n, h).

    In ``x``'s dtype, as Hugging Face's models rotate: the angles are float32 (``sin``,
    ``cos`` come from float32 positions), their sines and cosines are rounded to ``x``'s
    dtype, and no float32 copy of the queries or keys is made (or kept for the backward
    pass). In bf16 the rotated values are within 1% of ``max |x|`` of a float32 rotation
    (tests/models/test_transformer.py)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    if sin.ndim == 2:  # one table for every row, else one per row (packed documents)
        sin, cos = sin[None], cos[None]
    sin, cos = sin[:, :, None, :].astype(x.dtype), cos[:, :, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
