"""Token shards in shuffled epochs, weighted mixtures, and the same global sequence of
batches on any number of processes (so a run resumes on 4, then 2, then 3 of them)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import jaxpar
from jaxpar.config.validate import check_config
from jaxpar.data.mixture import MixtureLoader, Source
from jaxpar.data.shards import Windows, names_shards, open_shard, shard_paths
from jaxpar.errors import JaxparError

SEQ = 8


def _write_shards(folder, name: str, sizes: list[int], dtype: str = "uint16",
                  base: int = 0) -> list[str]:
    """Shards whose ids count up from ``base`` (so every window says where it came from)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], base
    for i, n in enumerate(sizes):
        path = folder / f"{name}-{i:05d}.bin"
        np.arange(start, start + n, dtype=dtype).tofile(path)
        paths.append(str(path))
        start += n
    return paths


def _windows(spec: str, dtype: str = "uint16", **kw) -> Windows:
    return Windows([open_shard(p, dtype) for p in shard_paths(spec)], SEQ, name=spec, **kw)


def test_windows_cover_each_shard_and_never_cross_two(tmp_path):
    _write_shards(tmp_path / "a", "train", [33, 17, 9])  # 4 + 2 + 1 windows of 8 + 1 ids
    windows = _windows(str(tmp_path / "a" / "*.bin"))
    assert len(windows) == 7
    rows = [windows[i] for i in range(len(windows))]
    assert all(r.dtype == np.int32 and r.shape == (SEQ + 1,) for r in rows)
    assert all(np.all(np.diff(r) == 1) for r in rows)  # contiguous: inside one shard
    assert [int(r[0]) for r in rows] == [0, 8, 16, 24, 33, 41, 50]


def test_uint32_shards_and_held_out_tails(tmp_path):
    _write_shards(tmp_path, "big", [81], dtype="uint32", base=70_000)
    train = _windows(str(tmp_path), "uint32", part=(0.0, 0.8))
    held = _windows(str(tmp_path), "uint32", part=(0.8, 1.0))
    assert (len(train), len(held)) == (8, 2)
    assert int(train[0][0]) == 70_000 and int(held[0][0]) == 70_000 + 8 * SEQ
    with pytest.raises(JaxparError, match="is not a whole number of uint16 ids"):
        (tmp_path / "odd.bin").write_bytes(b"\0" * 3)
        open_shard(tmp_path / "odd.bin")


def test_an_epoch_draws_every_window_once_and_the_next_reshuffles(tmp_path):
    _write_shards(tmp_path, "s", [8 * 24 + 1])  # 24 windows, batches of 4: 6 steps an epoch
    loader = MixtureLoader([Source(_windows(str(tmp_path / "*.bin")))], 4, seed=3)
    first = [tuple(r) for step in range(6) for r in loader.batch(step)]
    second = [tuple(r) for step in range(6, 12) for r in loader.batch(step)]
    assert len(set(first)) == 24 and set(first) == set(second) and first != second
    assert loader.epochs(6) == [1.0]


def test_a_mixture_follows_its_weights(tmp_path):
    _write_shards(tmp_path / "web", "w", [8 * 50 + 1])
    _write_shards(tmp_path / "code", "c", [8 * 10 + 1], base=10_000)
    loader = MixtureLoader([Source(_windows(str(tmp_path / "web")), 3.0),
                            Source(_windows(str(tmp_path / "code")), 1.0)], 8, seed=0)
    rows = np.concatenate([loader.batch(step) for step in range(50)])
    share = float(np.mean(rows[:, 0] >= 10_000))
    assert abs(share - 0.25) <= 1 / 400, share  # within one window of 400
    # The small source wraps into its next epochs; the large one is still in its first.
    assert [round(e, 2) for e in loader.epochs(50)] == [6.0, 10.0]


@pytest.mark.parametrize("counts", [(4, 2, 3), (1, 4), (3, 1)])
def test_the_global_batches_do_not_depend_on_the_process_count(tmp_path, counts):
    """A run resumed on another number of processes continues the same global sequence:
    steps 0-3 on counts[0] processes, 4-7 on counts[1], ... equal one process's steps."""
    _write_shards(tmp_path / "a", "a", [8 * 40 + 1])
    _write_shards(tmp_path / "b", "b", [8 * 30 + 1], base=20_000)

    def loader(index: int, count: int) -> MixtureLoader:
        return MixtureLoader([Source(_windows(str(tmp_path / "a")), 2.0),
                              Source(_windows(str(tmp_path / "b")), 1.0)], 12, seed=7,
                             process_index=index, process_count=count)

    whole = loader(0, 1)
    for part, count in enumerate(counts):
        for step in range(4 * part, 4 * part + 4):
            rows = np.concatenate([loader(p, count).batch(step) for p in range(count)])
            np.testing.assert_array_equal(rows, whole.batch(step))


