"""Chat templates (jaxpar.data.chat) against ``transformers``' ``apply_chat_template``,
token for token, on the Llama 3, Gemma, Qwen2 (ChatML) and Phi-3 templates; the
assistant-only mask against the assistant contents' character spans and against
``transformers``' own ``{% generation %}`` mask; the conversation reader's one-line
errors; the loader's rows; the masked loss's gradient."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.data.chat import ChatTokenizer
from jaxpar.data.conversations import ChatLoader, pad_id, read_conversations
from jaxpar.errors import JaxparError
from jaxpar.training.objective import lm_loss
from tests.data.chat_families import CONVERSATIONS, FAMILIES, save_family, tokenizer_object

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> its tokenizer folder (one BPE trained for all)."""
    root = tmp_path_factory.mktemp("chat")
    tokenizer = tokenizer_object()
    return {family: save_family(family, root / family, tokenizer) for family in FAMILIES}


def _reference(folder, conversation, add_generation_prompt):
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    return hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                  tokenize=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ids_equal_apply_chat_template(folders, family):
    chat = ChatTokenizer.load(str(folders[family]))
    compared = 0
    for conversation in CONVERSATIONS:
        for generation_prompt in (False, True):
            try:
                want = _reference(folders[family], conversation, generation_prompt)
            except Exception as exc:  # Gemma has no system role: both refuse
                with pytest.raises(JaxparError, match=str(exc)):
                    chat.render(conversation, generation_prompt)
                continue
            got, _ = chat.encode(chat.render(conversation, generation_prompt))
            assert got == want, (family, conversation, generation_prompt)
            compared += 1
    assert compared >= 4
    # A generation prompt is what the model is asked with: the rendered turn opener.
    assert chat.prompt_ids(CONVERSATIONS[2][:3]) == _reference(
        folders[family], CONVERSATIONS[2][:3], True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_assistant_mask_covers_assistant_content_only(folders, family):
    chat = ChatTokenizer.load(str(folders[family]))
    stop_tokens = {chat.tokenizer.id_to_token(i) for i in chat.stop_ids}
    for conversation in CONVERSATIONS:
        if family == "gemma" and conversation[0]["role"] == "system":
            continue
        text = chat.render(conversation)
        ids, offsets = chat.encode(text)
        _, mask = chat.conversation(conversation)
        # Each message's (trimmed) content, found in order in the text.
        at, spans = 0, []
        for message in conversation:
            content = message["content"].strip()
            start = text.index(content, at)
            at = start + len(content)
            spans.append((message["role"], start, at))
        for role, start, end in spans:
            inside = [t for t, (s, e) in enumerate(offsets) if s < end and e > start]
            assert inside
            assert all(mask[t] == (role == "assistant") for t in inside), (role, text)
            if role == "assistant":  # the turn's end token is learned too
                after = next(t for t, (s, e) in enumerate(offsets)
                             if s >= end and text[s:e].strip())
                assert mask[after] and chat.tokenizer.id_to_token(ids[after]) in (
                    stop_tokens | {"<|eot_id|>"}), text[end:]
        # Nothing outside the assistant turns but their end: no opener, no user text.
        assert sum(mask) < len(mask)
        for t in np.flatnonzero(mask):
            s, e = offsets[t]
            assert any(s < b + 24 and e > a for r, a, b in spans if r == "assistant")


def test_mask_equals_transformers_generation_mask(folders, tmp_path):
    """ChatML with ``{% generation %}`` around the assistant's turn: transformers' own
    ``return_assistant_tokens_mask`` is jaxpar's mask."""
    template = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
        "{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
        "{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n'}}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    hf = transformers.AutoTokenizer.from_pretrained(str(folders["qwen2"]))
    hf.chat_template = template
    hf.save_pretrained(str(tmp_path))
    chat = ChatTokenizer.load(str(tmp_path))
    for conversation in CONVERSATIONS:
        want = hf.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids, mask = chat.conversation(conversation)
        assert ids == want["input_ids"]
        assert mask == want["assistant_masks"]


def test_stop_ids_are_the_eos_and_end_of_turn(folders):
    tokens = {family: {ChatTokenizer.load(str(folders[family])).tokenizer.id_to_token(i)
                       for i in ChatTokenizer.load(str(folders[family])).stop_ids}
              for family in FAMILIES}
    assert tokens == {"llama3": {"<|eot_id|>"}, "gemma": {"<eos>", "<end_of_turn>"},
                      "qwen2": {"<|im_end|>"}, "phi3": {"<|endoftext|>", "<|end|>"}}


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


@pytest.mark.parametrize("family, record, culprit", [
    ("llama3", {"text": "hi"}, ':2: the record has no "messages"'),
    ("llama3", "{not json", ":2: not JSON"),
    ("llama3", {"messages": [{"role": "robot", "content": "x"}]},
     ":2: message 1 has the unknown role 'robot'"),
    ("llama3", {"messages": [{"role": "user"}]}, ':2: message 1 has no text "content"'),
    ("llama3", {"messages": [{"role": "user", "content": "x"}]}, ":2: no assistant message"),
    ("gemma", {"messages": [{"role": "system", "content": "x"},
                            {"role": "assistant", "content": "y"}]},
     ":2: the chat template refuses the conversation: System role not supported"),
    ("llama3", {"messages": [{"role": "user", "content": "cat " * 80},
                             {"role": "assistant", "content": "ok"}]},
     r":2: the conversation is \d+ tokens, more than train.seq_len \+ 1 = 64"),
])
def test_bad_conversations_name_file_and_line(folders, tmp_path, family, record, culprit):
    good = {"messages": CONVERSATIONS[0]}
    path = _jsonl(tmp_path / "chat.jsonl", [good, record])
    chat = ChatTokenizer.load(str(folders[family]))
    with pytest.raises(JaxparError, match=culprit) as info:
        read_conversations(path, chat, 64)
    assert "\n" not in str(info.value) and f"{tmp_path / 'chat.jsonl'}:2" in str(info.value)


def test_no_template_is_one_line(tmp_path):
    tokenizer_object().save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(JaxparError, match="no chat template"):
        ChatTokenizer.load(str(tmp_path))


def test_loader_rows_pad_and_mask_deterministically(folders, tmp_path):
    chat = ChatTokenizer.load(str(folders["qwen2"]))
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS] + [""])
    conversations = read_conversations(path, chat, 96)
    assert len(conversations) == 3
    loader = ChatLoader(conversations, pad_id(chat), 4, 95, seed=3)
    batch = loader.batch(5)
    assert {k: v.shape for k, v in batch.items()} == {
        k: (4, 96) for k in ("tokens", "segment_ids", "loss_mask")}
    for tokens, segments, mask in zip(batch["tokens"], batch["segment_ids"],
                                      batch["loss_mask"], strict=True):
        n = int((segments == 0).sum())
        match = [i for i, (ids, _) in enumerate(conversations) if len(ids) == n
                 and (ids == tokens[:n]).all()]
        assert match and (conversations[match[0]][1] == mask[:n]).all()
        assert (tokens[n:] == pad_id(chat)).all() and not mask[n:].any()
    again = ChatLoader(conversations, pad_id(chat), 4, 95, seed=3).batch(5)
    assert all((batch[k] == again[k]).all() for k in batch)
    # One epoch of 3 rows holds each conversation once.
    firsts = [tuple(loader.row(i)[0]) for i in range(3)]
    assert len(set(firsts)) == 3


