"""npu-serve against the official `openai` client, on the loopback only: replies equal npu-chat's,
a conversation's next request prefills only what departs from it (cached_tokens), tools render
as transformers renders them, concurrent and disconnecting clients, the API key, bad requests, and
no memory growth over 200 requests. Every loop here is bounded in count and time."""
import contextlib
import http.client
import io
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import hybrid_npu  # noqa: E402
from hybrid_npu.runtime.chat.cli import main as chat_main  # noqa: E402
from hybrid_npu.runtime.serve.api import parse_request, tool_calls_of, visible  # noqa: E402

KEY = "test-key-123"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def raw(port: int, method: str, path: str, body: str | None = None, key: str | None = KEY):
    """A plain HTTP request (status, JSON or text), for what the openai client will not send."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        text = r.read().decode()
        return r.status, text
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "hybrid_npu.runtime.serve.cli", "--port", str(self.port),
                                      *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                if raw(self.port, "GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError("npu-serve did not come up in 120 s")

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self) -> str:
        self.proc.terminate()
        try:
            return self.proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.communicate()[1]


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", KEY)
    yield s
    s.stop()


def npu_chat(prompt: str, n: int) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert chat_main(["--prompt", prompt, "--json", "--max-new-tokens", str(n)]) == 0
    return json.loads(out.getvalue())


def ask(client, messages, n=16, **kw):
    return client.chat.completions.create(model="default", messages=messages, max_tokens=n, **kw)


def test_replies_equal_npu_chat_streaming_or_not(server):
    want = npu_chat("def add(a, b):", 20)
    client = server.client()
    assert [m.id for m in client.models.list()] == ["default"]
    reply = ask(client, [{"role": "user", "content": "def add(a, b):"}], 20)
    assert reply.choices[0].message.content == want["text"]
    assert reply.usage.completion_tokens == len(want["token_ids"])
    assert reply.choices[0].finish_reason == ("length" if len(want["token_ids"]) == 20 else "stop")
    pieces, usage, finish = [], None, None
    for event in ask(client, [{"role": "user", "content": "def add(a, b):"}], 20, stream=True,
                     stream_options={"include_usage": True}):
        if event.usage:
            usage = event.usage
        for choice in event.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == want["text"] and finish == reply.choices[0].finish_reason
    assert usage.completion_tokens == len(want["token_ids"])
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # the same prompt again


def test_a_seed_reproduces_a_sampled_reply_and_it_is_npu_chats(server):
    """Four identical sampled requests with one seed: one reply (the server speculates; its policy
    decides from timings), and it is npu-chat's plain-decoded reply with that seed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert chat_main(["--prompt", "class Stack:", "--json", "--max-new-tokens", "24", "--temperature", "0.8",
                          "--seed", "1", "--no-speculative"]) == 0
    want = json.loads(out.getvalue())["text"]
    client = server.client()
    replies = {ask(client, [{"role": "user", "content": "class Stack:"}], 24, temperature=0.8, seed=1)
               .choices[0].message.content for _ in range(4)}
    assert replies == {want}


def test_the_next_request_of_a_conversation_prefills_only_its_new_part(server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hybrid_npu.default_model())
    client = server.client()
    first = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "class Stack:"}]
    r1 = ask(client, first, 12)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "Add a pop method."}]
    r2 = ask(client, second, 12)
    p1, p2 = hf_ids(tok, first), hf_ids(tok, second)
    assert r2.usage.prompt_tokens == len(p2)
    departs = next(i for i, (a, b) in enumerate(zip(p1, p2)) if a != b)  # the template drops the think block
    assert r2.usage.prompt_tokens_details.cached_tokens == departs > len(p1) // 2
    want = npu_chat_messages(second, 12)
    assert r2.choices[0].message.content == want


