"""npu-summarize: summarise a long document fully offline.

    npu-summarize FILE [--model EXPORT] [--max-new-tokens 256] [--memory 8G] [--json] ...

The document (.txt, .md, or .pdf with the `pdf` extra) becomes one user turn of the model's own
chat template, INSTRUCTION + document (the instruction the embedded model is trained with), with
thinking off where the template has the switch. The prompt is checked against the memory plan
before any work, prefilled in chunks with a progress bar on stderr, and the summary streams to
stdout as it is decoded, so `npu-summarize doc.md > summary.txt` keeps only the summary.

document_tokens is the length of the whole rendered prompt (template + instruction + document):
what is prefilled, and what has to fit in the context next to --max-new-tokens.
"""
from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.text import Text

from hybrid_npu.cli_common import OneLineParser, data_output, human_bytes, path_arg, report, stdout_closed
from hybrid_npu.errors import UserError

from .model_args import add_engine_arguments, check_engine_arguments, open_engine

INSTRUCTION = "Summarize the following document.\n\n"


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="npu-summarize", description="Summarize a .txt, .md or .pdf document offline with "
                      "an exported hybrid model: summary on stdout, progress on stderr.")
    p.add_argument("file", type=path_arg, help="the document (.pdf needs: pip install hybrid-npu[pdf])")
    p.add_argument("--model", type=path_arg, help="an export-hybrid output directory (default: the embedded model)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest summary in tokens (default: 256)")
    p.add_argument("--seed", type=int, help="sampling seed: the same document, settings and seed give the same summary")
    add_engine_arguments(p, "where the document is prefilled")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object {text, token_ids, document_tokens, stats}, no progress bar")
    p.add_argument("--quiet", action="store_true", help="nothing on stderr but errors")
    return p


def prompt_ids(engine, document: str) -> list[int]:
    """One user turn, INSTRUCTION + document, rendered by the export's chat template up to the
    assistant's cue, thinking off where the template can switch it."""
    from .chat.template import ChatTemplate
    from .chat.conversation import encode_turns, require_tokenizer

    require_tokenizer(engine)
    template = ChatTemplate.from_export(engine.path, engine.manifest)
    return encode_turns(engine, template, [{"role": "user", "content": INSTRUCTION + document}],
                        False if template.has_thinking_switch else None)


def check_fits(engine, n_prompt: int, max_new_tokens: int, source, at_least: bool = False) -> None:
    """Refuse, before any work, a prompt that leaves no room for the summary in the context: the
    refusal names what set the limit (the memory plan or the model's max_position_embeddings)."""
    limit = engine.memory_report()["max_context"]
    if n_prompt + max_new_tokens > limit:
        who, detail, fix = engine.memory.limit_and_fix()
        fix = fix.replace("memory=/--memory", "--memory").replace("the input", "the document")
        raise UserError(f"{source} is {'at least ' if at_least else ''}{n_prompt} tokens with the prompt; with "
                        f"--max-new-tokens {max_new_tokens} that exceeds the {limit}-token context {who} allows "
                        f"({detail}); {fix}, or lower --max-new-tokens")


class TokenCounter:
    """Counts a document's tokens block by block as it is read and refuses once it cannot fit, so a
    huge file never sits in memory whole, tokenised (a 5 MB text took 1.15 GB that way)."""

    SLACK_PER_BLOCK = 8  # block edges fall where the tokenizer splits anyway; a few tokens of leeway

    def __init__(self, engine, max_new_tokens: int, source):
        self.engine, self.max_new_tokens, self.source = engine, max_new_tokens, source
        self.tokens = self.blocks = 0

    def __call__(self, block: str) -> None:
        self.tokens += len(self.engine.tokenizer.encode(block, add_special_tokens=False).ids)
        self.blocks += 1
        surely = self.tokens - self.SLACK_PER_BLOCK * self.blocks
        if surely + self.max_new_tokens > self.engine.memory_report()["max_context"]:
            check_fits(self.engine, surely, self.max_new_tokens, self.source, at_least=True)