def test_masked_loss_ignores_everything_but_the_assistant(folders):
    """Changing the tokens after the last assistant turn (the closing user message)
    changes neither the loss nor its gradient; without the mask both change (so the
    check can fail), and the loss is the hand-masked mean of the per-token losses."""
    from jaxpar.models import Transformer, TransformerConfig

    chat = ChatTokenizer.load(str(folders["llama3"]))
    ids, mask = chat.conversation(CONVERSATIONS[2])  # ends with a user message
    ids, mask = np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    last = int(np.flatnonzero(mask)[-1])
    assert last < len(ids) - 4
    other = ids.copy()
    other[last + 1:] = (ids[last + 1:] + 7) % 300
    config = TransformerConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4,
                               n_kv_heads=2, d_ff=64, max_seq_len=128)
    model = Transformer(config, rngs=nnx.Rngs(0))

    def batch(tokens, with_mask=True):
        out = {"tokens": jnp.asarray(tokens[None]),
               "segment_ids": jnp.zeros((1, len(tokens)), jnp.int32)}
        return {**out, "loss_mask": jnp.asarray(mask[None])} if with_mask else out

    @nnx.jit
    def loss_and_grad(m, b):
        return nnx.value_and_grad(lambda m: lm_loss(m, b))(m)

    (la, ga), (lb, gb) = loss_and_grad(model, batch(ids)), loss_and_grad(model, batch(other))
    assert float(la) == pytest.approx(float(lb), abs=1e-6)
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.abs(a - b).max(), ga, gb))
    assert max(float(d) for d in diffs) < 1e-6
    (ua, gua), (ub, gub) = (loss_and_grad(model, batch(ids, False)),
                            loss_and_grad(model, batch(other, False)))
    assert abs(float(ua) - float(ub)) > 1e-3
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.abs(a - b).max(), gua, gub))
    assert max(float(d) for d in diffs) > 1e-4
    logits = model(jnp.asarray(ids[None, :-1]))
    logp = jax.nn.log_softmax(logits[0].astype(jnp.float32))
    nll = -np.asarray(logp)[np.arange(len(ids) - 1), ids[1:]]
    want = float((nll * mask[1:]).sum() / mask[1:].sum())
    assert float(la) == pytest.approx(want, rel=1e-5)


