"""A chat held on one Engine: the messages, the prompt the template renders from them, the part
of it the engine has not seen yet, streaming text, and save/load of the whole conversation.

Each turn renders the whole conversation and tokenizes it. When the engine's context (every token
it holds) is a prefix of that, only the rest is prefilled. Otherwise (Qwen3.5's template drops
earlier replies' <think> blocks, an edited system prompt, a reply that tokenizes differently when
re-read) the engine goes back to its latest turn checkpoint before the point where the two part,
and prefills from there. Each turn keeps two checkpoints: where the next turn's render will part
from this one (found by rendering the conversation with a stand-in reply and a next message), and
the prompt's end before its last token (a regenerated reply prefills one token).

/save writes one file: the engine snapshot (safetensors, see snapshot.py) with the messages in its
metadata under the same checksum, replaced in one step, so concurrent saves to one path leave one
whole conversation and a reader never pairs one save's messages with another's state. Chats saved
by earlier versions (snapshot + sidecar FILE.json holding the snapshot's sha256) still load.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hybrid_npu.errors import UserError
from hybrid_npu.safe_files import read_text

from .template import ChatTemplate
from ..turn_checkpoints import common_prefix
from .tool_calls import check_tools, parse_tool_calls

CHAT_FORMAT = "hybrid-npu-chat/1"
CHAT_KEY = "chat"  # the snapshot metadata entry holding {"format", "messages"}


@dataclass
class Sampling:
    max_new_tokens: int = 512
    temperature: float | None = None  # None: the model's default (engine.sampling_defaults)
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    speculative: bool | None = None  # None: speculate when the model has a drafter
    stop_at_eos: bool = True


@dataclass
class Reply:
    text: str
    token_ids: list[int]
    stopped: bool                  # cut short by should_stop (Ctrl-C)
    reused_tokens: int             # context tokens kept instead of prefilled again
    stats: dict = field(default_factory=dict)
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments"} the reply asks for


class StreamDecoder:
    """Text pieces for a growing reply: decode all of it so far and hand out the new suffix, so a
    character split over several byte tokens appears whole. A trailing U+FFFD (an incomplete
    character) is held back until the next token completes it, or until flush()."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        return "" if text.endswith("\ufffd") else self._advance(text)

    def flush(self) -> str:
        return self._advance(self.tokenizer.decode(self.ids))

    def _advance(self, text: str) -> str:
        piece = text[len(self.shown):] if text.startswith(self.shown) else ""  # printed text cannot be taken back
        self.shown = text
        return piece


def require_tokenizer(engine) -> None:
    if engine.tokenizer is None:
        raise UserError(f"{engine.path} has no tokenizer.json; re-export from a checkpoint that has one")


def encode_turns(engine, template: ChatTemplate, messages: list[dict], enable_thinking: bool | None = None,
                 tools: list[dict] | None = None, add_generation_prompt: bool = True,
                 should_stop: Callable[[], bool] | None = None) -> list[int]:
    """The messages rendered by the template (ending in the assistant's cue), as token ids."""
    text = template.render(messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                           tools=tools, should_stop=should_stop)
    return engine.tokenizer.encode(text, add_special_tokens=False).ids



def checkpoint_marks(engine, template: ChatTemplate, messages: list[dict], full: list[int],
                     enable_thinking: bool | None = None, tools: list[dict] | None = None,
                     should_stop: Callable[[], bool] | None = None) -> tuple[int, int]:
    """Where a turn keeps its two checkpoints: where the next turn's render will part from `full`
    (the template re-renders this turn's reply as history, and Qwen3.5's drops its <think> block:
    render a stand-in reply and next message and see where the tokens first differ), and before
    the prompt's last token."""
    probe = messages + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}]
    departs = common_prefix(full, encode_turns(engine, template, probe, enable_thinking, tools,
                                               add_generation_prompt=False, should_stop=should_stop))
    return departs, len(full) - 1


def generate_streamed(engine, ids: list[int], max_new_tokens: int, on_text: Callable[[str], None] | None = None,
                      **generate_kw) -> list[int]:
    """engine.generate, with the reply handed to on_text in whole characters as it is decoded."""
    stream = StreamDecoder(engine.tokenizer)

    def on_token(token: int) -> None:
        piece = stream.push(token)
        if piece and on_text:
            on_text(piece)

    new = engine.generate(ids, max_new_tokens, on_token=on_token, **generate_kw)
    tail = stream.flush()
    if tail and on_text:
        on_text(tail)
    return new


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


SIDECAR_BYTES = 64 << 20  # a chat's messages beside an older snapshot


def sidecar(path) -> Path:
    """Where the messages of a saved chat live: next to the snapshot, FILE.json."""
    return Path(f"{path}.json")


