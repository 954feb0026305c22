"""Chat with the real Qwen3.5 stack (released vocabulary, tokenizer_config.json and chat template),
held against transformers: the stop set, template precedence, rendering with tools, the sampling
defaults, and multi-turn conversations that prefill only what departs from the context (turn
checkpoints), also across /save + /load in a fresh process."""
import contextlib
import copy
import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import hybrid_npu
from hybrid_npu.export.exporter import export
from hybrid_npu.runtime.chat.cli import main as chat_main
from hybrid_npu.runtime.turn_checkpoints import common_prefix
from hybrid_npu.runtime.chat.conversation import Conversation, Sampling
from hybrid_npu.runtime.chat.tool_calls import parse_tool_calls

from conftest import CHUNK, Release, hf_tokenizer
from qwen35_release import (ENDOFTEXT_ID, IM_END_ID, INTEGRATION_IDS, INTEGRATION_TEXT, RELEASE,
                            write_real_vocab_checkpoint)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "units": {"type": "object"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="session")
def sampling_release(release, tmp_path_factory):
    """The same model with the larger releases' generation_config.json (temperature 0.6, ...)."""
    root = tmp_path_factory.mktemp("qwen35_sampling")
    write_real_vocab_checkpoint(root / "hf", release.cache, seed=11, generation_config=True)
    export(root / "hf", root / "export", chunk=CHUNK)
    return Release(root / "hf", root / "export", release.ref, release.cache)


def hf_prompt(tok, messages, **kw) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return tok.encode(text, add_special_tokens=False)


def hf_greedy(model, ids, n) -> list[int]:
    """transformers' own greedy continuation (no stop token: compared over the same length)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=ENDOFTEXT_ID)
    return out[0, len(ids):].tolist()


# ---------------------------------------------------------------- tokenizer and stop set
def test_the_export_tokenizes_as_the_released_qwen35(release):
    engine = hybrid_npu.load_engine(release.out)
    assert engine.tokenizer.encode(INTEGRATION_TEXT, add_special_tokens=False).ids == INTEGRATION_IDS
    assert engine.tokenizer.decode(INTEGRATION_IDS) == INTEGRATION_TEXT
    assert release.hf_tokenizer().encode(INTEGRATION_TEXT, add_special_tokens=False) == INTEGRATION_IDS


def test_stop_set_is_every_files_eos(release, tmp_path):
    """No generation_config.json: <|im_end|> comes from tokenizer_config.json, <|endoftext|> from
    config.json. A generation_config.json that names only <|endoftext|> (transformers' default) adds
    nothing and loses nothing."""
    tok = release.hf_tokenizer()
    want = {tok.eos_token_id, release.ref.config.eos_token_id}
    assert want == {IM_END_ID, ENDOFTEXT_ID}
    manifest = json.loads((release.out / "model.json").read_text())
    assert set(manifest["config"]["eos_token_ids"]) == want == set(manifest["tokenizer"]["stop_token_ids"])
    assert manifest["tokenizer"]["stop_token_sources"] == {"config.json": [ENDOFTEXT_ID],
                                                           "tokenizer_config.json": [IM_END_ID]}
    assert set(hybrid_npu.load_engine(release.out).config.eos_token_ids) == want

    from transformers import GenerationConfig

    src = tmp_path / "hf"
    write_real_vocab_checkpoint(src, release.cache, seed=11)
    GenerationConfig(eos_token_id=ENDOFTEXT_ID).save_pretrained(src)
    export(src, tmp_path / "out", chunk=CHUNK)
    assert set(json.loads((tmp_path / "out" / "model.json").read_text())["config"]["eos_token_ids"]) == want


# ---------------------------------------------------------------- the template
def test_chat_template_jinja_wins_as_in_transformers(release, tmp_path):
    src = tmp_path / "hf"
    write_real_vocab_checkpoint(src, release.cache, seed=11, template="large", template_file="tokenizer_config.json")
    (src / "chat_template.jinja").write_text((RELEASE / "qwen35_small.jinja").read_text(encoding="utf-8"))
    export(src, tmp_path / "out", chunk=CHUNK)
    manifest = json.loads((tmp_path / "out" / "model.json").read_text())
    assert manifest["tokenizer"]["chat_template_file"] == "chat_template.jinja"
    tok = hf_tokenizer(src)
    messages = [{"role": "user", "content": "Hi"}]
    ours = render_only(tmp_path / "out", "--prompt", "Hi")
    assert ours == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<think>\n\n</think>\n\n")  # the small template: no thinking unless asked


def render_only(model, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert chat_main([str(model), "--render-only", *args]) == 0
    return out.getvalue()


@pytest.mark.parametrize("think", [None, True, False], ids=["default", "think", "no-think"])
@pytest.mark.parametrize("system", [None, "", "You are terse. 你好 🚀"], ids=["no-system", "empty-system", "system"])
def test_render_only_equals_apply_chat_template(release, tmp_path, think, system):
    tools_file = tmp_path / "tools.json"
    tools_file.write_text(json.dumps(TOOLS))
    args = ["--prompt", "Weather in Paris?", "--tools", str(tools_file)]
    args += [] if system is None else ["--system", system]
    args += [] if think is None else ["--think" if think else "--no-think"]
    messages = ([] if system is None else [{"role": "system", "content": system}]) + \
        [{"role": "user", "content": "Weather in Paris?"}]
    kw = {} if think is None else {"enable_thinking": think}
    want = release.hf_tokenizer().apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                      add_generation_prompt=True, **kw)
    assert render_only(release.out, *args) == want
    if system == "":
        no_tools = render_only(release.out, "--prompt", "x", "--system", "")
        assert no_tools.startswith("<|im_start|>system\n<|im_end|>\n")


def test_tool_calls_round_trip_through_the_template(release):
    """What the template writes for an assistant's tool calls parses back to those calls."""
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "units": {"temp": "C"}}},
             {"name": "get_weather", "arguments": {"city": "12"}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [{"type": "function", "function": c}
                                                                               for c in calls]}]
    text = release.hf_tokenizer().apply_chat_template(messages, tools=TOOLS, tokenize=False)
    reply = text.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]
    assert parse_tool_calls(reply, TOOLS) == ("Let me look.", calls)


