"""Output that is data (--json, --render-only, a one-shot reply, npu-summarize's summary) is UTF-8
whatever the console's code page or locale: the CLIs run here in fresh processes under
PYTHONIOENCODING=cp1252 (a Windows pipe) and LC_ALL=C, and their stdout bytes are checked against
transformers' and tokenizers' own text. Interactive console text replaces what the console cannot
show, and says so once."""
import io
import json
import os
import subprocess
import sys

import pytest

import hybrid_npu

PROMPT = "Say 你好 ☃"
CONSOLES = {"cp1252": {"PYTHONIOENCODING": "cp1252"}, "C locale": {"LC_ALL": "C", "LANG": "C"}}


def run(module: str, *args, env: dict, stdin: bytes | None = None) -> bytes:
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "PYTHONUTF8", "LC_ALL", "LANG")}
    proc = subprocess.run([sys.executable, "-m", f"hybrid_npu.runtime.{module}", *args], input=stdin,
                          capture_output=True, env={**full, **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")
    return proc.stdout.replace(b"\r\n", b"\n")  # (Windows' text-mode newlines)


def not_cp1252(text: str) -> bool:
    try:
        text.encode("cp1252")
        return False
    except UnicodeEncodeError:
        return True


@pytest.mark.parametrize("console", CONSOLES)
def test_render_only_prints_the_exact_utf8_prompt(console):
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(hybrid_npu.default_model()).apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    assert PROMPT in want
    assert run("chat.cli", "--render-only", "--prompt", PROMPT, env=CONSOLES[console]) == want.encode("utf-8")


@pytest.mark.parametrize("console", CONSOLES)
def test_json_and_a_one_shot_reply_are_utf8(text_tied, console):
    """The fixture's random model answers in random bytes of its byte-level vocabulary: text with
    characters cp1252 has no code for (U+FFFD where the bytes are not UTF-8)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(text_tied.out / "tokenizer.json"))
    args = [str(text_tied.out), "--prompt", PROMPT, "--max-new-tokens", "24", "--ignore-eos"]
    reply = json.loads(run("chat.cli", *args, "--json", env=CONSOLES[console]).decode("utf-8"))
    text = tok.decode(reply["token_ids"])
    assert reply["text"] == text and not_cp1252(text)
    assert run("chat.cli", *args, env=CONSOLES[console]) == (text + "\n").encode("utf-8")


@pytest.mark.parametrize("console", CONSOLES)
def test_npu_summarize_output_is_utf8(text_tied, tmp_path, console):
    from tokenizers import Tokenizer

    doc = tmp_path / "notes.txt"
    doc.write_text("Notes: 你好, 世界 ☃. The parser reads a header line and returns its fields.\n", encoding="utf-8")
    tok = Tokenizer.from_file(str(text_tied.out / "tokenizer.json"))
    args = [str(doc), "--model", str(text_tied.out), "--max-new-tokens", "24"]
    result = json.loads(run("summarize_cli", *args, "--json", env=CONSOLES[console]).decode("utf-8"))
    text = tok.decode(result["token_ids"])
    assert result["text"] == text and not_cp1252(text)
    assert run("summarize_cli", *args, "--quiet", env=CONSOLES[console]) == (text + "\n").encode("utf-8")


def test_piped_chat_reads_and_writes_utf8(text_tied):
    """npu-chat < questions.txt > answers.txt: the messages in and the replies out are UTF-8 on a
    cp1252 console too (the prompt's text reaches the model whole: the same reply as --prompt)."""
    args = [str(text_tied.out), "--max-new-tokens", "12", "--ignore-eos"]
    want = json.loads(run("chat.cli", *args, "--prompt", PROMPT, "--json", env={}).decode("utf-8"))["text"]
    out = run("chat.cli", *args, env=CONSOLES["cp1252"], stdin=(PROMPT + "\n").encode("utf-8")).decode("utf-8")
    assert want in out


class Console(io.StringIO):
    """A terminal whose code page is cp1252, as the REPL sees it."""
    encoding = "cp1252"

    def isatty(self):
        return True


def test_a_console_that_cannot_show_a_character_is_told_once(monkeypatch, capsys):
    from hybrid_npu.cli_common import console_output
    from hybrid_npu.runtime.chat.repl import Repl

    console_output("npu-chat")
    repl = Repl.__new__(Repl)
    repl.out = Console()
    repl.say("plain text")
    assert capsys.readouterr().err == ""
    repl.say("你好")
    repl.say("☃")
    notes = capsys.readouterr().err.strip().splitlines()
    assert len(notes) == 1 and "cp1252" in notes[0] and "PYTHONIOENCODING=utf-8" in notes[0]
