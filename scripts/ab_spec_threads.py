"""Paired A/B of the thread-pool settings speculation runs with: does a plain decode step cost
more right after a speculative round than in a run of plain steps, and which setting fixes it.

Each arm runs in its own fresh process, arms alternated round by round (load from other jobs hits
all of them); within one process, on the embedded pair after CTX tokens of held-out source:
  plain_before_verify_exists  30 plain steps, the verify session not opened yet (one pool)
  plain_verify_idle           30 plain steps after the verify session ran once and slept 0.3 s
  plain_right_after_round     the plain step right after each of 15 draft + verify rounds
  plain_run_after_rounds      30 plain steps after those rounds
  verify_ms                   the verify call of those rounds (depth-6 chain, 8 nodes)
and a short chat reply, plain vs every-step speculation (64 tokens, best of 2).
Medians per process; the summary keeps each arm's best process and the per-process ratios
right-after-round / before (the paired number: same process, same minute).

Arms: spinning (every CPU session spins: the runtime before this fix), verify_quiet (the verify
session does not spin: the runtime's default), no_spinning (no session spins: HYBRID_NPU_SPINNING=0).

    python scripts/ab_spec_threads.py [--context 500] [--rounds 4] [--arms spinning,verify_quiet,no_spinning]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_json  # noqa: E402  (scripts/: one JSON object on stdout and in --out)
ARMS = ("spinning", "verify_quiet", "no_spinning")


def child(arm: str, ctx: int) -> dict:
    import numpy as np

    import bench_speculative as bench
    import hybrid_npu
    import hybrid_npu.runtime.engine as engine_mod
    from hybrid_npu.runtime.generation import catch_up_drafter
    from hybrid_npu.runtime.speculative import Tree, tree_feed

    if arm == "spinning":  # the verify session as a main one: spinning after its calls
        real = engine_mod.cpu_session
        engine_mod.cpu_session = lambda path, manifest, threads=None: real(path, manifest, threads)
    e = hybrid_npu.load(hybrid_npu.default_model(), threads=2)
    ids = bench.source_ids(e.tokenizer, ctx)
    e.generate(ids, 2, speculative=False)
    catch_up_drafter(e)  # the drafter is shown the context when next needed: here, before propose

    def plain():
        t = time.perf_counter()
        e._step("decode", [1])
        return time.perf_counter() - t

    def round_():
        e.drafter.propose(e.drafter._last_token, top_k=1, depth=6, total_tokens=6)
        tree, _ = Tree.from_draft(1, [1] * 6, list(range(-1, 5)), 8)
        t = time.perf_counter()
        e.pipelines["verify"].run(tree_feed(e.config, e.state, tree))  # no commit: the state stays
        return time.perf_counter() - t

    ms = lambda xs: round(float(np.median(xs)) * 1e3, 3)  # noqa: E731
    before = [plain() for _ in range(30)]
    round_()
    time.sleep(0.3)
    idle = [plain() for _ in range(30)]
    after, verify = [], []
    for _ in range(15):
        verify.append(round_())
        after.append(plain())
    run_after = [plain() for _ in range(30)]
    chat = e.tokenizer.encode(bench.held_out_prompts(1)[0]).ids
    e.adaptive = False
    tp = ts = 0.0
    for _ in range(2):
        e.generate(chat, 64, speculative=False, stop_at_eos=False)
        tp = max(tp, e.last_stats["decode_tokens_per_s"])
        e.generate(chat, 64, speculative=True, stop_at_eos=False)
        ts = max(ts, e.last_stats["decode_tokens_per_s"])
    return {"plain_before_verify_exists": ms(before), "plain_verify_idle": ms(idle),
            "plain_right_after_round": ms(after), "plain_run_after_rounds": ms(run_after), "verify_ms": ms(verify),
            "chat_plain_tok_s": round(tp, 1), "chat_spec_tok_s": round(ts, 1), "chat_spec_vs_plain": round(ts / tp, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.context)))
        return 0
    arms = a.arms.split(",")
    runs: dict = {arm: [] for arm in arms}
    for r in range(a.rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            env = dict(os.environ, **({"HYBRID_NPU_SPINNING": "0"} if arm == "no_spinning" else {}))
            p = subprocess.run([sys.executable, __file__, "--child", arm, "--context", str(a.context)],
                               capture_output=True, text=True, env=env)
            if p.returncode:
                print(p.stderr, file=sys.stderr)
                return 1
            runs[arm].append(json.loads(p.stdout.strip().splitlines()[-1]))
    summary = {}
    for arm, rows in runs.items():
        best = {k: (max if "tok_s" in k or "vs" in k else min)(r[k] for r in rows) for k in rows[0]}
        best["after_round_vs_before_per_process"] = [round(r["plain_right_after_round"] /
                                                           r["plain_before_verify_exists"], 2) for r in rows]
        summary[arm] = best
    out = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cores": os.cpu_count(),
           "load_average": os.getloadavg(), "context": a.context, "rounds": a.rounds,
           "note": "machine shared with other jobs; arms in alternating fresh processes", "arms": summary, "runs": runs}
    bench_json.emit(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
