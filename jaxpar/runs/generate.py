"""Text generation from a trained run: what ``jaxpar sample`` prints.

:func:`generate` continues a prompt of token ids by plain recompute: every new token calls
the model on the whole (windowed) sequence, with no KV cache. The sequence lives in one
fixed-size buffer, right-padded (causal attention keeps padding out of the positions that
are read), so the step compiles once per model and sampling settings, not once per length.
:func:`load_run_model` rebuilds a run's model on one device from its newest checkpoint,
LoRA adapters included; :class:`TextCodec` turns text into the run's ids and back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.adapters import lora as lora_lib
from jaxpar.checkpoint.checkpointer import (
    CorruptCheckpoint,
    Location,
    load_weights,
    read_only,
    resolve_dir,
)
from jaxpar.config.assembly import build_mesh, build_plan, model_factory
from jaxpar.config.schema import Config, MeshConfig, from_dict
from jaxpar.data.tokenizer import eos_id, load_tokenizer, unknown_pieces, vocab_size
from jaxpar.errors import JaxparError, JaxparWarning
from jaxpar.sharding.partitioning import init_sharded
from jaxpar.storage.remote import check_bucket, is_remote


def _model_limits(model: nnx.Module) -> tuple[int | None, int | None]:
    """``(max_seq_len, vocab_size)`` of a model with a jaxpar-like ``config`` (else None)."""
    cfg = getattr(model, "config", None)
    size = lambda name: (v if isinstance(v := getattr(cfg, name, None), int) and v > 0
                         else None)
    return size("max_seq_len"), size("vocab_size")


@functools.partial(jax.jit, static_argnames=("graphdef", "greedy", "top_k"))
def _next_token(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, pos: jax.Array,
                key: jax.Array, step: jax.Array, temperature: jax.Array, *, greedy: bool,
                top_k: int) -> jax.Array:
    """The id after ``tokens[0, :pos + 1]``: argmax, or a sample at ``temperature``."""
    logits = nnx.merge(graphdef, state)(tokens)
    logits = jax.lax.dynamic_index_in_dim(logits[0], pos, keepdims=False).astype(jnp.float32)
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    key = jax.random.fold_in(key, step)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        values, ids = jax.lax.top_k(logits, top_k)
        return ids[jax.random.categorical(key, values)].astype(jnp.int32)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def _prompt_ids(prompt: Sequence[int] | np.ndarray) -> list[int]:
    """The ids of a prompt: one non-empty 1-D sequence of integers (not text, not floats)."""
    if isinstance(prompt, (str, bytes)):
        raise JaxparError(f"the prompt is text ({prompt[:40]!r}), not token ids: encode it "
                          "first (jaxpar.runs.generate.TextCodec.encode)")
    try:
        array = np.asarray(prompt)
    except ValueError:  # ragged nesting
        raise JaxparError("the prompt is not a 1-D sequence of token ids (its rows have "
                          "different lengths)") from None
    if array.ndim != 1:
        raise JaxparError(f"the prompt has shape {array.shape}: give one 1-D sequence of "
                          "token ids (generate continues a single prompt; for a batch of "
                          "one, pass prompt[0])")
    if array.size == 0:
        raise JaxparError("the prompt is empty: generation needs at least one token")
    if array.dtype.kind not in "iu":
        raise JaxparError(f"the prompt's token ids must be integers, not {array.dtype} "
                          f"(the first is {array[0].item()!r}): ids are not rounded")
    return [int(i) for i in array]


def _vocab_of(graphdef: nnx.GraphDef, state: nnx.State, length: int) -> int | None:
    """The size of the last axis of the model's output for ``(1, length)`` ids (traced
    abstractly, nothing runs), or None when the output is not ``(1, seq, vocab)``."""
    out = jax.eval_shape(lambda st, t: nnx.merge(graphdef, st)(t), state,
                         jax.ShapeDtypeStruct((1, length), jnp.int32))
    shape = getattr(out, "shape", ())
    return shape[-1] if len(shape) == 3 else None


def generate_iter(model: nnx.Module, prompt: Sequence[int] | np.ndarray, *,
                  max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                  seed: int = 0, eos_id: int | None = None) -> Iterator[int]:
    """:func:`generate`, yielding each new id as soon as it is chosen (to print text as it
    comes). The arguments are checked at the call, before the first id is asked for.

    Raises:
      JaxparError: as :func:`generate`.
    """
    ids = _prompt_ids(prompt)
    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise JaxparError(f"{name}={value!r}: must be a whole number")
    if max_new_tokens < 0:
        raise JaxparError(f"max_new_tokens={max_new_tokens}: must be 0 or more")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise JaxparError(f"temperature={temperature}: must be 0 (greedy) or positive")
    if top_k < 0:
        raise JaxparError(f"top_k={top_k}: must be 0 (all tokens) or positive")
    max_len, vocab = _model_limits(model)
    length = len(ids) + max_new_tokens
    length = min(length, max_len) if max_len is not None else length
    graphdef, state = nnx.split(model)
    if vocab is None and max_new_tokens > 0:
        vocab = _vocab_of(graphdef, state, length)
    bad = next((i for i in ids if i < 0 or (vocab is not None and i >= vocab)), None)
    if bad is not None:
        where = f"[0, {vocab})" if vocab is not None else "(ids are 0 or more)"
        raise JaxparError(f"prompt token id {bad} is outside the model's vocabulary {where}")
    if max_new_tokens == 0:
        return iter(())
    view = nnx.merge(graphdef, state)  # a copy of the module tree to switch dropout off in
    view.eval()
    graphdef, state = nnx.split(view)
    return _tokens(graphdef, state, ids, length, max_new_tokens, temperature, int(top_k),
                   seed, eos_id)


def _tokens(graphdef: nnx.GraphDef, state: nnx.State, ids: list[int], length: int,
            max_new_tokens: int, temperature: float, top_k: int, seed: int,
            eos_id: int | None) -> Iterator[int]:
    """The new ids, one model call each, over a buffer of ``length`` ids."""
    key = jax.random.key(seed)
    buffer = np.zeros((1, length), np.int32)
    seq = list(ids)
    for step in range(max_new_tokens):
        window = seq[-length:]
        buffer[0, :len(window)] = window
        buffer[0, len(window):] = 0
        token = int(_next_token(graphdef, state, jnp.asarray(buffer), len(window) - 1, key,
                                step, temperature or 1.0, greedy=temperature == 0,
                                top_k=top_k))
        seq.append(token)
        yield token
        if eos_id is not None and token == eos_id:
            return


def generate(model: nnx.Module, prompt: Sequence[int] | np.ndarray, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             eos_id: int | None = None) -> list[int]:
    """Continue ``prompt`` (token ids) by up to ``max_new_tokens`` ids; returns the new ids.

    ``prompt`` is one 1-D sequence of integer ids (a list, or a NumPy or JAX array).
    ``model(tokens)`` must map ids ``(1, seq)`` to logits ``(1, seq, vocab)``. With
    ``temperature`` 0 each id is the argmax; otherwise it is drawn from
    ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely ids when
    ``top_k > 0``, reproducibly for a ``seed``. Generation stops after ``eos_id`` (which
    is returned as the last id). The buffer holds ``len(prompt) + max_new_tokens`` ids, at
    most the model's ``config.max_seq_len`` when it has one: past that, the model sees the
    newest ``max_seq_len`` ids (the prompt is cut from the left). Dropout is off (the model
    itself is left as it is). :func:`generate_iter` yields the ids as they come.

    Raises:
      JaxparError: for a prompt that is empty, not 1-D, not integers, or has ids outside
        the model's vocabulary (its ``config.vocab_size``, else the last axis of its
        output); a ``max_new_tokens`` or ``top_k`` that is not a whole number; a negative
        ``max_new_tokens``, ``temperature`` or ``top_k``.
    """
    return list(generate_iter(model, prompt, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, seed=seed,
                              eos_id=eos_id))


@dataclasses.dataclass(frozen=True)
class TextCodec:
    """Text <-> token ids for a run: its ``data.tokenizer``, or UTF-8 bytes (vocab 256).

    Attributes:
      tokenizer: a ``tokenizers.Tokenizer``, or None for bytes.
      eos_id: the end-of-document id (None for bytes: they have none).
    """

    tokenizer: Any = None
    eos_id: int | None = None

    @classmethod
    def for_config(cls, config: Config) -> TextCodec:
        """The codec of a run config (loading its tokenizer, if it has one)."""
        spec = config.data.tokenizer
        if not spec:
            return cls()
        tokenizer = load_tokenizer(spec)
        folder = Path(spec).expanduser()
        folder = folder if folder.is_dir() else folder.parent
        try:
            eos = eos_id(tokenizer, folder)
        except JaxparError:
            eos = None
        return cls(tokenizer, eos)

    @functools.cached_property
    def vocab_size(self) -> int:
        """How many ids have a text: 256 bytes, or the tokenizer's (added tokens included)."""
        if self.tokenizer is None:
            return 256
        return vocab_size(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (without special tokens)."""
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def unknown(self, text: str) -> str | None:
        """What the tokenizer cannot spell in ``text``, as a phrase for a notice, or None
        when it has a token for all of it (bytes always have)."""
        if self.tokenizer is None:
            return None
        unknown, dropped = unknown_pieces(self.tokenizer, text)
        show = lambda pieces: ", ".join(repr(p) for p in pieces[:8]) + (
            f" and {len(pieces) - 8} more" if len(pieces) > 8 else "")
        said = ([f"{show(unknown)} (read as its unknown token)"] if unknown else []) + (
            [f"{show(dropped)} (left out)"] if dropped else [])
        return " and ".join(said) or None

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``: bytes that are not UTF-8 become U+FFFD; ids outside
        ``[0, vocab_size)`` have none (:class:`TextStream` counts them)."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids)


def prompt_ids(codec: TextCodec, prompt: str, what: str = "the prompt") -> list[int]:
    """The ids of ``prompt``; text the tokenizer has no token for is not an error (the
    model reads its unknown token, or nothing, there), but it is said once, as a
    :class:`~jaxpar.errors.JaxparWarning` naming ``what`` and the text.

    Raises:
      JaxparError: when the prompt encodes to no ids at all (naming what the tokenizer
        has no token for).
    """
    ids = codec.encode(prompt)
    unknown = codec.unknown(prompt)
    if not ids:
        why = f": the tokenizer has no token for {unknown}" if unknown else ""
        raise JaxparError(f"{what} {prompt!r} encodes to no tokens{why}")
    if unknown:
        warnings.warn(f"{what}: the tokenizer has no token for {unknown}; the model "
                      "continues what it was given", JaxparWarning, stacklevel=2)
    return ids


class TextStream:
    """The text that new ids add after a prompt, piece by piece, to print as they come.

    :meth:`push` returns the text one more id adds (possibly ''); :meth:`finish`, the rest.
    The whole sequence is decoded each time, so tokenizers that join tokens with spaces
    or merge pieces print what the whole decodes to; the end of an incomplete UTF-8
    character is waited for. Ids the codec has no text for (a model whose vocabulary is
    larger than its tokenizer's) print nothing; :meth:`finish` warns about them.
    """

    def __init__(self, codec: TextCodec, prompt: Sequence[int]):
        self.codec = codec
        self.prompt = [int(i) for i in prompt]
        self.head = codec.decode(self.prompt)
        self.ids: list[int] = []
        self.outside: list[int] = []
        self.shown = ""

    def _text(self) -> str:
        whole = self.codec.decode([*self.prompt, *self.ids])
        if whole.startswith(self.head):
            return whole[len(self.head):]
        return self.codec.decode(self.ids)

    def _advance(self, text: str) -> str:
        if not text.startswith(self.shown):
            return ""  # the decoder rewrote what was shown: it cannot be taken back
        piece, self.shown = text[len(self.shown):], text
        return piece

    def push(self, token: int) -> str:
        """Add ``token``; returns the text it completes."""
        self.ids.append(int(token))
        if not 0 <= int(token) < self.codec.vocab_size:
            self.outside.append(int(token))
        return self._advance(self._text().rstrip("\ufffd"))

    def finish(self) -> str:
        """The text not returned yet; warns (once) about ids that had no text."""
        if self.outside:
            seen = sorted(set(self.outside))
            kind = "tokenizer's" if self.codec.tokenizer is not None else "byte values'"
            warnings.warn(
                f"{len(self.outside)} of the {len(self.ids)} generated ids are outside the "
                f"{kind} {self.codec.vocab_size} ids and printed as nothing (ids "
                f"{', '.join(map(str, seen[:8]))}{', ...' if len(seen) > 8 else ''}): the "
                "model's vocabulary is larger than its tokenizer's", JaxparWarning,
                stacklevel=2)
        return self._advance(self._text())


def context_room(config: Config, prompt_len: int, model: nnx.Module | None = None
                 ) -> tuple[int, str] | None:
    """How many ids can follow a ``prompt_len``-id prompt within what the run's model
    attends to, and that limit in words (``model.max_seq_len=256``): the built-in
    decoder's ``model.max_seq_len``; for a ``model.factory`` model, its own
    ``config.max_seq_len`` (once ``model`` is given) or else ``train.seq_len``, the
    longest sequence it was trained on. None for a factory model not built yet."""
    factory = config.model.factory
    if not factory:
        limit = config.model.max_seq_len
        said = f"model.max_seq_len={limit}"
    elif model is None:
        return None
    elif (own := _model_limits(model)[0]) is not None:
        limit = own
        said = f"the max_seq_len ({limit}) of model.factory={factory!r}"
    else:
        limit = config.train.seq_len
        said = f"train.seq_len={limit} (model.factory={factory!r} has no max_seq_len)"
    return max(limit - prompt_len, 0), said


def sample_text(model: nnx.Module, codec: TextCodec, prompt: str, **kwargs: Any) -> str:
    """``prompt`` followed by the text :func:`generate` continues it with (``kwargs`` are
    its keywords; ``eos_id`` defaults to the codec's). Warns about prompt text the
    tokenizer cannot spell and generated ids it has no text for."""
    ids = prompt_ids(codec, prompt)
    kwargs.setdefault("eos_id", codec.eos_id)
    stream = TextStream(codec, ids)
    pieces = [stream.push(token) for token in generate_iter(model, ids, **kwargs)]
    return prompt + "".join(pieces) + stream.finish()


def run_config(run: str | Path) -> Config:
    """The config saved with the newest readable checkpoint of a run folder (the model is
    not built).

    Raises:
      JaxparError: for a missing run folder or no readable checkpoint.
    """
    directory = check_run(run)
    with read_only(directory) as reader:
        saved: dict[str, Any] | None = None
        for step in reversed(reader.steps()):
            try:
                saved = reader.config(step)
                break
            except CorruptCheckpoint:
                continue
    if saved is None:
        raise JaxparError(f"run folder {str(run)!r}: no readable checkpoint in {directory}")
    if not saved:
        raise JaxparError(f"checkpoint {directory}/{step} holds no run config")
    return from_dict(Config, saved)


def check_run(run: str | Path) -> Location:
    """The checkpoint folder of a run (``RUN`` or ``RUN/checkpoints``), checked on disk
    without starting JAX.

    Raises:
      JaxparError: when the folder is missing, a file, or holds no complete checkpoint.
    """
    if is_remote(run):  # a run folder in a bucket (gs://)
        check_bucket(str(run), "run folder")
        path = resolve_dir(run, "run folder")
        if not any(p.name.isdigit() for p in path.iterdir()):
            raise JaxparError(f"run folder {str(run)!r} holds no complete checkpoint (none "
                              f"in {path})")
        return path
    path = Path(run).expanduser()
    if not path.exists():
        raise JaxparError(f"run folder {str(run)!r} does not exist")
    if not path.is_dir():
        raise JaxparError(f"run folder {str(run)!r} is a file, not a folder")
    if not any(p.name.isdigit() for p in path.iterdir()):
        path = path / "checkpoints"
    if not (path.is_dir() and any(p.name.isdigit() and p.is_dir() for p in path.iterdir())):
        raise JaxparError(f"run folder {str(run)!r} holds no complete checkpoint (none in "
                          f"{path}): a run saves one every checkpoint.every steps and at "
                          "its end")
    return path


def load_run_model(run: str | Path) -> tuple[nnx.Module, Config]:
    """The model of a run folder on one device, with every weight of its newest readable
    checkpoint (the base and, if the run used LoRA, the adapters), in eval mode; and the
    run's config, as saved with that checkpoint.

    A run trained on any mesh or pipeline layout loads (the stacked layers are read back
    into the plain layout).

    Raises:
      JaxparError: for a missing run folder, no readable checkpoint, or a checkpoint that
        does not match the model its config describes.
    """
    config = run_config(run)
    directory = check_run(run)
    one = dataclasses.replace(config, init_from="",
                              mesh=MeshConfig(data=1, explicit=config.mesh.explicit))
    mesh = build_mesh(one, jax.devices()[:1])
    plan = build_plan(one, mesh)
    model = init_sharded(model_factory(one), plan)
    with plan.activate():
        lora_lib.apply_config(model, one.lora, rngs=one.train.seed, plan=plan)
    # Every variable the run saved, except RNG streams (int8 bases are not nnx.Params).
    load_weights(model, directory, stages=1, variables=nnx.Not(nnx.RngState), what="--run")
    model.eval()
    return model, config


__all__ = ["TextCodec", "TextStream", "check_run", "context_room", "generate", "generate_iter",
           "load_run_model", "prompt_ids", "run_config", "sample_text"]
