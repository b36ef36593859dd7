"""The reference decoder's configuration: sizes, family variants and how to compute.

Kept apart from the model so that configs, the planner and converters can read and check
a model's shape without building it.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxpar.errors import JaxparError
from jaxpar.parallel import attention as attention_lib

ROPE_SCALINGS = ("none", "linear", "llama3")
MLP_ACTIVATIONS = {"silu": jax.nn.silu,
                   "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
                   "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and variants of the decoder.

    ``head_dim=0`` means ``d_model // n_heads``. ``qkv_bias``: biases on the q/k/v
    projections. ``qk_norm``: RMSNorm over ``head_dim`` on queries and keys before RoPE.
    ``rope_scaling``: ``none``, ``linear`` (frequencies divided by ``rope_factor``) or
    ``llama3`` (low frequencies divided by ``rope_factor``, high ones kept, a smooth blend
    between, set by ``rope_low_freq_factor``, ``rope_high_freq_factor`` and
    ``rope_original_max_len``). ``norm_offset``: norms scale by ``norm_offset + w`` (Gemma:
    1, its weights stored as offsets from one). ``embed_scale``: multiply embeddings by
    ``sqrt(d_model)``. ``mlp_activation``: the gate's nonlinearity, ``silu`` (SwiGLU),
    ``gelu_tanh`` or ``gelu`` (GeGLU). ``sliding_window``: each query sees only itself and
    the ``sliding_window - 1`` tokens before it (0: the whole causal prefix); see
    ``global_every`` for layers that alternate between local and global attention.
    ``attention``: the implementation (``auto``, ``xla``, ``cudnn``, ``chunked``, ``splash``; see
    :mod:`jaxpar.parallel.attention`), ``attention_block`` the key block of ``chunked``. These two
    change how attention is computed, not what: any value gives the same model.
    ``loss_chunk``: the default loss (:func:`jaxpar.training.trainer.lm_loss`, through
    :meth:`Transformer.next_token_loss`) computes logits, softmax and their gradient this
    many sequence positions at a time, never holding the full ``(batch, seq, vocab)``
    logits (see :mod:`jaxpar.parallel.loss`); 0 materialises them. It too changes only how.

    Mixture of experts (``n_experts > 0``): every layer's MLP becomes ``n_experts`` gated
    experts of width ``expert_d_ff`` (0: ``d_ff``), each token routed to
    ``experts_per_token`` of them, plus ``n_shared_experts`` experts every token uses.
    ``expert_capacity``: the capacity factor (each expert takes at most
    ``capacity x tokens x experts_per_token / n_experts`` tokens of a sequence, the rest
    pass through the residual); 0 is dropless. ``router_aux_loss`` and ``router_z_loss``
    weigh the load-balancing and router z-losses added to the training loss (see
    :mod:`jaxpar.models.moe`).
    """

    vocab_size: int = 256
    """Token ids the model embeds and predicts (the token data are checked against it)."""
    d_model: int = 64
    """Width of the residual stream (the embedding size)."""
    n_layers: int = 2
    """Decoder blocks."""
    n_heads: int = 4
    """Query heads per attention layer."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention: ``n_heads`` must be a multiple; equal to it
    is multi-head attention)."""
    head_dim: int = 0
    """Size of each head; 0: ``d_model // n_heads``."""
    d_ff: int = 256
    """Hidden width of each block's gated MLP."""
    max_seq_len: int = 256
    """The longest sequence the model is built for (RoPE tables); ``train.seq_len`` may not
    exceed it."""
    tie_embeddings: bool = False
    """Use the embedding table as the output head (no separate head weights)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding's frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms."""
    init_std: float = 0.02
    """Standard deviation of the weights' normal initialisation."""
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    """The ``rope_scaling`` factor frequencies are divided by (``linear``, ``llama3``)."""
    rope_low_freq_factor: float = 1.0
    """``llama3`` scaling: wavelengths longer than ``rope_original_max_len /
    rope_low_freq_factor`` are divided by ``rope_factor``."""
    rope_high_freq_factor: float = 4.0
    """``llama3`` scaling: wavelengths shorter than ``rope_original_max_len /
    rope_high_freq_factor`` are kept."""
    rope_original_max_len: int = 8192
    """``llama3`` scaling: the context length the model was trained for before scaling."""
    norm_offset: float = 0.0
    embed_scale: bool = False
    mlp_activation: str = "silu"
    sliding_window: int = 0
    global_every: int = 0
    """Local/global layer alternation (Gemma 2 and 3): with ``sliding_window`` > 0 and
    ``global_every=N`` > 0, every ``N``-th layer (those with ``(i + 1) % N == 0``, ``i``
    counting from 0) attends over the whole causal prefix and the others within the
    sliding window; Gemma 2 is ``N=2`` (layer 0 local, layer 1 global), Gemma 3 ``N=6``
    (Hugging Face's ``sliding_window_pattern``). 0: every layer uses ``sliding_window``.
    Adds no weights or state; not available with pipeline stages."""
    attn_logit_softcap: float = 0.0
    """Attention logit soft-capping (Gemma 2 uses 50): the scaled scores become ``cap *
    tanh(scores / cap)`` before the mask and softmax; 0: off. Every ``model.attention``
    but ``cudnn`` takes it (``xla`` then computes attention in plain JAX), and context
    parallelism does."""
    final_logit_softcap: float = 0.0
    """Output logit soft-capping (Gemma 2 uses 30): logits become ``cap * tanh(logits /
    cap)``; 0: off. The loss then takes the full logits (no ``loss_chunk``); not available
    with pipeline stages."""
    query_pre_attn_scalar: float = 0.0
    """Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma 2 and 3)
    instead of ``head_dim ** -0.5``; 0: ``head_dim``."""
    post_norms: bool = False
    """A second RMSNorm on the output of each sublayer before it joins the residual
    stream (Gemma 2 and 3: ``x + norm(attn(norm(x)))``, the same for the MLP)."""
    rotary_dim: int = 0
    """Dimensions of each head that RoPE rotates, the first ones, the others passed
    through (Phi-3's ``partial_rotary_factor x head_dim``); 0: the whole head."""
    rope_local_theta: float = 0.0
    """RoPE base of the sliding-window layers of ``global_every`` (Gemma 3: 10000), plain
    RoPE without ``rope_scaling`` there; 0: every layer uses ``rope_theta`` and its
    scaling."""
    attention: str = "auto"
    attention_block: int = 512
    """The key block size of the ``chunked`` attention implementation."""
    loss_chunk: int = 0
    n_experts: int = 0
    """Experts in each layer's MLP (mixture of experts); 0: a dense MLP."""
    experts_per_token: int = 2
    """Experts each token is routed to (with ``n_experts``)."""
    expert_d_ff: int = 0
    """Hidden width of each expert; 0: ``d_ff``."""
    expert_capacity: float = 1.25
    n_shared_experts: int = 0
    """Experts every token uses besides its routed ones."""
    shared_expert_gate: bool = False
    """Weigh the shared experts' output per token by ``sigmoid(x @ w)`` (a learned
    ``(d_model, 1)`` projection; Qwen2-MoE)."""
    renormalize_gates: bool = True
    """Divide a token's top ``experts_per_token`` router probabilities by their sum
    (Mixtral; Qwen's ``norm_topk_prob``); false: use them as they are."""
    router_aux_loss: float = 0.01
    """Weight of the router's load-balancing loss added to the training loss."""
    router_z_loss: float = 0.001
    """Weight of the router's z-loss (on its logits' size) added to the training loss."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise JaxparError(f"model.{name}={getattr(self, name)}: must be at least 1")
        for name in ("rope_theta", "norm_eps", "init_std", "rope_factor",
                     "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len"):
            if not getattr(self, name) > 0:
                raise JaxparError(f"model.{name}={getattr(self, name)}: must be positive")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise JaxparError(f"model.rope_scaling={self.rope_scaling!r}: choose one of "
                              f"{list(ROPE_SCALINGS)}")
        if (self.rope_scaling == "llama3"
                and not self.rope_high_freq_factor > self.rope_low_freq_factor):
            raise JaxparError(
                f"model.rope_high_freq_factor={self.rope_high_freq_factor} must be greater "
                f"than model.rope_low_freq_factor={self.rope_low_freq_factor}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise JaxparError(f"model.mlp_activation={self.mlp_activation!r}: choose one of "
                              f"{list(MLP_ACTIVATIONS)}")
        if self.attention not in attention_lib.IMPLEMENTATIONS:
            raise JaxparError(f"model.attention={self.attention!r}: choose one of "
                              f"{list(attention_lib.IMPLEMENTATIONS)}")
        if self.attention_block < 1:
            raise JaxparError(f"model.attention_block={self.attention_block}: must be at "
                              "least 1")
        if self.loss_chunk < 0:
            raise JaxparError(f"model.loss_chunk={self.loss_chunk}: must be 0 (full logits) "
                              "or a positive number of sequence positions")
        if self.n_experts < 0 or self.n_shared_experts < 0 or self.expert_d_ff < 0:
            raise JaxparError("model.n_experts, model.n_shared_experts and model.expert_d_ff "
                              "must not be negative")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise JaxparError(f"model.experts_per_token={self.experts_per_token}: must be "
                              f"between 1 and model.n_experts={self.n_experts}")
        if self.expert_capacity < 0 or self.router_aux_loss < 0 or self.router_z_loss < 0:
            raise JaxparError("model.expert_capacity, model.router_aux_loss and "
                              "model.router_z_loss must not be negative")
        if self.sliding_window < 0:
            raise JaxparError(f"model.sliding_window={self.sliding_window}: must be 0 (off) "
                              "or a positive number of tokens")
        if self.global_every < 0:
            raise JaxparError(f"model.global_every={self.global_every}: must be 0 (off) or "
                              "a positive number of layers")
        if self.global_every and not self.sliding_window:
            raise JaxparError(f"model.global_every={self.global_every} needs "
                              "model.sliding_window > 0 (the window of the local layers)")
        for name in ("final_logit_softcap", "query_pre_attn_scalar", "rope_local_theta"):
            if not getattr(self, name) >= 0:
                raise JaxparError(f"model.{name}={getattr(self, name)}: must be 0 (off) or "
                                  "positive")
        if self.rope_local_theta and not self.global_every:
            raise JaxparError(f"model.rope_local_theta={self.rope_local_theta} needs "
                              "model.global_every > 0 (it is the base of the local layers)")
        if self.shared_expert_gate and not (self.n_experts and self.n_shared_experts):
            raise JaxparError("model.shared_expert_gate needs model.n_experts > 0 and "
                              "model.n_shared_experts > 0 (it weighs the shared experts)")
        if not self.attn_logit_softcap >= 0:
            raise JaxparError(f"model.attn_logit_softcap={self.attn_logit_softcap}: must be "
                              "0 (off) or positive")
        if self.attn_logit_softcap and self.attention == "cudnn":
            raise JaxparError(f"model.attn_logit_softcap={self.attn_logit_softcap} with "
                              "model.attention='cudnn': cuDNN's kernel has no logit cap; use "
                              "model.attention=auto, xla, chunked or splash")
        if self.head_dim < 0:
            raise JaxparError(f"model.head_dim={self.head_dim}: must be positive (or 0: "
                              "d_model // n_heads)")
        if self.head_dim == 0:
            if self.d_model % self.n_heads:
                raise JaxparError(
                    f"model.d_model={self.d_model} is not divisible by model.n_heads="
                    f"{self.n_heads}; set model.head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise JaxparError(
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads="
                f"{self.n_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise JaxparError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise JaxparError(f"model.rotary_dim={self.rotary_dim}: must be an even number of "
                              f"dimensions, at most head_dim={self.head_dim} (0: all of them)")

    def layer_window(self, layer: int) -> int:
        """The attention window of decoder layer ``layer`` (counting from 0): 0 (the whole
        causal prefix) for the global layers of ``global_every``, else ``sliding_window``."""
        if self.global_every and (layer + 1) % self.global_every == 0:
            return 0
        return self.sliding_window

    @property
    def rope_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (``rotary_dim``, else ``head_dim``)."""
        return self.rotary_dim or self.head_dim

    @property
    def moe_d_ff(self) -> int:
        """Width of one expert's MLP."""
        return self.expert_d_ff or self.d_ff

    def active_param_count(self) -> int:
        """Parameters one token uses (all of them for a dense model; with experts, only
        ``experts_per_token`` routed experts and the shared ones count)."""
        total = self.param_count()
        if not self.n_experts:
            return total
        idle = self.n_experts - self.experts_per_token
        return total - self.n_layers * 3 * self.d_model * self.moe_d_ff * idle

    def param_count(self) -> int:
        """Number of parameters, embeddings included."""
        d, h = self.d_model, self.head_dim
        attn = d * h * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.qkv_bias:
            attn += h * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:
            attn += 2 * h
        mlp = 3 * d * self.d_ff
        if self.n_experts:
            mlp = 3 * d * self.moe_d_ff * (self.n_experts + self.n_shared_experts)
            mlp += d * self.n_experts  # the router
        if self.shared_expert_gate:
            mlp += d
        per_layer = attn + mlp + (4 if self.post_norms else 2) * d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layers * per_layer + d + head
