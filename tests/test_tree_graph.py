"""The step-graph builder's tree mode (the verify graph of speculative decoding): one pass over a
token tree gives, for every node, transformers' logits after the prompt plus that node's root
path, and the per-node commit tensors rebuild the recurrent state at the path's end."""
import numpy as np
import onnx
import onnxruntime as ort
import torch

import hybrid_npu
from hybrid_npu.export.checkpoint import read_checkpoint
from hybrid_npu.export.step_graph import StepSpec, build_step_graph
from hybrid_npu.export.weights import WeightPlan
from hybrid_npu.kernels.attention import MASKED
from hybrid_npu.kernels.conv import tree_conv_select
from hybrid_npu.kernels.delta_rule import commit_state_ref
from hybrid_npu.kernels.rope import rope_tables

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6, 4]


def paths(parents):
    out = []
    for m in range(len(parents)):
        p, path = m, []
        while p >= 0:
            path.append(p)
            p = parents[p]
        out.append(path[::-1])
    return out


def test_tree_verify_graph_matches_transformers_on_every_path(text_tied, tmp_path):
    ck = read_checkpoint(text_tied.src)
    cfg = ck.config
    n = len(PARENTS)
    plan = WeightPlan(ck.load)
    gb = build_step_graph(cfg, plan, StepSpec(n=n, tree=True, all_logits=True), "verify")
    placements = plan.write(tmp_path / "weights.bin")
    onnx.save_model(gb.model(placements), tmp_path / "verify.onnx")
    sess = ort.InferenceSession(str(tmp_path / "verify.onnx"), providers=["CPUExecutionProvider"])

    engine = hybrid_npu.load(text_tied.out)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 300, 11)]
    engine.prefill_logits(prompt)
    state, pos = engine.state, engine.state.position
    tree_tokens = [int(t) for t in np.random.default_rng(1).integers(0, 300, n)]
    node_paths = paths(PARENTS)
    M = np.zeros((n, n), np.float32)
    for i, path in enumerate(node_paths):
        M[i, path] = 1
    depth = np.array([len(p) - 1 for p in node_paths])
    cos, sin = rope_tables(pos + depth, cfg.rotary_dim, cfg.rope_theta)
    cap = state.capacity
    mask = np.full((n, cap + n), MASKED, np.float32)
    mask[:, :pos] = 0
    mask[:, cap:] = np.where(M > 0, 0.0, MASKED)
    feed = {"input_ids": np.array(tree_tokens, np.int64), "token_valid": np.ones(n, np.float32),
            "rope_cos": cos, "rope_sin": sin, "attn_mask": mask, "tree_mask": M,
            "conv_tree_select": tree_conv_select(PARENTS, cfg.linear_conv_kernel_dim)}
    for i, layer in state.gdn.items():
        feed[f"conv_state.{i}"], feed[f"recurrent_state.{i}"] = layer.conv, layer.recurrent
    for i, layer in state.attention.items():
        feed[f"past_key.{i}"], feed[f"past_value.{i}"] = layer.key, layer.value
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(names, feed)))

    for m, path in enumerate(node_paths):
        seq = prompt + [tree_tokens[j] for j in path]
        with torch.no_grad():
            hf = text_tied.ref(torch.tensor([seq]), use_cache=True)
        assert np.abs(out["logits"][m] - hf.logits[0, -1].numpy()).max() <= 1e-4
        for i in state.gdn:  # commit along the path = transformers' recurrent state after it
            commit = (out[f"commit_k.{i}"], out[f"commit_u.{i}"], out[f"commit_g.{i}"])
            rebuilt = commit_state_ref(state.gdn[i].recurrent, commit, path)
            want = hf.past_key_values.layers[i].recurrent_states[0][0].numpy()
            assert np.abs(rebuilt - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
