"""Fault injection for the runtime (issue 17): a full disk and a too-long name under /save, concurrent
savers and a reader, bad sampling values in the CLIs and the API, a pipe closed early, a huge document,
generation past the memory plan, and the small things a new user met. Each test reproduced its fault
before the fix."""
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.runtime.chat.conversation import Conversation, Sampling

ROOT = Path(__file__).resolve().parents[1]
LONG_NAME = "n" * 300  # longer than any filesystem's 255-byte name limit


def _one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A small tmpfs mounted at `path` (root only): a disk that can really fill up."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("a full disk needs a tmpfs mount: Linux, run as root")
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> None:
    """Write until the filesystem says ENOSPC."""
    with open(directory / "filler", "wb", buffering=0) as f:  # unbuffered: ENOSPC comes from write()
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


# ---------------------------------------------------------------- /save: full disk, bad name (point 2)
def test_repl_save_on_a_full_disk_or_a_long_name_says_why_and_carries_on(text_tied, tmp_path):
    from test_chat_cli import STATUS, ask, leave, spawn

    with tmpfs(tmp_path / "small", "1m") as disk:
        child = spawn(text_tied.out, "--max-new-tokens", 4)
        ask(child, "Hello there")
        ask(child, f"/save {disk / 'chat.state'}", "saved ")
        fill(disk)
        ask(child, "Tell me more")
        line = ask(child, f"/save {disk / 'chat.state'}", r"npu-chat: [^\r\n]*")
        assert "cannot save state" in line and "No space left on device" in line and "free disk space" in line
        line = ask(child, f"/save {tmp_path / LONG_NAME}", r"npu-chat: [^\r\n]*")
        assert "File name too long" in line and "shorter file name" in line
        ask(child, "And then?", STATUS)  # the REPL carries on with the whole conversation
        ask(child, f"/save {tmp_path / 'ok.state'}", "saved ")
        leave(child, "exit")
        assert "Traceback" not in child.before

        engine = hybrid_npu.load_engine(text_tied.out)
        earlier, later = Conversation(engine), Conversation(engine)
        earlier.load(disk / "chat.state")  # the snapshot saved before the disk filled is intact
        assert [m["content"] for m in earlier.messages if m["role"] == "user"] == ["Hello there"]
        later.load(tmp_path / "ok.state")
        assert [m["content"] for m in later.messages if m["role"] == "user"] == ["Hello there", "Tell me more",
                                                                                  "And then?"]
        assert sorted(p.name for p in disk.iterdir()) == ["chat.state", "filler"]  # no temporary file left


def test_failed_save_is_one_line_and_keeps_the_previous_file(text_tied, tmp_path):
    engine = hybrid_npu.load_engine(text_tied.out)
    conv = Conversation(engine)
    conv.reply("Hello", Sampling(max_new_tokens=3))
    with pytest.raises(UserError) as err:
        conv.save(tmp_path / LONG_NAME)
    assert "File name too long" in _one_line(str(err.value))
    with pytest.raises(UserError, match="is a directory"):
        conv.save(tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        conv.save(tmp_path / "no" / "chat.state")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- concurrent /save (point 3)
WRITER = r"""
import sys, time
from pathlib import Path
import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.runtime.chat.conversation import Conversation, Sampling
model, target, word, n, flags = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])
conv = Conversation(hybrid_npu.load_engine(model))
conv.reply(f"{word} {word} {word}", Sampling(max_new_tokens=2 + len(word) % 3, stop_at_eos=False))
(flags / f"ready.{word}").touch()
while not (flags / "go").exists():
    time.sleep(0.01)
failures = 0
for _ in range(n):
    try:
        conv.save(target)
    except UserError as e:
        failures += 1
        print(e, file=sys.stderr)
sys.exit(1 if failures else 0)
"""


def test_concurrent_saves_never_give_a_reader_a_mismatched_pair(text_tied, tmp_path):
    words, n = ("alpha", "bravo", "charlie"), 120
    target, flags = tmp_path / "shared.state", tmp_path / "flags"
    flags.mkdir()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(text_tied.out), str(target), w, str(n), str(flags)],
                                stderr=subprocess.PIPE, text=True) for w in words]
    engine = hybrid_npu.load_engine(text_tied.out)
    deadline = time.monotonic() + 120
    while not all((flags / f"ready.{w}").exists() for w in words):
        assert time.monotonic() < deadline and all(p.poll() is None for p in writers), "a writer did not start"
        time.sleep(0.05)
    (flags / "go").touch()
    accepted, mismatched, seen = 0, 0, set()
    while any(p.poll() is None for p in writers):
        conv = Conversation(engine)
        try:
            conv.load(target)
        except UserError as e:
            assert "no such file" in str(e), e  # only before the first save lands
            continue
        said = conv.messages[0]["content"].split()[0]
        in_state = {w for w in words if w in engine.tokenizer.decode(engine.context_ids())}
        accepted += 1
        mismatched += in_state != {said}
        seen.add(said)
    errors = [p.stderr.read() for p in writers]
    assert [p.returncode for p in writers] == [0, 0, 0], errors
    assert mismatched == 0, f"{mismatched} of {accepted} loads paired one save's messages with another's state"
    assert accepted > 0
    assert [p.name for p in tmp_path.iterdir() if p.name != "flags"] == ["shared.state"]  # no temporary files left


