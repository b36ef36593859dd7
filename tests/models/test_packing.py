"""Packed documents on the reference model: a row holding several documents computes, for
each, what the document computes alone (attention and RoPE positions start over at every
document), and the loss leaves out the target that crosses from one document to the next."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.data.loader import packed
from jaxpar.models import Transformer
from jaxpar.parallel.attention import document_positions
from jaxpar.training.objective import lm_loss
from tests.helpers import SMALL

EOS = 0
LENGTHS = (6, 11, 4)  # three documents in one row of 21 tokens (each ends with EOS)


def _row(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, SMALL.vocab_size, n - 1), EOS) for n in LENGTHS]
    return np.concatenate(docs).astype(np.int32)


def _model(attention: str, loss_chunk: int = 0) -> Transformer:
    cfg = dataclasses.replace(SMALL, attention=attention, loss_chunk=loss_chunk)
    return Transformer(cfg, rngs=nnx.Rngs(0))


def test_segment_ids_count_the_ends_before_each_token():
    batch = packed(np.array([[5, 0, 7, 8, 0, 3]]), eos_id=0)
    np.testing.assert_array_equal(batch["segment_ids"], [[0, 0, 1, 1, 1, 2]])
    np.testing.assert_array_equal(document_positions(jnp.asarray(batch["segment_ids"])),
                                  [[0, 1, 0, 1, 2, 0]])


@pytest.mark.parametrize("attention", ["xla", "chunked"])
def test_a_packed_row_computes_each_document_as_if_alone(attention):
    model = _model(attention)
    row = _row()
    seg = packed(row[None], EOS)["segment_ids"]
    logits = model(jnp.asarray(row[None]), segment_ids=jnp.asarray(seg))
    start = 0
    for n in LENGTHS:
        alone = model(jnp.asarray(row[None, start:start + n]))
        np.testing.assert_allclose(logits[:, start:start + n], alone, atol=2e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("loss_chunk", [0, 8])
def test_the_loss_skips_the_targets_that_cross_a_document_end(loss_chunk):
    """Rows of 21 + 1 tokens: the mean over every target inside a document, computed from
    the documents alone, equals the packed loss (full logits or chunked)."""
    model = _model("xla", loss_chunk)
    rows = np.stack([np.append(_row(s), 7) for s in range(2)])  # + a 4th document's start
    batch = {k: jnp.asarray(v) for k, v in packed(rows, EOS).items()}
    got = lm_loss(model, batch)
    total, count = 0.0, 0
    for row in rows:
        start = 0
        for n in LENGTHS:
            doc = jnp.asarray(row[None, start:start + n])
            logp = jax.nn.log_softmax(model(doc[:, :-1]).astype(jnp.float32))
            total += -float(jnp.take_along_axis(logp, doc[:, 1:, None], -1).sum())
            count += n - 1
            start += n
    np.testing.assert_allclose(float(got), total / count, rtol=1e-5)


def _packed_batch() -> dict:
    return packed(np.stack([np.append(_row(s), 7) for s in range(8)]), EOS)


@functools.cache
def _one_device_packed_losses() -> tuple[float, ...]:
    """Three steps on the packed batch on one device (shared by both sharded runs)."""
    one = jaxpar.Trainer(_model("chunked", 8), optax.adam(1e-2), jaxpar.Plan.from_preset(
        jaxpar.make_mesh({"data": 1}, devices=jax.devices()[:1]), "dp"))
    return tuple(float(one.step(_packed_batch())["loss"]) for _ in range(3))


@pytest.mark.parametrize("axes,knobs", [({"fsdp": 4, "tensor": 2}, {}),
                                        ({"fsdp": 2, "context": 4},
                                         {"context_attention": "ring",
                                          "context_balance": False})])
def test_a_sharded_run_trains_on_packed_batches(devices, axes, knobs):
    """On fsdp x tensor, and with the sequence split over context=4 (documents crossing
    the split), three steps on packed batches equal one device's."""
    plan = jaxpar.Plan.from_preset(jaxpar.make_mesh(axes), "fsdp_tp", **knobs)
    trainer = jaxpar.Trainer(jaxpar.init_sharded(lambda: _model("chunked", 8), plan),
                             optax.adam(1e-2), plan)
    losses = [float(trainer.step(_packed_batch())["loss"]) for _ in range(3)]
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, _one_device_packed_losses(), rtol=2e-5)


def test_a_model_without_segment_ids_is_refused_in_one_line():
    class Plain(nnx.Module):
        def __init__(self):
            self.embed = nnx.Embed(16, 8, rngs=nnx.Rngs(0))

        def __call__(self, tokens):
            return self.embed.attend(self.embed(tokens))

    batch = packed(np.array([[1, 0, 2, 3]]), 0)
    with pytest.raises(jaxpar.JaxparError, match="Plain.__call__ takes no segment_ids"):
        lm_loss(Plain(), batch)
