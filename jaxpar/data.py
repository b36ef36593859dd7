"""Token data: a built-in corpus, user files, and a deterministic, resumable batch loader.

The built-in corpus is the Python standard library's own source, read as bytes (vocab
256): it exists on every machine that runs jaxpar. User data may be a text file or a
folder of them (bytes again), a ``.npy`` array of token ids, or a ``.bin`` file of
``uint16`` token ids (the nanoGPT convention).

Batch ``k`` depends only on ``(seed, k)``, so a loader resumes exactly from a step
number, and each process of a multi-host run reads only its own rows of the global batch.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpar.errors import JaxparError


def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """The first ``max_bytes`` bytes of the standard library's ``.py`` files, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if {"site-packages", "dist-packages"} & set(path.parts):
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise JaxparError(f"no Python sources found under {root} for the built-in corpus")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def load_tokens(source: str, max_bytes: int = 8_000_000) -> np.ndarray:
    """Token ids from ``"stdlib"``, a text file, a folder of text files, a .npy or a .bin file."""
    if source == "stdlib":
        return stdlib_corpus(max_bytes)
    path = Path(source)
    if not path.exists():
        raise JaxparError(f"data.source {source!r} is neither 'stdlib' nor an existing path")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        data = b"".join(p.read_bytes() for p in files)
        return np.frombuffer(data[:max_bytes], dtype=np.uint8)
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise JaxparError(f"{source}: expected a 1-D integer array of token ids, "
                              f"got {tokens.dtype} {tokens.shape}")
        return tokens
    if path.suffix == ".bin":
        return np.memmap(path, dtype=np.uint16, mode="r")
    return np.frombuffer(path.read_bytes()[:max_bytes], dtype=np.uint8)


def split_holdout(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, holdout): the last ``fraction`` of the tokens is held out."""
    cut = int(len(tokens) * (1.0 - fraction))
    return tokens[:cut], tokens[cut:]


@dataclass
class TokenLoader:
    """Random windows of ``seq_len + 1`` tokens; batch ``k`` depends only on ``(seed, k)``.

    Attributes:
      tokens: 1-D token ids.
      global_batch: rows per step across all processes.
      seq_len: model sequence length (each row holds ``seq_len + 1`` ids: inputs and targets).
      seed: data order seed.
      process_index, process_count: this process's share of the rows.
    """

    tokens: np.ndarray
    global_batch: int
    seq_len: int
    seed: int = 0
    process_index: int = 0
    process_count: int = 1

    def __post_init__(self) -> None:
        if len(self.tokens) <= self.seq_len + 1:
            raise JaxparError(
                f"the corpus has {len(self.tokens)} tokens, too few for seq_len={self.seq_len}"
            )
        if self.global_batch % self.process_count:
            raise JaxparError(
                f"train.global_batch={self.global_batch} is not divisible by the "
                f"{self.process_count} processes"
            )

    @property
    def local_batch(self) -> int:
        """Rows this process loads per step."""
        return self.global_batch // self.process_count

    def batch(self, step: int) -> np.ndarray:
        """This process's rows of global batch ``step``: int32 ``(local_batch, seq_len + 1)``."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)
        mine = starts[self.process_index * self.local_batch:(self.process_index + 1)
                      * self.local_batch]
        return np.stack([self.tokens[s:s + self.seq_len + 1] for s in mine]).astype(np.int32)

    def vocab_check(self, vocab_size: int) -> None:
        """Fail clearly if a token id would index past the model's embedding table."""
        top = int(np.max(self.tokens[: 1 << 24]))
        if top >= vocab_size:
            raise JaxparError(
                f"the data holds token id {top} but model.vocab_size={vocab_size}"
            )
