"""Random-weight checkpoints with the real Qwen3.5 text configs (docs/qwen35-model.md), for
benchmarks. Built with transformers (the reference implementation), cached on disk.

    python scripts/random_checkpoint.py 0.8B /tmp/qwen35-0.8b-random
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(REAL_TEXT_CONFIGS))
    ap.add_argument("out")
    args = ap.parse_args()
    print(make_random_checkpoint(args.name, Path(args.out)))
