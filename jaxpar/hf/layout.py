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


def tensors(cfg: TransformerConfig) -> list[Tensor]:
    """Every parameter of a decoder with config ``cfg``, in Hugging Face's order."""
    d, h, n, k, f = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff
    out = [Tensor("embed", "model.embed_tokens.weight", (cfg.vocab_size, d),
                  (cfg.vocab_size, d), (0, 1), False)]

    def norm(path: str, name: str, size: int = d) -> Tensor:
        return Tensor(path, LAYER + name, (size,), (size,), (0,), True)

    out.append(norm("blocks/attn_norm/scale", "input_layernorm.weight"))
    for proj, heads in (("q", n), ("k", k), ("v", k)):
        out.append(Tensor(f"blocks/attn/w{proj}/kernel", LAYER + f"self_attn.{proj}_proj.weight",
                          (heads * h, d), (heads, h, d), (2, 0, 1), True))
        if cfg.qkv_bias:
            out.append(Tensor(f"blocks/attn/w{proj}/bias", LAYER + f"self_attn.{proj}_proj.bias",
                              (heads * h,), (heads, h), (0, 1), True))
    out.append(Tensor("blocks/attn/wo/kernel", LAYER + "self_attn.o_proj.weight",
                      (d, n * h), (d, n, h), (1, 2, 0), True))
    if cfg.qk_norm:
        out.append(norm("blocks/attn/q_norm/scale", "self_attn.q_norm.weight", h))
        out.append(norm("blocks/attn/k_norm/scale", "self_attn.k_norm.weight", h))
    out.append(norm("blocks/mlp_norm/scale", "post_attention_layernorm.weight"))
    out.append(_linear("blocks/mlp/w_gate/kernel", "mlp.gate_proj.weight", d, f))
    out.append(_linear("blocks/mlp/w_up/kernel", "mlp.up_proj.weight", d, f))
    out.append(_linear("blocks/mlp/w_down/kernel", "mlp.down_proj.weight", f, d))
    out.append(Tensor("final_norm/scale", "model.norm.weight", (d,), (d,), (0,), False))
    if not cfg.tie_embeddings:
        out.append(Tensor("lm_head/kernel", "lm_head.weight", (cfg.vocab_size, d),
                          (cfg.vocab_size, d), (1, 0), False))
    return out


def layer_name(tensor: Tensor, layer: int) -> str:
    """The Hugging Face name of ``tensor`` in decoder layer ``layer``."""
    return tensor.name.format(i=layer)


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

    def finish(slab: np.ndarray) -> np.ndarray:
        return slab.reshape(slab_view)[tuple(cut)]

    return tuple(stored), finish
