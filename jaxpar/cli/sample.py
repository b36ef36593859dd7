"""``jaxpar sample``: continue a prompt with a trained run's model."""

from __future__ import annotations

import argparse

from jaxpar.adapters import quant
from jaxpar.data.chat import ChatTokenizer
from jaxpar.errors import JaxparError
from jaxpar.runs import generate as gen
from jaxpar.runs.generate import check_run


def command(args: argparse.Namespace) -> int:
    """``jaxpar sample``: the prompt, then the model's continuation as it is generated.

    Prompt text the tokenizer has no token for is read as its unknown token (or left
    out, by tokenizers without one) and said in one warning line; generated ids the
    tokenizer has no text for print nothing and are counted in one warning line at the
    end. ``--max-tokens`` is bounded by what the model attends to after the prompt
    (``model.max_seq_len``); without it, 64 or what room is left.

    With ``--chat`` the prompt is a user message (after ``--system``, if given) rendered
    with the chat template of the run's ``data.tokenizer`` and its generation prompt; the
    reply alone is printed, ending at the family's EOS or end-of-turn token.
    """
    if not args.prompt:
        raise JaxparError("--prompt is empty: give the text to continue")
    if args.max_tokens is not None and args.max_tokens < 0:
        raise JaxparError(f"--max-tokens {args.max_tokens}: must be 0 or more")
    if not 0 <= args.temperature < float("inf"):
        raise JaxparError(f"--temperature {args.temperature}: must be 0 (greedy) or positive")
    if args.top_k < 0:
        raise JaxparError(f"--top-k {args.top_k}: must be 0 (every token) or positive")
    if args.system is not None and not args.chat:
        raise JaxparError("--system is a chat's system message: add --chat")
    check_run(args.run)
    config = gen.run_config(args.run)
    codec = gen.TextCodec.for_config(config)
    stops: tuple[int, ...] = ()
    if args.chat:
        if not config.data.tokenizer:
            raise JaxparError(f"--chat renders the prompt with a chat template, but the run "
                              f"{args.run!r} reads bytes (no data.tokenizer)")
        chat = ChatTokenizer.load(config.data.tokenizer, "the run's data.tokenizer")
        messages = ([{"role": "system", "content": args.system}] if args.system is not None
                    else []) + [{"role": "user", "content": args.prompt}]
        ids = chat.prompt_ids(messages)
        stops = chat.stop_ids
    else:
        ids = gen.prompt_ids(codec, args.prompt, "--prompt")

    def budget(room: tuple[int, str] | None) -> int | None:
        """--max-tokens checked against the room after the prompt (None: not known yet)."""
        if room is None:
            return None
        left, limit = room
        if args.max_tokens is None and left > 0:
            return min(64, left)
        if left == 0 and args.max_tokens != 0:
            raise JaxparError(f"--prompt is {len(ids)} tokens, which leaves no room to "
                              f"generate within {limit}: shorten --prompt")
        if args.max_tokens > left:
            raise JaxparError(f"--max-tokens {args.max_tokens} is more than the model can "
                              f"attend to after the prompt: {limit} minus the prompt's "
                              f"{len(ids)} tokens leaves {left}")
        return args.max_tokens

    max_tokens = budget(gen.context_room(config, len(ids)))  # before the model is built
    model, _ = gen.load_run_model(args.run)
    if args.int8:  # LLM.int8: int8 weights, outlier features in floats; the head stays
        quant.llm_int8(model, skip=lambda path, _: "lm_head" in map(str, path))
    if max_tokens is None:  # a model.factory model: its limit is known once built
        max_tokens = budget(gen.context_room(config, len(ids), model))
    tokens = gen.generate_iter(model, ids, max_new_tokens=max_tokens,
                               temperature=args.temperature, top_k=args.top_k,
                               seed=args.seed, eos_id=None if args.chat else codec.eos_id)
    stream = gen.TextStream(codec, ids)
    if not args.chat:  # a chat prints the reply alone
        print(args.prompt, end="", flush=True)
    for token in tokens:
        if token in stops:  # the end of the assistant's turn: generation stops here
            break
        piece = stream.push(token)
        if piece:
            print(piece, end="", flush=True)
    print(stream.finish(), flush=True)
    return 0
