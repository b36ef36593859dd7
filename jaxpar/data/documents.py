"""Documents by index: the text of record ``i`` of a corpus in files, read when asked.

A corpus of text at scale comes as many files in a columnar or record format. Each kind
here is a random-access table of documents (``len(docs)``, ``docs[i] -> str``), so that
:mod:`jaxpar.data.streams` can shuffle them globally and tokenize only what a batch needs:

* ``.jsonl`` (one JSON record per line; ``data.field`` names the text): the line offsets
  are found once (a scan for newlines, no parsing), lines parsed when read;
  ``.jsonl.gz`` and ``.jsonl.zst`` are decompressed into memory when first read (they
  cannot be read at an offset: for corpora larger than memory prefer the formats below);
* ``.parquet``: read a row group at a time (the last few kept), column ``data.field``;
* ``.arrow`` files and Hugging Face ``datasets`` folders (``save_to_disk``): memory-mapped;
* ``.array_record``: each record UTF-8 text, or a JSON object holding ``data.field``
  (one without it is refused, as a Parquet file without the column is).

In a bucket (``s3://``, ``gs://``; :mod:`jaxpar.storage.remote`), Parquet is read by byte
ranges a row group at a time, ``.jsonl`` (plain or compressed) and Arrow files are read
whole into memory; ArrayRecord files must be local.

:func:`open_documents` expands a glob, a folder or a file into one table over its files.
"""

from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.errors import JaxparError
from jaxpar.storage.remote import filesystem, is_remote, read_object, remote_files

DOCUMENT_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet",
                                      ".arrow", ".array_record")
"""The file kinds read as documents."""
HF_DATASET_FILES = ("dataset_info.json", "state.json")
"""Files that mark a Hugging Face ``datasets`` folder (``Dataset.save_to_disk``)."""


