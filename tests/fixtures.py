"""Offline, deterministic tiny-model fixtures for the hybrid-npu tests.

Everything here is built from scratch on the CPU with transformers/tokenizers/safetensors; nothing is
downloaded.  Spec: docs/qwen35-model.md (layouts, trap 6).

Public helpers
--------------
* ``tiny_text_config(**overrides)``                 -> ``Qwen3_5TextConfig`` (every axis differs, see TINY_TEXT_KWARGS)
* ``make_causal_lm(seed=0, tie=True, **ovr)``       -> float32 eval ``Qwen3_5ForCausalLM``, all weights randomised
* ``write_text_checkpoint(dir, seed, tie, **ovr)``  -> text-only HF dir (``model_type "qwen3_5_text"``) + tokenizer
* ``write_release_checkpoint(dir, seed, tie, with_mtp, sharded, **ovr)``
                                                    -> released-VLM layout (``model.language_model.*``, ``model.visual.*``,
                                                       ``mtp.*``; ``tie_word_embeddings`` only at the TOP level)
* ``write_qwen3_next_checkpoint(dir, seed, moe, tie, **ovr)`` -> tiny ``qwen3_next`` dir (fused in_proj_qkvz / in_proj_ba)
* ``train_tiny_tokenizer()`` / ``write_tokenizer_files(dir)``   -> byte-level BPE (300 tokens) + ChatML template
* ``write_pickle_only_checkpoint(dir, seed, tie)``  -> config.json + pytorch_model.bin only
* ``corrupt_truncate(path, n_bytes)``               -> chop the last n_bytes off a file

Weights are drawn from a private ``torch.Generator`` (the global RNG is left untouched), one parameter at a
time in ``named_parameters()`` order, with ``lm_head`` last; so for a given seed the text weights are the same
for ``make_causal_lm``, ``write_text_checkpoint`` and ``write_release_checkpoint``, and ``tie`` only decides
whether an extra ``lm_head`` is drawn.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

import chatml_tokenizer  # noqa: E402  (the tokenizer train_target.py gives the embedded model)

LIN, FULL = "linear_attention", "full_attention"

# ----------------------------------------------------------------------------------------------------
# tokenizer ids (asserted against the trained tokenizer in train_tiny_tokenizer)
# ----------------------------------------------------------------------------------------------------
N_BYTES = 256
N_MERGES = 39
ENDOFTEXT, IM_START, IM_END, THINK, END_THINK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"
ENDOFTEXT_ID = N_BYTES + N_MERGES          # 295
IM_START_ID = ENDOFTEXT_ID + 1             # 296
IM_END_ID = ENDOFTEXT_ID + 2               # 297
THINK_ID = ENDOFTEXT_ID + 3                # 298  (added token, not special -- as in Qwen3)
END_THINK_ID = ENDOFTEXT_ID + 4            # 299
TOKENIZER_VOCAB_SIZE = ENDOFTEXT_ID + 5    # 300; the model vocab (320) is larger, like the real releases

# VLM-only ids: inside the model vocab, outside the tokenizer vocab (text-only inputs never contain them)
VISION_START_ID, VISION_END_ID, IMAGE_ID, VIDEO_ID = 316, 317, 318, 319

# ----------------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------------
TINY_LAYER_TYPES = [LIN, LIN, FULL, LIN, LIN, FULL]    # 2:1, not the default 3:1

# H=48, nH*hd=96, nKV*hd=48, Hk*Dk=24, Hv*Dv=60, conv_dim=108, I=88, rd=6
TINY_TEXT_KWARGS = dict(
    vocab_size=320,
    hidden_size=48,
    intermediate_size=88,
    num_hidden_layers=6,
    layer_types=TINY_LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=12,
    linear_value_head_dim=10,
    linear_conv_kernel_dim=4,
    hidden_act="silu",
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,      # rd = int(24 * 0.25) = 6
        "mrope_section": [1, 1, 1],         # must sum to rd / 2 = 3
        "mrope_interleaved": True,
    },
    rms_norm_eps=1e-6,
    max_position_embeddings=65536,
    attention_bias=False,
    tie_word_embeddings=True,
    bos_token_id=ENDOFTEXT_ID,
    eos_token_id=IM_END_ID,
    pad_token_id=ENDOFTEXT_ID,
)

TINY_VISION_KWARGS = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=24,
    num_heads=2,
    in_channels=3,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=48,          # = text hidden_size (set from the text config)
    num_position_embeddings=16,
    hidden_act="gelu_pytorch_tanh",
)

DEFAULT_GENERATION_CONFIG = dict(
    bos_token_id=ENDOFTEXT_ID,
    eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
    pad_token_id=ENDOFTEXT_ID,
    do_sample=False,             # greedy by default so reference generations are deterministic
)


def _copy_kwargs(d):
    return json.loads(json.dumps(d))


def tiny_text_config(**overrides):
    """A tiny ``Qwen3_5TextConfig``; keyword overrides replace entries of TINY_TEXT_KWARGS.

    ``tie=`` is accepted as an alias of ``tie_word_embeddings=``.  When ``num_hidden_layers`` is overridden
    without ``layer_types``, the 2:1 pattern [lin, lin, full] is repeated (and truncated)."""
    from transformers import Qwen3_5TextConfig

    kw = _copy_kwargs(TINY_TEXT_KWARGS)
    if "tie" in overrides:
        overrides["tie_word_embeddings"] = overrides.pop("tie")
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        kw["layer_types"] = [TINY_LAYER_TYPES[i % 3] for i in range(n)]
    kw.update(overrides)
    if kw.get("layer_types") is not None:
        assert len(kw["layer_types"]) == kw["num_hidden_layers"], "layer_types must have num_hidden_layers entries"
    return Qwen3_5TextConfig(**kw)


def _full_attention_interval(layer_types):
    """n such that layer_types == HF's default schedule for interval n, else None."""
    for n in range(1, len(layer_types) + 1):
        if layer_types == [LIN if (i + 1) % n else FULL for i in range(len(layer_types))]:
            return n
    return None


