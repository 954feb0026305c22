"""The npu-chat read-reply loop: prompt_toolkit line editing (in-memory history), streamed replies,
one status line per reply, slash commands, Ctrl-C that stops a reply and keeps the conversation."""
from __future__ import annotations

import json
import shutil
import signal
import sys
import textwrap
import threading

from hybrid_npu.cli_common import note_unshowable, report
from hybrid_npu.errors import UserError

from .conversation import Conversation, Reply, Sampling

PROMPT = "you> "
HELP = """commands:
  /help          this list
  /reset         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt (no TEXT: none); the turns so far stay
  /save FILE     save the conversation (engine snapshot + messages) to FILE, atomically
  /load FILE     continue a conversation saved with /save
  /tool RESULT   give the model a tool's result (after it asked with a tool call); it answers on
  /stats         the last reply's numbers and the memory plan
  /exit          leave (Ctrl-D too)
Ctrl-C stops a reply (the conversation keeps it) or clears the line; start with // to send a leading /."""

# Model output is untrusted text: terminal control characters (ESC sequences, CR, C1 controls)
# are dropped from what the terminal shows; the conversation keeps the text as generated.
_CONTROLS = {c: None for c in [*range(0, 9), *range(11, 32), 127, *range(0x80, 0xA0)]}


class StopOnInterrupt:
    """While generating: SIGINT sets a flag (asked by Engine.generate between steps) instead of
    raising mid-step; the previous handler comes back afterwards. Works on Windows consoles too."""

    def __init__(self):
        self.stopped = False

    def __call__(self) -> bool:
        return self.stopped

    def _handler(self, signum, frame) -> None:
        self.stopped = True

    def __enter__(self) -> "StopOnInterrupt":
        self._previous = None
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = signal.signal(signal.SIGINT, self._handler)
        self._echo = _echoctl_off()
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        _echoctl_restore(self._echo)


def _echoctl_off():
    """A POSIX terminal echoes Ctrl-C as "^C" into the reply being streamed; turn that echo off while
    a reply runs (Windows consoles do not echo it). Returns what to restore."""
    try:
        import termios

        fd = sys.stdin.fileno()
        if not sys.stdin.isatty():
            return None
        saved = termios.tcgetattr(fd)
        quiet = list(saved)
        quiet[3] &= ~termios.ECHOCTL
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
        return fd, saved
    except (ImportError, AttributeError, OSError, ValueError):
        return None


def _echoctl_restore(saved) -> None:
    if saved is not None:
        import termios

        try:
            termios.tcsetattr(saved[0], termios.TCSANOW, saved[1])
        except OSError:
            pass


def terminal_width(out) -> int | None:
    """The terminal's columns when `out` is one (lines are wrapped to it), None for a pipe or file."""
    return shutil.get_terminal_size().columns if out.isatty() else None


def wrap_words(text: str, out=None) -> str:
    """`text` wrapped between words at the terminal's width (a terminal wraps mid-word otherwise)."""
    width = terminal_width(out or sys.stdout)
    return textwrap.fill(text, width - 1, break_long_words=False, break_on_hyphens=False) if width else text


def wrap_parts(parts: list[str], width: int | None, sep: str = " | ") -> str:
    """Parts joined by sep, a line broken only between parts when it would pass `width` columns."""
    if not width:
        return sep.join(parts)
    lines, line = [], ""
    for part in parts:
        if line and len(line) + len(sep) + len(part) >= width:
            lines.append(line + sep.rstrip())
            line = " " + part
        else:
            line = f"{line}{sep}{part}" if line else part
    return "\n".join(lines + [line])


def status_line(reply: Reply, conv: Conversation, width: int | None = None) -> str:
    import psutil

    s, mem = reply.stats, conv.engine.memory_report()
    kept = f", {reply.reused_tokens} kept" if reply.reused_tokens else ""
    rate = f"{s['decode_tokens_per_s']:.1f} tok/s" if s["decode_tokens"] > 1 else "n/a tok/s"  # one token: no rate
    parts = [f"prefill {s['prefill_tokens']} tok{kept} {s['prefill_tokens_per_s']:.0f} tok/s {s['prefill_device']}",
             f"decode {s['decode_tokens']} tok {rate} {s['decode_device']}"]
    if "acceptance_length" in s:
        plain = f", {s['plain_steps']} plain steps" if s.get("plain_steps") else ""  # where rounds did not pay
        parts.append(f"accept {s['acceptance_length']:.2f} over {s['rounds']} rounds{plain}")
    parts.append(f"context {mem['context_tokens']}/{mem['max_context']}")  # the count /stats and /load give
    parts.append(f"RSS {psutil.Process().memory_info().rss / 2**20:.0f} MiB")
    parts[0] = ("[stopped] [" if reply.stopped else "[") + parts[0]
    parts[-1] += "]"
    return wrap_parts(parts, width)


