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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import Config, MeshConfig, _build
from jaxpar.errors import JaxparError


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


def generate(model: nnx.Module, prompt: Sequence[int] | np.ndarray, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             eos_id: int | None = None) -> list[int]:
    """Continue ``prompt`` (token ids) by up to ``max_new_tokens`` ids; returns the new ids.

    ``model(tokens)`` must map ids ``(1, seq)`` to logits ``(1, seq, vocab)``. With
    ``temperature`` 0 each id is the argmax; otherwise it is drawn from
    ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely ids when
    ``top_k > 0``, reproducibly for a ``seed``. Generation stops after ``eos_id`` (which
    is returned as the last id). The buffer holds ``len(prompt) + max_new_tokens`` ids, at
    most the model's ``config.max_seq_len`` when it has one: past that, the model sees the
    newest ``max_seq_len`` ids (the prompt is cut from the left). Dropout is off (the model
    itself is left as it is).

    Raises:
      JaxparError: for an empty prompt, ids outside the model's vocabulary, or a negative
        ``max_new_tokens``, ``temperature`` or ``top_k``.
    """
    ids = [int(i) for i in np.asarray(prompt).reshape(-1)]
    if not ids:
        raise JaxparError("the prompt is empty: generation needs at least one token")
    if max_new_tokens < 0:
        raise JaxparError(f"max_new_tokens={max_new_tokens}: must be 0 or more")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise JaxparError(f"temperature={temperature}: must be 0 (greedy) or positive")
    if top_k < 0:
        raise JaxparError(f"top_k={top_k}: must be 0 (all tokens) or positive")
    max_len, vocab = _model_limits(model)
    if vocab is not None and not all(0 <= i < vocab for i in ids):
        bad = next(i for i in ids if not 0 <= i < vocab)
        raise JaxparError(f"prompt token id {bad} is outside the model's vocabulary "
                          f"[0, {vocab})")
    if max_new_tokens == 0:
        return []
    length = len(ids) + max_new_tokens
    length = min(length, max_len) if max_len is not None else length
    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, state)  # a copy of the module tree to switch dropout off in
    view.eval()
    graphdef, state = nnx.split(view)
    key = jax.random.key(seed)
    buffer = np.zeros((1, length), np.int32)
    seq, new = list(ids), []
    for step in range(max_new_tokens):
        window = seq[-length:]
        buffer[0, :len(window)] = window
        buffer[0, len(window):] = 0
        token = int(_next_token(graphdef, state, jnp.asarray(buffer), len(window) - 1, key,
                                step, temperature or 1.0, greedy=temperature == 0,
                                top_k=int(top_k)))
        seq.append(token)
        new.append(token)
        if eos_id is not None and token == eos_id:
            break
    return new


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
        from jaxpar.tokenize import eos_id, load_tokenizer

        tokenizer = load_tokenizer(spec)
        folder = Path(spec).expanduser()
        folder = folder if folder.is_dir() else folder.parent
        try:
            eos = eos_id(tokenizer, folder)
        except JaxparError:
            eos = None
        return cls(tokenizer, eos)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (without special tokens)."""
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (bytes that are not UTF-8 become U+FFFD)."""
        if self.tokenizer is None:
            return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode([int(i) for i in ids])


def sample_text(model: nnx.Module, codec: TextCodec, prompt: str, **kwargs: Any) -> str:
    """``prompt`` followed by the text :func:`generate` continues it with (``kwargs`` are
    its keywords; ``eos_id`` defaults to the codec's)."""
    ids = codec.encode(prompt)
    if not ids:
        raise JaxparError(f"the prompt {prompt!r} encodes to no tokens")
    kwargs.setdefault("eos_id", codec.eos_id)
    new = generate(model, ids, **kwargs)
    whole, head = codec.decode([*ids, *new]), codec.decode(ids)
    return prompt + whole[len(head):] if whole.startswith(head) else whole


def check_run(run: str | Path) -> Path:
    """The checkpoint folder of a run (``RUN`` or ``RUN/checkpoints``), checked on disk
    without starting JAX.

    Raises:
      JaxparError: when the folder is missing, a file, or holds no complete checkpoint.
    """
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
    from jaxpar import lora as lora_lib
    from jaxpar.assembly import build_mesh, build_plan, model_factory
    from jaxpar.checkpoint import CorruptCheckpoint, load_weights, read_only
    from jaxpar.partitioning import init_sharded

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
    config = _build(Config, saved)
    one = dataclasses.replace(config, init_from="",
                              mesh=MeshConfig(data=1, explicit=config.mesh.explicit))
    mesh = build_mesh(one, jax.devices()[:1])
    plan = build_plan(one, mesh)
    model = init_sharded(model_factory(one), plan)
    with plan.activate():
        lora_lib.apply_config(model, one.lora, rngs=one.train.seed, plan=plan)
    # Every variable the run saved, except RNG streams (int8 bases are not nnx.Params).
    load_weights(model, directory, stages=1, variables=nnx.Not(nnx.RngState))
    model.eval()
    return model, config


__all__ = ["TextCodec", "check_run", "generate", "load_run_model", "sample_text"]