class Conversation:
    def __init__(self, engine, template: ChatTemplate | None = None, system: str | None = None,
                 enable_thinking: bool | None = None, tools: list[dict] | None = None):
        require_tokenizer(engine)
        self.engine = engine
        self.template = template or ChatTemplate.from_export(engine.path, engine.manifest)
        if enable_thinking is not None and not self.template.has_thinking_switch:
            raise UserError("this model's chat template has no thinking switch (enable_thinking); "
                            "drop --think/--no-think")
        self.enable_thinking = enable_thinking
        self.tools = check_tools(tools) if tools is not None else None
        self.messages: list[dict] = []
        self.set_system(system)

    # ---------------------------------------------------------------- the messages
    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None: none; "" keeps an empty one, as transformers renders it);
        the turns so far stay."""
        if self.system is not None:
            self.messages.pop(0)
        if text is not None:
            self.messages.insert(0, {"role": "system", "content": text})

    def reset(self) -> None:
        """Forget the turns (the system prompt stays) and the engine's context."""
        self.messages = self.messages[:1] if self.system is not None else []
        self.engine.reset()
        self.engine.last_stats = {}  # /stats must not show the forgotten reply's numbers

    def prompt_ids(self, messages: list[dict], should_stop: Callable[[], bool] | None = None) -> list[int]:
        """The conversation rendered by the template (ending in the assistant's cue), as token ids."""
        return encode_turns(self.engine, self.template, messages, self.enable_thinking, self.tools,
                            should_stop=should_stop)

    def render(self, messages: list[dict] | None = None) -> str:
        """The exact prompt the model is given for `messages` (default: the conversation so far)."""
        return self.template.render(self.messages if messages is None else messages, add_generation_prompt=True,
                                    enable_thinking=self.enable_thinking, tools=self.tools)

    # ---------------------------------------------------------------- a turn
    def reply(self, text: str, sampling: Sampling, on_text: Callable[[str], None] | None = None,
              should_stop: Callable[[], bool] | None = None, role: str = "user") -> Reply:
        """Add the user's message (role "tool": a tool's result), generate the assistant's reply
        (streamed to on_text), keep both. A reply cut short by should_stop is kept as it is;
        should_stop while the template renders (before any token) refuses the turn with a UserError
        and leaves the conversation and the engine as they were."""
        messages = self.messages + [{"role": role, "content": text}]
        full = self.prompt_ids(messages, should_stop)
        marks = checkpoint_marks(self.engine, self.template, messages, full, self.enable_thinking, self.tools,
                                 should_stop)
        kept = self.engine.resume(full)  # keeps, or goes back to a checkpoint, or starts over
        ids = generate_streamed(self.engine, full[kept:], sampling.max_new_tokens, on_text,
                                temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                seed=sampling.seed, stop_at_eos=sampling.stop_at_eos, append=True,
                                speculative=sampling.speculative, should_stop=should_stop, checkpoint_at=marks)
        reply = self.engine.tokenizer.decode(ids)
        self.messages = messages + [{"role": "assistant", "content": reply}]
        _, calls = parse_tool_calls(reply, self.tools) if self.tools else ("", [])
        return Reply(reply, ids, bool(should_stop and should_stop()), kept, dict(self.engine.last_stats), calls)

    # ---------------------------------------------------------------- save / load
    def save(self, path) -> Path:
        """The engine snapshot and the messages to `path`, one file written atomically; returns it."""
        chat = json.dumps({"format": CHAT_FORMAT, "messages": self.messages}, ensure_ascii=False)
        self.engine.save_state(path, extra={CHAT_KEY: chat})
        return Path(path)

    def load(self, path) -> None:
        """Restore a chat saved by save(): the engine's context and the messages, both or neither."""
        path = Path(path)
        try:
            if path.is_dir():
                raise UserError(f"cannot load chat {path}: it is a directory; give a file written by /save")
            if not path.is_file():
                raise UserError(f"cannot load chat {path}: no such file; give a file written by /save")
        except OSError as e:
            raise UserError(f"cannot load chat {str(path)[:60]}…: {e.strerror or e}; give a file written by /save") from None
        found: list = []
        try:
            self.engine.load_state(path, check=lambda extra: found.append(_saved_messages(path, extra)))
        except UserError as e:  # the snapshot's own refusals, worded for a chat
            raise UserError(str(e).replace("cannot load state", "cannot load chat", 1)) from None
        self.messages = found[0]


def _saved_messages(path: Path, extra: dict) -> list[dict]:
    """The messages a snapshot carries, or (earlier versions) its sidecar's, bound by sha256."""
    if CHAT_KEY in extra:
        data, where = _json(extra[CHAT_KEY], path, path.name), path.name
    else:
        side = sidecar(path)
        if not side.exists() and not side.is_symlink():
            raise UserError(f"cannot load chat {path}: it holds no messages (an engine snapshot, not a /save); "
                            "load it with engine.load_state, or give a file written by /save")
        text = read_text(side, SIDECAR_BYTES, "the chat's messages", "save the chat again")
        data, where = _json(text, path, side.name), side.name
        if isinstance(data, dict) and data.get("state_sha256") != _sha256(path):
            raise UserError(f"cannot load chat {path}: the snapshot does not match {side.name} "
                            "(overwritten or altered); save the chat again")
    messages = data.get("messages") if isinstance(data, dict) else None
    if (data.get("format") if isinstance(data, dict) else None) != CHAT_FORMAT or not _valid(messages):
        raise UserError(f"cannot load chat {path}: {where} holds no {CHAT_FORMAT} messages; give a file written by /save")
    return messages


def _json(text: str, path: Path, where: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise UserError(f"cannot load chat {path}: {where} nests too deeply; save the chat again") from None
    except ValueError as e:
        raise UserError(f"cannot load chat {path}: {where} is unreadable ({str(e)[:120]}); save the chat again") from None


def _valid(messages) -> bool:
    return isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
