"""Self-check of tests/fixtures.py against transformers 5.24 (CPU, offline, fast)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import fixtures as F

@pytest.fixture(autouse=True, scope="module")
def _single_torch_thread():
    """On this 2-core box a 2-thread OpenMP forward of the tiny model becomes ~10x slower as soon as another
    process holds a core (spin-waiting barriers); one intra-op thread is fast and deterministic.  Restored
    afterwards so other test modules are unaffected."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


IDS = torch.tensor([[F.IM_START_ID, 39, 68, 280, 78, 0, 220, 255, 150, 12, F.IM_END_ID, 198, 7, 90, 101, 33,
                     F.ENDOFTEXT_ID, 5, 140, 64, 250, 319, 17, 3]])


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _safetensors_keys(d):
    from safetensors import safe_open

    keys = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), "pt") as f:
                for k in f.keys():
                    assert k not in keys, f"{k} in two shards"
                    keys[k] = fn
    return keys


# --------------------------------------------------------------------------------------------------
def test_tiny_config_every_axis_differs():
    c = F.tiny_text_config()
    assert c.model_type == "qwen3_5_text"
    assert c.layer_types == ["linear_attention", "linear_attention", "full_attention",
                             "linear_attention", "linear_attention", "full_attention"]
    default_schedule = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(6)]
    assert c.layer_types != default_schedule
    H, nH, nKV, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    Hk, Hv, Dk, Dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    assert Hk != Hv and Dk != Dv and hd != Dk and hd != Dv and nH != nKV and nH * hd != H
    assert Hv % Hk == 0 and nH % nKV == 0
    rp = c.rope_parameters
    rd = int(hd * rp["partial_rotary_factor"])
    assert sum(rp["mrope_section"]) == rd // 2 and rp["mrope_interleaved"]
    assert c.vocab_size >= F.TOKENIZER_VOCAB_SIZE
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (F.ENDOFTEXT_ID, F.IM_END_ID, F.ENDOFTEXT_ID)
    # overrides
    c8 = F.tiny_text_config(num_hidden_layers=8)
    assert len(c8.layer_types) == 8 and c8.layer_types[2] == "full_attention"
    assert F.tiny_text_config(tie=False).tie_word_embeddings is False


def test_make_causal_lm_deterministic_randomised_and_rng_neutral():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    a = F.make_causal_lm(seed=0, tie=True)
    assert torch.equal(before, torch.get_rng_state()), "fixtures must not consume the global RNG"
    b = F.make_causal_lm(seed=0, tie=True)
    c = F.make_causal_lm(seed=1, tie=True)
    u = F.make_causal_lm(seed=0, tie=False)
    sa, sb, sc, su = a.state_dict(), b.state_dict(), c.state_dict(), u.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.norm.weight"], sc["model.norm.weight"])
    # tie only adds an lm_head draw; everything else identical
    assert all(torch.equal(sa[k], su[k]) for k in sa if k != "lm_head.weight")
    assert not torch.equal(su["lm_head.weight"], su["model.embed_tokens.weight"])
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()
    assert not a.training and all(p.dtype == torch.float32 for p in a.parameters())
    # every norm randomised: (1+w) norms ~ N(0, .3), gated norm ~ 1 + N(0, .3)
    for k, v in sa.items():
        if k.endswith("linear_attn.norm.weight"):
            assert (v - 1).abs().mean() > 0.1, k
        elif k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or k == "model.norm.weight":
            assert v.abs().mean() > 0.1 and v.mean().abs() < 0.3, k
    # logits spread over a few units, hidden states sane, greedy decoding non-trivial
    with torch.no_grad():
        out = a(input_ids=IDS, output_hidden_states=True)
    assert 1.0 < out.logits.std().item() < 5.0
    assert torch.isfinite(out.logits).all()
    assert max(h.pow(2).mean().sqrt().item() for h in out.hidden_states) < 20
    ids, gen = IDS[:, :10], []
    with torch.no_grad():                                          # plain greedy loop (cheaper than generate)
        for _ in range(16):
            nxt = a(input_ids=ids).logits[0, -1].argmax().item()
            gen.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    assert len(set(gen)) >= 6, gen


