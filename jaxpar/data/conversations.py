"""Supervised fine-tuning data: conversations rendered with the family's chat template,
the loss on the assistant's turns only.

``data.chat: true`` reads ``data.source``, a ``.jsonl`` file (or a folder of them, sorted;
either may be in a ``gs://`` or ``s3://`` bucket, or a glob there)
holding a conversation per line, ``{"messages": [{"role": "user", "content": "..."},
{"role": "assistant", "content": "..."}, ...]}`` (roles: :data:`~jaxpar.data.chat.ROLES`;
blank lines are skipped; a record may add ``"tools"``, the function schemas a template
lists, and ``"chat_template_kwargs"``, options such as ``{"enable_thinking": false}``,
passed as ``apply_chat_template`` passes them; an assistant message with ``tool_calls``
may leave out its content), with ``data.tokenizer`` a Hugging Face tokenizer folder that
has a chat template (:class:`~jaxpar.data.chat.ChatTokenizer`). Each conversation is
rendered and tokenized once, up front, as ``apply_chat_template`` would, with a mask of
the tokens the assistant writes (its turns and what closes them).

A row holds one conversation, padded to ``seq_len + 1`` ids with the tokenizer's pad token
(its EOS when it has none). Batches are ``{"tokens", "segment_ids", "loss_mask"}``: the
conversation is segment 0 and the padding segment 1 (attention never crosses), and
``loss_mask[t]`` is 1 where token ``t`` is the assistant's: only those targets count in
the loss (:func:`jaxpar.training.objective.packed_lm_loss`). A conversation longer than
``seq_len + 1`` ids is refused, not cut (a cut turn would teach the model to stop in
the middle of an answer): the message names the file and line and its length.

Bad input is one line naming the file and line: not JSON, no ``messages`` list, a
message without a ``role`` or text ``content``, an unknown role, no assistant turn,
``tools`` not a list of objects or ``chat_template_kwargs`` not an object, a
template that refuses the conversation (``raise_exception``), one too long.

Conversations are shuffled in epochs: row ``i`` of the global sequence is conversation
``perm_e[i mod N]`` of epoch ``e = i div N`` (a permutation drawn from ``(seed, e)``), so
batch ``k`` depends only on ``(seed, k)`` and a run resumes from its step number alone.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxpar.data.chat import ROLES, ChatTokenizer
from jaxpar.errors import JaxparError
from jaxpar.storage.remote import is_remote, read_object, remote_files


def chat_files(source: str) -> list[Path] | list[str]:
    """The ``.jsonl`` file ``source``, or a folder's ``.jsonl`` files (recursively, sorted);
    in a bucket (``gs://``, ``s3://``), the object, a folder's ``.jsonl`` objects or a
    glob's matches, as URLs.

    Raises:
      JaxparError: when there is none, or the bucket cannot be read."""
    if is_remote(source):
        return remote_files(source, (".jsonl",), "data.source")
    root = Path(source).expanduser()
    if root.is_dir():
        files = sorted(p for p in root.rglob("*.jsonl") if p.is_file())
        if not files:
            raise JaxparError(f"data.source {source!r}: the folder holds no .jsonl file of "
                              "conversations")
        return files
    if not root.is_file():
        raise JaxparError(f"data.source {source!r} does not exist")
    return [root]


def _lines(source: str, file: Path | str) -> list[str]:
    """The lines of one conversation file, local or in a bucket (one line on failure)."""
    try:
        if isinstance(file, str):
            return read_object(file, "data.source").decode("utf-8").splitlines()
        return file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise JaxparError(f"data.source {source!r}: {str(file)!r} is not UTF-8") from None
    except OSError as exc:
        raise JaxparError(f"data.source {source!r}: cannot read {str(file)!r}: "
                          f"{exc.strerror or exc}") from None


def _messages(record: object, where: str) -> list[dict]:
    """The checked ``messages`` of one record."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        what = ("the record has no \"messages\"" if messages is None
                else "\"messages\" is not a non-empty list")
        raise JaxparError(f"{where}: {what} (each line is {{\"messages\": [{{\"role\": "
                          "\"user\", \"content\": \"...\"}, ...]})")
    for n, message in enumerate(messages, 1):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            what = "has no \"role\"" if role is None else f"has the unknown role {role!r}"
            raise JaxparError(f"{where}: message {n} {what} (roles: {', '.join(ROLES)})")
        if not isinstance(message.get("content"), str) and not (
                role == "assistant" and message.get("tool_calls")):
            raise JaxparError(f"{where}: message {n} has no text \"content\"")
    if not any(m["role"] == "assistant" for m in messages):
        raise JaxparError(f"{where}: no assistant message: nothing to learn from it")
    return messages


