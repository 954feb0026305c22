"""The embedded default model ships inside the installed package with its drafter, under the size
ceiling, and is what the CLIs open when no model is given; speculation on it is lossless."""
import json
import subprocess
import sys

import hybrid_npu
from hybrid_npu.runtime.chat.template import ChatTemplate

from conftest import assert_speculation_accounts_for

CEILING = 40 * 2**20
PROMPT = "Write a Python function that does this: Return the first line of a text file."


def test_the_package_carries_the_model_and_its_drafter_under_40_mb():
    root = hybrid_npu.default_model()  # raises (fails) when packaging dropped it
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert size <= CEILING, f"{size / 2**20:.1f} MiB"
    manifest = json.loads((root / "model.json").read_text())
    assert manifest["drafter"]["dir"] == "drafter" and "verify" in manifest["graphs"]
    training = json.loads((root / "training.json").read_text())
    assert training["target"]["held_out_perplexity"] > 1 and "eval_runtime" in training["drafter"]


def rendered(engine, text):
    template = ChatTemplate.from_export(engine.path)
    return engine.tokenizer.encode(template.render([{"role": "user", "content": text}], enable_thinking=False),
                                   add_special_tokens=False).ids


def test_speculation_on_the_embedded_pair_is_lossless_and_accepts_drafts():
    engine = hybrid_npu.load_engine(hybrid_npu.default_model(), threads=1)
    assert engine.drafter is not None
    ids = rendered(engine, PROMPT)
    fast = engine.generate(ids, 64, speculative=True, stop_at_eos=False)
    stats = engine.last_stats
    plain = engine.generate(ids, 64, speculative=False, stop_at_eos=False)
    assert fast == plain
    # a trained pair must beat a drafter that never agrees (acceptance length 1.0)
    assert stats["acceptance_length"] > 1.3, stats


def test_full_depth_rounds_on_the_embedded_pair_verify_the_whole_chain_and_stay_lossless():
    """The shipped draft shape is a deep chain because this pair's drafts are accepted far down
    (docs/speculation.md): rounds at the recorded depth verify all its nodes on the
    CPU, emit what plain decoding does, and accept past the depth-6 chain's ceiling of 7 a round."""
    engine = hybrid_npu.load_engine(hybrid_npu.default_model(), threads=1)
    engine.pipelines["verify"]  # opened now, not still opening while the first steps decode plainly
    depth = engine.draft_shape["depth"]
    assert engine.draft_shape["top_k"] == 1 and engine.verify_graph(depth) == ("CPU", depth + 1)
    engine.adaptive = False  # every step a round of the recorded depth
    ids = rendered(engine, PROMPT)
    fast = engine.generate(ids, 64, speculative=True, stop_at_eos=False)
    stats = engine.last_stats
    assert fast == engine.generate(ids, 64, speculative=False, stop_at_eos=False)
    assert stats["plain_steps"] == 0 and stats["acceptance_length"] > 7, stats


def test_npu_chat_one_shot_json_uses_the_embedded_model_by_default():
    r = subprocess.run([sys.executable, "-m", "hybrid_npu.runtime.chat.cli", "--prompt", PROMPT,
                        "--max-new-tokens", "24", "--json", "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    engine = hybrid_npu.load_engine(hybrid_npu.default_model(), threads=1)
    assert out["token_ids"] == engine.generate(rendered(engine, PROMPT), 24, speculative=False)
    assert out["text"] == engine.tokenizer.decode(out["token_ids"])
    # on by default with a drafter; a 24-token reply in a fresh process may end before the verify
    # session has opened in the background, and then decodes plainly
    assert_speculation_accounts_for(out["stats"], len(out["token_ids"]), rounds_at_least=0)


def test_npu_chat_drafter_mtp_speculates_with_the_shipped_mtp_head():
    """--drafter mtp picks the MTP head the embedded model ships beside EAGLE-3: the reply is the
    plain decode's; an export without one is refused in one line (exit 2)."""

    engine = hybrid_npu.load_engine(hybrid_npu.default_model(), threads=1, drafter="mtp")
    assert type(engine.drafter).__name__ == "MtpDrafter"
    ids = rendered(engine, PROMPT)
    fast = engine.generate(ids, 48, speculative=True, stop_at_eos=False)
    rounds = engine.last_stats["rounds"]
    assert fast == engine.generate(ids, 48, speculative=False, stop_at_eos=False)
    assert rounds > 0
    r = subprocess.run([sys.executable, "-m", "hybrid_npu.runtime.chat.cli", "--prompt", PROMPT, "--drafter", "mtp",
                        "--max-new-tokens", "24", "--json", "--threads", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == engine.generate(ids, 24, speculative=False)


def test_npu_chat_drafter_kind_the_export_lacks_is_one_line(text_tied, capsys):
    from hybrid_npu.runtime.chat.cli import main

    assert main([str(text_tied.out), "--prompt", "hi", "--drafter", "mtp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "ships no mtp drafter" in err and "--drafter mtp" in err, err
