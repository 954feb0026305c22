"""engine.last_stats describes the last call that ran the model, prefill_logits included."""
import hybrid_npu


def test_prefill_logits_replaces_the_last_generate_stats(text_tied):
    engine = hybrid_npu.load_engine(text_tied.out)
    engine.generate([1, 2, 3], 4, stop_at_eos=False)
    assert engine.last_stats["decode_tokens"] == 4
    ids = list(range(5, 5 + 11))
    engine.prefill_logits(ids)
    s = engine.last_stats
    assert s["prefill_tokens"] == len(ids) and s["decode_tokens"] == 0 and "decode_tokens_per_s" not in s
    assert s["prefill_device"] == "CPU" and s["prefill_tokens_per_s"] > 0 and s["context_tokens"] == len(ids)
