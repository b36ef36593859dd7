"""Token shards: many ``.bin`` or ``.npy`` files of token ids, cut into training windows.

A corpus at scale comes as shards (``train-00000.bin`` ...), often from several sources.
:func:`shard_paths` expands what a config names (a glob such as ``data/*.bin``, a folder
of shards, one file) into a sorted list; each shard is memory-mapped, never read whole.
:class:`Windows` cuts every shard into windows of ``seq_len + 1`` ids at a stride of
``seq_len`` (consecutive windows share one id: the last target of one is the first input
of the next), never across two shards, and serves them by index: it is a random-access
source for :mod:`jaxpar.data.mixture`, which shuffles and mixes them.

``.bin`` shards hold raw ids of ``data.token_dtype`` (``uint16``, the nanoGPT convention,
or ``uint32`` for vocabularies past 65,536); ``.npy`` shards carry their dtype. Shards
``jaxpar tokenize`` wrote carry their id type, EOS id and vocabulary in the
``tokenize.json`` beside them: :func:`check_shards` refuses a ``data.token_dtype``,
``data.eos_id`` or ``model.vocab_size`` that disagrees (the config is never overridden
silently), and a manifest of an interrupted ``jaxpar tokenize``. Raw ``.bin`` shards
without one are checked in their first window: ids read as the wrong width show as every
other id 0, or as ids past the vocabulary that the other width keeps within it.
"""

from __future__ import annotations

import bisect
import glob
import json
from pathlib import Path

import numpy as np

from jaxpar.data.loader import check_token_ids
from jaxpar.errors import JaxparError
from jaxpar.storage.remote import RemoteTokens, is_remote, read_object, remote_files

TOKEN_DTYPES: tuple[str, ...] = ("uint16", "uint32")
SHARD_SUFFIXES: tuple[str, ...] = (".bin", ".npy")


def is_pattern(spec: str) -> bool:
    """Whether ``spec`` is a glob pattern rather than a path."""
    return any(c in spec for c in "*?[")


MANIFEST = "tokenize.json"
"""What ``jaxpar tokenize`` writes beside the shards it makes (tokenizer, EOS id, id type,
each shard's documents and tokens)."""


def names_shards(spec: str) -> bool:
    """Whether ``data.source`` names token shards: a glob, a folder whose visible files
    are all ``.bin``/``.npy`` (at least one; the ``tokenize.json`` manifest ``jaxpar
    tokenize`` writes beside them aside), or anything in object storage (``s3://``,
    ``gs://``: a bucket holds token shards)."""
    if is_pattern(spec) or is_remote(spec):
        return True
    path = Path(spec)
    if not path.is_dir():
        return False
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
             and p.name != MANIFEST]
    return bool(files) and all(p.suffix in SHARD_SUFFIXES for p in files)


def shard_paths(spec: str) -> list[Path | str]:
    """The shards ``spec`` names, sorted: the files a glob matches, the ``.bin``/``.npy``
    files of a folder, or one file; URLs for shards in object storage.

    Raises:
      JaxparError: when nothing matches, or a match is not a ``.bin`` or ``.npy`` file.
    """
    if is_remote(spec):
        paths = remote_files(spec, SHARD_SUFFIXES, "data source")
        odd = [p for p in paths if not p.endswith(SHARD_SUFFIXES)]
        if odd:
            raise JaxparError(f"data source {spec!r}: {odd[0]} is not a token shard (.bin "
                              "or .npy)")
        return paths
    if is_pattern(spec):
        paths = [Path(p) for p in sorted(glob.glob(spec, recursive=True))]
        if not paths:
            raise JaxparError(f"data source {spec!r}: the pattern matches no file")
    else:
        path = Path(spec)
        if path.is_dir():
            paths = sorted(p for p in path.rglob("*") if p.suffix in SHARD_SUFFIXES
                           and p.is_file())
            if not paths:
                raise JaxparError(f"data source {spec!r}: the folder holds no .bin or .npy "
                                  "shard")
        elif path.exists():
            paths = [path]
        else:
            raise JaxparError(f"data source {spec!r} does not exist")
    odd = [str(p) for p in paths if p.suffix not in SHARD_SUFFIXES]
    if odd:
        raise JaxparError(f"data source {spec!r}: {odd[0]} is not a token shard (.bin or "
                          ".npy)")
    return paths


