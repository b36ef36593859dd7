"""Safetensors folders, checked with the ``safetensors`` library itself: shards written
within their size limit with the index ``transformers`` reads, slices read back equal to
numpy's (counting their bytes), every malformed folder named in one line, and a write the
file system refuses reported with the folder and its free space."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from jaxpar.errors import JaxparError
from jaxpar.storage.safetensors_io import (
    INDEX,
    SINGLE,
    SafetensorsFolder,
    write_hf_folder,
    write_shards,
    writing,
)


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((10, 10)).astype(np.float32),      # 400 bytes
            "b": rng.standard_normal((100,)).astype(np.float32),        # 400 bytes
            "c": rng.integers(-9, 9, (50, 2)).astype(np.int32),         # 400 bytes
            "d": rng.standard_normal((500,)).astype(np.float16),        # 1000 bytes
            "e": np.arange(6, dtype=np.int64).reshape(2, 3)}            # 48 bytes


def _entries(tensors: dict[str, np.ndarray]) -> list:
    return [(name, t.shape, t.dtype) for name, t in tensors.items()]


def test_shards_respect_the_limit_and_the_index_lists_every_tensor(tmp_path):
    tensors = _tensors()
    produced = []

    def produce(name):
        produced.append(name)
        return tensors[name]

    files = write_shards(tmp_path, _entries(tensors), produce, max_shard_bytes=900)
    # a + b: 800 bytes; c would make 1200, so it starts shard 2; d (1000 bytes, over the
    # limit by itself) gets shard 3 alone; e would make 1048, so it starts shard 4.
    assert files == [f"model-0000{k}-of-00004.safetensors" for k in (1, 2, 3, 4)]
    assert produced == list(tensors)  # once each, in order
    index = json.loads((tmp_path / INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert index["weight_map"] == {"a": files[0], "b": files[0], "c": files[1], "d": files[2],
                                   "e": files[3]}
    assert not (tmp_path / SINGLE).exists()
    assert not list(tmp_path.glob("*.tmp"))
    for file in files:
        with safe_open(str(tmp_path / file), framework="numpy") as handle:
            assert handle.metadata() == {"format": "pt"}
        for name, array in load_file(tmp_path / file).items():
            assert index["weight_map"][name] == file
            assert array.dtype == tensors[name].dtype
            np.testing.assert_array_equal(array, tensors[name])


def test_everything_in_one_shard_is_a_single_file(tmp_path):
    tensors = _tensors()
    assert write_shards(tmp_path, _entries(tensors), tensors.__getitem__,
                        max_shard_bytes=10_000) == [SINGLE]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE]
    back = load_file(tmp_path / SINGLE)
    assert sorted(back) == sorted(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(back[name], array)


def test_bfloat16_is_stored_as_bf16(tmp_path):
    x = np.linspace(-2, 2, 12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    write_shards(tmp_path, [("x", x.shape, x.dtype)], lambda _: x, max_shard_bytes=1 << 20)
    with safe_open(str(tmp_path / SINGLE), framework="numpy") as handle:
        part = handle.get_slice("x")
        assert part.get_dtype() == "BF16" and part.get_shape() == [3, 4]
    with SafetensorsFolder(tmp_path) as folder:
        assert folder.info("x") == ((3, 4), "BF16")
        np.testing.assert_array_equal(folder.read("x").astype(np.float32), x.astype(np.float32))


def test_a_process_that_does_not_write_still_produces_every_tensor(tmp_path):
    tensors = _tensors()
    produced = []
    files = write_shards(tmp_path, _entries(tensors),
                         lambda n: produced.append(n) or tensors[n], max_shard_bytes=900,
                         write=False)
    assert len(files) == 4 and produced == list(tensors)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def sharded(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    tensors = _tensors()
    write_shards(tmp_path, _entries(tensors), tensors.__getitem__, max_shard_bytes=900)
    return tmp_path, tensors


def test_folder_reads_slices_like_numpy_and_counts_bytes(sharded):
    path, tensors = sharded
    with SafetensorsFolder(path) as folder:
        assert sorted(folder.names()) == sorted(tensors)
        assert folder.info("a") == ((10, 10), "F32")
        assert folder.info("c") == ((50, 2), "I32")
        assert folder.info("d") == ((500,), "F16")
        assert folder.bytes_read == 0  # info reads no data
        part = folder.read("a", (slice(2, 5),))
        np.testing.assert_array_equal(part, tensors["a"][2:5])
        assert folder.bytes_read == 3 * 10 * 4
        part = folder.read("a", (slice(1, 3), slice(4, 9)))
        np.testing.assert_array_equal(part, tensors["a"][1:3, 4:9])
        np.testing.assert_array_equal(folder.read("e"), tensors["e"])
        assert folder.bytes_read == 120 + 2 * 5 * 4 + 48


def test_single_file_folder(tmp_path):
    save_file({"w": np.ones((4, 2), np.float32)}, str(tmp_path / SINGLE))
    with SafetensorsFolder(tmp_path) as folder:
        assert folder.files is None and folder.names() == ["w"]
        np.testing.assert_array_equal(folder.read("w", (slice(3, 4),)), np.ones((1, 2)))
        with pytest.raises(JaxparError, match=r"tensor 'v' is missing"):
            folder.info("v")


def test_malformed_folders_are_named(tmp_path):
    with pytest.raises(JaxparError, match=rf"{tmp_path}: no model.safetensors or "
                                          rf"model.safetensors.index.json"):
        SafetensorsFolder(tmp_path)
    (tmp_path / INDEX).write_text("{not json")
    with pytest.raises(JaxparError, match=rf"{tmp_path / INDEX}: not a safetensors index"):
        SafetensorsFolder(tmp_path)
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(JaxparError, match=r"not a safetensors index \('weight_map'\)"):
        SafetensorsFolder(tmp_path)
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {
        "x": "gone.safetensors", "y": "junk.safetensors", "z": "ok.safetensors"}}))
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
    save_file({"other": np.zeros(2, np.float32)}, str(tmp_path / "ok.safetensors"))
    with SafetensorsFolder(tmp_path) as folder:
        assert folder.names() == ["x", "y", "z"]
        with pytest.raises(JaxparError, match=rf"{tmp_path / 'gone.safetensors'}: missing "
                                              rf"\(listed in {INDEX}\)"):
            folder.info("x")
        with pytest.raises(JaxparError, match=r"junk.safetensors: not a readable safetensors "
                                              r"file"):
            folder.info("y")
        with pytest.raises(JaxparError, match=r"tensor 'z' is missing"):  # not in its shard
            folder.info("z")
        with pytest.raises(JaxparError, match=r"tensor 'q' is missing"):  # not in the index
            folder.info("q")


def test_writing_turns_a_full_disk_into_one_line(tmp_path):
    target = tmp_path / "export"
    with pytest.raises(JaxparError) as err, writing(target):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target / "x"))
    msg = str(err.value)
    assert msg.startswith(f"could not write {target}: no space left on device (")
    assert msg.endswith("free there); nothing was written")
    target.mkdir()
    with pytest.raises(JaxparError, match=rf"{target} is left as it was$"), writing(target):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                              "StorageFull, message: \"No space left on device\" })")


def test_writing_names_a_file_in_the_way_and_passes_other_errors_on(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    target = blocker / "sub" / "export"
    with pytest.raises(JaxparError, match=rf"could not write {target}: {blocker} is a file, "
                                          r"not a folder"), writing(target):
        target.mkdir(parents=True)
    with pytest.raises(SafetensorError, match="shape mismatch"), writing(tmp_path / "out"):
        raise SafetensorError("shape mismatch")  # a bug, not the disk: shown whole
    with pytest.raises(ValueError), writing(tmp_path / "out"):
        raise ValueError("not a write at all")


def test_write_hf_folder_swaps_in_shards_and_the_finish(tmp_path):
    target = tmp_path / "hf"
    target.mkdir()
    (target / "model-00001-of-00009.safetensors").write_text("an older export's shard")
    (target / "notes.md").write_text("mine")
    tensors = _tensors()

    def finish(staging: Path) -> None:
        assert staging != target and (staging / INDEX).is_file()  # after the shards
        (staging / "config.json").write_text("{}")

    assert write_hf_folder(target, _entries(tensors), tensors.__getitem__, finish,
                           max_shard_bytes=900) == target
    names = sorted(p.name for p in target.iterdir())
    assert names == ["config.json", *[f"model-0000{k}-of-00004.safetensors"
                                      for k in (1, 2, 3, 4)], INDEX, "notes.md"]
    with SafetensorsFolder(target) as folder:
        for name, array in tensors.items():
            np.testing.assert_array_equal(folder.read(name), array)
