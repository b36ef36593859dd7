"""Which parameters train: ``train.trainable`` strings as nnx filters, "LoRA is on" read
from the model itself (plain Flax ``nnx.LoRA`` and ``nnx.LoRAParam`` count), the check that
a filter selects something, and parameter counts against hand-computed sizes."""

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.sharding.paths import path_str
from jaxpar.training.trainable import (
    count_params,
    path_filter,
    select_trainable,
    trainable_filter,
)


class Plain(nnx.Module):
    """No adapters: a linear layer, a norm and a non-parameter variable."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.proj = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.proj_count = nnx.BatchStat(jnp.zeros((5,)))  # matches "proj", not a Param


class FlaxLora(nnx.Module):
    """Adapters from Flax itself, not jaxpar: an ``nnx.LoRA`` around a linear layer."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        base = nnx.Linear(3, 4, rngs=rngs)
        self.proj = nnx.LoRA(3, 2, 4, base_module=base, rngs=rngs)
        self.head = nnx.Linear(4, 5, use_bias=False, rngs=rngs)


class BareLoraParam(nnx.Module):
    """A single hand-made ``nnx.LoRAParam`` beside ordinary parameters."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones((2, 2)))
        self.delta = nnx.LoRAParam(jnp.zeros((2, 1)))


def _selected(model: nnx.Module, filt) -> set[str]:
    return {path_str(p) for p, _ in nnx.to_flat_state(nnx.state(model, filt))}


def test_path_filter_selects_params_by_regex():
    model = Plain()
    assert _selected(model, path_filter("proj")) == {"proj/kernel", "proj/bias"}
    assert _selected(model, path_filter(r"^proj/bias$|scale")) == {"proj/bias", "norm/scale"}
    assert _selected(model, path_filter("nothing")) == set()
    lora = FlaxLora()
    assert _selected(lora, path_filter("lora_")) == {"proj/lora_a", "proj/lora_b"}


def test_path_filter_names_a_bad_regex():
    with pytest.raises(JaxparError, match=r"train.trainable target='a\(b': is not a valid "
                                          r"regular expression \(missing \)"):
        path_filter("a(b")


@pytest.mark.parametrize("spec, lora, want", [
    (None, True, nnx.LoRAParam), ("", True, nnx.LoRAParam), ("auto", True, nnx.LoRAParam),
    (None, False, nnx.Param), ("  auto ", False, nnx.Param), ("lora", False, nnx.LoRAParam),
    ("all", True, nnx.Param), (" all\n", False, nnx.Param),
])
def test_trainable_filter_keywords(spec, lora, want):
    assert trainable_filter(spec, lora=lora) is want


def test_trainable_filter_regex_is_a_path_filter():
    filt = trainable_filter("norm", lora=True)
    assert _selected(Plain(), filt) == {"norm/scale", "norm/bias"}


def test_flax_lora_turns_lora_on():
    model = FlaxLora()
    assert select_trainable(model) is nnx.LoRAParam
    assert _selected(model, select_trainable(model)) == {"proj/lora_a", "proj/lora_b"}
    # "all" keeps every parameter, the adapters included (LoRAParam is a Param).
    assert _selected(model, select_trainable(model, "all")) == {
        "proj/lora_a", "proj/lora_b", "proj/base_module/kernel", "proj/base_module/bias",
        "head/kernel"}
    assert _selected(model, select_trainable(model, "head")) == {"head/kernel"}


def test_a_single_lora_param_turns_lora_on():
    model = BareLoraParam()
    assert select_trainable(model) is nnx.LoRAParam
    assert _selected(model, select_trainable(model)) == {"delta"}
    assert select_trainable(Plain()) is nnx.Param


def test_a_standalone_flax_lora_counts_too():
    """``nnx.LoRA`` without a base module: only adapters, so "all" and "lora" agree."""
    model = nnx.LoRA(3, 2, 4, rngs=nnx.Rngs(0))
    assert select_trainable(model) is nnx.LoRAParam
    assert _selected(model, select_trainable(model, "all")) == {"lora_a", "lora_b"}


def test_select_trainable_refuses_an_empty_selection_listing_the_paths():
    with pytest.raises(JaxparError) as err:
        select_trainable(Plain(), "lora")
    msg = str(err.value)
    assert msg.startswith("train.trainable='lora' selects no parameter; parameters: ")
    for path in ("proj/kernel", "proj/bias", "norm/scale", "norm/bias"):
        assert f"'{path}'" in msg, msg
    assert "proj_count" not in msg  # not a parameter
    with pytest.raises(JaxparError, match=r"train.trainable='zzz' selects no parameter; "
                                          r"parameters: \[") as err:
        select_trainable(BareLoraParam(), "zzz")
    assert "'delta'" in str(err.value) and "'w'" in str(err.value)


def test_count_params_by_hand():
    assert count_params(Plain()) == 3 * 4 + 4 + 4 + 4  # kernel, bias, norm scale and bias
    assert count_params(FlaxLora(), nnx.LoRAParam) == 3 * 2 + 2 * 4
    assert count_params(FlaxLora()) == 3 * 2 + 2 * 4 + 3 * 4 + 4 + 4 * 5
    assert count_params(Plain(), nnx.BatchStat) == 5
    abstract = nnx.eval_shape(lambda: FlaxLora())  # shapes only, nothing allocated
    assert count_params(abstract) == count_params(FlaxLora())
    assert count_params(Plain(), path_filter("nothing")) == 0
