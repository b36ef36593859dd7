import numpy as np
import pytest

import jaxpar
from jaxpar import JaxparError
from jaxpar.data import TokenLoader, load_tokens, split_holdout, stdlib_corpus


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
    with pytest.raises(JaxparError, match="token id 299 but model.vocab_size=256"):
        TokenLoader(load_tokens(str(tmp_path / "t.npy")), 2, 8).vocab_check(256)
    with pytest.raises(JaxparError, match="neither 'stdlib' nor an existing path"):
        load_tokens(str(tmp_path / "missing"))


def test_holdout_split():
    train, held = split_holdout(np.arange(100), 0.1)
    assert len(train) == 90 and held[0] == 90


def test_holdout_loader_is_the_tail_and_too_small_a_holdout_is_named():
    from jaxpar.run import make_loader

    cfg = jaxpar.load_config(None, ["data.max_bytes=100000", "train.seq_len=32",
                                    "train.global_batch=4", "data.holdout_fraction=0.1"])
    train, held = make_loader(cfg), make_loader(cfg, holdout=True)
    assert len(train.tokens) + len(held.tokens) == 100000 and len(held.tokens) == 10000
    assert held.batch(0).shape == (4, 33) and not np.array_equal(held.batch(0), train.batch(0))
    empty = jaxpar.load_config(None, ["data.max_bytes=100000", "data.holdout_fraction=0.0",
                                      "train.eval_every=5"])
    with pytest.raises(JaxparError, match="held-out part has 0 tokens"):
        make_loader(empty, holdout=True)
