"""Packed rows from text documents tokenized as they are read, the same on any number of
processes, resumable from a few integers a row.

Documents (:mod:`jaxpar.data.documents`) of each source are shuffled with the run's seed in
epochs and, with several sources, mixed in the proportions of their weights (Grain's
``MapDataset.shuffle``/``repeat``/``mix``, as for token shards): one global sequence of
documents ``D[0], D[1], ...``. Nothing is tokenized ahead of time.

Row ``r`` of every global batch (``0 <= r < B``, ``B = train.global_batch``) is fed by a
stream of its own: documents ``D[r], D[r + B], D[r + 2B], ...``, each tokenized when the
stream reaches it, ended with the EOS id (the tokenizer's, or ``data.eos_id``) and
concatenated; consecutive batches cut consecutive ``seq_len + 1`` ids from it
(concatenate-and-split packing: no padding, no token dropped). A row's segment ids count
the EOS ids before each token, so attention stays inside a document
(:func:`jaxpar.data.loader.packed`); with ``data.cross_document`` rows go without them.

Process ``p`` of ``n`` runs the streams of its rows only (it reads and tokenizes only its
share), ``workers`` threads filling rows at once (the tokenizer's Rust code runs outside
the GIL). A stream's position is two integers: the documents it has finished and the ids
of the next one it has used. The positions of all ``B`` streams at step ``k`` go into the
checkpoint of step ``k`` (:meth:`DocumentLoader.state`), so a resumed run continues with
exactly batch ``k``, on the same or another number of processes: the global sequence does
not depend on how the rows are split.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpar.data.loader import packed
from jaxpar.errors import JaxparError

KEEP_STATES = 64
"""Steps back whose stream positions are kept (the checkpoint of a step already dispatched
while the loader reads ahead needs them)."""


class _Part:
    """Documents ``[lo, hi)`` of a table: the training part or the held-out tail."""

    def __init__(self, docs: Any, part: tuple[float, float]):
        n = len(docs)
        self.docs, self.lo, self.hi = docs, int(n * part[0]), int(n * part[1])
        if self.hi <= self.lo:
            raise JaxparError(f"data source {getattr(docs, 'name', '')!r}: no document in "
                              f"the part {part} of its {n} documents (raise "
                              "data.holdout_fraction or add documents)")

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, index: int) -> str:
        return self.docs[self.lo + int(index)]


class DocumentLoader:
    """Packed rows of ``seq_len + 1`` ids from documents (see the module docstring).

    Args:
      sources: ``(documents, weight)`` pairs.
      tokenizer: a ``tokenizers.Tokenizer``.
      eos_id: the id ending every document.
      global_batch, seq_len: rows per step across all processes, and the model's length.
      seed: shuffle seed.
      process_index, process_count: this process's rows.
      part: the fraction of each source's documents read (the held-out tail for evals).
      segments: return ``{"tokens", "segment_ids"}`` (attention kept inside documents);
        plain rows otherwise.
      workers: threads tokenizing rows at once.
    """

    def __init__(self, sources: Sequence[tuple[Any, float]], tokenizer: Any, eos_id: int,
                 global_batch: int, seq_len: int, *, seed: int = 0, process_index: int = 0,
                 process_count: int = 1, part: tuple[float, float] = (0.0, 1.0),
                 segments: bool = True, workers: int = 4):
        import grain  # imported on use, as for token shards

        if global_batch % process_count:
            raise JaxparError(f"train.global_batch={global_batch} is not divisible by the "
                              f"{process_count} processes")
        weights = [float(w) for _, w in sources]
        total = sum(weights)
        streams = [grain.MapDataset.source(_Part(docs, part)).shuffle(seed=seed * 1009 + i)
                   .repeat(None) for i, (docs, _) in enumerate(sources)]
        self._docs = streams[0] if len(streams) == 1 else grain.MapDataset.mix(
            streams, [w / total for w in weights])
        self.weights = tuple(w / total for w in weights)
        self.tokenizer, self.eos_id, self.segments = tokenizer, eos_id, segments
        self.global_batch, self.seq_len = global_batch, seq_len
        local = global_batch // process_count
        self.rows = range(process_index * local, (process_index + 1) * local)
        self._position = {r: (0, 0) for r in self.rows}  # (documents done, ids used)
        self._current: dict[int, tuple[int, np.ndarray]] = {}  # a stream's document ids
        self._next = 0
        self._states: dict[int, dict[int, tuple[int, int]]] = {0: dict(self._position)}
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, workers))

    @property
    def local_batch(self) -> int:
        """Rows this process loads per step."""
        return len(self.rows)

    def document(self, index: int) -> str:
        """Document ``index`` of the global (shuffled, mixed) sequence."""
        return self._docs[int(index)]

    def _ids(self, row: int, done: int) -> np.ndarray:
        """The ids of the ``done``-th document of row ``row``'s stream, EOS last."""
        cached = self._current.get(row)
        if cached is not None and cached[0] == done:
            return cached[1]
        text = self.document(row + done * self.global_batch)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        out = np.asarray([*ids, self.eos_id], np.int32)
        self._current[row] = (done, out)
        return out

    def _fill(self, row: int) -> np.ndarray:
        done, used = self._position[row]
        parts, need = [], self.seq_len + 1
        while need:
            ids = self._ids(row, done)
            take = ids[used:used + need]
            parts.append(take)
            need -= len(take)
            used += len(take)
            if used == len(ids):
                done, used = done + 1, 0
        self._position[row] = (done, used)
        return np.concatenate(parts)

    def batch(self, step: int) -> np.ndarray | dict[str, np.ndarray]:
        """This process's rows of global batch ``step`` (int32 ``(local_batch, seq_len + 1)``,
        packed with segment ids when ``segments``). Steps are read in order; a step read
        before (within :data:`KEEP_STATES`) is read again from its saved positions."""
        step = int(step)
        if step != self._next:
            if step not in self._states:
                raise JaxparError(f"document batches are read in order: batch {step} was "
                                  f"asked for after batch {self._next - 1}")
            self._position = dict(self._states[step])
        rows = np.stack(list(self._pool.map(self._fill, self.rows)))
        self._next = step + 1
        self._states[self._next] = dict(self._position)
        for old in [s for s in self._states if 0 < s < self._next - KEEP_STATES]:
            del self._states[old]
        return packed(rows, self.eos_id) if self.segments else rows

    def local_state(self, step: int) -> np.ndarray:
        """This process's stream positions before batch ``step``: int64 ``(local_batch, 2)``."""
        if step not in self._states:
            raise JaxparError(f"the document streams' positions at step {step} are no longer "
                              "kept")
        return np.asarray([self._states[step][r] for r in self.rows], np.int64)

    def restore(self, positions: Sequence[Sequence[int]], step: int) -> None:
        """Continue at batch ``step`` from the positions of all ``global_batch`` streams (as
        saved by a run on any number of processes).

        Raises:
          JaxparError: when they were saved for another global batch.
        """
        if len(positions) != self.global_batch:
            raise JaxparError(f"the checkpoint's document streams were saved for "
                              f"train.global_batch={len(positions)}, not "
                              f"{self.global_batch}: resume with the global batch it was "
                              "saved with")
        self._position = {r: (int(positions[r][0]), int(positions[r][1])) for r in self.rows}
        self._current.clear()
        self._next = step
        self._states = {step: dict(self._position)}

    def vocab_check(self, vocab_size: int, **_: object) -> None:
        """Nothing to scan: the tokenizer's vocabulary was checked against the model's."""

    def close(self) -> None:
        """Stop the tokenizing threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
