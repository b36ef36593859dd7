"""What the planner reads of a model: the reference transformer's tensors worked out from
its config (parameter counts by hand, tied embeddings, the pipeline layout, experts), the
same read from an NNX factory by abstract evaluation, and a factory that fails."""

import dataclasses

import pytest
from flax import nnx

import jaxpar
from jaxpar.models import TransformerConfig
from jaxpar.planner import plan
from jaxpar.planner.model import Tensor, from_nnx, from_transformer
from tests.planner.cases import TINY, TINY_MATMUL_PARAMS, TINY_PARAMS


def test_nnx_model_read_by_abstract_evaluation():
    from flax import nnx

    from jaxpar.models import Transformer, TransformerConfig

    cfg = TransformerConfig()
    spec = from_nnx(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    assert spec.n_params == cfg.param_count() == from_transformer(cfg).n_params
    names = {t.path: t.names for t in spec.tensors}
    assert names["blocks/attn/wq/kernel"] == ("layers", "embed", "heads", "head_dim")
    assert plan(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), chips="cpu:8", global_batch=16,
                seq=64)


def test_moe_spec_matches_the_model():
    from flax import nnx

    from jaxpar.models import Transformer, TransformerConfig

    cfg = TransformerConfig(n_experts=4, experts_per_token=2, expert_d_ff=64,
                            n_shared_experts=1)
    spec = from_nnx(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    analytic = from_transformer(cfg)
    key = lambda s: sorted((t.path, t.shape, t.names) for t in s.tensors)
    assert key(spec) == key(analytic) and spec.n_params == cfg.param_count()
    assert spec.is_moe and spec.n_active_dense == analytic.n_active_dense


def test_transformer_tensors_counted_by_hand():
    spec = from_transformer(TINY)
    assert spec.n_params == TINY_PARAMS
    assert spec.n_dense == TINY_MATMUL_PARAMS  # no lookup table, no norm scales
    assert spec.is_transformer and not spec.is_moe and spec.n_active_dense == spec.n_dense
    shapes = {t.path: (t.shape, t.names) for t in spec.tensors}
    assert shapes["embed"] == ((256, 64), ("vocab", "embed"))
    assert shapes["blocks/attn/wk/kernel"] == ((2, 64, 2, 16),
                                               ("layers", "embed", "kv_heads", "head_dim"))
    assert shapes["blocks/mlp/w_down/kernel"] == ((2, 256, 64), ("layers", "mlp", "embed"))
    assert shapes["lm_head/kernel"] == ((64, 256), ("embed", "vocab"))
    assert (spec.d_model, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.d_ff,
            spec.vocab_size, spec.n_layers) == (64, 4, 2, 16, 256, 256, 2)


def test_tied_embeddings_have_no_head_and_count_the_table_as_a_matmul():
    spec = from_transformer(TransformerConfig(**{**vars(TINY), "tie_embeddings": True}))
    assert "lm_head/kernel" not in {t.path for t in spec.tensors}
    assert spec.n_params == TINY_PARAMS - 64 * 256
    assert spec.n_dense == TINY_MATMUL_PARAMS  # the table is the head's matmul now


def test_pipeline_layout_stacks_layers_by_repeat_and_stage():
    cfg = TransformerConfig(**{**vars(TINY), "n_layers": 4})
    spec = from_transformer(cfg, stages=2)
    wq = next(t for t in spec.tensors if t.path == "blocks/attn/wq/kernel")
    assert wq.shape == (2, 2, 64, 4, 16) and wq.names[:2] == ("repeat", "stage")
    assert wq.per_layer and wq.size == 4 * 64 * 4 * 16
    assert spec.n_params == from_transformer(cfg).n_params
    with pytest.raises(jaxpar.JaxparError, match="model.n_layers=4 is not divisible by 3"):
        from_transformer(cfg, stages=3)


def test_per_layer_means_stacked_over_layers():
    assert Tensor("blocks/x", (2, 8), ("layers", "embed")).per_layer
    assert not Tensor("embed", (8, 4), ("vocab", "embed")).per_layer
    assert not Tensor("bias", (8,), ()).per_layer
    assert Tensor("w", (3, 4, 5), (None, None, None)).size == 60


def test_experts_active_per_token():
    cfg = TransformerConfig(**{**vars(TINY), "n_experts": 4, "experts_per_token": 2,
                               "expert_d_ff": 64})
    spec = from_transformer(cfg)
    one_expert = 3 * 64 * 64  # gate, up, down
    assert spec.is_moe and spec.n_expert_params == 2 * 4 * one_expert
    # A token goes to 2 of 4 experts: the other two of every layer's are idle.
    assert spec.n_active_dense == spec.n_dense - 2 * 2 * one_expert
    assert (spec.n_experts, spec.experts_per_token, spec.expert_d_ff) == (4, 2, 64)
    assert spec.capacity_factor == cfg.expert_capacity


class _TwoLayers(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.b = nnx.Linear(8, 2, use_bias=False, kernel_init=init, rngs=rngs)


def test_any_nnx_model_is_read_with_its_logical_names():
    spec = from_nnx(lambda: _TwoLayers(nnx.Rngs(0)), name="two")
    tensors = {t.path: (t.shape, t.names) for t in spec.tensors}
    assert tensors == {"a/kernel": ((4, 8), (None, None)), "a/bias": ((8,), (None,)),
                       "b/kernel": ((8, 2), ("embed", "mlp"))}
    assert spec.n_params == 4 * 8 + 8 + 8 * 2 and spec.name == "two"
    assert not spec.is_transformer  # no activation sizes without a TransformerConfig


def test_a_failing_factory_is_reported():
    def factory():
        raise ValueError("no such layer")

    with pytest.raises(jaxpar.JaxparError, match="could not evaluate.*no such layer"):
        from_nnx(factory)


@pytest.mark.parametrize("knobs", [{"qkv_bias": True}, {"qk_norm": True},
                                   {"qkv_bias": True, "qk_norm": True, "n_kv_heads": 2}])
def test_attention_biases_and_query_key_norms_are_counted(knobs):
    # Qwen2's q/k/v biases and Qwen3's per-head q/k norms are parameters too: the spec
    # read from the config holds the tensors the built model holds, shape for shape.
    cfg = dataclasses.replace(TINY, **knobs)
    spec = from_transformer(cfg)
    built = from_nnx(lambda: jaxpar.models.Transformer(cfg, rngs=nnx.Rngs(0)))
    assert {t.path: t.shape for t in spec.tensors} == {t.path: t.shape for t in built.tensors}
    assert spec.n_params == built.n_params == cfg.param_count()
