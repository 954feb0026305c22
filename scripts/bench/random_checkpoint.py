"""Random-weight checkpoints with the real Qwen3.5 text configs (docs/qwen35-model.md), for
benchmarks. Built with transformers (the reference implementation), cached on disk.

    python scripts/bench/random_checkpoint.py 0.8B /tmp/qwen35-0.8b-random
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REAL_TEXT_CONFIGS = {
    # H, layers (3:1 schedule), nH, nKV, Hv, I, tie -- Hk=16, Dk=Dv=128, hd=256, V=248320 for all
    "0.8B": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                 linear_num_value_heads=16, intermediate_size=3584, tie_word_embeddings=True),
    "2B": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
               linear_num_value_heads=16, intermediate_size=6144, tie_word_embeddings=True),
    "4B": dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
               linear_num_value_heads=32, intermediate_size=9216, tie_word_embeddings=True),
}
COMMON = dict(vocab_size=248320, head_dim=256, linear_num_key_heads=16, linear_key_head_dim=128,
              linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                               "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def model_config(name: str, dims: dict | None = None):
    """The runtime's ModelConfig of a real config `name` (or of `dims`, the same keys), without torch:
    what the plans and models that need no weights read."""
    from hybrid_npu.config import FULL, LINEAR, ModelConfig

    d = {**COMMON, **(dims if dims is not None else REAL_TEXT_CONFIGS[name])}
    rope = d["rope_parameters"]
    return ModelConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(d["num_hidden_layers"])),
        num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
        head_dim=d["head_dim"], linear_num_key_heads=d["linear_num_key_heads"],
        linear_num_value_heads=d["linear_num_value_heads"], linear_key_head_dim=d["linear_key_head_dim"],
        linear_value_head_dim=d["linear_value_head_dim"], linear_conv_kernel_dim=d["linear_conv_kernel_dim"],
        rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
        rms_norm_eps=d["rms_norm_eps"], tie_word_embeddings=d["tie_word_embeddings"],
        max_position_embeddings=d["max_position_embeddings"])


def text_config(name: str, **overrides):
    from transformers import Qwen3_5TextConfig

    kw = {**COMMON, **REAL_TEXT_CONFIGS[name], **overrides}
    return Qwen3_5TextConfig(**kw)


def make_random_checkpoint(name: str, out: Path, seed: int = 0, **overrides) -> Path:
    """Write (once) a random-weight Qwen3_5ForCausalLM with the real `name` config to `out`."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    out = Path(out)
    marker = out / "random_checkpoint.json"
    want = {"name": name, "seed": seed, "overrides": overrides}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(text_config(name, **overrides)).eval()
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(want))
    return out


def make_random_drafter(target_cfg, out: Path, draft_vocab: int, seed: int = 0) -> Path:
    """Write (once) a random EAGLE-3 drafter (official layout: midlayer.*, fc, norm, lm_head, d2t,
    t2d; the embedding is the target's) shaped for `target_cfg` (a hybrid_npu ModelConfig): one
    layer mirroring the target's attention and MLP sizes, as SpecForge's Qwen drafters do, over a
    draft vocabulary of the first `draft_vocab` target ids. For timing, not for drafting."""
    import numpy as np
    from safetensors.numpy import save_file

    out = Path(out)
    marker = out / "random_drafter.json"
    want = {"target_hidden": target_cfg.hidden_size, "draft_vocab": draft_vocab, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    c = target_cfg
    h, nh, nkv, hd, inter, V = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                c.intermediate_size, c.vocab_size)
    taps = list(c.tap_layers)
    rng = np.random.default_rng(seed)

    def mat(o, i):
        return (rng.standard_normal((o, i), np.float32) / np.sqrt(i)).astype(np.float32)

    m = "midlayer."
    w = {"fc.weight": mat(h, len(taps) * h), "norm.weight": np.ones(h, np.float32), "lm_head.weight": mat(draft_vocab, h),
         m + "input_layernorm.weight": np.ones(h, np.float32), m + "hidden_norm.weight": np.ones(h, np.float32),
         m + "post_attention_layernorm.weight": np.ones(h, np.float32),
         m + "self_attn.q_proj.weight": mat(nh * hd, 2 * h), m + "self_attn.k_proj.weight": mat(nkv * hd, 2 * h),
         m + "self_attn.v_proj.weight": mat(nkv * hd, 2 * h), m + "self_attn.o_proj.weight": mat(h, nh * hd),
         m + "mlp.gate_proj.weight": mat(inter, h), m + "mlp.up_proj.weight": mat(inter, h),
         m + "mlp.down_proj.weight": mat(h, inter)}
    used = np.arange(draft_vocab, dtype=np.int64)
    w["d2t"] = used - np.arange(draft_vocab)
    t2d = np.zeros(V, bool)
    t2d[used] = True
    w["t2d"] = t2d
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
           "num_hidden_layers": 1, "hidden_size": h, "num_attention_heads": nh, "num_key_value_heads": nkv,
           "head_dim": hd, "intermediate_size": inter, "vocab_size": V, "draft_vocab_size": draft_vocab,
           "target_hidden_size": h, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "tie_word_embeddings": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t - 1 for t in taps]}}
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    marker.write_text(json.dumps(want))
    return out


def make_random_mtp(target_cfg, out: Path, seed: int = 0) -> Path:
    """Write (once) a random MTP head (the released `mtp.*` names and shapes, one layer) for
    `target_cfg` (a hybrid_npu ModelConfig), as a directory export_mtp's `source` reads. For timing,
    not for drafting."""
    import numpy as np
    from safetensors.numpy import save_file

    from hybrid_npu.export.drafters.mtp import MtpConfig, expected_shapes

    out = Path(out)
    marker = out / "random_mtp.json"
    want = {"target_hidden": target_cfg.hidden_size, "vocab": target_cfg.vocab_size, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    rng = np.random.default_rng(seed)
    w = {name: (np.zeros(shape, np.float32) if len(shape) == 1  # zero-centred norms: scale 1
                else (rng.standard_normal(shape, np.float32) / np.sqrt(shape[1])).astype(np.float32))
         for name, shape in expected_shapes(MtpConfig.of(target_cfg)).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "mtp.safetensors"))
    marker.write_text(json.dumps(want))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(REAL_TEXT_CONFIGS))
    ap.add_argument("out")
    args = ap.parse_args()
    print(make_random_checkpoint(args.name, Path(args.out)))