def test_tool_result_turn_renders_as_transformers(release):
    engine = hybrid_npu.load_engine(release.out)
    conv = Conversation(engine, tools=TOOLS)
    conv.reply("Weather in Paris?", Sampling(max_new_tokens=4, speculative=False))
    conv.reply('{"temp": 21}', Sampling(max_new_tokens=4, speculative=False), role="tool")
    prompt_messages = conv.messages[:-1]
    want = release.hf_tokenizer().apply_chat_template(prompt_messages, tools=TOOLS, tokenize=False,
                                                      add_generation_prompt=True)
    assert conv.render(prompt_messages) == want
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in want


# ---------------------------------------------------------------- multi-turn: turn checkpoints
TURNS = ["Hello, who are you?", "Tell me more about that.", "And then?", "Thanks, one more thing."]


@pytest.mark.parametrize("think", [None, True], ids=["default", "think"])
def test_each_turn_prefills_only_what_departs_from_the_context(release, think):
    """Four turns with the release template (which drops earlier replies' <think> blocks): each turn
    after the first prefills exactly the tokens from where transformers' render of it parts from
    the context, and its greedy reply equals transformers' greedy continuation of that render."""
    engine = hybrid_npu.load_engine(release.out)
    tok = release.hf_tokenizer()
    conv = Conversation(engine, enable_thinking=think)
    kw = {} if think is None else {"enable_thinking": think}
    context, prefilled = [], []
    for n, user in enumerate(TURNS):
        full = hf_prompt(tok, conv.messages + [{"role": "user", "content": user}], **kw)
        reply = conv.reply(user, Sampling(max_new_tokens=6, speculative=False, stop_at_eos=False))
        assert reply.token_ids == hf_greedy(release.ref, full, 6)
        departs = common_prefix(context, full)
        assert reply.stats["prefill_tokens"] == len(full) - departs, f"turn {n + 1}"
        assert reply.reused_tokens == departs
        prefilled.append(reply.stats["prefill_tokens"])
        context = full + reply.token_ids
    assert max(prefilled[1:]) < len(full) // 2, prefilled  # not the whole conversation again