def _template_inputs(record: dict, where: str) -> dict:
    """The record's ``tools`` and ``chat_template_kwargs``, checked, as keyword
    arguments of :meth:`~jaxpar.data.chat.ChatTokenizer.conversation`."""
    tools, options = record.get("tools"), record.get("chat_template_kwargs")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise JaxparError(f"{where}: \"tools\" is not a list of objects (function schemas)")
    if options is not None and not isinstance(options, dict):
        raise JaxparError(f"{where}: \"chat_template_kwargs\" is not an object (e.g. "
                          "{\"enable_thinking\": false})")
    return {"tools": tools, "options": options}


def read_conversations(source: str, chat: ChatTokenizer, limit: int
                       ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, mask)`` of every conversation of ``source``, each at most ``limit`` ids.

    Raises:
      JaxparError: one line naming the file and line, for any bad input (see the module
        docstring)."""
    out = []
    for file in chat_files(source):
        for number, line in enumerate(_lines(source, file), 1):
            if not line.strip():
                continue
            where = f"data.source {source!r}: {file}:{number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise JaxparError(f"{where}: not JSON ({exc})") from None
            messages = _messages(record, where)
            inputs = _template_inputs(record, where)
            try:
                ids, mask = chat.conversation(messages, **inputs)
            except JaxparError as exc:
                raise JaxparError(f"{where}: {exc}") from None
            if len(ids) > limit:
                raise JaxparError(f"{where}: the conversation is {len(ids)} tokens, more than "
                                  f"train.seq_len + 1 = {limit}: raise train.seq_len (and "
                                  "model.max_seq_len) or shorten it (conversations are not "
                                  "cut)")
            if not any(mask):
                raise JaxparError(f"{where}: the chat template leaves no assistant token")
            out.append((np.asarray(ids, np.int32), np.asarray(mask, np.int32)))
    if not out:
        raise JaxparError(f"data.source {source!r} holds no conversation")
    return out


class ChatLoader:
    """Rows of one conversation each (see the module docstring); batch ``k`` depends only on
    ``(seed, k)``.

    Args:
      conversations: ``(ids, mask)`` pairs, each at most ``seq_len + 1`` long.
      pad_id: the id that fills a row after its conversation.
      global_batch, seq_len: rows per step across all processes, and the model's length.
      seed: shuffle seed.
      process_index, process_count: this process's rows.
    """

    def __init__(self, conversations: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int,
                 global_batch: int, seq_len: int, *, seed: int = 0, process_index: int = 0,
                 process_count: int = 1):
        if not conversations:
            raise JaxparError("no conversation to train on")
        if global_batch % process_count:
            raise JaxparError(f"train.global_batch={global_batch} is not divisible by the "
                              f"{process_count} processes")
        self.conversations, self.pad_id = list(conversations), pad_id
        self.global_batch, self.seq_len, self.seed = global_batch, seq_len, seed
        local = global_batch // process_count
        self.rows = range(process_index * local, (process_index + 1) * local)

    @property
    def local_batch(self) -> int:
        """Rows this process loads per step."""
        return len(self.rows)

    @functools.lru_cache(maxsize=4)  # noqa: B019 (a few epochs' permutations, per loader)
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.conversations))

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row ``index`` of the global sequence: ``(tokens, segment_ids, loss_mask)``, each
        int32 ``(seq_len + 1,)``."""
        n = len(self.conversations)
        ids, mask = self.conversations[int(self._permutation(index // n)[index % n])]
        width = self.seq_len + 1
        tokens = np.full(width, self.pad_id, np.int32)
        tokens[:len(ids)] = ids
        segments = np.ones(width, np.int32)
        segments[:len(ids)] = 0
        loss_mask = np.zeros(width, np.int32)
        loss_mask[:len(mask)] = mask
        return tokens, segments, loss_mask

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``step``: ``{"tokens", "segment_ids",
        "loss_mask"}``, each int32 ``(local_batch, seq_len + 1)``."""
        first = int(step) * self.global_batch
        rows = [self.row(first + r) for r in self.rows]
        return {key: np.stack([r[i] for r in rows])
                for i, key in enumerate(("tokens", "segment_ids", "loss_mask"))}

    def vocab_check(self, vocab_size: int, **_: object) -> None:
        """Fail in one line if a conversation's id would index past the embedding."""
        top = max(int(ids.max()) for ids, _ in self.conversations)
        if max(top, self.pad_id) >= vocab_size:
            raise JaxparError(f"token id {max(top, self.pad_id)} of the conversations is >= "
                              f"model.vocab_size={vocab_size}")


def pad_id(chat: ChatTokenizer) -> int:
    """The id padding a row: the ``pad_token``, else the EOS, else 0."""
    for name in ("pad_token", "eos_token"):
        token = chat.special.get(name)
        if token is not None and (found := chat.tokenizer.token_to_id(token)) is not None:
            return found
    return chat.stop_ids[0] if chat.stop_ids else 0
