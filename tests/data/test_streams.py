"""Documents tokenized as they are read: every file kind written by its own library (pyarrow,
Hugging Face ``datasets``, array_record, zstandard), packed rows equal to the tokenizer's
own output, mixtures, and the same global batches on any number of processes, resumed
from the saved stream positions."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest

import jaxpar
from jaxpar.config.validate import check_config
from jaxpar.data.documents import names_documents, open_documents
from jaxpar.data.streams import DocumentLoader
from jaxpar.errors import JaxparError
from tests.data.test_tokenizer import SENTENCES, make_tokenizer

WORDS = " ".join(SENTENCES).split()


def _docs(n: int, seed: int = 0, tag: str = "") -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join([tag] * bool(tag) + list(rng.choice(WORDS, rng.integers(1, 12))))
            for _ in range(n)]


def _jsonl(path, docs, opener=open) -> None:
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))


def _write_every_kind(folder, docs: list[str]) -> dict[str, str]:
    """The same documents in each kind of file, written by the kind's own library."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from array_record.python.array_record_module import ArrayRecordWriter

    folder.mkdir(parents=True, exist_ok=True)
    _jsonl(folder / "a.jsonl", docs)
    _jsonl(folder / "a.jsonl.gz", docs, gzip.open)
    with open(folder / "a.jsonl.zst", "wb") as raw, \
            zstandard.ZstdCompressor().stream_writer(raw) as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}),
                   folder / "a.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder / "hf"))
    writer = ArrayRecordWriter(str(folder / "a.array_record"), "group_size:1")
    for i, d in enumerate(docs):
        record = json.dumps({"text": d}) if i % 2 else d  # JSON records and plain text
        writer.write(record.encode())
    writer.close()
    return {"jsonl": f"{folder}/a.jsonl", "gz": f"{folder}/a.jsonl.gz",
            "zst": f"{folder}/a.jsonl.zst", "parquet": f"{folder}/a.parquet",
            "hf": f"{folder}/hf", "array_record": f"{folder}/a.array_record"}


def test_every_kind_of_file_reads_back_its_documents(tmp_path):
    docs = _docs(30)
    for kind, spec in _write_every_kind(tmp_path / "d", docs).items():
        table = open_documents(spec)
        assert len(table) == 30, kind
        assert [table[i] for i in (0, 13, 29, 6, 7)] == [docs[i] for i in (0, 13, 29, 6, 7)]
        assert names_documents(spec) == (kind not in ("jsonl", "gz")), kind
    assert names_documents(f"{tmp_path}/d/*.jsonl")  # a glob of jsonl streams
    both = open_documents(f"{tmp_path}/d/a.jsonl*")
    assert len(both) == 90 and both[31] == docs[1]