def is_hf_dataset(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by ``datasets.Dataset.save_to_disk``."""
    return Path(path).is_dir() and all((Path(path) / f).is_file() for f in HF_DATASET_FILES)


STREAMED_ONLY: tuple[str, ...] = (".jsonl.zst", ".parquet", ".arrow", ".array_record")
"""Kinds only the document loader reads: a single ``.jsonl``(``.gz``) file or a folder of
them is small local input, tokenized up front as before (:mod:`jaxpar.data.tokenizer`)."""


def names_documents(spec: str) -> bool:
    """Whether ``spec`` names documents to tokenize as read: a glob of document files, a
    Hugging Face ``datasets`` folder, or a file or folder of a kind in
    :data:`STREAMED_ONLY`."""
    if is_remote(spec):  # a bucket holds no up-front cache: its documents stream
        return spec.rstrip("/").endswith(DOCUMENT_SUFFIXES)
    if is_hf_dataset(spec):
        return True
    if any(c in spec for c in "*?["):
        return spec.endswith(DOCUMENT_SUFFIXES) or any(
            p.endswith(DOCUMENT_SUFFIXES) for p in glob.glob(spec, recursive=True)[:1])
    if Path(spec).is_dir():
        return any(p.name.endswith(STREAMED_ONLY) for p in Path(spec).rglob("*"))
    return spec.endswith(STREAMED_ONLY)


def uses_documents(source: str, sources: Sequence[Any], tokenizer: str) -> bool:
    """Whether a data config reads documents tokenized as read: a tokenizer, and
    ``data.sources`` or a ``data.source`` that :func:`names_documents`."""
    if not tokenizer:
        return False
    return bool(sources) or names_documents(source)


def _record_text(record: Any, field: str, where: str) -> str:
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        what = (f"the record has no data.field={field!r}" if text is None else
                f"data.field={field!r} is a {type(text).__name__}, not text")
        raise JaxparError(f"{where}: {what}")
    return text


def _column_text(text: Any, source: str, index: int, field: str) -> str:
    """A table cell that must be a document's text (one line naming the row otherwise)."""
    if not isinstance(text, str):
        raise JaxparError(f"data source {source!r}: row {index}: data.field={field!r} is "
                          f"{type(text).__name__}, not text")
    return text


class JsonlDocuments:
    """The lines of a ``.jsonl`` file (or a decompressed ``.jsonl.gz``/``.jsonl.zst``)."""

    def __init__(self, path: Path, field: str):
        self.path, self.field = path, field
        data = self._bytes()
        ends = np.flatnonzero(data == ord("\n"))
        if len(data) and data[-1] != ord("\n"):
            ends = np.append(ends, len(data))
        starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros(0, np.int64)
        keep = (ends - starts) > 0  # blank lines hold no document
        self._starts, self._ends = starts[keep], ends[keep]
        self._numbers = np.flatnonzero(keep) + 1  # line numbers, for messages
        self._data = data  # a memory map, or a compressed file's bytes (kept in memory)

    def _bytes(self) -> np.ndarray:
        name = str(self.path).rsplit("/", 1)[-1]
        try:
            if is_remote(self.path):  # read whole: a line index needs every byte
                raw = read_object(str(self.path), "data source")
                if name.endswith(".gz"):
                    raw = gzip.decompress(raw)
                if not name.endswith(".zst"):
                    return np.frombuffer(raw, np.uint8)
            if name.endswith(".gz"):
                with gzip.open(self.path, "rb") as f:
                    return np.frombuffer(f.read(), np.uint8)
            if name.endswith(".zst"):
                import zstandard

                rest = raw if is_remote(self.path) else self.path.read_bytes()
                parts = []
                while rest:  # frame by frame: a truncated one is an error, not an end
                    frame = zstandard.ZstdDecompressor().decompressobj()
                    parts.append(frame.decompress(rest))
                    if not frame.eof:
                        raise ValueError("the last frame is cut short")
                    rest = frame.unused_data
                return np.frombuffer(b"".join(parts), np.uint8)
            return np.memmap(self.path, np.uint8, mode="r") if self.path.stat().st_size else (
                np.zeros(0, np.uint8))
        except (OSError, EOFError) as exc:
            raise JaxparError(f"data source {str(self.path)!r}: cannot read it: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
        except Exception as exc:  # zstandard.ZstdError has no common base with the above
            raise JaxparError(f"data source {str(self.path)!r}: not a whole compressed "
                              f"file ({exc})") from None

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> str:
        line = bytes(self._data[self._starts[index]:self._ends[index]])
        where = f"data source {str(self.path)!r}: line {self._numbers[index]}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise JaxparError(f"{where}: not JSON ({exc})") from None
        return _record_text(record, self.field, where)


class ParquetDocuments:
    """Column ``field`` of a Parquet file, read a row group at a time."""

    KEEP = 4

    def __init__(self, path: Path, field: str):
        import pyarrow.parquet as pq

        self.path, self.field = path, field
        try:
            source = (filesystem(str(path), "data source").open(str(path), "rb")
                      if is_remote(path) else path)  # read by ranges, a row group at a time
            self._file = pq.ParquetFile(source)
        except Exception as exc:  # pyarrow.ArrowInvalid and OSError
            raise JaxparError(f"data source {str(path)!r}: not a readable Parquet file "
                              f"({exc})") from None
        if field not in self._file.schema_arrow.names:
            raise JaxparError(f"data source {str(path)!r}: no column data.field={field!r} "
                              f"(columns: {self._file.schema_arrow.names})")
        meta = self._file.metadata
        self._ends = np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
                               ).tolist()
        self._groups: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._ends[-1]) if self._ends else 0

    def __getitem__(self, index: int) -> str:
        group = bisect.bisect_right(self._ends, index)
        with self._lock:
            if group not in self._groups:
                self._groups[group] = self._file.read_row_group(
                    group, columns=[self.field]).column(0).to_pylist()
                while len(self._groups) > self.KEEP:
                    self._groups.popitem(last=False)
            rows = self._groups[group]
        return _column_text(rows[index - (self._ends[group - 1] if group else 0)],
                            str(self.path), index, self.field)


class ArrowDocuments:
    """Column ``field`` of memory-mapped Arrow files (a ``datasets`` folder's shards)."""

    def __init__(self, paths: Sequence[Path], field: str, name: str):
        import pyarrow as pa

        self.name, self.field = name, field
        tables = []
        for path in paths:
            try:
                source = (pa.py_buffer(read_object(str(path), "data source")) if is_remote(path)
                          else pa.memory_map(str(path)))
                try:
                    table = pa.ipc.open_stream(source).read_all()
                except pa.ArrowInvalid:  # the file format rather than the stream format
                    table = pa.ipc.open_file(source).read_all()
            except Exception as exc:
                raise JaxparError(f"data source {str(path)!r}: not a readable Arrow file "
                                  f"({exc})") from None
            if field not in table.column_names:
                raise JaxparError(f"data source {name!r}: no column data.field={field!r} "
                                  f"(columns: {table.column_names})")
            tables.append(table.column(field))
        self._columns = tables
        self._ends = np.cumsum([len(c) for c in tables]).tolist()

    def __len__(self) -> int:
        return int(self._ends[-1]) if self._ends else 0

    def __getitem__(self, index: int) -> str:
        part = bisect.bisect_right(self._ends, index)
        return _column_text(
            self._columns[part][index - (self._ends[part - 1] if part else 0)].as_py(),
            self.name, index, self.field)


