"""Chat templates as the model families ship them, rendered as ``transformers`` does.

A Hugging Face tokenizer folder holds ``tokenizer.json`` (the ``tokenizers`` library) and
``tokenizer_config.json``, whose ``chat_template`` (a Jinja string; or a list of named
templates, ``default`` taken; or a ``chat_template.jinja`` file beside it, as newer
``transformers`` saves it) turns a conversation into text, and whose ``bos_token``,
``eos_token``, ``pad_token``... the template reads by name.

:class:`ChatTokenizer` renders a conversation with the same Jinja environment as
``transformers``' ``apply_chat_template`` (a sandbox, ``trim_blocks`` and
``lstrip_blocks``, ``loopcontrols``, ``raise_exception``, ``strftime_now``, its ``tojson``,
``dict`` and ``namespace``, the ``{% generation %}`` block) and encodes the text without
adding special tokens (the template writes them), so its ids equal ``apply_chat_template``'s
token for token.

The assistant turns of a conversation (for a loss on them only) are found by rendering:
turn ``i`` spans from where the conversation before it, rendered with
``add_generation_prompt=True`` (the prompt that opens an assistant turn), stops agreeing
with the whole to where the conversation up to it, rendered alone, does: its content and
what closes it (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, ``<|end|>``), which
the model must learn to write to stop. Templates that render a turn otherwise once later
turns follow (Qwen3 writes an assistant turn's reasoning, ``<think>...</think>``, only
after the last user message, and a non-thinking generation prompt's empty block only at
the end) are met: the turn is the longest tail of its lone rendering that the whole text
holds where the turn starts; where the conversation before a turn disagrees with the
whole because an earlier turn's reasoning is dropped there (a reasoned tool call, then the
answer, then a new user message), the turn is placed by the conversation before it
rendered without that reasoning. A token counts when it overlaps such a span (as
``transformers``' ``return_assistant_tokens_mask`` reads its spans).

A conversation may carry ``tools`` (function schemas, for templates that list them) and
template options (``enable_thinking`` and the like): they reach the template as
``apply_chat_template(..., tools=..., **options)`` passes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime
from os.path import commonprefix  # character by character: any strings
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from jaxpar.data.tokenizer import eos_id, load_tokenizer, tokenizer_json
from jaxpar.errors import JaxparError

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                 "cls_token", "mask_token")
"""The named special tokens ``transformers`` passes to a chat template."""

END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>",
               "<|end_of_text|>", "</s>", "<eos>")
"""Tokens that end an assistant turn in the families' templates: generation stops at any
of them that the template writes (besides the EOS and ``generation_config.json``'s)."""

ROLES = ("system", "user", "assistant", "tool")
"""The roles a conversation's messages may have."""


def _compile(template: str) -> Any:
    """``template`` compiled in ``transformers``' chat-template environment."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: rendered as its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                          ).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(template)


def _token_text(value: Any) -> str | None:
    """A special token's text: a string, or a serialised ``AddedToken``'s ``content``."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise JaxparError(f"cannot read {str(path)!r}: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise JaxparError(f"{str(path)!r} is not a JSON object")
    return data


@dataclasses.dataclass
class ChatTokenizer:
    """A family's tokenizer and chat template.

    Attributes:
      tokenizer: the ``tokenizers.Tokenizer`` of ``tokenizer.json``.
      template: the chat template's Jinja source.
      special: the named special tokens' text (``bos_token``, ``eos_token``, ...).
      stop_ids: the ids that end an assistant turn (EOS, end-of-turn tokens).
      name: where it came from, for messages.
    """

    tokenizer: Tokenizer
    template: str
    special: dict[str, str]
    stop_ids: tuple[int, ...]
    name: str = "data.tokenizer"

    def __post_init__(self) -> None:
        try:
            self._compiled = _compile(self.template)
        except ImportError:
            raise JaxparError(f"{self.name}: chat templates are rendered with jinja2, which "
                              "is not installed: pip install 'jinja2>=3.1.6'") from None
        except Exception as exc:  # a jinja2.TemplateSyntaxError
            raise JaxparError(f"{self.name}: the chat template does not compile: "
                              f"{' '.join(str(exc).split())}") from None

    @classmethod
    def load(cls, spec: str, what: str = "data.tokenizer") -> ChatTokenizer:
        """The tokenizer and chat template of the folder ``spec`` (or of the folder of the
        ``tokenizer.json`` file ``spec``).

        Raises:
          JaxparError: naming ``what`` when there is no tokenizer or no chat template.
        """
        tokenizer = load_tokenizer(spec)
        folder = tokenizer_json(spec).parent
        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        special_map = folder / "special_tokens_map.json"
        special: dict[str, str] = {}
        for source in ([_read_json(special_map)] if special_map.is_file() else []) + [config]:
            for name in SPECIAL_NAMES:
                if (text := _token_text(source.get(name))) is not None:
                    special[name] = text
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = folder / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if not isinstance(template, str) or not template:
            raise JaxparError(f"{what}={spec!r}: no chat template (neither a chat_template in "
                              f"{str(config_path)!r} nor a chat_template.jinja beside it)")
        return cls(tokenizer, template, special, _stop_ids(tokenizer, folder, special, template),
                   name=f"{what}={spec!r}")

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False, *,
               tools: Sequence[dict] | None = None, options: dict[str, Any] | None = None
               ) -> str:
        """The conversation as text, as ``apply_chat_template(messages, tokenize=False,
        add_generation_prompt=..., tools=tools, **options)``.

        Raises:
          JaxparError: when the template raises (``raise_exception``) or fails."""
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._compiled.render(**{
                **self.special, **(options or {}), "messages": plain,
                "tools": list(tools) if tools else None, "documents": None,
                "add_generation_prompt": add_generation_prompt})
        except Exception as exc:  # TemplateError from raise_exception, or any other
            why = " ".join(str(exc).split()) or type(exc).__name__
            raise JaxparError(f"the chat template refuses the conversation: {why}") from None

    def encode(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of rendered ``text`` (no special tokens added) and their character spans."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), list(encoding.offsets)

    def prompt_ids(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                   options: dict[str, Any] | None = None) -> list[int]:
        """The ids that ask the model for the next assistant turn of ``messages``."""
        return self.encode(self.render(messages, True, tools=tools, options=options))[0]

    def assistant_spans(self, messages: Sequence[dict], text: str, *,
                        tools: Sequence[dict] | None = None,
                        options: dict[str, Any] | None = None) -> list[tuple[int, int]]:
        """The character spans of ``text`` (the whole conversation rendered) that the
        assistant writes: each assistant turn's content and what closes it (see the
        module docstring).

        Raises:
          JaxparError: when the template renders the start of the conversation otherwise
            than the whole does, or a turn so that no part of it is found in the whole,
            so that the turn cannot be placed."""
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            for earlier in _as_the_whole_may_render(messages[:i]):
                before = self.render(earlier, tools=tools, options=options)
                prompt = self.render(earlier, True, tools=tools, options=options)
                start = len(commonprefix((prompt, text)))
                if start >= len(prompt) or (start >= len(before) and text.startswith(before)):
                    break
            else:
                raise JaxparError(f"message {i + 1}: the chat template renders the "
                                  "conversation before this assistant turn otherwise than "
                                  "the whole conversation begins, so the turn cannot be "
                                  "found for the loss")
            upto = self.render([*earlier, message], tools=tools, options=options)
            end = start + len(commonprefix((upto[start:], text[start:])))
            if end == start:  # rendered otherwise with later turns: its longest tail
                tail = next((upto[d:] for d in range(start + 1, len(upto))
                             if text.startswith(upto[d:], start)), "")
                end = start + len(tail)
            if end == start:
                raise JaxparError(f"message {i + 1}: the chat template renders this "
                                  "assistant turn otherwise in the whole conversation than "
                                  "alone, so the turn cannot be found for the loss")
            spans.append((start, end))
        return spans

    def conversation(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                     options: dict[str, Any] | None = None) -> tuple[list[int], list[int]]:
        """``(ids, mask)`` of a whole conversation: ``mask[t]`` is 1 where token ``t`` is
        written by the assistant (it overlaps an :meth:`assistant_spans` span)."""
        text = self.render(messages, tools=tools, options=options)
        ids, offsets = self.encode(text)
        spans = []
        for start, end in self.assistant_spans(messages, text, tools=tools,
                                               options=options):
            # Where the text agreed only up to the middle of a token (Phi-3's '<|' of the
            # next '<|user|>'), the turn ends before that token.
            cut = next((s for s, e in offsets if s < end < e), end)
            if cut > start:
                spans.append((start, cut))
        return ids, overlap_mask(offsets, spans)


def _as_the_whole_may_render(earlier: Sequence[dict]) -> list[Sequence[dict]]:
    """The conversation before an assistant turn as it is, then, when an earlier assistant
    turn carries reasoning, without it: a template may drop a turn's reasoning once a later
    turn follows (Qwen3's, once a user speaks again), so the start of the whole
    conversation may be the start rendered without it."""
    reasoned = any(m.get("role") == "assistant" and "reasoning_content" in m for m in earlier)
    if not reasoned:
        return [earlier]
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"}
             if m.get("role") == "assistant" else m for m in earlier]
    return [earlier, plain]


def overlap_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
                 ) -> list[int]:
    """1 for each token whose character span ``offsets[t]`` overlaps one of ``spans`` (both
    in order), else 0: ``transformers``' reading of its assistant spans."""
    mask, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = 1
    return mask


def _stop_ids(tokenizer: Tokenizer, folder: Path, special: dict[str, str], template: str
              ) -> tuple[int, ...]:
    """The EOS (``special``'s, else jaxpar's usual guess), ``generation_config.json``'s
    ``eos_token_id`` (one or a list) and the :data:`END_OF_TURN` tokens that the template
    writes and the vocabulary holds."""
    ids: list[int] = []
    eos = special.get("eos_token")
    if eos is not None and (found := tokenizer.token_to_id(eos)) is not None:
        ids.append(found)
    else:
        with contextlib.suppress(JaxparError):  # no EOS: the end-of-turn tokens stop
            ids.append(eos_id(tokenizer))
    generation = folder / "generation_config.json"
    if generation.is_file():
        value = _read_json(generation).get("eos_token_id")
        ids += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
    ids += [i for t in END_OF_TURN
            if t in template and (i := tokenizer.token_to_id(t)) is not None]
    return tuple(dict.fromkeys(ids))
