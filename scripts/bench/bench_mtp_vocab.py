"""What trimming the MTP head's draft vocabulary costs in acceptance (export-hybrid --mtp-vocab N),
on the embedded model's MTP head: a depth-6 chain every step over held-out chat prompts, greedy,
with the head drafting over the whole vocabulary or only N tokens, chosen by the tokenizer's merge
order (the default) or by their counts in a text (--mtp-vocab-text; here the training split of the
corpus the model was trained on, never the held-out prompts). Every output is checked equal to
plain decoding. Prints one JSON object.

The trimmed head is emulated on the shipped one: its logits outside the N tokens are set to -inf,
which drafts exactly what the trimmed export drafts (its logits are the full head's rows at those
tokens: tests/test_mtp_draft_vocab.py), without re-exporting from the training checkpoint.

    python scripts/bench/bench_mtp_vocab.py [--sizes 512,1024,2048] [--prompts 16] [--new 96] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # stdlib_corpus: the corpus the trainers use
import stdlib_corpus  # noqa: E402
from bench_speculative import held_out_prompts, machine  # noqa: E402
import harness  # noqa: E402  (one JSON object on stdout and in --out, machine and commit recorded)

COUNT_CHARS = 4_000_000  # of training text to count tokens over


def training_counts(tokenizer, vocab_size: int) -> np.ndarray:
    """Token counts over the first COUNT_CHARS of the training split (documents in name order)."""
    parts, size = [], 0
    for d in sorted(stdlib_corpus.documents(), key=lambda d: d.name):
        if not d.held_out:
            parts.append(stdlib_corpus.training_text(d))
            size += len(parts[-1])
            if size >= COUNT_CHARS:
                break
    ids = np.asarray(tokenizer.encode("".join(parts)[:COUNT_CHARS], add_special_tokens=False).ids, np.int64)
    return np.bincount(ids, minlength=vocab_size)


def masked(drafter, keep: np.ndarray | None) -> None:
    """Make the drafter draft only `keep` (None: everything), as the trimmed head would: every call of
    its graph (_call: the observe's, the tree's and the chain's levels) has the rest's logits masked."""
    run = type(drafter)._call
    if keep is None:
        drafter._call = run.__get__(drafter)
        return
    outside = np.ones(len(drafter.draft_to_target), bool)
    outside[keep] = False

    def run_masked(*args, **kw):
        out = run(drafter, *args, **kw)
        out["logits"][:, outside] = -np.inf
        return out
    drafter._call = run_masked


def main() -> int:
    from hybrid_npu.cli_common import OneLineParser

    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512,1024,2048")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import hybrid_npu
    from hybrid_npu.export.drafters.vocab import added_token_ids, choose_draft_vocab

    model = hybrid_npu.default_model()
    engine = hybrid_npu.load_engine(model, drafter="mtp", threads=args.threads)
    vocab = engine.config.vocab_size
    always = added_token_ids(model / "tokenizer.json") | set(engine.config.eos_token_ids)
    counts = training_counts(engine.tokenizer, vocab)
    variants = {"full": None}
    for n in [int(s) for s in args.sizes.split(",")]:
        variants[f"merge_order_{n}"] = choose_draft_vocab(vocab, n, always)
        variants[f"text_counts_{n}"] = choose_draft_vocab(vocab, n, always, counts)
    prompts = [engine.tokenizer.encode(p, add_special_tokens=False).ids for p in held_out_prompts(args.prompts)]
    plain = [engine.generate(p, args.new, speculative=False) for p in prompts]
    engine.adaptive, engine.draft_shape = False, {"top_k": 1, "depth": 6, "total_tokens": 6}
    rows = {}
    for name, keep in variants.items():
        masked(engine.drafter, keep)
        rounds = accepted = mismatches = 0
        for p, want in zip(prompts, plain):
            got = engine.generate(p, args.new)
            mismatches += got != want
            rounds += engine.last_stats["rounds"]
            accepted += round((engine.last_stats["acceptance_length"] - 1) * engine.last_stats["rounds"])
        covered = 1.0 if keep is None else float(np.isin(np.concatenate(plain), keep).mean())
        rows[name] = {"draft_vocab": vocab if keep is None else len(keep), "rounds": rounds,
                      "acceptance_length": round((accepted + rounds) / max(rounds, 1), 3),
                      "reply_tokens_in_vocab": round(covered, 4), "mismatches": mismatches}
        print(name, rows[name], file=sys.stderr, flush=True)
    harness.emit({"machine": machine(), "model": "embedded default model, its MTP head", "vocab": vocab,
                     "prompts": args.prompts, "new_tokens": args.new, "shape": "chain depth 6, every step",
                     "counted_over": f"first {COUNT_CHARS:,} characters of the training split", "variants": rows},
                    args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