@pytest.mark.parametrize("tie", [True, False])
def test_text_checkpoint_loads_identically(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    ref = F.write_text_checkpoint(tmp_path, seed=3, tie=tie)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["tie_word_embeddings"] is tie
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    keys = _safetensors_keys(tmp_path)
    assert ("lm_head.weight" in keys) is (not tie)
    assert all(k.startswith("model.") or k == "lm_head.weight" for k in keys)
    assert not (tmp_path / "pytorch_model.bin").exists()
    gc = json.loads((tmp_path / "generation_config.json").read_text())
    assert gc["eos_token_id"] == [F.IM_END_ID, F.ENDOFTEXT_ID]
    for fn in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / fn).is_file()
    m = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(m).__name__ == "Qwen3_5ForCausalLM"
    torch.testing.assert_close(_logits(m), _logits(ref), rtol=0, atol=0)


@pytest.mark.parametrize("tie,sharded", [(True, False), (False, False), (True, True), (False, True)])
def test_release_checkpoint_layout_and_equivalence(tmp_path, tie, sharded):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    ref = F.write_release_checkpoint(tmp_path, seed=5, tie=tie, with_mtp=True, sharded=sharded)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["tie_word_embeddings"] is tie and "tie_word_embeddings" not in cfg["text_config"]
    assert cfg["text_config"]["model_type"] == "qwen3_5_text" and cfg["vision_config"]["model_type"] == "qwen3_5"
    assert cfg["text_config"]["full_attention_interval"] == 3
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1

    keys = _safetensors_keys(tmp_path)
    text = {k for k in keys if k.startswith("model.language_model.")}
    assert text and not any(k.startswith("model.layers.") for k in keys)
    assert any(k.startswith("model.visual.") for k in keys)
    assert ("lm_head.weight" in keys) is (not tie)
    H = ref.config.hidden_size
    mtp = {k for k in keys if k.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.self_attn.q_norm.weight",
            "mtp.layers.0.mlp.down_proj.weight"} <= mtp
    assert tuple(ref.mtp_state_dict["mtp.fc.weight"].shape) == (H, 2 * H)
    assert set(ref.mtp_state_dict) == mtp
    if sharded:
        idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert idx["weight_map"] == keys and len(set(keys.values())) >= 2
        assert not (tmp_path / "model.safetensors").exists()
    else:
        assert set(keys.values()) == {"model.safetensors"}

    # same text weights as make_causal_lm(seed, tie)
    ref_sd = ref.state_dict()
    fresh_sd = F.make_causal_lm(seed=5, tie=tie).state_dict()
    assert all(torch.equal(v, fresh_sd[k]) for k, v in ref_sd.items())

    # AutoModelForCausalLM: drops visual/mtp; with tie only at the top level lm_head is NOT tied (docs/qwen35-model.md trap 6)
    m, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(m).__name__ == "Qwen3_5ForCausalLM"
    assert not info["unexpected_keys"]
    assert set(info["missing_keys"]) == ({"lm_head.weight"} if tie else set())
    msd = m.state_dict()
    assert all(torch.equal(msd[k], v) for k, v in ref_sd.items() if k != "lm_head.weight")
    if tie:                                   # what an exporter must do: read the top-level flag, tie explicitly
        m.lm_head.weight = m.model.embed_tokens.weight
    torch.testing.assert_close(_logits(m), _logits(ref), rtol=0, atol=0)

    # the VLM class reads the top-level flag itself and needs no fix-up
    if not sharded:
        v, vinfo = AutoModelForImageTextToText.from_pretrained(tmp_path, output_loading_info=True)
        assert type(v).__name__ == "Qwen3_5ForConditionalGeneration"
        assert not vinfo["missing_keys"] and not vinfo["unexpected_keys"]
        torch.testing.assert_close(_logits(v), _logits(ref), rtol=0, atol=0)


def test_release_checkpoint_without_mtp(tmp_path):
    F.write_release_checkpoint(tmp_path, seed=0, tie=True, with_mtp=False)
    keys = _safetensors_keys(tmp_path)
    assert not any(k.startswith("mtp.") for k in keys) and "lm_head.weight" not in keys