def check_utf8(line: str) -> None:
    """A line read from stdin with bytes that are not UTF-8 (they arrive as surrogate escapes) is the
    user's input, not a bug: refused in one line, the conversation untouched."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = line[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"\\u{ord(bad):04x}"
        raise UserError(f"that line is not UTF-8 text ({byte} at column {e.start + 1}); it was not sent, the "
                        "conversation is kept; set your terminal or file to UTF-8") from None


def _line_reader():
    """prompt_toolkit on a terminal (history kept in memory: Up recalls what was typed); plain
    input() when stdin is a pipe, so `npu-chat < questions.txt` works too."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        session = PromptSession(history=InMemoryHistory())
        return lambda: session.prompt(PROMPT)
    if hasattr(sys.stdin, "reconfigure"):  # bad bytes reach check_utf8 as one refused line, not a lost buffer
        sys.stdin.reconfigure(errors="surrogateescape")
    return lambda: input(PROMPT)


class Repl:
    def __init__(self, conv: Conversation, sampling: Sampling, out=None):
        self.conv, self.sampling = conv, sampling
        self.out = out or sys.stdout
        self.show = (lambda t: t.translate(_CONTROLS)) if self.out.isatty() else (lambda t: t)

    def say(self, text: str = "", end: str = "\n") -> None:
        note_unshowable(text, self.out)
        self.out.write(text + end)
        self.out.flush()

    def run(self) -> int:
        read = _line_reader()
        while True:
            try:
                line = read()
            except KeyboardInterrupt:  # Ctrl-C at the prompt: prompt_toolkit cleared the line
                continue
            except UnicodeDecodeError as e:  # stdin that could not take surrogateescape
                report("npu-chat", UserError(f"input is not UTF-8 text (byte 0x{e.object[e.start]:02x}); it was not "
                                             "sent, the conversation is kept; set your terminal or file to UTF-8"))
                continue
            except EOFError:  # Ctrl-D
                self.say()
                return 0
            try:
                if self.handle(line.strip()) == "exit":
                    return 0
            except UserError as e:
                report("npu-chat", e)
            except KeyboardInterrupt:  # Ctrl-C while no reply was running (a command, a save)
                self.say()
            except BrokenPipeError:  # stdout is gone: nothing more can be shown (npu-chat exits quietly)
                raise
            except Exception as e:  # noqa: BLE001 - a bug must not end the session and lose the chat
                print(f"npu-chat: {type(e).__name__}: {' '.join(str(e).split())} (the conversation is kept; "
                      "/save it and report this)", file=sys.stderr, flush=True)

    def handle(self, line: str) -> str | None:
        if not line:
            return None
        check_utf8(line)
        if line.startswith("/") and not line.startswith("//"):
            return self.command(*(line[1:].split(maxsplit=1) + [""])[:2])
        self.turn(line[1:] if line.startswith("//") else line)
        return None

    def turn(self, text: str, role: str = "user") -> None:
        with StopOnInterrupt() as stop:
            reply = self.conv.reply(text, self.sampling, on_text=lambda piece: self.say(self.show(piece), end=""),
                                    should_stop=stop, role=role)
        self.say()
        for call in reply.tool_calls:  # never run by us: the user runs it and answers with /tool
            self.say(self.show(f"[tool call] {call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})"
                               " - answer with /tool RESULT"))
        self.say(status_line(reply, self.conv, terminal_width(self.out)))
        if reply.stats.get("context_full"):
            self.say(wrap_words(f"[context full: the memory plan allows {self.conv.engine.memory_report()['max_context']} "
                                "tokens; /save it, /reset to go on, or restart with a larger --memory]", self.out))

    def command(self, name: str, arg: str) -> str | None:
        arg = arg.strip()
        if name in ("exit", "quit"):
            return "exit"
        if name == "help":
            self.say(HELP)
        elif name == "reset":
            self.conv.reset()
            self.say("conversation reset")
        elif name == "system":
            self.conv.set_system(arg or None)
            self.say(f"system prompt {'set' if arg else 'cleared'}")
        elif name in ("save", "load"):
            if not arg:
                raise UserError(f"/{name} needs a file name, e.g. /{name} chat.state")
            if name == "save":
                self.conv.save(arg)
                self.say(f"saved {arg}: {len(self.conv.messages)} messages")
            else:
                self.conv.load(arg)
                self.say(f"loaded {arg}: {len(self.conv.messages)} messages, "
                         f"{self.conv.engine.memory_report()['context_tokens']} tokens of context")
        elif name == "tool":
            if not arg:
                raise UserError("/tool needs the tool's result, e.g. /tool {\"temperature\": 21}")
            self.turn(arg, role="tool")
        elif name == "stats":
            for key, value in {**self.conv.engine.last_stats, **self.conv.engine.memory_report()}.items():
                self.say(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
        else:
            raise UserError(f"unknown command /{name}; /help lists the commands")
        return None
