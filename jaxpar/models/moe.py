"""Mixture-of-experts MLP for the reference decoder, laid out for expert parallelism.

A linear router scores every token against ``n_experts`` experts (in float32); each token
goes to its ``experts_per_token`` best, weighted by their router probabilities
renormalised to sum to one (Mixtral's gating). Experts are gated MLPs whose weights are
stacked on a leading ``expert`` axis, so the ``expert`` mesh axis splits them. Optional
shared experts, one dense MLP of ``n_shared_experts`` times the expert width, see every
token (DeepSeek-MoE), optionally weighted per token by a sigmoid gate (Qwen2-MoE,
``shared_expert_gate``). With ``renormalize_gates`` false the top-k probabilities are
used as they are (Qwen's ``norm_topk_prob: false``).

Two ways to run the experts:

* **Capacity** (``expert_capacity > 0``; GShard, Switch): each sequence is a group, and
  in it each expert takes at most ``C = ceil(capacity x seq x k / n_experts)`` tokens
  (at least 1, at most ``seq``). Slots are handed out first-choice-first: the first
  choices of all tokens in sequence order, then the second choices, and so on; a choice
  that finds its expert full is dropped (that token gets nothing from that expert, and
  the residual connection carries it). Tokens move by einsum with one-hot dispatch and
  combine tensors ``(batch, seq, expert, capacity)``. The dispatched tokens are pinned
  expert-major, ``("expert", "batch", "capacity", "embed")``, while the residual stream
  is split over the batch on ``(data, fsdp, expert)``: the ``expert`` mesh axis moves
  from the batch dimension to the expert dimension, which GSPMD lowers to an all-to-all
  and back.
* **Dropless** (``expert_capacity == 0``; MegaBlocks): every (token, choice) pair is
  sorted by expert and the experts run as grouped matmuls (``jax.lax.ragged_dot``), so
  nothing is dropped. The sort is over all tokens of the batch and the matmuls take the
  whole expert stack, so under expert parallelism GSPMD gathers tokens and expert weights
  rather than exchanging tokens; use it on one device or without an ``expert`` axis.

:class:`MoE` returns its output and a dict of scalar diagnostics; :func:`aux_loss` turns
those into the loss terms a training step adds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.models.config import MLP_ACTIVATIONS, TransformerConfig
from jaxpar.sharding.plan import constrain

OUTPUT = ("batch", "residual_seq", "embed")
"""Logical names of the layer's output, those of the residual stream."""
DISPATCHED = ("expert", "batch", "capacity", "embed")
"""Logical names of the tokens an expert receives (capacity path)."""

_IN = "ebcd,edf->ebcf"
_OUT = "ebcf,efd->ebcd"
"""The experts' projections on dispatched tokens ``(expert, batch, capacity, features)``."""

__all__ = ["MoE", "aux_loss", "capacity", "top_k"]


def _activation(name: str):
    return MLP_ACTIVATIONS[name]


def _experts(rngs: nnx.Rngs, spec: str, std: float, shape: tuple[int, ...],
             names: tuple[str, ...]) -> nnx.Einsum:
    """One projection of every expert at once: an ``nnx.Einsum`` whose kernel is stacked
    on the leading ``expert`` axis (so LoRA sees the expert axis as one it shares with
    the input and gives each expert its own adapter)."""
    init = nnx.with_partitioning(nnx.initializers.normal(std), names)
    return nnx.Einsum(spec, shape, kernel_init=init, rngs=rngs)


def _kernel(projection: nnx.Module) -> jax.Array:
    """A projection's effective kernel: with a LoRA adapter, the base plus ``A @ B``."""
    base = getattr(projection, "base", projection)
    kernel = base.kernel[...]
    if hasattr(projection, "weight_delta"):
        kernel = kernel + projection.weight_delta().astype(kernel.dtype)
    return kernel


def _linear(rngs: nnx.Rngs, d_in: int, d_out: int, names: tuple[str | None, ...], std: float,
            dtype=None) -> nnx.Linear:
    init = nnx.with_partitioning(nnx.initializers.normal(std), names)
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=init, dtype=dtype, rngs=rngs)


def capacity(factor: float, group: int, n_experts: int, k: int) -> int:
    """Slots per expert in a group of ``group`` tokens: ``ceil(factor x group x k /
    n_experts)``, at least 1 and at most ``group`` (an expert can receive each token of a
    group at most once, since a token's ``k`` choices are distinct experts)."""
    return max(1, min(group, math.ceil(factor * group * k / n_experts)))


