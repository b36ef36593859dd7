"""The embedding table looked up where it lies, and the vocabulary split over fsdp
(``plan.vocab_over_fsdp``): sharded steps equal one device's, and the compiled programs
move token activations, never the whole table (nor, with the vocabulary split, the whole
output head)."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

import jaxpar
from jaxpar.analysis.hlo import parse_collectives
from jaxpar.models import Transformer
from jaxpar.parallel import embedding
from jaxpar.sharding.rules import VOCAB_OVER_FSDP, preset, split_vocab_over_fsdp
from jaxpar.training.optimizer import make_optimizer
from tests.helpers import SMALL, loader, one_device, small_config
from tests.training.test_trainer import losses

V, D = SMALL.vocab_size, SMALL.d_model  # 256 x 64: no other weight has a 256-long side
TABLE = re.compile(rf"\[{V},{D}\]")
HEAD = re.compile(rf"\[{D},{V}\]")


def _trainer(axes: dict, vocab_over_fsdp: bool, devices=None) -> jaxpar.Trainer:
    mesh = jaxpar.make_mesh(axes, devices=devices)
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", vocab_over_fsdp=vocab_over_fsdp)
    model = jaxpar.init_sharded(lambda: Transformer(SMALL, rngs=nnx.Rngs(0)), plan)
    return jaxpar.Trainer(model, make_optimizer(small_config().train), plan)


def _moved_whole(trainer: jaxpar.Trainer) -> int:
    """Collectives whose result holds a whole vocabulary-sized weight (the table, the
    head or either's gradient, which XLA may lay out transposed)."""
    hlo = trainer.lower(loader().batch(0)).compile().as_text()
    results = [c.line.split(" = ", 1)[1].split(")")[0] for c in parse_collectives(hlo)]
    return sum(len(TABLE.findall(r)) + len(HEAD.findall(r)) for r in results)


@pytest.fixture(scope="module")
def reference(devices):
    return losses(_trainer({"data": 1}, False, devices=one_device()), steps=3)


@pytest.mark.parametrize("axes,vocab_over_fsdp", [
    ({"fsdp": 8}, False),
    ({"fsdp": 8}, True),
    ({"data": 2, "fsdp": 2, "tensor": 2}, True),
])
def test_steps_equal_one_device_and_the_table_stays(reference, axes, vocab_over_fsdp):
    trainer = _trainer(axes, vocab_over_fsdp)
    np.testing.assert_allclose(losses(trainer, steps=3), reference, rtol=1e-5)
    # The table looked up in place: ids and rows move instead of it and its gradient. The
    # head is gathered for the logits and its gradient reduced, unless the vocabulary is
    # split over fsdp: then the final hidden states move instead.
    assert _moved_whole(trainer) == (0 if vocab_over_fsdp else 2)


def test_split_vocab_rules_put_fsdp_on_the_vocabulary(devices):
    mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    params, acts = split_vocab_over_fsdp(*preset("fsdp_tp"))
    assert params.rules[0] == acts.rules[0] == (VOCAB_OVER_FSDP[0], VOCAB_OVER_FSDP[1])
    assert params.spec(("embed", "vocab"), mesh) == jax.sharding.PartitionSpec(
        None, ("tensor", "fsdp"))
    # the logits: the vocabulary takes fsdp, the batch falls back to data
    assert acts.spec(("batch", "seq", "vocab"), mesh) == jax.sharding.PartitionSpec(
        "data", None, ("tensor", "fsdp"))
    assert acts.spec(("batch", "seq", "embed"), mesh) == jax.sharding.PartitionSpec(
        ("data", "fsdp"), None, None)
    # and back: the preset again
    assert split_vocab_over_fsdp(params, acts, on=False) == preset("fsdp_tp")


@pytest.mark.parametrize("axes", [{"data": 2, "fsdp": 4}, {"data": 2, "fsdp": 2, "context": 2}])
def test_lookup_gradient_equals_take(devices, axes):
    """The in-place lookup's rows and table gradient are jnp.take's; with the sequence
    split too (context parallelism) the rows reach the batch split by jaxpar's own
    all-to-all over ``fsdp`` (GSPMD's reshard gathered whole microbatches on the TPU
    compiler at 70B scale: embedding._all_to_all)."""
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), "fsdp_tp")
    rng = np.random.default_rng(0)
    table = rng.normal(size=(V, D)).astype(np.float32)
    tokens = rng.integers(0, V, (8, 16)).astype(np.int32)
    weights = rng.normal(size=(8, 16, D)).astype(np.float32)

    def loss(t, ids):
        with plan.activate():
            rows = embedding.lookup(t, ids, plan, ("batch", "seq", "embed"))
        return (rows * weights).sum(), rows

    table_sh = plan.sharding(plan.param_spec(embedding.TABLE))
    args = (jax.device_put(table, table_sh), jax.device_put(tokens, plan.batch_sharding(2)))
    step = jax.value_and_grad(loss, has_aux=True)
    assert ("all_to_all" in str(jax.make_jaxpr(step)(*args))) == ("context" in axes)
    got = jax.jit(step)(*args)
    (_, rows), grad = got
    np.testing.assert_array_equal(np.asarray(rows), table[tokens])
    want = np.zeros_like(table)
    np.add.at(want, tokens, weights)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-5)


def test_chunked_loss_keeps_the_logits_rows_split_with_the_vocabulary(reference):
    """With the vocabulary over fsdp the logits' batch falls back to ``data`` and
    ``expert``, the final hidden states' is over ``fsdp`` too: the chunked loss gathers
    the hidden states to the logits' rows, so the head's gradient is summed over each
    device's own rows. Before, GSPMD all-gathered each chunk's logit gradient over the
    batch axes for it (every row of the batch on each device; on Qwen3-30B-A3B at data 4
    x fsdp 2 x expert 8, an 18.6 GiB buffer). Losses still equal one device's."""
    chunked = dataclasses.replace(SMALL, loss_chunk=8)
    mesh = jaxpar.make_mesh({"data": 2, "fsdp": 2, "expert": 2})
    plan = jaxpar.Plan.from_preset(mesh, "fsdp_tp", vocab_over_fsdp=True)
    model = jaxpar.init_sharded(lambda: Transformer(chunked, rngs=nnx.Rngs(0)), plan)
    trainer = jaxpar.Trainer(model, make_optimizer(small_config().train), plan)
    hlo = trainer.lower(loader().batch(0)).compile().as_text()
    # One device's chunk: 16 rows over data x expert (4), 8 positions, half the vocabulary.
    assert f"[4,8,{V // 2}]" in hlo
    assert not re.search(rf"\[(8|16),8,{V // 2}\]", hlo)  # the rows of several devices
    np.testing.assert_allclose(losses(trainer, steps=3), reference, rtol=1e-5)
