"""The small byte-level BPE tokenizers this project trains (the embedded model's, by
train_target.py, and the test fixtures'): one pre-tokenizer, one set of added tokens, one ChatML
template, one tokenizer_config, so the two cannot drift apart.

The added tokens and the template follow the released Qwen3.5 small models: `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>` special; `<think>`, `</think>` added but not special; a reply starts
with an empty think block unless `enable_thinking` is true.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]
# the Qwen2/3 pre-tokenizer split (numbers one digit at a time)
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
               r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is not defined or enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def train_bpe(texts, merged_vocab: int):
    """A byte-level BPE of `merged_vocab` entries (the 256 bytes + merges), then the added tokens
    after them (ids merged_vocab .. merged_vocab + 4, in SPECIALS + THINK_TOKENS order)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=merged_vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok


def tokenizer_config(tok) -> dict:
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": t in SPECIALS}
             for t in SPECIALS + THINK_TOKENS}
    return {"tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
            "added_tokens_decoder": added, "additional_special_tokens": SPECIALS[1:], "bos_token": None,
            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
            "clean_up_tokenization_spaces": False, "split_special_tokens": False, "model_max_length": 65536,
            "chat_template": CHAT_TEMPLATE}


def write_tokenizer(tok, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template), as a checkpoint carries them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")
