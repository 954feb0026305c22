"""npu-summarize end to end: the prompt is the export's chat template around INSTRUCTION + document,
the summary is exactly what the engine generates for it, a ~20k-token document runs in chunks with
progress on stderr, a document beyond the memory plan is refused before any work, and every bad
input ends in one line and exit code 2."""
import json
import os
import random
import subprocess
import sys

import pytest

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.runtime.documents import read_document
from hybrid_npu.runtime.summarize_cli import main, prompt_ids

LONG_TOKENS = 20_000
SPEC_INSTRUCTION = "Summarize the following document.\n\n"  # the embedded model is trained with exactly this
THREADS = "1"  # on the shared 2-core box one ORT thread is ~2x faster than two fighting for a core


@pytest.fixture(scope="module", params=["tiny", "embedded"])
def model_dir(request):
    if request.param == "tiny":
        return request.getfixturevalue("text_tied").out
    try:
        return hybrid_npu.default_model()
    except UserError:
        pytest.skip("no embedded default model in this install")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def reference_prompt_ids(hf_tokenizer, document: str) -> list[int]:
    """What transformers renders and tokenizes for the same single user turn, thinking off."""
    messages = [{"role": "user", "content": SPEC_INSTRUCTION + document}]
    return list(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                                 tokenize=True, return_dict=True)["input_ids"])


def make_document(hf_tokenizer, n_tokens: int) -> str:
    """Varied sentences until the document alone is at least n_tokens long."""
    r = random.Random(n_tokens)
    subjects = ["The engine", "A small model", "The fox", "Every chunk", "The state", "Our cache", "The robot"]
    verbs = ["reads", "writes", "keeps", "updates", "paints", "summarizes", "prefills", "decodes"]
    objects = ["the sky", "a long context", "every token", "the sea", "its memory", "a short story", "the rule"]
    parts, i = [], 0
    while True:
        batch = [f"{r.choice(subjects)} {r.choice(verbs)} {r.choice(objects)} in section {i + k}."
                 + ("\n\n" if (i + k) % 9 == 8 else " ") for k in range(20)]
        parts += batch
        i += len(batch)
        text = "".join(parts).strip()
        if len(hf_tokenizer(text, add_special_tokens=False)["input_ids"]) >= n_tokens:
            return text


def run(*args, timeout=600):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "hybrid_npu.runtime.summarize_cli", *map(str, args)],
                          capture_output=True, encoding="utf-8", env=env, timeout=timeout)


def assert_one_line_error(code_or_proc, err, *needles):
    code = code_or_proc if isinstance(code_or_proc, int) else code_or_proc.returncode
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert str(n) in err, (n, err)


@pytest.fixture(scope="module")
def short_doc(tmp_path_factory, hf_tokenizer):
    path = tmp_path_factory.mktemp("docs") / "short.md"
    path.write_text(make_document(hf_tokenizer, 600), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def short_reference(model_dir, hf_tokenizer, short_doc):
    """Greedy ids hybrid_npu.load_engine().generate gives for the transformers-rendered prompt."""
    ids = reference_prompt_ids(hf_tokenizer, short_doc.read_text(encoding="utf-8"))
    engine = hybrid_npu.load_engine(model_dir, threads=1)
    return ids, engine.generate(ids, 16, speculative=False), engine.tokenizer


# ---------------------------------------------------------------- the summary
def test_json_matches_engine_generate(model_dir, short_doc, short_reference):
    prompt, expected, tokenizer = short_reference
    proc = run(short_doc, "--model", model_dir, "--json", "--max-new-tokens", 16, "--threads", THREADS,
               "--no-speculative")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # --json: no progress bar
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "token_ids", "document_tokens", "stats"}
    assert out["document_tokens"] == len(prompt) == out["stats"]["prefill_tokens"]
    assert out["token_ids"] == expected
    assert out["text"] == tokenizer.decode(out["token_ids"])


