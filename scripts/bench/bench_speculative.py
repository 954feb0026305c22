"""Speculative decoding on the embedded model and its trained EAGLE-3 drafter: acceptance length
and decode tokens/s, plain vs speculative, (1) on held-out chat prompts, chain and tree, and
(2) after contexts of 24 to 12k tokens: held-out stdlib source, then a held-out chat prompt (a
long chat: the reply is a chat answer, where the drafter was trained), L tokens in all. Each
length runs --context-prompts such contexts (each its own stretch of source and its own prompt)
and a row's rate is over all their replies: one 96-token reply is ~0.3 s of decoding here, and a
ratio of two of them moved ±15-20% from run to run, too much to read "never slower" from.

Modes: "plain"; "adaptive" (the default: runtime/speculation/ decides per step whether and how
deep to draft); "always" (a round every step, the draft shape's full depth); "plain_again", plain
decoding a second time in each repeat: its ratio to "plain" is this run's noise floor (what a mode
that changed nothing would measure), against which a ratio near 1 is read. Runs of the modes
are interleaved, repeat by repeat, so load from other jobs on the machine hits all of them; each
row keeps its best repeat ("vs_plain": best against best), and also the median of its per-repeat
ratios to the plain run of the same repeat ("paired_vs_plain"; each repeat turns the
order of the modes by one): one 96-token reply here varies by
±15-20% from one run to the next even on a quiet machine, so a best-of ratio of a few repeats can
land anywhere in that band, where the median of the pairs is steadier. "own_vs_plain" reads
the same from inside the replies (vs_own_plain_steps, below), paired the same way. Every speculative output is checked against the plain greedy output
of the same prompt: mismatches are counted in the JSON over every repeat, each with where it parted
and by how much plain decoding preferred its own token there ("divergences"): a mismatch on a
near-tie (two logits within float rounding of each other, which the verify's and the decode step's
rounding may order differently) is "near_tie"; any other would be a bug (speculation is lossless).

    python scripts/bench/bench_speculative.py [--model EXPORT] [--prompts 16] [--new 128] [--threads 2]
        [--contexts 24,500,1500,6000,12000] [--context-new 96] [--context-prompts 4] [--repeats 2]
        [--drafter eagle3,mtp]
        [--modes adaptive,always] [--chain-depths 6,14] [--policy-b runs=0]

--policy-b: a second adaptive arm, "adaptive_b", on its own engine whose policy takes these
SpecPolicy settings (FIELD=NUMBER,...): a policy change paired against the default across the
contexts in sequence, the far-context switches between them included. The default's adaptive
arm then runs on an engine of its own too: on the engine that also runs plain, every step and the
trees, the same policy read 0.89× a second engine's in chat (an A/A run on a Zen 3, in
scripts/bench/results/bench_speculative/), which paired_vs_a would have counted as the policy's.

--drafter: the drafter kinds the export ships to compare side by side (one engine each, the same
target graphs; runs interleaved with plain ones); rows are then named KIND_SHAPE_MODE. Without it,
the export's default drafter and the row names as before.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # stdlib_corpus: the corpus the trainers use
import stdlib_corpus  # noqa: E402
import harness  # noqa: E402  (one JSON object on stdout and in --out, machine and commit recorded)
from harness import paired, rotated  # noqa: E402,F401  (the arm order turned each round, the median paired ratio)

# EAGLE-2 tree shapes (docs/eagle3-drafter.md); a chain is the tree of width 1. The chat rows' chain
# is the export's recorded one where it records a chain for that drafter (the embedded model: depth 14)
SHAPES = {"tree": {"top_k": 4, "depth": 6, "total_tokens": 31},
          "chain": {"top_k": 1, "depth": 6, "total_tokens": 6}}


def recorded_shape(manifest, kind: str | None) -> dict | None:
    """The draft shape the export records for its default drafter, where `kind` is that drafter."""
    d = manifest.drafter
    if d is None or d.draft_shape is None or kind not in (None, d.drafter_kind):
        return None
    return d.draft_shape.as_dict()


def chat_shapes(manifest, kind: str | None, chain_depths: list[int] | None) -> dict:
    """The chat rows' shapes for one drafter kind: the tree, and the chain the export records for it
    (else SHAPES["chain"]), or with --chain-depths one chain per depth ("chain6", "chain14", ...)."""
    shape = recorded_shape(manifest, kind)
    if chain_depths:
        chains = {f"chain{d}": {"top_k": 1, "depth": d, "total_tokens": d} for d in chain_depths}
    else:
        chains = {"chain": shape if shape and shape["top_k"] == 1 else SHAPES["chain"]}
    return {"tree": SHAPES["tree"], **chains}


def held_out_messages(n: int) -> list[str]:
    """The held-out chat prompts' user messages (never trained on), in a fixed order."""
    docs = [d for d in stdlib_corpus.documents() if d.held_out and d.kind != "code"]
    docs.sort(key=lambda d: d.name)
    return [d.prompt for d in docs[:n]]


