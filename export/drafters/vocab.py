"""Which tokens a trimmed MTP head drafts (`export-hybrid --drafter mtp --mtp-vocab N`).

The MTP head's lm_head is the target's, 248,320 rows on every released Qwen3.5: each draft step
is a full-vocabulary product, ~0.2 of a decode step at 0.8B (docs/mtp-drafter.md). Drafting only
the N most frequent tokens cuts that product N/V-fold and stays lossless, since the target verifies
every draft: a token outside the N is never proposed, and the round then emits the target's own
token instead (FR-Spec's frequency-ranked draft vocabulary; FastMTP and the llama.cpp `d2t` MTP
heads trim Qwen3.5's 248k to 32k the same way).

Frequent by what: by counts over a text the user gives (`--mtp-vocab-text`: their own kind of
text), else by the tokenizer's own order. A byte-level BPE numbers its tokens in merge order, and
a merge is learned when its pair is the most frequent one left in the tokenizer's training text,
so low ids are common ones, but only within one training run: Qwen3.5's vocabulary puts its
Chinese tokens after the base vocabulary (all above id 95,000), so id order never keeps them.
Hence no trim by default, and a warning when one comes without a text (trim_hints). The
tokenizer's added tokens (<|im_end|>, <think>, the tool-call markers: what a chat reply is made
of) and the model's stop tokens are always kept.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hybrid_npu.errors import UserError
from hybrid_npu.safe_files import TOKENIZER_BYTES, read_json

from ..text_input import read_text_input, text_tokenizer

MIN_DRAFT_VOCAB = 2
HINT_ABOVE = 65536  # a head over more tokens than this drafts slowly at real size: the export says so


def draft_vocab_size(vocab_size: int, asked: int | None) -> int | None:
    """How many tokens the MTP head drafts: `asked` (--mtp-vocab), None or 0: all of them (no trim).
    Not trimmed by default: which tokens are frequent depends on the user's language, and no order
    of the ids says it (Qwen3.5's Chinese tokens all lie above id 95,000, docs/mtp-drafter.md)."""
    return None if not asked else asked


def trim_hints(vocab_size: int, asked: int | None, text) -> str | None:
    """What the export should tell the user about the MTP head's vocabulary, if anything."""
    if not asked and vocab_size > HINT_ABOVE:
        return (f"the MTP head drafts over all {vocab_size:,} tokens, ~0.4 of a decode step a draft at 0.8B; "
                "--mtp-vocab 32768 --mtp-vocab-text SAMPLE.txt (text like yours) makes a draft ~4x cheaper")
    if asked and text is None and vocab_size > HINT_ABOVE:
        return (f"--mtp-vocab {asked} without --mtp-vocab-text keeps the lowest ids, which favour English and "
                "code (Qwen3.5's Chinese tokens lie above id 95,000); give a sample of your text to count them")
    return None


def added_token_ids(tokenizer_json: Path) -> set[int]:
    """The ids of the tokenizer's added tokens (special and not): tokenizer.json's "added_tokens"."""
    try:
        data = read_json(Path(tokenizer_json), TOKENIZER_BYTES, "tokenizer.json", "", max_depth=None)
    except (OSError, UserError):
        return set()
    added = data.get("added_tokens") if isinstance(data, dict) else None
    return {int(t["id"]) for t in added or [] if isinstance(t, dict) and type(t.get("id")) is int}


def token_counts(text_file: Path, tokenizer_json: Path, vocab_size: int) -> np.ndarray:
    """How often each id occurs in the UTF-8 text file, tokenized by the export's tokenizer."""
    text = read_text_input("--mtp-vocab-text", text_file, "a UTF-8 text of the kind you will chat about, in its "
                           "languages")
    tokenizer = text_tokenizer("--mtp-vocab-text", tokenizer_json)
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64)
    return np.bincount(ids[ids < vocab_size], minlength=vocab_size)


def choose_draft_vocab(vocab_size: int, n: int, always: set[int], counts: np.ndarray | None = None) -> np.ndarray:
    """The n target ids a trimmed head drafts, ascending: every id in `always` (added and stop
    tokens), then the most frequent by `counts` (ties and unseen ids by id), or by id (merge order)
    without counts."""
    if not MIN_DRAFT_VOCAB <= n < vocab_size:
        raise UserError(f"--mtp-vocab {n}: give a draft vocabulary between {MIN_DRAFT_VOCAB} and "
                        f"{vocab_size - 1} tokens (the target has {vocab_size}; leave it out to draft over all "
                        "of them)")
    always = sorted(i for i in always if 0 <= i < vocab_size)
    if len(always) > n:
        raise UserError(f"--mtp-vocab {n} is smaller than the {len(always)} added and stop tokens a chat reply "
                        f"needs; give at least {len(always)}")
    order = np.arange(vocab_size) if counts is None else np.lexsort((np.arange(vocab_size), -counts))
    chosen = np.zeros(vocab_size, bool)
    chosen[always] = True
    rest = order[~chosen[order]][: n - len(always)]
    chosen[rest] = True
    return np.flatnonzero(chosen).astype(np.int64)
