"""An EAGLE-3 drafter exported beside the target: export-hybrid --drafter, load() picks it up,
speculation is on by default and lossless."""
import numpy as np
from conftest import CHUNK, assert_speculation_accounts_for

import drafter_fixtures
import hybrid_npu
from hybrid_npu.export.exporter import export


def test_exported_eagle3_drafter_speculates_losslessly(text_tied, tmp_path):
    weights = drafter_fixtures.drafter_weights(seed=1, hidden_size=48, embed=False)  # shares the target embedding
    src = drafter_fixtures.write_eagle3(tmp_path / "eagle3", weights, hidden_size=48)
    out = tmp_path / "export"
    export(text_tied.src, out, chunk=CHUNK, drafter=src)
    assert (out / "drafter" / "drafter.json").exists()
    engine = hybrid_npu.load_engine(out)
    assert engine.drafter is not None
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, 300, CHUNK + 4)]
    plain = engine.generate(prompt, 96, stop_at_eos=False, speculative=False)
    spec = engine.generate(prompt, 96, stop_at_eos=False)  # speculative by default with a drafter
    assert spec == plain
    stats = engine.last_stats
    assert stats["draft_s"] > 0
    assert_speculation_accounts_for(stats, len(spec))
    sampled = engine.generate(prompt, 24, temperature=0.8, top_p=0.95, seed=3, stop_at_eos=False)
    assert len(sampled) == 24