def open_shard(path: Path | str, token_dtype: str = "uint16") -> np.ndarray | RemoteTokens:
    """A shard's ids as a read-only memory map (1-D); a shard in object storage as a
    :class:`~jaxpar.storage.remote.RemoteTokens` (read by byte ranges).

    Raises:
      JaxparError: naming the file, for a size that is not whole ids, a ``.npy`` that is
        not a 1-D integer array, or an unreadable file.
    """
    if token_dtype not in TOKEN_DTYPES:
        raise JaxparError(f"data.token_dtype={token_dtype!r}: choose one of "
                          f"{list(TOKEN_DTYPES)}")
    if is_remote(path):
        return RemoteTokens.open(str(path), token_dtype)
    path = Path(path)
    try:
        if path.suffix == ".npy":
            ids = np.load(path, mmap_mode="r")
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise JaxparError(f"shard {str(path)!r}: expected a 1-D integer array of "
                                  f"token ids, got {ids.dtype} {ids.shape}")
            return ids
        size, width = path.stat().st_size, np.dtype(token_dtype).itemsize
        if size % width:
            raise JaxparError(f"shard {str(path)!r}: {size} bytes is not a whole number of "
                              f"{token_dtype} ids ({width} bytes each): truncated, or set "
                              f"data.token_dtype")
        if size == 0:
            return np.zeros(0, token_dtype)
        return np.memmap(path, dtype=token_dtype, mode="r")
    except OSError as exc:
        raise JaxparError(f"shard {str(path)!r}: cannot read it: {exc.strerror or exc}"
                          ) from None
    except ValueError as exc:  # a corrupt .npy header
        raise JaxparError(f"shard {str(path)!r}: not a readable .npy array ({exc})") from None


class Windows:
    """Windows of ``seq_len + 1`` token ids over shards, by index (a random-access source).

    With ``part`` ``(start, stop)``, fractions of each shard's windows: ``(0, 0.95)`` for
    training and ``(0.95, 1)`` for a held-out tail.
    """

    def __init__(self, shards: list[np.ndarray | RemoteTokens], seq_len: int, *, name: str = "",
                 part: tuple[float, float] = (0.0, 1.0)):
        self.shards, self.seq_len, self.name = shards, seq_len, name
        self._vocab_size: int | None = None  # remote shards' ids are checked as read
        self._first: list[int] = []  # each shard's first window (in the shard)
        counts = []
        for ids in shards:
            n = max((len(ids) - 1) // seq_len, 0)
            lo, hi = int(n * part[0]), int(n * part[1])
            self._first.append(lo)
            counts.append(hi - lo)
        self._ends = np.cumsum(counts).tolist()
        if not self._ends or self._ends[-1] == 0:
            raise JaxparError(f"data source {name!r}: its shards hold no window of "
                              f"train.seq_len + 1 = {seq_len + 1} tokens"
                              f"{' in this part' if part != (0.0, 1.0) else ''}")

    def __len__(self) -> int:
        return int(self._ends[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        shard = bisect.bisect_right(self._ends, index)
        local = index - (self._ends[shard - 1] if shard else 0) + self._first[shard]
        start = local * self.seq_len
        ids = self.shards[shard][start:start + self.seq_len + 1]
        if self._vocab_size is not None and isinstance(self.shards[shard], RemoteTokens):
            check_token_ids(ids, self._vocab_size, source=self.shards[shard].filename,
                            offset=start)
        return np.asarray(ids, np.int32)

    def check_ids(self, vocab_size: int) -> None:
        """Fail in one line, naming the shard, if an id is ``>= vocab_size`` (every shard
        scanned in chunks; see :func:`jaxpar.data.loader.check_token_ids`). A shard in
        object storage is checked as it is read, not downloaded whole up front."""
        for ids in self.shards:
            if isinstance(ids, RemoteTokens):
                self._vocab_size = vocab_size  # checked in __getitem__
                continue
            check_token_ids(ids, vocab_size, source=str(getattr(ids, "filename", None)
                                                        or self.name))


def read_manifest(folder: Path | str) -> dict | None:
    """The ``tokenize.json`` in ``folder``, local or in a bucket (None when there is none
    or it is unreadable)."""
    try:
        if is_remote(folder):
            manifest = json.loads(read_object(f"{str(folder).rstrip('/')}/{MANIFEST}",
                                              "data source"))
        else:
            manifest = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):  # a JaxparError (no such object) is a ValueError
        return None
    return manifest if isinstance(manifest, dict) else None


HEAD_IDS = 4096
"""Ids of a raw shard's start that :func:`check_shards` looks at for a wrong id width."""


def _width_mismatch(path: Path, token_dtype: str, vocab_size: int
                    ) -> tuple[str, str] | None:
    """The id type a raw ``.bin`` shard's first ids say it has, when not ``token_dtype``,
    and why."""
    try:
        with path.open("rb") as f:
            head = f.read(HEAD_IDS * 4)
    except OSError:
        return None  # open_shard names the file
    head = head[:len(head) // 4 * 4]
    if len(head) < 64:
        return None
    as16, as32 = np.frombuffer(head, "<u2"), np.frombuffer(head, "<u4")
    if token_dtype == "uint16":
        if not as16[1::2].any() and as16[0::2].any():
            return "uint32", "uint16 are every other one 0"
        if as16.max() >= vocab_size > as32.max():
            return "uint32", f"uint16 pass model.vocab_size={vocab_size}"
    elif as32.max() >= vocab_size > as16.max():
        return "uint16", f"uint32 pass model.vocab_size={vocab_size}"
    return None


def check_shards(paths: list[Path | str], token_dtype: str, eos_id: int, vocab_size: int,
                 source: str) -> None:
    """Refuse, in one line naming the setting, shards the config would misread: a
    ``tokenize.json`` beside them that records another ``token_dtype``, an ``eos_id`` other
    than ``data.eos_id`` (when set), a vocabulary larger than ``model.vocab_size``, or an
    interrupted run; raw ``.bin`` shards whose first ids look like the other width (local
    ones: in a bucket, ids are checked as they are read)."""
    manifests: dict[str, dict | None] = {}
    for path in paths:
        folder, _, name = str(path).rpartition("/")
        if folder not in manifests:
            manifests[folder] = read_manifest(folder or ".")
        manifest = manifests[folder]
        listed = manifest is not None and name in {
            s.get("shard") for s in manifest.get("shards", []) if isinstance(s, dict)}
        where, recorded = f"data source {source!r}", f"{folder or '.'}/{MANIFEST}"
        if manifest is not None and manifest.get("complete") is False:
            raise JaxparError(f"{where}: {folder or '.'!r} holds the shards of an interrupted "
                              "jaxpar tokenize (its tokenize.json is unfinished): run it "
                              "again with the same --out to rewrite them")
        if listed:
            want = manifest.get("token_dtype")
            if name.endswith(".bin") and want in TOKEN_DTYPES and want != token_dtype:
                raise JaxparError(f"{where}: {recorded!r} says its shards hold "
                                  f"{want} ids, but data.token_dtype={token_dtype}: set "
                                  f"data.token_dtype={want}")
            eos = manifest.get("eos_id")
            if eos_id >= 0 and isinstance(eos, int) and eos != eos_id:
                raise JaxparError(f"{where}: {recorded!r} says its documents "
                                  f"end with id {eos}, but data.eos_id={eos_id}: set "
                                  f"data.eos_id={eos} (or -1: rows across documents)")
            vocab = manifest.get("vocab_size")
            if isinstance(vocab, int) and vocab > vocab_size:
                raise JaxparError(f"{where}: {recorded!r} says its tokenizer "
                                  f"has {vocab} ids, but model.vocab_size={vocab_size}: set "
                                  f"model.vocab_size={vocab} or more")
        elif name.endswith(".bin") and not is_remote(path):
            found = _width_mismatch(Path(path), token_dtype, vocab_size)
            if found:
                raise JaxparError(f"{where}: shard {str(path)!r} holds {found[0]} ids, not "
                                  f"data.token_dtype={token_dtype} (its first ids as "
                                  f"{found[1]}): set data.token_dtype={found[0]}")
