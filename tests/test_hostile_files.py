"""Hostile files at run time (issue 52): export folders, snapshots, PDFs, --tools files and paths.

Every input here is refused by the real CLI (or the engine, in a child process run the same way)
in one line with exit 2, no traceback, under a memory and time bound (tests/hostile.py), and
what the user had (the files beside it, the conversation in the engine) is still there.
"""
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.format import manifest_hash

from hostile import assert_refused, run_bounded

POSIX = os.name == "posix"
CHAT = ["-m", "hybrid_npu.runtime.chat.cli"]
SUMMARIZE = ["-m", "hybrid_npu.runtime.summarize_cli"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_NPU_CACHE", str(tmp_path / "cache"))


@pytest.fixture()
def export(tmp_path):
    out = tmp_path / "export"
    shutil.copytree(hybrid_npu.default_model(), out)
    return out


def edit_manifest(out: Path, edit) -> None:
    m = json.loads((out / "model.json").read_text())
    edit(m)
    (out / "model.json").write_text(json.dumps(m))


def chat(model, *args, **kw):
    return run_bounded([*CHAT, model, "--prompt", "hi", "--max-new-tokens", "1", *args], **kw)


def files_of(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def fifo(path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.mkfifo(path)
    return path


# ---- 5. an export folder is read only inside itself, only regular files, bounded ---------------
def _integrity_outside(out):
    edit_manifest(out, lambda m: m["integrity"]["files"].update({"/etc/passwd": {"bytes": 1, "sha256": "0" * 64}}))


def _integrity_dotdot(out):
    (out.parent / "secret.txt").write_text("the user's secret")
    edit_manifest(out, lambda m: m["integrity"]["files"].update(
        {"../secret.txt": {"bytes": 17, "sha256": "0" * 64}}))


def _graph_elsewhere(out):
    (out.parent / "elsewhere").mkdir()
    shutil.copy(out / "graphs" / "cpu.onnx", out.parent / "elsewhere" / "cpu.onnx")
    edit_manifest(out, lambda m: m["graphs"]["cpu"].update(file="../elsewhere/cpu.onnx"))


def _graph_absolute(out):
    edit_manifest(out, lambda m: m["graphs"]["decode"].update(file=str((out / "graphs" / "decode.onnx").resolve())))


def _drafter_dir_outside(out):
    shutil.copytree(out / "drafter", out.parent / "drafter")
    edit_manifest(out, lambda m: m["drafter"].update(dir="../drafter"))


def _symlink_out(out):
    if not POSIX:
        pytest.skip("symlinks need privileges on Windows")
    (out / "graphs" / "decode.onnx").unlink()
    os.symlink(out.parent / "elsewhere.onnx", out / "graphs" / "decode.onnx")
    shutil.copy(hybrid_npu.default_model() / "graphs" / "decode.onnx", out.parent / "elsewhere.onnx")


def _integrity_fifo(out):
    fifo(out / "graphs" / "pipe")
    edit_manifest(out, lambda m: m["integrity"]["files"].update({"graphs/pipe": {"bytes": 0, "sha256": "0" * 64}}))


def _graph_fifo_without_hashes(out):
    (out / "graphs" / "decode.onnx").unlink()
    fifo(out / "graphs" / "decode.onnx")
    edit_manifest(out, lambda m: m.pop("integrity"))  # an export from before hashes: sizes only


def _drafter_graph_fifo_without_hashes(out):
    (out / "drafter" / "drafter.onnx").unlink()
    fifo(out / "drafter" / "drafter.onnx")
    edit_manifest(out, lambda m: m.pop("integrity"))


def _integrity_dev_zero_link(out):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    os.symlink("/dev/zero", out / "zero")
    edit_manifest(out, lambda m: m["integrity"]["files"].update({"zero": {"bytes": 1 << 40, "sha256": "0" * 64}}))


def _tokenizer_dev_zero(out):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    (out / "tokenizer.json").unlink()
    os.symlink("/dev/zero", out / "tokenizer.json")


def _model_json_dev_zero(out):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    (out / "model.json").unlink()
    os.symlink("/dev/zero", out / "model.json")


def _model_json_deep(out):
    (out / "model.json").write_text("[" * 100_000 + "]" * 100_000)


def _model_json_huge(out):
    with open(out / "model.json", "r+b") as f:
        f.truncate(1 << 34)  # sparse: 16 GiB that reads as zeros


def _heads_huge(out):
    edit_manifest(out, lambda m: m["config"].update(num_key_value_heads=1 << 20))


def _head_dim_huge(out):
    edit_manifest(out, lambda m: m["config"].update(linear_value_head_dim=1 << 16))


def _chunk_huge(out):
    def edit(m):
        m["chunk"] = m["graphs"]["prefill"]["n"] = m["graphs"]["cpu"]["n"] = 1 << 24
    edit_manifest(out, edit)


def _decode_n_huge(out):
    edit_manifest(out, lambda m: m["graphs"]["decode"].update(n=3000))


def _npu_context_elsewhere(out):
    edit_manifest(out, lambda m: m.update(npu={"snapdragon-x-elite": {"context": {"files": ["../../ctx.onnx"]}}}))


def _draft_vocab_elsewhere(out):
    def edit(m):
        m["drafter"]["dir"] = "drafter"
    edit_manifest(out, edit)
    d = json.loads((out / "drafter" / "drafter.json").read_text())
    d["vocab"]["file"] = "/etc/passwd"
    (out / "drafter" / "drafter.json").write_text(json.dumps(d))


EXPORT_FOLDERS = {
    "integrity key /etc/passwd": (_integrity_outside, "points outside"),
    "integrity key ../secret": (_integrity_dotdot, "points outside"),
    "graph ../elsewhere/cpu.onnx": (_graph_elsewhere, "points outside"),
    "graph as an absolute path": (_graph_absolute, "points outside"),
    "drafter dir ../drafter": (_drafter_dir_outside, "points outside"),
    "graph symlinked out": (_symlink_out, "outside"),
    "integrity key a FIFO": (_integrity_fifo, "not a regular file"),
    "integrity key -> /dev/zero": (_integrity_dev_zero_link, "outside"),
    "graph a FIFO, no hashes": (_graph_fifo_without_hashes, "not a regular file"),
    "drafter graph a FIFO, no hashes": (_drafter_graph_fifo_without_hashes, "not a regular file"),
    "tokenizer.json -> /dev/zero": (_tokenizer_dev_zero, "tokenizer.json"),
    "model.json -> /dev/zero": (_model_json_dev_zero, "model.json"),
    "model.json nested 100k deep": (_model_json_deep, "nests too deeply"),
    "model.json of 16 GiB": (_model_json_huge, "more than the"),
    "num_key_value_heads 2^20": (_heads_huge, "model.json"),
    "linear_value_head_dim 2^16": (_head_dim_huge, "model.json"),
    "chunk 2^24": (_chunk_huge, "model.json"),
    "decode n 3000": (_decode_n_huge, "decode"),
    "draft vocabulary /etc/passwd": (_draft_vocab_elsewhere, "drafter"),
    "NPU context binary ../../ctx.onnx": (_npu_context_elsewhere, "points outside"),
}


@pytest.mark.parametrize("name", list(EXPORT_FOLDERS))
def test_hostile_export_folder_is_refused(export, tmp_path, name):
    make, needle = EXPORT_FOLDERS[name]
    make(export)
    beside = tmp_path / "notes.txt"
    beside.write_text("the user's notes")
    assert_refused(chat(export), needle)
    assert beside.read_text() == "the user's notes"


def test_integrity_oracle_reads_nothing_outside(export, tmp_path, monkeypatch):
    """The hash of an outside file is never computed (it would tell its content to whoever made
    the export): the refusal comes from the path alone."""
    from hybrid_npu import integrity

    secret = tmp_path / "secret.txt"
    secret.write_text("x")
    read = []
    real = integrity.file_hash
    monkeypatch.setattr(integrity, "file_hash", lambda p, *a: read.append(Path(p)) or real(p, *a))
    edit_manifest(export, lambda m: m["integrity"]["files"].update({str(secret): {"bytes": 1, "sha256": "0" * 64}}))
    with pytest.raises(UserError, match="points outside"):
        hybrid_npu.load_engine(export)
    assert secret.resolve() not in {p.resolve() for p in read}


# ---- 6. /load: the header is checked against the model and the memory plan first ---------------
LOAD = ("import sys, hybrid_npu\nfrom hybrid_npu.errors import UserError\n"
        "try:\n    hybrid_npu.load_engine(sys.argv[1], memory=int(sys.argv[3])).load_state(sys.argv[2])\n"
        "except UserError as e:\n    print(f'load: error: {e}', file=sys.stderr)\n    sys.exit(2)\n")


def hostile_snapshot(path: Path, model: Path, tensors: dict, position: int, data_bytes: int) -> Path:
    """A safetensors file of `data_bytes` (sparse: it costs no disk) whose header claims `tensors`
    ({name: (dtype, shape)}) laid end to end, for the model at `model`."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = int(np.prod(shape, dtype=np.int64)) * (8 if dtype in ("I64", "F64") else 4)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "hybrid-npu-state/2", "model": manifest_hash(model),
                              "position": str(position), "checkpoints": "[]", "checksum": "0" * 64}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + max(offset, data_bytes))
    return path


def _full_layer(model: Path):
    cfg = json.loads((model / "model.json").read_text())["config"]
    i = cfg["layer_types"].index("full_attention")
    return i, cfg["num_key_value_heads"], cfg["head_dim"]


def test_snapshot_longer_than_the_plan_is_refused_before_it_is_read(tmp_path):
    model = hybrid_npu.default_model()
    i, nkv, hd = _full_layer(model)
    pos = 50_000_000  # 6 GiB per K/V tensor, in a sparse file
    f = hostile_snapshot(tmp_path / "big.state", model, {f"attention.{i}.key": ("F32", (nkv, pos, hd)),
                                                         "tokens": ("I64", (pos,))}, pos, 0)
    run = run_bounded(["-c", LOAD, model, f, 1 << 30], rss_mb=900)
    assert_refused(run, "memory plan allows")


def test_snapshot_with_a_foreign_huge_tensor_is_refused_before_it_is_read(tmp_path):
    model = hybrid_npu.default_model()
    f = hostile_snapshot(tmp_path / "evil.state", model, {"evil": ("F32", (1 << 31,)), "tokens": ("I64", (1,))},
                         1, 0)
    assert_refused(run_bounded(["-c", LOAD, model, f, 1 << 30], rss_mb=900), "evil", "no place")


def test_snapshot_whose_header_lies_about_its_bytes(tmp_path):
    model = hybrid_npu.default_model()
    f = hostile_snapshot(tmp_path / "short.state", model, {"tokens": ("I64", (1 << 28,))}, 1 << 28, 0)
    with open(f, "r+b") as fh:
        fh.truncate(4096)  # the header claims 2 GiB of tokens, the file has 4 KB
    assert_refused(run_bounded(["-c", LOAD, model, f, 1 << 30], rss_mb=900), "truncated")


def test_a_refused_load_keeps_the_conversation(tmp_path):
    engine = hybrid_npu.load_engine(hybrid_npu.default_model(), checkpoints=0)
    engine.prefill([1, 2, 3, 4, 5])
    before = (engine.state.position, list(engine.state.tokens))
    i, nkv, hd = _full_layer(engine.path)
    f = hostile_snapshot(tmp_path / "x.state", engine.path, {f"attention.{i}.key": ("F32", (nkv, 10**8, hd))},
                         10**8, 0)
    with pytest.raises(UserError, match="memory plan allows"):
        engine.load_state(f)
    assert (engine.state.position, list(engine.state.tokens)) == before


# ---- 8. PDFs: pages streamed and counted as they come; pypdf's warnings stay quiet --------------
def _pdf(path: Path, contents: list[bytes], pages: int | None = None, bad_xref: bool = False) -> Path:
    """A PDF whose pages show `contents` (one stream per page, or one stream shared by `pages` pages)."""
    import zlib

    objs = [b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    streams = []
    for c in contents:
        data = zlib.compress(c, 9)
        objs.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(data) + data + b"\nendstream")
        streams.append(len(objs))
    n_pages = pages or len(contents)
    pages_id = len(objs) + n_pages + 1
    kids = []
    for k in range(n_pages):
        objs.append(b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Contents %d 0 R /Resources "
                    b"<< /Font << /F1 1 0 R >> >> >>" % (pages_id, streams[0 if pages else k]))
        kids.append(len(objs))
    objs.append(b"<< /Type /Pages /Kids [%s] /Count %d >>" % (b" ".join(b"%d 0 R" % k for k in kids), n_pages))
    objs.append(b"<< /Type /Catalog /Pages %d 0 R >>" % pages_id)
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % (o + (7 if bad_xref else 0)) for o in offsets)
    out += b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, len(objs),
                                                                              xref + (3 if bad_xref else 0))
    path.write_bytes(bytes(out))
    return path


def _text(lines: int) -> bytes:
    line = b"(" + b" ".join(b"word%d" % i for i in range(30)) + b") Tj T*\n"
    return b"BT /F1 10 Tf 12 TL 72 720 Td\n" + line * lines + b"ET"


def _pdf_ready():
    pytest.importorskip("pypdf")


def test_pdf_with_megabytes_of_text_on_one_page_is_refused_as_it_is_read(tmp_path):
    _pdf_ready()
    doc = _pdf(tmp_path / "dense.pdf", [_text(20_000)])  # 4 MB of text in a 17 KB file
    assert doc.stat().st_size < 64_000
    line = assert_refused(run_bounded([*SUMMARIZE, doc, "--memory", "2G"]), "dense.pdf", "at least")
    assert "tokens" in line


def test_pdf_of_pages_sharing_one_stream_is_refused_as_it_is_read(tmp_path):
    _pdf_ready()
    doc = _pdf(tmp_path / "shared.pdf", [_text(2_000)], pages=200)  # 200 pages x 400 KB of text, one stream
    assert_refused(run_bounded([*SUMMARIZE, doc, "--memory", "2G"]), "shared.pdf", "at least")


def test_one_huge_text_run_reaches_the_counter_in_blocks(tmp_path):
    """A single 300,000-character string on a page is counted in 64 KiB pieces, not tokenized whole."""
    _pdf_ready()
    from hybrid_npu.runtime.documents import BLOCK_BYTES, read_document

    doc = _pdf(tmp_path / "run.pdf", [b"BT /F1 10 Tf 72 720 Td (" + b"x" * 300_000 + b") Tj ET"])
    blocks = []
    text = read_document(doc, take=blocks.append)
    assert text == "x" * 300_000 and "".join(blocks) == text
    assert max(map(len, blocks)) <= BLOCK_BYTES and len(blocks) == -(-300_000 // BLOCK_BYTES)


def test_pypdf_warnings_never_reach_the_user(tmp_path):
    _pdf_ready()
    from hybrid_npu.runtime.documents import read_document

    doc = _pdf(tmp_path / "repaired.pdf", [_text(3)], bad_xref=True)  # pypdf repairs the xref, and says so
    run = run_bounded(["-c", "import sys; from hybrid_npu.runtime.documents import read_document; "
                             "print(len(read_document(sys.argv[1])))", doc])
    assert run.rc == 0 and run.err == "", run.err
    assert "word29" in read_document(doc)


# ---- 10 and 12. --tools and paths: regular files, bounded, shallow, short names -----------------
def _tools_dev_zero(tmp_path):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    return "/dev/zero", "not a regular file"


def _tools_fifo(tmp_path):
    return fifo(tmp_path / "tools.json"), "not a regular file"


def _tools_deep(tmp_path):
    f = tmp_path / "deep.json"
    f.write_text("[" * 100_000 + "]" * 100_000)
    return f, "nests too deeply"


def _tools_deep_in_limits(tmp_path):
    f = tmp_path / "deep.json"
    f.write_text('[{"type": "function", "function": {"name": "f", "parameters": ' + '{"a": ' * 500 + "1"
                 + "}" * 500 + "}}]")
    return f, "nests deeper than"


def _tools_huge(tmp_path):
    f = tmp_path / "huge.json"
    with open(f, "wb") as fh:
        fh.truncate(1 << 33)
    return f, "more than the"


def _tools_long_name(tmp_path):
    return tmp_path / ("t" * 300 + ".json"), "limit is 255"


TOOLS = {"/dev/zero": _tools_dev_zero, "a FIFO": _tools_fifo, "nested 100k deep": _tools_deep,
         "nested 500 deep": _tools_deep_in_limits, "8 GiB sparse": _tools_huge, "a 300-character name": _tools_long_name}


@pytest.mark.parametrize("name", list(TOOLS))
def test_hostile_tools_file_is_refused(tmp_path, name):
    path, needle = TOOLS[name](tmp_path)
    run = run_bounded([*CHAT, "--tools", path, "--prompt", "hi", "--render-only"], rss_mb=700)
    assert_refused(run, "--tools", needle)


def test_tools_for_a_template_without_tools_is_said(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text('[{"type": "function", "function": {"name": "now", "parameters": {}}}]')
    run = run_bounded([*CHAT, "--tools", tools, "--prompt", "hi", "--render-only"], rss_mb=700)
    assert_refused(run, "no tools section", "--tools")


@pytest.mark.parametrize("argv", [
    [*CHAT, "/tmp/" + "m" * 256, "--prompt", "hi"],
    [*SUMMARIZE, "d" * 300 + ".txt"],
    [*SUMMARIZE, "notes.txt", "--model", "x" * 400],
    ["-m", "hybrid_npu.export.cli", "src", "o" * 256 + "/out"],
], ids=["chat model", "summarize file", "summarize --model", "export output"])
def test_path_component_over_255_characters(argv, tmp_path):
    assert_refused(run_bounded(argv, cwd=tmp_path, rss_mb=700), "limit is 255")


def test_summarize_refuses_a_fifo_and_a_device(tmp_path):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    assert_refused(run_bounded([*SUMMARIZE, "/dev/zero"], rss_mb=700), "not a file")
    assert_refused(run_bounded([*SUMMARIZE, fifo(tmp_path / "pipe.txt")], rss_mb=700), "not a file")


# ---- 13. /save: a killed save's temporary file is removed by the next save ---------------------
def test_next_save_removes_temporaries_of_killed_saves(tmp_path):
    import subprocess

    from hybrid_npu.runtime.atomic_io import write_atomically

    target = tmp_path / "chat.state"
    # a process that dies holding a temporary save file: SIGKILL gives it no chance to clean up
    code = ("import sys, time; from pathlib import Path; from hybrid_npu.runtime.atomic_io import write_atomically\n"
            "def write(tmp):\n    Path(tmp).write_bytes(b'x' * 1000); print('writing', flush=True); time.sleep(60)\n"
            "write_atomically(Path(sys.argv[1]), write, 'chat')\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    child.kill()
    child.wait()
    left = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1
    mine = tmp_path / ".chat.state.notes.tmp"  # not a name the saver gives: never touched
    mine.write_text("the user's")
    write_atomically(target, lambda tmp: Path(tmp).write_bytes(b"saved"), "chat")
    assert target.read_bytes() == b"saved"
    assert not left[0].exists() and mine.read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".chat.state.notes.tmp", "chat.state"])
