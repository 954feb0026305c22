"""Plain numpy reference of the MTP head (export/drafters/mtp.py's graphs, step by step), built from
the kernels' own references; tests hold the ONNX graphs to it and it to transformers' layers."""
from __future__ import annotations

import numpy as np

from hybrid_npu.kernels.attention import gqa_attention_ref
from hybrid_npu.kernels.norms import rmsnorm_1p_ref
from hybrid_npu.kernels.rope import partial_rope_ref, rope_tables

from .mtp import A, MLP, P, MtpConfig


def mtp_hidden_in_ref(w: dict, c: MtpConfig, residual: np.ndarray) -> np.ndarray:
    """tap.{L} -> the target's post-norm hidden (its final norm)."""
    return rmsnorm_1p_ref(residual, w["norm.weight"], c.rms_norm_eps)


def mtp_step_ref(w: dict, c: MtpConfig, hidden: np.ndarray, ids, positions, past_key: np.ndarray,
                 past_value: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """One MTP step over N rows: hidden [N, H] (post-norm target hidden, or a previous step's output),
    ids [N] the tokens paired with it, positions [N], past K/V [nKV, T, hd], mask [N, T + N] additive.
    Returns logits [N, V], hidden [N, H] (mtp.norm(x)), new_key/new_value [nKV, N, hd]."""
    nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    n = len(ids)
    e = rmsnorm_1p_ref(w["embed_tokens.weight"][np.asarray(ids)], w[P + "pre_fc_norm_embedding.weight"], eps)
    x = np.concatenate([e, rmsnorm_1p_ref(hidden, w[P + "pre_fc_norm_hidden.weight"], eps)], -1) @ w[P + "fc.weight"].T
    a = rmsnorm_1p_ref(x, w[P + "layers.0.input_layernorm.weight"], eps)
    qg = (a @ w[A + "q_proj.weight"].T).reshape(n, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, nh * hd)
    k = (a @ w[A + "k_proj.weight"].T).reshape(n, nkv, hd)
    v = (a @ w[A + "v_proj.weight"].T).reshape(n, nkv, hd)
    cos, sin = rope_tables(np.asarray(positions), c.rotary_dim, c.rope_theta)
    q = partial_rope_ref(rmsnorm_1p_ref(q, w[A + "q_norm.weight"], eps), cos, sin)
    k = partial_rope_ref(rmsnorm_1p_ref(k, w[A + "k_norm.weight"], eps), cos, sin)
    new_k, new_v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    keys, values = np.concatenate([past_key, new_k], 1), np.concatenate([past_value, new_v], 1)
    attn = gqa_attention_ref(q, keys, values, mask).reshape(n, nh * hd) * (1.0 / (1.0 + np.exp(-gate)))
    x = x + attn @ w[A + "o_proj.weight"].T
    m = rmsnorm_1p_ref(x, w[P + "layers.0.post_attention_layernorm.weight"], eps)
    g, u = m @ w[MLP + "gate_proj.weight"].T, m @ w[MLP + "up_proj.weight"].T
    x = x + (g / (1.0 + np.exp(-g)) * u) @ w[MLP + "down_proj.weight"].T
    out = rmsnorm_1p_ref(x, w[P + "norm.weight"], eps)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["embed_tokens.weight"]  # tied
    return {"logits": out @ head.T, "hidden": out, "new_key": new_k, "new_value": new_v}
