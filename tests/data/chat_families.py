"""The chat templates of four families, copied from their ``tokenizer_config.json``, and a
tokenizer folder per family built offline (a byte-level BPE trained here, wrapped as
``transformers.PreTrainedTokenizerFast`` and saved with ``save_pretrained``).

Not a test module: ``tests/data/test_chat.py`` and ``tests/cli/test_chat_sft.py`` import it.
"""

from __future__ import annotations

from pathlib import Path

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
"""Meta-Llama-3-8B-Instruct's template."""

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
    "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
    "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\n'}}{% endif %}")
"""gemma-2-9b-it's template (Gemma 1 and 2 share it)."""

QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
"""Qwen2-7B-Instruct's template (ChatML with a default system message)."""

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
"""Phi-3-mini-4k-instruct's template (an EOS after a finished conversation)."""

FAMILIES = {
    "llama3": (LLAMA3, dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                            pad_token="<|end_of_text|>")),
    "gemma": (GEMMA, dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")),
    "qwen2": (QWEN2, dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    "phi3": (PHI3, dict(bos_token="<s>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")),
}
"""Each family's template and named special tokens (as its tokenizer_config.json has them)."""

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|begin_of_text|>", "<|end_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<bos>", "<eos>",
            "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
            "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

TEXT = ("You are a helpful assistant. What is the capital of France? The capital of France "
        "is Paris. And of Italy? Rome, of course. Tell me a joke about cats. Why did the cat "
        "sit on the computer? To keep an eye on the mouse! Thanks, bye. Goodbye, see you. ")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Tell me a joke about cats."},
     {"role": "assistant", "content": "Why did the cat sit on the computer?"}],
    [{"role": "user", "content": "What is the capital of France? "},
     {"role": "assistant", "content": " Paris."},
     {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome, of course.\n"},
     {"role": "user", "content": "Thanks, bye."}],
]
"""No system message, a system message, several turns (with spaces a template trims)."""


def tokenizer_object():
    """A byte-level BPE trained on :data:`TEXT` with every family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def save_family(family: str, folder: Path, tokenizer=None) -> Path:
    """``family``'s tokenizer folder, written by ``transformers``' ``save_pretrained``."""
    import transformers

    template, special = FAMILIES[family]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer or tokenizer_object(), unk_token="<unk>", **special)
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder
