"""Single graphs of real-size Qwen3.5 models with random weights, built without transformers
(the exporter's own builder over a random weight source), for NPU coverage and size checks."""
from pathlib import Path

import numpy as np
import onnx

from hybrid_npu.config import FULL, LINEAR, ModelConfig
from hybrid_npu.export.checkpoint import expected_shapes
from hybrid_npu.export.step_graph import StepSpec, build_step_graph
from hybrid_npu.export.weights import WeightPlan


def qwen35_text_config(name: str = "0.8B") -> ModelConfig:
    """docs/qwen35-model.md (real release configs, text part)."""
    h, layers, nh, nkv, hv, inter = {"0.8B": (1024, 24, 8, 2, 16, 3584), "4B": (2560, 32, 16, 4, 32, 9216)}[name]
    return ModelConfig(vocab_size=248320, hidden_size=h, intermediate_size=inter,
                       layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
                       num_attention_heads=nh, num_key_value_heads=nkv, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=hv, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4, rope_theta=1e7, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
                       tie_word_embeddings=True)


def random_source(cfg: ModelConfig, seed: int = 0):
    shapes = expected_shapes(cfg)

    def load(name):
        r = np.random.default_rng(abs(hash(name)) % 2**32 + seed)
        return (r.standard_normal(shapes[name], dtype=np.float32) * 0.02).astype(np.float32)
    return load


def write_graph(cfg: ModelConfig, spec: StepSpec, out_dir: Path, name: str, quantizable: bool = False) -> Path:
    """quantizable: the layout export/npu/qdq.py quantises (gates apart, untied head)."""
    plan = WeightPlan(random_source(cfg), quantizable=quantizable)
    g = build_step_graph(cfg, plan, spec, name)
    out_dir.mkdir(parents=True, exist_ok=True)
    placements = plan.write(out_dir / f"{name}.weights.bin")
    path = out_dir / f"{name}.onnx"
    onnx.save_model(g.model(placements), path)
    return path