def test_interleaved_conversations_each_resume_their_own_state(server):
    """A, then B, then A again: A's second request resumes A's kept context, not B's, and the
    reply equals a fresh engine's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hybrid_npu.default_model())
    client = server.client()
    a1 = [{"role": "user", "content": "def mean(xs):"}]
    ra = ask(client, a1, 10).choices[0].message.content
    ask(client, [{"role": "user", "content": "import json"}], 10)  # another conversation in between
    a2 = a1 + [{"role": "assistant", "content": ra}, {"role": "user", "content": "Now the median."}]
    r = ask(client, a2, 10)
    p1, p2 = hf_ids(tok, a1), hf_ids(tok, a2)
    departs = next(i for i, (x, y) in enumerate(zip(p1, p2)) if x != y)
    assert r.usage.prompt_tokens_details.cached_tokens == departs
    assert r.choices[0].message.content == npu_chat_messages(a2, 10)


def hf_ids(tok, messages, **kw) -> list[int]:
    """transformers' rendering of the messages, tokenized as the engine tokenizes a prompt."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return tok.encode(text, add_special_tokens=False)


def npu_chat_messages(messages, n):
    """A fresh engine's greedy reply to these messages (the reference for the server's)."""
    from hybrid_npu.runtime.chat.conversation import Conversation, Sampling

    conv = Conversation(hybrid_npu.load_engine(hybrid_npu.default_model()))
    conv.messages = list(messages[:-1])
    return conv.reply(messages[-1]["content"], Sampling(max_new_tokens=n, speculative=False)).text


def test_tools_render_as_transformers_and_calls_come_back_parsed(server):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hybrid_npu.default_model())
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    reply = ask(server.client(), messages, 6, tools=TOOLS)
    for_hf = [dict(m) for m in messages]
    for_hf[1] = {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert reply.usage.prompt_tokens == len(hf_ids(tok, for_hf, tools=TOOLS))
    # what the model would write for a call (the release template's own format) comes back as a call
    text = "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    calls = tool_calls_of(text, TOOLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert visible(text, [], False, True, final=True) == ("", "Let me check.\n\n", False)
    assert visible(text[:20], [], False, True, final=False)[1] == "Let me check.\n\n"  # "<tool_" held back


def test_two_clients_at_once_both_get_their_own_answers(server):
    prompts = ["import os", "def fib(n):"]
    want = {p: npu_chat(p, 12)["text"] for p in prompts}
    got = {}

    def one(p):
        got[p] = ask(server.client(), [{"role": "user", "content": p}], 12).choices[0].message.content

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == want


def test_a_client_that_leaves_mid_stream_then_a_new_request(server):
    body = {"model": "default", "messages": [{"role": "user", "content": "def parse(text):"}], "max_tokens": 200,
            "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = conn.getresponse()
    events = 0
    while events < 3:
        events += r.readline().startswith(b"data:")
    conn.close()  # leave: the server stops this generation at its next step
    want = npu_chat("def parse(text):", 10)["text"]
    assert ask(server.client(), [{"role": "user", "content": "def parse(text):"}], 10).choices[0].message.content == want


def test_the_api_key_is_required(server):
    for key in ("wrong", ""):
        with pytest.raises(openai.AuthenticationError):
            ask(server.client(key or "none"), [{"role": "user", "content": "x"}], 2)
    assert raw(server.port, "GET", "/v1/models", key=None)[0] == 401
    assert raw(server.port, "GET", "/health", key=None)[0] == 200


@pytest.mark.parametrize("body, needle", [
    ("{bad json", "not valid JSON"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "'temperature' must be in"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "'top_p' must be in"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "'max_tokens' must be in"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "'max_tokens' must be an integer"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "'n' other than 1"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1]}, "'stop' must be"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"nope": 1}]}, "is not a function spec"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, "memory plan allows"),
])
def test_bad_requests_are_400_with_a_message(server, body, needle):
    data = body if isinstance(body, str) else json.dumps(body)
    status, text = raw(server.port, "POST", "/v1/chat/completions", data)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert needle in error["message"] and "Traceback" not in text
    if "memory plan" in needle:
        assert error["code"] == "context_length_exceeded"


