"""Real text through a Hugging Face ``tokenizers`` tokenizer, tokenized once and cached.

``data.tokenizer`` is a ``tokenizer.json`` file or a folder holding one. ``data.source`` is
a text file, a ``.jsonl`` file (a document per line: the string at ``data.field``) or a
folder of such files (recursively, sorted, hidden ones skipped); a text file is one
document. Each document is encoded without special tokens, followed by the EOS id, and
the documents are packed end to end into one stream of ids.

The cache is ``.jaxpar-tokens/<name>-<key>.npy`` beside the source ``<name>`` (in the
folder that holds it): ``uint16`` ids when the vocabulary fits, else ``uint32``, memory-mapped
read-only on later runs. ``<key>`` hashes :data:`FORMAT`, the tokenizer.json bytes, the EOS
id, ``data.field`` and every data file's relative path, size and mtime, so changing or
touching a data file or the tokenizer tokenizes again. A cache is written to a temporary
file and renamed into place (never half-written, even by concurrent runs); after a new one
is written, the source's caches under other keys are deleted.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from jaxpar.errors import JaxparError

FORMAT = "jaxpar-tokens-1"
"""Cache format version: part of every cache key, so changing it retires old caches."""

CACHE_DIR = ".jaxpar-tokens"
"""The hidden folder, beside the data, that holds the caches."""

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")
"""EOS tokens tried in order when no ``tokenizer_config.json`` names one."""

BATCH_CHARS = 1 << 22
"""Characters of text collected before one ``encode_batch`` call (encoded in parallel)."""


def tokenizer_json(spec: str) -> Path:
    path = Path(spec).expanduser()
    return path / "tokenizer.json" if path.is_dir() else path


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer in ``spec``: a ``tokenizer.json`` file or a folder holding one.

    Raises:
      JaxparError: naming ``data.tokenizer`` when it is missing, unreadable or invalid."""
    path = tokenizer_json(spec)
    if not path.is_file():
        raise JaxparError(f"data.tokenizer={spec!r}: is neither a tokenizer.json file nor "
                          "a folder holding one")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # an OSError, invalid JSON, an unknown model type
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise JaxparError(f"data.tokenizer={spec!r}: cannot load {str(path)!r}: {why}") from None


def vocab_size(tokenizer: Tokenizer) -> int:
    """One past the largest token id (added tokens included): the embedding rows needed."""
    return max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def token_dtype(vocab: int) -> np.dtype:
    """``uint16`` when every id of a ``vocab``-token vocabulary fits in it, else ``uint32``."""
    return np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)


def eos_id(tokenizer: Tokenizer, folder: str | Path | None = None) -> int:
    """The end-of-document id: ``eos_token`` of ``folder/tokenizer_config.json`` when there
    is one, else the first of :data:`EOS_CANDIDATES` in the vocabulary.

    Raises:
      JaxparError: when the named or any usual EOS token is not in the vocabulary."""
    config = Path(folder or ".", "tokenizer_config.json")
    if folder is not None and config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
        except (OSError, ValueError, AttributeError) as exc:
            raise JaxparError(f"data.tokenizer: cannot read eos_token from {str(config)!r}: "
                              f"{' '.join(str(exc).split())}") from None
        eos = eos.get("content") if isinstance(eos, dict) else eos  # a serialised AddedToken
        if isinstance(eos, str):
            found = tokenizer.token_to_id(eos)
            if found is None:
                raise JaxparError(f"data.tokenizer: eos_token {eos!r} of {str(config)!r} is "
                                  "not in the tokenizer's vocabulary")
            return found
    found = [i for t in EOS_CANDIDATES if (i := tokenizer.token_to_id(t)) is not None]
    if found:
        return found[0]
    raise JaxparError("data.tokenizer: no end-of-document token: none of "
                      f"{', '.join(EOS_CANDIDATES)} is in the vocabulary and no "
                      "tokenizer_config.json names an eos_token")


