"""npu-serve's application: OpenAI-compatible chat completions over one model and its contexts.

One model, one worker thread: requests run in arrival order (a single-thread executor is a FIFO
queue), so a waiting request's stream starts when its turn comes. Each request renders its
messages with the model's own template (the same code path as npu-chat), goes to whichever kept
conversation keeps the most of that prompt (contexts.py), prefills only the rest and keeps
two turn checkpoints, as a chat turn does. A client that goes away mid-stream stops its generation
at the last committed token; the context it leaves is consistent and can be resumed from.

Hostile requests (docs/reliability-server.md): guard.py checks Host, Origin, the key,
Content-Type and Content-Length first; the body is counted as it arrives and refused past
--max-request-bytes; parsing, rendering and tokenizing run in a thread, never on the event loop
(/health answers meanwhile); at most --max-queue requests are prepared, wait for the worker or
run on it, the next gets a 503 with Retry-After; a client that disconnects stops its generation,
streamed or not.
"""

import asyncio
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from typing import Callable

from hybrid_npu.errors import UserError

from . import api
from ..chat.template import ChatTemplate
from ..chat.conversation import StreamDecoder, checkpoint_marks
from ..generation import stream
from ..sampling import Sampler
from .contexts import ServedContexts
from .guard import Guard, HostCheck, too_large_message

DEFAULT_MAX_QUEUE = 16
RETRY_AFTER_S = 5


def default_max_request_bytes(max_context: int) -> int:
    """A body that could fit the context: 64 bytes a token covers JSON escapes (a CJK character is
    one token and six bytes as \\uXXXX) and the fields around the text; at least 1 MiB for tools."""
    return max(64 * max_context, 1 << 20)


@dataclass
class Prepared:
    request: api.ChatRequest
    ids: list[int]
    max_tokens: int
    thinking: bool  # the prompt opened a <think> block: the reply starts with reasoning


@dataclass
class Result:
    message: dict
    finish: str
    usage: dict


def _log(line: str) -> None:
    print(f"npu-serve: {line}", file=sys.stderr, flush=True)


