"""Token choice from logits: greedy, or temperature → top-k → top-p (transformers' order)."""
from __future__ import annotations

import numpy as np


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution actually sampled from (float64). Used by plain and speculative sampling alike."""
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = cum - p[order] < top_p  # smallest prefix whose mass reaches top_p (always keeps the top token)
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def choose(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    if temperature <= 0.0:
        return int(np.argmax(logits))
    p = filtered_probs(logits, temperature, top_k, top_p)
    return int(rng.choice(p.size, p=p))


def model_defaults(generation: dict) -> dict:
    """temperature/top_k/top_p when the caller gives none, from the model's generation_config
    (as recorded in the manifest): greedy unless it says do_sample, as transformers generates."""
    sample = bool(generation.get("do_sample", False))
    return {"temperature": float(generation.get("temperature", 1.0)) if sample else 0.0,
            "top_k": int(generation.get("top_k", 0)), "top_p": float(generation.get("top_p", 1.0))}
