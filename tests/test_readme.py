"""The README's shell commands work as written.

Every command line in the README's shell blocks is either run here (from a scratch folder, with a
tiny offline checkpoint standing in for ./Qwen3.5-0.8B) or listed in NOT_RUN with the reason and the
test that covers it; every flag a README command names must be one its `--help` offers. The Python
example is run by test_reliability_runtime.py::test_readme_python_example_runs_and_its_next_turn_continues_the_reply;
the openai client block by test_serve.py (a real server, the official client).
"""
import json
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import fixtures

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CLIS = ("npu-chat", "npu-summarize", "npu-serve", "export-hybrid", "npu-bench")

# command line (as in the README, comment dropped) -> why it is not run here
NOT_RUN = {
    'python3 -m venv .venv && . .venv/bin/activate && pip install ".[test,qnn]" && python scripts/demo.py':
        "installs packages; .ci/run does this in a fresh venv (the demo is run below)",
    'pip install -q ".[test,qnn]" && pytest -q': "the test command itself (.ci/run)",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": "a download",
    "npu-chat": "the interactive REPL: test_chat_cli.py drives it with pexpect",
    "npu-chat ./qwen35-0.8b --temperature 0.7 --seed 1": "the interactive REPL (flags checked against --help)",
    "npu-serve ./qwen35-0.8b --port 8080 --api-key KEY": "a server: test_serve.py runs it with the openai client",
}


def _shell_lines() -> list[str]:
    lines, fence = [], None  # fence: None outside a block, else the block's language ("" = shell)
    for line in README.splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence == "":
            line = re.split(r"\s{2,}#", line)[0].strip()
            if line:
                lines.append(line)
    return lines


def _exe(name: str) -> str:
    found = shutil.which(name, path=sysconfig.get_path("scripts"))
    assert found, f"{name} is not installed beside this Python"
    return found


def test_readme_is_short():
    assert len(README.splitlines()) <= 250


def test_every_flag_a_readme_command_names_is_in_its_help():
    helps = {}
    for line in _shell_lines():
        words = shlex.split(line)
        if words[0] not in CLIS:
            continue
        key = tuple(w for w in words[:2] if w == "calibrate" or w == words[0])
        if key not in helps:
            helps[key] = subprocess.run([_exe(words[0]), *key[1:], "--help"], capture_output=True, text=True,
                                        timeout=120).stdout
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", helps[key]), f"{line!r}: {flag} is not in {' '.join(key)} --help"
    table = README.split("## Commands and their main flags")[1].split("\n## ")[0]
    for row in table.splitlines()[2:]:
        if not row.startswith("| `"):
            continue
        words = row.split("`")[1].split()
        key = (words[0], "calibrate") if words[0] == "npu-bench" else (words[0],)
        text = subprocess.run([_exe(words[0]), *key[1:], "--help"], capture_output=True, text=True, timeout=120).stdout
        for flag in re.findall(r"`(--[a-z][a-z0-9-]*)", row):
            assert re.search(rf"{re.escape(flag)}\b", text), f"{row[:40]}: {flag} is not in --help"


def test_every_readme_command_is_run_here_or_says_why_not():
    run = {line for line in _shell_lines() if line not in NOT_RUN}
    assert run == set(RUN), f"classify these README commands in tests/test_readme.py: {run ^ set(RUN)}"


RUN = (
    'npu-chat --prompt "Write a Python function that adds two numbers." --max-new-tokens 32 --json',
    "export-hybrid ./Qwen3.5-0.8B ./qwen35-0.8b --weights int4 --head-bits 4 --block-size 128",
    'npu-chat ./qwen35-0.8b --prompt "Name three prime numbers." --max-new-tokens 32 --json',
    "npu-summarize report.md --model ./qwen35-0.8b --max-new-tokens 256",
)


def test_the_readme_quick_start_runs_in_order(tmp_path):
    """The quick start, command by command, in a scratch folder: the embedded model answers, a
    checkpoint is exported into a sibling folder, chatted with and asked for a summary."""
    fixtures.write_text_checkpoint(tmp_path / "Qwen3.5-0.8B", seed=1, tie=True)  # a tiny stand-in, offline
    (tmp_path / "report.md").write_text("def add(a, b):\n    return a + b\n", encoding="utf-8")
    for line in RUN:
        words = shlex.split(line)
        done = subprocess.run([_exe(words[0]), *words[1:]], capture_output=True, text=True, encoding="utf-8",
                              cwd=tmp_path, timeout=600)
        assert done.returncode == 0, f"{line}: {done.stderr[-2000:]}"
        if "--json" in words:
            reply = json.loads(done.stdout)
            assert reply["token_ids"] and reply["stats"]["finish_reason"] in ("stop", "length")
    assert (tmp_path / "qwen35-0.8b" / "model.json").is_file()


def test_the_readme_demo_runs(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py")], capture_output=True, text=True,
                          encoding="utf-8", cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "identical output: True" in done.stdout


PASS_ORDINAL = re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                          r"\w+teenth|twentieth|twenty-\w+|thirtieth|\d+(?:st|nd|rd|th)) pass(?:es)?\b", re.I)


def test_no_doc_or_code_names_a_pass():
    """Docs describe what is, comments say why: the measurement history lives under a git tag."""
    roots = ["docs", "export", "runtime", "kernels", "profiles", "src", "scripts", "tests"]
    found = [f"{p.relative_to(ROOT)}:{n}" for root in roots for p in (ROOT / root).rglob("*")
             if p.suffix in (".md", ".py", ".toml") and p.name != "test_readme.py"
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if PASS_ORDINAL.search(line)]
    assert not found, found


def test_every_kept_benchmark_result_is_cited_by_a_doc():
    texts = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    texts = re.sub(r"([\w/.\-]*)\{([\w,\-]+)\}([\w/.\-]*)",  # a{b,c}d cites abd and acd
                   lambda m: " ".join(m[1] + x + m[3] for x in m[2].split(",")), texts)
    results = ROOT / "scripts" / "bench" / "results"
    uncited = [str(p.relative_to(results)) for p in results.rglob("*") if p.is_file() and p.name not in texts]
    assert not uncited, f"cite these in docs/ or delete them: {uncited}"
