"""npu-chat: the REPL driven in a pseudo-terminal (streaming, status line, Ctrl-C, history, /save
/reset /load, /exit), the one-shot --json mode against Engine.generate, the chat template renderer
against transformers', incremental multi-turn prefill against a fresh render, and bad input."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import CHUNK, assert_speculation_accounts_for

import drafter_fixtures
import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.export.exporter import export
from hybrid_npu.runtime.chat.cli import main
from hybrid_npu.runtime.chat.template import ChatTemplate
from hybrid_npu.runtime.turn_checkpoints import common_prefix
from hybrid_npu.runtime.chat.conversation import Conversation, Sampling, sidecar

PROMPT = "you>"  # prompt_toolkit draws "you>" and moves the cursor over the space
STATUS = r"\[prefill \d+ tok[^\]]*decode \d+ tok[^\]]*context \d+/\d+ \| RSS \d+ MiB\]"


@pytest.fixture(scope="module")
def chat_model(text_tied, tmp_path_factory):
    """The tiny tied export (ChatML template with enable_thinking) with a random EAGLE-3 drafter."""
    root = tmp_path_factory.mktemp("chat_model")
    weights = drafter_fixtures.drafter_weights(seed=1, hidden_size=48, embed=False)
    src = drafter_fixtures.write_eagle3(root / "eagle3", weights, hidden_size=48)
    export(text_tied.src, root / "export", chunk=CHUNK, drafter=src)
    return root / "export"


@pytest.fixture(scope="module")
def engines(chat_model):
    """Two engines of the chat model, loaded once: one that chats, one that recomputes from scratch."""
    return hybrid_npu.load_engine(chat_model), hybrid_npu.load_engine(chat_model)


@pytest.fixture()
def engine(engines):
    engines[0].reset()
    return engines[0]


# ---------------------------------------------------------------- the REPL in a pseudo-terminal
def spawn(model, *args):
    pexpect = pytest.importorskip("pexpect")
    if sys.platform == "win32":
        pytest.skip("pseudo-terminals are POSIX-only")
    # no cursor-position queries to answer; no COLUMNS/LINES (pytest-xdist's workers set 80x24), so the
    # pseudo-terminal's own size is the one the REPL wraps its lines to
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn(sys.executable, ["-m", "hybrid_npu.runtime.chat.cli", str(model), *map(str, args)],
                          env=env, encoding="utf-8", codec_errors="replace", timeout=120, dimensions=(50, 250))
    child.expect_exact(PROMPT)
    return child


def ask(child, line, expect=STATUS):
    child.sendline(line)
    child.expect(expect)
    found = child.after
    child.expect_exact(PROMPT)
    return found


def streamed_for(child, seconds):
    """What the child printed during `seconds`."""
    import pexpect

    child.expect(pexpect.TIMEOUT, timeout=seconds)
    return child.before


def leave(child, how):
    import pexpect

    child.sendline("/exit") if how == "exit" else child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before


def saved_messages(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:  # one file: the messages ride in the snapshot's metadata
        return json.loads(f.metadata()["chat"])["messages"]


def test_repl_streams_stops_on_ctrl_c_and_keeps_the_conversation(chat_model, tmp_path):
    child = spawn(chat_model, "--max-new-tokens", 100000, "--ignore-eos")  # replies end only by Ctrl-C
    child.sendline("Write a long story")
    first, later = streamed_for(child, 2.0), streamed_for(child, 1.0)
    assert "[prefill" not in first + later and later.strip(), "the reply must appear while it is generated"
    child.sendintr()
    child.expect(r"\[stopped\] " + STATUS)
    assert "accept " in child.after  # the drafter speculates by default
    child.expect_exact(PROMPT)

    child.sendline("And then?")  # the conversation goes on after a stopped reply
    # its prefill re-reads the first reply (re-rendered, it departs from the context): Ctrl-C only
    # once the reply shows, after prompt_toolkit hands the terminal back (bracketed paste off)
    child.expect_exact("\x1b[?2004l")
    child.expect(r"[^\x1b\s]", timeout=120)
    child.sendintr()
    child.expect(r"\[stopped\] " + STATUS)
    child.expect_exact(PROMPT)

    child.send("half a line")  # Ctrl-C at the prompt clears the line, sends nothing
    time.sleep(0.3)
    child.sendintr()
    child.expect_exact(PROMPT)
    ask(child, "/stats", r"context_tokens: \d+")
    child.send("\x1b[A")  # Up recalls /stats from the in-memory history
    time.sleep(0.3)
    child.send("\r")
    child.expect(r"context_tokens: \d+")
    child.expect_exact(PROMPT)

    ask(child, f"/save {tmp_path / 'chat.state'}", "saved ")
    leave(child, "eof")
    messages = saved_messages(tmp_path / "chat.state")
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == "Write a long story" and messages[2]["content"] == "And then?"
    assert all(m["content"] for m in messages)  # the stopped replies are kept


def test_repl_save_reset_load_continues_exactly(chat_model, tmp_path):
    f = {k: tmp_path / f"{k}.state" for k in ("history", "straight", "reloaded", "fresh")}
    child = spawn(chat_model, "--max-new-tokens", 8, "--no-speculative")  # speculation: the Ctrl-C test
    ask(child, "Hello there")
    ask(child, f"/save {f['history']}", "saved ")
    ask(child, "Tell me more")  # the reply without interruption
    ask(child, f"/save {f['straight']}", "saved ")
    ask(child, "/reset", "conversation reset")
    ask(child, f"/load {f['history']}", "loaded ")
    ask(child, "Tell me more")
    ask(child, f"/save {f['reloaded']}", "saved ")
    ask(child, f"/load {tmp_path / 'missing.state'}", "cannot load chat")  # one line, the REPL goes on
    (tmp_path / "junk.state").write_bytes(b"not a snapshot")
    (tmp_path / "junk.state.json").write_text("{")
    ask(child, f"/load {tmp_path / 'junk.state'}", "cannot load chat")
    ask(child, "/stats", r"context_tokens: \d+")
    leave(child, "exit")

    fresh = spawn(chat_model, "--max-new-tokens", 8, "--no-speculative")  # another process resumes the saved history
    ask(fresh, f"/load {f['history']}", "loaded ")
    ask(fresh, "Tell me more")
    ask(fresh, f"/save {f['fresh']}", "saved ")
    leave(fresh, "eof")

    straight = saved_messages(f["straight"])
    assert len(straight) == 4 and straight[:2] == saved_messages(f["history"])
    assert saved_messages(f["reloaded"]) == straight
    assert saved_messages(f["fresh"]) == straight


# ---------------------------------------------------------------- one-shot
def test_one_shot_json_matches_engine_generate(chat_model, engine, capsys):
    assert main([str(chat_model), "--prompt", "Hello there", "--max-new-tokens", "10", "--json",
                 "--system", "Be brief."]) == 0
    out = json.loads(capsys.readouterr().out)  # exactly one JSON object, nothing else
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    text = ChatTemplate.from_export(chat_model).render(messages, add_generation_prompt=True)
    ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
    assert text.count("<|im_start|>assistant\n") == 1 and "Be brief." in text
    assert out["token_ids"] == engine.generate(ids, 10, speculative=False)
    assert out["text"] == engine.tokenizer.decode(out["token_ids"])
    assert out["stats"]["prefill_tokens"] == len(ids)
    assert_speculation_accounts_for(out["stats"], len(out["token_ids"]))


@pytest.mark.npu
def test_one_shot_with_the_x_elite_profile_verifies_where_its_verify_table_says(chat_model, tmp_path, monkeypatch,
                                                                               capsys):
    """npu-chat --profile snapdragon-x-elite on the HTP emulator: as shipped (the CPU seed) its rounds
    verify on the CPU; once the user's copy holds a [verify] table naming the NPU (what npu-bench
    calibrate writes where the NPU's tree verify is faster), they verify on the NPU."""
    pytest.importorskip("onnxruntime_qnn")
    from hybrid_npu.format import MANIFEST
    from hybrid_npu.profiles.loader import load_profile, write_user_profile

    monkeypatch.setenv("HYBRID_NPU_PROFILE_DIR", str(tmp_path))
    shipped = load_profile("snapdragon-x-elite")
    sizes = json.loads((chat_model / MANIFEST).read_text())["graphs"]["cpu_verify"]["sizes"]
    args = [str(chat_model), "--profile", "snapdragon-x-elite", "--prompt", "Hello there", "--max-new-tokens", "24",
            "--ignore-eos", "--json"]
    for table, device in (((), "CPU"), (tuple((m, "npu", 2000, 1000) for m in sizes), "QNN/HTP")):
        write_user_profile(shipped, graph_finalization=1, verify_by_size=table)  # mode 1: compiles faster
        assert main(args) == 0
        stats = json.loads(capsys.readouterr().out)["stats"]
        assert stats["verify_device"] == device and stats["rounds"] > 0, stats


