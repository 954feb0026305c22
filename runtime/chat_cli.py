"""npu-chat: chat with an exported model in the terminal, or answer one --prompt and exit."""
from __future__ import annotations

import argparse
import json
import sys

from hybrid_npu.cli_common import OneLineParser, stdout_closed
from hybrid_npu.errors import UserError

from .model_args import add_engine_arguments, check_engine_arguments, open_model


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="npu-chat", description="Chat with an exported hybrid model (REPL; /help inside), "
                                                    "or answer one --prompt and exit.")
    p.add_argument("model", nargs="?", help="an export-hybrid output directory (default: the embedded model)")
    add_engine_arguments(p, "where prompts are prefilled")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, help="sampling seed (each reply starts from it)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="longest reply in tokens (default: 512)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end of turn (benchmarks)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="reasoning on/off, for templates with enable_thinking (default: the template's)")
    p.add_argument("--prompt", help="answer this one message, print the reply and exit")
    p.add_argument("--json", action="store_true", help="with --prompt: print one JSON object {text, token_ids, stats}")
    return p


def check_args(a) -> None:
    if a.prompt is not None and not a.prompt.strip():
        raise UserError("--prompt is empty; give the message to answer, e.g. --prompt \"Hello\"")
    if a.json and a.prompt is None:
        raise UserError("--json needs --prompt (it prints one reply as JSON)")
    check_engine_arguments(a)  # sampling flags too: the same rules as engine.generate


def one_shot(conv, sampling, prompt: str, as_json: bool) -> None:
    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    reply = conv.reply(prompt, sampling, on_text=None if as_json else show)
    if as_json:
        print(json.dumps({"text": reply.text, "token_ids": reply.token_ids, "stats": reply.stats}))
    else:
        print()


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    for stream in (sys.stdout, sys.stderr):  # a Windows pipe's code page cannot encode every reply
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    try:
        from .chat_repl import Repl, wrap_words
        from .conversation import Conversation, Sampling

        check_args(a)
        engine = open_model(a.model, a)
        conv = Conversation(engine, system=a.system, enable_thinking=a.think)
        sampling = Sampling(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                            top_p=a.top_p, seed=a.seed, speculative=False if a.no_speculative else None,
                            stop_at_eos=not a.ignore_eos)
        if a.prompt is not None:
            one_shot(conv, sampling, a.prompt, a.json)
            return 0
        drafter = "on" if engine.drafter is not None and not a.no_speculative else "off"
        name = "the embedded default model" if a.model is None else engine.path  # not a site-packages path
        print(wrap_words(f"npu-chat: {name} (profile {engine.profile.name}, speculative {drafter}); "
                         "/help for commands, Ctrl-D to leave"), flush=True)
        return Repl(conv, sampling).run()
    except UserError as e:
        print(f"npu-chat: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # stdout closed early: `... | head`
        return stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C while loading or during a one-shot reply
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
