"""Train a Qwen3.5 MTP head (`mtp.*`) for a frozen hybrid target, as the released checkpoints ship one.

    python scripts/train/train_mtp.py TARGET_DIR OUT_DIR [--minutes 14] [--prompts 2048] [--ttt-steps 6] [--threads 2]
        [--long-prompts N --max-context 4096] [--window 512] [--init DIR] [--total-minutes M] [--device cuda]

The head learns to predict token t+2 from the target's (post-norm) hidden at t and the embedding of
token t+1 (docs/mtp-drafter.md). Data as for the EAGLE-3 drafter (scripts/train/train_drafter.py): the
target's own greedy continuations of stdlib-corpus prompts with its final hidden states; the loss is
the soft cross-entropy against the target's distribution one position later (what verification
accepts), unrolled over --ttt-steps chained steps (each fed the head's own output hidden, weights
0.8^k), so chains deeper than one draft are trained too. The embedding and lm_head stay the target's.
With --long-prompts, long contexts too (a stretch of source up to --max-context tokens, half ending in
a chat turn; their last --window prompt rows kept) and a training mask that reads the rows the
runtime's windowed drafter reads (--window, the runtime's DRAFT_WINDOW), as train_drafter.py does for
the EAGLE-3 drafter; held-out long contexts are then evaluated too. --init continues from a head this
script wrote.

Writes OUT_DIR/model.safetensors (`mtp.*`: export-hybrid TARGET OUT --drafter mtp reads them from a
checkpoint; build_embedded_model.py --mtp OUT_DIR from here) and OUT_DIR/train_log.json (the held-out
chain estimate and acceptance through our runtime, checked lossless).
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_npu.cli_common import OneLineParser  # noqa: E402
from hybrid_npu.errors import UserError  # noqa: E402
from hybrid_npu.runtime.drafters.draft_tree import DRAFT_WINDOW  # noqa: E402
from train_drafter import DEPTH, Clock, build_data, load_target, train  # noqa: E402  (the same TTT loop)


def parse_args(argv=None):
    ap = OneLineParser(prog="train_mtp.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", type=Path, help="Hugging Face Qwen3.5 hybrid checkpoint directory")
    ap.add_argument("out", type=Path, help="where model.safetensors (mtp.*) and train_log.json go")
    ap.add_argument("--minutes", type=float, default=14.0, help="training-loop budget (data and eval come on top)")
    ap.add_argument("--total-minutes", type=float, help="a wall-clock budget for the whole run (a lent machine's "
                    "time): the training loop gets what data generation left of it, less a minute for the rest")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=192)
    ap.add_argument("--long-prompts", type=int, default=0, help="long-context training prompts besides those")
    ap.add_argument("--max-context", type=int, default=4096, help="the longest long-context prompt, in tokens")
    ap.add_argument("--window", type=int, default=DRAFT_WINDOW,
                    help="stable rows a draft query reads in training (the runtime's DRAFT_WINDOW); 0: all")
    ap.add_argument("--init", type=Path, help="continue from OUT_DIR of an earlier run (its model.safetensors)")
    ap.add_argument("--ttt-steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--runtime-prompts", type=int, default=16, help="held-out prompts through the runtime (0: skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus-root", type=Path, help="a directory of .py files instead of the standard library")
    args = ap.parse_args(argv)
    if not (args.target / "config.json").is_file():
        raise UserError(f"{args.target} has no config.json; give a Hugging Face checkpoint directory")
    if args.ttt_steps < 1 or args.prompts < 1 or args.gen_tokens < 2 or args.batch < 1:
        raise UserError("--ttt-steps, --prompts, --batch must be >= 1 and --gen-tokens >= 2")
    if args.long_prompts < 0 or args.window < 0 or (args.long_prompts and args.max_context < 512):
        raise UserError("--long-prompts and --window must be >= 0 and --max-context >= 512")
    if args.init is not None and not (args.init / "model.safetensors").is_file():
        raise UserError(f"--init {args.init}: no model.safetensors there; give a head train_mtp.py wrote")
    return args


def runtime_acceptance(target: Path, mtp_dir: Path, prompts, gen_tokens: int, threads: int) -> dict:
    """Export the target with this MTP head, then plain and speculative greedy generation (every step a
    round, chain of depth 6) on each prompt: acceptance length and losslessness."""
    import hybrid_npu
    from hybrid_npu.export.exporter import export

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        export(target, out, mtp=mtp_dir)
        engine = hybrid_npu.load_engine(out, threads=threads)
        engine.adaptive, engine.draft_shape = False, {"top_k": 1, "depth": DEPTH, "total_tokens": DEPTH}
        rows = []
        for p in prompts:
            plain = engine.generate(p, gen_tokens, speculative=False)
            spec = engine.generate(p, gen_tokens, speculative=True)
            s = engine.last_stats
            rows.append({"prompt_tokens": len(p), "tokens": len(spec), "lossless": spec == plain,
                         "rounds": s["rounds"], "acceptance_length": round(s["acceptance_length"], 4)})
    rounds = sum(r["rounds"] for r in rows)
    emitted = sum(r["acceptance_length"] * r["rounds"] for r in rows)
    return {"prompts": len(rows), "all_lossless": all(r["lossless"] for r in rows),
            "mean_acceptance_length": emitted / max(rounds, 1), "draft_shape": dict(engine.draft_shape),
            "per_prompt": rows}


def run(args) -> dict:
    import torch

    import stdlib_corpus
    from eagle3_train import chain_acceptance
    from mtp_model import MtpHead, load_mtp, save_mtp

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    clock, started = Clock(), time.perf_counter()
    with clock.phase("load"):
        model, text, tok, _ = load_target(args.target, args.device)
        docs = stdlib_corpus.documents(args.corpus_root)
    for p in model.parameters():
        p.requires_grad_(False)  # the target stays frozen
    cfg = model.config.get_text_config()
    args.taps = (cfg.num_hidden_layers,)  # hidden_states[L]: after the target's final norm (post-norm)
    train_docs = [d for d in docs if not d.held_out]
    held_docs = [d for d in docs if d.held_out]
    _, seqs = build_data(model, tok, train_docs, args.prompts, args, clock, "train")
    eval_prompts, eval_seqs = build_data(model, tok, held_docs, args.eval_prompts, args, clock, "eval")
    long_eval: list = []
    if args.long_prompts:
        seqs += build_data(model, tok, train_docs, args.long_prompts, args, clock, "train_long", long=True)[1]
        long_eval = build_data(model, tok, held_docs, args.eval_prompts, args, clock, "eval_long", long=True)[1]
    V = cfg.vocab_size
    all_vocab, used = np.ones(V, bool), np.arange(V)
    from hybrid_npu.export.checkpoint import read_checkpoint
    head = MtpHead(read_checkpoint(args.target).config, text.embed_tokens.weight, model.lm_head.weight,
                   window=args.window or None).to(args.device)
    if args.init is not None:
        load_mtp(head, args.init)
    else:
        head.init_from_target(text)
    lm_head = model.lm_head.weight.detach().float()
    log = {"target": str(args.target), "settings": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()},
           "data": {"train_sequences": len(seqs), "long_sequences": args.long_prompts,
                    "train_tokens": int(sum(len(s.ids) for s in seqs)), "eval_sequences": len(eval_seqs)},
           "steps": [], "loss": [], "loss_per_ttt_step": [], "top1_per_ttt_step": [], "step_s": []}
    def evaluate(key):
        log[key] = chain_acceptance(head, eval_seqs, used, all_vocab, DEPTH, args.gen_batch, args.device)
        if long_eval:
            log[key + "_long"] = chain_acceptance(head, long_eval, used, all_vocab, DEPTH, args.gen_batch, args.device)

    evaluate("eval_chain_before")
    budget = args.minutes * 60.0
    if args.total_minutes:  # a minute kept for saving and the held-out evaluation
        budget = min(budget, args.total_minutes * 60.0 - (time.perf_counter() - started) - 60.0)
    log["train_budget_s"] = round(max(budget, 1.0), 1)
    with clock.phase("train"):
        log["final_step"] = train(head, lm_head, seqs, all_vocab, args, log, max(budget, 1.0))
    if log["step_s"]:
        log["mean_step_s"] = round(float(np.mean(log["step_s"][1:] or log["step_s"])), 3)
    with clock.phase("save"):
        save_mtp(head, args.out, {"target": args.target, "steps": log["final_step"]})
    with clock.phase("eval_chain"):
        evaluate("eval_chain")
    for key in ("eval_chain", "eval_chain_long"):
        if key in log:
            before = log[key.replace("eval_chain", "eval_chain_before")]
            print(f"held-out chain estimate ({key}): {log[key].get('mean_acceptance_length')} "
                  f"(before training {before.get('mean_acceptance_length')})", flush=True)
    if args.runtime_prompts:
        with clock.phase("eval_runtime"):
            log["eval_runtime"] = runtime_acceptance(args.target, args.out, eval_prompts[: args.runtime_prompts],
                                                     args.gen_tokens, args.threads)
        r = log["eval_runtime"]
        print(f"runtime: acceptance length {r['mean_acceptance_length']:.3f}, lossless {r['all_lossless']}",
              flush=True)
    log["timing_s"] = clock.phases
    (args.out / "train_log.json").write_text(json.dumps(log) + "\n")
    return log


def main(argv=None) -> int:
    try:
        run(parse_args(argv))
    except UserError as e:
        print(f"train_mtp.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