def held_out_prompts(n: int) -> list[str]:
    return [stdlib_corpus.chat_text(m) for m in held_out_messages(n)]


def source_ids(tokenizer, n: int) -> list[int]:
    """n tokens of held-out stdlib source (the embedded model's own domain), documents in name order."""
    ids: list[int] = []
    for d in sorted(stdlib_corpus.documents(), key=lambda d: d.name):
        if d.kind == "code" and d.held_out:
            ids += tokenizer.encode(d.text).ids
            if len(ids) >= n:
                break
    return ids[:n]


def context_prompts(tokenizer, prompts: list[str], lengths: list[int], n: int) -> dict[int, list[list[int]]]:
    """length -> n token lists of that length: context i is held-out source from its own stretch (i x
    the longest length on), ending in held-out chat prompt i (cycled when n exceeds the prompts)."""
    if n < 1 or not prompts:
        raise ValueError("give at least one context and one prompt")
    span = max(lengths)
    text = source_ids(tokenizer, span * n)
    if len(text) < span * n:
        raise ValueError(f"{n} contexts of {span} tokens need {span * n} tokens of held-out source; "
                         f"there are {len(text)}: give fewer --context-prompts or shorter --contexts")
    asks = [tokenizer.encode(prompts[i % len(prompts)]).ids for i in range(n)]
    return {ctx: [(text[i * span: i * span + max(ctx - len(a), 0)] + a)[-ctx:] for i, a in enumerate(asks)]
            for ctx in lengths}


def set_mode(engine, mode: str, shape: dict) -> None:
    engine.adaptive = mode != "always"
    engine.draft_shape = dict(shape, total_tokens=min(shape["total_tokens"], engine.manifest.verify.n - 1))


# "vs_own_plain_steps": a reply's tokens at the median cost of its own plain decode steps, over its
# decode time: its rate against plain decoding measured in the same fraction of a second (a plain
# reply reads ~1 less the loop's own time). One 96-token reply's rate moved ±15-20% against a plain
# reply's run just before (a shared VM), where this moves only with what the reply itself did
# besides plain steps: rounds, the drafter's guesses, the policy. Taken over the replies with at
# least MIN_PLAIN_STEPS plain steps (a median of a few, most after a round, reads high).
MIN_PLAIN_STEPS = 16


def run(engine, prompts, new, mode, long_context=False):
    """prompts: texts (chat: stops at end of turn) or token lists (a long context: no stop, no
    warm-up prefill; the timing leaves the prefill out either way)."""
    total_new = total_s = rounds = accepted_plus_rounds = draft_s = verify_s = plain_steps = ttft_s = 0
    as_plain_s = judged_s = 0.0  # replies with enough plain steps: their tokens at their own plain step's cost
    outputs = []
    for text in prompts:
        ids = text if long_context else engine.tokenizer.encode(text).ids
        if not long_context:
            engine.generate(ids, 1, speculative=False)  # warm up
        t0 = time.perf_counter()
        out = engine.generate(ids, new, speculative=mode != "plain", stop_at_eos=not long_context)
        s = engine.last_stats
        decode_s = time.perf_counter() - t0 - s["ttft_s"]
        total_s += decode_s
        ttft_s += s["ttft_s"]
        total_new += len(out) - 1  # the first token comes from the prefill
        if s["plain_step_median_s"] is not None and s.get("plain_steps", len(out) - 1) >= MIN_PLAIN_STEPS:
            as_plain_s += (len(out) - 1) * s["plain_step_median_s"]
            judged_s += decode_s
        outputs.append(out)
        if mode != "plain":
            rounds += s["rounds"]
            plain_steps += s["plain_steps"]
            accepted_plus_rounds += s["acceptance_length"] * s["rounds"]
            draft_s, verify_s = draft_s + s["draft_s"], verify_s + s["verify_s"]
    # ttft: the prefill and, when speculating, the drafter shown the prompt's last pairs (drafter_feed.py)
    row = {"decode_tokens_per_s": round(total_new / total_s, 2), "new_tokens": total_new,
           "ttft_ms": round(1e3 * ttft_s / len(prompts), 1),
           "vs_own_plain_steps": round(as_plain_s / judged_s, 3) if judged_s else None}
    if mode != "plain":
        row["acceptance_length"] = round(accepted_plus_rounds / max(rounds, 1), 3)
        row["rounds"] = rounds
        row["plain_steps"] = plain_steps
        row["draft_ms_per_round"] = round(1e3 * draft_s / max(rounds, 1), 2)
        row["verify_ms_per_round"] = round(1e3 * verify_s / max(rounds, 1), 2)
    return row, outputs


