"""The default objective, next-token cross-entropy, and what it assumes of a model.

:func:`lm_loss` is the loss a :class:`~jaxpar.training.trainer.Trainer` uses unless given another.
It assumes three things a model from elsewhere may not satisfy, and this module holds the
checks the Trainer runs for them, each failing with one line that says what to do:

* the batch is token ids shaped ``(batch, seq + 1)`` (:func:`check_tokens`), inside the
  model's vocabulary (:func:`first_id_outside`, a reduction on the devices);
* ``model(tokens)`` returns next-token logits shaped ``(batch, seq, vocab)``
  (:func:`next_token_logits`);
* position ``t``'s logits depend on input token ``t`` and on no later one
  (:func:`check_causal`, on the logits of one forward pass with a token changed).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import JaxparError
from jaxpar.parallel import loss as loss_lib

CUSTOM_LOSS = ("pass your own loss: Trainer(..., loss_fn=fn) or train.loss: "
               "package.module:function in a run config, with fn(model, batch) -> scalar")
"""The advice every refusal of the default loss ends with."""

CAUSAL_TOLERANCE = 1e-4
"""Largest change, relative to the logits' scale, that the causality check
(:func:`check_causal`) reads as rounding rather than dependence."""


PACKED_KEYS = ("tokens", "segment_ids")
"""The keys of a packed batch: token ids and their documents' ids, both ``(batch, seq + 1)``
(see :mod:`jaxpar.data.mixture`, ``data.eos_id``)."""


def token_ids(batch: Any) -> Any:
    """The token ids of a batch: the batch itself, or a packed batch's ``tokens``."""
    return batch["tokens"] if is_packed(batch) else batch


def is_packed(batch: Any) -> bool:
    """Whether ``batch`` is a packed batch (a mapping with :data:`PACKED_KEYS`)."""
    return isinstance(batch, dict) and set(PACKED_KEYS) <= set(batch)


def packed_lm_loss(model: nnx.Module, tokens: jax.Array, segment_ids: jax.Array,
                   rngs: nnx.Rngs | None = None, loss_mask: jax.Array | None = None
                   ) -> jax.Array:
    """:func:`lm_loss` on packed rows: the model keeps the documents apart (attention
    and positions), and a target in another document than its input does not count.
    With ``loss_mask`` ``(batch, seq + 1)`` (a chat batch, :mod:`jaxpar.data.conversations`),
    only the targets it marks count besides (the assistant's tokens).

    The model takes the documents as ``next_token_loss(tokens, segment_ids=...)`` (and
    ``loss_mask=...``), or as ``model(inputs, segment_ids=...)`` (``(batch, seq)`` ids,
    one per document)."""
    own = getattr(model, "next_token_loss", None)
    if callable(own) and _takes(own, "segment_ids") and (
            loss_mask is None or _takes(own, "loss_mask")):
        extra = {} if loss_mask is None else {"loss_mask": loss_mask}
        loss = own(tokens, segment_ids=segment_ids, **extra)
        if loss is not None:
            return loss
    if not _takes(model.__call__, "segment_ids"):
        raise JaxparError(f"packed documents (data.eos_id) need a model that keeps them "
                          f"apart, but {type(model).__name__}.__call__ takes no segment_ids: "
                          "add a segment_ids=None argument (attention only within a "
                          "document), or let attention cross documents: data.eos_id=-1 "
                          "(token shards) or data.cross_document=true (documents "
                          "tokenized as read)")
    kwargs = {"rngs": rngs} if rngs is not None and takes_rngs(model.__call__) else {}
    logits = model(tokens[:, :-1], segment_ids=segment_ids[:, :-1], **kwargs)
    mask = segment_ids[:, 1:] == segment_ids[:, :-1]
    if loss_mask is not None:
        mask = mask & (loss_mask[:, 1:] > 0)
    return loss_lib.cross_entropy(logits, tokens[:, 1:], mask)