REASONING = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- 'Tools:' }}{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}"
    "{%- set think = loop.index0 > ns.last_user and (loop.last or m.reasoning_content) %}"
    "{%- set given = think and not m.reasoning_content and enable_thinking is defined"
    " and enable_thinking is false %}"
    "{%- if given %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- generation %}"
    "{%- if think and not given %}"
    "{{- '<think>\n' + (m.reasoning_content or '') + '\n</think>\n\n' }}{%- endif %}"
    "{{- m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '\n<tool_call>\n' + call.function | tojson + '\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endgeneration %}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}")
"""A template in Qwen3's manner: an assistant turn's reasoning block is written only after
the last user message (earlier turns lose it once a user speaks again), and there only
when it has reasoning or ends the conversation; tools are listed in the system turn, tool
calls follow the content, and ``enable_thinking=False`` opens the turn with an empty
reasoning block, which the model is given, not asked to write."""

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
REASONED = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris.", "reasoning_content": "France: Paris."},
     {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome.", "reasoning_content": "Italy: Rome."}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Is it raining in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "rain"},
     {"role": "assistant", "content": "Yes, it rains.", "reasoning_content": "The tool said so."},
     {"role": "user", "content": "Thanks."},
     {"role": "assistant", "content": "You are welcome."}],
    [{"role": "user", "content": "Is it raining in Rome?"},
     {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.", "tool_calls": [
         {"type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}}]},
     {"role": "tool", "content": "sun"},
     {"role": "assistant", "content": "No, it is sunny.", "reasoning_content": "Sun, no rain."},
     {"role": "user", "content": "And tomorrow?"},
     {"role": "assistant", "content": "I cannot tell.", "reasoning_content": "No forecast."}],
]
"""Reasoning in two turns, the first dropped from the whole; a tool call, its response, and
reasoning on the answer to it; a reasoned tool call and a reasoned answer, both dropped
from the whole once the user speaks again (the conversation before the answer, rendered
alone, keeps the call's reasoning: it disagrees with the whole)."""


@pytest.mark.parametrize("thinking", [None, False])
def test_reasoning_and_tools_render_and_mask_as_transformers_does(folders, tmp_path, thinking):
    """Earlier turns rendered otherwise once later ones follow, tools and the thinking
    switch: ids equal ``apply_chat_template``'s and the mask its own ``{% generation %}``
    mask (every assistant turn learned, the reasoning only where the text keeps it)."""
    hf = transformers.AutoTokenizer.from_pretrained(str(folders["qwen2"]))
    hf.chat_template = REASONING
    hf.save_pretrained(str(tmp_path))
    chat = ChatTokenizer.load(str(tmp_path))
    options = {} if thinking is None else {"enable_thinking": thinking}
    for conversation in REASONED:
        if thinking is False:  # no reasoning to learn where the prompt says not to think
            conversation = [{k: v for k, v in m.items() if k != "reasoning_content"}
                            for m in conversation]
        want = hf.apply_chat_template(conversation, tools=[WEATHER], tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True,
                                      **options)
        ids, mask = chat.conversation(conversation, tools=[WEATHER], options=options)
        assert ids == want["input_ids"]
        assert mask == want["assistant_masks"]
        turns = sum(m["role"] == "assistant" for m in conversation)
        assert np.count_nonzero(np.diff([0, *mask]) == 1) == turns  # each turn a run
        prompt = chat.prompt_ids(conversation[:-1], tools=[WEATHER], options=options)
        assert prompt == hf.apply_chat_template(conversation[:-1], tools=[WEATHER],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=True, **options)["input_ids"]


def test_conversation_records_carry_tools_and_template_options(folders, tmp_path):
    hf = transformers.AutoTokenizer.from_pretrained(str(folders["qwen2"]))
    hf.chat_template = REASONING
    hf.save_pretrained(str(tmp_path / "tok"))
    chat = ChatTokenizer.load(str(tmp_path / "tok"))
    source = tmp_path / "chats.jsonl"
    records = [{"messages": REASONED[1], "tools": [WEATHER],
                "chat_template_kwargs": {"enable_thinking": False}}, {"messages": REASONED[0]}]
    source.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (ids, mask), (ids0, mask0) = read_conversations(str(source), chat, 512)
    assert (list(ids), list(mask)) == chat.conversation(
        REASONED[1], tools=[WEATHER], options={"enable_thinking": False})
    assert "Tools:" in chat.tokenizer.decode(list(ids)) and list(ids0) == chat.conversation(
        REASONED[0])[0]
    for bad, culprit in [({"tools": {"name": "weather"}}, '"tools" is not a list'),
                         ({"chat_template_kwargs": [1]}, '"chat_template_kwargs" is not an')]:
        source.write_text(json.dumps({"messages": REASONED[0], **bad}) + "\n")
        with pytest.raises(JaxparError, match=f"chats.jsonl:1: {culprit}"):
            read_conversations(str(source), chat, 512)
