import os
import pathlib
import re

import numpy as np
import pytest

import jaxpar
import jaxpar.data.loader
from jaxpar import JaxparError
from jaxpar.data.loader import (
    TokenLoader,
    check_token_ids,
    load_tokens,
    split_holdout,
    stdlib_corpus,
)
from jaxpar.runs.loop import make_loader


def test_stdlib_corpus_is_bytes_and_deterministic():
    a, b = stdlib_corpus(100_000), stdlib_corpus(100_000)
    assert a.dtype == np.uint8 and len(a) == 100_000
    np.testing.assert_array_equal(a, b)
    assert b"def " in a.tobytes()


def test_batches_depend_only_on_seed_and_step():
    tokens = stdlib_corpus(50_000)
    one, two = TokenLoader(tokens, 8, 16, seed=3), TokenLoader(tokens, 8, 16, seed=3)
    np.testing.assert_array_equal(one.batch(5), two.batch(5))
    assert one.batch(5).shape == (8, 17) and one.batch(5).dtype == np.int32
    assert not np.array_equal(one.batch(5), one.batch(6))


def test_processes_split_the_global_batch():
    tokens = stdlib_corpus(50_000)
    whole = TokenLoader(tokens, 8, 16, seed=1).batch(2)
    parts = [TokenLoader(tokens, 8, 16, seed=1, process_index=i, process_count=2).batch(2)
             for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_user_files(tmp_path):
    ids = np.arange(1000, dtype=np.int32) % 300
    np.save(tmp_path / "t.npy", ids)
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "t.npy")), ids)
    ids.astype(np.uint16).tofile(tmp_path / "t.bin")
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "t.bin")), ids)
    with pytest.raises(JaxparError, match="id 256 at position 256 is >= model.vocab_size=256"):
        TokenLoader(load_tokens(str(tmp_path / "t.npy")), 2, 8).vocab_check(256)
    with pytest.raises(JaxparError, match="neither 'stdlib' nor an existing path"):
        load_tokens(str(tmp_path / "missing"))


def test_holdout_split():
    train, held = split_holdout(np.arange(100), 0.1)
    assert len(train) == 90 and held[0] == 90


def test_holdout_loader_is_the_tail_and_too_small_a_holdout_is_named():
    cfg = jaxpar.load_config(None, ["data.max_bytes=100000", "train.seq_len=32",
                                    "train.global_batch=4", "data.holdout_fraction=0.1"])
    train, held = make_loader(cfg), make_loader(cfg, holdout=True)
    assert len(train.tokens) + len(held.tokens) == 100000 and len(held.tokens) == 10000
    assert held.batch(0).shape == (4, 33) and not np.array_equal(held.batch(0), train.batch(0))
    empty = jaxpar.load_config(None, ["data.max_bytes=100000", "data.holdout_fraction=0.0",
                                      "train.eval_every=5"])
    with pytest.raises(JaxparError, match="held-out part has 0 tokens"):
        make_loader(empty, holdout=True)


# --- bad data: every case is a JaxparError whose one-line message names the culprit -------

SMALL = ["train.global_batch=2", "train.seq_len=8", "model.vocab_size=256"]  # a batch: 18 ids


def _ids(n: int, bad_at: int | None = None, bad: int = 0, dtype=np.uint16) -> np.ndarray:
    ids = (np.arange(n) % 200).astype(dtype)
    if bad_at is not None:
        ids[bad_at] = bad
    return ids


def _odd_bin(d):
    _ids(1000).tofile(d / "t.bin")
    with open(d / "t.bin", "ab") as f:
        f.write(b"\x00")
    return d / "t.bin", []


def _bin_bad_id_after_first_chunk(d):  # SCAN_CHUNK is 1024 here: the id sits in chunk 3
    _ids(5000, bad_at=3000, bad=300).tofile(d / "t.bin")
    return d / "t.bin", []


