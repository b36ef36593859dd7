"""Token data: a built-in corpus, user files, and a deterministic, resumable batch loader.

The built-in corpus is the Python standard library's own source, read as bytes (vocab
256): it exists on every machine that runs jaxpar. User data may be a text file or a
folder of them (bytes again, or tokenized by a Hugging Face tokenizer: see
:mod:`jaxpar.data.tokenizer`), a ``.npy`` array of token ids, or a ``.bin`` file of
``uint16`` (the nanoGPT convention) or ``uint32`` token ids (``data.token_dtype``).

Batch ``k`` depends only on ``(seed, k)``, so a loader resumes exactly from a step
number, and each process of a multi-host run reads only its own rows of the global batch.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpar.data.tokenizer import tokenized
from jaxpar.errors import JaxparError

_NOT_STDLIB = frozenset({"site-packages", "dist-packages"})


def _sorted_py_files(folder: Path):
    """The ``.py`` paths under ``folder`` in the order of ``sorted(folder.rglob("*.py"))``
    (paths compare part by part: a folder's entries by name, each subfolder's files at its
    name's place), found as they are needed, not by walking the whole library first.
    Symlinked folders are not entered (as ``rglob`` does not); installed packages'
    folders are skipped."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        path = folder / entry.name
        if entry.name.endswith(".py"):
            yield path
        try:
            walk = entry.is_dir() and not entry.is_symlink()
        except OSError:
            walk = False
        if walk and entry.name not in _NOT_STDLIB:
            yield from _sorted_py_files(path)


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """The first ``max_bytes`` bytes of the standard library's ``.py`` files, in sorted order
    (read-only; kept for the next call)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in _sorted_py_files(root):
        if _NOT_STDLIB & set(path.parts):
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


#: Token ids scanned per step by :func:`check_token_ids`: a multi-GB memmap streams
#: through memory this many elements at a time instead of being loaded whole.
SCAN_CHUNK = 1 << 24


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (the strerror alone for an OS error)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


def _cannot_read(source: str, path: str | Path, exc: OSError) -> JaxparError:
    """The error for a file (or folder) of the data source that the OS refuses to read."""
    what = "it" if str(path) == source else repr(str(path))
    return JaxparError(f"data.source {source!r}: cannot read {what}: {_one_line(exc)}")


def _read_prefix(source: str, path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes from the start of ``path``; an OS error names the file."""
    try:
        with path.open("rb") as f:
            return f.read(limit)
    except OSError as exc:
        raise _cannot_read(source, path, exc) from None


def _folder_files(source: str, root: Path) -> list[Path]:
    """Every file under ``root``, in sorted order; an unreadable subfolder is an error."""

    def refuse(exc: OSError) -> None:
        raise _cannot_read(source, exc.filename, exc)

    files = []
    for folder, _, names in os.walk(root, onerror=refuse):
        for name in names:
            file = Path(folder, name)
            try:
                if file.is_file():  # a dangling link is skipped
                    files.append(file)
            except OSError as exc:
                raise _cannot_read(source, file, exc) from None
    files.sort()
    if not files:
        raise JaxparError(f"data.source {source!r} is a folder with no files")
    return files


def _load_npy(source: str, path: Path) -> np.ndarray:
    magic = _read_prefix(source, path, 6)
    if not magic:
        raise JaxparError(f"data.source {source!r} is empty: it has 0 bytes")
    if magic != b"\x93NUMPY":
        raise JaxparError(f"data.source {source!r}: not a .npy file (it does not start with "
                          "the .npy header b'\\x93NUMPY')")
    try:
        tokens = np.load(path, mmap_mode="r")
    except OSError as exc:
        raise _cannot_read(source, path, exc) from None
    except Exception as exc:  # a corrupt header, pickled objects, a truncated payload
        raise JaxparError(f"data.source {source!r}: not a readable .npy array of token ids "
                          f"({_one_line(exc)})") from None
    if (not isinstance(tokens, np.ndarray) or tokens.ndim != 1
            or not np.issubdtype(tokens.dtype, np.integer)):
        what = (f"{tokens.dtype} {tokens.shape}" if isinstance(tokens, np.ndarray)
                else type(tokens).__name__)
        raise JaxparError(f"data.source {source!r}: expected a 1-D integer array of token "
                          f"ids, got {what}")
    return tokens


def _load_bin(source: str, path: Path, token_dtype: str = "uint16") -> np.ndarray:
    width = np.dtype(token_dtype).itemsize
    try:
        size = path.stat().st_size
        if size % width:
            raise JaxparError(
                f"data.source {source!r}: a .bin file of {token_dtype} token ids "
                f"(data.token_dtype) has {width} bytes an id, but its size is {size} bytes: "
                "the file is truncated or of another id type")
        if size == 0:
            return np.zeros(0, dtype=token_dtype)
        return np.memmap(path, dtype=token_dtype, mode="r")
    except OSError as exc:
        raise _cannot_read(source, path, exc) from None


def load_tokens(source: str, max_bytes: int = 8_000_000, *, tokenizer: str = "",
                field: str = "text", token_dtype: str = "uint16") -> np.ndarray:
    """Token ids from ``"stdlib"``, a text file, a folder of text files, a .npy or a .bin file.

    Text (a file, or every file of a folder, in sorted order) is read as bytes, at most
    ``max_bytes`` of them; .npy and .bin files (of ``token_dtype`` ids) are memory-mapped
    whole. With a
    ``tokenizer``, text and ``.jsonl`` (the string at ``field``) are tokenized whole
    instead, through a cache (:func:`jaxpar.data.tokenizer.tokenized`).

    Raises:
      JaxparError: naming the file, for a missing, unreadable, empty or malformed source.
    """
    if source == "stdlib":
        return stdlib_corpus(max_bytes)
    path = Path(source)
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:  # a parent folder that may not be searched
        raise _cannot_read(source, path, exc) from None
    if not exists:
        raise JaxparError(f"data.source {source!r} is neither 'stdlib' nor an existing path")
    if tokenizer:
        tokens = tokenized(source, tokenizer, field=field)
    elif is_dir:
        chunks, total = [], 0
        for file in _folder_files(source, path):
            if total >= max_bytes:
                break
            chunks.append(_read_prefix(source, file, max_bytes - total))
            total += len(chunks[-1])
        tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    elif path.suffix == ".npy":
        tokens = _load_npy(source, path)
    elif path.suffix == ".bin":
        tokens = _load_bin(source, path, token_dtype)
    else:
        tokens = np.frombuffer(_read_prefix(source, path, max_bytes), dtype=np.uint8)
    if len(tokens) == 0:
        what = "holds only empty files" if is_dir else "is empty"
        raise JaxparError(f"data.source {source!r} {what}: it has 0 tokens")
    return tokens


def split_holdout(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, holdout): the last ``fraction`` of the tokens is held out."""
    if not 0.0 <= fraction < 1.0:  # also refuses NaN
        raise JaxparError(f"data.holdout_fraction={fraction!r} must be in [0, 1)")
    cut = int(len(tokens) * (1.0 - fraction))
    return tokens[:cut], tokens[cut:]


def check_token_ids(tokens: np.ndarray, vocab_size: int, *, source: str | None = None,
                    offset: int = 0, chunk: int | None = None) -> None:
    """Fail if an id of ``tokens`` is negative or ``>= vocab_size``.

    Streams the array ``chunk`` (default :data:`SCAN_CHUNK`) ids at a time, so a large
    memmap is never loaded whole; an unsigned dtype whose every value is below
    ``vocab_size`` (bytes with a 256-id vocabulary) is not scanned at all. The message
    gives the first bad id and its position (plus ``offset``: the slice's place in the file).
    """
    dtype = tokens.dtype
    unsigned = np.issubdtype(dtype, np.unsignedinteger)
    if unsigned and int(np.iinfo(dtype).max) < vocab_size:
        return
    step = chunk or SCAN_CHUNK
    for start in range(0, len(tokens), step):
        part = tokens[start:start + step]
        if int(part.max()) < vocab_size and (unsigned or int(part.min()) >= 0):
            continue
        bad = part >= vocab_size
        if not unsigned:
            bad |= part < 0
        at = int(np.argmax(bad))
        value = int(part[at])
        where = f"data.source {source!r}: " if source is not None else ""
        rule = (f"negative; ids must lie in [0, model.vocab_size={vocab_size})" if value < 0
                else f">= model.vocab_size={vocab_size}")
        raise JaxparError(f"{where}token id {value} at position {offset + start + at} "
                          f"is {rule}")


def packed(rows: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """Rows of token ids as a packed batch: ``{"tokens": rows, "segment_ids": ids}``, where
    a token's segment id counts the ``eos_id`` tokens before it in its row (an end of
    document belongs to the document it ends). The model keeps the segments apart."""
    ends = rows == eos_id
    return {"tokens": rows, "segment_ids": (np.cumsum(ends, axis=1) - ends).astype(np.int32)}


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
    eos_id: int = -1
    """With an id >= 0, batches are packed (:func:`packed`): documents end at it."""

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

    def batch(self, step: int) -> np.ndarray | dict[str, np.ndarray]:
        """This process's rows of global batch ``step``: int32 ``(local_batch, seq_len + 1)``
        (packed with ``eos_id``)."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)
        mine = starts[self.process_index * self.local_batch:(self.process_index + 1)
                      * self.local_batch]
        rows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in mine]).astype(np.int32)
        return packed(rows, self.eos_id) if self.eos_id >= 0 else rows

    def vocab_check(self, vocab_size: int, *, source: str | None = None,
                    offset: int = 0, chunk: int | None = None) -> None:
        """Fail clearly if a token id is negative or would index past the embedding table
        (every id is checked; see :func:`check_token_ids`)."""
        check_token_ids(self.tokens, vocab_size, source=source, offset=offset, chunk=chunk)