# A greedy reply may part from plain decoding where the plain step's two best logits are closer than
# the verify and decode paths agree (a few 1e-6 on the embedded model: docs/speculation.md): a tie
# within float rounding, decided by the rounding. A mismatch is counted as such a near-tie when the
# speculative token's plain logit is within this of the plain argmax's; any other is a bug.
NEAR_TIE = 1e-4


def divergence(engine, ids: list[int], plain: list[int], spec: list[int]) -> dict:
    """Where a speculative reply first parts from the plain one, and by how much the plain step there
    preferred its token: the plain logits at that position, decoded again along the plain reply
    (untimed), l[plain token] - l[speculative token]. A reply that is the other's prefix (one ended
    early) has no margin and is no near-tie."""
    k = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    if k >= min(len(plain), len(spec)):
        return {"token": k, "plain_margin": None, "near_tie": False}
    engine.reset()
    logits = engine.prefill(list(ids))
    for t in plain[:k]:
        logits = engine.step("decode", [t])
    engine.reset()
    gap = float(logits[plain[k]] - logits[spec[k]])
    return {"token": k, "plain_margin": gap, "near_tie": gap <= NEAR_TIE}


def note_mismatches(engine, prompts, outputs, reference, long_context: bool, where: list) -> None:
    """Each reply that is not plain's: its divergence appended to `where` (their count is the mismatches)."""
    for text, out, ref in zip(prompts, outputs, reference):
        if out != ref:
            ids = text if long_context else engine.tokenizer.encode(text).ids
            where.append(divergence(engine, ids, ref, out))


def b_against_a(rows: dict, per_repeat: dict) -> None:
    """--policy-b: each B arm's per-repeat rate over its A arm's (the default policy's, same shape,
    same repeat), their median, in the B row as "paired_vs_a": the two policies against each other
    with plain decoding's own drift left out."""
    for name, row in rows.items():
        if name.endswith("adaptive_b") and name[:-2] in per_repeat:
            ratios = [b / a for b, a in zip(per_repeat[name], per_repeat[name[:-2]])]
            row["paired_vs_a"] = round(statistics.median(ratios), 3)
            row["ratios_vs_a"] = [round(x, 3) for x in ratios]


def own_paired(mode: list, plain: list) -> dict:
    """Each repeat's vs_own_plain_steps over plain's in the same repeat (a plain reply's own reads below
    1 by its loop and by its steps' skew), their median: the rate against plain decoding from
    inside the replies. Repeats where either has none are left out."""
    ratios = [m / p for m, p in zip(mode, plain) if m and p]
    return {"own_vs_plain": round(statistics.median(ratios), 3) if ratios else None,
            "own_ratios": [round(x, 3) for x in ratios]}


def settings(text: str) -> dict:
    """"field=value,field=value" -> {field: value} for SpecPolicy (numbers only)."""
    from dataclasses import fields

    from hybrid_npu.errors import UserError
    from hybrid_npu.runtime.speculation import Settings

    known = {f.name for f in fields(Settings) if not f.name.startswith("_")}
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in known or not value:
            raise UserError(f"{item!r}: give FIELD=NUMBER with a SpecPolicy field, e.g. max_refresh_every=16")
        try:
            out[name] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise UserError(f"{item!r}: {value!r} is not a number") from None
    return out


