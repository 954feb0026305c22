"""What a checkpoint's tokenizer and generation files say about chatting: the tokens that end a
turn, the chat template (and which file it came from), and the sampling defaults.

Stop tokens are the union of generation_config.json's eos_token_id, config.json's and
tokenizer_config.json's eos_token (as transformers' and mlx-lm's chat pipelines stop): a released
Qwen3.5 ends every reply with <|im_end|>, which only tokenizer_config.json names when the checkpoint
ships no generation_config.json or one that lists <|endoftext|> alone.

Template precedence is transformers 5's: a chat_template.jinja file beats tokenizer_config.json's
"chat_template", which beats a (processor-style) chat_template.json.
"""
from __future__ import annotations

from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.safe_files import CONFIG_BYTES, TOKENIZER_BYTES, read_json as _read_json, read_text

SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")


def read_json(file: Path, what: str):
    """A JSON file of the checkpoint (a bounded regular file), or a one-line error naming it; None
    when absent. tokenizer.json is large and shallow; the rest small."""
    if not file.exists() and not file.is_symlink():
        return None
    big = file.name == "tokenizer.json"
    return _read_json(file, TOKENIZER_BYTES if big else CONFIG_BYTES, what, "fix or remove the file",
                      max_depth=None if big else 64)


def _as_dict(value, file: Path) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{file}: expected a JSON object, found {type(value).__name__}; fix or remove the file")
    return value


def _ids(value) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def token_id(path: Path, tok_cfg: dict, text: str) -> int | None:
    """The id of a special token by its text: tokenizer_config.json's added_tokens_decoder (tok_cfg,
    already read), else tokenizer.json's added tokens and vocabulary."""
    for key, entry in (tok_cfg.get("added_tokens_decoder") or {}).items():
        if _token_text(entry) == text and str(key).isdigit():
            return int(key)
    tok = read_json(path / "tokenizer.json", "tokenizer.json")
    if isinstance(tok, dict):
        for entry in tok.get("added_tokens") or []:
            if isinstance(entry, dict) and entry.get("content") == text and isinstance(entry.get("id"), int):
                return entry["id"]
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
            return vocab[text]
    return None


def stop_token_ids(path: Path, raw: dict, text: dict) -> tuple[tuple[int, ...], dict[str, list[int]]]:
    """The union of every file's end-of-sequence ids (first-seen order), and which file gave which."""
    gen = _as_dict(read_json(path / "generation_config.json", "generation_config.json"),
                   path / "generation_config.json")
    sources = {"generation_config.json": _ids(gen.get("eos_token_id")),
               "config.json": _ids(text.get("eos_token_id", raw.get("eos_token_id")))}
    tok_cfg = _as_dict(read_json(path / "tokenizer_config.json", "tokenizer_config.json"),
                       path / "tokenizer_config.json")
    eos_text = _token_text(tok_cfg.get("eos_token"))
    if isinstance(eos_text, str):
        eos = token_id(path, tok_cfg, eos_text)
        sources["tokenizer_config.json"] = [] if eos is None else [eos]
    union = tuple(dict.fromkeys(i for ids in sources.values() for i in ids))
    return union, {k: v for k, v in sources.items() if v}


def _pick(template):
    """tokenizer_config.json may hold one template or a list of named ones; chat uses "default"."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


def chat_template(path: Path) -> tuple[str | None, str | None]:
    """(template source, the file it came from), by transformers 5's precedence; (None, None): none."""
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        return read_text(jinja, CONFIG_BYTES, "the chat template", "fix or remove the file"), jinja.name
    for name in ("tokenizer_config.json", "chat_template.json"):
        data = read_json(path / name, name)
        source = _pick(data.get("chat_template")) if isinstance(data, dict) else None
        if source:
            return source, name
    return None, None


def sampling_defaults(path: Path) -> dict:
    """generation_config.json's do_sample/temperature/top_k/top_p, those it sets."""
    gen = _as_dict(read_json(path / "generation_config.json", "generation_config.json"),
                   path / "generation_config.json")
    out = {}
    for key in SAMPLING_KEYS:
        value = gen.get(key)
        if key == "do_sample" and isinstance(value, bool):
            out[key] = value
        elif key != "do_sample" and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = int(value) if key == "top_k" else float(value)
    return out
