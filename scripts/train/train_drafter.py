"""Train an EAGLE-3 drafter for a Qwen3.5 hybrid target by training-time test (docs/eagle3-drafter.md).

    python scripts/train/train_drafter.py TARGET_DIR OUT_DIR [--minutes 15] [--prompts 512] [--gen-tokens 128]
        [--draft-vocab V] [--ttt-steps 7] [--threads 2] [--device cpu]
        [--long-prompts N --max-context 4096] [--window 512]

Phases (each timed in OUT_DIR/train_log.json):
  1. data: the target's greedy continuations of training-split corpus prompts (scripts/train/stdlib_corpus.py;
     chat kinds: the rendered user turn, code: the source up to a random line) with, from the same
     passes, the taps (residual stream entering layers (2, L//2, L-3), as our runtime records them)
     and the target's final hidden state (its logits are the soft targets); with --long-prompts, also
     long contexts (a stretch of source up to --max-context tokens, half ending in a chat turn), of
     which only the last --window prompt rows are kept: the runtime's drafter reads no more;
  2. draft vocabulary: the most frequent tokens of that data (d2t/t2d);
  3. TTT training for --minutes (AdamW, warmup + cosine over the budget, grad clip);
  4. OUT_DIR/config.json + model.safetensors in the official/SpecForge layout (export-hybrid --drafter);
  5. acceptance on held-out prompts (and held-out long contexts, with --long-prompts): a teacher-free
     chain estimate (depth 6), then through our runtime:
     export target + drafter, engine.generate(speculative=True) (tree: top_k 4, depth 6), checked
     equal to plain greedy output.
"""
from __future__ import annotations

import json
import math
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_npu.cli_common import OneLineParser  # noqa: E402
from hybrid_npu.errors import UserError  # noqa: E402

DEPTH = 6  # acceptance depth: the runtime's tree depth


def parse_args(argv=None):
    ap = OneLineParser(prog="train_drafter.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", type=Path, help="Hugging Face Qwen3.5 hybrid checkpoint directory")
    ap.add_argument("out", type=Path, help="where the drafter checkpoint and train_log.json go")
    ap.add_argument("--minutes", type=float, default=15.0, help="training-loop budget (data and eval come on top)")
    ap.add_argument("--total-minutes", type=float, help="a wall-clock budget for the whole run (a lent machine's "
                    "time): the training loop gets what data generation left of it, less a minute for the rest")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--prompts", type=int, default=512, help="training prompts to generate from")
    ap.add_argument("--gen-tokens", type=int, default=128, help="tokens the target generates per prompt")
    ap.add_argument("--max-prompt", type=int, default=192, help="prompt length cap in tokens")
    ap.add_argument("--long-prompts", type=int, default=0, help="long-context training prompts besides those")
    ap.add_argument("--max-context", type=int, default=4096, help="the longest long-context prompt, in tokens")
    ap.add_argument("--window", type=int, default=512,
                    help="stable rows a draft query reads in training (runtime/drafters/draft_tree.py DRAFT_WINDOW); 0: all")
    ap.add_argument("--draft-vocab", type=int, default=0, help="draft vocabulary size (default: min(V, 32000))")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8, help="sequences per training step")
    ap.add_argument("--gen-batch", type=int, default=64, help="sequences per generation batch")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the chain estimate")
    ap.add_argument("--runtime-prompts", type=int, default=8, help="held-out prompts through the runtime (0: skip)")
    ap.add_argument("--export-dir", type=Path, help="keep the runtime check's export (target + drafter) here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus-root", type=Path, help="a directory of .py files instead of the standard library")
    ap.add_argument("--init", type=Path, help="continue training this drafter checkpoint (one train_drafter.py "
                    "wrote for the same target) instead of starting from the target's head")
    args = ap.parse_args(argv)
    if not (args.target / "config.json").is_file():
        raise UserError(f"{args.target} has no config.json; give a Hugging Face checkpoint directory")
    if args.init is not None and not (args.init / "model.safetensors").is_file():
        raise UserError(f"--init {args.init}: no model.safetensors there; give a drafter train_drafter.py wrote")
    if args.ttt_steps < 1 or args.prompts < 1 or args.gen_tokens < 2 or args.batch < 1:
        raise UserError("--ttt-steps, --prompts, --batch must be >= 1 and --gen-tokens >= 2")
    if args.long_prompts < 0 or args.window < 0 or (args.long_prompts and args.max_context < 512):
        raise UserError("--long-prompts and --window must be >= 0 and --max-context >= 512")
    return args


class Clock:
    """Wall-clock seconds per phase, printed as they finish."""

    def __init__(self):
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        print(f"[{name}] ...", flush=True)
        t0 = time.perf_counter()
        yield
        self.phases[name] = round(time.perf_counter() - t0, 2)
        print(f"[{name}] {self.phases[name]:.1f} s", flush=True)


