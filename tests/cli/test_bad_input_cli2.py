"""Bad input, part 2: ``jaxpar launch`` flags that clash with its child's, ``jaxpar sample``
(a --max-tokens past the model's context, prompt text the tokenizer cannot spell, ids it
has no text for, output streamed as it is generated) and the prompt checks of
:func:`jaxpar.runs.generate.generate`.

The table and its helpers are those of ``tests/cli/test_bad_input.py``.
"""

from __future__ import annotations

import dataclasses
import io
import re
import sys
import warnings

import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import jaxpar.runs.generate as gen
from jaxpar import load_config
from jaxpar.cli import main
from jaxpar.errors import JaxparError, JaxparWarning
from jaxpar.models.transformer import Transformer, TransformerConfig
from tests.cli.test_bad_input import (
    CHILD,
    CHILD_BASE,
    ROOT,
    SMALL,
    Case,
    _check,
    _params,
    _prepare,
    _snapshot,
    run_main,
)

RUNS: dict[str, str] = {}
"""Run folders trained once for this module (by the ``runs`` fixture): ``bytes``, ``words``."""

LAUNCH_1 = ["launch", "--processes", "2", "--devices-per-process", "1", "--"]
SAMPLE = ["sample", "--run", "{run}", "--prompt", "ab"]


def run(kind: str):
    """A setup naming the module's trained run ``kind`` as ``{run}``."""
    return lambda tmp: {"run": RUNS[kind]}


CASES = [
    # --- launch: what launch sets itself, given again after -- ---------------------------
    Case("launch_child_devices", [*LAUNCH_1, *CHILD_BASE, "--devices", "4", "--out",
                                  "{out}", *SMALL],
         ("train --devices 4", "launch --devices-per-process 1")),
    Case("launch_child_devices_equals_form", [*LAUNCH_1, *CHILD, "--devices=8"],
         ("train --devices 8", "launch --devices-per-process 1")),
    Case("launch_child_devices_abbreviated", [*LAUNCH_1, *CHILD, "--dev", "2"],
         ("train --devices 2", "launch --devices-per-process 1")),
    Case("launch_child_num_processes", [*LAUNCH_1, *CHILD, "--num-processes", "4"],
         ("train --num-processes 4", "launch --processes 2")),
    Case("launch_child_process_id", [*LAUNCH_1, *CHILD, "--process-id", "1"],
         ("train --process-id 1", "launch --processes 2")),
    Case("launch_child_coordinator", [*LAUNCH_1, *CHILD, "--coordinator", "h:99"],
         ("train --coordinator h:99", "launch --processes 2")),
    Case("launch_child_devices_and_ids", [*LAUNCH_1, *CHILD, "--devices", "3",
                                          "--process-id", "0"],
         ("train --devices 3", "train --process-id 0")),
    # --- sample: --max-tokens within what the model attends to ---------------------------
    Case("sample_max_tokens_past_context", [*SAMPLE, "--max-tokens", "1000000000"],
         ("--max-tokens 1000000000", "model.max_seq_len=32", "prompt's 2 tokens",
          "leaves 30"), setup=run("bytes")),
    Case("sample_max_tokens_one_too_many", [*SAMPLE, "--max-tokens", "31"],
         ("--max-tokens 31", "model.max_seq_len=32", "leaves 30"), setup=run("bytes")),
    Case("sample_prompt_fills_context", ["sample", "--run", "{run}", "--prompt", "x" * 40],
         ("--prompt is 40 tokens", "model.max_seq_len=32", "shorten --prompt"),
         setup=run("bytes")),
    # --- plan, storage ---------------------------------------------------------------------
    Case("plan_expert_on_a_dense_model",
         ["plan", "--model", "configs/llama-7b.yaml", "--chips", "h100:8", "--global-batch",
          "8", "--seq", "2048", "--expert", "4"],
         ("expert axis 4", "the model is dense", "leave out --expert")),
    Case("train_out_unsupported_scheme", [*CHILD_BASE, "--out", "ftp://host/run"],
         ("--out 'ftp://host/run'", "ftp:// is not supported")),
]