class ArrayRecordDocuments:
    """Records of ``.array_record`` files: UTF-8 text, or JSON objects holding ``field``."""

    def __init__(self, paths: Sequence[Path], field: str, name: str):
        from array_record.python.array_record_data_source import ArrayRecordDataSource

        self.name, self.field = name, field
        remote = [str(p) for p in paths if is_remote(p)]
        if remote:
            raise JaxparError(f"data source {remote[0]!r}: ArrayRecord files are read from "
                              "local (or mounted) storage; copy them there, or use Parquet "
                              "or jsonl in the bucket")
        try:
            self._source = ArrayRecordDataSource([str(p) for p in paths])
        except Exception as exc:
            raise JaxparError(f"data source {name!r}: not readable ArrayRecord files "
                              f"({exc})") from None

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> str:
        raw = self._source[index]
        where = f"data source {self.name!r}: record {index}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise JaxparError(f"{where}: not UTF-8") from None
        if text.startswith("{"):
            try:
                record = json.loads(text)
            except ValueError:
                return text  # text that happens to start with a brace
            if isinstance(record, dict):  # a JSON object: its text is at data.field
                return _record_text(record, self.field, where)
        return text


class Documents:
    """Several tables as one: document ``i`` of their concatenation."""

    def __init__(self, tables: Sequence[Any], name: str):
        self.tables, self.name = [t for t in tables if len(t)], name
        self._ends = np.cumsum([len(t) for t in self.tables]).tolist()
        if not self._ends:
            raise JaxparError(f"data source {name!r} holds no document")

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, index: int) -> str:
        index = int(index)
        part = bisect.bisect_right(self._ends, index)
        return self.tables[part][index - (self._ends[part - 1] if part else 0)]


def document_files(spec: str) -> list[Path] | list[str]:
    """The document files ``spec`` names, sorted (a glob's matches, a folder's files of
    :data:`DOCUMENT_SUFFIXES`, a Hugging Face folder's Arrow shards, or one file).

    Raises:
      JaxparError: when nothing matches or a file is of no kind read here.
    """
    if is_remote(spec):
        return remote_files(spec, DOCUMENT_SUFFIXES, "data source")
    root = Path(spec)
    if is_hf_dataset(spec):
        try:
            state = json.loads((root / "state.json").read_text())
            files = [root / f["filename"] for f in state["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise JaxparError(f"data source {spec!r}: unreadable datasets state.json "
                              f"({exc})") from None
    elif any(c in spec for c in "*?["):
        files = [Path(p) for p in sorted(glob.glob(spec, recursive=True)) if Path(p).is_file()]
        if not files:
            raise JaxparError(f"data source {spec!r}: the pattern matches no file")
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file()
                       and p.name.endswith(DOCUMENT_SUFFIXES))
        if not files:
            raise JaxparError(f"data source {spec!r}: the folder holds no document file "
                              f"({', '.join(DOCUMENT_SUFFIXES)})")
    elif root.is_file():
        files = [root]
    else:
        raise JaxparError(f"data source {spec!r} does not exist")
    odd = [str(f) for f in files if not f.name.endswith(DOCUMENT_SUFFIXES)]
    if odd:
        raise JaxparError(f"data source {spec!r}: {odd[0]} is not a document file "
                          f"({', '.join(DOCUMENT_SUFFIXES)})")
    return files


def _name(file: Path | str) -> str:
    return str(file).rsplit("/", 1)[-1]


def open_documents(spec: str, field: str = "text") -> Documents:
    """All documents of ``spec`` (see :func:`document_files`): its ``.jsonl`` and Parquet
    files in order, then its Arrow files, then its ArrayRecord files."""
    files = document_files(spec)
    tables: list[Any] = []
    arrow = [f for f in files if _name(f).endswith(".arrow")]
    records = [f for f in files if _name(f).endswith(".array_record")]
    for file in files:
        if _name(file).endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
            tables.append(JsonlDocuments(file, field))
        elif _name(file).endswith(".parquet"):
            tables.append(ParquetDocuments(file, field))
    if arrow:
        tables.append(ArrowDocuments(arrow, field, spec))
    if records:
        tables.append(ArrayRecordDocuments(records, field, spec))
    return Documents(tables, spec)
