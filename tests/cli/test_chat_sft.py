"""Supervised fine-tuning on a chat jsonl from the command line: a tiny LoRA fine-tune of a
Hugging Face Llama with the Llama 3 chat template (``data.chat=true``), exported as PEFT
adapters that ``transformers`` + ``peft`` load with the template; ``jaxpar sample --chat``
asks with the template's generation prompt and stops at the end of turn; bad chat input is
one line with exit status 2."""

import json

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.data.chat import ChatTokenizer
from jaxpar.runs import generate as gen
from tests.data.chat_families import CONVERSATIONS, save_family, tokenizer_object

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """(model folder, chat jsonl, run folder): 3 LoRA steps on 12 conversations."""
    from tests.hf.test_convert import make_hf_model

    root = tmp_path_factory.mktemp("sft")
    folder = root / "llama"
    make_hf_model(folder, "llama31", vocab_size=448, max_position_embeddings=128)
    save_family("llama3", folder, tokenizer_object())
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 4))
    out = root / "run"
    code = main(["train", "--config", "configs/tiny-lora.yaml", "--devices", "8", "--out",
                 str(out), f"init_from=hf:{folder}", f"data.source={data}",
                 f"data.tokenizer={folder}", "data.chat=true", "data.holdout_fraction=0",
                 "mesh.fsdp=4", "mesh.tensor=2", "mesh.data=1", "train.steps=3",
                 "train.seq_len=95", "train.global_batch=4", "train.lr=0.05",
                 "train.eval_every=0", "checkpoint.every=3"])
    assert code == 0
    return folder, data, out


def test_lora_fine_tune_on_chat_jsonl_exports_for_peft(chat_run, tmp_path):
    folder, _, run = chat_run
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text()
              .splitlines() if "loss" in json.loads(line)]
    assert losses and all(np.isfinite(losses))
    adapters = tmp_path / "adapters"
    assert main(["export", "--run", str(run), "--to-hf", str(adapters), "--adapters"]) == 0
    peft = pytest.importorskip("peft")
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(hf_base, adapters).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(adapters))
    ids = tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=True, return_dict=True,
                                        add_generation_prompt=True)["input_ids"]
    assert ids == ChatTokenizer.load(str(folder)).prompt_ids(CONVERSATIONS[0])
    model, _ = gen.load_run_model(str(run))
    with torch.no_grad():
        want = tuned(torch.tensor([ids])).logits.float().numpy()
    np.testing.assert_allclose(np.asarray(model(np.asarray([ids]))), want, atol=1e-4, rtol=0)


def test_sample_chat_renders_the_prompt_and_stops_at_end_of_turn(chat_run, monkeypatch,
                                                                 capsys):
    folder, _, run = chat_run
    chat = ChatTokenizer.load(str(folder))
    hello = chat.tokenizer.encode(" Paris", add_special_tokens=False).ids
    eot = chat.tokenizer.token_to_id("<|eot_id|>")
    asked = {}

    def fake_generate(model, prompt, **kwargs):
        asked["prompt"] = list(prompt)
        yield from [*hello, eot, *hello]

    monkeypatch.setattr(gen, "generate_iter", fake_generate)
    assert main(["sample", "--run", str(run), "--chat", "--system", "Be brief.",
                 "--prompt", "What is the capital of France?", "--max-tokens", "8"]) == 0
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert asked["prompt"] == hf.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
    assert capsys.readouterr().out == " Paris\n"  # the reply alone, cut at <|eot_id|>


@pytest.mark.parametrize("line, culprit", [
    ('{"messages": [{"role": "robot", "content": "x"}]}',
     ":2: message 1 has the unknown role 'robot'"),
    ('{"text": "x"}', ':2: the record has no "messages"'),
])
def test_bad_chat_line_is_one_line_exit_2(chat_run, tmp_path, capsys, line, culprit):
    folder, _, _ = chat_run
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + line + "\n")
    code = main(["train", "--config", "configs/tiny-lora.yaml", "--devices", "8", "--out",
                 str(tmp_path / "run"), f"init_from=hf:{folder}", f"data.source={data}",
                 f"data.tokenizer={folder}", "data.chat=true", "train.steps=1",
                 "train.seq_len=95", "train.global_batch=8", "train.eval_every=0"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{data}{culprit}" in err


def test_chat_without_tokenizer_is_refused(tmp_path, capsys):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    code = main(["train", "--config", "configs/tiny-lora.yaml", "--devices", "8", "--out",
                 str(tmp_path / "run"), f"data.source={data}", "data.chat=true"])
    assert code == 2
    assert "data.chat=true renders conversations with a chat template" in (
        capsys.readouterr().err)


def test_system_without_chat_is_refused(tmp_path, capsys):
    assert main(["sample", "--run", str(tmp_path), "--prompt", "ab", "--system", "x"]) == 2
    assert capsys.readouterr().err == (
        "jaxpar: error: --system is a chat's system message: add --chat\n")


def test_first_step_loss_is_the_assistant_only_loss(chat_run):
    """The run's step-1 loss (LoRA B = 0: the base model) is the mean next-token loss of
    transformers' logits over the assistant's targets of batch 0, not over all targets."""
    from jaxpar.data.conversations import ChatLoader, pad_id, read_conversations

    folder, data, run = chat_run
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    chat = ChatTokenizer.load(str(folder))
    batch = ChatLoader(read_conversations(str(data), chat, 96), pad_id(chat), 4, 95,
                       seed=0).batch(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(torch.tensor(batch["tokens"][:, :-1])).logits.double()
    nll = -torch.log_softmax(logits, -1).gather(
        -1, torch.tensor(batch["tokens"][:, 1:, None]).long())[..., 0].numpy()
    same = batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1]
    assistant = same & (batch["loss_mask"][:, 1:] > 0)
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(nll[assistant].mean(), abs=2e-4)
    assert abs(first["loss"] - nll[same & (batch["segment_ids"][:, 1:] == 0)].mean()) > 0.01
