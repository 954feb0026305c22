"""Checkpoints with massive activations planted, as real LLMs carry them (Sun et al. 2024, arXiv
2402.17762): a few residual-stream channels at hundreds to tens of thousands, for the first token
and separator tokens. Planted in the embedding rows, so the residual stream carries them from
layer 0 on; the head is untied, so the logits stay on the fixture's usual scale and measure the
damage an outlier does on its way through the layers."""
from __future__ import annotations

from pathlib import Path

import fixtures
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
    import numpy as np

    r = np.random.default_rng(seed)
    ids = [int(t) for t in r.integers(0, 300, n)]
    ids[0] = fixtures.ENDOFTEXT_ID
    for i in range(5, n, 7):
        ids[i] = OUTLIER_TOKENS[1 + (i // 7) % 3]
    return ids
