"""LoRA fine-tuning of a Hugging Face model on an FSDP x TP mesh (8 simulated CPU devices),
and the adapters back in transformers + PEFT with the same logits.

1. Make a tiny random Qwen2 model with ``transformers`` and a byte-level BPE tokenizer
   trained with ``tokenizers`` on a text file written here; save both as one folder.
2. ``jaxpar train`` LoRA adapters on that text with that tokenizer, starting from the
   folder (``init_from=hf:FOLDER``: the model section comes from its ``config.json``, the
   weights are read straight into their fsdp=4 x tensor=2 shardings).
3. ``jaxpar export --adapters``: the adapters in PEFT's format, the tokenizer alongside.
4. Load them with ``peft.PeftModel.from_pretrained`` onto the base model and check that
   its logits equal jaxpar's, then continue a prompt with both.

Needs the ``hf`` extra (CPU torch, transformers, peft): ``pip install -e ".[hf]"``.
Run: ``python examples/finetune_hf.py [--steps 120] [--out DIR]`` (about 35 s on two CPU
cores; without ``--out`` everything goes to a temporary folder, removed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from jaxpar import cli  # noqa: E402
from jaxpar.runs.generate import TextCodec, load_run_model  # noqa: E402

transformers.utils.logging.disable_progress_bar()
# PEFT calls a transformers method that transformers 5 has deprecated.
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = [
    "the quick brown fox jumps over the lazy dog.",
    "a small model learns a short text by heart.",
    "every device holds a slice of every weight.",
    "adapters train while the base stays frozen.",
    "sharded arrays meet again in one safetensors file.",
]


def write_text(path: Path, repeats: int = 120) -> None:
    """The fine-tuning text: the sentences above, in a new order on each line."""
    rng = random.Random(0)
    lines = [" ".join(rng.sample(SENTENCES, len(SENTENCES))) for _ in range(repeats)]
    path.write_text("\n".join(lines) + "\n")


def make_hf_model(folder: Path, text: Path) -> None:
    """A random Qwen2 model with a tokenizer trained on ``text``, saved to ``folder``."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(text)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                eos_token="</s>", pad_token="</s>")
    fast.save_pretrained(folder)  # tokenizer.json + tokenizer_config.json (names the EOS)
    eos = tok.token_to_id("</s>")
    config = transformers.Qwen2Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        initializer_range=0.2)  # large weights, so the frozen head can give confident logits
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    print(f"Hugging Face model: Qwen2, {tok.get_vocab_size()} tokens used of 320, in {folder}")


def jaxpar(*args: str) -> None:
    """Run a ``jaxpar`` command in this process (``python -m jaxpar.cli ...`` is the same)."""
    print("\n$ jaxpar", shlex.join(args), flush=True)
    if cli.main(list(args)) != 0:
        raise SystemExit(f"jaxpar {args[0]} failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--out", help="folder for the model, run and adapters (default: temporary)")
    args = ap.parse_args()
    if args.out:
        run(Path(args.out).resolve(), args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp), args.steps)


def run(work: Path, steps: int) -> None:
    base, text, out, adapters = (work / "qwen2-tiny", work / "text" / "corpus.txt",
                                 work / "run", work / "adapters")
    text.parent.mkdir(parents=True, exist_ok=True)
    write_text(text)
    make_hf_model(base, text)

    # 2. LoRA on fsdp=4 x tensor=2; configs/tiny-lora.yaml's model section is replaced by
    # the Hugging Face model's.
    jaxpar("train", "--config", str(ROOT / "configs/tiny-lora.yaml"), "--out", str(out),
           f"init_from=hf:{base}", f"data.source={text}", f"data.tokenizer={base}",
           "mesh.fsdp=4", "mesh.tensor=2", f"train.steps={steps}", "train.global_batch=8",
           "train.seq_len=32", "train.lr=1e-2")
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")

    # 3. The adapters alone, as PEFT writes them (the tokenizer is copied along).
    jaxpar("export", "--run", str(out), "--to-hf", str(adapters), "--adapters")
    print(sorted(p.name for p in adapters.iterdir()))

    # 4. transformers + PEFT against jaxpar's model of the run (on one device, newest
    # checkpoint, adapters included).
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tuned = peft.PeftModel.from_pretrained(hf_base, adapters).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapters)
    ids = torch.tensor(tokenizer(text.read_text()).input_ids[:64]).reshape(2, 32)
    with torch.no_grad():
        want = tuned(ids).logits.numpy()
    model, config = load_run_model(out)
    got = np.asarray(model(jnp.asarray(ids.numpy())))
    diff = float(np.abs(got - want).max())
    print(f"\nPEFT vs jaxpar logits {got.shape}: max |diff| {diff:.2e}")
    assert diff < 1e-4, diff

    # 5. Greedy continuations: jaxpar sample (with the run's data.tokenizer), then PEFT.
    prompt = "the quick brown"
    assert TextCodec.for_config(config).encode(prompt) == tokenizer(prompt).input_ids
    jaxpar("sample", "--run", str(out), "--prompt", prompt, "--max-tokens", "20")
    with torch.no_grad():
        new = tuned.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=20,
                             do_sample=False)
    print("transformers + PEFT, greedy:")
    print(tokenizer.decode(new[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
