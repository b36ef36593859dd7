"""``jaxpar tokenize``: jsonl (plain and gzipped) and text files into .bin shards by worker
processes, each document ended by EOS, equal to the tokenizer's own output; then trained
on as token shards."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.data.shards import open_shard, shard_paths
from jaxpar.data.tokenize_shards import MANIFEST, write_shards
from tests.data.test_tokenizer import SENTENCES, make_tokenizer


@pytest.fixture
def corpus(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES[:3]))
    with gzip.open(data / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": s}) + "\n" for s in SENTENCES[3:])
    (data / "c.txt").write_text(" ".join(SENTENCES))
    return data, make_tokenizer(tmp_path / "tok" / "tokenizer.json"), tmp_path / "tok"


def test_each_file_becomes_a_shard_of_its_documents_and_eos(corpus, tmp_path):
    data, tokenizer, tok = corpus
    manifest = write_shards([str(data)], str(tok), tmp_path / "shards", workers=2,
                            progress=False)
    eos = tokenizer.token_to_id("</s>")
    assert manifest["eos_id"] == eos and manifest["token_dtype"] == "uint16"
    encode = lambda t: [*tokenizer.encode(t, add_special_tokens=False).ids, eos]  # noqa: E731
    want = [[i for s in SENTENCES[:3] for i in encode(s)],
            [i for s in SENTENCES[3:] for i in encode(s)], encode(" ".join(SENTENCES))]
    paths = shard_paths(str(tmp_path / "shards"))
    assert [p.name for p in paths] == ["00000-a.bin", "00001-b.bin", "00002-c.bin"]
    for path, ids in zip(paths, want, strict=True):
        np.testing.assert_array_equal(open_shard(path), ids)
    assert [s["tokens"] for s in manifest["shards"]] == [len(w) for w in want]
    assert json.loads((tmp_path / "shards" / MANIFEST).read_text()) == manifest


def test_the_command_says_how_to_train_and_refuses_a_folder_with_shards(corpus, tmp_path,
                                                                         capsys):
    data, tokenizer, tok = corpus
    out = tmp_path / "shards"
    argv = ["tokenize", "--tokenizer", str(tok), "--out", str(out), "--workers", "1",
            f"{data}/*.jsonl*"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    eos = tokenizer.token_to_id("</s>")
    assert f"train on them with data.source={out} data.token_dtype=uint16 data.eos_id={eos}" \
        in said
    from jaxpar.data.shards import names_shards

    assert names_shards(str(out))  # the folder as printed: its shards, the manifest aside
    assert main(argv) == 2
    assert "holds shards already; choose another folder" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "no text field"}\n')
    assert main(["tokenize", "--tokenizer", str(tok), "--out", str(tmp_path / "o2"),
                 str(bad)]) == 2
    assert "bad.jsonl:1: the record has no data.field='text'" in capsys.readouterr().err


def test_parquet_and_zstd_inputs_an_interrupt_stops_the_workers_and_a_rerun_rewrites(
        tmp_path, monkeypatch, capsys):
    """Parquet and ``.jsonl.zst`` are read as training reads them; SIGTERM mid-run stops
    the workers at once (exit 143, one line), training refuses the unfinished folder, and
    the same command again rewrites it."""
    import concurrent.futures
    import multiprocessing
    import os
    import signal

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from jaxpar.data.shards import check_shards
    from jaxpar.data.tokenize_shards import input_files
    from jaxpar.errors import JaxparError

    tokenizer = make_tokenizer(tmp_path / "tok" / "tokenizer.json")
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.table({"text": SENTENCES[:3]}), raw / "a.parquet")
    (raw / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": s}) + "\n" for s in SENTENCES[3:]).encode()))
    np.zeros(4, np.int32).tofile(tmp_path / "ids.npy")
    with pytest.raises(JaxparError, match=r"input '.*ids.npy' is not a kind it reads \(text, "):
        input_files([str(tmp_path / "ids.npy")])
    hf = tmp_path / "hf"  # a datasets folder: its Arrow files, not its json state
    hf.mkdir()
    (hf / "dataset_info.json").write_text("{}")
    (hf / "state.json").write_text('{"_data_files": [{"filename": "data-0.arrow"}]}')
    assert input_files([str(hf)]) == [hf / "data-0.arrow"]
    out = tmp_path / "out"
    argv = ["tokenize", "--tokenizer", str(tmp_path / "tok"), "--out", str(out),
            "--workers", "2", str(raw)]
    real = concurrent.futures.as_completed

    def terminated(jobs):  # SIGTERM arrives while the workers are busy
        os.kill(os.getpid(), signal.SIGTERM)
        yield from real(jobs)

    monkeypatch.setattr(concurrent.futures, "as_completed", terminated)
    assert main(argv) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jaxpar: tokenize stopped by SIGTERM, its workers with it; the shards are "
                   "unfinished: run the same command again to rewrite them"]
    assert multiprocessing.active_children() == [] and not list(out.glob(".*.tmp"))
    assert json.loads((out / MANIFEST).read_text())["complete"] is False
    with pytest.raises(JaxparError, match="holds the shards of an interrupted jaxpar tokenize"):
        check_shards([out / "00000-a.bin"], "uint16", -1, 64, str(out))
    monkeypatch.setattr(concurrent.futures, "as_completed", real)
    (out / "00001-b.bin").write_bytes(b"\0\0")  # what a killed run might have left
    assert main(argv) == 0
    assert "left (1 shards, no finished tokenize.json): rewriting it" in capsys.readouterr().err
    eos = tokenizer.token_to_id("</s>")
    for path, texts in zip(shard_paths(str(out)), [SENTENCES[:3], SENTENCES[3:]], strict=True):
        want = [i for s in texts for i in (*tokenizer.encode(s, add_special_tokens=False).ids,
                                           eos)]
        np.testing.assert_array_equal(open_shard(path), want)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["complete"] is True and manifest["vocab_size"] == tokenizer.get_vocab_size()
    assert main(argv) == 2  # a finished folder is not rewritten
    assert "holds shards already" in capsys.readouterr().err