def _tokenizer(path) -> None:
    """A word-level tokenizer of a few words (with ``<unk>`` and ``</s>``), saved as path."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran in the park"],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    tok.save(str(path))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 2-step runs of a tiny model (model.max_seq_len=32): byte-level, and through a
    word-level tokenizer (12 ids) with ``model.vocab_size=256`` (a model whose vocabulary
    outgrows its tokenizer's, as a model.factory model's may)."""
    root = tmp_path_factory.mktemp("sample-runs")
    tiny = ["--config", "configs/tiny.yaml", "--devices", "8", *SMALL, "train.warmup_steps=1",
            "train.eval_every=0", "checkpoint.every=0", "model.max_seq_len=32"]
    assert main(["train", *tiny, "--out", str(root / "bytes")]) == 0
    _tokenizer(root / "tokenizer.json")
    (root / "words.txt").write_text("the cat sat on the mat a dog ran in the park\n" * 400)
    assert main(["train", *tiny, "--out", str(root / "words"),
                 f"data.tokenizer={root / 'tokenizer.json'}",
                 f"data.source={root / 'words.txt'}"]) == 0
    RUNS.update(bytes=str(root / "bytes"), words=str(root / "words"))
    yield
    RUNS.clear()


@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input_in_process(case: Case, runs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = _prepare(case, tmp_path)
    before = _snapshot(tmp_path)
    code, out, err = run_main(argv, capsys)
    _check(case, code, out, err)
    assert out == "", "nothing is printed before the error"
    assert _snapshot(tmp_path) == before, "the output folder changed"


def test_sample_max_tokens_default_fits_the_context(runs, capsys):
    # Without --max-tokens: 64, or what is left after a long prompt (32 - 26 = 6 here);
    # given, exactly the room left is fine. Bytes that are not UTF-8 print one U+FFFD each.
    for extra in ([], ["--max-tokens", "6"]):
        capsys.readouterr()
        assert main(["sample", "--run", RUNS["bytes"], "--prompt", "y" * 26, *extra]) == 0
        out, err = capsys.readouterr()
        assert err == "" and out.startswith("y" * 26) and len(out) <= 26 + 6 + 1, out


class _Writes(io.StringIO):
    """A stdout that records how many tokens had been generated at each write."""

    def __init__(self, calls: list[int]):
        super().__init__()
        self.calls, self.seen = calls, []

    def write(self, text: str) -> int:
        if text:
            self.seen.append((len(self.calls), text))
        return super().write(text)


def test_sample_streams_tokens_as_they_come(runs, monkeypatch):
    calls: list[int] = []
    real = gen._next_token

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gen, "_next_token", counted)
    out = _Writes(calls)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["sample", "--run", RUNS["bytes"], "--prompt", "ab", "--max-tokens",
                 "12", "--temperature", "50", "--seed", "1"]) == 0
    assert len(calls) == 12
    assert out.seen[0] == (0, "ab")  # the prompt, before any token is generated
    counts = [n for n, _ in out.seen[1:]]
    assert len(set(counts)) > 3, out.seen  # text came out while tokens were generated
    assert counts == sorted(counts)
    # What was streamed is what sample_text returns at once.
    model, config = gen.load_run_model(RUNS["bytes"])
    whole = gen.sample_text(model, gen.TextCodec.for_config(config), "ab", max_new_tokens=12,
                            temperature=50.0, seed=1)
    assert out.getvalue() == whole + "\n"


