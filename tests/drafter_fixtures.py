"""Tiny random EAGLE-3 drafters for the tiny target of fixtures.py, written offline in both layouts
(docs/eagle3-drafter.md): official/SpecForge (`midlayer.*`) and vLLM speculators (`layers.0.*`).

Sizes differ on every axis: target H=48, V=320, taps (2, 3, 3); drafter h=32, 4 heads, 2 KV heads,
head_dim 12 (not h/heads = 8), intermediate 40, draft vocab 64 with a sparse d2t.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import fixtures
from hybrid_npu.export.checkpoint import parse_config

H, V = 48, 320
DRAFTER = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=40,
               draft_vocab_size=64, rms_norm_eps=1e-6, rope_theta=10000.0)


def target_config():
    """The tiny target's ModelConfig (tap_layers (2, 3, 3))."""
    return parse_config(Path("."), fixtures.tiny_text_config().to_dict())


def target_embedding(seed=7, h=H) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((V, h)) / np.sqrt(h)).astype(np.float32)


def drafter_weights(seed=0, n_taps=3, embed=True, qk_norm=False, input_norm=False, fc_in=None, **over) -> dict:
    """Canonical (`midlayer.*`) random weights, norms near 1, activations O(1)."""
    d = {**DRAFTER, **over}
    h, nh, nkv, hd, inter, vd = (d["hidden_size"], d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"],
                                 d["intermediate_size"], d["draft_vocab_size"])
    rng = np.random.default_rng(seed)
    fc_in = fc_in or n_taps * H

    def mat(o, i, gain=1.0):
        return (gain * rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": mat(h, fc_in), "norm.weight": norm(h), "lm_head.weight": mat(vd, h, 2.0),
         "midlayer.input_layernorm.weight": norm(h), "midlayer.hidden_norm.weight": norm(h),
         "midlayer.post_attention_layernorm.weight": norm(h),
         "midlayer.self_attn.q_proj.weight": mat(nh * hd, 2 * h, 2.0),
         "midlayer.self_attn.k_proj.weight": mat(nkv * hd, 2 * h, 2.0),
         "midlayer.self_attn.v_proj.weight": mat(nkv * hd, 2 * h),
         "midlayer.self_attn.o_proj.weight": mat(h, nh * hd),
         "midlayer.mlp.gate_proj.weight": mat(inter, h), "midlayer.mlp.up_proj.weight": mat(inter, h),
         "midlayer.mlp.down_proj.weight": mat(h, inter)}
    if embed:
        w["embed_tokens.weight"] = (rng.standard_normal((V, h)) / np.sqrt(h)).astype(np.float32)
    if qk_norm:
        w["midlayer.self_attn.q_norm.weight"], w["midlayer.self_attn.k_norm.weight"] = norm(hd), norm(hd)
    if input_norm:
        w["input_norm.weight"] = norm(fc_in)
    if vd != V:
        used = np.sort(rng.choice(V, vd, replace=False)).astype(np.int64)  # docs/eagle3-drafter.md
        w["d2t"] = used - np.arange(vd)
        w["t2d"] = np.isin(np.arange(V), used)
    return w


def _llama(**over) -> dict:
    d = {**DRAFTER, **over}
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "num_hidden_layers": 1, "vocab_size": V, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            **{k: v for k, v in d.items() if k != "draft_vocab_size"}}


def write_eagle3(path, weights: dict, *, eagle_config_ids=None, **over) -> Path:
    """Official/SpecForge layout; eagle_config_ids are SpecForge's "output of layer k" ids."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**_llama(**over), "draft_vocab_size": over.get("draft_vocab_size", DRAFTER["draft_vocab_size"])}
    if eagle_config_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(eagle_config_ids)}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


def write_speculators(path, weights: dict, *, aux_ids=(2, 3, 3), norm_before_residual=False, norm_output=False,
                      **over) -> Path:
    """vLLM speculators layout: `layers.0.*`, transformer_layer_config, ids used as is."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "model_type": "speculators",
           "transformer_layer_config": _llama(**over),
           "draft_vocab_size": over.get("draft_vocab_size", DRAFTER["draft_vocab_size"]),
           "norm_before_residual": norm_before_residual, "norm_before_fc": "input_norm.weight" in weights,
           "fc_norm": False, "norm_output": norm_output, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": list(aux_ids),
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}}
    (path / "config.json").write_text(json.dumps(cfg))
    renamed = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): np.ascontiguousarray(v)
               for k, v in weights.items()}
    save_file(renamed, str(path / "model.safetensors"))
    return path


def write_pickle_only(path, weights: dict) -> Path:
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**_llama(), "draft_vocab_size": DRAFTER["draft_vocab_size"]}))
    torch.save({k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}, path / "pytorch_model.bin")
    return path
