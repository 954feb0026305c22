"""Hostile chat templates: a model folder's template is untrusted code. Each class of attack (output
size, integer size, loop work, wall time, call depth, what Jinja itself raises, compile-time
folding) with inputs of its own, each refused in one line naming the bound, within a time and
memory bound measured here (psutil), with the user's conversation still there afterwards."""
import io
import json
import signal
import subprocess
import sys
import threading

import pytest
from hostile import CHATML, MiB, PeakRSS, one_line, template_export
from hybrid_npu.runtime.chat.template import ChatTemplate
from hybrid_npu.runtime.chat.template_sandbox import TemplateLimits

import hybrid_npu
from hybrid_npu.errors import UserError

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
SECONDS = 30          # far above the 5 s the renderer allows itself, for a loaded machine
MEMORY = 400 * MiB    # peak RSS growth while refusing

BIG = "{% set s = 'a' * 1000000 %}"
CASES = {
    # output size
    "repeat a string 10**10 times": ("{{ 'a' * 10**10 }}", "over the bound of 8,000,000"),
    "print a million 100-character pieces": ("{% for i in range(1000000) %}{{ 'x' * 100 }}{% endfor %}",
                                             "output over the bound"),
    "a list holding one big string a million times": (BIG + "{{ [s] * 1000000 }}", "prints to over"),
    "replace every gap with the string itself": (BIG + "{{ s|replace('', s) }}", "a replaced string"),
    "double a string forty times with ~": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                                           "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", "a joined string"),
    "a %-format width of a billion": ("{{ '%1000000000s' % 'a' }}", "format width"),
    "a str.format width of a billion": ("{{ '{:>999999999}'.format('a') }}", "format width"),
    "center to a billion": ("{{ 'a'|center(1000000000) }}", "an argument of 1,000,000,000"),
    "join a list with itself": ("{% set l = ['a' * 1000000] * 8 %}{{ l|join(l[0]) }}", "prints to over"),
    "expand a thousand tabs to a million columns": ("{{ ('\t' * 1000).expandtabs(1000000) }}", "tabs expanded"),
    "indent a thousand lines by a million": ("{{ ('\n' * 1000)|indent(1000000) }}", "an indented string"),
    "a separator joined a million times": (BIG + "{{ s.join(['a'] * 100) }}", "a joined string"),
    "a strftime_now format of '%c' a million times": ("{{ strftime_now('%c' * 1000000) }}", "strftime_now format"),
    "a %-format filter width of a billion": ("{{ '%1000000000s'|format('a') }}", "format width"),
    "slice into ten million lists": ("{{ [1]|slice(10000000)|list }}", "an argument of 10,000,000"),
    # integer size
    "10**(10**9)": ("{{ 10**(10**9) }}", "integer bound"),
    "squaring forty times": ("{% set ns = namespace(x=7) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
                             "{% endfor %}{{ ns.x }}", "integer bound"),
    "a power of a power": ("{{ (2**1000) ** 3 }}", "integer bound"),
    # loop work
    "nested range(100000) loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                   "{% endfor %}", "steps of work"),
    "nested loops over a string": ("{% set s = 'a' * 5000 %}{% for a in s %}{% for b in s %}{% endfor %}"
                                   "{% endfor %}", "steps of work"),
    "range(10**9)": ("{{ range(10**9)|list }}", "over the bound"),
    "batch into a hundred million": ("{{ [1]|batch(100000000, 'x')|list }}", "an argument of 100,000,000"),
    # call depth
    "a recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested more than 64"),
    "two macros calling each other": ("{% macro a(n) %}{{ b(n) }}{% endmacro %}{% macro b(n) %}{{ a(n) }}"
                                      "{% endmacro %}{{ a(0) }}", "nested more than 64"),
    # what Jinja or Python raises: one line, never a traceback
    "{% include %}": ("{% include 'other.jinja' %}", "TypeError"),
    "{% extends %}": ("{% extends 'base.jinja' %}", "TypeError"),
    "division by zero": ("{{ 1 // 0 }}", "ZeroDivisionError"),
    # compile time: Jinja folds constants while compiling
    "a constant filter Jinja would fold": ("{{ 'aaaaaaaaaa'|center(999999999) }}", "an argument of 999,999,999"),
    "parentheses 5000 deep": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "does not compile"),
    "a template of two million characters": ("{# " + "x" * 2_000_000 + " #}", "over the bound of 1,000,000"),
}