def engine_with(overrides: dict, threads: int, drafter: str | None = None, model=None):
    """An engine (default: the embedded model) whose speculation policies take `overrides`."""
    import hybrid_npu
    from hybrid_npu.runtime.speculation import SpecPolicy

    engine = hybrid_npu.load_engine(hybrid_npu.DEFAULT_MODEL if model is None else model, threads=threads, drafter=drafter)
    engine.make_policy = lambda e: SpecPolicy(e.draft_shape["depth"], verify_nodes=e.verify_graph,
                                              verify_graphs=e.verify_graphs, **overrides)
    return engine


def machine() -> str:
    """The CPU by name (Linux: /proc/cpuinfo's model name, what lscpu prints) and its core count."""
    info = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
             if line.startswith("model name")] if info.is_file() else []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an export with drafter/ (default: the embedded model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=lambda v: [int(x) for x in v.split(",")], default=[24, 500, 1500, 6000, 12000])
    ap.add_argument("--context-new", type=int, default=96, help="new tokens after each context")
    ap.add_argument("--context-prompts", type=int, default=4, help="contexts of each length (each its own source and prompt)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--drafter", type=lambda v: v.split(","), help="drafter kinds to compare, e.g. eagle3,mtp")
    ap.add_argument("--chain-depths", type=lambda v: [int(x) for x in v.split(",")],
                    help="chat rows: one chain per depth (e.g. 6,14) instead of the export's recorded chain")
    ap.add_argument("--modes", type=lambda v: v.split(","), default=["adaptive", "always"],
                    help="speculative modes beside plain (default: adaptive,always)")
    ap.add_argument("--policy-b", help="SpecPolicy settings of a second adaptive arm, e.g. runs=0")
    args = ap.parse_args()
    if args.policy_b and args.drafter:
        print("bench_speculative: --policy-b takes the export's default drafter; leave out --drafter", file=sys.stderr)
        return 2
    if not args.modes or set(args.modes) - {"adaptive", "always"}:
        print(f"bench_speculative: --modes {','.join(args.modes)}: give adaptive, always or both", file=sys.stderr)
        return 2
    if args.context_prompts < 1:
        print(f"bench_speculative: --context-prompts {args.context_prompts}: give at least 1", file=sys.stderr)
        return 2
    import hybrid_npu
    from hybrid_npu.errors import UserError
    if args.policy_b:
        try:
            overrides = settings(args.policy_b)
        except UserError as e:
            print(f"bench_speculative: --policy-b {e}", file=sys.stderr)
            return 2

    model = args.model or hybrid_npu.default_model()
    try:
        engines = {kind: hybrid_npu.load_engine(model, threads=args.threads, drafter=kind) for kind in (args.drafter or [None])}
    except UserError as e:
        print(f"bench_speculative: {e}", file=sys.stderr)
        return 2
    engine = next(iter(engines.values()))
    if engine.drafter is None:
        print("bench_speculative: the model has no drafter/", file=sys.stderr)
        return 2
    engine_b = engine_with(overrides, args.threads, model=model) if args.policy_b else None
    # with a B arm, A's adaptive arm gets an engine as unshared as B's (module docstring: why)
    engine_a = hybrid_npu.load_engine(model, threads=args.threads) if args.policy_b else engine

    def engine_for(mode: str, e):
        return engine_a if mode == "adaptive" and engine_b is not None else e
    prefix = {kind: f"{kind}_" if args.drafter else "" for kind in engines}
    prompts = held_out_prompts(args.prompts)
    result = {"machine": machine(), "load_average_at_start": os.getloadavg(), "threads": args.threads,
              "note": "machine shared with other jobs; modes interleaved per repeat, best repeat kept",
              "repeats": args.repeats, "greedy": True, "chat": {}, "context": [], "policy_b": args.policy_b}
    chat_shape_sets = {kind: chat_shapes(engine.manifest, kind, args.chain_depths) for kind in engines}
    chat_modes = [("plain", None, engine), ("plain_again", None, engine)] + [
        (f"{prefix[kind]}{name}_{mode}", (shape, mode), engine_for(mode, e))
        for kind, e in engines.items() for name, shape in chat_shape_sets[kind].items() for mode in args.modes]
    if engine_b is not None:
        chat_modes += [(f"{name}_adaptive_b", (shape, "adaptive"), engine_b)
                       for name, shape in chat_shape_sets[None].items()]
    best: dict = {}
    per_repeat: dict = {}
    own: dict = {}  # each repeat's vs_own_plain_steps
    divergences: dict = {}  # replies that were not plain's, over every repeat (not only the best one's): where
    #                         each parted, and whether on a near-tie (NEAR_TIE)
    reference = None
    for r in range(args.repeats):
        for name, spec, e in rotated(chat_modes, r):
            if spec:
                set_mode(e, spec[1], spec[0])
            row, outputs = run(e, prompts, args.new, "plain" if spec is None else spec[1])
            if name == "plain":
                reference = outputs
            else:  # plain again must match too: greedy plain decoding is deterministic
                note_mismatches(e, prompts, outputs, reference, False, divergences.setdefault(name, []))
                if spec:
                    row["shape"] = e.draft_shape
            per_repeat.setdefault(name, []).append(row["decode_tokens_per_s"])
            own.setdefault(name, []).append(row["vs_own_plain_steps"])
            if name not in best or row["decode_tokens_per_s"] > best[name]["decode_tokens_per_s"]:
                best[name] = row
    for name, row in best.items():
        if name != "plain":
            row["mismatched_prompts"] = len(divergences[name])
            row["divergences"] = divergences[name]
        row["vs_plain"] = round(row["decode_tokens_per_s"] / best["plain"]["decode_tokens_per_s"], 2)
        row.update(paired(per_repeat[name], per_repeat["plain"]), **own_paired(own[name], own["plain"]))
    b_against_a(best, per_repeat)
    result["chat"] = {"prompts": len(prompts), "new_tokens_per_prompt": args.new, "rows": best}
    print(json.dumps(result["chat"]), file=sys.stderr, flush=True)
    # after long contexts: the embedded default draft shape (its manifest's) for the default drafter
    shapes = {kind: recorded_shape(engine.manifest, kind) or SHAPES["chain"] for kind in engines}
    try:
        contexts = context_prompts(engine.tokenizer, prompts, args.contexts, args.context_prompts)
    except ValueError as e:
        print(f"bench_speculative: {e}", file=sys.stderr)
        return 2
    for ctx in args.contexts:
        rows: dict = {}
        per_repeat, own, divergences = {}, {}, {}
        reference = None
        runs = [("plain", "plain", engine, None), ("plain_again", "plain", engine, None)] + [
            (f"{prefix[kind]}{mode}", mode, engine_for(mode, e), kind) for kind, e in engines.items() for mode in args.modes]
        if engine_b is not None:
            runs.append(("adaptive_b", "adaptive", engine_b, None))
        for r in range(args.repeats):
            for name, mode, e, kind in rotated(runs, r):
                if mode != "plain":
                    set_mode(e, mode, shapes[kind])
                row, outputs = run(e, contexts[ctx], args.context_new, mode, long_context=True)
                reference = outputs if name == "plain" else reference
                if name != "plain":  # over every repeat; plain again too (greedy plain is deterministic)
                    note_mismatches(e, contexts[ctx], outputs, reference, True, divergences.setdefault(name, []))
                if mode != "plain":
                    row["shape"] = e.draft_shape
                per_repeat.setdefault(name, []).append(row["decode_tokens_per_s"])
                own.setdefault(name, []).append(row["vs_own_plain_steps"])
                if name not in rows or row["decode_tokens_per_s"] > rows[name]["decode_tokens_per_s"]:
                    rows[name] = row
        for mode, row in rows.items():
            if mode != "plain":
                row["mismatched"] = len(divergences[mode])
                row["divergences"] = divergences[mode]
            row["vs_plain"] = round(row["decode_tokens_per_s"] / rows["plain"]["decode_tokens_per_s"], 2)
            row.update(paired(per_repeat[mode], per_repeat["plain"]), **own_paired(own[mode], own["plain"]))
        b_against_a(rows, per_repeat)
        result["context"].append({"context_tokens": ctx, "contexts": len(contexts[ctx]), "new_tokens": args.context_new,
                                  "rows": rows})
        print(json.dumps(result["context"][-1]), file=sys.stderr, flush=True)
    result["load_average_at_end"] = os.getloadavg()
    harness.emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
