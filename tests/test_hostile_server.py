"""Hostile requests to npu-serve, sent the way a browser or an attacker would, over the loopback
only: web pages (simple POSTs, preflights, a foreign Host or Origin), oversized and deeply nested
bodies, lone surrogates, stop strings, sampling settings, a hostile chat template, a full queue and
a client that leaves. Each is refused with a 4xx and a one-line message, the server's memory stays
bounded (psutil), and the running server still answers /health afterwards."""
import http.client
import json
import random
import select
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

pytest.importorskip("fastapi")

from hostile import CHATML, MiB, one_line, template_export  # noqa: E402
from hybrid_npu.runtime.serve.api import _held_tail  # noqa: E402

KEY = "test-key-456"
LIMIT = 1 << 20  # --max-request-bytes of the plain server
SERVER_RSS = 1536 * MiB  # the embedded model's server stays far below this whatever it is sent
HELLO = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, method, path, body=None, headers=None, timeout=120):
    """(status, headers, text) for a request exactly as given (Host and Content-Type included)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    head = {"Content-Type": "application/json", **(headers or {})}
    head = {k: v for k, v in head.items() if v is not None}
    try:
        conn.request(method, path, body=data, headers=head)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def refused(status: int, text: str, needle: str) -> None:
    assert 400 <= status < 500, (status, text[:500])
    message = json.loads(text)["error"]["message"]
    assert needle in one_line(message), message


class Server:
    def __init__(self, tmp, *args):
        self.port = free_port()
        self.log = tmp / f"serve-{self.port}.log"
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "hybrid_npu.runtime.serve.cli", "--port", str(self.port),
                                      *args], stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if self.health():
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError("npu-serve did not come up in 120 s")

    def health(self) -> bool:
        return request(self.port, "GET", "/health", timeout=30)[0] == 200

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        return self.log.read_text()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("plain"), "--max-request-bytes", str(LIMIT))
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _still_serving(request):
    """After every test: each server it used still answers and its memory is bounded."""
    yield
    for name in ("plain", "keyed", "hostile"):
        if name in request.fixturenames:
            s = request.getfixturevalue(name)
            assert s.health() and s.rss() < SERVER_RSS, s.rss() / MiB


# ---------------------------------------------------------------- a web page (defect 7)
EVIL = "http://evil.example"


@pytest.mark.parametrize("headers, status, needle", [
    ({"Content-Type": "text/plain;charset=UTF-8"}, 415, "Content-Type 'text/plain' is not accepted"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "is not accepted"),
    ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "is not accepted"),
    ({"Content-Type": None}, 415, "Content-Type 'none'"),
    ({"Content-Type": "text/plain", "Origin": EVIL}, 403, "web pages at 'http://evil.example'"),
    ({"Origin": EVIL}, 403, "are not allowed"),
    ({"Host": "rebind.evil.example"}, 403, "Host 'rebind.evil.example"),  # DNS rebinding: same origin, wrong name
    ({"Host": "localhost.evil.example:8080", "Origin": "http://localhost.evil.example:8080"}, 403, "is not this server"),
])
def test_a_web_page_cannot_run_the_model(plain, headers, status, needle):
    got, _, text = request(plain.port, "POST", "/v1/chat/completions", HELLO, headers)
    assert got == status
    refused(got, text, needle)


def test_reads_from_a_foreign_host_or_origin_are_refused_too(plain):
    for headers in ({"Host": "evil.example"}, {"Origin": EVIL}):
        for path in ("/v1/models", "/health"):
            status, _, text = request(plain.port, "GET", path, headers=headers)
            refused(status, text, "not")
    assert request(plain.port, "GET", "/health", headers={"Host": f"localhost:{plain.port}"})[0] == 200
    assert request(plain.port, "GET", "/health", headers={"Host": f"[::1]:{plain.port}"})[0] == 200


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("keyed"), "--api-key", KEY, "--cors-origin", "http://app.local",
               "--allowed-host", "npu.lan")
    yield s
    s.stop()


def test_the_allowed_origin_passes_its_preflight_before_the_key_check(keyed):
    pre = {"Origin": "http://app.local", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type", "Content-Type": None}
    status, headers, _ = request(keyed.port, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.local"
    status, _, text = request(keyed.port, "OPTIONS", "/v1/chat/completions", headers={**pre, "Origin": EVIL})
    refused(status, text, "not allowed")
    for scheme in ("Bearer", "bearer", "BEARER"):
        status, headers, text = request(keyed.port, "POST", "/v1/chat/completions", HELLO,
                                        {"Origin": "http://app.local", "Authorization": f"{scheme} {KEY}"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://app.local", text
    for auth in (f"Basic {KEY}", "Bearer wrong", None):
        status, _, text = request(keyed.port, "POST", "/v1/chat/completions", HELLO, {"Authorization": auth})
        assert status == 401
        refused(status, text, "API key")


def test_allowed_host_names_are_served_and_others_are_not(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert request(keyed.port, "GET", "/v1/models", headers={**auth, "Host": f"npu.lan:{keyed.port}"})[0] == 200
    status, _, text = request(keyed.port, "GET", "/v1/models", headers={**auth, "Host": "other.lan"})
    assert status == 403
    refused(status, text, "--allowed-host")


# ---------------------------------------------------------------- size (defect 2)
def raw_send(port: int, head: bytes, chunks) -> tuple[int, str]:
    """Send the head, then the body piece by piece until the server answers; its answer."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        try:
            for c in chunks:
                if select.select([s], [], [], 0.05)[0]:
                    break  # answered: the rest is never sent
                s.sendall(c)
            while piece := s.recv(65536):
                data += piece
        except ConnectionResetError:  # closed with our bytes unread: what came before counts
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    assert head, "no answer"
    return int(head.split()[1]), body.decode("utf-8", "replace")