# ---------------------------------------------------------------- bad sampling values (point 8)
@pytest.mark.parametrize("cli", ["chat.cli", "summarize_cli"])
@pytest.mark.parametrize("flags, needle", [
    (["--seed", "-1"], "--seed -1"), (["--temperature", "nan"], "--temperature nan"),
    (["--temperature", "inf"], "--temperature inf"), (["--max-new-tokens", "0"], "--max-new-tokens 0"),
], ids=["seed", "nan", "inf", "max-new"])
def test_bad_sampling_flags_are_one_line_exit_2(text_tied, tmp_path, cli, flags, needle):
    doc = tmp_path / "doc.txt"
    doc.write_text("def f(x):\n    return x\n")
    target = [str(text_tied.out), "--prompt", "hi"] if cli == "chat.cli" else [str(doc), "--model", str(text_tied.out)]
    proc = subprocess.run([sys.executable, "-m", f"hybrid_npu.runtime.{cli}", *target, *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in _one_line(proc.stderr), proc.stderr


@pytest.mark.parametrize("kw, needle", [
    ({"temperature": -1}, "temperature=-1"), ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": 2}, "top_p=2"), ({"top_p": 0}, "top_p=0"), ({"top_k": -1}, "top_k=-1"),
    ({"max_new_tokens": 0}, "max_new_tokens=0"), ({"max_new_tokens": 2.5}, "max_new_tokens=2.5"),
    ({"seed": -1}, "seed=-1"),
])
def test_the_api_validates_as_the_clis_do(text_tied, kw, needle):
    engine = hybrid_npu.load_engine(text_tied.out)
    args = {"max_new_tokens": 4, **kw}
    with pytest.raises(UserError) as err:
        engine.generate([1, 2, 3], **args)
    assert needle in _one_line(str(err.value))
    assert engine.context_ids() == []  # refused before any work


# ---------------------------------------------------------------- a pipe closed early (point 9)
@pytest.mark.parametrize("cli", ["chat", "chat-json", "summarize"])
def test_closed_stdout_exits_quietly(text_tied, tmp_path, cli):
    doc = tmp_path / "doc.txt"
    doc.write_text("def f(x):\n    return x\n")
    chat = ["hybrid_npu.runtime.chat.cli", str(text_tied.out), "--prompt", "hi", "--ignore-eos"]
    args = {"chat": chat, "chat-json": [*chat, "--json"],
            "summarize": ["hybrid_npu.runtime.summarize_cli", str(doc), "--model", str(text_tied.out), "--quiet"]}[cli]
    proc = subprocess.Popen([sys.executable, "-m", *args, "--max-new-tokens", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first byte: `| head -c 0`
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1, err  # Python's own exit status on EPIPE
    assert err == "", err


# ---------------------------------------------------------------- the memory plan bounds decoding (point 11)
def _budget(plan, max_context: int) -> int:
    return (plan.weights_bytes + plan.state_bytes + plan.checkpoint_bytes
            + max_context * plan.kv_bytes_per_token)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_generation_stops_at_the_plans_limit(speculative):
    model = hybrid_npu.default_model()  # it has a drafter (verify trees of 16 nodes)
    reference = hybrid_npu.load_engine(model)
    prompt = reference.tokenizer.encode("def parse(text):\n").ids
    room = 40
    limit = len(prompt) + room
    engine = hybrid_npu.load_engine(model, memory=_budget(reference.memory, limit))
    assert engine.memory_report()["max_context"] == limit
    new = engine.generate(prompt, 5000, stop_at_eos=False, speculative=speculative)
    assert len(new) == room and len(engine.context_ids()) == limit  # stopped at the plan, not at 5000
    assert engine.last_stats["finish_reason"] == "length" and engine.last_stats["context_full"]
    if speculative:
        assert engine.last_stats["rounds"] > 0  # it speculated, then decoded the last tokens plainly
    assert new == reference.generate(prompt, room, stop_at_eos=False, speculative=False)  # what it did emit is right
    assert engine.state.position <= limit
    with pytest.raises(UserError, match=f"needs {limit + 2} tokens of context but the memory plan allows {limit}"):
        engine.generate([5], 4, append=True)  # the next turn is refused before any work, in one line
    assert len(engine.context_ids()) == limit


def test_a_prompt_that_fills_the_plan_leaves_no_room_and_is_refused(text_tied):
    plan = hybrid_npu.load_engine(text_tied.out).memory
    engine = hybrid_npu.load_engine(text_tied.out, memory=_budget(plan, 12))
    with pytest.raises(UserError, match="needs 13 tokens of context"):
        engine.generate(list(range(12)), 4)
    assert engine.generate(list(range(11)), 4, stop_at_eos=False) and len(engine.context_ids()) == 12


# ---------------------------------------------------------------- a huge document (point 10, 14: sniffing)
PEAK = r"""
import resource, sys
from hybrid_npu.runtime.summarize_cli import main
code = main(sys.argv[1:])
print(f"PEAK {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}", file=sys.stderr)
sys.exit(code)
"""


def summarize_peak(*args):
    """npu-summarize in a fresh process: (exit code, stderr without the PEAK line, peak RSS bytes)."""
    proc = subprocess.run([sys.executable, "-c", PEAK, *map(str, args)], capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    peak = int(lines[-1].split()[1])
    return proc.returncode, "\n".join(lines[:-1]), peak


def code_text(n_bytes: int) -> str:
    lines, size, i = [], 0, 0
    while size < n_bytes:
        line = f"def handler_{i}(request, value={i}):\n    return request.send(value + {i % 97})\n"
        lines.append(line)
        size, i = size + len(line), i + 1
    return "".join(lines)


@pytest.mark.skipif(sys.platform == "win32", reason="peak RSS through resource.getrusage (POSIX)")
def test_a_huge_document_is_refused_before_it_is_in_memory(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text(code_text(2000))
    code, err, baseline = summarize_peak(small, "--quiet", "--max-new-tokens", 8)
    assert code == 0, err

    sparse = tmp_path / "huge.txt"  # 4 GiB that take no disk: text, then a hole
    with open(sparse, "wb") as f:
        f.write(code_text(4096).encode())
        f.truncate(4 << 30)
    code, err, peak_sparse = summarize_peak(sparse)
    assert code == 2 and "at least" in _one_line(err) and "max_position_embeddings is 65536" in err, err
    assert "4.0 GiB" in err and "split it" in err

    notes = tmp_path / "NOTES"  # no suffix: text is recognised by its first bytes
    notes.write_text(code_text(5 << 20))  # 5 MB: under the size bound, over the 65536-token context
    code, err, peak_streamed = summarize_peak(notes)
    assert code == 2 and "at least" in _one_line(err) and "65536-token context" in err, err
    print(f"\npeak RSS: small document {baseline / 2**20:.0f} MiB, 4 GiB sparse file {peak_sparse / 2**20:.0f} MiB,"
          f" 5 MB text {peak_streamed / 2**20:.0f} MiB")
    assert peak_sparse < baseline + (32 << 20) and peak_streamed < baseline + (64 << 20)


def test_text_without_a_known_suffix_is_sniffed(tmp_path, capsys):
    from hybrid_npu.runtime.summarize_cli import main

    (tmp_path / "README").write_text("def f(x):\n    return x\n")
    (tmp_path / "blob").write_bytes(b"\x7fELF\x02\x01\x01\0\0\0")
    assert main([str(tmp_path / "README"), "--max-new-tokens", "4", "--json"]) == 0
    capsys.readouterr()
    assert main([str(tmp_path / "blob")]) == 2
    assert "not a text document (binary data at byte 0)" in _one_line(capsys.readouterr().err)


def test_blockwise_reading_equals_reading_whole(tmp_path, monkeypatch):
    import random

    from hybrid_npu.runtime import documents

    for block in (1, 2, 3, 7, 64):
        monkeypatch.setattr(documents, "BLOCK_BYTES", block)
        rng = random.Random(block)
        for trial in range(100):
            text = "".join(rng.choice(["a", " ", "\n", "\r\n", "é", "€", "  x", "\r"]) for _ in range(rng.randint(1, 60)))
            raw = (b"\xef\xbb\xbf" if trial % 3 == 0 else b"") + (text + "z").encode()
            (tmp_path / "d.txt").write_bytes(raw)
            blocks = []
            got = documents.read_document(tmp_path / "d.txt", take=blocks.append)
            assert got == "".join(blocks) == raw.decode("utf-8-sig").replace("\r\n", "\n")


# ---------------------------------------------------------------- the REPL's small things (point 14)
def test_repl_at_80_columns_names_the_model_wraps_between_words_and_forgets_on_reset(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    if sys.platform == "win32":
        pytest.skip("pseudo-terminals are POSIX-only")
    env = {**os.environ, "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}
    child = pexpect.spawn(sys.executable, ["-m", "hybrid_npu.runtime.chat.cli", "--max-new-tokens", "100000",
                                           "--ignore-eos", "--no-speculative"],  # the embedded model
                          env=env, encoding="utf-8", codec_errors="replace", timeout=120, dimensions=(50, 80))
    child.expect_exact("you>")
    banner = child.before
    assert "embedded default model" in banner and "site-packages" not in banner, banner
    assert all(len(line) < 80 for line in banner.splitlines()) and "Ctrl-D to leave" in banner

    child.sendline("Write a long story")
    child.expect(pexpect.TIMEOUT, timeout=1.5)
    child.sendintr()
    child.expect(r"\[stopped\] \[prefill")
    child.expect_exact("you>")
    status = "[stopped] [prefill" + child.before
    assert "^C" not in child.before and "^C" not in status, status  # the terminal did not echo Ctrl-C into the reply
    lines = [line for line in status.splitlines() if line.strip()]
    assert all(len(line) < 80 for line in lines) and len(lines) >= 2, lines  # wrapped, between parts only
    assert all(part in status for part in ("decode ", " tok/s ", "context ", "RSS "))

    child.sendline("/reset")
    child.expect_exact("conversation reset")
    child.expect_exact("you>")
    child.sendline("/stats")
    child.expect(r"max_context: \d+")
    child.expect_exact("you>")
    assert "prefill_tokens" not in child.before  # the forgotten reply's numbers are gone
    child.sendline(f"/load {tmp_path}")
    child.expect(r"npu-chat: [^\r\n]*")
    assert "is a directory" in child.after and "no such file" not in child.after
    child.expect_exact("you>")
    child.sendline("/exit")
    child.expect(pexpect.EOF)


OPEN_NPU_SESSION = r"""
import sys
import onnx
from onnx import TensorProto, helper
from hybrid_npu.profiles.loader import load_profile
from hybrid_npu.runtime import qnn
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g", [x], [y])
onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), sys.argv[1])
try:
    options = qnn.qnn_session_options(load_profile("snapdragon-x-elite").qnn_provider_options())
except qnn.NpuUnavailable as e:
    print("SKIP", e)
    sys.exit(0)
if sys.argv[2] == "plain":
    qnn.ort.InferenceSession(sys.argv[1], options)
else:
    qnn.qnn_session(sys.argv[1], options)
print("opened")
"""


def test_opening_an_npu_session_keeps_stdout_clean(tmp_path):
    def stdout_of(how):
        proc = subprocess.run([sys.executable, "-c", OPEN_NPU_SESSION, str(tmp_path / "add.onnx"), how],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        if proc.stdout.startswith("SKIP"):
            pytest.skip(proc.stdout)
        return proc.stdout

    noisy = stdout_of("plain")
    if "LIBNATIVE" not in noisy:
        pytest.skip("this QNN build prints no native banner")
    assert stdout_of("quiet") == "opened\n"  # the emulator's banner no longer lands in a reply or --json


def test_tiny_memory_budget_is_shown_in_binary_units(text_tied, capsys):
    from hybrid_npu.runtime.chat.cli import main

    assert main([str(text_tied.out), "--memory", "1K", "--prompt", "hi"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "budget 1.0 KiB" in err and "0.0 GiB" not in err, err


# ---------------------------------------------------------------- the README's Python example (point 13)
def test_readme_python_example_runs_and_its_next_turn_continues_the_reply(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = readme.split("```python\n")[1:]
    example = next(b.split("```")[0] for b in blocks if "hybrid_npu.stream" in b)
    monkeypatch.chdir(tmp_path)  # it writes chat.state
    namespace: dict = {}
    exec(example.replace('"./qwen35-0.8b"', repr(str(hybrid_npu.default_model()))), namespace)
    model, ctx, ids, more = (namespace[k] for k in ("model", "ctx", "ids", "more"))
    new_ids = namespace["r"].ids
    turn = model.tokenizer.encode(" and then").ids
    # the next turn continues "Hello" + the reply, not "Hello" alone
    assert ctx.context_ids() == ids + new_ids + turn + more
    fresh = hybrid_npu.load_engine(hybrid_npu.default_model())
    assert fresh.generate(ids + new_ids + turn, 32) == more  # greedy: the same as one fresh pass over it all