# ----------------------------------------------------------------------------------------------------
# weight randomisation
# ----------------------------------------------------------------------------------------------------
def _draw(name, shape, gen, hidden_size, vision=False):
    """Random tensor for parameter `name` (float32).  Scales chosen so that activations stay O(1) and
    the final logits spread over a few units."""
    n = name
    shape = tuple(shape)
    if len(shape) == 1 and n.endswith(".bias"):
        return 0.02 * torch.randn(shape, generator=gen)
    if vision:                                                      # LayerNorms (plain w) and Linears/Conv3d
        if len(shape) == 1:
            return 1.0 + 0.1 * torch.randn(shape, generator=gen)
        fan_in = int(torch.tensor(shape[1:]).prod()) if len(shape) > 2 else shape[-1]
        return (0.7 / math.sqrt(fan_in)) * torch.randn(shape, generator=gen)
    if n.endswith("linear_attn.norm.weight"):                       # Qwen3_5RMSNormGated: plain w, init 1
        return 1.0 + 0.3 * torch.randn(shape, generator=gen)
    if n.endswith("A_log"):                                         # decays from ~1 (slow heads) to fast
        return torch.empty(shape).uniform_(math.log(0.01), math.log(8.0), generator=gen)
    if n.endswith("dt_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if n.endswith("conv1d.weight"):                                 # [conv_dim, 1, K]
        return 0.5 * torch.randn(shape, generator=gen)
    if len(shape) == 1 and n.endswith(".weight") and "norm" in n.split(".")[-2]:
        # every other norm of the text / MTP stacks is a zero-centred (1 + w) RMSNorm:
        # input_layernorm, post_attention_layernorm, model.norm, q_norm, k_norm, mtp.*norm*
        return 0.3 * torch.randn(shape, generator=gen)
    if n.endswith("embed_tokens.weight") or n == "lm_head.weight":     # logits std ~2 (range ~12 units)
        return (2.0 / math.sqrt(hidden_size)) * torch.randn(shape, generator=gen)
    if len(shape) >= 2:                                             # Linear [out, in]; experts [E, out, in]
        # unit gain keeps the residual stream O(1-4): a larger gain (2.0) let fp32 rounding grow to
        # 4e-4 on the logits in transformers itself (vs float64), too close to the 1e-4 parity bar
        gain = 1.0
        return (gain / math.sqrt(shape[-1])) * torch.randn(shape, generator=gen)
    raise AssertionError(f"fixtures: no randomisation rule for {name} {shape}")


def _randomise_(model, seed, hidden_size, vision=False):
    gen = torch.Generator().manual_seed(int(seed))
    named = list(model.named_parameters())                           # tied lm_head appears once (as embed)
    named.sort(key=lambda kv: kv[0] == "lm_head.weight")             # lm_head last: tie does not shift the rest
    with torch.no_grad():
        for name, p in named:
            p.copy_(_draw(name, p.shape, gen, hidden_size, vision).to(p.dtype))
    return model


def _quiet_new(cls, config):
    """Instantiate a transformers model without touching the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        return cls(config)


# ----------------------------------------------------------------------------------------------------
# Qwen3.5 text model
# ----------------------------------------------------------------------------------------------------
def make_causal_lm(seed=0, tie=True, **cfg_overrides):
    """Float32 eval-mode ``Qwen3_5ForCausalLM`` with every weight randomised (norms included)."""
    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    cfg = tiny_text_config(**{**cfg_overrides, "tie_word_embeddings": bool(tie)})
    model = _quiet_new(Qwen3_5ForCausalLM, cfg).to(torch.float32)
    _randomise_(model, seed, cfg.hidden_size)
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(**DEFAULT_GENERATION_CONFIG)
    return model.eval()


def _write_generation_config(dir_, gen=None):
    d = dict(DEFAULT_GENERATION_CONFIG if gen is None else gen)
    import transformers
    d["transformers_version"] = transformers.__version__
    Path(dir_, "generation_config.json").write_text(json.dumps(d, indent=2) + "\n")


def write_text_checkpoint(dir, seed=0, tie=True, **cfg_overrides):
    """``save_pretrained`` of ``make_causal_lm(seed, tie, **cfg_overrides)`` (safetensors, names ``model.*``,
    ``lm_head.weight`` only when untied, ``model_type "qwen3_5_text"``) + tokenizer files +
    generation_config.json.  Returns the in-memory reference model."""
    dir_ = Path(dir)
    dir_.mkdir(parents=True, exist_ok=True)
    model = make_causal_lm(seed=seed, tie=tie, **cfg_overrides)
    model.save_pretrained(dir_, safe_serialization=True)
    _write_generation_config(dir_)
    write_tokenizer_files(dir_)
    return model


# ----------------------------------------------------------------------------------------------------
# released VLM layout
# ----------------------------------------------------------------------------------------------------
def _tiny_vision_config(hidden_size):
    from transformers import Qwen3_5VisionConfig

    return Qwen3_5VisionConfig(**{**TINY_VISION_KWARGS, "out_hidden_size": hidden_size})


def _vision_state_dict(seed, hidden_size):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    vis = _quiet_new(Qwen3_5VisionModel, _tiny_vision_config(hidden_size)).to(torch.float32)
    _randomise_(vis, seed + 0x71510, hidden_size, vision=True)
    return {f"model.visual.{k}": v.detach().clone().contiguous() for k, v in vis.state_dict().items()}


def make_mtp_state_dict(cfg, seed=0):
    """Fake MTP tensors (mtp_num_hidden_layers = 1): fc [H, 2H], three (1+w) norms, and one full-attention
    decoder layer ``mtp.layers.0.*`` with the same names/shapes as a text-stack attention layer."""
    H, hd, nH, nKV, I = (cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                         cfg.intermediate_size)
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.layers.0.input_layernorm.weight": (H,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nH * hd, H),
        "mtp.layers.0.self_attn.k_proj.weight": (nKV * hd, H),
        "mtp.layers.0.self_attn.v_proj.weight": (nKV * hd, H),
        "mtp.layers.0.self_attn.o_proj.weight": (H, nH * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.post_attention_layernorm.weight": (H,),
        "mtp.layers.0.mlp.gate_proj.weight": (I, H),
        "mtp.layers.0.mlp.up_proj.weight": (I, H),
        "mtp.layers.0.mlp.down_proj.weight": (H, I),
        "mtp.norm.weight": (H,),
    }
    gen = torch.Generator().manual_seed(int(seed) + 0x3770)
    return {k: _draw(k, s, gen, H).contiguous() for k, s in shapes.items()}


def _release_config_dict(cfg, tie, with_mtp):
    import transformers

    text = cfg.to_diff_dict()
    for k in ("tie_word_embeddings", "transformers_version", "architectures", "_name_or_path"):
        text.pop(k, None)
    text["model_type"] = "qwen3_5_text"
    text["dtype"] = "float32"
    # keys the real releases carry in text_config (ignored by transformers)
    text["attn_output_gate"] = True
    text["output_gate_type"] = "swish"
    text["mamba_ssm_dtype"] = "float32"
    text["mtp_num_hidden_layers"] = 1 if with_mtp else 0
    text["mtp_use_dedicated_embeddings"] = False
    text["partial_rotary_factor"] = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
    interval = _full_attention_interval(list(cfg.layer_types))
    if interval is not None:
        text["full_attention_interval"] = interval
    vision = _tiny_vision_config(cfg.hidden_size).to_diff_dict()
    for k in ("transformers_version", "architectures", "_name_or_path"):
        vision.pop(k, None)
    vision["model_type"] = "qwen3_5"          # as released; Qwen3_5Config rewrites it to qwen3_5_vision
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": IMAGE_ID,
        "video_token_id": VIDEO_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "language_model_only": False,
        "tie_word_embeddings": bool(tie),     # top level ONLY (docs/qwen35-model.md trap 6)
        "text_config": text,
        "vision_config": vision,
        "transformers_version": transformers.__version__,
    }


def _save_safetensors(dir_, tensors, sharded):
    from safetensors.torch import save_file

    names = list(tensors)
    if not sharded:
        save_file(tensors, str(Path(dir_, "model.safetensors")), metadata={"format": "pt"})
        return ["model.safetensors"]
    # 3 shards: text embed + first half of layers | rest of text (+ lm_head) | visual + mtp
    text = [n for n in names if not n.startswith(("model.visual.", "mtp."))]
    other = [n for n in names if n.startswith(("model.visual.", "mtp."))]
    half = len(text) // 2
    groups = [g for g in (text[:half], text[half:], other) if g]
    assert len(groups) >= 2
    n = len(groups)
    weight_map, files = {}, []
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in g}, str(Path(dir_, fname)), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in g})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    Path(dir_, "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def write_release_checkpoint(dir, seed=0, tie=True, with_mtp=True, sharded=False, **cfg_overrides):
    """Write the released ``Qwen3_5ForConditionalGeneration`` layout (qwen35.md section 4):

    * config.json: ``model_type "qwen3_5"``, architectures ``["Qwen3_5ForConditionalGeneration"]``,
      ``text_config`` (+ the release-only keys) and a tiny ``vision_config``; ``tie_word_embeddings`` is at the
      top level and deliberately NOT inside text_config (so ``AutoModelForCausalLM`` leaves ``lm_head`` random
      when tie=True -- docs/qwen35-model.md trap 6).
    * tensors ``model.language_model.*``, ``model.visual.*`` (a complete tiny vision tower), ``lm_head.weight``
      only when untied, and ``mtp.*`` when ``with_mtp``.  ``sharded=True`` writes 3 shards + the index.
    * tokenizer files + generation_config.json.

    Returns the reference ``Qwen3_5ForCausalLM`` (same text weights; for a given seed identical to
    ``make_causal_lm(seed, tie)``), with ``lm_head`` tied explicitly when ``tie``.  The fake MTP tensors are
    attached as ``ref.mtp_state_dict`` (``{}`` when ``with_mtp=False``)."""
    dir_ = Path(dir)
    dir_.mkdir(parents=True, exist_ok=True)
    ref = make_causal_lm(seed=seed, tie=tie, **cfg_overrides)
    cfg = ref.config

    tensors = {}
    for k, v in ref.state_dict().items():
        if k == "lm_head.weight":
            if tie:
                continue
            tensors[k] = v.detach().clone().contiguous()
        else:
            assert k.startswith("model."), k
            tensors["model.language_model." + k[len("model."):]] = v.detach().clone().contiguous()
    tensors.update(_vision_state_dict(seed, cfg.hidden_size))
    mtp = make_mtp_state_dict(cfg, seed) if with_mtp else {}
    tensors.update(mtp)

    Path(dir_, "config.json").write_text(json.dumps(_release_config_dict(cfg, tie, with_mtp), indent=2) + "\n")
    _save_safetensors(dir_, tensors, sharded)
    _write_generation_config(dir_)
    write_tokenizer_files(dir_)
    ref.mtp_state_dict = mtp
    return ref


# ----------------------------------------------------------------------------------------------------
# Qwen3-Next
# ----------------------------------------------------------------------------------------------------
def tiny_qwen3_next_config(moe=False, **overrides):
    """Tiny ``Qwen3NextConfig`` with the same geometry as the Qwen3.5 fixture (no MRoPE).

    Dense (``moe=False``): ``num_experts=4`` but ``mlp_only_layers`` = every layer, so every layer is a dense
    ``Qwen3NextMLP`` (an exporter must decide per layer, as transformers does).  ``moe=True``: layers 1
    (linear attention) and 5 (full attention) are sparse-MoE blocks."""
    from transformers import Qwen3NextConfig

    kw = _copy_kwargs(TINY_TEXT_KWARGS)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    kw["tie_word_embeddings"] = False
    if "tie" in overrides:
        overrides["tie_word_embeddings"] = overrides.pop("tie")
    L = overrides.get("num_hidden_layers", kw["num_hidden_layers"])
    if "layer_types" not in overrides:
        kw["layer_types"] = [TINY_LAYER_TYPES[i % 3] for i in range(L)]
    sparse = [i for i in (1, 5) if i < L]
    kw.update(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=20,
        shared_expert_intermediate_size=28,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        mlp_only_layers=[i for i in range(L) if i not in sparse] if moe else list(range(L)),
    )
    kw.update(overrides)
    return Qwen3NextConfig(**kw)


def write_qwen3_next_checkpoint(dir, seed=0, moe=False, tie=False, **cfg_overrides):
    """Tiny ``qwen3_next`` checkpoint (``save_pretrained``, safetensors) + tokenizer + generation config.
    Returns the float32 eval ``Qwen3NextForCausalLM`` reference."""
    from transformers import GenerationConfig, Qwen3NextForCausalLM

    dir_ = Path(dir)
    dir_.mkdir(parents=True, exist_ok=True)
    cfg = tiny_qwen3_next_config(moe=moe, **{**cfg_overrides, "tie_word_embeddings": bool(tie)})
    model = _quiet_new(Qwen3NextForCausalLM, cfg).to(torch.float32)
    _randomise_(model, seed, cfg.hidden_size)
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(**DEFAULT_GENERATION_CONFIG)
    model.eval()
    model.save_pretrained(dir_, safe_serialization=True)
    _write_generation_config(dir_)
    write_tokenizer_files(dir_)
    return model


# ----------------------------------------------------------------------------------------------------
# pickle-only checkpoint and corruption helper
# ----------------------------------------------------------------------------------------------------
def write_pickle_only_checkpoint(dir, seed=0, tie=True, **cfg_overrides):
    """config.json + pytorch_model.bin (``torch.save`` of the state dict, no safetensors at all).
    Returns the reference model."""
    dir_ = Path(dir)
    dir_.mkdir(parents=True, exist_ok=True)
    model = make_causal_lm(seed=seed, tie=tie, **cfg_overrides)
    model.config.architectures = ["Qwen3_5ForCausalLM"]
    model.config.to_json_file(str(dir_ / "config.json"))
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
          if not (tie and k == "lm_head.weight")}
    torch.save(sd, dir_ / "pytorch_model.bin")
    return model


def corrupt_truncate(path, n_bytes):
    """Chop the last ``n_bytes`` bytes off ``path`` (clamped at 0).  Returns the new size."""
    size = os.path.getsize(path)
    new = max(0, size - int(n_bytes))
    with open(path, "r+b") as f:
        f.truncate(new)
    return new


# ----------------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------------
# The tokenizer, its added tokens and its ChatML template are the ones train_target.py gives the
# embedded model (scripts/train/chatml_tokenizer.py), trained here on a built-in text.

_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the forest.
A small model can still learn the shape of a language. It sees the same words again and again: the, and,
of, to, in, is, that, it, with, for, on, as, this, was, are, be, at, by, not, or, from, have, an, they.
Hello! How are you today? I am fine, thank you. What is the weather like where you are? It is raining here.
Please write a short story about a robot who wants to learn how to paint. The robot found a brush and a
canvas, and it painted the sea, the sky and the mountains. Then it painted itself, and it was happy.
Numbers are split into digits: 2024, 3.14159, 42, 1000000 and 7 are all numbers. Lists are useful too:
first, second, third. Questions end with a question mark? Statements end with a full stop.
The user asks a question and the assistant answers it. The system message tells the assistant how to
behave. The assistant thinks before it answers, and then it gives a clear and helpful answer to the user.
Simple is better than complex. Readability counts. Errors should never pass silently.
In the face of ambiguity, refuse the temptation to guess. Now is better than never.
Linear attention keeps a fixed state, while full attention keeps every key and value in a cache.
The state is updated with a gated delta rule, and the cache grows with the length of the context.
"""

CHAT_TEMPLATE = chatml_tokenizer.CHAT_TEMPLATE

_TOKENIZER = None


def train_tiny_tokenizer():
    """Byte-level BPE (256 bytes + 39 merges + 3 special + 2 think tokens = 300), trained once per process
    on the built-in English text.  Returns the cached ``tokenizers.Tokenizer`` (do not mutate it)."""
    global _TOKENIZER
    if _TOKENIZER is not None:
        return _TOKENIZER
    tok = chatml_tokenizer.train_bpe(_CORPUS.splitlines(keepends=True), N_BYTES + N_MERGES)
    ids = [tok.token_to_id(t) for t in (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)]
    assert ids == [ENDOFTEXT_ID, IM_START_ID, IM_END_ID, THINK_ID, END_THINK_ID], ids
    assert tok.get_vocab_size() == TOKENIZER_VOCAB_SIZE
    _TOKENIZER = tok
    return tok


def write_tokenizer_files(dir):
    """tokenizer.json, tokenizer_config.json (ChatML ``chat_template`` with ``enable_thinking``),
    special_tokens_map.json."""
    dir_ = Path(dir)
    dir_.mkdir(parents=True, exist_ok=True)
    chatml_tokenizer.write_tokenizer(train_tiny_tokenizer(), dir_)
    stm = {
        "additional_special_tokens": [IM_START, IM_END],
        "eos_token": {"content": IM_END, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "pad_token": {"content": ENDOFTEXT, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False},
    }
    (dir_ / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")
    return dir_


def tables_ort_holds(onnx_path, shape) -> list:
    """The element types of the initializers of `shape` in ONNX Runtime's optimised form of the graph
    (its constant folding included), e.g. [FLOAT16] for an embedding read in place, [FLOAT16, FLOAT]
    when a Cast of the whole table was folded into an fp32 copy."""
    import tempfile

    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(Path(tmp) / "optimised.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimised.bin")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "0")
        ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        model = onnx.load(so.optimized_model_filepath, load_external_data=False)
    return [t.data_type for t in model.graph.initializer if tuple(t.dims) == tuple(shape)]


def fp32_compute(graphs_dir) -> None:
    """Every MatMulNBits in graphs_dir/*.onnx multiplying in fp32 (accuracy_level 0), weights
    untouched: against float weights dequantised the same way, only summation order differs."""
    import onnx

    for path in Path(graphs_dir).glob("*.onnx"):
        model = onnx.load(str(path), load_external_data=False)
        for node in model.graph.node:
            for attr in node.attribute:
                if node.op_type == "MatMulNBits" and attr.name == "accuracy_level":
                    attr.i = 0
        onnx.save_model(model, str(path))