def load_target(path: Path, device: str):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from hybrid_npu.export.checkpoint import read_checkpoint

    taps = read_checkpoint(path).config.tap_layers   # the layers our runtime taps, entering-layer convention
    if not (path / "tokenizer.json").is_file():
        raise UserError(f"{path} has no tokenizer.json; the prompts are tokenised with the target's tokenizer")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    text = getattr(model.model, "language_model", model.model)   # the released VLM layout nests it
    return model, text, Tokenizer.from_file(str(path / "tokenizer.json")), tuple(taps)


def build_data(model, tok, docs, n, args, clock, label, long=False):
    """long: long-context prompts (their last --window prompt rows kept), else the short ones."""
    import eagle3_data as data

    gc = model.generation_config
    eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
    pad = gc.pad_token_id if gc.pad_token_id is not None else eos[0]
    if long:
        try:
            prompts = data.context_prompts(docs, tok, n, args.seed, args.max_context)
        except ValueError as e:
            raise UserError(f"{e} (give a larger --corpus-root)") from None
    else:
        prompts = data.make_prompts(docs, tok, n, args.seed, args.max_prompt)
    with clock.phase(f"{label}_generate"):
        return prompts, data.generate(model, prompts, args.gen_tokens, args.gen_batch, pad, eos, args.taps,
                                      args.device, keep_prompt=args.window if long and args.window else None)


class _TextLM:
    """What init_from_target needs: .model (the text stack) and .lm_head."""

    def __init__(self, text, head):
        self.model, self.lm_head = text, head


def batches(seqs, size: int, rng: random.Random):
    """Endless shuffled batches of similar lengths (less padding)."""
    while True:
        order = list(range(len(seqs)))
        rng.shuffle(order)
        groups = []
        for s in range(0, len(order), 32 * size):
            block = sorted(order[s: s + 32 * size], key=lambda i: len(seqs[i].ids))
            groups += [block[j: j + size] for j in range(0, len(block), size)]
        rng.shuffle(groups)
        for g in groups:
            yield [seqs[i] for i in g]


def train(drafter, head, seqs, t2d, args, log, budget: float):
    import torch

    from eagle3_train import collate, ttt_loss

    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    warm, step = 20, 0
    it = batches(seqs, args.batch, random.Random(args.seed))
    t0 = time.perf_counter()
    while step < args.max_steps and time.perf_counter() - t0 < budget:
        frac = max((time.perf_counter() - t0) / budget, step / args.max_steps)
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        ts = time.perf_counter()
        total, losses, accs = ttt_loss(drafter, collate(next(it), t2d, args.device), head, args.ttt_steps)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        step += 1
        log["steps"].append(step)
        log["loss"].append(round(total.item(), 4))
        log["loss_per_ttt_step"].append([round(x, 4) for x in losses])
        log["top1_per_ttt_step"].append([round(x, 4) for x in accs])
        log["step_s"].append(round(time.perf_counter() - ts, 3))
        if step % 10 == 0 or step == 1:
            print(f"step {step} loss {total.item():.3f} step0 {losses[0]:.3f} top1 "
                  f"{' '.join(f'{a:.2f}' for a in accs)} lr {lr:.1e} {(time.perf_counter() - t0) / 60:.1f} min",
                  flush=True)
    return step


def runtime_acceptance(target: Path, drafter_dir: Path, prompts, gen_tokens: int, threads: int,
                       export_dir: Path | None = None) -> dict:
    """Export target + drafter, then plain and speculative greedy generation on each prompt."""
    import hybrid_npu
    from hybrid_npu.export.exporter import export

    with tempfile.TemporaryDirectory() as tmp:
        out = export_dir or Path(tmp) / "export"
        t0 = time.perf_counter()
        export(target, out, drafter=drafter_dir)
        export_s = time.perf_counter() - t0
        engine = hybrid_npu.load_engine(out, threads=threads)
        per_round: list[int] = []
        from hybrid_npu.runtime import generation
        speculate = generation.speculative_round

        def counted(*a, **kw):  # instrumentation only: accepted drafts of each round
            before = engine.spec_stats["accepted"]
            emitted = speculate(*a, **kw)
            per_round.append(engine.spec_stats["accepted"] - before)
            return emitted
        generation.speculative_round = counted  # put back below: the module is the process's
        rows = []
        for p in prompts:
            t1 = time.perf_counter()
            plain = engine.generate(p, gen_tokens, speculative=False)
            t2 = time.perf_counter()
            spec = engine.generate(p, gen_tokens, speculative=True)
            t3 = time.perf_counter()
            s = engine.last_stats
            rows.append({"prompt_tokens": len(p), "tokens": len(spec), "lossless": spec == plain,
                         "rounds": s["rounds"], "acceptance_length": round(s["acceptance_length"], 4),
                         "plain_s": round(t2 - t1, 3), "speculative_s": round(t3 - t2, 3)})
        generation.speculative_round = speculate
    a = np.array(per_round)
    rounds = max(len(a), 1)
    return {"export_s": round(export_s, 1), "prompts": len(rows), "all_lossless": all(r["lossless"] for r in rows),
            "mean_acceptance_length": float(1 + a.sum() / rounds) if len(a) else None,
            "accept_rate_at_depth": [float((a > k).mean()) for k in range(DEPTH)] if len(a) else [],
            "tree": dict(engine.draft_shape), "per_prompt": rows}


