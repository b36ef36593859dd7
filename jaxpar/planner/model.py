"""What the planner knows of a model: its parameter tensors (shape, logical axis names) and,
for transformers, the sizes that drive activation memory and attention FLOPs (and, for a
mixture of experts, how many experts a token uses, which sets its FLOPs).

Two sources: a :class:`jaxpar.models.TransformerConfig` (read analytically, in microseconds,
so the search can evaluate thousands of candidates), or any Flax NNX model factory, read by
abstract evaluation (``nnx.eval_shape``: shapes and logical names, no arrays allocated).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from jaxpar.errors import JaxparError
from jaxpar.models.config import TransformerConfig
from jaxpar.sharding.annotations import logical_names
from jaxpar.sharding.paths import path_str


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter array as the Trainer stores it (stacked layers keep their axis)."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]

    @property
    def size(self) -> int:
        """Elements."""
        return math.prod(self.shape)

    @property
    def per_layer(self) -> bool:
        """True for a decoder-layer weight stacked over ``layers`` (or the pipeline's
        ``repeat, stage``): the scan runs it once per layer, and HLO holds its
        collectives once, inside the loop body."""
        return bool(self.names) and self.names[0] in ("layers", "repeat")


class IdentityMemo:
    """Results of pure functions looked up by the identity of the objects they read (a
    :class:`ModelSpec`, a layout: hashing them walks all their tensors) and by hashable
    arguments. Each entry holds the objects it was keyed by, so their ids cannot be reused
    by others while it lives; the memo is emptied when it reaches ``size`` entries."""

    def __init__(self, size: int = 4096):
        self._entries: dict[tuple, tuple[tuple[Any, ...], Any]] = {}
        self._size = size

    def get(self, owners: tuple[Any, ...], args: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()``, remembered under ``owners`` (by identity) and ``args``."""
        key = (*map(id, owners), *args)
        hit = self._entries.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], owners, strict=True)):
            return hit[1]
        out = compute()
        if len(self._entries) >= self._size:
            self._entries.clear()
        self._entries[key] = (owners, out)
        return out


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Parameters plus the transformer sizes (zero for a generic model).

    ``attention``, ``attention_block`` and ``loss_chunk`` say how the transformer computes
    attention and the loss (the :class:`~jaxpar.models.TransformerConfig` fields of those
    names), which sets how much of its memory grows with ``seq x seq`` and ``seq x vocab``;
    ``sliding_window`` and ``global_every`` which layers see only a window of keys (what
    kernels that skip masked blocks then compute). ``post_norms`` (a norm after each
    sublayer too), ``qk_norm`` (norms on queries and keys), ``mlp_activation`` and
    ``attn_logit_softcap`` (Gemma's) add to what a layer saves for the backward pass (see
    :mod:`jaxpar.planner.memory`).
    """

    tensors: tuple[Tensor, ...]
    n_layers: int = 0
    d_model: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    d_ff: int = 0
    vocab_size: int = 0
    tie_embeddings: bool = False
    name: str = "model"
    attention: str = "auto"
    attention_block: int = 512
    loss_chunk: int = 0
    sliding_window: int = 0
    global_every: int = 0
    n_experts: int = 0
    experts_per_token: int = 0
    expert_d_ff: int = 0
    n_shared_experts: int = 0
    capacity_factor: float = 0.0
    post_norms: bool = False
    qk_norm: bool = False
    mlp_activation: str = "silu"
    attn_logit_softcap: float = 0.0
    tracer: Any = dataclasses.field(default=None, compare=False, repr=False)
    """For a model jaxpar did not write, read from a run config: its
    :class:`jaxpar.planner.traced.StepTracer`, whose traced step gives the activation
    memory and model FLOPs the transformer fields give the reference model (None: not
    known)."""

    @property
    def windowed_layers(self) -> int:
        """Layers that attend within ``sliding_window`` (all of them, or with
        ``global_every = N`` all but every ``N``-th)."""
        if not self.sliding_window:
            return 0
        return self.n_layers - (self.n_layers // self.global_every if self.global_every else 0)

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts transformer."""
        return self.n_experts > 0

    @property
    def n_params(self) -> int:
        """All parameters."""
        return sum(t.size for t in self.tensors)

    @property
    def n_dense(self) -> int:
        """Parameters that take part in matmuls (everything but the embedding lookup
        table, unless it is tied to the output head, and the norm scales)."""
        skip = 0
        for t in self.tensors:
            if "norm" in t.names or (t.path == "embed" and not self.tie_embeddings):
                skip += t.size
        return self.n_params - skip

    @property
    def n_expert_params(self) -> int:
        """Parameters of the routed experts (the tensors with an ``expert`` axis)."""
        return sum(t.size for t in self.tensors if "expert" in t.names)

    @property
    def n_active_dense(self) -> int:
        """Matmul parameters one token uses: :attr:`n_dense` less the routed experts it is
        not sent to (``n_experts - experts_per_token`` of every layer's)."""
        if not self.is_moe:
            return self.n_dense
        idle = self.n_experts - self.experts_per_token
        return self.n_dense - self.n_expert_params * idle // self.n_experts

    @property
    def is_transformer(self) -> bool:
        """True when the activation sizes are known."""
        return self.n_layers > 0 and self.d_model > 0


