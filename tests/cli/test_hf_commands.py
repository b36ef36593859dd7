"""A tiny Hugging Face model (the ``base`` fixture, shared with tests/cli/test_convert.py and
tests/cli/test_export.py) and its sharded loading/saving by 2 real processes x 4 CPU
devices, each reading only its share of the checkpoint, checked against transformers."""

import io
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.runs.distributed import free_port, run_all
from jaxpar.runs.generate import load_run_model
from tests.helpers import without_cache
from tests.hf.test_convert import IDS, TOL, make_hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


def _jaxpar_logits(run) -> np.ndarray:
    model, _ = load_run_model(run)
    return np.asarray(model(jnp.asarray(IDS)))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen2 model with a byte-level BPE tokenizer trained on the text it will be
    fine-tuned on: (model folder, text folder)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("hfcli")
    text = root / "text"
    text.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    (text / "a.txt").write_text(" ".join(rng.choice(words, 6000)))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train([str(text / "a.txt")], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = root / "qwen2"
    make_hf_model(folder, "qwen2", vocab_size=320)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder, text


def test_two_processes_read_their_share_and_save_together(base, tmp_path):
    folder, _ = base
    out = tmp_path / "saved"
    env = dict(without_cache(os.environ), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAXPAR_COORDINATOR=f"127.0.0.1:{free_port()}", JAXPAR_NUM_PROCESSES="2")
    cmd = [sys.executable, "-m", "tests.hf_worker", str(folder), str(out),
           json.dumps(IDS.tolist())]
    log = io.StringIO()
    code = run_all([cmd, cmd], [dict(env, JAXPAR_PROCESS_ID=str(i)) for i in range(2)],
                   out=log)
    assert code == 0, log.getvalue()[-3000:]
    results = [json.loads((tmp_path / f"result-{i}.json").read_text()) for i in range(2)]
    assert sorted(r["process"] for r in results) == [0, 1]
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        total = sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118
    for r in results:  # each holds half the fsdp shards: about half the bytes, never all
        assert 0.45 * total < r["bytes_read"] < 0.6 * total, (r["bytes_read"], total)
    want = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(folder).eval())
    for r in results:
        np.testing.assert_allclose(np.array(r["logits"]), want, atol=TOL, rtol=0)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    np.testing.assert_allclose(_hf_logits(back.eval()), want, atol=TOL, rtol=0)
