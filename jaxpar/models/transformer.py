"""A Llama-style decoder in Flax NNX, annotated with logical axis names throughout.

RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention through
``jax.nn.dot_product_attention`` (the fused kernel on GPU), optional tied embeddings.
Config fields, not copies of the model, cover the common open families: biases on the
q/k/v projections (Qwen2), RMSNorm on queries and keys (Qwen3), ``head_dim`` other than
``d_model / n_heads``, RoPE frequency scaling (``linear``, and Llama 3.1's ``llama3``),
Gemma's ``(offset + w)`` norm scale, ``sqrt(d_model)`` embedding scale and GeGLU MLP,
sliding-window attention (Mistral), layers alternating between a sliding window and global
attention, attention and final logit soft-capping, norms after each sublayer, a
``query_pre_attn_scalar`` attention scale and a local RoPE base (Gemma 2 and 3), and
mixtures of experts (Mixtral, Qwen-MoE; :mod:`jaxpar.models.moe`).
The decoder layers are created stacked (one weight array per kind, leading ``layers``
axis) and applied with ``jax.lax.scan``, so compile time does not grow with depth.

Under tensor parallelism the layout is Megatron's: Q/K/V and the MLP's gate/up weights
are split on their output (heads, mlp) dimension, the attention output and MLP down
weights on their input dimension, so each block needs one all-reduce in attention and one
in the MLP. Activations are pinned with :func:`jaxpar.constrain` at every block boundary
so GSPMD keeps the batch split rather than inventing a layout of its own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.errors import JaxparError
from jaxpar.models import moe as moe_lib
from jaxpar.models.config import MLP_ACTIVATIONS, TransformerConfig
from jaxpar.models.rotary import apply_rotary, rope_frequencies, rotary_tables
from jaxpar.parallel import attention as attention_lib
from jaxpar.parallel import context as context_lib
from jaxpar.parallel import embedding as embedding_lib
from jaxpar.parallel import loss as loss_lib
from jaxpar.parallel import offload
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.parallel import schedules as schedules_lib
from jaxpar.sharding import remat as remat_lib
from jaxpar.sharding.plan import constrain, current_plan, explicit_sharding

RESIDUAL = ("batch", "residual_seq", "embed")
"""Logical names of the residual stream between blocks (``residual_seq`` is split over the
tensor axis under sequence parallelism, over ``context`` under context parallelism)."""
BLOCK_INPUT = ("batch", "seq", "embed")
"""Logical names of a sublayer's (normed) input."""
_CARRIED = nnx.Any(nnx.RngCount, nnx.BatchStat)
"""Per-layer state a forward pass advances (dropout counters), kept across the scan."""


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, jnp.float32))


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm with a learned scale, applied as ``offset + scale``
    (``offset`` 0 usually; Gemma stores its scales as offsets from 1). The scale starts so
    that the norm multiplies by one."""

    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, offset: float = 0.0):
        init = nnx.initializers.constant(1.0 - offset)
        self.scale = _param(rngs, init, (dim,), ("norm",))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        if self.offset:
            scale = scale + self.offset
        return (y * scale).astype(x.dtype)


def _einsum(rngs: nnx.Rngs, spec: str, shape: tuple[int, ...], names: tuple[str, ...],
            std: float, bias: bool = False) -> nnx.Einsum:
    """An einsum projection; with ``bias``, a bias over the output dims (all but the first)."""
    init = nnx.with_partitioning(nnx.initializers.normal(std), names)
    bias_init = nnx.with_partitioning(nnx.initializers.zeros, names[1:])
    return nnx.Einsum(spec, shape, shape[1:] if bias else None, kernel_init=init,
                      bias_init=bias_init, rngs=rngs)


def _row_parallel(layer: nnx.Module, x: jax.Array, d_model: int) -> jax.Array:
    """``layer(x)`` for a projection back to the residual stream, contracting a dimension
    tensor parallelism splits; on an explicit mesh told its output's layout, which it
    cannot infer."""
    out = explicit_sharding(RESIDUAL, (*x.shape[:2], d_model))
    return layer(x) if out is None else layer(x, out_sharding=out)


def _linear(rngs: nnx.Rngs, d_in: int, d_out: int, names: tuple[str, str], std: float
            ) -> nnx.Linear:
    init = nnx.with_partitioning(nnx.initializers.normal(std), names)
    return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=init, rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query causal self-attention, head-parallel under tensor parallelism.

    Projections are ``nnx.Einsum`` modules, so parameter filters and LoRA see ordinary
    Flax layers (``attn/wq/kernel`` and so on).
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        d, h, std = cfg.d_model, cfg.head_dim, cfg.init_std
        out_std = std / math.sqrt(2 * cfg.n_layers)
        bias = cfg.qkv_bias
        self.wq = _einsum(rngs, "bse,enh->bsnh", (d, cfg.n_heads, h),
                          ("embed", "heads", "head_dim"), std, bias)
        self.wk = _einsum(rngs, "bse,enh->bsnh", (d, cfg.n_kv_heads, h),
                          ("embed", "kv_heads", "head_dim"), std, bias)
        self.wv = _einsum(rngs, "bse,enh->bsnh", (d, cfg.n_kv_heads, h),
                          ("embed", "kv_heads", "head_dim"), std, bias)
        self.wo = _einsum(rngs, "bsnh,nhe->bse", (cfg.n_heads, h, d),
                          ("heads", "head_dim", "embed"), out_std)
        self.d_model = d
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.norm_eps, rngs=rngs, offset=cfg.norm_offset)
            self.k_norm = RMSNorm(h, cfg.norm_eps, rngs=rngs, offset=cfg.norm_offset)
        self.window = cfg.sliding_window
        self.softcap = cfg.attn_logit_softcap
        # Scores scaled by query_pre_attn_scalar ** -0.5: the queries carry the ratio to
        # the head_dim ** -0.5 every attention implementation applies.
        scalar = cfg.query_pre_attn_scalar
        self.q_scale = math.sqrt(h / scalar) if scalar and scalar != h else 0.0
        self.local_rope = bool(cfg.rope_local_theta)
        self.rotary_dim = cfg.rotary_dim if cfg.rotary_dim != h else 0
        self.implementation, self.block = cfg.attention, cfg.attention_block

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array,
                 segments: jax.Array | None = None, is_global: jax.Array | None = None
                 ) -> jax.Array:
        """Attention of ``x`` ``(batch, seq, embed)``; ``is_global`` (a boolean scalar, may
        be traced) makes the layer attend over the whole causal prefix instead of its
        sliding window (``model.global_every``). With ``model.rope_local_theta`` ``sin`` and
        ``cos`` hold two tables, the global layers' first, and the layer takes its own."""
        if self.local_rope:
            pick = 1 if is_global is None else jnp.where(is_global, 0, 1)
            sin, cos = sin[pick], cos[pick]
        q, k = self.wq(x), self.wk(x)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._rotate(q, sin, cos)
        if self.q_scale:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        k = constrain(self._rotate(k, sin, cos), ("batch", "seq", "kv_heads", "head_dim"))
        v = constrain(self.wv(x), ("batch", "seq", "kv_heads", "head_dim"))
        if is_global is None or not self.window:
            o = self._attend(q, k, v, segments, self.window)
        else:  # every implementation's window is static: one branch per window
            o = jax.lax.cond(is_global, lambda: self._attend(q, k, v, segments, 0),
                             lambda: self._attend(q, k, v, segments, self.window))
        o = constrain(checkpoint_name(o, "attention"), ("batch", "seq", "heads", "head_dim"))
        out = _row_parallel(self.wo, o, self.d_model)
        return constrain(checkpoint_name(out, "attention_out"), RESIDUAL)

    def _rotate(self, x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
        """RoPE on the first ``rotary_dim`` dimensions of each head (all of them when it
        is 0), the rest passed through."""
        if not self.rotary_dim:
            return apply_rotary(x, sin, cos)
        r = self.rotary_dim
        return jnp.concatenate([apply_rotary(x[..., :r], sin, cos), x[..., r:]], axis=-1)

    def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array,
                segments: jax.Array | None, window: int) -> jax.Array:
        """Attention over the causal prefix (of each document, with ``segments``) within
        ``window`` (0: all of it); with the sequence split over the plan's ``context``
        axis, exact across the split (see :mod:`jaxpar.parallel.context`)."""
        plan = current_plan()
        if plan is None or plan.mesh.shape.get("context", 1) == 1:
            return attention_lib.attention(q, k, v, implementation=self.implementation,
                                           window=window, block=self.block,
                                           segments=segments, softcap=self.softcap)
        order = sequence_order(q.shape[1])
        positions = np.arange(q.shape[1], dtype=np.int32) if order is None else order
        # Splash runs per device (auto on a TPU) when each device's share of the sequence
        # is whole 128-token tiles; otherwise, and for the other kernels, plain blocks.
        # cuDNN's (auto on a GPU in half precision) on chunk pairs, without windows or
        # documents (the soft cap already rules it out).
        kind = attention_lib.resolve(self.implementation, q.dtype, self.softcap, q.shape[-1])
        tiles = attention_lib.SPLASH_TILE * plan.mesh.shape["context"]
        if self.implementation == "auto" and (
                (kind == "splash" and q.shape[1] % tiles)
                or (kind == "cudnn" and (window or segments is not None))):
            kind = "xla"
        return context_lib.context_attention(
            q, k, v, positions, mesh=plan.mesh, kind=plan.context_attention,
            window=window, segments=segments, softcap=self.softcap, implementation=kind,
            block=self.block,
            q_spec=plan.act_spec(("batch", "seq", "heads", "head_dim"), shape=q.shape),
            kv_spec=plan.act_spec(("batch", "seq", "kv_heads", "head_dim"), shape=k.shape))


