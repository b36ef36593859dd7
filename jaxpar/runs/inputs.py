"""What a run reads: the config's data as this process's loader of batches.

Four kinds, by what ``data`` names: one corpus in memory (the built-in text, a file or
folder of text, one token file: :class:`~jaxpar.data.loader.TokenLoader`); token shards
(a glob or folder of ``.bin``/``.npy``, local or in a bucket, or ``data.sources`` of them:
:class:`~jaxpar.data.mixture.MixtureLoader`); documents tokenized as read (``.jsonl``,
Parquet, Arrow, ArrayRecord, Hugging Face ``datasets`` folders with ``data.tokenizer``:
:class:`~jaxpar.data.streams.DocumentLoader`); and conversations for supervised
fine-tuning (``data.chat``: :class:`~jaxpar.data.conversations.ChatLoader`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar.config.schema import Config
from jaxpar.data.chat import ChatTokenizer
from jaxpar.data.conversations import ChatLoader, pad_id, read_conversations
from jaxpar.data.documents import open_documents, uses_documents
from jaxpar.data.loader import TokenLoader, load_tokens, split_holdout
from jaxpar.data.mixture import MixtureLoader, Source
from jaxpar.data.shards import Windows, check_shards, names_shards, open_shard, shard_paths
from jaxpar.data.streams import DocumentLoader
from jaxpar.data.tokenizer import eos_id, load_tokenizer, tokenizer_json, vocab_size
from jaxpar.errors import JaxparError, JaxparWarning


def fitting_tokenizer(config: Config) -> Any:
    """``data.tokenizer``, loaded; refused in one line when its vocabulary outgrows
    ``model.vocab_size`` (checked before anything is tokenized)."""
    tokenizer = load_tokenizer(config.data.tokenizer)
    vocab = vocab_size(tokenizer)
    if vocab > config.model.vocab_size:
        raise JaxparError(
            f"data.tokenizer {config.data.tokenizer!r} has a vocabulary of {vocab} tokens "
            f"but model.vocab_size={config.model.vocab_size}: set model.vocab_size={vocab} "
            "or more")
    return tokenizer


def load_corpus(config: Config) -> np.ndarray:
    """The whole corpus of ``config.data`` as token ids (a tokenizer's vocabulary is checked
    against ``model.vocab_size`` before anything is tokenized)."""
    data = config.data
    if data.tokenizer:
        fitting_tokenizer(config)
    elif Path(data.source).suffix == ".bin":  # one shard: its manifest or first ids
        check_shards([Path(data.source)], data.token_dtype, data.eos_id,
                     config.model.vocab_size, data.source)
    return load_tokens(data.source, data.max_bytes, tokenizer=data.tokenizer,
                       field=data.field, token_dtype=data.token_dtype)


def reads_shards(config: Config) -> bool:
    """Whether the run reads token shards, documents or conversations in shuffled epochs
    (``data.sources``, a glob or folder of shards, document files, ``data.chat``) rather
    than one corpus in memory."""
    return (config.data.chat or bool(config.data.sources) or names_shards(config.data.source)
            or reads_documents(config))


def chat_loader(config: Config, *, holdout: bool = False) -> ChatLoader:
    """This process's :class:`ChatLoader` over ``data.source``'s conversations rendered
    with ``data.tokenizer``'s chat template: the first ``1 - data.holdout_fraction`` of
    them for training, the rest held out."""
    data, train = config.data, config.train
    fitting_tokenizer(config)  # the vocabulary against model.vocab_size, in one line
    chat = ChatTokenizer.load(data.tokenizer)
    conversations = read_conversations(data.source, chat, train.seq_len + 1)
    cut = int(len(conversations) * (1.0 - data.holdout_fraction))
    part = conversations[cut:] if holdout else conversations[:cut]
    if not part:
        what = "held-out part" if holdout else "training part"
        raise JaxparError(f"data.source {data.source!r}: the {what} of its "
                          f"{len(conversations)} conversations is empty "
                          f"(data.holdout_fraction={data.holdout_fraction}): add "
                          "conversations or change the fraction")
    loader = ChatLoader(part, pad_id(chat), train.global_batch, train.seq_len,
                        seed=train.seed + (1 if holdout else 0),
                        process_index=jax.process_index(), process_count=jax.process_count())
    loader.vocab_check(config.model.vocab_size)
    return loader


def reads_documents(config: Config) -> bool:
    """Whether the run tokenizes documents as it reads them (:func:`document_loader`)."""
    data = config.data
    return uses_documents(data.source, data.sources, data.tokenizer)


def document_loader(config: Config, *, holdout: bool = False) -> DocumentLoader:
    """This process's :class:`DocumentLoader` over the config's document sources: the first
    ``1 - data.holdout_fraction`` of each source's documents for training, the rest held
    out. Documents end with ``data.eos_id`` (-1: the tokenizer's EOS id); rows carry
    segment ids unless ``data.cross_document`` (said in one warning line), or the mesh
    has stages, or a context axis in the balanced order (which do not take them yet)."""
    data, train = config.data, config.train
    tokenizer = fitting_tokenizer(config)
    eos = (data.eos_id if data.eos_id >= 0
           else eos_id(tokenizer, tokenizer_json(data.tokenizer).parent))
    if data.cross_document and not holdout:
        warnings.warn("data.cross_document=true: rows run across documents (no segment "
                      "ids; attention crosses from one document into the next)",
                      JaxparWarning, stacklevel=2)
    cut = 1.0 - data.holdout_fraction
    sources = [(open_documents(entry["path"], data.field), float(entry.get("weight", 1.0)))
               for entry in data.sources or [{"path": data.source}]]
    return DocumentLoader(
        sources, tokenizer, eos, train.global_batch, train.seq_len,
        seed=train.seed + (1 if holdout else 0), process_index=jax.process_index(),
        process_count=jax.process_count(), part=(cut, 1.0) if holdout else (0.0, cut),
        segments=not data.cross_document and config.mesh.stage == 1 and (
            config.mesh.context == 1 or not config.plan.context_balance),
        workers=data.workers)


def shard_loader(config: Config, *, holdout: bool = False) -> MixtureLoader:
    """This process's :class:`MixtureLoader` over the config's token shards: the first
    ``1 - data.holdout_fraction`` of each shard's windows for training, the rest held out."""
    data, train = config.data, config.train
    cut = 1.0 - data.holdout_fraction
    sources = []
    for entry in data.sources or [{"path": data.source}]:
        paths = shard_paths(entry["path"])
        check_shards(paths, data.token_dtype, data.eos_id, config.model.vocab_size,
                     entry["path"])
        shards = [open_shard(p, data.token_dtype) for p in paths]
        windows = Windows(shards, train.seq_len, name=entry["path"],
                          part=(cut, 1.0) if holdout else (0.0, cut))
        sources.append(Source(windows, float(entry.get("weight", 1.0))))
    loader = MixtureLoader(sources, train.global_batch, seed=train.seed + (1 if holdout else 0),
                           process_index=jax.process_index(),
                           process_count=jax.process_count(), eos_id=data.eos_id)
    loader.vocab_check(config.model.vocab_size)
    return loader


def make_loader(config: Config, *, holdout: bool = False,
                tokens: np.ndarray | None = None
                ) -> TokenLoader | MixtureLoader | DocumentLoader | ChatLoader:
    """This process's loader over the training tokens (or, with ``holdout``, over the
    held-out tail of the corpus: ``data.holdout_fraction``). ``tokens``: the corpus, when
    :func:`load_corpus` has read it already. Token shards get a :func:`shard_loader`,
    documents a :func:`document_loader`, conversations (``data.chat``) a
    :func:`chat_loader`."""
    if config.data.chat:
        return chat_loader(config, holdout=holdout)
    if reads_documents(config):
        return document_loader(config, holdout=holdout)
    if reads_shards(config):
        return shard_loader(config, holdout=holdout)
    data, train = config.data, config.train
    tokens = load_corpus(config) if tokens is None else tokens
    train_tokens, held_out = split_holdout(tokens, data.holdout_fraction)
    chosen = held_out if holdout else train_tokens
    # One batch of distinct windows; a window also needs one spare id to vary its start.
    need = max(train.global_batch * (train.seq_len + 1), train.seq_len + 2)
    if len(chosen) < need:
        formula = (f"train.global_batch * (train.seq_len + 1) = {train.global_batch} * "
                   f"{train.seq_len + 1} = {need}" if train.global_batch > 1
                   else f"train.seq_len + 2 = {need}")
        if holdout:
            raise JaxparError(
                f"data.source {data.source!r}: the held-out part has {len(chosen)} tokens "
                f"(data.holdout_fraction={data.holdout_fraction} of {len(tokens)}), fewer "
                f"than one batch needs ({formula}) for train.eval_every={train.eval_every}; "
                f"raise data.holdout_fraction or set train.eval_every=0")
        cut_short = (tokens.dtype == "uint8" and len(tokens) == data.max_bytes
                     and Path(data.source).suffix != ".npy")
        more = (f"more data (data.max_bytes={data.max_bytes} cut it short)" if cut_short
                else "more data")
        raise JaxparError(
            f"data.source {data.source!r}: the training part has {len(chosen)} tokens "
            f"(of {len(tokens)}, after data.holdout_fraction={data.holdout_fraction}), "
            f"fewer than one batch needs ({formula}); lower train.global_batch or "
            f"train.seq_len, or use {more}")
    loader = TokenLoader(
        chosen, train.global_batch, train.seq_len,
        seed=train.seed + (1 if holdout else 0),
        process_index=jax.process_index(), process_count=jax.process_count(),
        eos_id=data.eos_id,
    )
    # Every id is checked (streamed in chunks); positions count from the file's start.
    loader.vocab_check(config.model.vocab_size, source=data.source,
                       offset=len(train_tokens) if holdout else 0)
    return loader