def test_tokenizer_roundtrip_and_hf_agreement(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = F.train_tiny_tokenizer()
    assert F.train_tiny_tokenizer() is tok                       # cached
    assert tok.get_vocab_size() == F.TOKENIZER_VOCAB_SIZE <= 300
    for t, i in ((F.ENDOFTEXT, F.ENDOFTEXT_ID), (F.IM_START, F.IM_START_ID), (F.IM_END, F.IM_END_ID),
                 (F.THINK, F.THINK_ID), (F.END_THINK, F.END_THINK_ID)):
        assert tok.token_to_id(t) == i
    texts = ["Hello! How are you today?", "The quick brown fox, 2024 and 3.14.\n\n  indented\ttab",
             "caf\u00e9 na\u00efve \u2615 \u65e5\u672c\u8a9e \U0001F600", ""]
    for s in texts:
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s
    s = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nOK<|im_end|><|endoftext|>"
    ids = tok.encode(s).ids
    for i in (F.IM_START_ID, F.IM_END_ID, F.THINK_ID, F.END_THINK_ID, F.ENDOFTEXT_ID):
        assert i in ids
    assert tok.decode(ids, skip_special_tokens=False) == s
    assert len(tok.encode("the assistant answers the question").ids) < len("the assistant answers the question")

    F.write_tokenizer_files(tmp_path)
    t2 = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token == F.IM_END and hf.pad_token == F.ENDOFTEXT
    assert hf.eos_token_id == F.IM_END_ID and hf.pad_token_id == F.ENDOFTEXT_ID
    for s2 in texts + [s]:
        assert t2.encode(s2).ids == tok.encode(s2).ids == hf(s2, add_special_tokens=False).input_ids
        assert hf.decode(tok.encode(s2).ids) == s2


def test_chat_template_sandboxed_and_hf(tmp_path):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    F.write_tokenizer_files(tmp_path)
    tcfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    tmpl = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(tcfg["chat_template"])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to 3."}]
    body = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nCount to 3.<|im_end|>\n")
    assert tmpl.render(messages=msgs) == body
    assert tmpl.render(messages=msgs, add_generation_prompt=False, enable_thinking=False) == body
    no_think = body + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # as the released small Qwen3.5 models: no thinking unless enable_thinking is true
    assert tmpl.render(messages=msgs, add_generation_prompt=True) == no_think
    assert tmpl.render(messages=msgs, add_generation_prompt=True, enable_thinking=True) == \
        body + "<|im_start|>assistant\n"
    assert tmpl.render(messages=msgs, add_generation_prompt=True, enable_thinking=False) == no_think
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False) == no_think
    tok = F.train_tiny_tokenizer()
    ids = tok.encode(no_think).ids
    assert ids[0] == F.IM_START_ID and ids.index(F.THINK_ID) < ids.index(F.END_THINK_ID)
    assert tok.decode(ids, skip_special_tokens=False) == no_think


@pytest.mark.parametrize("moe", [False, True])
def test_qwen3_next_checkpoint(tmp_path, moe):
    from transformers import AutoModelForCausalLM

    ref = F.write_qwen3_next_checkpoint(tmp_path, seed=2, moe=moe)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next"
    keys = _safetensors_keys(tmp_path)
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in keys
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in keys
    assert not any(k.endswith(("in_proj_qkv.weight", "in_proj_z.weight")) for k in keys)
    c = ref.config
    kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    assert tuple(ref.state_dict()["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape) == \
        (2 * kd + 2 * vd, c.hidden_size)
    moe_layers = sorted({int(k.split(".")[2]) for k in keys if ".mlp.experts." in k or ".mlp.gate.weight" in k})
    assert moe_layers == ([1, 5] if moe else [])
    m = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(m).__name__ == "Qwen3NextForCausalLM"
    a, b = _logits(m), _logits(ref)
    assert a.std() > 1.0
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_pickle_only_checkpoint_and_truncate(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    pk = tmp_path / "pk"
    ref = F.write_pickle_only_checkpoint(pk)
    assert sorted(os.listdir(pk)) == ["config.json", "pytorch_model.bin"]
    m = AutoModelForCausalLM.from_pretrained(pk)
    torch.testing.assert_close(_logits(m), _logits(ref), rtol=0, atol=0)

    st = tmp_path / "st"
    F.write_text_checkpoint(st, seed=0)
    p = st / "model.safetensors"
    size = os.path.getsize(p)
    assert F.corrupt_truncate(p, 1000) == size - 1000 == os.path.getsize(p)
    with pytest.raises(Exception):
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    assert F.corrupt_truncate(p, 10 ** 9) == 0