def unknown_pieces(tokenizer: Tokenizer, text: str) -> tuple[list[str], list[str]]:
    """What ``tokenizer`` has no token for in ``text``: the pieces it encodes as its
    unknown token (a word for a word-level tokenizer, a character for most others), and
    the characters, other than white space, it encodes as nothing at all (dropped, as a
    BPE tokenizer without an unknown token does). Each is listed once, in order."""
    encoding = tokenizer.encode(text, add_special_tokens=False)
    unk_token = getattr(tokenizer.model, "unk_token", None)
    unk = tokenizer.token_to_id(unk_token) if unk_token else None
    unknown = [text[start:end] for token_id, token, (start, end)
               in zip(encoding.ids, encoding.tokens, encoding.offsets, strict=True)
               # A Unigram model's unknown id keeps the text as its token string.
               if token_id == unk or tokenizer.id_to_token(token_id) != token]
    chars = [c for c in dict.fromkeys(text) if not c.isspace()]
    alone = tokenizer.encode_batch(chars, add_special_tokens=False) if chars else []
    dropped = [c for c, e in zip(chars, alone, strict=True) if not e.ids]
    return list(dict.fromkeys(p for p in unknown if p)), dropped


def data_files(source: str) -> list[Path]:
    """The files of ``source`` (itself, or a folder's files recursively, sorted, without
    hidden files, hidden folders or jaxpar's caches)."""
    root = Path(source)
    if not root.is_dir():
        return [root]
    files = [p for p in root.rglob("*")
             if p.is_file() and not any(part.startswith(".")
                                        for part in p.relative_to(root).parts)]
    if not files:
        raise JaxparError(f"data.source {source!r} is a folder with no (visible) files")
    return sorted(files)


def is_jsonl(file: Path) -> bool:
    """Whether ``file`` holds a JSON record per line (``.jsonl``, or ``.jsonl.gz``)."""
    return file.name.endswith((".jsonl", ".jsonl.gz"))


def _open_text(file: Path):
    """``file`` opened as UTF-8 text, gunzipped on the fly when it ends in ``.gz``."""
    if file.suffix == ".gz":
        return gzip.open(file, "rt", encoding="utf-8")
    return file.open(encoding="utf-8")


