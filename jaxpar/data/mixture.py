"""Batches over token shards: shuffled in epochs, mixed by weight, the same on any number of
processes, with Grain.

Each source's windows (:class:`~jaxpar.data.shards.Windows`) form a Grain ``MapDataset``
that is shuffled with the run's seed and repeated: every epoch is a fresh permutation, so
within an epoch no window is drawn twice. Several sources are interleaved by
``MapDataset.mix`` in the proportions of their weights (exactly, up to one window per
source in any stretch of rows). The result is one infinite, deterministic sequence of rows;
global batch ``k`` is rows ``k * B ... (k + 1) * B - 1``, and process ``p`` of ``n`` reads
its ``B / n`` consecutive rows of it.

So the state of the data is the step number alone: a run resumed from a checkpoint at
step ``k`` continues with exactly batch ``k``, on the same or any other number of
processes (4, then 2, then 3): the global sequence of batches does not depend on how it
is split. Changing the weights on resume recomputes the interleaving from the new ones:
the batches after the resume are those a run with the new weights would have seen at
that step, so each source skips or repeats the windows the change moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxpar.data.loader import packed
from jaxpar.data.shards import Windows
from jaxpar.errors import JaxparError


@dataclasses.dataclass(frozen=True)
class Source:
    """One source of a mixture: its windows and relative weight."""

    windows: Windows
    weight: float = 1.0


class MixtureLoader:
    """Rows of ``seq_len + 1`` ids from weighted sources, shuffled in epochs; batch ``k``
    depends only on ``(sources, weights, seed, k)``, not on the process count.

    Attributes:
      global_batch: rows per step across all processes.
      seq_len: model sequence length.
      process_index, process_count: this process's share of the rows.
      eos_id: with an id >= 0, batches are packed: documents end at it.
    """

    def __init__(self, sources: Sequence[Source], global_batch: int, *, seed: int = 0,
                 process_index: int = 0, process_count: int = 1, eos_id: int = -1):
        import grain  # imported on use: runs on the built-in corpus never load it

        if not sources:
            raise JaxparError("a mixture needs at least one data source")
        weights = [float(s.weight) for s in sources]
        if any(not np.isfinite(w) or w <= 0 for w in weights):
            raise JaxparError(f"data.sources weights must be positive numbers, got {weights}")
        if global_batch % process_count:
            raise JaxparError(f"train.global_batch={global_batch} is not divisible by the "
                              f"{process_count} processes")
        self.sources = tuple(sources)
        self.global_batch, self.seq_len = global_batch, sources[0].windows.seq_len
        self.process_index, self.process_count = process_index, process_count
        self.eos_id = eos_id
        streams = [grain.MapDataset.source(s.windows).shuffle(seed=seed * 1009 + i)
                   .repeat(None) for i, s in enumerate(sources)]
        total = sum(weights)
        self.weights = tuple(w / total for w in weights)
        self._rows = streams[0] if len(streams) == 1 else grain.MapDataset.mix(
            streams, list(self.weights))

    @property
    def local_batch(self) -> int:
        """Rows this process loads per step."""
        return self.global_batch // self.process_count

    def row(self, index: int) -> np.ndarray:
        """Row ``index`` of the global sequence: int32 ``(seq_len + 1,)``."""
        return self._rows[int(index)]

    def batch(self, step: int) -> np.ndarray | dict[str, np.ndarray]:
        """This process's rows of global batch ``step``: int32 ``(local_batch, seq_len + 1)``;
        with ``eos_id >= 0`` a packed batch (:func:`jaxpar.data.loader.packed`)."""
        first = step * self.global_batch + self.process_index * self.local_batch
        rows = np.stack([self.row(first + r) for r in range(self.local_batch)])
        return packed(rows, self.eos_id) if self.eos_id >= 0 else rows

    def epochs(self, steps: int) -> list[float]:
        """Epochs of each source that ``steps`` steps read (its share of the rows over its
        number of windows)."""
        rows = steps * self.global_batch
        return [rows * w / len(s.windows) for s, w in zip(self.sources, self.weights,
                                                           strict=True)]

    def vocab_check(self, vocab_size: int, **_: object) -> None:
        """Fail in one line, naming the shard, if an id would index past the embedding."""
        for source in self.sources:
            source.windows.check_ids(vocab_size)
