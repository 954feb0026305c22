"""scripts/bench/bench_spec_chat.py: a multi-turn chat through the export's template on a speculating and a
plain engine; the replies are compared token for token (greedy speculation is lossless), and bad
arguments are one line and exit 2."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "bench"


def _run(*args, cwd):
    return subprocess.run([sys.executable, str(SCRIPTS / "bench_spec_chat.py"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_three_turns_on_the_embedded_model_give_the_plain_replies(tmp_path):
    run = _run("--turns", "3", "--new", "24", "--out", str(tmp_path / "r.json"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result == json.loads((tmp_path / "r.json").read_text())
    turns = result["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2] and result["mismatches"] == 0
    assert all(t["same_output"] and 1 <= t["new_tokens"] <= 24 for t in turns)
    # each turn keeps the conversation: the context grows, and later turns reuse what came before
    assert turns[0]["reused_tokens"] == 0 and all(t["reused_tokens"] > 0 for t in turns[1:])
    assert turns[0]["context_tokens"] < turns[1]["context_tokens"] < turns[2]["context_tokens"]


def test_a_second_policy_speculates_the_same_conversation_losslessly(tmp_path):
    run = _run("--turns", "2", "--new", "16", "--policy-b", "probe_budget=0.02,guess_budget=0.01", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["policy_b"] == {"probe_budget": 0.02, "guess_budget": 0.01}
    assert result["mismatches"] == 0 and result["mismatches_b"] == 0
    turns = result["turns"]
    assert all(t["same_output_b"] and t["rounds_b"] + t["plain_steps_b"] >= 1 for t in turns)
    for key, rate in (("chat_ratio", "speculative_tok_s"), ("chat_ratio_b", "speculative_b_tok_s")):
        # the whole chat's time plainly over speculating, from the turns' own lengths and rates
        plain = sum((t["new_tokens"] - 1) / t["plain_tok_s"] for t in turns if t["new_tokens"] > 1)
        spec = sum((t["new_tokens"] - 1) / t[rate] for t in turns if t["new_tokens"] > 1)
        assert abs(result[key] - plain / spec) < 1e-3


def test_a_bad_second_policy_is_one_line(tmp_path):
    run = _run("--policy-b", "probe_budget=lots", cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "probe_budget" in run.stderr


def test_an_export_without_a_drafter_is_one_line(text_tied, tmp_path):
    run = _run("--model", str(text_tied.out), cwd=tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1 and "--drafter" in run.stderr


def test_zero_turns_is_refused(tmp_path):
    run = _run("--turns", "0", cwd=tmp_path)
    assert run.returncode == 2 and "--turns" in run.stderr and "Traceback" not in run.stderr
