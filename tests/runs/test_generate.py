"""Text generation (jaxpar.runs.generate) and ``jaxpar sample``: greedy decoding against a naive
loop, seeded sampling, and whole runs (byte-level and LoRA) trained, loaded and sampled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main
from jaxpar.models.transformer import Transformer, TransformerConfig
from jaxpar.runs.generate import TextCodec, generate, load_run_model

TINY = TransformerConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                         d_ff=32, max_seq_len=8, init_std=0.5)
SMALL = ["model.d_model=32", "model.n_layers=1", "model.d_ff=64", "train.seq_len=16",
         "train.global_batch=8", "train.steps=3", "train.warmup_steps=1", "train.lr=1e-2",
         "train.eval_every=0", "data.max_bytes=100000"]


logits = nnx.jit(lambda model, tokens: model(tokens))
"""``model(tokens)``, compiled (once per shape: the naive loop's lengths are few)."""


@pytest.fixture(scope="module")
def tiny_model() -> Transformer:
    return Transformer(TINY, rngs=nnx.Rngs(0))


def naive_greedy(model: nnx.Module, prompt: list[int], n: int, window: int) -> list[int]:
    """The reference: the whole unpadded sequence (its newest ``window`` ids) each step."""
    ids = list(prompt)
    for _ in range(n):
        out = logits(model, jnp.asarray([ids[-window:]], jnp.int32))
        ids.append(int(jnp.argmax(out[:, -1], axis=-1)[0]))
    return ids[len(prompt):]


@pytest.mark.parametrize("prompt, n", [([3], 5), ([1, 5, 7, 2, 9], 5), ([4, 8] * 5, 3)])
def test_greedy_matches_a_naive_loop(tiny_model, prompt, n):
    # The last two run past max_seq_len=8 (the last from the start): the model then sees
    # the newest 8 ids.
    got = generate(tiny_model, prompt, max_new_tokens=n)
    assert got == naive_greedy(tiny_model, prompt, n, TINY.max_seq_len)
    assert len(got) == n


def test_eos_stops_generation(tiny_model):
    full = generate(tiny_model, [1, 2, 3], max_new_tokens=8)
    stop = full[2]
    got = generate(tiny_model, [1, 2, 3], max_new_tokens=8, eos_id=stop)
    assert got == full[:full.index(stop) + 1]
    assert generate(tiny_model, np.array([1, 2]), max_new_tokens=0) == []


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny_model):
    prompt = [1, 2, 3]
    kw = dict(max_new_tokens=10, temperature=2.0)
    first = generate(tiny_model, prompt, seed=0, **kw)
    assert generate(tiny_model, prompt, seed=0, **kw) == first
    others = [generate(tiny_model, prompt, seed=s, **kw) for s in (1, 2)]
    assert any(o != first for o in others)
    assert len(set(first + others[0] + others[1])) > 1
    greedy = generate(tiny_model, prompt, max_new_tokens=10)
    assert generate(tiny_model, prompt, seed=5, top_k=1, **kw) == greedy
    top3 = generate(tiny_model, prompt, seed=0, top_k=3, **kw)
    assert len(top3) == 10 and all(0 <= t < TINY.vocab_size for t in top3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A byte-level run, and a LoRA run fine-tuned from it (3 steps each)."""
    root = tmp_path_factory.mktemp("runs")
    base, lora = root / "base", root / "lora"
    assert main(["train", "--config", "configs/tiny.yaml", "--devices", "8", "--out",
                 str(base), *SMALL]) == 0
    assert main(["train", "--config", "configs/tiny-lora.yaml", "--devices", "8", "--out",
                 str(lora), *SMALL, f"init_from={base}/checkpoints"]) == 0
    return base, lora


@pytest.fixture(scope="module")
def loaded(runs):
    """:func:`load_run_model` of both runs."""
    return tuple(load_run_model(run) for run in runs)


def test_sample_prints_the_prompt_and_the_models_continuation(runs, loaded, capsys):
    base, _ = runs
    capsys.readouterr()
    assert main(["sample", "--run", str(base), "--prompt", "ab", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ab")
    model, config = loaded[0]
    assert config.model.d_model == 32 and not config.data.tokenizer
    new = generate(model, list(b"ab"), max_new_tokens=5)
    assert out == TextCodec().decode([*b"ab", *new]) + "\n"
    # The trained weights were loaded, not the initial ones.
    fresh = Transformer(config.model.transformer(), rngs=nnx.Rngs(config.train.seed))
    assert not np.allclose(model.embed[...], fresh.embed[...])


def test_lora_run_samples_with_its_adapters(runs, loaded, capsys):
    _, lora = runs
    capsys.readouterr()
    assert main(["sample", "--run", str(lora), "--prompt", "ab", "--max-tokens", "5",
                 "--temperature", "0.8", "--top-k", "20", "--seed", "3"]) == 0
    assert capsys.readouterr().out.startswith("ab")
    (base_model, _), (model, config) = loaded
    assert config.lora.enabled
    # The base came from the first run (init_from); the adapters were trained (B starts 0).
    assert np.array_equal(model.embed[...], base_model.embed[...])
    adapters = nnx.state(model, nnx.LoRAParam)
    b = [x for p, x in nnx.to_flat_state(adapters) if p[-1] == "lora_b"]
    assert b and any(float(jnp.abs(x[...]).max()) > 0 for x in b)
    tokens = jnp.asarray([list(b"hello")], jnp.int32)
    with_lora = logits(model, tokens)
    nnx.update(model, jax.tree.map(jnp.zeros_like, adapters))
    try:
        without = logits(model, tokens)
    finally:
        nnx.update(model, adapters)
    assert not np.allclose(with_lora, without)
    np.testing.assert_allclose(without, logits(base_model, tokens), rtol=1e-5, atol=1e-5)


def test_sample_int8_runs_llm_int8_close_to_the_float_model(runs, loaded, capsys):
    """``jaxpar sample --int8``: every projection but the head in int8 with LLM.int8's
    float outlier columns; the next-token logits stay within 2% of the float model's and
    the command prints the int8 model's greedy continuation."""
    from jaxpar.adapters.quant import QuantizedProjection, llm_int8

    base, _ = runs
    model, config = loaded[0]
    tokens = jnp.asarray([list(b"hello world, ab")], jnp.int32)
    want = np.asarray(logits(model, tokens))
    fresh, _ = load_run_model(base)
    int8 = llm_int8(fresh, skip=lambda path, _: "lm_head" in map(str, path))
    assert isinstance(int8.blocks.mlp.w_up, QuantizedProjection)
    assert not isinstance(int8.lm_head, QuantizedProjection)
    got = np.asarray(logits(int8, tokens))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02
    capsys.readouterr()
    assert main(["sample", "--run", str(base), "--prompt", "ab", "--max-tokens", "5",
                 "--int8"]) == 0
    new = generate(int8, list(b"ab"), max_new_tokens=5)
    assert capsys.readouterr().out == TextCodec().decode([*b"ab", *new]) + "\n"