def top_k(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest entries of the last axis, largest first, and their indices (the
    lower index first among equals), as ``jax.lax.top_k`` gives them.

    Found by ``k`` rounds of argmax, which GSPMD partitions along the leading axes; XLA's
    ``TopK`` custom call on CPU is not partitioned and would gather the whole batch."""
    found, indices = [], []
    for _ in range(k):
        index = jnp.argmax(values, axis=-1)
        found.append(jnp.take_along_axis(values, index[..., None], axis=-1)[..., 0])
        indices.append(index)
        taken = jax.nn.one_hot(index, values.shape[-1], dtype=jnp.bool_)
        values = jnp.where(taken, -jnp.inf, values)
    return jnp.stack(found, axis=-1), jnp.stack(indices, axis=-1).astype(jnp.int32)


class MoE(nnx.Module):
    """Routed gated-MLP experts (plus optional shared experts) in place of the dense MLP.

    ``MoE(cfg)(x)`` maps ``x`` ``(batch, seq, embed)`` to ``(y, aux)``: ``y`` of the same
    shape and dtype as ``x``, pinned to the residual stream's layout, and ``aux`` a dict of
    float32 scalars:

    * ``moe_load_balance``: Switch Transformer's balancing loss ``E x sum_e f_e x P_e``,
      with ``f_e`` the share of all (token, choice) assignments that went to expert ``e``
      (before any were dropped) and ``P_e`` its mean router probability. It is 1 when
      routing is uniform and grows to ``E / k`` when every token prefers the same experts.
    * ``moe_router_z``: the mean over tokens of ``logsumexp(router logits) ** 2`` (ST-MoE's
      z-loss), which keeps the router's logits small.
    * ``moe_dropped``: the share of (token, choice) assignments dropped for lack of
      capacity (0 on the dropless path).

    Parameters: ``router`` (an ``nnx.Linear``, kernel ``("embed", None)``), ``w_gate`` and
    ``w_up`` (``nnx.Einsum``, kernel ``(n_experts, d_model, moe_d_ff)`` named ``("expert",
    "embed", "mlp")``), ``w_down`` (kernel ``(n_experts, moe_d_ff, d_model)`` named
    ``("expert", "mlp", "embed")``); LoRA's default target adapts all three per expert;
    and with shared experts ``shared_gate``/``shared_up``/``shared_down`` linears named
    as the dense MLP's (and ``shared_scale``, ``(d_model, 1)``, with
    ``shared_expert_gate``). Matmuls run in ``x``'s dtype; the router runs in float32.
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_d_ff
        if e < 1:
            raise ValueError(f"MoE needs model.n_experts >= 1, got {e}")
        # Created unsharded, as the Transformer's weights are: jaxpar places them itself.
        with nnx.use_eager_sharding(False):
            std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
            self.router = _linear(rngs, d, e, ("embed", None), std, dtype=jnp.float32)
            self.w_gate = _experts(rngs, _IN, std, (e, d, f), ("expert", "embed", "mlp"))
            self.w_up = _experts(rngs, _IN, std, (e, d, f), ("expert", "embed", "mlp"))
            self.w_down = _experts(rngs, _OUT, out_std, (e, f, d), ("expert", "mlp", "embed"))
            if cfg.n_shared_experts:
                width = cfg.n_shared_experts * f
                self.shared_gate = _linear(rngs, d, width, ("embed", "mlp"), std)
                self.shared_up = _linear(rngs, d, width, ("embed", "mlp"), std)
                self.shared_down = _linear(rngs, width, d, ("mlp", "embed"), out_std)
            if cfg.shared_expert_gate:
                self.shared_scale = _linear(rngs, d, 1, ("embed", None), std)
        self.n_experts, self.k = e, cfg.experts_per_token
        self.renormalize = cfg.renormalize_gates
        self.capacity_factor = cfg.expert_capacity
        self.activation = cfg.mlp_activation

    # --- routing ---------------------------------------------------------------------------
    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Router logits and probabilities ``(batch, seq, E)`` (float32), and each token's
        chosen experts ``(batch, seq, k)`` with their renormalised gates (float32)."""
        # Pinned to the batch layout: left alone, GSPMD may gather the whole batch's
        # probabilities for top_k.
        logits = constrain(self.router(x.astype(jnp.float32)), ("batch", "seq", None))
        probs = constrain(jax.nn.softmax(logits, axis=-1), ("batch", "seq", None))
        top_probs, experts = top_k(probs, self.k)
        gates = (top_probs / jnp.sum(top_probs, axis=-1, keepdims=True) if self.renormalize
                 else top_probs)
        return logits, probs, experts, gates

    def _aux(self, logits: jax.Array, probs: jax.Array, experts: jax.Array,
             dropped: jax.Array) -> dict[str, jax.Array]:
        e = self.n_experts
        chosen = jax.nn.one_hot(experts, e, dtype=jnp.float32)  # (b, s, k, E)
        share = jnp.mean(jnp.sum(chosen, axis=2), axis=(0, 1)) / self.k
        mean_prob = jnp.mean(probs, axis=(0, 1))
        z = jax.nn.logsumexp(logits, axis=-1)
        return {"moe_load_balance": e * jnp.sum(share * mean_prob),
                "moe_router_z": jnp.mean(z * z),
                "moe_dropped": jnp.asarray(dropped, jnp.float32)}

    # --- experts ---------------------------------------------------------------------------
    def _weights(self, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
        # Pinned in their compute layout (split over experts, whole over embed), so an FSDP
        # split of embed is gathered here, once, and never the expert dimension.
        gate = constrain(_kernel(self.w_gate).astype(dtype), ("expert", "embed", "mlp"))
        up = constrain(_kernel(self.w_up).astype(dtype), ("expert", "embed", "mlp"))
        down = constrain(_kernel(self.w_down).astype(dtype), ("expert", "mlp", "embed"))
        return gate, up, down

    def _with_capacity(self, x: jax.Array, experts: jax.Array, gates: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
        b, s, _ = x.shape
        e, k = self.n_experts, self.k
        c = capacity(self.capacity_factor, s, e, k)
        # Slot of each (choice, token) in its expert's buffer: a running count over the
        # group in priority order (all first choices, then all second choices, ...).
        chosen = jax.nn.one_hot(jnp.swapaxes(experts, 1, 2), e, dtype=jnp.int32)  # b,k,s,E
        flat = chosen.reshape(b, k * s, e)
        slot = (jnp.cumsum(flat, axis=1) - 1) * flat
        slot = jnp.sum(slot.reshape(b, k, s, e), axis=-1)  # (b, k, s)
        kept = slot < c
        dropped = 1.0 - jnp.mean(kept.astype(jnp.float32))
        # One-hot over (expert, slot) for every kept choice; a token's k choices are
        # distinct experts, so summing over k never adds two ones in the same place.
        where = (chosen.astype(x.dtype)[..., None]
                 * jax.nn.one_hot(jnp.where(kept, slot, c), c, dtype=x.dtype)[..., None, :])
        dispatch = jnp.sum(where, axis=1)  # (b, s, E, C)
        gate_k = jnp.swapaxes(gates, 1, 2).astype(x.dtype)[..., None, None]
        combine = jnp.sum(where * gate_k, axis=1)
        dispatch = constrain(dispatch, ("batch", "seq", None, "capacity"))
        combine = constrain(combine, ("batch", "seq", None, "capacity"))

        act = _activation(self.activation)
        tokens = constrain(jnp.einsum("bsec,bsd->ebcd", dispatch, x), DISPATCHED)
        hidden = act(self.w_gate(tokens)) * self.w_up(tokens)
        hidden = constrain(hidden.astype(x.dtype), ("expert", "batch", "capacity", "mlp"))
        out = self.w_down(checkpoint_name(hidden, "mlp_hidden"))
        out = constrain(out.astype(x.dtype), DISPATCHED)
        y = jnp.einsum("bsec,ebcd->bsd", combine, out)
        return constrain(y, ("batch", "seq", "embed")), dropped

    def _dropless(self, x: jax.Array, experts: jax.Array, gates: jax.Array) -> jax.Array:
        b, s, d = x.shape
        e, k = self.n_experts, self.k
        flat_x = x.reshape(b * s, d)
        flat_experts = experts.reshape(b * s * k)
        order = jnp.argsort(flat_experts, stable=True)
        group_sizes = jnp.bincount(flat_experts, length=e).astype(jnp.int32)
        sorted_x = flat_x[order // k]  # pair i belongs to token i // k
        w_gate, w_up, w_down = self._weights(x.dtype)
        act = _activation(self.activation)
        hidden = act(jax.lax.ragged_dot(sorted_x, w_gate, group_sizes))
        hidden = hidden * jax.lax.ragged_dot(sorted_x, w_up, group_sizes)
        out = jax.lax.ragged_dot(checkpoint_name(hidden, "mlp_hidden"), w_down, group_sizes)
        out = out[jnp.argsort(order)].reshape(b, s, k, d)
        y = jnp.einsum("bskd,bsk->bsd", out, gates.astype(x.dtype))
        return constrain(y, ("batch", "seq", "embed"))

    def _shared(self, x: jax.Array) -> jax.Array:
        gate = _activation(self.activation)(self.shared_gate(x))
        hidden = constrain(gate * self.shared_up(x), ("batch", "seq", "mlp"))
        out = self.shared_down(hidden)
        if hasattr(self, "shared_scale"):  # Qwen2-MoE: a per-token sigmoid weight
            out = jax.nn.sigmoid(self.shared_scale(x)) * out
        return out

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        logits, probs, experts, gates = self.route(x)
        if self.capacity_factor > 0:
            y, dropped = self._with_capacity(x, experts, gates)
        else:
            y, dropped = self._dropless(x, experts, gates), jnp.zeros((), jnp.float32)
        if hasattr(self, "shared_gate"):
            y = y + self._shared(x)
        y = constrain(checkpoint_name(y.astype(x.dtype), "mlp_out"), OUTPUT)
        return y, self._aux(logits, probs, experts, dropped)


def aux_loss(aux: dict[str, jax.Array], cfg: TransformerConfig) -> jax.Array:
    """The router losses to add to the training loss: ``router_aux_loss x
    moe_load_balance + router_z_loss x moe_router_z`` (from :class:`MoE`'s ``aux``)."""
    return (cfg.router_aux_loss * aux["moe_load_balance"]
            + cfg.router_z_loss * aux["moe_router_z"])