def test_sources_are_checked_before_anything_runs(tmp_path):
    _write_shards(tmp_path / "a", "a", [100])
    ok = str(tmp_path / "a" / "*.bin")
    assert names_shards(ok) and names_shards(str(tmp_path / "a"))
    for overrides, message in [
        ([f"data.source={tmp_path}/none-*.bin"], "the pattern matches no file"),
        ([f"data.sources=[{{path: '{ok}', weight: 0}}]"], "data.sources[0].weight=0: must be"),
        ([f"data.sources=[{{path: '{ok}', wieght: 1}}]"], "data.sources[0]="),
        ([f"data.source={ok}", "data.token_dtype=int8"], "data.token_dtype='int8': choose"),
    ]:
        config = jaxpar.load_config(None, overrides)
        with pytest.raises(JaxparError, match=re.escape(message)):
            check_config(config, devices=8, processes=1)


def test_a_run_trains_on_a_mixture_of_shard_folders_packed(tmp_path):
    from jaxpar.runs.loop import train

    _write_shards(tmp_path / "web", "w", [4000])
    _write_shards(tmp_path / "code", "c", [2000])
    config = jaxpar.load_config(None, [
        f"data.sources=[{{path: '{tmp_path}/web', weight: 3}}, "
        f"{{path: '{tmp_path}/code/*.bin', weight: 1}}]",
        "model.vocab_size=8192", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
        "model.n_kv_heads=1", "model.d_ff=32", "model.max_seq_len=16", "train.seq_len=16",
        "train.global_batch=8", "train.steps=2", "train.eval_every=2", "mesh.data=-1",
        "data.eos_id=4095"])  # packed: every id 4095 ends a document
    _, history = train(config, tmp_path / "run")
    assert len(history) == 2 and np.isfinite(history[-1]["loss"])
    assert np.isfinite(history[-1]["eval_loss"])


def test_shards_are_read_as_their_manifest_or_first_ids_say(tmp_path, monkeypatch):
    """Shards ``jaxpar tokenize`` wrote carry their id type, EOS and vocabulary in
    tokenize.json: a config that disagrees is refused naming the setting; raw shards read
    at the wrong width are refused naming data.token_dtype (never a PosixPath repr)."""
    import json

    from jaxpar.runs.inputs import make_loader

    rng = np.random.default_rng(0)
    ids = rng.integers(2, 3000, 2000)
    ids[::50] = 1  # documents end with 1
    small = ["model.vocab_size=4096", "train.seq_len=16", "train.global_batch=4"]

    def refused(folder, *overrides) -> str:
        config = jaxpar.load_config(None, [*small, f"data.source={folder}", *overrides])
        with pytest.raises(JaxparError) as info:
            make_loader(config)
        assert "PosixPath" not in str(info.value) and "\n" not in str(info.value)
        return str(info.value)

    made = tmp_path / "made"
    made.mkdir()
    ids.astype("uint32").tofile(made / "00000-a.bin")
    (made / "tokenize.json").write_text(json.dumps({
        "eos_id": 1, "token_dtype": "uint32", "vocab_size": 3000, "complete": True,
        "shards": [{"shard": "00000-a.bin", "tokens": 2000}]}))
    assert "says its shards hold uint32 ids, but data.token_dtype=uint16: set " \
        "data.token_dtype=uint32" in refused(made)
    assert "end with id 1, but data.eos_id=5: set data.eos_id=1" in refused(
        made, "data.token_dtype=uint32", "data.eos_id=5")
    assert "has 3000 ids, but model.vocab_size=2048: set model.vocab_size=3000" in refused(
        made, "data.token_dtype=uint32", "model.vocab_size=2048")
    config = jaxpar.load_config(None, [*small, f"data.source={made}",
                                       "data.token_dtype=uint32", "data.eos_id=1"])
    assert make_loader(config).batch(0)["tokens"].max() < 3000
    import jaxpar.data.shards as shards  # in a bucket: the manifest is read from there too

    written = (made / "tokenize.json").read_bytes()
    monkeypatch.setattr(shards, "read_object", lambda url, what: written if url == (
        "s3://b/made/tokenize.json") else (_ for _ in ()).throw(JaxparError("no object")))
    with pytest.raises(JaxparError, match=r"'s3://b/made/tokenize.json' says its shards hold "
                       r"uint32 ids, but data.token_dtype=uint16"):
        shards.check_shards(["s3://b/made/00000-a.bin"], "uint16", -1, 4096, "s3://b/made/")
    shards.check_shards(["s3://b/raw/a.bin"], "uint16", -1, 4096, "s3://b/raw/")  # none
    (made / "tokenize.json").unlink()  # raw: the first ids tell
    assert "holds uint32 ids, not data.token_dtype=uint16 (its first ids as uint16 are " \
        "every other one 0): set data.token_dtype=uint32" in refused(made)
    raw = tmp_path / "raw"
    raw.mkdir()
    ids.astype("uint16").tofile(raw / "a.bin")
    assert "holds uint16 ids, not data.token_dtype=uint32 (its first ids as uint32 pass " \
        "model.vocab_size=4096): set data.token_dtype=uint16" in refused(
            raw, "data.token_dtype=uint32")
    assert "holds uint16 ids" in refused(raw / "a.bin", "data.token_dtype=uint32")  # one file
    big = np.concatenate([ids, [5000]]).astype("uint16")
    big.tofile(raw / "a.bin")
    assert f"data.source '{raw / 'a.bin'}': token id 5000 at position 2000" in refused(raw)
