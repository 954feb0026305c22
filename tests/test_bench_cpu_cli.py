"""bench_cpu.py's llama.cpp side: a missing llama-bench or GGUF is one line and exit 2, before any
export starts; llama-bench's JSON rows map to prefill / decode (its documented -o json fields).
ab_cpu.py's arm options parse, and a bad one is refused."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))


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


def test_ab_arm_options():
    from ab_cpu import parse_arm

    path, opts = parse_arm("/x/int4,opt=extended,intra=1,session.intra_op.allow_spinning=0")
    assert path == Path("/x/int4")
    assert opts == {"opt": "extended", "intra": "1", "session.intra_op.allow_spinning": "0"}
    for bad in ("/x,opt=fast", "/x,intra=two", "/x,nokey"):
        try:
            parse_arm(bad)
        except ValueError as e:
            assert "bad option" in str(e)
        else:
            raise AssertionError(f"{bad} accepted")


def test_bench_step_after_break_refuses_a_missing_export_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPTS / "bench_step_after_break.py"), "--model", str(tmp_path / "none")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "model.json" in run.stderr


def _script(name, *args, cwd):
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_ab_verify_graph_refuses_bad_node_counts_in_one_line(tmp_path):
    for counts in ("1,2", "two", ""):
        run = _script("ab_verify_graph.py", "--a", str(tmp_path), "--b", str(tmp_path), "--counts", counts, cwd=tmp_path)
        assert run.returncode == 2 and run.stdout == ""
        assert len(run.stderr.strip().splitlines()) == 1 and "--counts" in run.stderr


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

        def _step(self, graph, ids):
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


def test_batch_invariance_refuses_too_few_tokens_in_one_line(tmp_path):
    run = _script("batch_invariance.py", "--model", str(tmp_path), "--tokens", "2", cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "--tokens" in run.stderr


def test_ab_huge_pages_refuses_a_non_export_in_one_line(tmp_path):
    for args in ([str(tmp_path)], [str(tmp_path), "--rounds", "0"]):
        run = subprocess.run([sys.executable, str(SCRIPTS / "ab_huge_pages.py"), *args], capture_output=True,
                             text=True, cwd=tmp_path, timeout=120)
        assert run.returncode == 2 and run.stdout == ""
        assert len(run.stderr.strip().splitlines()) == 1
        assert ("not a hybrid-npu export" in run.stderr) or ("--rounds" in run.stderr)


def test_paired_ab_turns_the_arm_order_each_round_and_takes_the_median_ratio():
    from bench_speculative import paired, rotated  # what ab_cpu.py and ab_decode_depth.py pair with
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


def test_ab_embedded_drafters_after_a_context_pairs_the_drafters_losslessly(tmp_path):
    """--context runs the benchmark's context rows (no stop), --depth the chain; one JSON object."""
    import hybrid_npu

    model = str(hybrid_npu.DEFAULT_MODEL)
    run = subprocess.run([sys.executable, str(SCRIPTS / "ab_embedded_drafters.py"), "--a", model, "--b", model,
                          "--context", "300", "--prompts", "1", "--rounds", "1", "--new", "12", "--depth", "4",
                          "--threads", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["mismatches"] == 0 and out["context_tokens"] == 300 and out["shape"]["depth"] == 4
    assert out["rows"]["a_always"]["rounds"] > 0 and "own_vs_plain" in out["rows"]["b_adaptive"]
    bad = subprocess.run([sys.executable, str(SCRIPTS / "ab_embedded_drafters.py"), "--a", model, "--b", model,
                          "--depth", "0"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1


def test_bench_int8_kv_attention_checks_ort_int8_cache_against_its_reference(tmp_path):
    """ORT's GroupQueryAttention over an int8 cache computes exact attention over the keys and values
    rounded with their per-channel scales (to float rounding), writes the new row in place, and the
    rounding costs a visible error against fp32; bad --contexts is one line, exit 2."""
    run = _script("bench_int8_kv_attention.py", "--contexts", "40,300", "--layers", "1", "--rounds", "1",
                  "--threads", "1", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)["rows"]
    assert [r["context"] for r in rows] == [40, 300]
    for r in rows:
        assert r["int8_vs_reference"] <= 1e-5 and r["new_row_written_in_place"]
        assert 1e-4 < r["int8_vs_fp32"] < 0.1 and r["kv_bytes"]["fp32"] == 4 * r["kv_bytes"]["int8"]
        assert r["own_fp32_ms"] > 0 and r["gqa_int8_ms"] > 0
    for contexts in ("0", "8k", ""):
        bad = _script("bench_int8_kv_attention.py", "--contexts", contexts, cwd=tmp_path)
        assert bad.returncode == 2 and bad.stdout == ""
        assert len(bad.stderr.strip().splitlines()) == 1 and "--contexts" in bad.stderr


def test_ab_spec_policy_takes_policy_fields_and_refuses_others_in_one_line(tmp_path):
    from ab_spec_policy import settings

    assert settings("max_refresh_every=16,wide_margin=1.25") == {"max_refresh_every": 16, "wide_margin": 1.25}
    for bad in ("nope=3", "max_refresh_every=x", "wide_margin", "_decode=1"):
        run = _script("ab_spec_policy.py", "--a", bad, "--b", "max_refresh_every=64", cwd=tmp_path)
        assert run.returncode == 2 and run.stdout == "", bad
        assert len(run.stderr.strip().splitlines()) == 1 and bad.split("=")[0] in run.stderr
    run = _script("ab_spec_policy.py", "--a", "max_refresh_every=16", "--b", "max_refresh_every=64",
                  "--context", "-1", cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == "" and "--context" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_bench_verify_sizes_times_a_commit_and_puts_the_state_back():
    """The real-size cost model charges the host's commit of a verified path (bench_verify_sizes
    "modelled_with_commit"): timed on the engine's own state, which is left as it was."""
    import copy
    import time

    import numpy as np
    from bench_verify_sizes import timed_commit

    import hybrid_npu
    from hybrid_npu.runtime.speculative import Tree, commit_path, tree_feed

    engine = hybrid_npu.load(hybrid_npu.DEFAULT_MODEL, threads=1)
    engine.prefill_logits([1, 2, 3, 4])
    before = copy.deepcopy(engine.state)
    tree = Tree([5, 6, 7], [-1, 0, 1])
    out = engine.pipelines["verify"].run(tree_feed(engine.config, engine.state, tree))
    moved = copy.deepcopy(engine.state)
    commit_path(moved, out, tree, [0, 1, 2], engine.config.linear_conv_kernel_dim)
    assert moved.position == before.position + 3  # what is timed does commit the path
    assert timed_commit(engine.state, out, tree, engine.config.linear_conv_kernel_dim, time.perf_counter) > 0
    assert engine.state.position == before.position and engine.state.tokens == before.tokens
    for i, layer in engine.state.gdn.items():
        np.testing.assert_array_equal(layer.recurrent, before.gdn[i].recurrent)
        np.testing.assert_array_equal(layer.conv, before.gdn[i].conv)


def test_the_modelled_round_charges_the_observe_beside_the_commit_and_the_later_levels():
    """bench_verify_sizes.modelled_round: a chain of d drafts costs verify(d + 1) + (commit beside
    observe)(d + 1) + (d - 1) warm levels (the observe yields level 1), against hand arithmetic."""
    from bench_verify_sizes import modelled_round

    verify, beside = {2: 1.2, 3: 1.4}, {2: 0.25, 3: 0.3}
    # d = 1: 1.7 tokens for 1.2 + 0.25 = 1.45 steps -> 1.172; d = 2: 2.19 tokens for 1.4 + 0.3 + 0.1
    # = 1.8 steps -> 1.217 (a = 0.7, level 0.1 of a decode step of 1.0)
    r = modelled_round(verify, beside, 0.1, 1.0, 0.7)
    assert (r["depth"], r["verify_size"]) == (2, 3)
    assert abs(r["speedup"] - 2.19 / 1.8) < 0.006
    # levels costlier: d = 1 wins (1.7 / 1.45 = 1.172 against 2.19 / 2.1 = 1.043)
    r = modelled_round(verify, beside, 0.4, 1.0, 0.7)
    assert r["depth"] == 1 and abs(r["speedup"] - 1.7 / 1.45) < 0.006


def test_bench_ours_decodes_plainly_on_an_export_with_a_drafter(monkeypatch):
    """bench_cpu's decode rate is plain decoding, as llama-bench's is: on an export that ships a
    drafter (the embedded model) the engine would otherwise speculate by default, and ab_cpu.py's
    "decode" on it read the speculating rate (docs/cpu-speed.md, twenty-seventh pass)."""
    import hybrid_npu
    from bench_cpu import bench_ours

    engines, asked = [], []
    load = hybrid_npu.load

    def load_and_watch(*args, **kw):
        engine = load(*args, **kw)
        generate = engine.generate
        engine.generate = lambda *a, **k: asked.append(k.get("speculative", engine.drafter is not None)) or generate(*a, **k)
        engines.append(engine)
        return engine

    monkeypatch.setattr(hybrid_npu, "load", load_and_watch)
    row = bench_ours(Path(hybrid_npu.default_model()), 1, list(range(40, 72)), 6)
    engine, = engines
    assert engine.drafter is not None and row["decode_tokens_per_s"] > 0
    assert asked and not any(asked)  # every timed reply asked for plain decoding
    assert engine.last_stats.get("rounds", 0) == 0