def documents(source: str, files: list[Path], field: str) -> Iterator[tuple[str, int]]:
    """(text, bytes read) per document: whole text files, ``.jsonl`` (or ``.jsonl.gz``)
    lines ('' if blank)."""
    for file in files:
        try:
            if not is_jsonl(file):
                with _open_text(file) as f:
                    yield f.read(), file.stat().st_size
                continue
            with _open_text(file) as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        yield "", len(line.encode())
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as exc:
                        raise JaxparError(f"data.source {source!r}: {file}:{number}: not "
                                          f"JSON ({exc})") from None
                    text = record.get(field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        what = (f"the record has no data.field={field!r}" if text is None else
                                f"data.field={field!r} is a {type(text).__name__}, not text")
                        raise JaxparError(f"data.source {source!r}: {file}:{number}: {what}")
                    yield text, len(line.encode())
        except UnicodeDecodeError:
            raise JaxparError(f"data.source {source!r}: {str(file)!r} is not UTF-8") from None
        except (gzip.BadGzipFile, EOFError) as exc:
            raise JaxparError(f"data.source {source!r}: {str(file)!r} is not a whole gzip "
                              f"file ({exc})") from None
        except OSError as exc:
            raise JaxparError(f"data.source {source!r}: cannot read {str(file)!r}: "
                              f"{exc.strerror or exc}") from None


def _encode(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each text, without special tokens (in parallel, by the Rust library)."""
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def cache_key(tokenizer_json: Path, eos: int, field: str, source: str, files: list[Path]) -> str:
    """16 hex digits naming one tokenization of ``files`` (see the module docstring)."""
    digest = hashlib.sha256(f"{FORMAT}\0{eos}\0{field}\0".encode())
    digest.update(tokenizer_json.read_bytes())
    root = Path(source)
    for file, stat in ((f, f.stat()) for f in files):
        rel = file.relative_to(root) if root.is_dir() else file.name
        digest.update(f"\0{rel}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def _write_cache(path: Path, chunks: Iterator[np.ndarray], dtype: np.dtype) -> int:
    """Stream ``chunks`` into the .npy ``path`` atomically (a temp file, then a rename) and
    return how many ids it holds; with none, nothing is written."""
    raw, tmp = (path.with_name(f"{path.stem}.{os.getpid()}-{id(chunks)}.{ext}")
                for ext in ("raw", "tmp"))
    try:
        count = 0
        with open(raw, "wb") as out:
            for chunk in chunks:
                out.write(chunk.astype(dtype, copy=False).tobytes())
                count += len(chunk)
        with open(tmp, "wb") as out, open(raw, "rb") as data:
            np.lib.format.write_array_header_1_0(out, {
                "descr": dtype.str, "fortran_order": False, "shape": (count,)})
            shutil.copyfileobj(data, out, 1 << 24)
        if count:
            os.replace(tmp, path)
        return count
    finally:
        raw.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def encoded_stream(tokenizer: Tokenizer, eos: int, dtype: np.dtype, bar: tqdm,
            documents: Iterator[tuple[str, int]]) -> Iterator[np.ndarray]:
    """The ids of ``documents``, each followed by ``eos``, an array per encoded batch of
    about :data:`BATCH_CHARS` characters; ``bar`` advances by the bytes read."""
    texts, size, done = [], 0, 0
    for text, nbytes in itertools.chain(documents, [("", -1)]):
        if text:
            texts.append(text)
            size += len(text)
        done += max(nbytes, 0)
        if texts and (size >= BATCH_CHARS or nbytes < 0):
            flat: list[int] = []
            for ids in _encode(tokenizer, texts):
                flat += ids
                flat.append(eos)
            yield np.array(flat, dtype=dtype)
            texts, size = [], 0
        bar.update(done - bar.n)


def tokenized(source: str, tokenizer_spec: str, *, field: str = "text",
              progress: bool = True) -> np.ndarray:
    """The token ids of ``source`` under ``tokenizer_spec``: a read-only memmap of the
    cache, written first when there is none for this tokenizer and data.

    Raises:
      JaxparError: for a bad tokenizer, an unreadable or non-UTF-8 file, a JSONL record
        without a ``field`` string (naming file and line), no text, an unwritable cache."""
    tokenizer = load_tokenizer(tokenizer_spec)
    json_path = tokenizer_json(tokenizer_spec)
    eos = eos_id(tokenizer, json_path.parent)
    dtype = token_dtype(vocab_size(tokenizer))
    files = data_files(source)
    root = Path(source).resolve()
    folder = root.parent / CACHE_DIR
    try:
        key = cache_key(json_path, eos, field, source, files)
        total = sum(f.stat().st_size for f in files)
    except OSError as exc:
        raise JaxparError(f"data.source {source!r}: cannot read {exc.filename!r}: "
                          f"{exc.strerror or exc}") from None
    cache = folder / f"{root.name}-{key}.npy"
    if not cache.is_file():
        try:
            folder.mkdir(exist_ok=True)
            with tqdm(total=total, desc="tokenize", unit="B", unit_scale=True,
                      disable=None if progress else True, dynamic_ncols=True) as bar:
                ids = encoded_stream(tokenizer, eos, dtype, bar, documents(source, files, field))
                count = _write_cache(cache, ids, dtype)
        except OSError as exc:
            raise JaxparError(f"data.source {source!r}: cannot write the token cache in "
                              f"{str(folder)!r}: {exc.strerror or exc}") from None
        if count == 0:
            raise JaxparError(f"data.source {source!r} holds no text: it has 0 tokens")
        stale = re.compile(re.escape(root.name) + r"-[0-9a-f]{16}\.npy")
        for old in folder.iterdir():
            if old != cache and stale.fullmatch(old.name):
                old.unlink(missing_ok=True)
    return np.load(cache, mmap_mode="r")