def test_sample_says_what_the_tokenizer_cannot_spell_or_print(runs, capsys):
    capsys.readouterr()
    # 'cät' and 'é' are not words of the tokenizer; at temperature 100 almost every id is
    # drawn from the model's 256, of which only 12 are the tokenizer's.
    code = main(["sample", "--run", RUNS["words"], "--prompt", "the cät sat é",
                 "--max-tokens", "8", "--temperature", "100"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert lines[0] == ("jaxpar: warning: --prompt: the tokenizer has no token for 'cät', "
                        "'é' (read as its unknown token); the model continues what it was "
                        "given"), lines[0]
    assert re.fullmatch(r"jaxpar: warning: \d of the 8 generated ids are outside the "
                        r"tokenizer's 12 ids and printed as nothing \(ids [\d, .]+\): the "
                        r"model's vocabulary is larger than its tokenizer's", lines[1]), lines[1]
    assert out.startswith("the cät sat é")


def test_text_stream_decodes_whole_characters_and_counts_ids_without_text():
    codec = gen.TextCodec()
    stream = gen.TextStream(codec, list(b"ab"))
    euro = "€".encode()  # three bytes: printed once the third arrives
    assert [stream.push(b) for b in euro] == ["", "", "€"]
    assert stream.push(300) == "" and stream.push(ord("x")) == "x"
    with pytest.warns(JaxparWarning, match=r"1 of the 5 generated ids are outside the byte "
                      r"values' 256 ids and printed as nothing \(ids 300\)"):
        assert stream.finish() == ""
    assert codec.decode([*b"ab", 300, *euro]) == "ab€"  # not chr(300 & 0xFF)
    half = gen.TextStream(codec, [97])
    assert half.push(euro[0]) == "" and half.finish() == "\ufffd"  # cut short: shown


def test_prompt_ids_says_what_was_left_out(tmp_path):
    # A BPE tokenizer without an unknown token drops characters it has no token for.
    tok = Tokenizer(models.BPE())
    tok.train_from_iterator(["the cat sat"], trainers.BpeTrainer(special_tokens=["</s>"]))
    codec = gen.TextCodec(tok)
    with pytest.warns(JaxparWarning, match=r"the prompt: the tokenizer has no token for "
                      r"'x', 'y' \(left out\)"):
        ids = gen.prompt_ids(codec, "thexcat yy")
    assert codec.decode(ids).replace(" ", "") == "thecat"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gen.prompt_ids(codec, "the cat") == codec.encode("the cat")  # no notice
    with pytest.raises(JaxparError, match=re.escape(
            "the prompt 'zz' encodes to no tokens: the tokenizer has no token for 'z' "
            "(left out)")):
        gen.prompt_ids(codec, "zz")


# --- generate(): the prompt is one 1-D sequence of integer ids in the vocabulary -----------

TINY = TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                         d_ff=32, max_seq_len=8)


class Bare(nnx.Module):
    """A model without a ``config``, as a model.factory may build: its vocabulary is only
    the last axis of its output."""

    def __init__(self, inner: nnx.Module):
        self.inner = inner

    def __call__(self, tokens):
        return self.inner(tokens)


@pytest.fixture(scope="module")
def tiny():
    return Transformer(TINY, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("prompt, message", [
    ([[1, 2], [3, 4]], "the prompt has shape (2, 2): give one 1-D sequence"),
    (np.ones((1, 3), np.int32), "the prompt has shape (1, 3)"),
    (5, "the prompt has shape ()"),
    ([1.7, 2.2], "must be integers, not float64 (the first is 1.7)"),
    (np.array([1.0, 2.0], np.float32), "must be integers, not float32"),
    ([True, False], "must be integers, not bool"),
    ("hello", "the prompt is text ('hello'), not token ids"),
    ([[1, 2], [3]], "rows have different lengths"),
    ([], "the prompt is empty"),
    ([1, 32], "prompt token id 32 is outside the model's vocabulary [0, 32)"),
    ([1, -1], "prompt token id -1 is outside the model's vocabulary [0, 32)"),
])
def test_generate_checks_the_prompt(tiny, prompt, message):
    with pytest.raises(JaxparError, match=re.escape(message)):
        gen.generate(tiny, prompt, max_new_tokens=2)


def test_generate_checks_counts_and_a_bare_models_vocabulary(tiny):
    with pytest.raises(JaxparError, match=re.escape("max_new_tokens=2.5: must be a whole")):
        gen.generate(tiny, [1, 2], max_new_tokens=2.5)
    with pytest.raises(JaxparError, match=re.escape("top_k=1.0: must be a whole number")):
        gen.generate(tiny, [1, 2], max_new_tokens=2, top_k=1.0)
    bare = Bare(tiny)
    with pytest.raises(JaxparError, match=re.escape("prompt token id 40 is outside the "
                                                    "model's vocabulary [0, 32)")):
        gen.generate(bare, [1, 40], max_new_tokens=2)
    ids = np.array([1, 2, 3], np.int64)  # any integer dtype, a JAX array too
    assert gen.generate(bare, ids, max_new_tokens=3) == gen.generate(tiny, [1, 2, 3],
                                                                    max_new_tokens=3)
    assert gen.generate(tiny, np.asarray(ids, np.uint8), max_new_tokens=2) == (
        gen.generate(tiny, [1, 2, 3], max_new_tokens=2))
    stream = gen.generate_iter(tiny, [1, 2, 3], max_new_tokens=3)
    assert next(stream) == gen.generate(tiny, [1, 2, 3], max_new_tokens=1)[0]


def test_context_room_of_built_in_and_factory_models(tiny):
    config = load_config("configs/tiny.yaml", [])
    assert gen.context_room(config, 6) == (250, "model.max_seq_len=256")
    assert gen.context_room(config, 300) == (0, "model.max_seq_len=256")
    name = "tests.user_models:llama_like"
    factory = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                    factory=name))
    assert gen.context_room(factory, 6) is None  # known once the model is built
    assert gen.context_room(factory, 6, Bare(tiny)) == (
        122, f"train.seq_len=128 (model.factory={name!r} has no max_seq_len)")
    assert gen.context_room(factory, 6, tiny) == (
        2, f"the max_seq_len (8) of model.factory={name!r}")
