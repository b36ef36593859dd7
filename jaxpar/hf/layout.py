"""Where each of the reference decoder's weights lives in a Hugging Face checkpoint.

A :class:`Tensor` names one jaxpar parameter (``blocks/attn/wq/kernel``), the Hugging Face
tensor it comes from (``model.layers.{i}.self_attn.q_proj.weight``, ``{i}`` for a layer)
and the transform between them: jaxpar's array is the Hugging Face one reshaped to
``view`` and transposed by ``perm``. PyTorch stores a linear layer as ``(out, in)``; jaxpar
keeps ``(in, out)`` kernels, with attention heads as their own dimensions, so
``q_proj.weight`` ``(heads * head_dim, d_model)`` becomes ``wq`` ``(d_model, heads,
head_dim)``. :func:`source_slices` turns a slice of the view into the slices of the stored
tensor that hold it, which is what lets a process read only its own shards; the transpose
to jaxpar's order is left to the devices.

Two kinds of tensor are not one-to-one. A fused projection (Phi-3's ``qkv_proj`` and
``gate_up_proj``) holds several jaxpar parameters one after the other along its first
dimension: each is a :class:`Tensor` with ``rows``, its part of the stored rows. A
mixture of experts stores each expert's projection apart
(``mlp.experts.{j}.gate_proj.weight``) where jaxpar stacks them on a leading ``expert``
axis: a :class:`Tensor` with ``experts`` > 0, whose ``shape`` is one expert's and whose
view starts with the expert axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from jaxpar.models.config import TransformerConfig

LAYER = "model.layers.{i}."
"""Prefix of one decoder layer's tensors."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter: jaxpar ``path``, Hugging Face ``name`` (``{i}``: layer index), the
    stored ``shape``, and ``view``/``perm`` with ``jaxpar = stored.reshape(view)
    .transpose(perm)``; ``per_layer``: stacked over the decoder layers in jaxpar."""

    path: str
    name: str
    shape: tuple[int, ...]
    view: tuple[int, ...]
    perm: tuple[int, ...]
    per_layer: bool
    rows: tuple[int, int, int] | None = None
    """A part of a fused tensor: ``(start, stop, total)`` rows of the stored first
    dimension (``shape`` is the part's)."""
    experts: int = 0
    """Experts stored apart (``{j}`` in ``name``); ``view[0]`` is the expert axis."""

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the whole stored tensor (one expert's, for per-expert tensors)."""
        return (self.rows[2], *self.shape[1:]) if self.rows else self.shape

    def expert(self) -> Tensor:
        """The :class:`Tensor` of one expert of a per-expert tensor (its view without the
        expert axis)."""
        if not self.experts or self.perm[0] != 0:
            raise ValueError(f"{self.path} is not stacked over experts")
        return dataclasses.replace(self, view=self.view[1:],
                                   perm=tuple(p - 1 for p in self.perm[1:]), experts=0)

    @property
    def jaxpar_shape(self) -> tuple[int, ...]:
        """Shape of one (per-layer) jaxpar array."""
        return tuple(self.view[p] for p in self.perm)

    def to_jaxpar(self, stored: np.ndarray) -> np.ndarray:
        """The jaxpar layout of a whole stored tensor."""
        return stored.reshape(self.view).transpose(self.perm)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        """The stored (Hugging Face) layout of a whole jaxpar array."""
        return np.ascontiguousarray(array.transpose(np.argsort(self.perm)).reshape(self.shape))


def _linear(path: str, name: str, d_in: int, d_out: int) -> Tensor:
    return Tensor(path, LAYER + name, (d_out, d_in), (d_out, d_in), (1, 0), True)


FUSED = ("Phi3ForCausalLM",)
"""Architectures whose q/k/v and gate/up projections are each one stored tensor."""
MIXTRAL_NAMES = {"router": "block_sparse_moe.gate", "w_gate": "block_sparse_moe.experts.{j}.w1",
                 "w_up": "block_sparse_moe.experts.{j}.w3",
                 "w_down": "block_sparse_moe.experts.{j}.w2"}
QWEN_MOE_NAMES = {"router": "mlp.gate", "w_gate": "mlp.experts.{j}.gate_proj",
                  "w_up": "mlp.experts.{j}.up_proj", "w_down": "mlp.experts.{j}.down_proj",
                  "shared_gate": "mlp.shared_expert.gate_proj",
                  "shared_up": "mlp.shared_expert.up_proj",
                  "shared_down": "mlp.shared_expert.down_proj",
                  "shared_scale": "mlp.shared_expert_gate"}
"""jaxpar MoE projection (``blocks/mlp/<name>``) -> the Hugging Face module of a layer."""


def _moe(cfg: TransformerConfig, architecture: str | None) -> list[Tensor]:
    """The tensors of a mixture-of-experts MLP: the router, each expert's projections
    (stacked on the expert axis in jaxpar) and the shared experts with their gate."""
    d, f, e = cfg.d_model, cfg.moe_d_ff, cfg.n_experts
    names = MIXTRAL_NAMES if architecture == "MixtralForCausalLM" else QWEN_MOE_NAMES
    out = [_linear("blocks/mlp/router/kernel", names["router"] + ".weight", d, e)]
    for proj, (d_in, d_out) in (("w_gate", (d, f)), ("w_up", (d, f)), ("w_down", (f, d))):
        out.append(Tensor(f"blocks/mlp/{proj}/kernel", LAYER + names[proj] + ".weight",
                          (d_out, d_in), (e, d_out, d_in), (0, 2, 1), True, experts=e))
    if cfg.n_shared_experts:
        width = cfg.n_shared_experts * f
        for proj, (d_in, d_out) in (("shared_gate", (d, width)), ("shared_up", (d, width)),
                                    ("shared_down", (width, d))):
            out.append(_linear(f"blocks/mlp/{proj}/kernel", names[proj] + ".weight", d_in,
                               d_out))
    if cfg.shared_expert_gate:
        out.append(_linear("blocks/mlp/shared_scale/kernel", names["shared_scale"] + ".weight",
                           d, 1))
    return out


def tensors(cfg: TransformerConfig, architecture: str | None = None) -> list[Tensor]:
    """Every parameter of a decoder with config ``cfg``, in Hugging Face's order, as the
    family ``architecture`` stores them (default: separate projections, Llama's names)."""
    d, h, n, k, f = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff
    fused = architecture in FUSED
    out = [Tensor("embed", "model.embed_tokens.weight", (cfg.vocab_size, d),
                  (cfg.vocab_size, d), (0, 1), False)]

    def norm(path: str, name: str, size: int = d) -> Tensor:
        return Tensor(path, LAYER + name, (size,), (size,), (0,), True)

    out.append(norm("blocks/attn_norm/scale", "input_layernorm.weight"))
    start = 0
    for proj, heads in (("q", n), ("k", k), ("v", k)):
        name = "self_attn.qkv_proj.weight" if fused else f"self_attn.{proj}_proj.weight"
        rows = (start, start + heads * h, (n + 2 * k) * h) if fused else None
        start += heads * h
        out.append(Tensor(f"blocks/attn/w{proj}/kernel", LAYER + name, (heads * h, d),
                          (heads, h, d), (2, 0, 1), True, rows=rows))
        if cfg.qkv_bias:
            out.append(Tensor(f"blocks/attn/w{proj}/bias", LAYER + f"self_attn.{proj}_proj.bias",
                              (heads * h,), (heads, h), (0, 1), True))
    out.append(Tensor("blocks/attn/wo/kernel", LAYER + "self_attn.o_proj.weight",
                      (d, n * h), (d, n, h), (1, 2, 0), True))
    if cfg.qk_norm:
        out.append(norm("blocks/attn/q_norm/scale", "self_attn.q_norm.weight", h))
        out.append(norm("blocks/attn/k_norm/scale", "self_attn.k_norm.weight", h))
    if cfg.post_norms:  # Gemma 2 and 3: a norm after each sublayer, another name before
        out.append(norm("blocks/attn_post_norm/scale", "post_attention_layernorm.weight"))
        out.append(norm("blocks/mlp_norm/scale", "pre_feedforward_layernorm.weight"))
        out.append(norm("blocks/mlp_post_norm/scale", "post_feedforward_layernorm.weight"))
    else:
        out.append(norm("blocks/mlp_norm/scale", "post_attention_layernorm.weight"))
    if cfg.n_experts:
        out.extend(_moe(cfg, architecture))
    elif fused:
        for proj, at in (("w_gate", 0), ("w_up", f)):
            t = _linear(f"blocks/mlp/{proj}/kernel", "mlp.gate_up_proj.weight", d, f)
            out.append(dataclasses.replace(t, rows=(at, at + f, 2 * f)))
    else:
        out.append(_linear("blocks/mlp/w_gate/kernel", "mlp.gate_proj.weight", d, f))
        out.append(_linear("blocks/mlp/w_up/kernel", "mlp.up_proj.weight", d, f))
    if not cfg.n_experts:
        out.append(_linear("blocks/mlp/w_down/kernel", "mlp.down_proj.weight", f, d))
    out.append(Tensor("final_norm/scale", "model.norm.weight", (d,), (d,), (0,), False))
    if not cfg.tie_embeddings:
        out.append(Tensor("lm_head/kernel", "lm_head.weight", (cfg.vocab_size, d),
                          (cfg.vocab_size, d), (1, 0), False))
    return out


def layer_name(tensor: Tensor, layer: int | None, expert: int | str = "*") -> str:
    """The Hugging Face name of ``tensor`` in decoder layer ``layer`` (and of its expert
    ``expert`` for a per-expert tensor)."""
    return tensor.name.format(i=layer, j=expert)


def stored_names(tensor: Tensor, n_layers: int) -> list[tuple[str, int | None, int | None]]:
    """``(name, layer, expert)`` of every stored tensor ``tensor`` reads (``None`` where
    it is not per layer or per expert)."""
    layers = range(n_layers) if tensor.per_layer else [None]
    experts = range(tensor.experts) if tensor.experts else [None]
    return [(tensor.name if i is None and j is None else layer_name(tensor, i, j), i, j)
            for i in layers for j in experts]


def _groups(shape: tuple[int, ...], view: tuple[int, ...]) -> list[list[int]]:
    """Which view dimensions each stored dimension splits into (a reshape's grouping)."""
    groups, v = [], 0
    for size in shape:
        group, prod = [], 1
        while prod < size or not group:
            group.append(v)
            prod *= view[v]
            v += 1
        if prod != size:
            raise ValueError(f"view {view} does not split shape {shape}")
        groups.append(group)
    return groups


def source_slices(tensor: Tensor, view_index: tuple[slice, ...]
                  ) -> tuple[tuple[slice, ...], Callable[[np.ndarray], np.ndarray]]:
    """The stored-tensor slices that cover ``view_index`` (slices, with concrete bounds, of
    one layer's tensor reshaped to ``tensor.view``), and a function turning what was read
    into exactly that part (still in the view's axis order: no transpose on the host).

    Only the slab of stored rows the part occupies is read; a split of a dimension that
    is not the leading one of its group (never the case for the rules' shardings, which do
    not split ``head_dim``) reads the whole group and cuts after.
    """
    if tensor.experts:
        raise ValueError(f"{tensor.path}: read per expert (Tensor.expert)")
    stored, cut, slab_view = [], [], []
    for group in _groups(tensor.shape, tensor.view):
        lead, rest = group[0], group[1:]
        inner = math.prod(tensor.view[r] for r in rest)
        s = view_index[lead]
        stored.append(slice(s.start * inner, s.stop * inner))
        slab_view.append(s.stop - s.start)
        cut.append(slice(None))
        for r in rest:
            slab_view.append(tensor.view[r])
            cut.append(view_index[r])

    if tensor.rows:  # a part of a fused tensor: its rows start further down
        first = stored[0]
        stored[0] = slice(first.start + tensor.rows[0], first.stop + tensor.rows[0])

    def finish(slab: np.ndarray) -> np.ndarray:
        return slab.reshape(slab_view)[tuple(cut)]

    return tuple(stored), finish