class ChatService:
    def __init__(self, model, model_id: str, conversations: int = 4, speculative: bool | None = None,
                 log: Callable[[str], None] = _log, max_queue: int = DEFAULT_MAX_QUEUE):
        self.model, self.model_id, self.speculative, self.log = model, model_id, speculative, log
        self.template = ChatTemplate.from_export(model.path, model.manifest)
        self.contexts = ServedContexts(model, conversations)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="npu-serve")
        self.max_queue, self.active = max_queue, 0
        self._lock = threading.Lock()
        self._longest_token = None

    def admit(self) -> bool:
        """Take a place among the requests being read, prepared, waiting or run; False when full."""
        with self._lock:
            if self.active >= self.max_queue:
                return False
            self.active += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.active -= 1

    def longest_token_chars(self) -> int:
        if self._longest_token is None:
            self._longest_token = max((len(t) for t in self.model.tokenizer.get_vocab()), default=1)
        return self._longest_token

    def prepare(self, req: api.ChatRequest) -> Prepared:
        """Render and count before any work: a prompt over the memory plan is refused here."""
        try:
            text = self.template.render(req.messages, add_generation_prompt=True,
                                        enable_thinking=req.enable_thinking, tools=req.tools)
        except UserError as e:
            raise api.BadRequest(str(e), "messages") from None
        limit = self.model.memory.max_context
        # no token is longer than the vocabulary's longest (x4: normalisation may shrink text), so a
        # prompt this long cannot fit: refused before the tokenizer spends time and memory on it
        at_least = len(text) // (4 * self.longest_token_chars())
        if at_least + (req.max_tokens or 1) > limit:
            raise api.BadRequest(f"this request needs at least {at_least} prompt tokens + {req.max_tokens or 1} to "
                                 f"generate, but the memory plan allows {limit} tokens of context; shorten the "
                                 "conversation or lower max_tokens", "messages", "context_length_exceeded")
        ids = self.model.tokenizer.encode(text, add_special_tokens=False).ids
        max_tokens = req.max_tokens or max(min(limit - len(ids), api.DEFAULT_MAX_TOKENS), 1)
        if len(ids) + max_tokens > limit:
            raise api.BadRequest(f"this request needs {len(ids)} prompt tokens + {max_tokens} to generate = "
                                 f"{len(ids) + max_tokens}, but the memory plan allows {limit} tokens of context; "
                                 "shorten the conversation or lower max_tokens", "messages", "context_length_exceeded")
        return Prepared(req, ids, max_tokens, text.endswith("<think>\n"))

    def run(self, p: Prepared, on_delta: Callable[[dict], None] | None, gone: Callable[[], bool]) -> Result:
        """Generate the reply (in the worker thread); on_delta gets stream deltas as they are shown."""
        req, model = p.request, self.model
        context = self.contexts.take_best(p.ids, len(p.ids) + p.max_tokens)
        kept = context.resume(p.ids)
        marks = checkpoint_marks(model, self.template, req.messages, p.ids, req.enable_thinking, req.tools)
        decoder, shown, stopped = StreamDecoder(model.tokenizer), ["", ""], [False]

        def show(final: bool) -> None:
            reasoning, content, stopped[0] = api.visible(decoder.shown, req.stop, p.thinking, bool(req.tools), final)
            for key, text, i in (("reasoning_content", reasoning, 0), ("content", content, 1)):
                if len(text) > len(shown[i]) and text.startswith(shown[i]):
                    if on_delta is not None:
                        on_delta({key: text[len(shown[i]):]})
                    shown[i] = text

        sampler = Sampler.from_defaults(model.sampling_defaults, req.temperature, req.top_k, req.top_p, req.seed,
                                        p.max_tokens)
        tokens = stream(model, context, p.ids[kept:], sampler, p.max_tokens, append=True, speculative=self.speculative,
                        should_stop=lambda: stopped[0] or gone(), checkpoint_at=marks)
        with closing(tokens):
            for token in tokens:
                decoder.push(token)
                show(final=False)
        new, s = tokens.response.ids, tokens.response.stats
        decoder.flush()
        show(final=True)
        text = decoder.shown
        calls = api.tool_calls_of(text, req.tools) if req.tools else []
        message = {"role": "assistant", "content": shown[1] if shown[1] or not calls else None}
        if p.thinking:
            message["reasoning_content"] = shown[0]
        if calls:
            message["tool_calls"] = calls
        ended = stopped[0] or (new and new[-1] in model.config.eos_token_ids) or gone()
        finish = "tool_calls" if calls else "stop" if ended else "length"
        rate = f"{s['decode_tokens_per_s']:.1f} tok/s" if len(new) > 1 else "n/a tok/s"
        self.log(f"{len(p.ids)} prompt tokens ({kept} cached, {s['prefill_tokens']} prefilled on "
                 f"{s['prefill_device']}), {len(new)} generated at {rate}, finish {finish}"
                 + (" (client gone)" if gone() else ""))
        return Result(message, finish, api.usage(len(p.ids), len(new), kept))