def _npy_negative_id(d):
    np.save(d / "t.npy", _ids(1000, bad_at=7, bad=-1, dtype=np.int32))
    return d / "t.npy", []


def _npy_bad_id_in_holdout(d):  # the held-out tail is checked too, at its place in the file
    np.save(d / "t.npy", _ids(1000, bad_at=990, bad=999, dtype=np.int64))
    return d / "t.npy", ["data.holdout_fraction=0.05", "train.eval_every=5", "holdout"]


def _write(name: str, data: bytes):
    def make(d):
        (d / name).write_bytes(data)
        return d / name, []
    return make


def _npy_object_array(d):
    np.save(d / "t.npy", np.array([1, "a", None], dtype=object), allow_pickle=True)
    return d / "t.npy", []


def _npy_truncated(d):
    np.save(d / "t.npy", _ids(1000, dtype=np.int32))
    data = (d / "t.npy").read_bytes()
    (d / "t.npy").write_bytes(data[:len(data) // 2])
    return d / "t.npy", []


def _npy_2d(d):
    np.save(d / "t.npy", np.zeros((10, 10), np.int32))
    return d / "t.npy", []


def _empty_npy_array(d):
    np.save(d / "t.npy", np.zeros(0, np.int32))
    return d / "t.npy", []


def _empty_folder(d):
    (d / "corpus" / "sub").mkdir(parents=True)
    return d / "corpus", []


def _folder_of_empty_files(d):
    (d / "corpus").mkdir()
    (d / "corpus" / "a.txt").write_bytes(b"")
    return d / "corpus", []


def _shorter_than_a_batch(d):  # 100 bytes: 95 train tokens < 8 * 17
    (d / "t.txt").write_bytes(b"x" * 100)
    return d / "t.txt", ["train.global_batch=8", "train.seq_len=16"]


def _holdout_smaller_than_a_batch(d):  # 2000 * 0.05 = 100 held-out tokens < 8 * 17
    (d / "t.txt").write_bytes(b"x" * 2000)
    return d / "t.txt", ["train.global_batch=8", "train.seq_len=16", "train.eval_every=5",
                         "holdout"]


BAD_DATA = {  # case: (make files under tmp_path -> (source, overrides), message fragments)
    "odd-size .bin": (_odd_bin, ["its size is 2001 bytes", "uint16"]),
    "id >= vocab after the first chunk": (
        _bin_bad_id_after_first_chunk,
        ["token id 300 at position 3000 is >= model.vocab_size=256"]),
    "negative id in .npy": (
        _npy_negative_id, ["token id -1 at position 7 is negative",
                           "[0, model.vocab_size=256)"]),
    "id >= vocab in the held-out tail": (
        _npy_bad_id_in_holdout, ["token id 999 at position 990 is >= model.vocab_size=256"]),
    "empty text file": (_write("t.txt", b""), ["is empty: it has 0 tokens"]),
    "empty .bin": (_write("t.bin", b""), ["is empty: it has 0 tokens"]),
    "empty .npy file": (_write("t.npy", b""), ["is empty: it has 0 bytes"]),
    "empty .npy array": (_empty_npy_array, ["is empty: it has 0 tokens"]),
    "folder with no files": (_empty_folder, ["is a folder with no files"]),
    "folder of empty files": (_folder_of_empty_files, ["holds only empty files"]),
    "not a .npy file": (_write("t.npy", b"token ids, honest"), ["not a .npy file"]),
    "pickled object array": (_npy_object_array, ["not a readable .npy array",
                                                 "Python objects"]),
    "truncated .npy": (_npy_truncated, ["not a readable .npy array"]),
    "2-D .npy": (_npy_2d, ["expected a 1-D integer array", "int32 (10, 10)"]),
    "shorter than one batch": (
        _shorter_than_a_batch,
        ["training part has 95 tokens",
         "train.global_batch * (train.seq_len + 1) = 8 * 17 = 136",
         "lower train.global_batch or train.seq_len, or use more data"]),
    "held-out part smaller than one batch": (
        _holdout_smaller_than_a_batch,
        ["held-out part has 100 tokens", "= 8 * 17 = 136",
         "raise data.holdout_fraction or set train.eval_every=0"]),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_is_a_one_line_error_naming_the_source(case, tmp_path, monkeypatch):
    monkeypatch.setattr(jaxpar.data.loader, "SCAN_CHUNK", 1024)
    make, fragments = BAD_DATA[case]
    source, overrides = make(tmp_path)
    holdout = "holdout" in overrides
    overrides = [o for o in overrides if o != "holdout"]
    config = jaxpar.load_config(None, [*SMALL, f"data.source={source}", *overrides])
    with pytest.raises(JaxparError) as info:
        make_loader(config, holdout=holdout)
    message = str(info.value)
    assert "\n" not in message
    assert f"data.source {str(source)!r}" in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("where", ["file", "folder"])
def test_unreadable_file_in_a_folder_is_named(tmp_path, monkeypatch, where):
    # As root, chmod cannot make a file unreadable: refuse the open (or the listing) instead.
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_bytes(b"x" * 1000)
    (tmp_path / "corpus" / "sub" / "secret.txt").write_bytes(b"y" * 1000)
    secret = tmp_path / "corpus" / "sub" / ("secret.txt" if where == "file" else "")
    real_open, real_scandir = pathlib.Path.open, os.scandir

    def refusing_open(self, *args, **kwargs):
        if self == secret:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    def refusing_scandir(path):
        if pathlib.Path(path) == secret:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(pathlib.Path, "open", refusing_open)
    monkeypatch.setattr(os, "scandir", refusing_scandir)
    corpus = str(tmp_path / "corpus")
    with pytest.raises(JaxparError) as info:
        load_tokens(corpus)
    assert str(info.value) == (f"data.source {corpus!r}: cannot read {str(secret)!r}: "
                               "Permission denied")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="chmod 000 does not stop root from reading")
@pytest.mark.parametrize("where", ["file", "folder"])
def test_chmod_000_file_is_named(tmp_path, where):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_bytes(b"x" * 1000)
    secret = tmp_path / "corpus" / ("secret" if where == "folder" else "secret.txt")
    if where == "folder":
        secret.mkdir()
        (secret / "b.txt").write_bytes(b"y" * 1000)
    else:
        secret.write_bytes(b"y" * 1000)
    secret.chmod(0)
    try:
        with pytest.raises(JaxparError, match=re.escape(f"cannot read {str(secret)!r}")):
            load_tokens(str(tmp_path / "corpus"))
        if where == "file":
            with pytest.raises(JaxparError, match=re.escape(
                    f"data.source {str(secret)!r}: cannot read it: Permission denied")):
                load_tokens(str(secret))
    finally:
        secret.chmod(0o755)


@pytest.mark.parametrize("at", [0, 1023, 1024, 4095, 4999])
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_every_id_is_checked_across_chunk_edges(at, dtype):
    ids = _ids(5000, bad_at=at, bad=256, dtype=dtype)
    check_token_ids(np.delete(ids, at), 256, chunk=1024)
    with pytest.raises(JaxparError, match=f"token id 256 at position {at + 10} is >="):
        check_token_ids(ids, 256, offset=10, chunk=1024)


def test_bytes_with_a_256_id_vocabulary_are_not_scanned():
    class Untouchable(np.ndarray):
        def __getitem__(self, key):
            raise AssertionError("scanned")

    tokens = np.zeros(10, np.uint8).view(Untouchable)
    check_token_ids(tokens, 256)  # a uint8 id cannot reach 256
    with pytest.raises(AssertionError, match="scanned"):
        check_token_ids(tokens, 200)


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5, float("nan")])
def test_split_holdout_refuses_a_fraction_outside_0_1(fraction):
    with pytest.raises(JaxparError, match=r"data.holdout_fraction=.* must be in \[0, 1\)"):
        split_holdout(np.arange(100), fraction)
