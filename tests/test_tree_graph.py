"""The step-graph builder's tree mode (the verify graph of speculative decoding): one pass over a
token tree gives, for every node, transformers' logits after the prompt plus that node's root
path, and the per-node commit tensors rebuild the recurrent state at the path's end."""
import copy

import numpy as np
import onnx
import onnxruntime as ort
import torch

import hybrid_npu
from hybrid_npu.export.checkpoint import read_checkpoint
from hybrid_npu.export.step_graph import ANY_COUNT_MAX, Kind, StepSpec, build_step_graph
from hybrid_npu.export.weights import WeightPlan
from hybrid_npu.kernels.delta_rule import commit_state_ref
from hybrid_npu.runtime.pipeline import Pipeline
from hybrid_npu.runtime.speculative import Tree, tree_feed

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6, 4]


def test_tree_verify_graph_matches_transformers_on_every_path(text_tied, tmp_path):
    ck = read_checkpoint(text_tied.src)
    cfg = ck.config
    n = len(PARENTS)
    plan = WeightPlan(ck.load)
    gb = build_step_graph(cfg, plan, StepSpec(Kind.VERIFY, n), "verify")
    placements = plan.write(tmp_path / "weights.bin")
    onnx.save_model(gb.model(placements), tmp_path / "verify.onnx")
    sess = ort.InferenceSession(str(tmp_path / "verify.onnx"), providers=["CPUExecutionProvider"])

    engine = hybrid_npu.load_engine(text_tied.out)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 300, 11)]
    engine.prefill_logits(prompt)
    state = engine.state
    tree_tokens = [int(t) for t in np.random.default_rng(1).integers(0, 300, n)]
    tree = Tree(tree_tokens, PARENTS)
    node_paths = tree.paths()
    feed = tree_feed(cfg, state, tree)
    out = Pipeline([sess], "CPU").run(feed)  # it feeds the state units (1 on the CPU)

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


def test_cpu_verify_graph_runs_trees_of_each_size_and_matches_transformers(text_tied):
    """The export's CPU verify graph (one core for any 2-16 nodes, its masked solve in two blocks,
    under a single If per layer; padded cores for the larger sizes under further Ifs): trees of 2-8
    nodes (the solve's first block), 9, 13 and 16 (its second block too), of a count between two sizes
    (padded up to the next inside the graph: 16 + 1 .. the full size) and trees the host pads
    (older exports' way) give transformers' logits on every real node's path, and the commit tensors
    rebuild its recurrent state. The reference runs in float64: our graphs are fp32 end to end
    (prefill through ORT's LinearAttention, verify through the masked form), and fp32 rounding alone
    moves these logits (|logit| ~ 7) by up to ~2e-4 on some paths (transformers' own fp32 run: 1.9e-4)."""
    ref64 = copy.deepcopy(text_tied.ref).double()
    engine = hybrid_npu.load_engine(text_tied.out)
    sizes = list(engine.manifest.cpu_verify.sizes)
    assert sizes[:7] == list(range(2, 9)) and sizes[-1] == engine.manifest.verify.n > 9
    graph = onnx.load(str(engine.path / engine.manifest.cpu_verify.file), load_external_data=False)
    ifs = [n for n in graph.graph.node if n.op_type == "If"]
    assert ifs and sizes[-1] > ANY_COUNT_MAX == 16
    for node in ifs:  # a 2-16 node call passes one If a layer
        small = next(a.g for a in node.attribute if a.name == "then_branch")
        assert not any(n.op_type == "If" for n in small.node) and len(small.node) > 20
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 300, 11)]
    cfg = engine.config
    rng = np.random.default_rng(2)
    for real_parents, size in (([-1, 0], 2), ([-1, 0, 1], 3), ([-1, 0, 1], 4), ([-1, 0, 0, 1, 2], 5),
                               ([-1, 0, 1, 2, 3, 4, 5], 7), (PARENTS, 9), (list(range(-1, 12)), 13), (PARENTS, 16),
                               (list(range(-1, 15)), 16), (list(range(-1, 16)), 17),
                               ([-1, 0, 1, 2, 3, 4, 5], 8), (PARENTS, sizes[-1])):
        engine.prefill_logits(prompt)
        draft = [int(t) for t in rng.integers(0, 300, len(real_parents) - 1)]
        tree, n_real = Tree.from_draft(int(rng.integers(0, 300)), draft, [p - 1 for p in real_parents[1:]], size)
        assert len(tree.tokens) == size
        out = engine.pipelines["verify"].run(tree_feed(cfg, engine.state, tree))
        assert out["logits"].shape[0] == size
        for m, path in enumerate(tree.paths()[:n_real]):
            seq = prompt + [tree.tokens[j] for j in path]
            with torch.no_grad():
                hf = ref64(torch.tensor([seq]), use_cache=True)
            assert np.abs(out["logits"][m] - hf.logits[0, -1].numpy()).max() <= 2e-4
            for i in engine.state.gdn:
                commit = (out[f"commit_k.{i}"], out[f"commit_u.{i}"], out[f"commit_g.{i}"])
                rebuilt = commit_state_ref(engine.state.gdn[i].recurrent, commit, path)
                want = hf.past_key_values.layers[i].recurrent_states[0][0].numpy()
                assert np.abs(rebuilt - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
