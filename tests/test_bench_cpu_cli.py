"""bench_cpu.py's llama.cpp side: a missing llama-bench or GGUF is one line and exit 2, before any
export starts; llama-bench's JSON rows map to prefill / decode (its documented -o json fields).
The paired-A/B harness alternates its arms and pairs them round by round."""
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "bench"


def _run(*args, cwd):
    return subprocess.run([sys.executable, str(SCRIPTS / "bench_cpu.py"), "--workdir", str(cwd), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def test_missing_llama_bench_is_one_line(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    run = _run("--gguf", str(gguf), "--llama-bench", str(tmp_path / "no-such-llama-bench"), cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "llama-bench" in run.stderr
    assert not any(p.is_dir() for p in tmp_path.iterdir())  # nothing exported first


def test_missing_gguf_is_one_line(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text("")
    run = _run("--gguf", str(tmp_path / "absent.gguf"), "--llama-bench", str(fake), cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "absent.gguf" in run.stderr


def test_linked_export_dir_is_one_line_before_anything_runs(tmp_path):
    """A link where a mode's export goes was refused by the export after llama-bench's rows had run,
    with a traceback; now it is one line before anything is built."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "qwen35-0.8b-export-int4").symlink_to(tmp_path / "elsewhere")
    run = _run("--weights", "int4", cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "qwen35-0.8b-export-int4" in run.stderr
    assert not (tmp_path / "qwen35-0.8b-random").exists()  # no checkpoint built first


def test_llama_bench_rows():
    from bench_cpu import llama_bench_rows

    rows = [{"n_prompt": 512, "n_gen": 0, "avg_ts": 88.512, "stddev_ts": 1.234, "samples_ts": [87.0, 90.004]},
            {"n_prompt": 0, "n_gen": 32, "avg_ts": 9.681, "stddev_ts": 0.05}]  # older builds: no samples
    assert llama_bench_rows(json.dumps(rows)) == {
        "prefill_tokens_per_s": 90.0, "prefill_avg": 88.51, "prefill_stdev": 1.23,
        "decode_tokens_per_s": 9.68, "decode_avg": 9.68, "decode_stdev": 0.05}


def _script(name, *args, cwd):
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_bench_speculative_refuses_an_unknown_mode_in_one_line(tmp_path):
    run = _script("bench_speculative.py", "--modes", "adaptive,never", cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "never" in run.stderr


def test_bench_speculative_refuses_a_bad_policy_b_in_one_line(tmp_path):
    for args in (["--policy-b", "no_such_field=1"], ["--policy-b", "runs=yes"],
                 ["--policy-b", "runs=0", "--drafter", "eagle3"]):
        run = _script("bench_speculative.py", *args, cwd=tmp_path)
        assert run.returncode == 2 and run.stdout == ""
        assert len(run.stderr.strip().splitlines()) == 1 and "--" in run.stderr


def test_policy_b_rows_pair_against_their_a_arm_repeat_by_repeat():
    from bench_speculative import b_against_a
    rows = {"adaptive": {}, "adaptive_b": {}, "chain_adaptive": {}, "chain_adaptive_b": {}, "always": {}}
    per_repeat = {"adaptive": [2.0, 4.0, 3.0], "adaptive_b": [1.0, 4.0, 6.0],
                  "chain_adaptive": [1.0, 1.0], "chain_adaptive_b": [1.5, 0.5], "always": [9.0, 9.0, 9.0]}
    b_against_a(rows, per_repeat)
    assert rows["adaptive_b"]["ratios_vs_a"] == [0.5, 1.0, 2.0] and rows["adaptive_b"]["paired_vs_a"] == 1.0
    assert rows["chain_adaptive_b"]["paired_vs_a"] == 1.0  # (1.5 + 0.5) / 2
    assert "paired_vs_a" not in rows["adaptive"] and "paired_vs_a" not in rows["always"]


def test_a_mismatch_is_placed_and_judged_a_near_tie_only_within_float_rounding():
    """divergence() decodes the plain reply again to its first differing token and reads how much the
    plain logits preferred the plain token there: within NEAR_TIE a near-tie, beyond it a bug."""
    import numpy as np
    from bench_speculative import NEAR_TIE, divergence

    class Engine:  # logits after the prompt and after each plain token: token t's logit is scripted
        def __init__(self, margin):
            self.margin, self.steps, self.resets = margin, [], 0

        def reset(self):
            self.resets += 1

        def _logits(self):
            out = np.zeros(8, np.float32)
            if len(self.steps) == 2:  # at the third new token: plain's 3 against speculation's 5
                out[3], out[5] = 1.0, 1.0 - self.margin
            return out

        def prefill(self, ids):
            self.steps = []
            return self._logits()

        def step(self, graph, ids):
            assert graph == "decode"
            self.steps += ids
            return self._logits()

    plain, spec = [1, 2, 3, 4], [1, 2, 5, 6]
    for margin, tie in ((0.0, True), (NEAR_TIE / 2, True), (0.01, False)):
        e = Engine(margin)
        got = divergence(e, [7, 7], plain, spec)
        assert got["token"] == 2 and e.steps == [1, 2] and got["near_tie"] == tie
        assert got["plain_margin"] == pytest.approx(margin, abs=1e-7) and e.resets == 2  # left as generate finds it
    ended = divergence(Engine(0.0), [7], plain, plain[:2])  # one reply stopped early: no margin, no tie
    assert ended == {"token": 2, "plain_margin": None, "near_tie": False}


def test_paired_ab_turns_the_arm_order_each_round_and_takes_the_median_ratio():
    from harness import paired, rotated  # what every paired benchmark pairs with
    orders = [rotated(["a", "b"], r) for r in range(4)]
    assert orders == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]  # each arm first in half the rounds
    assert [o[0] for o in (rotated(["p", "q", "s"], r) for r in range(3))] == ["p", "q", "s"]
    assert paired([2.0, 3.0, 9.0], [1.0, 1.0, 3.0])["paired_vs_plain"] == 3.0  # ratios 2, 3, 3
    assert paired([2.0, 4.0], [1.0, 1.0])["paired_vs_plain"] == 3.0           # even count: the middle two's mean


def test_bench_speculative_refuses_no_contexts_in_one_line(tmp_path):
    run = _script("bench_speculative.py", "--context-prompts", "0", cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "--context-prompts" in run.stderr


def test_context_rows_run_several_contexts_each_its_own_source_ending_in_its_own_prompt():
    import bench_speculative as b

    class Words:  # a tokenizer whose ids are word numbers: each context's source stretch is readable
        class _Ids:
            def __init__(self, ids):
                self.ids = ids

        def encode(self, text):
            return self._Ids([len(w) + 1000 for w in text.split()][:3] or [1000])

    source = list(range(500))
    b_source = b.source_ids
    b.source_ids = lambda tokenizer, n: source[:n]
    try:
        got = b.context_prompts(Words(), ["a bb", "ccc dddd eeeee ffffff"], [10, 100], 3)
        assert [len(p) for p in got[10]] == [10, 10, 10] and [len(p) for p in got[100]] == [100] * 3
        asks = [[1001, 1002], [1003, 1004, 1005], [1001, 1002]]  # the prompts cycled
        for ctx in (10, 100):
            for i, (p, ask) in enumerate(zip(got[ctx], asks)):
                assert p[-len(ask):] == ask
                body = p[: -len(ask)]
                assert body == source[i * 100: i * 100 + len(body)]  # its own stretch: i x the longest length on
        with pytest.raises(ValueError, match="--context-prompts"):  # 6 x 100 tokens of source needed, 500 there
            b.context_prompts(Words(), ["a"], [100], 6)
    finally:
        b.source_ids = b_source


def test_own_rates_pair_repeat_by_repeat_and_skip_repeats_without_plain_steps():
    from bench_speculative import own_paired
    got = own_paired([0.95, None, 0.90, 1.2], [0.95, 0.97, 1.0, 1.0])  # the second: no plain steps to judge by
    assert got["own_ratios"] == [1.0, 0.9, 1.2] and got["own_vs_plain"] == 1.0
    assert own_paired([None], [0.98])["own_vs_plain"] is None


def test_policy_settings_take_policy_fields_and_refuse_others_in_one_line(tmp_path):
    from bench_speculative import settings

    assert settings("max_refresh_every=16,wide_margin=1.25") == {"max_refresh_every": 16, "wide_margin": 1.25}
    for bad in ("nope=3", "max_refresh_every=x", "wide_margin", "_decode=1"):
        run = _script("bench_speculative.py", "--policy-b", bad, cwd=tmp_path)
        assert run.returncode == 2 and run.stdout == "", bad
        assert len(run.stderr.strip().splitlines()) == 1 and bad.split("=")[0] in run.stderr


def test_bench_ours_decodes_plainly_on_an_export_with_a_drafter(monkeypatch):
    """bench_cpu's decode rate is plain decoding, as llama-bench's is: on an export that ships a
    drafter (the embedded model) the engine would otherwise speculate by default."""
    import hybrid_npu
    from bench_cpu import bench_ours

    engines, asked = [], []
    load = hybrid_npu.load_engine

    def load_and_watch(*args, **kw):
        engine = load(*args, **kw)
        generate = engine.generate
        engine.generate = lambda *a, **k: asked.append(k.get("speculative", engine.drafter is not None)) or generate(*a, **k)
        engines.append(engine)
        return engine

    monkeypatch.setattr(hybrid_npu, "load_engine", load_and_watch)
    row = bench_ours(Path(hybrid_npu.default_model()), 1, list(range(40, 72)), 6)
    engine, = engines
    assert engine.drafter is not None and row["decode_tokens_per_s"] > 0
    assert asked and not any(asked)  # every timed reply asked for plain decoding
    assert engine.last_stats.get("rounds", 0) == 0


def test_harness_alternates_two_commands_in_fresh_processes_and_records_machine_and_commit(tmp_path):
    """Each arm is a command printing one JSON object: the arms alternate, each keeps its best
    round, B / A is the median of the rounds' ratios, and the result names the machine and commit."""
    arm = [sys.executable, "-c", "import json, os; print(json.dumps({'r': {'rate': float(os.environ['RATE'])}}))"]
    cmd = lambda rate: f"RATE={rate} " + shlex.join(arm)  # noqa: E731
    run = _script("harness.py", "--a", cmd(2), "--b", cmd(3), "--metric", "r.rate", "--rounds", "3",
                  "--out", str(tmp_path / "ab.json"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    out = json.loads((tmp_path / "ab.json").read_text(encoding="utf-8"))
    assert out["a"]["best_r.rate"] == 2.0 and out["b"]["best_r.rate"] == 3.0
    assert out["b"]["over_a_paired"]["r.rate"] == 1.5 and len(out["a"]["runs"]) == 3
    assert out["machine"]["cores"] and out["commit"] and out["date"]
    bad = _script("harness.py", "--a", cmd(2), "--b", cmd(3), "--metric", "r.nope", "--rounds", "1", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