def from_transformer(cfg: TransformerConfig, *, stages: int = 1) -> ModelSpec:
    """The parameter tensors of :class:`jaxpar.models.Transformer` for ``cfg``.

    With ``stages > 1`` the decoder layers use the pipeline layout ``(repeat, stage, ...)``.
    With ``cfg.n_experts > 0`` each layer's MLP is the router, the stacked experts
    ``(n_experts, ...)`` and the shared experts' dense MLP, as :mod:`jaxpar.models.moe` builds it.
    """
    d, h, L = cfg.d_model, cfg.head_dim, cfg.n_layers
    n, k, f, v = cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size
    if stages > 1:
        if L % stages:
            raise JaxparError(f"model.n_layers={L} is not divisible by {stages} stages")
        lead, lead_names = (L // stages, stages), ("repeat", "stage")
    else:
        lead, lead_names = (L,), ("layers",)
    layer = [
        ("attn_norm/scale", (d,), ("norm",)),
        ("attn/wq/kernel", (d, n, h), ("embed", "heads", "head_dim")),
        ("attn/wk/kernel", (d, k, h), ("embed", "kv_heads", "head_dim")),
        ("attn/wv/kernel", (d, k, h), ("embed", "kv_heads", "head_dim")),
        ("attn/wo/kernel", (n, h, d), ("heads", "head_dim", "embed")),
        ("mlp_norm/scale", (d,), ("norm",)),
    ]
    if cfg.qkv_bias:  # Qwen2
        layer += [("attn/wq/bias", (n, h), ("heads", "head_dim")),
                  ("attn/wk/bias", (k, h), ("kv_heads", "head_dim")),
                  ("attn/wv/bias", (k, h), ("kv_heads", "head_dim"))]
    if cfg.qk_norm:  # Qwen3
        layer += [("attn/q_norm/scale", (h,), ("norm",)), ("attn/k_norm/scale", (h,), ("norm",))]
    layer += _moe_tensors(cfg) if cfg.n_experts else [
        ("mlp/w_gate/kernel", (d, f), ("embed", "mlp")),
        ("mlp/w_up/kernel", (d, f), ("embed", "mlp")),
        ("mlp/w_down/kernel", (f, d), ("mlp", "embed")),
    ]
    tensors = [Tensor("embed", (v, d), ("vocab", "embed"))]
    tensors += [Tensor(f"blocks/{p}", lead + s, lead_names + names) for p, s, names in layer]
    tensors.append(Tensor("final_norm/scale", (d,), ("norm",)))
    if not cfg.tie_embeddings:
        tensors.append(Tensor("lm_head/kernel", (d, v), ("embed", "vocab")))
    return ModelSpec(tuple(tensors), L, d, n, k, h, f, v, cfg.tie_embeddings,
                     name=f"transformer d{d} L{L}", attention=cfg.attention,
                     attention_block=cfg.attention_block, loss_chunk=cfg.loss_chunk,
                     sliding_window=cfg.sliding_window,
                     global_every=getattr(cfg, "global_every", 0), post_norms=cfg.post_norms,
                     qk_norm=cfg.qk_norm, mlp_activation=cfg.mlp_activation,
                     attn_logit_softcap=cfg.attn_logit_softcap, **_moe_fields(cfg))


def _moe_tensors(cfg: TransformerConfig) -> list[tuple[str, tuple[int, ...], tuple]]:
    """One layer's mixture-of-experts weights as :class:`jaxpar.models.moe.MoE` names them."""
    d, e, f = cfg.d_model, cfg.n_experts, cfg.moe_d_ff
    out: list[tuple[str, tuple[int, ...], tuple]] = [
        ("mlp/router/kernel", (d, e), ("embed", None)),
        ("mlp/w_gate/kernel", (e, d, f), ("expert", "embed", "mlp")),
        ("mlp/w_up/kernel", (e, d, f), ("expert", "embed", "mlp")),
        ("mlp/w_down/kernel", (e, f, d), ("expert", "mlp", "embed")),
    ]
    if cfg.n_shared_experts:
        w = cfg.n_shared_experts * f
        out += [("mlp/shared_gate/kernel", (d, w), ("embed", "mlp")),
                ("mlp/shared_up/kernel", (d, w), ("embed", "mlp")),
                ("mlp/shared_down/kernel", (w, d), ("mlp", "embed"))]
    return out


def _moe_fields(cfg: TransformerConfig) -> dict[str, Any]:
    if not cfg.n_experts:
        return {}
    return {"n_experts": cfg.n_experts, "experts_per_token": cfg.experts_per_token,
            "expert_d_ff": cfg.moe_d_ff, "n_shared_experts": cfg.n_shared_experts,
            "capacity_factor": float(cfg.expert_capacity)}


def from_nnx(factory: Callable[[], Any], *, name: str = "model") -> ModelSpec:
    """Parameter tensors of any Flax NNX model, by abstract evaluation (no arrays made).

    Logical names come from each variable's sharding metadata (``nnx.with_partitioning``);
    a parameter without names counts as replicated. A model that carries a
    ``TransformerConfig`` as ``.config`` also gets the activation sizes.
    """
    import jax
    from flax import nnx

    try:
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(factory)
    except JaxparError:
        raise
    except Exception as err:  # the factory is user code: say which step failed
        raise JaxparError(f"could not evaluate the model factory abstractly: {err}") from None
    params = nnx.state(abstract, nnx.Param)
    tensors = []
    for path, var in jax.tree_util.tree_leaves_with_path(
            params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        shape = tuple(var.get_value().shape)
        names = logical_names(var, len(shape)) or (None,) * len(shape)
        tensors.append(Tensor(path_str(path), shape, tuple(names)))
    cfg = getattr(abstract, "config", None)
    if isinstance(cfg, TransformerConfig):
        t = from_transformer(cfg)
        return dataclasses.replace(t, tensors=tuple(tensors), name=name)
    return ModelSpec(tuple(tensors), name=name)
