"""What LoRA saves: trainable parameters and optimizer memory against full fine-tuning,
computed on abstract shapes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.adapters.lora.layers import LoraConfig
from jaxpar.adapters.lora.wrapping import apply_config
from jaxpar.training.trainable import count_params, trainable_filter


def _bytes(tree: Any) -> int:
    return sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))



# --- reporting ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FinetuneReport:
    """Trainable parameters and memory of LoRA versus full fine-tuning (whole model, bytes
    summed over devices; divide by the shard count for per-device figures)."""

    total_params: int
    lora_trainable: int
    full_trainable: int
    lora_optimizer_bytes: int
    full_optimizer_bytes: int
    lora_frozen_bytes: int
    lora_adapter_bytes: int
    full_param_bytes: int

    @property
    def trainable_fraction(self) -> float:
        """LoRA trainable parameters as a fraction of full fine-tuning's."""
        return self.lora_trainable / max(self.full_trainable, 1)

    def __str__(self) -> str:
        mib = 1 / 2**20
        return "\n".join([
            f"parameters: {self.total_params:,}",
            f"trainable: LoRA {self.lora_trainable:,} ({100 * self.trainable_fraction:.2f}%)"
            f" vs full {self.full_trainable:,}",
            f"optimizer state: LoRA {self.lora_optimizer_bytes * mib:.1f} MiB vs full "
            f"{self.full_optimizer_bytes * mib:.1f} MiB",
            f"gradients: LoRA {self.lora_adapter_bytes * mib:.1f} MiB vs full "
            f"{self.full_param_bytes * mib:.1f} MiB",
            f"weights: LoRA frozen base {self.lora_frozen_bytes * mib:.1f} MiB + adapters "
            f"{self.lora_adapter_bytes * mib:.1f} MiB vs full {self.full_param_bytes * mib:.1f}"
            " MiB",
        ])


def finetune_report(
    base_factory: Callable[[], nnx.Module],
    config: LoraConfig,
    optimizer: optax.GradientTransformation | None = None,
    *,
    trainable: str | None = None,
) -> FinetuneReport:
    """Count trainable parameters and optimizer memory, LoRA versus full fine-tuning.

    Everything is computed from abstract shapes (``nnx.eval_shape``); nothing is allocated.
    ``optimizer`` defaults to ``optax.adamw`` (two float32 moments per trainable value).
    """
    optimizer = optimizer or optax.adamw(1e-4)
    cfg = dataclasses.replace(config, enabled=True)
    with nnx.use_eager_sharding(False):
        base = nnx.eval_shape(base_factory)
        lora_model = nnx.eval_shape(lambda: apply_config(base_factory(), cfg))
    full_params = nnx.state(base, nnx.Param)
    lora_params, frozen = nnx.state(lora_model, trainable_filter(trainable, lora=True), ...)
    return FinetuneReport(
        total_params=count_params(base, nnx.Param),
        lora_trainable=int(sum(math.prod(x.shape) for x in jax.tree.leaves(lora_params))),
        full_trainable=int(sum(math.prod(x.shape) for x in jax.tree.leaves(full_params))),
        lora_optimizer_bytes=_bytes(jax.eval_shape(optimizer.init, lora_params)),
        full_optimizer_bytes=_bytes(jax.eval_shape(optimizer.init, full_params)),
        lora_frozen_bytes=_bytes(frozen),
        lora_adapter_bytes=_bytes(lora_params),
        full_param_bytes=_bytes(full_params),
    )
