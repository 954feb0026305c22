"""Text files the exporter is given by a flag (--calibration, --mtp-vocab-text): read as UTF-8 and
tokenized with the checkpoint's own tokenizer, each fault a one-line UserError naming the flag."""
from __future__ import annotations

from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.safe_files import TOKENIZER_BYTES, check_names, read_bytes, read_text

TEXT_BYTES = 256 << 20  # a calibration or vocabulary sample: only its first few thousand tokens count


def read_text_input(flag: str, path, what: str) -> str:
    """The text of the file `path` given by `flag`; what: the fix's words for the file wanted
    ("a UTF-8 text file of ...")."""
    path = Path(path)
    check_names(path, flag)
    if not path.exists():
        raise UserError(f"{flag} {path}: no such file; give {what}")
    if not path.is_file():
        raise UserError(f"{flag} {path} is not a file; give {what}")
    data = read_bytes(path, TEXT_BYTES, f"{flag} file", f"give {what}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{flag} {path} is not UTF-8 text; convert it (e.g. a .txt or .md file)") from None
    if not text.strip():
        raise UserError(f"{flag} {path} is empty; give {what}")
    return text


def text_tokenizer(flag: str, tokenizer_json: Path):
    """The checkpoint's tokenizer, which `flag`'s text is counted in."""
    tokenizer_json = Path(tokenizer_json)
    if not tokenizer_json.is_file():
        raise UserError(f"{flag} needs the checkpoint's tokenizer.json, which {tokenizer_json.parent} lacks")
    from tokenizers import Tokenizer

    return Tokenizer.from_str(read_text(tokenizer_json, TOKENIZER_BYTES, "tokenizer.json",
                                        "copy the model's tokenizer.json again"))
