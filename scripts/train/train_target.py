"""Train the embedded default model from scratch on the CPU: a small Qwen3.5-architecture
`Qwen3_5ForCausalLM` (8 layers, 3 Gated DeltaNet : 1 attention, hidden 256, byte-level BPE of
4096 tokens) on the Python standard library's sources (scripts/train/stdlib_corpus.py; PSF licence).

    python scripts/train/train_target.py OUT [--minutes 45] [--threads 2]

Writes a normal Hugging Face checkpoint (model.safetensors, config.json, tokenizer.json,
tokenizer_config.json with a ChatML template, generation_config.json) and OUT/train_log.json
(loss every few steps, held-out loss and perplexity). Stops at --steps or --minutes, whichever
comes first; the held-out split is never trained on.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import chatml_tokenizer  # noqa: E402
import stdlib_corpus  # noqa: E402

def model_config(vocab_size, tok):
    from transformers import Qwen3_5TextConfig

    lin, full = "linear_attention", "full_attention"
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        layer_types=[lin, lin, lin, full] * 2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        tie_word_embeddings=True, bos_token_id=tok.token_to_id("<|endoftext|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=tok.token_to_id("<|endoftext|>"))


def token_stream(tok, docs, eot):
    ids = []
    for enc in tok.encode_batch([stdlib_corpus.training_text(d) for d in docs]):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


@torch.no_grad()
def held_out_loss(model, val, seq, max_windows=64):
    model.eval()
    n = min(max_windows, (len(val) - 1) // seq)
    losses = [model(input_ids=torch.from_numpy(val[i * seq:(i + 1) * seq + 1][None, :-1]),
                    labels=torch.from_numpy(val[i * seq:(i + 1) * seq + 1][None, :-1])).loss.item()
              for i in range(n)]
    model.train()
    return float(np.mean(losses))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--minutes", type=float, default=45.0)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    t0 = time.time()
    docs = stdlib_corpus.documents()
    train_docs = [d for d in docs if not d.held_out]
    random.Random(args.seed).shuffle(train_docs)
    val_docs = [d for d in docs if d.held_out]
    n_added = len(chatml_tokenizer.SPECIALS) + len(chatml_tokenizer.THINK_TOKENS)
    tok = chatml_tokenizer.train_bpe((stdlib_corpus.training_text(d) for d in train_docs), args.vocab - n_added)
    eot = tok.token_to_id("<|endoftext|>")
    train, val = token_stream(tok, train_docs, eot), token_stream(tok, val_docs, eot)
    print(f"corpus: {len(train_docs)} train / {len(val_docs)} held-out documents, "
          f"{len(train):,} / {len(val):,} tokens ({time.time() - t0:.0f} s)", flush=True)

    cfg = model_config(tok.get_vocab_size(), tok)
    model = Qwen3_5ForCausalLM(cfg).float().train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget_s, warm = args.minutes * 60.0, 100
    rng = np.random.default_rng(args.seed)
    log = {"params": n_params, "train_tokens_available": int(len(train)), "steps": [], "loss": [],
           "elapsed_s": [], "val_steps": [], "val_loss": []}
    t_train, step = time.time(), 0
    while step < args.steps:
        elapsed = time.time() - t_train
        if elapsed > budget_s:
            break
        # lr: warmup, then cosine over the wall-clock budget (steps are not known in advance)
        frac = min(1.0, elapsed / budget_s)
        lr = args.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train) - args.seq - 1, size=args.batch)
        x = torch.from_numpy(np.stack([train[s:s + args.seq] for s in starts]))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0:
            log["steps"].append(step), log["loss"].append(round(loss.item(), 4))
            log["elapsed_s"].append(round(time.time() - t_train, 1))
        if step % 200 == 0:
            vl = held_out_loss(model, val, args.seq, 16)
            log["val_steps"].append(step), log["val_loss"].append(round(vl, 4))
            print(f"step {step} loss {loss.item():.3f} held-out {vl:.3f} lr {lr:.2e} "
                  f"{(time.time() - t_train) / 60:.1f} min", flush=True)

    final = held_out_loss(model, val, args.seq)
    log.update(final_steps=step, tokens_seen=step * args.batch * args.seq, train_minutes=(time.time() - t_train) / 60,
               held_out_loss=final, held_out_perplexity=math.exp(final), held_out_tokens=int(len(val)),
               corpus=f"Python {sys.version.split()[0]} standard library sources (PSF licence)",
               config=dict(seq=args.seq, batch=args.batch, lr=args.lr, vocab=args.vocab, seed=args.seed))
    args.out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=[cfg.eos_token_id, eot],
                                               pad_token_id=eot, do_sample=False)
    model.save_pretrained(args.out, safe_serialization=True)
    chatml_tokenizer.write_tokenizer(tok, args.out)
    (args.out / "train_log.json").write_text(json.dumps(log) + "\n")
    print(json.dumps({k: v for k, v in log.items() if not isinstance(v, list)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