def test_bad_document_files_fail_in_one_line(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "a b"}\n{"body": "c"}\n')
    with pytest.raises(JaxparError, match=r"x.jsonl': line 2: the record has no data.field"):
        open_documents(str(tmp_path / "x.jsonl"))[1]
    (tmp_path / "y.parquet").write_bytes(b"not parquet")
    with pytest.raises(JaxparError, match=r"y.parquet'.*not a readable Parquet file"):
        open_documents(str(tmp_path / "y.parquet"))
    import zstandard

    whole = zstandard.ZstdCompressor().compress(b'{"text": "a b"}\n' * 50)
    (tmp_path / "z.jsonl.zst").write_bytes(whole[:len(whole) // 2])  # cut short
    with pytest.raises(JaxparError, match=r"z.jsonl.zst'.*not a whole compressed file"):
        open_documents(str(tmp_path / "z.jsonl.zst"))
    tok = tmp_path / "tok" / "tokenizer.json"
    make_tokenizer(tok)
    for overrides, message in [
        ([f"data.source={tmp_path}/none-*.jsonl"], "the pattern matches no file"),
        ([f"data.sources=[{{path: '{tmp_path}/x.jsonl', weight: -1}}]"],
         "data.sources[0].weight=-1: must be a positive number"),
        ([f"data.source={tmp_path}/x.jsonl*", "data.workers=0"], "data.workers=0: must be"),
    ]:
        config = jaxpar.load_config(None, [*overrides, f"data.tokenizer={tok}"])
        with pytest.raises(JaxparError, match=re.escape(message)):
            check_config(config, devices=8, processes=1)


@pytest.fixture
def tokenizer(tmp_path):
    return make_tokenizer(tmp_path / "tok" / "tokenizer.json")


def _loader(sources, tokenizer, *, index=0, count=1, batch=6, seq=16, **kw):
    return DocumentLoader(sources, tokenizer, tokenizer.token_to_id("</s>"), batch, seq,
                          seed=3, process_index=index, process_count=count, **kw)


def test_rows_pack_each_stream_of_documents_whole_and_in_order(tmp_path, tokenizer):
    docs = _docs(200)
    table = open_documents(_write_every_kind(tmp_path / "d", docs)["parquet"])
    loader = _loader([(table, 1.0)], tokenizer, batch=4, seq=16)
    got = [loader.batch(step) for step in range(6)]
    eos = tokenizer.token_to_id("</s>")
    for row in range(4):  # row r reads documents r, r + 4, r + 8, ... of the shuffled order
        stream = [i for k in range(40) for i in (
            *tokenizer.encode(loader.document(row + 4 * k), add_special_tokens=False).ids, eos)]
        have = np.concatenate([b["tokens"][row] for b in got])
        np.testing.assert_array_equal(have, stream[:len(have)])
    first = got[0]
    ends = first["tokens"] == eos
    np.testing.assert_array_equal(first["segment_ids"], np.cumsum(ends, 1) - ends)
    # one epoch draws every document once: the shuffled order is a permutation
    assert sorted(loader.document(i) for i in range(200)) == sorted(docs)
    assert loader.batch(2)["tokens"].tolist() == got[2]["tokens"].tolist()  # read again


def test_a_mixture_follows_its_weights_by_documents(tmp_path, tokenizer):
    kinds_a = _write_every_kind(tmp_path / "a", _docs(60, 1, "cat"))
    kinds_b = _write_every_kind(tmp_path / "b", _docs(40, 2, "dog"))
    loader = _loader([(open_documents(kinds_a["zst"]), 3.0),
                      (open_documents(kinds_b["hf"]), 1.0)], tokenizer)
    drawn = [loader.document(i).split()[0] for i in range(400)]
    assert abs(drawn.count("dog") / 400 - 0.25) <= 1 / 400, drawn.count("dog")


@pytest.mark.parametrize("counts", [(4, 2, 3), (1, 3)])
def test_resumed_on_other_process_counts_the_batches_are_one_sequence(tmp_path, tokenizer,
                                                                       counts):
    """Steps 0-2 on counts[0] processes, the stream positions saved (gathered in row
    order), steps 3-5 on counts[1] processes from them, ...: one process's batches."""
    kinds = _write_every_kind(tmp_path / "d", _docs(150))
    sources = lambda: [(open_documents(kinds["array_record"]), 2.0),  # noqa: E731
                       (open_documents(kinds["gz"]), 1.0)]
    whole = _loader(sources(), tokenizer, batch=12)
    want = [whole.batch(step)["tokens"] for step in range(3 * len(counts))]
    saved = None
    for part, count in enumerate(counts):
        loaders = [_loader(sources(), tokenizer, index=p, count=count, batch=12)
                   for p in range(count)]
        start = 3 * part
        if saved is not None:
            for loader in loaders:
                loader.restore(saved, start)
        for step in range(start, start + 3):
            rows = np.concatenate([ld.batch(step)["tokens"] for ld in loaders])
            np.testing.assert_array_equal(rows, want[step])
        saved = np.concatenate([ld.local_state(start + 3) for ld in loaders]).tolist()
    with pytest.raises(JaxparError, match="saved for train.global_batch=12, not 6"):
        _loader(sources(), tokenizer, batch=6).restore(saved, 9)


def test_document_knobs_do_what_they_say_or_are_refused(tmp_path, tokenizer):
    """ArrayRecord JSON objects without data.field are refused (as Parquet and Arrow are);
    data.eos_id ends documents when set; data.token_dtype on text and data.cross_document
    beside anything but documents are refused; data.cross_document trains a model that
    takes no segment_ids (rows without them, one warning), which packed rows refuse."""
    import warnings

    from array_record.python.array_record_module import ArrayRecordWriter

    from jaxpar.runs.inputs import make_loader
    from jaxpar.training.objective import lm_loss
    from tests.user_models import MhaLM

    writer = ArrayRecordWriter(str(tmp_path / "r.array_record"), "group_size:1")
    for record in ['{"text": "a b"}', '{"body": "c d"}', "{plain text}"]:
        writer.write(record.encode())
    writer.close()
    table = open_documents(str(tmp_path / "r.array_record"))
    assert table[0] == "a b" and table[2] == "{plain text}"
    with pytest.raises(JaxparError, match=r"record 1: the record has no data.field='text'"):
        table[1]
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"text": _docs(40)}), tmp_path / "d" / "a.parquet")
    tok = tmp_path / "tok" / "tokenizer.json"
    base = [f"data.tokenizer={tok}", f"data.source={tmp_path}/d/a.parquet",
            "model.vocab_size=64", "train.seq_len=16", "train.global_batch=4"]
    assert make_loader(jaxpar.load_config(None, [*base, "data.eos_id=5"])).eos_id == 5
    for overrides, message in [
        ([*base, "data.token_dtype=uint32"], "data.token_dtype=uint32 is the id type of .bin "
         f"token shards, but data.source '{tmp_path}/d/a.parquet' is text: drop it"),
        (["data.token_dtype=uint32"], "data.token_dtype=uint32 is the id type"),  # stdlib
        (["data.cross_document=true"], "data.cross_document=true applies to documents"),
    ]:
        with pytest.raises(JaxparError, match=re.escape(message)):
            check_config(jaxpar.load_config(None, overrides), devices=8, processes=1)
    from flax import nnx

    with nnx.use_eager_sharding(False):  # traced, not run: the loss's shape is the check
        model = nnx.eval_shape(lambda: MhaLM(rate=0.0, rngs=nnx.Rngs(0)))  # no segment_ids
    packed = make_loader(jaxpar.load_config(None, base)).batch(0)
    with pytest.raises(JaxparError, match=r"takes no segment_ids: add a segment_ids=None .*"
                       r"or data.cross_document=true \(documents tokenized as read\)"):
        nnx.eval_shape(lm_loss, model, packed)
    config = jaxpar.load_config(None, [*base, "data.cross_document=true"])
    check_config(config, devices=4, processes=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        rows = make_loader(config).batch(0)
    assert [str(w.message) for w in said] == [
        "data.cross_document=true: rows run across documents (no segment ids; attention "
        "crosses from one document into the next)"]
    np.testing.assert_array_equal(rows, packed["tokens"])  # the same ids, unpacked
    assert nnx.eval_shape(lm_loss, model, rows).shape == ()
