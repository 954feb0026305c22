"""Training data for an EAGLE-3 drafter: the target's own greedy continuations of corpus prompts
(docs/eagle3-drafter.md: SpecForge regenerates responses with the target), with the tap features
and the target's final hidden state of every position, captured while generating.

Taps: the residual stream ENTERING layers (2, L//2, L-3) (hybrid_npu ModelConfig.tap_layers, the
`tap.{j}` outputs of our graphs); with output_hidden_states, hidden_states[k] is that stream for
layer k (hidden_states[0] = the embeddings).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import stdlib_corpus


@dataclass
class Sequence:
    ids: np.ndarray       # int64 [n]: prompt + generation
    prompt_len: int
    taps: np.ndarray      # float32 [n, nT·H]: taps low | mid | high
    final: np.ndarray     # float32 [n, H]: the target's last hidden state after its final norm (lm_head input)
    argmax: np.ndarray    # int64 [n]: the target's greedy next token after each position (full vocabulary)


def prompt_ids(doc, tok, rng, max_prompt: int) -> list[int] | None:
    """Chat kinds: the user turn rendered for a reply; code: the source up to a random line,
    its last max_prompt tokens. None when a chat prompt does not fit."""
    if doc.kind != "code":
        ids = tok.encode(stdlib_corpus.chat_text(doc.prompt)).ids
        return ids if len(ids) <= max_prompt else None
    lines = doc.text.splitlines(keepends=True)
    if len(lines) < 2:
        return None
    cut = int(rng.integers(1, len(lines)))
    ids = tok.encode("".join(lines[:cut])).ids[-max_prompt:]
    return ids if len(ids) >= 4 else None


def make_prompts(docs, tok, n: int, seed: int, max_prompt: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in rng.permutation(len(docs)):
        if len(out) == n:
            break
        ids = prompt_ids(docs[i], tok, rng, max_prompt)
        if ids:
            out.append(ids)
    return out


def context_prompts(docs, tok, n: int, seed: int, max_context: int, min_context: int = 256) -> list[list[int]]:
    """Long contexts, as a reader meets them (bench_speculative's context rows): a stretch of source,
    log-uniform in [min_context, max_context] tokens, from the documents' code laid end to end; half
    of them end in a chat turn of the same documents (a question after a document), half mid-source."""
    rng = np.random.default_rng(seed)
    code = [d for d in docs if d.kind == "code"]
    chats = [d for d in docs if d.kind != "code"]
    stream = np.concatenate([np.asarray(e.ids, np.int64) for e in tok.encode_batch([d.text for d in code])]
                            or [np.zeros(0, np.int64)])   # in the documents' order; starts are random
    top = min(max_context, len(stream) - 1)   # a small corpus: contexts as long as it holds
    if top < 16:
        raise ValueError(f"the documents hold {len(stream)} tokens of source; long contexts need more")
    out = []
    for _ in range(n):
        length = int(np.exp(rng.uniform(np.log(min(min_context, top)), np.log(top))))
        ask = (tok.encode(stdlib_corpus.chat_text(chats[rng.integers(len(chats))].prompt)).ids
               if chats and rng.random() < 0.5 else [])
        start = int(rng.integers(0, len(stream) - length))
        out.append([int(t) for t in stream[start: start + max(length - len(ask), 1)]] + ask)
    return out


@torch.inference_mode()
def generate(model, prompts: list[list[int]], gen_tokens: int, batch: int, pad_id: int, eos_ids, taps,
             device="cpu", keep_prompt: int | None = None) -> list[Sequence]:
    """Greedy continuations with their features, in the prompts' order. Batched by prompt length with
    left padding (GDN layers zero padded positions; RoPE only sees relative positions). The hidden
    states come from the generation passes themselves (prefill + cached decode steps): a second
    full-sequence pass would double the cost (measured: the torch GDN prefill path runs at ~250
    tokens/s on this CPU). The last sampled token has none, so each sequence ends one token
    earlier: prompt + generation up to (and including) the first end-of-sequence token.
    keep_prompt: keep only the last keep_prompt prompt positions (a long context's features are
    computed over all of it; a drafter reading a window of rows needs only that many)."""
    eos = set(eos_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list = [None] * len(prompts)
    for s in range(0, len(order), batch):
        idx = order[s: s + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=gen_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=list(eos),
                             output_hidden_states=True, return_dict_in_generate=True)
        # hidden_states: one tuple per generation pass (L+1 tensors, [B, positions, H]); [0] = the
        # embeddings, [k] = the stream entering layer k, [-1] = after the final norm
        steps = out.hidden_states
        fused = torch.cat([torch.cat([hs[t] for t in taps], -1) for hs in steps], 1).float()   # [B, width+G-1, nT·H]
        final = torch.cat([hs[-1] for hs in steps], 1).float()
        argmax = model.lm_head(final).argmax(-1)
        for r, i in enumerate(idx):
            p = len(prompts[i])
            new = out.sequences[r, width:].tolist()
            cut = next((j for j, t in enumerate(new) if t in eos), len(new) - 1)
            n = p + min(cut + 1, len(new) - 1)          # tokens that have hidden states
            skip = max(p - keep_prompt, 0) if keep_prompt else 0
            rows = slice(width - p + skip, width - p + n)
            seq = (list(prompts[i]) + new)[skip:n]
            results[i] = Sequence(np.asarray(seq, np.int64), p - skip, fused[r, rows].cpu().numpy(),
                                  final[r, rows].cpu().numpy(), argmax[r, rows].cpu().numpy().astype(np.int64))
    return results


def draft_vocabulary(seqs: list[Sequence], vocab_size: int, draft_vocab: int) -> np.ndarray:
    """The draft vocabulary (docs/eagle3-drafter.md): the draft_vocab most frequent tokens of the data
    (ties and unseen tokens by lower id), sorted ascending; used[i] is draft id i's target id."""
    counts = np.zeros(vocab_size, np.int64)
    for s in seqs:
        np.add.at(counts, s.ids, 1)
    return np.sort(np.argsort(-counts, kind="stable")[:draft_vocab]).astype(np.int64)