def test_a_body_over_the_bound_is_refused_before_it_is_read(plain):
    big = b"x" * (50 * LIMIT)  # 50 MB took the server past 6 GB
    before = plain.rss()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{plain.port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(big)}\r\nConnection: close\r\n\r\n").encode()
    status, text = raw_send(plain.port, head, [big[i:i + 65536] for i in range(0, len(big), 65536)])
    assert status == 413
    refused(status, text, f"over {LIMIT:,} bytes")
    # no Content-Length: the bytes are counted as they arrive
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{plain.port}\r\nContent-Type: application/json"
            "\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    piece = b"x" * 65536
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 100
    status, text = raw_send(plain.port, head, chunks)
    assert status == 413
    refused(status, text, "--max-request-bytes")
    assert plain.rss() - before < 200 * MiB


def test_a_prompt_over_the_context_is_refused_with_a_bounded_cost(plain):
    body = {"messages": [{"role": "user", "content": "x " * (LIMIT // 2 - 100)}], "max_tokens": 2}
    status, _, text = request(plain.port, "POST", "/v1/chat/completions", body)
    refused(status, text, "memory plan allows")
    assert json.loads(text)["error"]["code"] == "context_length_exceeded"


# ---------------------------------------------------------------- bodies that crashed it (defect 12)
def nested(depth: int, inner="1") -> str:
    return "[" * depth + inner + "]" * depth


BAD = {
    "a role that is a list": ({"messages": [{"role": ["user"], "content": "x"}]}, "unknown role"),
    "a role that is an object": ({"messages": [{"role": {"name": "user"}, "content": "x"}]}, "unknown role"),
    "a body nested 100k deep": (nested(100_000), "nests deeper than 64"),
    "a field nested 100k deep": ('{"messages": [{"role": "user", "content": "x"}], "tools": ' + nested(100_000) + "}",
                                 "nests deeper than 64"),
    "a field nested 100 deep": ('{"messages": [{"role": "user", "content": "x"}], "user": ' + nested(100) + "}",
                                "nests deeper than 64"),
    "tool-call arguments nested 100k deep": (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": nested(100_000)}}]}]}, "nest deeper than 64"),
    "tool-call arguments nested 100 deep": (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"a": ' + nested(100) + "}"}}]}]},
        "nests deeper than 64"),
    "a lone surrogate in content": ('{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "lone surrogate"),
    "a lone low surrogate in a system prompt": (
        '{"messages": [{"role": "system", "content": "\\udfff"}, {"role": "user", "content": "x"}]}', "lone surrogate"),
    "a lone surrogate in tool-call arguments": (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud83d"}'}}]}]}, "lone surrogate"),
    # sampling (defect 11)
    "temperature 5e-324": ({**HELLO, "temperature": 5e-324}, "'temperature' must be 0 (greedy) or in"),
    "temperature 1e-10": ({**HELLO, "temperature": 1e-10}, "'temperature' must be 0 (greedy) or in"),
    # stop strings (defect 3)
    "four stops of 200,000 characters": ({**HELLO, "stop": ["ab" * 100_000] * 4}, "at most 1000 characters"),
    "a stop of 1001 characters": ({**HELLO, "stop": "x" * 1001}, "at most 1000 characters"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_body_is_a_400_in_one_line(plain, name):
    body, needle = BAD[name]
    status, _, text = request(plain.port, "POST", "/v1/chat/completions", body)
    assert status == 400
    refused(status, text, needle)


def test_the_held_tail_check_is_the_brute_force_one_and_long_stops_cost_little(plain):
    """_held_tail against the quadratic definition it replaced (the reference), then a request with
    four 1000-character stops that never match: it is answered like any other."""
    def reference(text, tags):
        return max((k for tag in tags for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)

    rng = random.Random(7)
    for _ in range(5000):
        tags = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        assert _held_tail(text, tags) == reference(text, tags), (text, tags)
    stops = ["\u2603" * 999 + c for c in "abcd"]
    status, _, text = request(plain.port, "POST", "/v1/chat/completions", {**HELLO, "max_tokens": 40, "stop": stops})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] >= 1, text


def test_threads_and_temperature_flags_are_bounded(capsys):
    from hybrid_npu.runtime.chat.cli import main as chat_main
    from hybrid_npu.runtime.serve.cli import main as serve_main

    for argv, main, needle in ((["--threads", "100000"], serve_main, "--threads 100000: give 1 to"),
                               (["--threads", "100000", "--prompt", "x"], chat_main, "--threads 100000: give 1 to"),
                               (["--temperature", "5e-324", "--prompt", "x"], chat_main, "--temperature 5e-324"),
                               (["--temperature", "1e-9", "--prompt", "x"], chat_main, "--temperature 1e-09")):
        assert main(argv) == 2
        assert needle in one_line(capsys.readouterr().err)
    import hybrid_npu
    from hybrid_npu.errors import UserError

    with pytest.raises(UserError, match=r"^threads=100000: give 1 to"):  # the API, before any graph opens
        hybrid_npu.load_engine(hybrid_npu.default_model(), threads=100000)


# ---------------------------------------------------------------- a client that leaves (defect 4)
def test_a_non_streaming_request_stops_when_its_client_leaves(plain):
    # greedy, this prompt runs to max_tokens (3,000 tokens, seconds even on a fast machine): the close
    # below lands mid-reply whatever the machine's speed
    body = json.dumps({"messages": [{"role": "user", "content": "class Node:"}], "max_tokens": 3000,
                       "temperature": 0}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{plain.port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    lines = plain.log.read_text().count("prompt tokens")
    with socket.create_connection(("127.0.0.1", plain.port), timeout=60) as s:
        s.sendall(head + body)
        time.sleep(0.5)  # generating by now: the close below is a client leaving mid-reply
    deadline = time.monotonic() + 120
    while plain.log.read_text().count("prompt tokens") == lines and time.monotonic() < deadline:
        time.sleep(0.2)
    last = plain.log.read_text().strip().splitlines()[-1]
    assert "(client gone)" in last and int(last.split(" generated")[0].rsplit(", ", 1)[-1]) < 3000, last


# ---------------------------------------------------------------- a hostile template, a full queue (defects 1, 4)
HOSTILE = ("{%- if messages[-1].content == 'spin' %}{% set s = 'a' * 1000000 %}{% for i in range(1000000) %}"
           "{% set x = s|replace('a', 'b') %}{% endfor %}{% endif -%}"
           "{%- if messages[-1].content == 'loops' %}{% for i in range(100000) %}{% for j in range(100000) %}"
           "{% endfor %}{% endfor %}{% endif -%}"
           "{%- if messages[-1].content == 'pow' %}{{ 10**(10**9) }}{% endif -%}"
           "{%- if messages[-1].content == 'grow' %}{{ 'a' * 10**10 }}{% endif -%}"
           "{%- if messages[-1].content == 'recurse' %}{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
           "{% endif -%}" + CHATML)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    s = Server(root, str(template_export(root, HOSTILE, full=True)), "--max-queue", "1")
    yield s
    s.stop()


@pytest.mark.parametrize("content, needle", [("pow", "integer bound"), ("grow", "over the bound of 8,000,000"),
                                             ("loops", "steps of work"), ("recurse", "nested more than 64")])
def test_a_hostile_template_is_a_400_and_the_server_stays_up(hostile, content, needle):
    """It used to hang the constructor (pow: the server never listened) or the event loop."""
    status, _, text = request(hostile.port, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert status == 400
    refused(status, text, needle)


def test_while_a_template_spins_health_answers_and_the_queue_is_bounded(hostile):
    got = {}

    def spin():
        got["spin"] = request(hostile.port, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "spin"}], "max_tokens": 2})

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(1)  # the spin request holds the one place (--max-queue 1) while its template runs
    assert hostile.health() and t.is_alive()  # the event loop is free while a render runs
    status, headers, text = request(hostile.port, "POST", "/v1/chat/completions", HELLO)
    busy = t.is_alive()
    t.join(timeout=120)
    assert busy and status == 503 and headers["retry-after"].isdigit()
    assert "--max-queue" in one_line(json.loads(text)["error"]["message"])
    refused(got["spin"][0], got["spin"][2], "more than 5 s")
    assert request(hostile.port, "POST", "/v1/chat/completions", HELLO)[0] == 200  # its place was given back


def test_a_reply_whose_tool_arguments_nest_100k_deep_stays_text():
    """Model output is bounded by max_tokens, not by a nesting rule: a call whose value would not
    parse within Python's recursion limit comes back as the text it is, not as a 500."""
    from hybrid_npu.runtime.serve.api import tool_calls_of

    value = nested(100_000)
    reply = f"<tool_call>\n<function=f>\n<parameter=a>\n{value}\n</parameter>\n</function>\n</tool_call>"
    (call,) = tool_calls_of(reply, None)
    assert json.loads(call["function"]["arguments"]) == {"a": value}


@pytest.mark.slow
def test_sigterm_is_honoured_while_a_template_spins(tmp_path):
    """The event loop is free while a hostile render runs, so SIGTERM stops the server (it waits
    for the render to reach its bound) instead of being ignored."""
    s = Server(tmp_path, str(template_export(tmp_path, HOSTILE, full=True)))
    t = threading.Thread(target=lambda: request(s.port, "POST", "/v1/chat/completions",
                                                {"messages": [{"role": "user", "content": "spin"}]}))
    t.start()
    time.sleep(1)
    s.proc.terminate()
    assert s.proc.wait(timeout=60) is not None  # no kill needed
    t.join(timeout=60)
    s.stop()