def check_size(engine, path, max_new_tokens: int) -> None:
    """Before reading: a text file of B bytes holds at least B / (4 * longest token in bytes) tokens
    (4: CRLF->LF and Unicode normalisation shrink text by at most that), so a file that cannot fit
    is refused from its size alone."""
    from pathlib import Path

    size = Path(path).stat().st_size
    longest = max((len(t.encode("utf-8")) for t in engine.tokenizer.get_vocab()), default=1)
    check_fits(engine, size // (4 * longest), max_new_tokens, f"{path} ({human_bytes(size)})", at_least=True)


class PrefillBar:
    """Prefill progress on stderr: tokens done/total, tokens/s, ETA and device. It stops at the last
    chunk, so the summary that follows is never drawn under a live bar."""

    def __init__(self, total: int, device: str):
        self._progress = Progress(TextColumn("prefill on {task.fields[device]}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("tokens"), RateColumn(), TimeRemainingColumn(),
                                  console=Console(stderr=True), redirect_stdout=False, redirect_stderr=False)
        self._task = self._progress.add_task("prefill", total=total, device=device)

    def __enter__(self) -> "PrefillBar":
        self._progress.start()
        return self

    def __call__(self, done: int, total: int) -> None:
        self._progress.update(self._task, completed=done)
        if done >= total:
            self._progress.stop()

    def __exit__(self, *exc) -> None:
        self._progress.stop()


class RateColumn(ProgressColumn):
    def render(self, task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} tok/s" if speed else "-- tok/s")


def summarize(engine, ids: list[int], max_new_tokens: int = 256, temperature: float = 0.0, seed: int | None = None,
              speculative: bool | None = None, on_text=None, progress=None) -> dict:
    """Prefill the prompt, decode the summary (streamed to on_text in whole characters)."""
    from .chat.conversation import generate_streamed

    new = generate_streamed(engine, ids, max_new_tokens, on_text, temperature=temperature, seed=seed,
                            progress=progress, speculative=speculative)
    return {"text": engine.tokenizer.decode(new), "token_ids": new, "document_tokens": len(ids),
            "stats": dict(engine.last_stats)}


def stats_line(stats: dict) -> str:
    return (f"npu-summarize: prefill {stats['prefill_tokens']} tokens on {stats['prefill_device']} at "
            f"{stats['prefill_tokens_per_s']:,.0f} tok/s ({stats['ttft_s']:.1f} s); decode "
            f"{stats['decode_tokens']} tokens at {stats['decode_tokens_per_s']:.1f} tok/s")


def _show(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def main(argv=None) -> int:
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    data_output()  # the summary is data: UTF-8 on stdout whatever the console
    try:
        from .chat.conversation import require_tokenizer
        from .documents import check_document, read_document

        check_engine_arguments(a)
        kind = check_document(a.file)  # before the model loads: a bad file fails in a moment
        engine = open_engine(a.model, a, checkpoints=0)  # one prompt: nothing to resume
        require_tokenizer(engine)
        if kind == "text":
            check_size(engine, a.file, a.max_new_tokens)
        document = read_document(a.file, take=TokenCounter(engine, a.max_new_tokens, a.file))
        ids = prompt_ids(engine, document)
        check_fits(engine, len(ids), a.max_new_tokens, a.file)
        options = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed,
                       speculative=False if a.no_speculative else None)
        if a.json:
            print(json.dumps(summarize(engine, ids, **options), ensure_ascii=False))
            return 0
        if a.quiet:
            summarize(engine, ids, on_text=_show, **options)
            print()
            return 0
        with PrefillBar(len(ids), engine.prefill_device(len(ids))) as bar:
            result = summarize(engine, ids, on_text=_show, progress=bar, **options)
        print()
        print(stats_line(result["stats"]), file=sys.stderr)
        return 0
    except UserError as e:
        return report("npu-summarize", e)
    except BrokenPipeError:  # stdout closed early: `... | head`
        return stdout_closed()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
