"""The tokenizer pipeline: EOS packing, JSONL fields, cache reuse and invalidation, the
vocabulary check against the model, and the config checks."""

import json
import os
import re

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import jaxpar
import jaxpar.data.tokenizer as tok
from jaxpar import JaxparError
from jaxpar.config.validate import check_config
from jaxpar.runs.loop import make_loader

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "birds sing at dawn",
             "the sun sets over the sea", "rain falls on the roof"]
SMALL = ["train.global_batch=2", "train.seq_len=8", "model.vocab_size=256"]  # 18 ids a batch


def make_tokenizer(path, specials=("<unk>", "</s>")) -> Tokenizer:
    """A word-level tokenizer trained on :data:`SENTENCES`, saved as ``path``."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(
        special_tokens=list(specials)))
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


@pytest.fixture
def corpus(tmp_path):
    """(data folder, tokenizer.json path, tokenizer): two text files and a tokenizer."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text(" ".join(SENTENCES[:3]) + "\n")
    (data / "sub" / "b.txt").write_text(" ".join(SENTENCES[2:]) * 3)
    (data / ".hidden").write_text("never read")
    path = tmp_path / "tok" / "tokenizer.json"
    return data, path, make_tokenizer(path)


def expected(tokenizer, texts) -> list[int]:
    eos = tokenizer.token_to_id("</s>")
    return [i for text in texts for i in [*tokenizer.encode(text, add_special_tokens=False)
                                          .ids, eos]]


def caches(data) -> list[str]:
    return sorted(p.name for p in (data.parent / tok.CACHE_DIR).glob("*.npy"))


def test_folder_is_documents_packed_with_eos(corpus):
    data, path, tokenizer = corpus
    ids = tok.tokenized(str(data), str(path.parent), progress=False)
    texts = [(data / "a.txt").read_text(), (data / "sub" / "b.txt").read_text()]
    assert ids.dtype == np.uint16 and not ids.flags.writeable
    assert ids.tolist() == expected(tokenizer, texts)
    assert caches(data) and caches(data)[0].startswith("data-")


def test_jsonl_field_and_a_record_without_it(tmp_path, corpus):
    _, path, tokenizer = corpus
    notes = tmp_path / "notes.jsonl"
    notes.write_text(json.dumps({"body": SENTENCES[0]}) + "\n\n"
                     + json.dumps({"body": SENTENCES[1], "x": 1}) + "\n")
    ids = tok.tokenized(str(notes), str(path), field="body", progress=False)
    assert ids.tolist() == expected(tokenizer, SENTENCES[:2])
    notes.write_text(notes.read_text() + json.dumps({"text": "no body"}) + "\n")
    where = re.escape(f"{notes}:4: the record has no data.field='body'")
    with pytest.raises(JaxparError, match=where):
        tok.tokenized(str(notes), str(path), field="body", progress=False)


def test_cache_is_reused_then_invalidated(corpus, monkeypatch):
    data, path, tokenizer = corpus
    calls = []
    encode = tok._encode
    monkeypatch.setattr(tok, "_encode", lambda t, texts: calls.append(1) or encode(t, texts))
    first = tok.tokenized(str(data), str(path), progress=False)
    assert calls and caches(data)
    calls.clear()
    again = tok.tokenized(str(data), str(path), progress=False)
    assert not calls and again.tolist() == first.tolist()

    a = data / "a.txt"  # touched: same text, a new cache (the stale one is deleted)
    before = caches(data)
    stat = a.stat()
    os.utime(a, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched = tok.tokenized(str(data), str(path), progress=False)
    assert calls and caches(data) != before and len(caches(data)) == 1
    assert touched.tolist() == first.tolist()

    a.write_text("the dog sat")  # edited: new ids
    edited = tok.tokenized(str(data), str(path), progress=False)
    assert edited.tolist()[:4] == expected(tokenizer, ["the dog sat"])

    other = make_tokenizer(path, specials=("<pad>", "<unk>", "</s>"))  # every id moves by 1
    retokenized = tok.tokenized(str(data), str(path), progress=False)
    assert retokenized.tolist() == [i + 1 for i in edited.tolist()]
    assert retokenized.tolist()[:4] == expected(other, ["the dog sat"])


def test_dtype_follows_the_vocabulary():
    assert tok.token_dtype(256) == np.uint16 and tok.token_dtype(65536) == np.uint16
    assert tok.token_dtype(65537) == np.uint32 and tok.token_dtype(151_936) == np.uint32


def test_eos_from_tokenizer_config_or_the_usual_names(corpus):
    _, path, tokenizer = corpus
    assert tok.eos_id(tokenizer) == tokenizer.token_to_id("</s>")
    (path.parent / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<unk>"}}))
    assert tok.eos_id(tokenizer, path.parent) == tokenizer.token_to_id("<unk>")
    bare = make_tokenizer(path.parent / "bare" / "tokenizer.json", specials=("<unk>",))
    with pytest.raises(JaxparError, match="no end-of-document token"):
        tok.eos_id(bare)


def test_a_bad_tokenizer_names_data_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(JaxparError, match=r"^data.tokenizer='.*': cannot load"):
        tok.load_tokenizer(str(tmp_path))
    with pytest.raises(JaxparError, match="is neither a tokenizer.json file nor a folder"):
        tok.load_tokenizer(str(tmp_path / "nope"))


def test_make_loader_over_tokenized_text(corpus):
    data, path, tokenizer = corpus
    cfg = jaxpar.load_config(None, [*SMALL, f"data.source={data}", f"data.tokenizer={path}",
                                    "data.holdout_fraction=0.1"])
    check_config(cfg)
    batch = make_loader(cfg).batch(0)
    assert batch.shape == (2, 9) and int(batch.max()) < tokenizer.get_vocab_size()


def test_a_vocabulary_larger_than_the_model_is_one_line(corpus):
    data, path, tokenizer = corpus
    cfg = jaxpar.load_config(None, [*SMALL, "model.vocab_size=8", f"data.source={data}",
                                    f"data.tokenizer={path.parent}"])
    n = tokenizer.get_vocab_size()
    with pytest.raises(JaxparError) as err:
        make_loader(cfg)
    assert str(err.value) == (f"data.tokenizer {str(path.parent)!r} has a vocabulary of {n} "
                              f"tokens but model.vocab_size=8: set model.vocab_size={n} or more")


@pytest.mark.parametrize("override, message", [
    ("data.source=stdlib", r"^data.source='stdlib': with data.tokenizer set, must be a text"),
    ("data.tokenizer=nowhere/tok.json", r"^data.tokenizer='nowhere/tok.json': is neither"),
])
def test_config_checks(corpus, override, message):
    data, path, _ = corpus
    cfg = jaxpar.load_config(None, [f"data.source={data}", f"data.tokenizer={path}", override])
    with pytest.raises(JaxparError, match=message) as err:
        check_config(cfg)
    assert "\n" not in str(err.value)
