"""npu-chat: chat with an exported model in the terminal, or answer one --prompt and exit."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybrid_npu.cli_common import OneLineParser, console_output, data_output, path_arg, report, stdout_closed
from hybrid_npu.errors import UserError
from hybrid_npu.format import MANIFEST

from ..model_args import add_engine_arguments, check_engine_arguments, open_engine


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="npu-chat", description="Chat with an exported hybrid model (REPL; /help inside), "
                                                    "or answer one --prompt and exit.")
    p.add_argument("model", nargs="?", type=path_arg, help="an export-hybrid output directory (default: the embedded model)")
    add_engine_arguments(p, "where prompts are prefilled")
    p.add_argument("--top-p", type=float, help="nucleus sampling (default: the model's generation_config, else 1)")
    p.add_argument("--top-k", type=int, help="0 = off (default: the model's generation_config, else off)")
    p.add_argument("--seed", type=int, help="sampling seed: the same context, settings and seed give the same reply, "
                                            "speculating or not (docs/reproducibility.md)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="longest reply in tokens (default: 512)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end of turn (benchmarks)")
    p.add_argument("--system", help="system prompt (\"\" keeps an empty one; omit it for none)")
    p.add_argument("--tools", metavar="FILE.json", type=path_arg,
                   help="a JSON list of OpenAI-style function specs the template shows the model; its calls come "
                        "back in --json's tool_calls (REPL: shown; answer with /tool RESULT). Nothing is executed")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="reasoning on/off, for templates with enable_thinking (default: the template's)")
    p.add_argument("--prompt", help="answer this one message, print the reply and exit")
    p.add_argument("--json", action="store_true",
                   help="with --prompt: print one JSON object {text, token_ids, tool_calls, stats}")
    p.add_argument("--render-only", action="store_true",
                   help="print the exact prompt the model would be given for --system/--tools/--prompt/--think, "
                        "then exit (loads no model graphs)")
    return p


def check_args(a) -> None:
    if a.prompt is not None and not a.prompt.strip():
        raise UserError("--prompt is empty; give the message to answer, e.g. --prompt \"Hello\"")
    if a.json and a.prompt is None:
        raise UserError("--json needs --prompt (it prints one reply as JSON)")
    if a.render_only and a.prompt is None:
        raise UserError("--render-only needs --prompt (the message whose prompt to print)")
    check_engine_arguments(a)  # sampling flags too: the same rules as engine.generate


def one_shot(conv, sampling, prompt: str, as_json: bool) -> None:
    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    reply = conv.reply(prompt, sampling, on_text=None if as_json else show)
    if as_json:
        print(json.dumps({"text": reply.text, "token_ids": reply.token_ids, "tool_calls": reply.tool_calls,
                          "stats": reply.stats}, ensure_ascii=False))
    else:
        print()


def sampling_note(engine, sampling) -> str:
    """The sampling a reply uses, and where each default came from (for the banner)."""
    d = engine.sampling_defaults
    t = d["temperature"] if sampling.temperature is None else sampling.temperature
    if t <= 0:
        return "greedy"
    k = d["top_k"] if sampling.top_k is None else sampling.top_k
    p = d["top_p"] if sampling.top_p is None else sampling.top_p
    given = sampling.temperature is not None and sampling.top_k is not None and sampling.top_p is not None
    return f"temperature {t:g}, top_k {k or 'off'}, top_p {p:g}" + ("" if given else " (model defaults)")


def check_tools_section(template, tools) -> None:
    """--tools given to a template that never reads `tools` would be dropped without a word."""
    if tools and template is not None and "tools" not in template.source:
        raise UserError("this model's chat template has no tools section (it never reads `tools`), so the model "
                        "would not see --tools; drop --tools or use a model whose template takes tools")


def render_only(a, tools) -> str:
    """The prompt for --system/--tools/--prompt/--think, from the export's files alone."""
    import hybrid_npu

    from .template import ChatTemplate
    from ..export_check import read_manifest

    path = Path(a.model) if a.model else hybrid_npu.default_model()
    if not (path / MANIFEST).is_file():
        raise UserError(f"{path} is not a hybrid-npu export (no model.json); give an export-hybrid output directory")
    manifest, _ = read_manifest(path)  # checked, config included
    template = ChatTemplate.from_export(path, manifest)
    if a.think is not None and not template.has_thinking_switch:
        raise UserError("this model's chat template has no thinking switch (enable_thinking); drop --think/--no-think")
    check_tools_section(template, tools)
    messages = ([] if a.system is None else [{"role": "system", "content": a.system}]) + \
        [{"role": "user", "content": a.prompt}]
    return template.render(messages, add_generation_prompt=True, enable_thinking=a.think, tools=tools)


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if a.prompt is not None:  # --json, --render-only or one reply: data, UTF-8 whatever the console
        data_output()
    else:
        console_output("npu-chat")
    try:
        from .repl import Repl, wrap_words
        from .conversation import Conversation, Sampling

        from .tool_calls import read_tools

        check_args(a)
        tools = read_tools(a.tools) if a.tools else None
        if a.render_only:
            print(render_only(a, tools), end="")
            return 0
        engine = open_engine(a.model, a, checkpoints=0 if a.prompt is not None else None)
        conv = Conversation(engine, system=a.system, enable_thinking=a.think, tools=tools)
        check_tools_section(conv.template, tools)
        sampling = Sampling(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                            top_p=a.top_p, seed=a.seed, speculative=False if a.no_speculative else None,
                            stop_at_eos=not a.ignore_eos)
        if a.prompt is not None:
            one_shot(conv, sampling, a.prompt, a.json)
            return 0
        drafter = "on" if engine.drafter is not None and not a.no_speculative else "off"
        name = "the embedded default model" if a.model is None else engine.path  # not a site-packages path
        print(wrap_words(f"npu-chat: {name} (profile {engine.profile.name}, speculative {drafter}, "
                         f"{sampling_note(engine, sampling)}); /help for commands, Ctrl-D to leave"), flush=True)
        return Repl(conv, sampling).run()
    except UserError as e:
        return report("npu-chat", e)
    except BrokenPipeError:  # stdout closed early: `... | head`
        return stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C while loading or during a one-shot reply
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
