"""The npu-chat read-reply loop: prompt_toolkit line editing (in-memory history), streamed replies,
one status line per reply, slash commands, Ctrl-C that stops a reply and keeps the conversation."""
from __future__ import annotations

import signal
import sys
import threading

from hybrid_npu.errors import UserError

from .conversation import Conversation, Reply, Sampling, sidecar

PROMPT = "you> "
HELP = """commands:
  /help          this list
  /reset         forget the conversation (the system prompt stays)
  /system TEXT   set the system prompt (no TEXT: none); the turns so far stay
  /save FILE     save the conversation: FILE (engine snapshot) and FILE.json (messages)
  /load FILE     continue a conversation saved with /save
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
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def status_line(reply: Reply, conv: Conversation) -> str:
    import psutil

    s, mem = reply.stats, conv.engine.memory_report()
    kept = f", {reply.reused_tokens} kept" if reply.reused_tokens else ""
    parts = [f"prefill {s['prefill_tokens']} tok{kept} {s['prefill_tokens_per_s']:.0f} tok/s {s['prefill_device']}",
             f"decode {s['decode_tokens']} tok {s['decode_tokens_per_s']:.1f} tok/s {s['decode_device']}"]
    if "acceptance_length" in s:
        plain = f", {s['plain_steps']} plain steps" if s.get("plain_steps") else ""  # where rounds did not pay
        parts.append(f"accept {s['acceptance_length']:.2f} over {s['rounds']} rounds{plain}")
    parts.append(f"context {len(conv.engine.context_ids())}/{mem['max_context']}")
    parts.append(f"RSS {psutil.Process().memory_info().rss / 2**20:.0f} MiB")
    return ("[stopped] " if reply.stopped else "") + "[" + " | ".join(parts) + "]"


def _line_reader():
    """prompt_toolkit on a terminal (history kept in memory: Up recalls what was typed); plain
    input() when stdin is a pipe, so `npu-chat < questions.txt` works too."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        session = PromptSession(history=InMemoryHistory())
        return lambda: session.prompt(PROMPT)
    return lambda: input(PROMPT)


class Repl:
    def __init__(self, conv: Conversation, sampling: Sampling, out=None):
        self.conv, self.sampling = conv, sampling
        self.out = out or sys.stdout
        self.show = (lambda t: t.translate(_CONTROLS)) if self.out.isatty() else (lambda t: t)

    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def run(self) -> int:
        read = _line_reader()
        while True:
            try:
                line = read()
            except KeyboardInterrupt:  # Ctrl-C at the prompt: prompt_toolkit cleared the line
                continue
            except EOFError:  # Ctrl-D
                self.say()
                return 0
            try:
                if self.handle(line.strip()) == "exit":
                    return 0
            except UserError as e:
                print(f"npu-chat: {e}", file=sys.stderr, flush=True)
            except KeyboardInterrupt:  # Ctrl-C while no reply was running (a command, a save)
                self.say()

    def handle(self, line: str) -> str | None:
        if not line:
            return None
        if line.startswith("/") and not line.startswith("//"):
            return self.command(*(line[1:].split(maxsplit=1) + [""])[:2])
        self.turn(line[1:] if line.startswith("//") else line)
        return None

    def turn(self, text: str) -> None:
        with StopOnInterrupt() as stop:
            reply = self.conv.reply(text, self.sampling, on_text=lambda piece: self.say(self.show(piece), end=""),
                                    should_stop=stop)
        self.say()
        self.say(status_line(reply, self.conv))

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
                self.say(f"saved {arg} and {self.conv.save(arg).name}")
            else:
                self.conv.load(arg)
                self.say(f"loaded {arg} and {sidecar(arg).name}: {len(self.conv.messages)} messages, "
                         f"{len(self.conv.engine.context_ids())} tokens of context")
        elif name == "stats":
            for key, value in {**self.conv.engine.last_stats, **self.conv.engine.memory_report()}.items():
                self.say(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
        else:
            raise UserError(f"unknown command /{name}; /help lists the commands")
        return None