def test_one_shot_streams_text(chat_model, engine, capsys):
    assert main([str(chat_model), "--prompt", "Hi", "--max-new-tokens", "6", "--no-speculative",
                 "--no-think"]) == 0
    conv = Conversation(engine, enable_thinking=False)
    expected = engine.tokenizer.decode(engine.generate(conv.prompt_ids([{"role": "user", "content": "Hi"}]), 6))
    assert capsys.readouterr().out == expected + "\n"


# ---------------------------------------------------------------- template and multi-turn prefill
def test_template_renders_like_transformers(tmp_path):
    from transformers.utils.chat_template_utils import render_jinja_template

    source = ("{% for m in messages %}\n  {% if m.role == 'system' %}\n[S] {{ m.content | tojson }}\n"
              "  {% elif m.role == 'bad' %}{{ raise_exception('no bad roles') }}\n"
              "  {% else %}\n<{{ m.role }}>{{ m.content }}{{ eos_token }}\n  {% endif %}\n"
              "  {% if loop.index > 8 %}{% break %}{% endif %}\n{% endfor %}\n"
              "{% if add_generation_prompt %}<assistant>{% if enable_thinking is false %}<nothink>{% endif %}{% endif %}")
    template = ChatTemplate(source, {"eos_token": "</s>"})
    messages = [{"role": "system", "content": "Say \"hi\" — ünïcode"}, {"role": "user", "content": "a\nb"},
                {"role": "assistant", "content": "c"}]
    for thinking in (None, False, True):
        kw = {} if thinking is None else {"enable_thinking": thinking}
        ours = template.render(messages, add_generation_prompt=True, enable_thinking=thinking)
        hf = render_jinja_template([messages], chat_template=source, add_generation_prompt=True, eos_token="</s>",
                                   **kw)[0][0]
        assert ours == hf
    assert template.has_thinking_switch
    with pytest.raises(UserError, match="no bad roles"):
        template.render([{"role": "bad", "content": ""}])
    with pytest.raises(UserError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_incremental_turn_equals_fresh_render(engine, engines, tmp_path):
    fresh = engines[1]
    # thinking on: this tiny template then renders a past reply exactly as it was generated (with
    # thinking off it drops the empty think block, and the reply is re-read: tests/test_release_chat.py)
    conv = Conversation(engine, system="You are terse.", enable_thinking=True)
    plain = Sampling(max_new_tokens=6, speculative=False)
    first = conv.reply("Hello there", plain)
    assert first.reused_tokens == 0 and len(first.token_ids) == 6

    engine.save_state(tmp_path / "turn1.state")  # a checkpoint, to look at the logits and come back
    full = conv.prompt_ids(conv.messages + [{"role": "user", "content": "Go on"}])
    rest = full[common_prefix(engine.context_ids(), full):]
    assert len(rest) < len(full) // 2, "the second turn must reuse the first one's context"
    incremental = engine.prefill(rest)
    np.testing.assert_allclose(incremental, fresh.prefill_logits(full), rtol=1e-4, atol=1e-4)
    engine.load_state(tmp_path / "turn1.state")

    second = conv.reply("Go on", Sampling(max_new_tokens=12))  # speculative: the same greedy tokens
    assert second.reused_tokens == len(full) - len(rest)
    assert second.stats["prefill_tokens"] == len(rest)
    assert second.token_ids == fresh.generate(full, 12, speculative=False)

    conv.set_system("You are verbose.")  # an edited system prompt: no longer a prefix, start over
    third = conv.reply("Again", plain)
    assert third.reused_tokens == 0
    assert third.token_ids == fresh.generate(conv.prompt_ids(conv.messages[:-1]), 6, speculative=False)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_should_stop_keeps_a_state_that_continues_exactly(engine, speculative):
    prompt = engine.tokenizer.encode("<|im_start|>user\nTell a story<|im_end|>\n<|im_start|>assistant\n").ids
    whole = engine.generate(prompt, 24, stop_at_eos=False, speculative=False)
    calls = []
    part = engine.generate(prompt, 24, stop_at_eos=False, speculative=speculative,
                           should_stop=lambda: calls.append(1) or len(calls) > 3)
    assert 1 <= len(part) < 24 and part == whole[: len(part)]
    assert engine.context_ids() == prompt + part
    rest = engine.generate([], 24 - len(part), stop_at_eos=False, append=True, speculative=speculative)
    assert part + rest == whole


def test_load_refuses_altered_or_mismatched_chats_and_keeps_the_chat(engine, tmp_path):
    import hashlib

    from safetensors.numpy import load_file, save_file

    conv = Conversation(engine)
    conv.reply("Hello", Sampling(max_new_tokens=3, speculative=False))
    conv.save(tmp_path / "a.state")
    engine.save_state(tmp_path / "legacy.state")  # an earlier version's pair: engine snapshot + FILE.json
    legacy = {"format": "hybrid-npu-chat/1", "messages": conv.messages,
              "state_sha256": hashlib.sha256((tmp_path / "legacy.state").read_bytes()).hexdigest()}
    sidecar(tmp_path / "legacy.state").write_text(json.dumps(legacy), encoding="utf-8")
    conv.reply("More", Sampling(max_new_tokens=3, speculative=False))
    conv.save(tmp_path / "b.state")

    from safetensors import safe_open
    with safe_open(str(tmp_path / "b.state"), framework="np") as f:
        meta = dict(f.metadata())
    meta["chat"] = meta["chat"].replace("More", "Less")  # someone edits the messages inside the file
    save_file(load_file(str(tmp_path / "b.state")), str(tmp_path / "edited.state"), metadata=meta)
    engine.save_state(tmp_path / "bare.state")  # no messages at all
    sidecar(tmp_path / "mismatched.state").write_text(json.dumps(legacy), encoding="utf-8")
    (tmp_path / "mismatched.state").write_bytes((tmp_path / "bare.state").read_bytes())
    before, context = list(conv.messages), engine.context_ids()
    for bad, why in [("edited.state", "checksum mismatch"), ("bare.state", "holds no messages"),
                     ("mismatched.state", "does not match"), ("none.state", "no such file")]:
        with pytest.raises(UserError, match=why):
            conv.load(tmp_path / bad)
        assert conv.messages == before and engine.context_ids() == context
    with pytest.raises(UserError, match="is a directory"):
        conv.load(tmp_path)

    conv.load(tmp_path / "legacy.state")  # an earlier version's pair still loads
    assert conv.messages == legacy["messages"]
    conv.load(tmp_path / "a.state")
    assert conv.messages == legacy["messages"]


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, needle", [
    (["{missing}"], "does not exist"),
    (["{empty}"], "not a hybrid-npu export"),
    (["{model}", "--profile", "no-such-profile"], "unknown profile"),
    (["{model}", "--frobnicate"], "unrecognized arguments"),
    (["{model}", "--prompt", "  "], "--prompt is empty"),
    (["{model}", "--memory", "lots"], "not a memory size"),
    (["{model}", "--prefill", "gpu"], "invalid choice"),
    (["{model}", "--json"], "--json needs --prompt"),
    (["{model}", "--max-new-tokens", "0"], "--max-new-tokens"),
], ids=["missing", "not-export", "profile", "flag", "empty-prompt", "memory", "prefill", "json", "max-new"])
def test_bad_input_is_one_line_exit_2(chat_model, tmp_path, capsys, args, needle):
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "model": chat_model}
    assert main([a.format(**paths) for a in args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_bad_input_from_the_command_line_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hybrid_npu.runtime.chat.cli", str(tmp_path / "nope"),
                           "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "does not exist" in proc.stderr
