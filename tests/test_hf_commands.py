"""The Hugging Face workflow through the CLI (``init_from=hf:``, ``jaxpar export``,
``jaxpar convert``) checked against transformers and peft, and sharded loading/saving by 2
real processes x 4 CPU devices, each reading only its share of the checkpoint."""

import io
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.adapters import lora
from jaxpar.cli import main
from jaxpar.runs.distributed import free_port, run_all
from jaxpar.runs.generate import load_run_model
from tests.helpers import without_cache
from tests.test_hf import IDS, TOL, make_hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


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


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory):
    folder, text = base
    out = tmp_path_factory.mktemp("lora") / "run"
    code = main(["train", "--config", "configs/tiny-lora.yaml", "--devices", "8", "--out",
                 str(out), f"init_from=hf:{folder}", f"data.source={text}",
                 f"data.tokenizer={folder}", "mesh.fsdp=4", "mesh.tensor=2", "mesh.data=1",
                 "train.steps=4", "train.seq_len=16", "train.global_batch=8", "train.lr=0.05",
                 "train.eval_every=0", "checkpoint.every=4"])
    assert code == 0
    return out


def test_lora_on_a_hugging_face_model_exports_for_peft(base, lora_run, tmp_path, capsys):
    folder, _ = base
    tuned = _jaxpar_logits(lora_run)
    base_logits = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(folder).eval())
    assert np.abs(tuned - base_logits).max() > 100 * TOL  # the fine-tune changed something
    model, _ = load_run_model(lora_run)
    for _, lp in lora.adapted(model):  # with the adapters zeroed, the base model remains
        lp.lora_b.set_value(jnp.zeros_like(lp.lora_b.get_value()))
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(IDS))), base_logits, atol=TOL,
                               rtol=0)

    adapters = tmp_path / "adapters"
    assert main(["export", "--run", str(lora_run), "--to-hf", str(adapters), "--adapters"]) == 0
    assert (adapters / "tokenizer.json").is_file()
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder) and config["r"] == 8
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with_peft = peft.PeftModel.from_pretrained(hf_base, adapters).eval()
    np.testing.assert_allclose(_hf_logits(with_peft), tuned, atol=TOL, rtol=0)

    merged = tmp_path / "merged"
    assert main(["export", "--run", str(lora_run), "--to-hf", str(merged), "--merge-lora"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    np.testing.assert_allclose(_hf_logits(back.eval()), tuned, atol=TOL, rtol=0)
    assert "wrote PEFT adapters" in capsys.readouterr().out

    for args, message in (
        ([], "the run trained LoRA adapters: pass --merge-lora"),
        (["--merge-lora", "--adapters"], "--merge-lora and --adapters exclude each other"),
    ):
        assert main(["export", "--run", str(lora_run), "--to-hf", str(tmp_path / "x"),
                     *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()


def test_convert_then_train_from_it(base, tmp_path, capsys):
    folder, text = base
    run = tmp_path / "converted"
    assert main(["convert", "--from-hf", str(folder), "--out", str(run), "--devices", "8"]) == 0
    want = _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(folder).eval())
    np.testing.assert_allclose(_jaxpar_logits(run), want, atol=TOL, rtol=0)
    out = tmp_path / "whole"
    assert main(["export", "--run", str(run), "--to-hf", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert np.abs(_hf_logits(back.eval()) - want).max() < 0.5  # bf16 weights only
    capsys.readouterr()
    for argv, message in (
        (["convert", "--from-hf", str(text), "--out", str(tmp_path / "y")],
         "has no config.json (not a Hugging Face model folder)"),
        (["convert", "--from-hf", str(folder), "--out", str(run)], "--resume"),
        (["export", "--run", str(run), "--to-hf", str(tmp_path / "y"), "--adapters"],
         "the run has no LoRA adapters; drop --adapters"),
        (["train", "--config", "configs/tiny.yaml", "init_from=hf:" + str(text)],
         "is not a Hugging Face model folder (no config.json)"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    assert not (tmp_path / "y").exists()


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