def refuse(source: str, limits: TemplateLimits | None = None) -> str:
    with PeakRSS() as rss:
        with pytest.raises(UserError) as e:
            ChatTemplate(source, limits=limits).render(MESSAGES)
    assert rss.seconds < SECONDS and rss.grew < MEMORY, (rss.seconds, rss.grew / MiB)
    return one_line(str(e.value))


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_template_is_refused_in_one_line(name):
    source, needle = CASES[name]
    assert needle in refuse(source)


def test_wall_time_is_bounded_where_work_is_not():
    """Work that costs time in C (a 1 MB replace each step) is stopped by the clock, not the count."""
    slow = BIG + "{% for i in range(1000000) %}{% set x = s|replace('a', 'b') %}{% endfor %}"
    assert "more than 0.5 s" in refuse(slow, TemplateLimits(seconds=0.5))
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    assert "more than 0.5 s" in refuse(loops, TemplateLimits(seconds=0.5, work=10**12))


def test_a_trusted_template_renders_as_before():
    """The bounds do not touch a real template: the embedded model's renders what transformers does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hybrid_npu.default_model())
    ours = ChatTemplate.from_export(hybrid_npu.default_model())
    long = MESSAGES + [{"role": "assistant", "content": "x" * 100_000}, {"role": "user", "content": "go on"}] * 20
    for messages in (MESSAGES, long):
        assert ours.render(messages) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("source, needle", [
    ("{{ 10**(10**9) }}", "integer bound"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps of work"),
])
def test_npu_chat_render_only_refuses_in_one_line(tmp_path, source, needle):
    """npu-chat --render-only in a fresh process: exit 2, one line, its peak memory bounded."""
    export = template_export(tmp_path, source)
    proc = subprocess.Popen([sys.executable, "-m", "hybrid_npu.runtime.chat.cli", str(export), "--render-only",
                             "--prompt", "hi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakRSS(proc.pid) as rss:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and out == ""
    assert needle in one_line(err) and err.startswith("npu-chat: error:")
    assert rss.peak < 600 * MiB, rss.peak / MiB


SPIN = ("{%- if messages[-1].content == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% endfor %}{% endfor %}{% endif -%}" + CHATML)


@pytest.fixture(scope="module")
def engine():
    return hybrid_npu.load_engine(hybrid_npu.default_model())


def test_ctrl_c_stops_a_render_in_the_repl_and_keeps_the_conversation(engine):
    """A real SIGINT (signal.raise_signal works on Windows too) while the template spins: the turn
    is refused in one line, the messages are as they were, and the next turn works."""
    from hybrid_npu.runtime.chat.repl import Repl
    from hybrid_npu.runtime.chat.conversation import Conversation, Sampling

    conv = Conversation(engine, template=ChatTemplate(SPIN, limits=TemplateLimits(seconds=60, work=10**12)))
    repl = Repl(conv, Sampling(max_new_tokens=4, speculative=False), out=io.StringIO())
    repl.handle("hello")
    before = [dict(m) for m in conv.messages]
    assert len(before) == 2
    timer = threading.Timer(0.5, signal.raise_signal, (signal.SIGINT,))
    with PeakRSS() as rss:
        timer.start()
        with pytest.raises(UserError) as e:
            repl.handle("spin")
    assert "stopped while rendering" in one_line(str(e.value))
    assert rss.seconds < SECONDS and conv.messages == before
    repl.handle("and now?")
    assert [m["content"] for m in conv.messages[::2]] == ["hello", "and now?"]


def test_the_repl_refuses_a_stdin_line_that_is_not_utf8():
    """Bytes that are not UTF-8 are the user's input: one line, not 'report this'; the next line
    is answered and the session ends normally."""
    proc = subprocess.run([sys.executable, "-m", "hybrid_npu.runtime.chat.cli", "--max-new-tokens", "2"],
                          input=b"\xff\xfe hello\nhi\n/exit\n", capture_output=True, timeout=300, check=False)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0, err
    assert "not UTF-8 text (byte 0xff at column 1)" in one_line(err) and "report this" not in err
    assert proc.stdout.decode().count("decode 2 tok") + proc.stdout.decode().count("decode 1 tok") == 1


def test_tojson_of_a_deep_structure_is_one_line():
    """A tool schema nested far deeper than a request may carry reaches the template only through
    the API (which refuses it); here the template itself meets it: one line."""
    deep = current = {}
    for _ in range(5000):
        current["x"] = {}
        current = current["x"]
    with pytest.raises(UserError) as e:
        ChatTemplate("{{ tools|tojson }}").render(MESSAGES, tools=[deep])
    assert "RecursionError" in one_line(str(e.value))
    assert json.dumps({"ok": 1})  # the process is fine