def test_restored_checkpoint_logits_equal_a_fresh_prefill(release):
    engine, fresh = hybrid_npu.load_engine(release.out), hybrid_npu.load_engine(release.out)
    tok = release.hf_tokenizer()
    conv = Conversation(engine)
    conv.reply(TURNS[0], Sampling(max_new_tokens=5, speculative=False, stop_at_eos=False))
    full = hf_prompt(tok, conv.messages + [{"role": "user", "content": TURNS[1]}])
    kept = engine.resume(full)
    assert 0 < kept < len(full) // 2
    resumed = engine.prefill(full[kept:])
    np.testing.assert_allclose(resumed, fresh.prefill_logits(full), rtol=1e-4, atol=1e-4)
    # against transformers in float64, held to 1e-4 or to transformers' own fp32 error if that is
    # larger: its fp32 run differs from float64 by about as much as ours does (1.5e-4 and 1.3e-4
    # here: ORT's LinearAttention and RMSNormalization accumulate in another order), so fp32 vs
    # fp32 would compare two roundings
    with torch.no_grad():
        want = copy.deepcopy(release.ref).double()(torch.tensor([full])).logits[0, -1].numpy()
        hf32 = release.ref(torch.tensor([full])).logits[0, -1].numpy()
    assert np.abs(resumed - want).max() <= max(1e-4, np.abs(hf32 - want).max())


