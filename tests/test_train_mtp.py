"""scripts/train/train_mtp.py end to end on the tiny fixture: short and long-context data, the windowed
training mask, a saved head that exports and speculates losslessly, and --init continuing from it.
(The head's unroll against the runtime's windowed drafter: tests/test_mtp_drafter.py.)"""
import json

import pytest

import train_mtp  # noqa: E402
from test_train_drafter import _corpus  # noqa: E402  (the same small corpus)

ARGS = ["--prompts", "8", "--gen-tokens", "12", "--max-prompt", "48", "--eval-prompts", "3",
        "--runtime-prompts", "1", "--ttt-steps", "2", "--batch", "4", "--threads", "1",
        "--long-prompts", "3", "--max-context", "512", "--window", "24"]


@pytest.fixture(scope="module")
def trained(text_tied, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_train")
    corpus = _corpus(root / "corpus")
    rc = train_mtp.main([str(text_tied.src), str(root / "head"), "--corpus-root", str(corpus), "--max-steps", "3",
                         *ARGS])
    assert rc == 0
    return root, corpus


def test_a_long_context_run_trains_evaluates_and_speculates_losslessly(trained):
    root, _ = trained
    log = json.loads((root / "head" / "train_log.json").read_text())
    assert log["final_step"] == 3 and all(len(x) == 2 for x in log["loss_per_ttt_step"])
    assert log["data"]["train_sequences"] == 8 + 3 and log["data"]["long_sequences"] == 3
    assert log["eval_chain_long"]["rounds"] > 0 and log["eval_chain_before_long"]["rounds"] > 0
    assert log["settings"]["window"] == 24
    assert log["eval_runtime"]["all_lossless"] and log["eval_runtime"]["prompts"] == 1


def test_init_continues_from_the_saved_head(trained, text_tied):
    """A second run from the first's head starts where the first ended: its evaluation before
    training is the first run's evaluation after it (same held-out data, same head)."""
    root, corpus = trained
    rc = train_mtp.main([str(text_tied.src), str(root / "again"), "--corpus-root", str(corpus), "--max-steps", "1",
                         "--init", str(root / "head"), *ARGS])
    assert rc == 0
    first = json.loads((root / "head" / "train_log.json").read_text())
    again = json.loads((root / "again" / "train_log.json").read_text())
    for key in ("", "_long"):
        assert again["eval_chain_before" + key] == first["eval_chain" + key]


def test_bad_options_are_one_line_exit_2(tmp_path, text_tied, capsys):
    for extra, words in ((["--window", "-1"], "--window"), (["--long-prompts", "2", "--max-context", "100"], "--max-context"),
                         (["--init", str(tmp_path)], "--init")):
        assert train_mtp.main([str(text_tied.src), str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err


def test_build_embedded_model_mtp_only_swaps_the_head_and_keeps_the_rest(trained, text_tied, text_untied, tmp_path,
                                                                         capsys, monkeypatch):
    """--mtp-only replaces the package's mtp/ and its training record and nothing else (the target's and
    EAGLE-3 drafter's files keep their hashes); the package loads (integrity) and speculates losslessly
    with the new head; a head offered with another target is refused in one line, the package untouched."""
    import build_embedded_model

    import hybrid_npu
    from hybrid_npu.export.exporter import export

    root, corpus = trained
    second = tmp_path / "second"  # one more step from the first head: another head for the same target
    assert train_mtp.main([str(text_tied.src), str(second), "--corpus-root", str(corpus), "--max-steps", "1",
                           "--init", str(root / "head"), *ARGS]) == 0
    pkg = tmp_path / "pkg"
    export(text_tied.src, pkg, dtype="fp16", mtp=root / "head", drafter_weights="int8",
           verify=build_embedded_model.VERIFY_NODES)
    hashes = lambda: json.loads((pkg / "model.json").read_text())["integrity"]["files"]  # noqa: E731
    before = hashes()
    assert build_embedded_model.main([str(text_tied.src), "--mtp", str(second), "--mtp-only",
                                      "--out", str(pkg)]) == 0
    after = hashes()
    changed = {f for f in after if before.get(f) != after[f]}
    assert "mtp/mtp_weights.bin" in changed and set(before) <= set(after)
    assert all(f.startswith("mtp/") or f == "training.json" for f in changed), changed
    assert json.loads((pkg / "training.json").read_text())["mtp"] == build_embedded_model.training_record(second)

    engine = hybrid_npu.load_engine(pkg, threads=1, drafter="mtp")
    engine.pipelines["verify"]  # open now, not while the first steps decode plainly
    engine.adaptive = False  # every step a round
    ids = [5, 17, 33, 2, 90, 41]
    fast = engine.generate(ids, 24, speculative=True, stop_at_eos=False)
    stats = engine.last_stats
    assert fast == engine.generate(ids, 24, speculative=False, stop_at_eos=False)
    assert stats["rounds"] > 0 and stats["plain_steps"] == 0, stats

    capsys.readouterr()
    assert build_embedded_model.main([str(text_untied.src), "--mtp", str(root / "head"), "--mtp-only",
                                      "--out", str(pkg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is not the target" in err and "checkpoint_from_export" in err
    assert hashes() == after
    monkeypatch.setattr(build_embedded_model, "CEILING_BYTES", 2**20)  # a package over the ceiling: refused too
    assert build_embedded_model.main([str(text_tied.src), "--mtp", str(root / "head"), "--mtp-only",
                                      "--out", str(pkg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ceiling" in err and hashes() == after and not (pkg / "mtp.new").exists()


def test_build_embedded_model_graphs_only_refreshes_a_stale_graph_and_keeps_the_rest(trained, text_tied, text_untied,
                                                                                     tmp_path, capsys):
    """--graphs-only re-exports the target's graphs and replaces those this tree builds differently (a
    stale cpu_verify.onnx, a wrong model.json entry), keeping weights.bin, drafter/ and mtp/ byte for byte;
    the package then loads (integrity) and speculates losslessly; another target is refused in one line."""
    import onnx
    import build_embedded_model

    import hybrid_npu
    from hybrid_npu.export.exporter import export

    root, _ = trained
    pkg = tmp_path / "pkg"
    export(text_tied.src, pkg, dtype="fp16", mtp=root / "head", drafter_weights="int8",
           verify=build_embedded_model.VERIFY_NODES)
    current = (pkg / "graphs/cpu_verify.onnx").read_bytes()
    stale = onnx.load_from_string(current)  # an older build of the same graph: other bytes, same weights
    stale.doc_string = "built by an older tree"
    (pkg / "graphs/cpu_verify.onnx").write_bytes(stale.SerializeToString())
    manifest = json.loads((pkg / "model.json").read_text())
    manifest["graphs"]["cpu_verify"]["nodes"] = 1
    build_embedded_model.write_records(pkg, manifest, {})
    hashes = lambda: json.loads((pkg / "model.json").read_text())["integrity"]["files"]  # noqa: E731
    before = hashes()

    assert build_embedded_model.main([str(text_tied.src), "--graphs-only", "--out", str(pkg)]) == 0
    after = hashes()
    assert {f for f in after if before.get(f) != after[f]} == {"graphs/cpu_verify.onnx"}
    assert (pkg / "graphs/cpu_verify.onnx").read_bytes() == current
    assert json.loads((pkg / "model.json").read_text())["graphs"]["cpu_verify"]["nodes"] > 1
    engine = hybrid_npu.load_engine(pkg, threads=1, drafter="mtp")
    engine.adaptive = False  # every step a round
    ids = [5, 17, 33, 2, 90, 41]
    assert engine.generate(ids, 16, speculative=True, stop_at_eos=False) == \
        engine.generate(ids, 16, speculative=False, stop_at_eos=False)

    capsys.readouterr()
    assert build_embedded_model.main([str(text_untied.src), "--graphs-only", "--out", str(pkg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "is not the target" in err and "checkpoint_from_export" in err
    assert hashes() == after