def _takes(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def lm_loss(model: nnx.Module, tokens: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
    """Mean next-token cross-entropy of ``model`` on ``tokens`` ``(batch, seq + 1)``.

    The model is called as ``model(tokens[:, :-1])`` (with ``rngs=rngs`` when its
    ``__call__`` takes ``rngs``) and must return logits ``(batch, seq, vocab)``, one row
    per input position, position ``i`` seeing tokens ``0..i`` only: the Trainer checks
    this once before the first step (:meth:`~jaxpar.training.trainer.Trainer.check_default_loss`).
    A model may instead compute the loss its own, memory-efficient way: when it has a
    ``next_token_loss(tokens)`` method that returns a scalar (rather than None), that is
    the loss (the reference :class:`~jaxpar.models.Transformer` does so with
    ``model.loss_chunk > 0``, never materialising the full logits; see :mod:`jaxpar.parallel.loss`).
    A packed batch (``{"tokens", "segment_ids"}``, and ``"loss_mask"`` for chat data)
    goes to :func:`packed_lm_loss`.

    Raises:
      JaxparError: when the batch is not a 2-D array of token ids, the model cannot be
        called with the tokens alone, or its output is not shaped like next-token logits:
        each message says what to pass instead.
    """
    if is_packed(tokens):
        check_tokens(tokens["tokens"])
        return packed_lm_loss(model, tokens["tokens"], tokens["segment_ids"], rngs,
                              tokens.get("loss_mask"))
    check_tokens(tokens)
    own = getattr(model, "next_token_loss", None)
    if callable(own) and (loss := own(tokens)) is not None:
        return loss  # a scalar, or (scalar, metrics) for a mixture-of-experts model
    logits = next_token_logits(model, tokens[:, :-1], rngs)
    return loss_lib.cross_entropy(logits, tokens[:, 1:])


def check_tokens(tokens: Any) -> None:
    """Refuse a batch that is not a 2-D array of integer token ids."""
    if (not hasattr(tokens, "ndim") or tokens.ndim != 2
            or not jnp.issubdtype(tokens.dtype, jnp.integer)):
        what = (f"{tokens.dtype}{list(tokens.shape)}" if hasattr(tokens, "shape")
                else type(tokens).__name__)
        raise JaxparError(f"the default loss (next-token cross-entropy) takes token ids shaped "
                          f"(batch, seq + 1), got a batch of {what}; {CUSTOM_LOSS}")


def takes_rngs(fn: Callable) -> bool:
    """Whether ``fn`` has an ``rngs`` parameter (call-time random streams)."""
    try:
        return "rngs" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def next_token_logits(model: nnx.Module, inputs: jax.Array,
                      rngs: nnx.Rngs | None = None) -> jax.Array:
    """``model(inputs)`` as the default loss calls it, its logits checked for shape; a
    model that cannot be called so gets a :class:`JaxparError` saying what to do."""
    name = type(model).__name__
    try:
        inspect.signature(model.__call__).bind(inputs)
    except TypeError as err:
        raise JaxparError(f"the default loss calls model(tokens), but {name}.__call__ cannot "
                          f"be called that way ({err}); {CUSTOM_LOSS}") from None
    except ValueError:  # no signature to read: just call it
        pass
    kwargs = {"rngs": rngs} if rngs is not None and takes_rngs(model.__call__) else {}
    try:
        logits = model(inputs, **kwargs)
    except TypeError as err:  # a wrapped (e.g. linen) model wanting other arguments
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise JaxparError(f"the default loss called {name}(tokens of shape "
                          f"{tuple(inputs.shape)}) and it failed: {first}; a model that needs "
                          f"other inputs needs its own loss: {CUSTOM_LOSS}") from None
    shape = getattr(logits, "shape", None)
    if shape is None or len(shape) != 3 or tuple(shape[:2]) != tuple(inputs.shape):
        got = tuple(shape) if shape is not None else type(logits).__name__
        raise JaxparError(
            f"the default loss expects {name}(tokens of shape {tuple(inputs.shape)}) to return "
            f"next-token logits shaped (batch, seq, vocab) = {tuple(inputs.shape)} + (vocab,), "
            f"got {got}; a model that shifts its inputs itself or returns something else "
            f"needs its own loss: {CUSTOM_LOSS}")
    return logits


def check_causal(name: str, diff: np.ndarray, scale: float, t: int) -> None:
    """Read the causality probe: ``diff[i]``, the largest change of position ``i``'s logits
    when input token ``t`` changed, against the logits' ``scale``.

    Raises:
      JaxparError: when an earlier position changed (the model sees later tokens) or
        position ``t`` did not (the model shifts its inputs itself).
    """
    tol = CAUSAL_TOLERANCE * max(scale, 1e-30)
    if diff[:t].max() > tol:
        raise JaxparError(
            f"the default loss needs a causal model, but {name}'s logits at positions "
            f"before {t} change when input token {t} changes: it sees later tokens (a "
            f"bidirectional or unmasked model), so next-token training would teach it to "
            f"copy; {CUSTOM_LOSS}")
    if diff[t] <= tol:
        raise JaxparError(
            f"the default loss feeds {name} tokens[:, :-1] and scores its logits at "
            f"position i against token i + 1, but changing input token {t} leaves the "
            f"logits at position {t} unchanged: the model shifts its inputs itself, so "
            f"the default loss would train it to skip a token; {CUSTOM_LOSS} (and feed "
            f"it the whole sequence)")


def first_id_outside(tokens: jax.Array, *, vocab: int) -> tuple[jax.Array, jax.Array]:
    """The flat index of the first id of ``tokens`` outside ``[0, vocab)`` (-1 if none)
    and that id: one reduction, meant to run jitted on the sharded batch."""
    # Only elementwise ops and full reductions: no reshape or gather of the sharded batch,
    # so it lowers on explicit meshes too.
    rows, cols = tokens.shape
    index = (jax.lax.broadcasted_iota(jnp.int32, tokens.shape, 0) * cols
             + jax.lax.broadcasted_iota(jnp.int32, tokens.shape, 1))
    bad = (tokens < 0) | (tokens >= vocab)
    first = jnp.min(jnp.where(bad, index, rows * cols))
    value = jnp.sum(jnp.where(index == first, tokens, 0))
    return jnp.where(first < rows * cols, first, -1), value


def id_outside_error(value: int, row: int, position: int, vocab: int) -> JaxparError:
    """The one line for an id outside the vocabulary, naming where it is."""
    return JaxparError(
        f"token id {value} at batch row {row}, position {position} is outside the model's "
        f"vocabulary [0, {vocab}): fix the data or the tokenizer (an id out of range would "
        f"corrupt the weights or be silently wrapped)")