def test_save_and_load_keep_the_checkpoints_in_a_fresh_process(release, tmp_path):
    engine = hybrid_npu.load_engine(release.out)
    tok = release.hf_tokenizer()
    conv = Conversation(engine)
    sampling = Sampling(max_new_tokens=6, speculative=False, stop_at_eos=False)
    for user in TURNS[:2]:
        reply = conv.reply(user, sampling)
    context = engine.context_ids()
    conv.save(tmp_path / "chat.state")
    full = hf_prompt(tok, conv.messages + [{"role": "user", "content": TURNS[2]}])
    script = textwrap.dedent(f"""
        import json, hybrid_npu
        from hybrid_npu.runtime.chat.conversation import Conversation, Sampling
        conv = Conversation(hybrid_npu.load_engine({str(release.out)!r}))
        conv.load({str(tmp_path / "chat.state")!r})
        r = conv.reply({TURNS[2]!r}, Sampling(max_new_tokens=6, speculative=False, stop_at_eos=False))
        print(json.dumps({{"ids": r.token_ids, "prefill": r.stats["prefill_tokens"], "kept": r.reused_tokens}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ids"] == hf_greedy(release.ref, full, 6)
    departs = common_prefix(context, full)
    assert out["kept"] == departs > 0 and out["prefill"] == len(full) - departs
    assert reply.token_ids  # the second turn ran


def test_speculative_turns_resume_from_checkpoints_losslessly():
    """The embedded model and its EAGLE-3 drafter: a turn that restores a checkpoint rewinds the
    drafter too, and the speculative reply equals plain greedy decoding of the same prompt."""
    engine, plain = hybrid_npu.load_engine(hybrid_npu.default_model()), hybrid_npu.load_engine(hybrid_npu.default_model())
    assert engine.drafter is not None
    conv = Conversation(engine)
    for user in ("def add(a, b):", "Now a function that multiplies."):
        before = list(conv.messages)
        reply = conv.reply(user, Sampling(max_new_tokens=24, speculative=True))
        full = conv.prompt_ids(before + [{"role": "user", "content": user}])
        assert reply.token_ids == plain.generate(full, 24, speculative=False)
    assert reply.reused_tokens > 0


# ---------------------------------------------------------------- sampling defaults
def test_generation_config_gives_the_sampling_defaults(release, sampling_release, capsys):
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(sampling_release.src)
    engine = hybrid_npu.load_engine(sampling_release.out)
    assert engine.sampling_defaults == {"temperature": gen.temperature, "top_k": gen.top_k, "top_p": gen.top_p}
    prompt = hf_prompt(release.hf_tokenizer(), [{"role": "user", "content": "Hi"}])
    by_default = engine.generate(prompt, 8, seed=3, stop_at_eos=False, speculative=False)
    explicit = engine.generate(prompt, 8, seed=3, temperature=0.6, top_k=20, top_p=0.95, stop_at_eos=False,
                               speculative=False)
    assert by_default == explicit
    assert engine.generate(prompt, 8, temperature=0, stop_at_eos=False, speculative=False) == \
        hf_greedy(release.ref, prompt, 8)
    assert chat_main([str(sampling_release.out), "--prompt", "Hi", "--json", "--max-new-tokens", "3",
                      "--no-speculative", "--temperature", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == hf_greedy(release.ref, prompt, 3)
    assert "temperature" in build_help()


def build_help() -> str:
    from hybrid_npu.runtime.chat.cli import build_parser
    return build_parser().format_help()


# ---------------------------------------------------------------- small things
def test_exports_and_snapshots_get_the_users_permissions(release, tmp_path):
    mask = os.umask(0o022)
    try:
        conv = Conversation(hybrid_npu.load_engine(release.out))
        conv.reply("Hi", Sampling(max_new_tokens=2, speculative=False))
        conv.save(tmp_path / "chat.state")
        assert (tmp_path / "chat.state").stat().st_mode & 0o777 == 0o644
        assert release.out.stat().st_mode & 0o777 == 0o755
    finally:
        os.umask(mask)


def test_one_token_reply_reports_no_rate(release):
    from hybrid_npu.runtime.chat.repl import status_line

    conv = Conversation(hybrid_npu.load_engine(release.out))
    line = status_line(conv.reply("Hi", Sampling(max_new_tokens=1, speculative=False)), conv)
    assert "decode 1 tok n/a tok/s" in line


@pytest.mark.parametrize("content, problem", [
    ('{"name": "f"}', "expected a non-empty JSON list"),
    ('[{"type": "function", "function": {"description": "no name"}}]', "needs a \"name\""),
    ("[1, 2]", "is not a function spec"),
    ("not json", "not valid JSON"),
])
def test_bad_tools_file_is_one_line(release, tmp_path, capsys, content, problem):
    f = tmp_path / "tools.json"
    f.write_text(content)
    assert chat_main([str(release.out), "--tools", str(f), "--prompt", "x", "--render-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert problem in err and len(err.splitlines()) == 1


def test_render_only_needs_a_prompt_and_a_refusing_template_is_one_line(release, tmp_path, capsys):
    assert chat_main([str(release.out), "--render-only"]) == 2
    assert "--render-only needs --prompt" in capsys.readouterr().err
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(release.out, broken)
    manifest = json.loads((broken / "model.json").read_text())
    manifest["tokenizer"]["chat_template"] = "{{ raise_exception('no tools here') }}"
    (broken / "model.json").write_text(json.dumps(manifest))
    assert chat_main([str(broken), "--render-only", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no tools here" in err and len(err.splitlines()) == 1


def test_repl_shows_tool_calls_and_sends_tool_results(release, monkeypatch):
    from hybrid_npu.runtime.chat.repl import Repl
    from hybrid_npu.runtime.chat.conversation import Reply

    conv = Conversation(hybrid_npu.load_engine(release.out), tools=TOOLS)
    out = io.StringIO()
    repl = Repl(conv, Sampling(max_new_tokens=3, speculative=False), out=out)
    repl.handle("Weather in Paris?")
    repl.handle('/tool {"temp": 21}')
    assert conv.messages[2] == {"role": "tool", "content": '{"temp": 21}'} and conv.messages[3]["role"] == "assistant"
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    monkeypatch.setattr(conv, "reply", lambda *a, **k: Reply("", [1], False, 0, conv.engine.last_stats, [call]))
    repl.handle("again")
    assert '[tool call] get_weather({"city": "Paris"}) - answer with /tool RESULT' in out.getvalue()


def test_banner_says_the_sampling_and_where_it_came_from(sampling_release):
    """A piped REPL prints its banner, then leaves at end of input."""
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(sampling_release.src)
    run = lambda *a: subprocess.run([sys.executable, "-m", "hybrid_npu.runtime.chat.cli",  # noqa: E731
                                     str(sampling_release.out), *a], input="", capture_output=True, text=True,
                                    timeout=300)
    banner = run().stdout.splitlines()[0]
    assert f"temperature {gen.temperature:g}, top_k {gen.top_k}, top_p {gen.top_p:g} (model defaults)" in banner
    assert "greedy" in run("--temperature", "0").stdout.splitlines()[0]
