"""Checkpoints with massive activations planted, as real LLMs carry them (Sun et al. 2024, arXiv
2402.17762): a few residual-stream channels at hundreds to tens of thousands, for the first token
and separator tokens. Planted in the embedding rows, so the residual stream carries them from
layer 0 on; the head is untied, so the logits stay on the fixture's usual scale and measure the
damage an outlier does on its way through the layers. Also the long low-decay GDN case whose
readout passes fp16 (long_low_decay_case) and the GDN core graph it runs through."""
from __future__ import annotations

from pathlib import Path

import fixtures
import numpy as np
import torch

# (channel, magnitude): several magnitudes on a handful of channels, signs mixed
PLANTED = ((3, 300.0), (17, -2500.0), (30, 20000.0), (41, 900.0))
# the tokens that carry them: end-of-text (the first token of a document) and three separators
OUTLIER_TOKENS = (fixtures.ENDOFTEXT_ID, ord("\n"), ord(" "), ord("."))


def make_outlier_lm(planted=PLANTED, tokens=OUTLIER_TOKENS, seed=7, **cfg_overrides):
    """The tiny random model (untied head) with embedding rows `tokens` (None: every row) set to
    the planted values on the planted channels."""
    model = fixtures.make_causal_lm(seed=seed, tie=False, **cfg_overrides)
    rows = slice(None) if tokens is None else list(tokens)
    with torch.no_grad():
        for channel, magnitude in planted:
            model.model.embed_tokens.weight[rows, channel] = magnitude
    return model


def write_outlier_checkpoint(dir, planted=PLANTED, tokens=OUTLIER_TOKENS, seed=7, **cfg_overrides):
    dir_ = Path(dir)
    dir_.mkdir(parents=True, exist_ok=True)
    model = make_outlier_lm(planted, tokens, seed, **cfg_overrides)
    model.save_pretrained(dir_, safe_serialization=True)
    fixtures._write_generation_config(dir_)
    fixtures.write_tokenizer_files(dir_)
    return model


def outlier_prompt(n: int, seed: int = 0) -> list[int]:
    """n random ids opening with end-of-text and with a separator every ~7 tokens."""
    r = np.random.default_rng(seed)
    ids = [int(t) for t in r.integers(0, 300, n)]
    ids[0] = fixtures.ENDOFTEXT_ID
    for i in range(5, n, 7):
        ids[i] = OUTLIER_TOKENS[1 + (i // 7) % 3]
    return ids


def long_low_decay_case(n=8192, hk=1, hv=2, dk=16, dv=16):
    """8192 tokens, decay e^-1e-6 per token, β 0.9, |v| <= 2e4 written through keys in half the key
    space, and a state from earlier context holding up to 3e5 in the other half (it persists: no
    key erases it, the decay barely does). The float64 recurrence's readout passes 65,504."""
    r = np.random.default_rng(0)
    k = r.standard_normal((n, hk, dk))
    k[..., dk // 2:] = 0
    q = r.standard_normal((n, hk, dk))
    v = 2e4 * np.tanh(r.standard_normal((n, hv, dv)))
    g_in, beta = np.full((n, hv), -1e-6), np.full((n, hv), 0.9)
    S0 = np.zeros((hv, dk, dv))
    S0[:, dk // 2:] = 3e5 * np.tanh(r.standard_normal((hv, dk - dk // 2, dv)))
    z = r.standard_normal((n, hv, dv))
    w = 1 + 0.3 * r.standard_normal(dv)
    return q, k, v, g_in, beta, S0, z, w


def gdn_layer_core(c, hk, hv, dk, dv, tree=False):
    """The NPU prefill's GDN core after the conv, as export/step_graph.py wires it: the chunked delta
    rule with the state in host-chosen units (recurrent_scale.0) and the gated norm taking them.
    tree: the verify form (tree_mask input; commit_k/u/g out instead of the state)."""
    from hybrid_npu.kernels import delta_rule
    from hybrid_npu.kernels.graph import GraphBuilder
    from hybrid_npu.kernels.norms import emit_gated_rmsnorm

    gb = GraphBuilder("gdn_long")
    ins = [gb.input(name, np.float32, shape) for name, shape in
           (("q", [c, hk, dk]), ("k", [c, hk, dk]), ("v", [c, hv, dv]), ("g", [c, hv]), ("beta", [c, hv]),
            ("recurrent_state.0", [hv, dk, dv]))]
    z, w = gb.input("z", np.float32, [c, hv, dv]), gb.input("w", np.float32, [dv])
    unit = gb.reshape(gb.input("recurrent_scale.0", np.float32, [hv]), [hv, 1, 1])
    if tree:
        m = gb.input("tree_mask", np.float32, [c, c])
        masks = (m, gb.transpose(m, [1, 0]), gb.op("Mul", m, gb.const(1 - np.eye(c, dtype=np.float32))))
    else:
        causal = np.tril(np.ones((c, c), np.float32))
        masks = (gb.const(causal), gb.const(causal.T), gb.const(np.tril(causal, -1)))
    o, s_after, commit = delta_rule.emit_gated_delta(gb, *ins, *masks, n=c, hk=hk, hv=hv, dk=dk, dv=dv,
                                                     chain_state=not tree, state_unit=unit)
    ru = gb.op("Reciprocal", gb.op("Sqrt", gb.reshape(unit, [hv, 1])))
    eps_scale = gb.op("Mul", gb.op("Mul", ru, ru), gb.op("Mul", ru, ru))
    gb.output(emit_gated_rmsnorm(gb, o, z, w, 1e-6, eps_scale), "normed", np.float32, [c, hv, dv])
    if tree:
        for name, t, shape in zip(("commit_k.0", "commit_u.0", "commit_g.0"), commit, ([c, hv, dk], [c, hv, dv], [c, hv])):
            gb.output(t, name, np.float32, shape)
    else:
        gb.output(s_after, "recurrent_state_out.0", np.float32, [hv, dk, dv])
    return gb