def create_app(service: ChatService, api_key: str | None = None, cors_origin: str | None = None,
               host: str = "127.0.0.1", allowed_hosts=(), max_request_bytes: int | None = None):
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from sse_starlette.sse import EventSourceResponse

    limit = max_request_bytes or default_max_request_bytes(service.model.memory.max_context)
    app = FastAPI(title="npu-serve", docs_url=None, redoc_url=None, openapi_url=None)
    if cors_origin:
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=[cors_origin], allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Guard, hosts=HostCheck(host, allowed_hosts), api_key=api_key, cors_origin=cors_origin,
                       max_request_bytes=limit)  # added last: outermost, before CORS and the routes

    def refuse(e: api.BadRequest, headers=None) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        return refuse(api.BadRequest("the request does not match the API; see the OpenAI chat completions format"))

    @app.exception_handler(Exception)
    async def failed(request, exc):  # never a traceback in a body
        service.log(f"internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(api.error_body(f"internal error ({type(exc).__name__}); see the server log",
                                           "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_id}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_id, "object": "model", "created": 0,
                                            "owned_by": "hybrid-npu"}]}

    async def body_of(request: Request) -> bytes | None:
        """The body, counted as it arrives: None once it passes the bound (nothing more is read)."""
        parts, n = [], 0
        async for piece in request.stream():
            n += len(piece)
            if n > limit:
                return None
            parts.append(piece)
        return b"".join(parts)

    def prepare(raw: bytes) -> Prepared:  # in a thread: JSON, template and tokenizer never block the loop
        return service.prepare(api.parse_request(api.load_json(raw)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await body_of(request)  # before admit: a slow sender holds a connection, not a place
        if raw is None:
            return refuse(api.BadRequest(too_large_message(limit), status=413, code="request_too_large"))
        if not service.admit():
            return refuse(api.BadRequest(f"the server is busy ({service.max_queue} requests in progress, the bound "
                                         "--max-queue sets); retry later", status=503, kind="server_error",
                                         code="server_busy"), headers={"Retry-After": str(RETRY_AFTER_S)})
        handed = False
        try:
            try:
                prepared = await anyio.to_thread.run_sync(prepare, raw)
            except api.BadRequest as e:
                return refuse(e)
            loop, cid = asyncio.get_running_loop(), api.completion_id()
            handed = True  # from here the worker's job gives the place back
            if prepared.request.stream:
                return EventSourceResponse(_stream(service, prepared, cid, loop), ping=15, sep="\n")
            return await _complete(service, prepared, cid, loop, request, refuse)
        finally:
            if not handed:
                service.release()

    return app


async def _complete(service: ChatService, prepared: Prepared, cid: str, loop, request, refuse):
    """A reply in one body. The worker runs it; meanwhile the connection is watched, and a client
    that has gone stops the generation at its next step, as a stream's does."""
    gone = threading.Event()

    def job() -> Result | None:
        try:
            return None if gone.is_set() else service.run(prepared, None, gone.is_set)
        finally:
            service.release()

    future = loop.run_in_executor(service.executor, job)
    while True:
        done, _ = await asyncio.wait({future}, timeout=0.25)
        if done:
            break
        if await request.is_disconnected():
            gone.set()
    try:
        result = future.result()
    except UserError as e:
        return refuse(api.BadRequest(str(e)))
    if result is None:  # left while waiting: nobody to answer
        return refuse(api.BadRequest("the client went away", status=499))
    return api.completion(cid, service.model_id, result.message, result.finish, result.usage)


async def _stream(service: ChatService, prepared: Prepared, cid: str, loop):
    """The reply as chat.completion.chunk events: the role when the request's turn comes, the text
    as it is decoded, the tool calls and finish reason, then usage (if asked) and [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()

    def put(item) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def job() -> None:
        try:
            if gone.is_set():  # left while waiting in the queue: no work at all
                return
            put(("delta", {"role": "assistant", "content": ""}))
            put(("done", service.run(prepared, lambda d: put(("delta", d)), gone.is_set)))
        except UserError as e:
            put(("error", str(e)))
        except Exception as e:  # noqa: BLE001 - reported to the client and the log, never a traceback
            service.log(f"internal error: {type(e).__name__}: {e}")
            put(("error", f"internal error ({type(e).__name__}); see the server log"))
        finally:
            service.release()
            put(("end", None))

    model = service.model_id
    loop.run_in_executor(service.executor, job)
    try:
        while True:
            kind, value = await queue.get()
            if kind == "delta":
                yield {"data": json.dumps(api.chunk(cid, model, value))}
            elif kind == "done":
                if value.message.get("tool_calls"):
                    calls = [dict(c, index=i) for i, c in enumerate(value.message["tool_calls"])]
                    yield {"data": json.dumps(api.chunk(cid, model, {"tool_calls": calls}))}
                yield {"data": json.dumps(api.chunk(cid, model, {}, value.finish))}
                if prepared.request.include_usage:
                    yield {"data": json.dumps(api.chunk(cid, model, None, use=value.usage))}
            elif kind == "error":
                yield {"data": json.dumps(api.error_body(value))}
            else:
                yield {"data": "[DONE]"}
                return
    finally:
        gone.set()  # a client that went away stops the generation at the next step