def sequence_order(seq_len: int):
    """The order positions are laid out in along the sequence under the active plan:
    ``None`` for the natural order, or (context parallelism with ``context_balance``) the
    balanced order of :func:`jaxpar.parallel.context.balanced_order`."""
    plan = current_plan()
    if plan is None or not plan.context_balance:
        return None
    c = plan.mesh.shape.get("context", 1)
    return None if c == 1 else context_lib.balanced_order(seq_len, c)


class MLP(nnx.Module):
    """Gated feed-forward block (SwiGLU, or GeGLU with ``mlp_activation=gelu_tanh``):
    column-parallel gate/up, row-parallel down."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.w_gate = _linear(rngs, cfg.d_model, cfg.d_ff, ("embed", "mlp"), std)
        self.w_up = _linear(rngs, cfg.d_model, cfg.d_ff, ("embed", "mlp"), std)
        self.w_down = _linear(rngs, cfg.d_ff, cfg.d_model, ("mlp", "embed"), out_std)
        self.activation = cfg.mlp_activation
        self.d_model = cfg.d_model

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = MLP_ACTIVATIONS[self.activation](self.w_gate(x))
        hidden = constrain(gate * self.w_up(x), ("batch", "seq", "mlp"))
        out = _row_parallel(self.w_down, checkpoint_name(hidden, "mlp_hidden"), self.d_model)
        return constrain(checkpoint_name(out, "mlp_out"), RESIDUAL)


class Block(nnx.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with
    ``model.post_norms`` (Gemma 2 and 3) ``x + norm(attn(norm(x)))`` and the same for the
    MLP."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        norm = lambda: RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs, offset=cfg.norm_offset)
        self.attn_norm = norm()
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = moe_lib.MoE(cfg, rngs=rngs) if cfg.n_experts else MLP(cfg, rngs=rngs)
        if cfg.post_norms:
            self.attn_post_norm, self.mlp_post_norm = norm(), norm()

    def __call__(self, x: jax.Array, sin: jax.Array, cos: jax.Array,
                 segments: jax.Array | None = None, is_global: jax.Array | None = None
                 ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """The layer's output; with experts, also the router statistics of this layer.
        ``segments`` ``(batch, seq)``: document ids of packed rows (attention stays
        inside each document). ``is_global``: whether this layer attends globally rather
        than within the sliding window (``model.global_every``; None: the window)."""
        # Named so that a remat policy can keep the layer's input in host memory
        # (plan.remat=offload:layer_input): the backward pass reads it from there.
        x = checkpoint_name(x, "layer_input")
        # The sublayers see the whole sequence: under sequence parallelism this is where
        # the split residual is all-gathered (and their outputs reduce-scattered back).
        y = self.attn(constrain(self.attn_norm(x), BLOCK_INPUT), sin, cos, segments, is_global)
        post = hasattr(self, "attn_post_norm")
        x = x + (self.attn_post_norm(y) if post else y)
        aux = None
        if isinstance(self.mlp, moe_lib.MoE):
            y, aux = self.mlp(constrain(self.mlp_norm(x), BLOCK_INPUT))
        else:
            y = self.mlp(constrain(self.mlp_norm(x), BLOCK_INPUT))
        x = x + (constrain(self.mlp_post_norm(y), RESIDUAL) if post else y)
        return x if aux is None else (x, aux)


class Transformer(nnx.Module):
    """Llama-style decoder: token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``.

    With ``pipeline=Schedule(...)`` the decoder layers are stored in the pipeline layout
    (leading ``("repeat", "stage")`` axes, see :mod:`jaxpar.parallel.pipeline`) and run as
    a pipeline: the forward pass always as GPipe or circular vectorised stages, the
    training loss (:meth:`next_token_loss`) of a ``1f1b`` or ``interleaved_1f1b``
    schedule by that schedule, backward pass included (:mod:`jaxpar.parallel.schedules`).
    The weights are initialised exactly as without it, so the same seed gives the same
    model.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs,
                 pipeline: pipeline_lib.Schedule | None = None):
        # Created unsharded even under a mesh: jaxpar places variables by its rules, and
        # outside any plan the model is an ordinary single-device one.
        with nnx.use_eager_sharding(False):
            self.config = cfg = config
            if pipeline is not None and cfg.n_experts:
                raise JaxparError("model.n_experts > 0 with pipeline stages (mesh.stage > 1) "
                                  "is not supported yet: use expert, fsdp, tensor or "
                                  "context parallelism")
            if pipeline is not None and cfg.global_every:
                raise JaxparError(f"model.global_every={cfg.global_every} with pipeline stages "
                                  "(mesh.stage > 1) is not supported yet: use fsdp, tensor or "
                                  "context parallelism, or set model.global_every=0")
            if pipeline is not None and cfg.final_logit_softcap:
                raise JaxparError(f"model.final_logit_softcap={cfg.final_logit_softcap} with "
                                  "pipeline stages (mesh.stage > 1) is not supported yet")
            if pipeline is not None and pipeline.layers != cfg.n_layers:
                raise JaxparError(
                    f"model.n_layers={cfg.n_layers} must equal pipeline stages x repeats x "
                    f"layers per stage = {pipeline.stages} x {pipeline.repeats} x "
                    f"{pipeline.layers_per_stage}"
                )
            # A tied table is the output head too: drawn at the head's scale (as GPT-2
            # draws it), or the first logits would be sqrt(d_model) times too large.
            embed_std = cfg.init_std if cfg.tie_embeddings else 1.0
            self.embed = _param(rngs, nnx.initializers.normal(embed_std),
                                (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.n_layers,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs=rngs)

            self.blocks = make_blocks(rngs)
            if pipeline is not None:
                self.blocks = pipeline_lib.relayout_module(self.blocks, pipeline.stages,
                                                           pipeline.layers_per_stage)
                self.pipeline_schedule = pipeline
                # model.eval() sets it: evaluation needs no backward pass, so its loss
                # runs the vectorised forward pipeline instead of a 1F1B schedule.
                self.deterministic = False
            self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, rngs=rngs,
                                      offset=cfg.norm_offset)
            if not cfg.tie_embeddings:
                self.lm_head = _linear(rngs, cfg.d_model, cfg.vocab_size, ("embed", "vocab"),
                                       cfg.init_std)

    def embed_tokens(self, tokens: jax.Array, dtype=None) -> jax.Array:
        """Look up token embeddings: ``(batch, seq)`` -> ``(batch, seq, embed)``.

        Computation runs in ``dtype``, by default the dtype the weights are given in (a
        precision policy casts them before the call)."""
        # Looked up in the table's own layout (see jaxpar.parallel.embedding): under FSDP
        # the ids travel to the table's columns, not the table to the ids.
        table = self.embed[...]
        x = embedding_lib.lookup(table.astype(dtype or table.dtype), tokens, current_plan(),
                                 RESIDUAL, in_place=not self.config.tie_embeddings)
        if self.config.embed_scale:  # scaled in the compute dtype, as Gemma does
            x = x * jnp.asarray(math.sqrt(self.config.d_model), x.dtype)
        return constrain(x, RESIDUAL)

    def apply_blocks(self, x: jax.Array, block_fn=None, segments: jax.Array | None = None
                     ) -> jax.Array:
        """Run the stacked decoder layers over ``x`` with ``lax.scan``.

        ``block_fn(block, x, sin, cos[, segments[, is_global]])`` may wrap the layer call
        (remat, for instance); ``is_global`` (a traced boolean, the layer's place in the
        ``model.global_every`` pattern) comes after ``segments`` (None when there are
        none) only for a model with ``global_every``. ``segments`` ``(batch, seq)``:
        document ids of packed rows; attention and RoPE positions then start over at each
        document. A model built with a pipeline schedule runs them with
        :func:`jaxpar.pipeline.pipeline`.
        """
        return self.apply_blocks_with_aux(x, block_fn, segments)[0]

    def apply_blocks_with_aux(self, x: jax.Array, block_fn=None,
                              segments: jax.Array | None = None
                              ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """:meth:`apply_blocks`, also returning the mixture-of-experts router statistics
        summed over layers (empty for a dense model; see :mod:`jaxpar.models.moe`)."""
        order = sequence_order(x.shape[1])
        positions = order if segments is None else attention_lib.document_positions(segments)
        if segments is not None and order is not None:
            raise JaxparError("packed documents (data.eos_id) with plan.context_balance are "
                              "not supported yet: set plan.context_balance=false")
        sin, cos = rotary_tables(x.shape[1], self.config.head_dim, positions=positions,
                                 freqs=rope_frequencies(self.config))
        if self.config.rope_local_theta:  # the local layers' tables beside the global ones
            local = rotary_tables(x.shape[1], self.config.rope_dim,
                                  self.config.rope_local_theta, positions=positions)
            sin, cos = jnp.stack([sin, local[0]]), jnp.stack([cos, local[1]])
        call = self._block_call(block_fn) or (lambda block, h, *args: block(h, *args))
        extra = () if segments is None else (segments,)
        schedule = getattr(self, "pipeline_schedule", None)
        if schedule is not None and segments is not None:
            raise JaxparError("packed documents (data.eos_id) with pipeline stages "
                              "(mesh.stage > 1) are not supported yet: set data.eos_id to -1")
        if schedule is not None:
            return pipeline_lib.pipeline_module(
                self.blocks, x, lambda block, h: call(block, h, sin, cos),
                microbatches=schedule.microbatches, act_names=RESIDUAL,
                layers_per_stage=schedule.layers_per_stage), {}
        graphdef, stacked = nnx.split(self.blocks)
        global_layers = self.global_layers()

        def body(h, xs):
            layer_state, is_global = xs
            layer = nnx.merge(graphdef, layer_state)
            args = (*extra,) if is_global is None else (segments, is_global)
            out = call(layer, h, sin, cos, *args)
            h, aux = out if isinstance(out, tuple) else (out, {})
            # Non-parameter state a layer changed (adapter dropout counters) leaves the scan.
            return h, (nnx.state(layer, _CARRIED), aux)

        x, (mutated, aux) = jax.lax.scan(body, x, (stacked, global_layers))
        if jax.tree.leaves(mutated):
            nnx.update(self.blocks, mutated)
        return x, {name: jnp.sum(values) for name, values in aux.items()}

    def global_layers(self) -> jax.Array | None:
        """Whether each decoder layer attends globally rather than within the sliding
        window, ``(n_layers,)`` booleans (``model.global_every``), or None when every layer
        uses ``model.sliding_window``."""
        cfg = self.config
        if not (cfg.global_every and cfg.sliding_window):
            return None
        return jnp.asarray([cfg.layer_window(i) == 0 for i in range(cfg.n_layers)])

    def _block_call(self, block_fn):
        """How each layer runs: ``block_fn`` if given, else the active plan's remat policy.
        Layer weights kept in host memory (``plan.offload_params``) are brought to the
        device inside the layer's checkpoint, one layer at a time, and fetched again for
        the backward pass rather than kept (see :mod:`jaxpar.parallel.offload`)."""
        streamed = any(offload.is_on_host(w) for w in jax.tree.leaves(nnx.state(self.blocks)))
        if block_fn is None:
            plan = current_plan()
            return remat_lib.block_wrapper(
                plan.remat if plan is not None else "none",
                prepare=offload.stream_layer if streamed else None,
                never_save=(offload.STREAMED,))
        if streamed:
            return remat_lib.checkpointed(block_fn, offload.SAVE_ALL_BUT_STREAMED,
                                          prepare=offload.stream_layer)
        return block_fn

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and output projection (tied to the embedding if configured)."""
        x = self.final_norm(x)
        if self.config.tie_embeddings:
            out = jnp.einsum("bse,ve->bsv", x, self.embed[...].astype(x.dtype))
        else:
            out = self.lm_head(x)
        out = attention_lib.soft_cap(out, self.config.final_logit_softcap)
        return constrain(out, ("batch", "seq", "vocab"))

    def hidden_states(self, tokens: jax.Array, *, dtype=None, block_fn=None,
                      segment_ids: jax.Array | None = None) -> jax.Array:
        """The decoder's output before the final norm: ``(batch, seq, embed)``.

        ``block_fn`` defaults to the active plan's remat policy; ``segment_ids``
        ``(batch, seq)`` are the documents of packed rows (see :meth:`apply_blocks`)."""
        return self.hidden_states_with_aux(tokens, dtype=dtype, block_fn=block_fn,
                                           segment_ids=segment_ids)[0]

    def hidden_states_with_aux(self, tokens: jax.Array, *, dtype=None, block_fn=None,
                               segment_ids: jax.Array | None = None,
                               layout_order: bool = False
                               ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """:meth:`hidden_states` and the router statistics of :meth:`apply_blocks_with_aux`.

        Under context parallelism with ``context_balance`` the tokens are laid out in the
        balanced order for the decoder layers (RoPE and the causal mask follow their true
        positions) and put back in order at the end; with ``layout_order`` they are left in
        the balanced order (:func:`sequence_order`), which a loss over every position can
        use as it is (its targets taken in the same order): putting the hidden states back
        would gather the whole sequence's activations over the context axis, and their
        gradient would be all-reduced over it."""
        if tokens.shape[1] > self.config.max_seq_len:
            raise JaxparError(
                f"sequence length {tokens.shape[1]} exceeds model.max_seq_len="
                f"{self.config.max_seq_len}"
            )
        order = sequence_order(tokens.shape[1])
        if order is not None:
            tokens = jnp.take(tokens, jnp.asarray(order), axis=1)
        x = self.embed_tokens(tokens, dtype)
        x, aux = self.apply_blocks_with_aux(x, block_fn, segment_ids)
        if order is not None and not layout_order:
            x = constrain(jnp.take(x, jnp.asarray(np.argsort(order)), axis=1), RESIDUAL)
        return x, aux

    def __call__(self, tokens: jax.Array, *, dtype=None, block_fn=None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """Logits for ``tokens``; ``block_fn`` defaults to the active plan's remat policy;
        ``segment_ids`` ``(batch, seq)`` keep packed documents apart."""
        return self.logits(self.hidden_states(tokens, dtype=dtype, block_fn=block_fn,
                                              segment_ids=segment_ids))

    def unembedding(self) -> loss_lib.Head | None:
        """The output projection as :func:`jaxpar.parallel.loss.chunked_cross_entropy` takes it: the
        kernel ``(embed, vocab)`` in its compute layout (the tied embedding transposed), the
        head module itself when it is wrapped (LoRA, int8), or None when it cannot be
        applied chunk by chunk (a LoRA head with active dropout would draw a new mask per
        chunk). ``model.final_logit_softcap`` is not part of it: the chunked loss caps
        each chunk's logits (its ``softcap``)."""
        if self.config.tie_embeddings:
            return constrain(self.embed[...].T, ("embed", "vocab"))
        head = self.lm_head
        if type(head) is nnx.Linear and not head.use_bias:
            return constrain(head.kernel[...], ("embed", "vocab"))
        if getattr(head, "dropout", 0) > 0 and not getattr(head, "deterministic", True):
            return None
        return head

    def next_token_loss(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                        loss_mask: jax.Array | None = None
                        ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]] | None:
        """Mean next-token cross-entropy on ``tokens`` ``(batch, seq + 1)`` computed
        ``loss_chunk`` positions at a time (see :mod:`jaxpar.parallel.loss`; from the full logits
        when it is 0 or the head cannot be chunked), or None in that case for a dense
        model: the caller then uses the full logits.
        :func:`jaxpar.training.trainer.lm_loss` calls it.

        Logits are cast to the active plan's output dtype before the softmax, as the
        full-logits loss does. A mixture-of-experts model returns ``(loss, metrics)``: the
        loss includes the weighted router losses, the metrics hold the router statistics
        averaged over layers and ``moe_aux_loss``, their weighted sum.

        ``segment_ids`` ``(batch, seq + 1)``: the documents of packed rows; attention
        stays inside each, and a target in another document than its input (the first
        token after an end of document) does not count. ``loss_mask`` ``(batch, seq + 1)``
        (with ``segment_ids``): only the targets it marks count (a chat's assistant turns)."""
        schedule = getattr(self, "pipeline_schedule", None)
        if schedule is not None and segment_ids is not None:
            raise JaxparError("packed documents (data.eos_id) with pipeline stages "
                              "(mesh.stage > 1) are not supported yet: set data.eos_id to -1")
        if (schedule is not None and schedule.backward_in_schedule
                and not getattr(self, "deterministic", False)):
            return self._scheduled_loss(tokens, schedule)
        chunk = self.config.loss_chunk
        head = self.unembedding() if chunk else None
        if (head is None and not self.config.n_experts and segment_ids is None
                and sequence_order(tokens.shape[1] - 1) is None):
            return None
        inputs_seg = None if segment_ids is None else segment_ids[:, :-1]
        mask = None if segment_ids is None else segment_ids[:, 1:] == segment_ids[:, :-1]
        if mask is not None and loss_mask is not None:
            mask = mask & (loss_mask[:, 1:] > 0)
        # Hidden states in the layout's order (balanced under context parallelism), the
        # targets taken in the same order: the mean over positions does not mind.
        x, aux = self.hidden_states_with_aux(tokens[:, :-1], segment_ids=inputs_seg,
                                             layout_order=True)
        targets, order = tokens[:, 1:], sequence_order(tokens.shape[1] - 1)
        if order is not None:  # (packed documents are refused with the balanced order)
            targets = jnp.take(targets, jnp.asarray(order), axis=1)
        if head is None:
            loss = loss_lib.cross_entropy(self.logits(x), targets, mask)
        else:
            plan = current_plan()
            out_dtype = plan.precision.output if plan is not None else jnp.float32
            loss = loss_lib.chunked_cross_entropy(self.final_norm(x), head, targets,
                                                  chunk=chunk, dtype=out_dtype, mask=mask,
                                                  softcap=self.config.final_logit_softcap)
        if not aux:
            return loss
        metrics = {name: value / self.config.n_layers for name, value in aux.items()}
        metrics["moe_aux_loss"] = moe_lib.aux_loss(metrics, self.config)
        return loss + metrics["moe_aux_loss"], metrics

    def _scheduled_loss(self, tokens: jax.Array, schedule: pipeline_lib.Schedule
                        ) -> jax.Array:
        """:meth:`next_token_loss` under a 1F1B schedule: embedding here, the decoder layers
        by the schedule over the plan's ``stage`` axis, final norm, head and loss on the
        last stage, microbatch by microbatch; its gradient is the schedule's."""
        plan = current_plan()
        if plan is None or plan.mesh.shape.get(pipeline_lib.STAGE, 1) != schedule.stages:
            raise JaxparError(f"schedule {schedule.kind} runs under a plan whose mesh has "
                              f"stage={schedule.stages}")
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if inputs.shape[1] > self.config.max_seq_len:
            raise JaxparError(f"sequence length {inputs.shape[1]} exceeds "
                              f"model.max_seq_len={self.config.max_seq_len}")
        cfg, chunk, out_dtype = self.config, self.config.loss_chunk, plan.precision.output
        call = self._block_call(None) or (lambda block, h, s, c: block(h, s, c))
        blocks_def, blocks = nnx.split(self.blocks)
        norm_def, norm = nnx.split(self.final_norm)
        head_def, head = (None, self.embed[...]) if cfg.tie_embeddings else nnx.split(
            self.lm_head)

        def layer(layer_state, h):
            # RoPE tables are built where they are used: nothing is closed over.
            sin, cos = rotary_tables(h.shape[1], cfg.head_dim, freqs=rope_frequencies(cfg))
            return call(nnx.merge(blocks_def, layer_state), h, sin, cos)

        def head_loss(params, y, t):
            x = nnx.merge(norm_def, params[0])(y)
            w = params[1]
            if chunk:
                kernel = w.T if head_def is None else nnx.merge(head_def, w)
                if head_def is not None and type(kernel) is nnx.Linear:
                    kernel = kernel.kernel[...]
                return loss_lib.chunked_cross_entropy(x, kernel, t, chunk=chunk,
                                                      dtype=out_dtype)
            logits = (jnp.einsum("bse,ve->bsv", x, w.astype(x.dtype)) if head_def is None
                      else nnx.merge(head_def, w)(x))
            return loss_lib.cross_entropy(logits, t)

        loss = schedules_lib.pipelined_loss(
            layer, head_loss, mesh=plan.mesh, schedule=schedule.kind,
            microbatches=schedule.microbatches, virtual=schedule.repeats,
            stage_axis=pipeline_lib.STAGE, batch_axes=pipeline_lib.manual_batch_axes(
                plan, inputs.shape[0], schedule.microbatches))
        return loss(blocks, (norm, head), self.embed_tokens(inputs), targets)