def run(args) -> dict:
    import torch

    import eagle3_data as data
    import stdlib_corpus
    from eagle3_model import Drafter, init_from_target, load_checkpoint, save_checkpoint, shape_for_target
    from eagle3_train import chain_acceptance

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    clock, started = Clock(), time.perf_counter()
    with clock.phase("load"):
        model, text, tok, args.taps = load_target(args.target, args.device)
        docs = stdlib_corpus.documents(args.corpus_root)
    train_docs = [d for d in docs if not d.held_out]
    held_docs = [d for d in docs if d.held_out]
    if not train_docs or not held_docs:
        raise UserError(f"the corpus has {len(train_docs)} training and {len(held_docs)} held-out documents; "
                        "both are needed (give a larger --corpus-root)")
    cfg = model.config.get_text_config()
    V = cfg.vocab_size
    vd = args.draft_vocab or min(V, 32000)
    if not 1 <= vd <= V:
        raise UserError(f"--draft-vocab {vd} is outside [1, {V}] (the target's vocabulary)")

    _, seqs = build_data(model, tok, train_docs, args.prompts, args, clock, "train")
    eval_prompts, eval_seqs = build_data(model, tok, held_docs, args.eval_prompts, args, clock, "eval")
    long_eval: list = []
    if args.long_prompts:
        seqs += build_data(model, tok, train_docs, args.long_prompts, args, clock, "train_long", long=True)[1]
        long_eval = build_data(model, tok, held_docs, args.eval_prompts, args, clock, "eval_long", long=True)[1]
    used = data.draft_vocabulary(seqs, V, vd)
    t2d = np.zeros(V, bool)
    t2d[used] = True
    all_ids = np.concatenate([s.ids for s in seqs])
    gen_ids = np.concatenate([s.ids[s.prompt_len:] for s in seqs])
    log = {"target": str(args.target), "taps_entering_layers": list(args.taps),
           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "data": {"train_sequences": len(seqs), "long_sequences": args.long_prompts,
                    "train_tokens": int(len(all_ids)),
                    "generated_tokens": int(len(gen_ids)), "eval_sequences": len(eval_seqs),
                    "draft_vocab": vd, "draft_vocab_coverage": float(t2d[all_ids].mean()),
                    "draft_vocab_coverage_generated": float(t2d[gen_ids].mean())},
           "steps": [], "loss": [], "loss_per_ttt_step": [], "top1_per_ttt_step": [], "step_s": []}

    drafter = Drafter(shape_for_target(cfg, vd, len(args.taps)), text.embed_tokens.weight,
                      window=args.window or None).to(args.device)
    used_t = torch.from_numpy(used).to(args.device)
    if args.init:
        load_checkpoint(drafter, used, args.init)
    else:
        init_from_target(drafter, _TextLM(text, model.lm_head), used_t)
    head = model.lm_head.weight.detach()[used_t].float()

    def evaluate(key):
        log[key] = chain_acceptance(drafter, eval_seqs, used, t2d, DEPTH, args.gen_batch, args.device)
        if long_eval:
            log[key + "_long"] = chain_acceptance(drafter, long_eval, used, t2d, DEPTH, args.gen_batch, args.device)
    evaluate("eval_chain_before")
    budget = args.minutes * 60.0
    if args.total_minutes:   # a minute kept for saving and the held-out evaluation
        budget = min(budget, args.total_minutes * 60.0 - (time.perf_counter() - started) - 60.0)
    budget = max(budget, 1.0)
    log["train_budget_s"] = round(budget, 1)
    with clock.phase("train"):
        log["final_step"] = train(drafter, head, seqs, t2d, args, log, budget)
    if log["step_s"]:
        log["mean_step_s"] = round(float(np.mean(log["step_s"][1:] or log["step_s"])), 3)
    with clock.phase("save"):
        save_checkpoint(drafter, used, args.taps, args.out)
        (args.out / "train_log.json").write_text(json.dumps(log) + "\n")   # rewritten with the evaluations
    with clock.phase("eval_chain"):
        evaluate("eval_chain")
    for suffix in ("", "_long"):
        if "eval_chain" + suffix in log:
            print(f"held-out chain estimate{suffix}: {log['eval_chain' + suffix].get('mean_acceptance_length')} "
                  f"(before training {log['eval_chain_before' + suffix].get('mean_acceptance_length')})", flush=True)
    if args.runtime_prompts:
        with clock.phase("eval_runtime"):
            log["eval_runtime"] = runtime_acceptance(args.target, args.out, eval_prompts[: args.runtime_prompts],
                                                     args.gen_tokens, args.threads, args.export_dir)
        r = log["eval_runtime"]
        print(f"runtime: acceptance length {r['mean_acceptance_length']}, lossless {r['all_lossless']}", flush=True)
    log["timing_s"] = clock.phases
    (args.out / "train_log.json").write_text(json.dumps(log) + "\n")
    return log


def main(argv=None) -> int:
    try:
        run(parse_args(argv))
    except UserError as e:
        print(f"train_drafter.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
