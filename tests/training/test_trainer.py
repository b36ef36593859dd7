"""Sharded training equals single-device training, and XLA does what each strategy implies."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis.hlo import collective_table, count_collectives
from jaxpar.errors import JaxparError
from jaxpar.models import Transformer
from jaxpar.training.optimizer import make_optimizer
from tests.helpers import (
    BATCH,
    SEQ,
    SMALL,
    block_forward_hlo,
    loader,
    make_trainer,
    one_device,
    small_config,
)
from tests.user_models import LLAMA_ANNOTATIONS, LlamaLike

STEPS = 3
STRATEGIES = {
    "dp": ({"data": 8}, "dp"),
    "fsdp": ({"data": 1, "fsdp": 8}, "fsdp"),
    "tp": ({"data": 2, "tensor": 4}, "tp"),
    "fsdp_tp": ({"data": 1, "fsdp": 4, "tensor": 2}, "fsdp_tp"),
    "dp_fsdp_tp": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
}


def losses(trainer: jaxpar.Trainer, steps: int = STEPS) -> list[float]:
    data = loader()
    return [trainer.step(data.batch(i))["loss"] for i in range(steps)]


@pytest.fixture(scope="module")
def reference_losses(devices):
    return losses(make_trainer({"data": 1}, devices=one_device()))


@pytest.mark.parametrize("knobs", [{}, {"zero_stage": 1}, {"zero_stage": 2, "microbatches": 2}])
def test_the_reference_transformer_trains_on_an_explicit_mesh(reference_losses, knobs):
    """jax.make_mesh's default, Explicit axis types: the built-in model's embedding gather
    and its row-parallel projections (whose output sharding JAX cannot infer from split
    operands) are told their layouts, and data 2 x fsdp 2 x tensor 2 trains as one
    device, with ZeRO-2 summing two microbatches into its gradient shards too."""
    mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, explicit=True)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp").replace(**knobs)
    assert plan.explicit
    model = jaxpar.init_sharded(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)), plan)
    trainer = jaxpar.Trainer(model, make_optimizer(small_config().train), plan)
    np.testing.assert_allclose(losses(trainer), reference_losses, rtol=1e-5)


def test_step_counter_and_optimizer_state_advance(devices):
    trainer = make_trainer({"fsdp": 8})
    before = jax.tree.map(np.asarray, trainer.state["params"])
    trainer.step(loader().batch(0))
    trainer.step(loader().batch(1))
    assert int(trainer.state["step"]) == 2
    counts = [int(x) for x in jax.tree.leaves(trainer.state["opt_state"])
              if getattr(x, "ndim", 1) == 0 and jnp.issubdtype(x.dtype, jnp.integer)]
    assert counts and all(c == 2 for c in counts)
    after = jax.tree.map(np.asarray, trainer.state["params"])
    changed = [not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)]
    assert all(changed)


def test_optimizer_state_sharded_like_params(devices):
    trainer = make_trainer({"fsdp": 4, "tensor": 2})
    params = trainer.state["params"]
    adam = trainer.state["opt_state"][1][0]  # chain(clip, adamw) -> adam's ScaleByAdamState
    for p, mu, nu in zip(jax.tree.leaves(params), jax.tree.leaves(adam.mu),
                         jax.tree.leaves(adam.nu), strict=True):
        assert mu.sharding.spec == p.sharding.spec == nu.sharding.spec


def _compiled_hlo(trainer: jaxpar.Trainer) -> str:
    return trainer.lower(loader().batch(0)).compile().as_text()


@pytest.mark.parametrize("name", STRATEGIES)
def test_compiled_collectives_match_strategy(capfd, reference_losses, name, fresh_compile):
    """Each strategy's steps equal one device's losses (and carry the step counter), and
    the same trainer's compiled step moves what the strategy implies."""
    axes, rules = STRATEGIES[name]
    trainer = make_trainer(axes, rules)
    capfd.readouterr()
    np.testing.assert_allclose(losses(trainer), reference_losses, rtol=1e-5)
    assert reference_losses[-1] < reference_losses[0]  # it really trains
    assert trainer.step_count == STEPS  # the functional step carried the counter
    hlo = _compiled_hlo(trainer)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    table = collective_table(hlo, trainer.plan.mesh)
    kinds = {(r["kind"], tuple(r["axes"])) for r in table}
    assert ("collective-permute", ()) not in kinds
    # The only all-to-alls: the embedding rows into and out of the batch-split layout,
    # where the table's columns are split over fsdp (jaxpar.parallel.embedding).
    moved = [r for r in table if r["kind"] == "all-to-all"]
    if "fsdp" in axes and rules != "tp":
        tokens = BATCH * SEQ // trainer.plan.data_parallel_size
        assert [(tuple(r["axes"]), r["count"], r["bytes_per_device"]) for r in moved] == [
            (("fsdp",), 2, 2 * tokens * SMALL.d_model * 4)]
    else:
        assert not moved
    if name == "dp":
        # Gradients (and the loss) are all-reduced over data; nothing else moves.
        assert kinds == {("all-reduce", ("data",))}
    elif name == "fsdp":
        # Weights are all-gathered over fsdp just in time; gradients are reduced over fsdp
        # (a reduce-scatter, or on CPU an all-reduce whose result each device slices).
        assert ("all-gather", ("fsdp",)) in kinds
        assert kinds <= {("all-gather", ("fsdp",)), ("all-reduce", ("fsdp",)),
                         ("reduce-scatter", ("fsdp",)), ("all-to-all", ("fsdp",))}
        gathered = sum(r["bytes_per_device"] for r in table if r["kind"] == "all-gather")
        weight_bytes = sum(x.size * 4 for x in jax.tree.leaves(trainer.state["params"]))
        table_bytes = trainer.state["params"]["embed"].size * 4
        # every sharded weight is gathered, but the embedding table (looked up in place)
        assert gathered >= (weight_bytes - table_bytes) * 0.9
        assert gathered < weight_bytes - table_bytes + table_bytes / 8
    elif name == "tp":
        # Megatron: activations all-reduced over tensor; gradients over data; no weight
        # is ever all-gathered.
        assert ("all-reduce", ("tensor",)) in kinds and ("all-reduce", ("data",)) in kinds
        assert not any(kind == "all-gather" for kind, _ in kinds)
    else:
        assert {("all-gather", ("fsdp",)), ("all-reduce", ("tensor",))} <= kinds
        assert not any(kind == "all-gather" and "tensor" in ax for kind, ax in kinds)


def test_megatron_block_has_one_all_reduce_per_sublayer(capfd, fresh_compile):
    """Forward of one decoder block under TP: exactly 2 all-reduces (attention, MLP)."""
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"data": 2, "tensor": 4}), "tp")
    capfd.readouterr()
    hlo = block_forward_hlo(plan)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    assert count_collectives(hlo) == {"all-reduce": 2}
    assert collective_table(hlo, plan.mesh)[0]["axes"] == ["tensor"]



def test_stages_on_a_model_without_a_pipeline_layout_are_refused(devices):
    """A stage axis on a model that cannot be pipelined would have the stages repeat each
    other's work; the Trainer says so in one line instead of running unpipelined."""
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh({"stage": 2, "fsdp": 4}), "fsdp_tp",
                                   annotations=LLAMA_ANNOTATIONS)
    model = jaxpar.init_sharded(lambda: LlamaLike(rngs=nnx.Rngs(0)), plan)
    with pytest.raises(JaxparError, match="stage=2 but LlamaLike has no pipeline layout") as e:
        jaxpar.Trainer(model, optax.adam(1e-3), plan)
    assert "\n" not in str(e.value)
