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