def test_parse_request_reads_the_openai_fields():
    req = parse_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                      {"role": "user", "content": "hi"}],
                         "max_completion_tokens": 7, "max_tokens": 99, "stop": "END", "seed": 5, "top_k": 3,
                         "stream": True, "stream_options": {"include_usage": True},
                         "chat_template_kwargs": {"enable_thinking": True}})
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert (req.max_tokens, req.stop, req.seed, req.top_k, req.stream, req.include_usage, req.enable_thinking) == \
        (7, ["END"], 5, 3, True, True, True)
    assert visible("abc END def", ["END"], False, False, final=False) == ("", "abc ", True)
    assert visible("abc EN", ["END"], False, False, final=False) == ("", "abc ", False)
    assert visible("why\n</think>\n\nso", [], True, False, final=False) == ("why\n", "so", False)


def test_no_memory_growth_over_200_requests():
    """RSS after 200 requests (sequential and four at a time, several conversations) is within 10% of
    RSS after 20."""
    import psutil
    from concurrent.futures import ThreadPoolExecutor

    s = Server("--conversations", "3")
    try:
        client = s.client()
        topics = ["import re", "class Node:", "def walk(tree):", "for i in range(10):", "with open(path) as f:"]

        def one(i):
            messages = [{"role": "user", "content": topics[i % len(topics)]}]
            return ask(client, messages, 4).usage.completion_tokens

        proc = psutil.Process(s.proc.pid)
        assert all(one(i) >= 1 for i in range(20))
        after_20 = proc.memory_info().rss
        with ThreadPoolExecutor(4) as pool:
            assert all(n >= 1 for n in pool.map(one, range(20, 120)))
        assert all(one(i) >= 1 for i in range(120, 200))
        after_200 = proc.memory_info().rss
        assert after_200 <= 1.10 * after_20, (after_20, after_200)
    finally:
        log = s.stop()
    assert log.count("prompt tokens") == 200  # one log line a request


def test_tools_with_the_release_template(release):
    """Tools and a tool-call round in the history, on the released Qwen3.5 template: the prompt the
    server gives the model is transformers' apply_chat_template of the same messages."""
    s = Server(str(release.out))
    try:
        messages = [{"role": "system", "content": ""}, {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "Let me check.", "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
        reply = ask(s.client(), messages, 4, tools=TOOLS)
        for_hf = [dict(m) for m in messages]
        for_hf[2] = {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
        tok = release.hf_tokenizer()
        assert reply.usage.prompt_tokens == len(hf_ids(tok, for_hf, tools=TOOLS))
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        s.stop()


def test_beyond_loopback_without_a_key_warns_and_a_taken_port_is_one_line(capsys):
    from hybrid_npu.runtime.serve.cli import main as serve_main

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_main(["--host", "0.0.0.0", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "without --api-key" in err[0] and f"cannot listen on 0.0.0.0:{port}" in err[1] and len(err) == 2
    assert serve_main(["--port", "0"]) == 2 and "--port 0" in capsys.readouterr().err


def test_cors_only_for_the_origin_given():
    s = Server("--cors-origin", "http://app.local")
    try:
        def preflight(origin):
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            conn.request("OPTIONS", "/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})
            r = conn.getresponse()
            r.read()
            conn.close()
            return r.getheader("access-control-allow-origin")

        assert preflight("http://app.local") == "http://app.local"
        assert preflight("http://evil.example") is None
    finally:
        s.stop()


def test_an_ipv6_host_prints_a_url_a_client_can_use():
    """npu-serve --host ::1 names its address as http://[::1]:PORT/v1 (RFC 3986 brackets), and the
    openai client reaches the server at exactly the URL printed."""
    import re
    from urllib.parse import urlsplit

    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hybrid_npu.runtime.serve.cli", "--host", "::1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, encoding="utf-8")
    try:
        line = proc.stderr.readline()  # the banner, once the model is loaded (bounded by the timeout below)
        url = re.search(r"http://\S+/v1", line).group(0)
        assert url == f"http://[::1]:{port}/v1" and urlsplit(url).hostname == "::1"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 120
        while True:
            try:
                assert [m.id for m in client.models.list()] == ["default"]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.3)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