def test_streams_summary_to_stdout_and_progress_to_stderr(model_dir, short_doc, short_reference):
    _, expected, tokenizer = short_reference
    proc = run(short_doc, "--model", model_dir, "--max-new-tokens", 16, "--threads", THREADS, "--no-speculative")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == tokenizer.decode(expected) + "\n"  # only the summary
    assert "prefill on CPU" in proc.stderr and "tok/s" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    quiet = run(short_doc, "--model", model_dir, "--max-new-tokens", 16, "--threads", THREADS, "--no-speculative",
                "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == proc.stdout


def test_long_document_in_chunks(model_dir, hf_tokenizer, tmp_path):
    document = make_document(hf_tokenizer, LONG_TOKENS)
    doc = tmp_path / "long.txt"
    doc.write_text(document, encoding="utf-8")
    proc = run(doc, "--model", model_dir, "--json", "--max-new-tokens", 16, "--threads", THREADS)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    prompt = reference_prompt_ids(hf_tokenizer, document)
    assert len(prompt) > LONG_TOKENS
    assert out["document_tokens"] == len(prompt) == out["stats"]["prefill_tokens"]
    assert 1 <= len(out["token_ids"]) <= 16
    assert out["stats"]["context_tokens"] == len(prompt) + len(out["token_ids"])
    assert out["text"] == hf_tokenizer.decode(out["token_ids"], skip_special_tokens=True)


# ---------------------------------------------------------------- the memory plan, up front
def budget_for(model_dir, max_context: int) -> int:
    """The --memory that gives exactly max_context tokens (checked against the engine's own plan)."""
    plan = hybrid_npu.load_engine(model_dir, checkpoints=0).memory  # npu-summarize keeps no turn checkpoints
    budget = (plan.weights_bytes + plan.state_bytes
              + max_context * plan.kv_bytes_per_token)
    assert hybrid_npu.load_engine(model_dir, memory=budget, checkpoints=0).memory_report()["max_context"] == max_context
    return budget


def test_refused_before_any_work_counting_the_new_tokens(text_tied, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The fox runs into the forest. " * 8, encoding="utf-8")
    n = len(prompt_ids(hybrid_npu.load_engine(text_tied.out), read_document(doc)))
    budget = budget_for(text_tied.out, n + 16)
    refused = run(doc, "--model", text_tied.out, "--memory", budget, "--max-new-tokens", 17)
    assert_one_line_error(refused, refused.stderr, f"is {n} tokens", "--max-new-tokens 17", f"{n + 16}-token",
                          "--memory")
    assert "prefill" not in refused.stderr and refused.stdout == ""
    fits = run(doc, "--model", text_tied.out, "--memory", budget, "--max-new-tokens", 16, "--json")
    assert fits.returncode == 0, fits.stderr


# ---------------------------------------------------------------- bad input: one line, exit 2
def test_bad_inputs(text_tied, tmp_path, capsys):
    model = str(text_tied.out)
    good = tmp_path / "good.md"
    good.write_text("A short document.", encoding="utf-8")
    (tmp_path / "empty.txt").write_text(" \n\t\n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "notes.docx").write_text("x", encoding="utf-8")
    (tmp_path / "folder.txt").mkdir()
    (tmp_path / "not_export").mkdir()
    cases = [
        ([tmp_path / "missing.txt"], "does not exist"),
        ([tmp_path / "empty.txt"], "no text to summarize"),
        ([tmp_path / "latin1.txt"], "not UTF-8"),
        ([tmp_path / "notes.docx"], ".docx"),
        ([tmp_path / "folder.txt"], "not a file"),
        ([good, "--bogus"], "--bogus"),
        ([good, "--max-new-tokens", "many"], "--max-new-tokens"),
        ([good, "--max-new-tokens", "0"], "--max-new-tokens 0"),
        ([good, "--temperature", "-1"], "--temperature"),
        ([good, "--memory", "lots"], "memory size"),
        ([good, "--prefill", "gpu"], "gpu"),
        ([good, "--profile", "no-such-profile"], "no-such-profile"),
        ([good, "--model", tmp_path / "not_export"], "not a hybrid-npu export"),
        ([good, "--model", tmp_path / "nowhere"], "does not exist"),
    ]
    for args, needle in cases:
        args = [str(a) for a in args]
        if "--model" not in args:
            args += ["--model", model]
        code = main(args)
        err = capsys.readouterr().err
        assert_one_line_error(code, err, needle)
    if sys.platform != "win32" and os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked.txt"
        locked.write_text("secret", encoding="utf-8")
        locked.chmod(0)
        assert_one_line_error(main([str(locked), "--model", model]), capsys.readouterr().err, "cannot read")
    proc = run(tmp_path / "notes.docx", "--model", model)  # the installed entry point, in its own process
    assert_one_line_error(proc, proc.stderr, ".docx")


def test_no_embedded_model_is_one_line(tmp_path, capsys):
    try:
        hybrid_npu.default_model()
        pytest.skip("this install has an embedded model")
    except UserError:
        pass
    doc = tmp_path / "d.txt"
    doc.write_text("text", encoding="utf-8")
    assert_one_line_error(main([str(doc)]), capsys.readouterr().err, "default model")


# ---------------------------------------------------------------- PDF
def minimal_pdf(text: str) -> bytes:
    """One page, one line of Helvetica text, with a correct xref table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_pdf(tmp_path, monkeypatch):
    pytest.importorskip("pypdf")
    pdf = tmp_path / "paper.pdf"
    pdf.write_bytes(minimal_pdf("Gated deltas keep a fixed state"))
    assert "Gated deltas keep a fixed state" in read_document(pdf)
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4\nnot really a pdf\n")
    with pytest.raises(UserError, match="not a readable PDF") as e:
        read_document(broken)
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "pypdf", None)  # as if the pdf extra were not installed
    with pytest.raises(UserError, match=r"pip install hybrid-npu\[pdf\]"):
        read_document(pdf)
