"""Cells of ``05_finetune_hf.ipynb``: a Hugging Face model fine-tuned with LoRA by jaxpar and
handed back to transformers + PEFT. Imported by ``make_notebooks.py``, which writes the
notebook; ``examples/finetune_hf.py`` is the same story as a script."""

from __future__ import annotations


def finetune_hf(setup: str) -> list[str]:
    """The notebook's cells (``md:`` marks markdown); ``setup`` is the device set-up cell."""
    return [
        '''md:# Fine-tuning a Hugging Face model

jaxpar reads Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Gemma) straight into
its sharded decoder and writes them back. This notebook goes the whole round trip on 8
simulated CPU devices, with a model small enough to train in seconds:

1. make a tiny random Qwen2 model with `transformers`, and a tokenizer for it trained with
   `tokenizers` on a text file written here;
2. fine-tune LoRA adapters on that text with `jaxpar train`, starting from the Hugging Face
   folder, on an `fsdp=4 x tensor=2` mesh;
3. export the adapters in PEFT's format with `jaxpar export --adapters`;
4. load them with `transformers` + `peft` and compare logits with jaxpar's;
5. plot the loss and continue a prompt with `jaxpar sample`.

It needs the `hf` extra (CPU torch, transformers, peft): `pip install -e ".[hf]"`.''',
        setup,
        '''md:## A Hugging Face model to start from

Any folder with a `config.json` and safetensors will do; here it is made on the spot. The
text is five sentences, shuffled on every line, so a model that learned it continues the
start of a sentence with its end. The tokenizer is byte-level BPE: the 256 bytes, `<unk>`,
`</s>` (which jaxpar appends to each document) and 42 merges learned from that text, 300
tokens in all; the model's embedding has a few rows more (320), as real models often do.
The weights are random, with a large initial spread so that the frozen output layer can
still give confident predictions once the adapters steer it.''',
        '''\
import random
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

transformers.utils.logging.disable_progress_bar()
scratch = tempfile.TemporaryDirectory(prefix="finetune-hf-")  # removed with the kernel
work = Path(scratch.name)
base, text, run, adapters = work / "qwen2-tiny", work / "corpus.txt", work / "run", \\
    work / "adapters"

SENTENCES = [
    "the quick brown fox jumps over the lazy dog.",
    "a small model learns a short text by heart.",
    "every device holds a slice of every weight.",
    "adapters train while the base stays frozen.",
    "sharded arrays meet again in one safetensors file.",
]
rng = random.Random(0)
text.write_text("\\n".join(" ".join(rng.sample(SENTENCES, 5)) for _ in range(120)) + "\\n")

tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train([str(text)], trainers.BpeTrainer(
    vocab_size=300, special_tokens=["<unk>", "</s>"], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                     eos_token="</s>", pad_token="</s>").save_pretrained(base)

eos = tok.token_to_id("</s>")
config = transformers.Qwen2Config(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    initializer_range=0.2)
torch.manual_seed(0)
transformers.Qwen2ForCausalLM(config).save_pretrained(base)
print(sorted(p.name for p in base.iterdir()))
print(tok.encode(SENTENCES[0]).tokens)''',
        '''md:## LoRA on fsdp=4 x tensor=2

`init_from=hf:FOLDER` does two things: the model section of the config becomes the model
of `FOLDER/config.json` (sizes, Qwen2's q/k/v biases, RoPE), and each weight is read from
the safetensors straight into the sharding the plan gives it. `data.source` is the text
file and `data.tokenizer` the folder holding `tokenizer.json`; the text is tokenized once
and cached beside it. The rest comes from `configs/tiny-lora.yaml`: rank-8 adapters on
every attention and MLP projection, only the adapters train, 5% of the text held out.

`jaxpar.cli.main` is the `jaxpar` command; the helper below runs a command line in this
kernel, as the shell would.''',
        '''\
import shlex

from jaxpar.cli import main as cli


def jaxpar(command):
    assert cli(shlex.split(command)) == 0, command


jaxpar(f"train --config configs/tiny-lora.yaml --out {run} init_from=hf:{base} "
       f"data.source={text} data.tokenizer={base} mesh.fsdp=4 mesh.tensor=2 "
       "train.steps=120 train.global_batch=8 train.seq_len=32 train.lr=1e-2")''',
        '''md:The run folder holds the config (with the model section read from the Hugging Face
folder), one JSON row of metrics per step and the checkpoints. The held-out loss is
measured every 10 steps.''',
        '''\
import json

import matplotlib.pyplot as plt

rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
evals = [r for r in rows if "eval_loss" in r]
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train")
ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held out")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy")
ax.set_title("LoRA fine-tuning of a tiny Qwen2, fsdp=4 x tensor=2", fontsize=10)
ax.legend()
fig.tight_layout()
print(f"loss {rows[0]['loss']:.2f} -> {rows[-1]['loss']:.2f}, "
      f"held out {evals[-1]['eval_loss']:.2f}")''',
        '''md:## The adapters in PEFT's format

`jaxpar export --adapters` writes only the adapters, as `adapter_config.json` and
`adapter_model.safetensors`, under the names PEFT gives the Hugging Face modules
(`blocks/attn/wq` becomes `model.layers.{i}.self_attn.q_proj`). The config records the
base folder the run started from, and the tokenizer is copied alongside.
(`--merge-lora` would instead fold the adapters into the weights and write a whole model.)''',
        '''\
jaxpar(f"export --run {run} --to-hf {adapters} --adapters")
print(sorted(p.name for p in adapters.iterdir()))
adapter_config = json.loads((adapters / "adapter_config.json").read_text())
print({k: adapter_config[k] for k in ("r", "lora_alpha", "target_modules",
                                      "base_model_name_or_path")})''',
        '''md:## Back in transformers + PEFT

PEFT puts the adapters on the base model, the tokenizer comes from the adapter folder,
and the logits of the same tokens are compared with those of jaxpar's model of the run
(`load_run_model` rebuilds it on one device from the newest checkpoint).''',
        '''\
import warnings

import jax.numpy as jnp
import numpy as np
import peft

from jaxpar.runs.generate import load_run_model

# PEFT calls a transformers method that transformers 5 has deprecated.
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
tuned = peft.PeftModel.from_pretrained(hf_base, adapters).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained(adapters)
ids = torch.tensor(tokenizer(text.read_text()).input_ids[:64]).reshape(2, 32)
with torch.no_grad():
    want = tuned(ids).logits.numpy()

model, run_config = load_run_model(run)
got = np.asarray(model(jnp.asarray(ids.numpy())))
diff = np.abs(got - want).max()
print(f"logits {got.shape}, max |PEFT - jaxpar| = {diff:.1e}")
assert diff < 1e-4''',
        '''md:## Sampling

`jaxpar sample` continues a prompt with the run's model (greedy unless `--temperature` is
given), encoding and decoding with the run's tokenizer. The PEFT model, greedy too, says
the same.''',
        '''\
jaxpar(f"sample --run {run} --prompt 'the quick brown' --max-tokens 20")
with torch.no_grad():
    out = tuned.generate(**tokenizer("the quick brown", return_tensors="pt"),
                         max_new_tokens=20, do_sample=False)
print(tokenizer.decode(out[0], skip_special_tokens=True))''',
    ]
