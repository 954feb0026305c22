"""The OpenAI chat-completions wire format: checking a request body, and writing replies, stream
chunks, usage and errors. No model runs here.

Supported: messages (system, developer = system, user, assistant with tool_calls and
reasoning_content, tool), max_tokens / max_completion_tokens, temperature, top_p, seed, stop,
stream, stream_options.include_usage, tools, and the extras top_k and
chat_template_kwargs.enable_thinking. Refused with a 400: n > 1, images and audio, unknown roles.
Ignored as llama-server and vLLM ignore them: model (one model is served), user, tool_choice
"auto", logit_bias absent or empty.
"""
from __future__ import annotations

import functools
import json
import math
import secrets
import time
from dataclasses import dataclass, field

from ..sampling import MIN_TEMPERATURE
from ..chat.tool_calls import check_tools, parse_tool_calls

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOP = 4
MAX_STOP_CHARS = 1000  # a stop string is text to watch for, not a document; the held-tail check is O(this)
MAX_NESTING = 64       # JSON depth of a request: tool schemas nest a few levels, nothing needs 100k
DEFAULT_MAX_TOKENS = 4096  # when the request names none: the context's room, at most this


class BadRequest(ValueError):
    """A request we refuse before any work: HTTP status, OpenAI error type/code, the parameter."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.code, self.status, self.kind = param, code, status, kind

    def body(self) -> dict:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ChatRequest:
    messages: list[dict]              # as the template takes them
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    tools: list[dict] | None
    enable_thinking: bool | None
    extra: dict = field(default_factory=dict)


def load_json(raw: bytes):
    """The request body as JSON: valid UTF-8 text (no lone surrogates) nested at most MAX_NESTING deep."""
    try:
        body = json.loads(raw or b"null")
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_NESTING} levels") from None
    except ValueError:
        raise BadRequest("the request body is not valid JSON") from None
    check_json_value(body, "the request body")
    return body


def check_json_value(value, where: str) -> None:
    """Walked without recursion: depth at most MAX_NESTING, every string encodable as UTF-8 (a lone
    surrogate such as "\\ud800" is valid JSON but no text a tokenizer can take)."""
    stack = [(value, 0)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_NESTING:
            raise BadRequest(f"{where} nests deeper than {MAX_NESTING} levels")
        if isinstance(x, str):
            _check_text(x, where)
        elif isinstance(x, dict):
            stack.extend((k, depth + 1) for k in x)
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{where} holds a lone surrogate (\\u{ord(text[e.start]):04x} at character {e.start}); "
                         "send text as valid UTF-8, surrogates only in pairs") from None


def _short(value, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)[: limit + 1] if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _number(body: dict, key: str, lo: float, hi: float, integer: bool = False, lo_open: bool = False):
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not integer and not math.isfinite(value)):
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {json.dumps(value)}", key)
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise BadRequest(f"'{key}' must be in {bound}, got {value}", key)
    return value


def _text(content, where: str, allow_none: bool) -> str | None:
    if content is None and allow_none:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: only text content is supported (got a {kind!r} part)", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts", "messages")


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise BadRequest(f"{where}: tool_calls must be a list", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}: each tool call needs function.name", "messages")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
                check_json_value(args, f"{where}: tool call arguments")
            except RecursionError:
                raise BadRequest(f"{where}: tool call arguments nest deeper than {MAX_NESTING} levels",
                                 "messages") from None
            except ValueError as e:
                if isinstance(e, BadRequest):
                    raise
                raise BadRequest(f"{where}: tool call {fn['name']}: arguments are not valid JSON", "messages") from None
        if not isinstance(args, dict):
            raise BadRequest(f"{where}: tool call {fn['name']}: arguments must be a JSON object", "messages")
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object with role and content", "messages")
        raw_role = m.get("role")
        role = ROLES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise BadRequest(f"{where}: unknown role {_short(raw_role)}; use one of {', '.join(ROLES)}", "messages")
        calls = m.get("tool_calls") if role == "assistant" else None
        message = {"role": role, "content": _text(m.get("content"), where, allow_none=calls is not None) or ""}
        if calls:
            message["tool_calls"] = _tool_calls(calls, where)
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            message["reasoning_content"] = m["reasoning_content"]
        out.append(message)
    return out


def parse_request(body) -> ChatRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise BadRequest("'n' other than 1 is not supported: one choice per request", "n")
    max_a = _number(body, "max_completion_tokens", 1, 1 << 31, integer=True)
    max_b = _number(body, "max_tokens", 1, 1 << 31, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings of at most "
                         f"{MAX_STOP_CHARS} characters", "stop")
    tools = body.get("tools")
    if tools is not None:
        try:
            tools = check_tools(tools, "'tools'")
        except Exception as e:  # UserError: the same rule as --tools
            raise BadRequest(str(e), "tools") from None
    options = body.get("stream_options") or {}
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(options, dict) or not isinstance(kwargs, dict):
        raise BadRequest("'stream_options' and 'chat_template_kwargs' must be objects")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("chat_template_kwargs.enable_thinking must be true or false", "chat_template_kwargs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    temperature = _number(body, "temperature", 0, 2)
    if temperature is not None and 0 < temperature < MIN_TEMPERATURE:
        raise BadRequest(f"'temperature' must be 0 (greedy) or in [{MIN_TEMPERATURE}, 2], got {temperature}",
                         "temperature")
    return ChatRequest(
        messages=_messages(body.get("messages")), max_tokens=max_a if max_a is not None else max_b,
        temperature=temperature, top_p=_number(body, "top_p", 0, 1, lo_open=True),
        top_k=_number(body, "top_k", 0, 1 << 20, integer=True), seed=_number(body, "seed", 0, 2**63 - 1, integer=True),
        stop=stop, stream=stream, include_usage=bool(options.get("include_usage")), tools=tools,
        enable_thinking=thinking)


# ---------------------------------------------------------------- what the reply shows
TOOL_TAG, THINK_END = "<tool_call>", "</think>"


def _held_tail(text: str, tags) -> int:
    """How many trailing characters might be the start of one of `tags` (not emitted yet): the
    longest suffix of `text` that is a proper prefix of a tag. Linear in the tag's length per call
    (a KMP automaton over the last len(tag) - 1 characters), where trying every prefix was quadratic."""
    return max((_prefix_suffix(text[-(len(tag) - 1):], tag) for tag in tags if len(tag) > 1), default=0)


@functools.lru_cache(maxsize=64)
def _failure(tag: str) -> tuple[int, ...]:
    """KMP's table: fail[i] = the longest proper prefix of tag[:i + 1] that is also its suffix."""
    fail, k = [0] * len(tag), 0
    for i in range(1, len(tag)):
        while k and tag[i] != tag[k]:
            k = fail[k - 1]
        if tag[i] == tag[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


def _prefix_suffix(tail: str, tag: str) -> int:
    start = tail.find(tag[0])  # no character of tail starts the tag: nothing to hold (the usual case)
    if start < 0:
        return 0
    fail, k = _failure(tag), 0
    for c in tail[start:]:
        while k and (k == len(tag) or c != tag[k]):
            k = fail[k - 1]
        if c == tag[k]:
            k += 1
    return k if k < len(tag) else fail[k - 1]


def visible(text: str, stop: list[str], thinking: bool, tools: bool, final: bool) -> tuple[str, str, bool]:
    """(reasoning, content, stopped) a client may be shown of the reply text so far: cut at the
    first stop string; reasoning up to </think> when the prompt opened a think block; content up to
    the first <tool_call> when tools were given (the call comes back parsed). Unless final, a tail
    that could still become a stop string or tag is held back, so what was shown is never taken back."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    stopped = bool(cuts)
    if cuts:
        text = text[: min(cuts)]
    elif not final and stop:
        text = text[: len(text) - _held_tail(text, stop)]
    reasoning = ""
    if thinking:
        if THINK_END in text:
            reasoning, text = text.split(THINK_END, 1)
            text = text.lstrip("\n")
        else:
            reasoning = text if final else text[: len(text) - _held_tail(text, [THINK_END])]
            text = ""
    if tools:
        if TOOL_TAG in text:
            text = text[: text.index(TOOL_TAG)]
        elif not final:
            text = text[: len(text) - _held_tail(text, [TOOL_TAG])]
    return reasoning, text, stopped


def tool_calls_of(text: str, tools) -> list[dict]:
    """The reply's calls in the OpenAI shape (arguments as a JSON string), each with a fresh id."""
    _, calls = parse_tool_calls(text.split(THINK_END)[-1], tools)
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion(cid: str, model: str, message: dict, finish: str, use: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}], "usage": use}


def chunk(cid: str, model: str, delta: dict | None, finish: str | None = None, use: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    out = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
