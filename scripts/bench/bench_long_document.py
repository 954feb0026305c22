"""npu-summarize over a long document on the CPU, end to end (docs/kv-cache.md): the random
Qwen3.5-0.8B-config checkpoint (scripts/random_checkpoint.py, with the embedded model's tokenizer
files so the CLI path runs) exported int4 with the default fp16 K/V cache; a text document of at
least --tokens prompt tokens (Python standard-library sources, concatenated); the summary run in a
fresh process the way npu-summarize runs it (read_document, prompt_ids, summarize) while this one
samples the child's resident memory. Prints one JSON object: peak RSS against the memory plan's
figure for the context (weights + state + K/V per token; the plan keeps MARGIN_BYTES beside it),
prefill tok/s over the first and the last --window prompt tokens and overall, decode tok/s. While it
runs, the child prints a JSON line on stderr every --window prompt tokens (tokens so far, tok/s since
the last line, its resident memory).

    python scripts/bench/bench_long_document.py [--tokens 100000] [--window 10000] [--workdir DIR]
                                          [--max-new-tokens 32] [--kv-cache fp16]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def checkpoint(workdir: Path) -> Path:
    """The random 0.8B checkpoint with a tokenizer (the embedded model's: its ids are within the vocab)."""
    from random_checkpoint import make_random_checkpoint

    import hybrid_npu

    src = make_random_checkpoint("0.8B", workdir / "qwen35-0.8b-random")
    tokenizer_dir = Path(hybrid_npu.__file__).parent / "models" / "default"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (src / name).exists():
            shutil.copy2(tokenizer_dir / name, src / name)
    return src


def export_for(workdir: Path, kv_cache: str) -> Path:
    from hybrid_npu.export.exporter import export
    from hybrid_npu.manifest import is_export

    out = workdir / f"export-int4-{kv_cache}-document"
    if not is_export(out):
        export(checkpoint(workdir), out, chunk=128, force=True, weights="int4", kv_cache=kv_cache)
    return out


def document(workdir: Path, export_dir: Path, tokens: int) -> Path:
    """A text file of at least `tokens` tokens under the export's tokenizer: standard-library sources."""
    from tokenizers import Tokenizer

    out = workdir / f"document-{tokens}.txt"
    if out.exists():
        return out
    tok = Tokenizer.from_file(str(export_dir / "tokenizer.json"))
    parts, count = [], 0
    for f in sorted(Path(json.__file__).resolve().parent.parent.glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        count += len(tok.encode(text).ids)
        if count >= tokens * 1.02:  # the template and instruction add a few; a margin, not a guess at them
            break
    out.write_text("".join(parts), encoding="utf-8")
    return out


def child(export_dir: Path, doc: Path, args) -> dict:
    """npu-summarize's path (runtime/summarize_cli.py main) with a timed progress callback."""
    import hybrid_npu
    from hybrid_npu.runtime.documents import read_document
    from hybrid_npu.runtime.summarize_cli import TokenCounter, prompt_ids, summarize

    engine = hybrid_npu.load_engine(export_dir, threads=args.threads, checkpoints=0)
    ids = prompt_ids(engine, read_document(doc, take=TokenCounter(engine, args.max_new_tokens, doc)))
    marks = [(time.perf_counter(), 0)]
    n, w = len(ids), args.window
    me, printed = psutil.Process(), [marks[0]]

    def progress(done: int, total: int) -> None:
        """Timed marks; a line on stderr each --window tokens, so a run stopped early still shows its
        rates and resident memory so far (a CPU prefill of 100k tokens takes hours on 2 cores)."""
        now, before = time.perf_counter(), marks[-1][1]
        marks.append((now, done))
        if done // w > before // w or done == total:
            then, was = printed[-1]
            print(json.dumps({"prefilled": done, "of": total, "elapsed_s": round(now - marks[0][0], 1),
                              "tok_s_since_last_line": round((done - was) / max(now - then, 1e-9), 2),
                              "rss_bytes": me.memory_info().rss}), file=sys.stderr, flush=True)
            printed.append((now, done))

    result = summarize(engine, ids, max_new_tokens=args.max_new_tokens, progress=progress)

    def rate(lo: int, hi: int) -> float:
        """Tokens/s over the chunks that end in (lo, hi]: whole chunks, as the progress reports them."""
        start = max((m for m in marks if m[1] <= lo), key=lambda m: m[1])
        end = min((m for m in marks if m[1] >= hi), key=lambda m: m[1])
        return round((end[1] - start[1]) / (end[0] - start[0]), 2)
    plan = engine.memory
    stats = result["stats"]
    return {"prompt_tokens": n, "kv_cache": engine.kv_cache, "prefill_device": stats["prefill_device"],
            "prefill_tok_s_first_window": rate(0, min(w, n)), "prefill_tok_s_last_window": rate(max(n - w, 0), n),
            "prefill_tok_s": round(stats["prefill_tokens_per_s"], 2), "decode_tokens": stats["decode_tokens"],
            "decode_tok_s": round(stats["decode_tokens_per_s"], 2),
            "plan_bytes": plan.weights_bytes + plan.state_bytes + plan.checkpoint_bytes
            + engine.state.position * plan.kv_bytes_per_token,
            "plan_weights_bytes": plan.weights_bytes, "kv_bytes_per_token": plan.kv_bytes_per_token,
            "kv_bytes_in_use": engine.state.kv_bytes_in_use(), "context": engine.state.position,
            "plan_max_context": plan.max_context}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--window", type=int, default=10_000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/hybrid-npu-bench"))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--kv-cache", default="fp16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)  # EXPORT DOCUMENT, in this process
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(*args.child, args)))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    export_dir = export_for(args.workdir, args.kv_cache)
    doc = document(args.workdir, export_dir, args.tokens)
    cmd = [sys.executable, __file__, "--child", str(export_dir), str(doc), "--window", str(args.window),
           "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)  # its progress lines pass through on stderr
    watched, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.Error:  # it just ended
            break
        time.sleep(0.2)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"bench_long_document: the summary run failed (exit {proc.returncode}; its error is above)")
    row = json.loads(out.strip().splitlines()[-1])
    row.update(peak_rss_bytes=peak, peak_rss_over_plan=round(peak / row["plan_bytes"], 3),
               wall_s=round(time.perf_counter() - t0, 1), document_chars=doc.stat().st_size)
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
