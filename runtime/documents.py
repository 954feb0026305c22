"""The text of a document to summarise: .txt and .md as UTF-8, .pdf through pypdf (the `pdf` extra),
any other file whose first bytes are UTF-8 text (a README, notes.log, code) as text too.

Every problem (missing, unreadable, not UTF-8, binary, no text at all) is a UserError of one line
that names the file and the fix. Text is read in blocks and handed to an optional `take(block)`
(npu-summarize counts tokens there and stops a document too long for the context before it is
all in memory).
"""
from __future__ import annotations

import codecs
import logging
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from hybrid_npu.errors import UserError

TEXT_SUFFIXES = (".txt", ".md")
PDF_SUFFIX = ".pdf"
SUFFIXES = TEXT_SUFFIXES + (PDF_SUFFIX,)
CONVERT_FIRST = (".docx", ".doc", ".odt", ".rtf", ".epub", ".pages", ".pptx", ".xlsx")  # formats, not text
SNIFF_BYTES = 8192
_TEXT_CONTROLS = b"\t\n\r\x0b\x0c\x1b"
BLOCK_BYTES = 1 << 16  # a block's tokenizer output stays a few MB


def check_document(path) -> str:
    """'text' or 'pdf' for a document we can read, else a UserError; reads at most SNIFF_BYTES."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist; give the document to summarize")
    if not path.is_file():
        raise UserError(f"{path} is not a file; give a {', '.join(SUFFIXES)} document")
    suffix = path.suffix.lower()
    if suffix == PDF_SUFFIX:
        return "pdf"
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in CONVERT_FIRST:
        raise UserError(f"{path}: {suffix} is not a supported document type; "
                        f"give a {', '.join(SUFFIXES)} file (convert it to .txt first)")
    head = _open(path).read(SNIFF_BYTES)
    bad = _binary_at(head)
    if bad is not None:
        raise UserError(f"{path} is not a text document (binary data at byte {bad}); "
                        f"give a {', '.join(SUFFIXES)} file or UTF-8 text")
    return "text"


def _binary_at(head: bytes) -> int | None:
    """Offset of the first byte that is not UTF-8 text (a control byte other than tab, newline,
    CR, form feed or ESC, or an invalid sequence), else None."""
    for i, b in enumerate(head):
        if (b < 0x20 and b not in _TEXT_CONTROLS) or b == 0x7F:
            return i
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a cut character at the end is fine
    except UnicodeDecodeError as e:
        return e.start
    return None


def read_document(path, take: Callable[[str], None] | None = None) -> str:
    """The document's text; `take(block)` sees it block by block as it is read and may refuse (raise)."""
    path = Path(path)
    kind = check_document(path)
    if kind == "pdf":
        text = _read_pdf(path, take)
    else:
        text = _read_text(path, take)
    if not text.strip():
        hint = " (a scanned PDF needs OCR first)" if kind == "pdf" else ""
        raise UserError(f"{path} has no text to summarize{hint}; give a non-empty document")
    return text


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}; check that the file is readable") from None


def _read_text(path: Path, take: Callable[[str], None] | None = None) -> str:
    """UTF-8 in blocks (a BOM, which Windows editors write, is not part of the text; CRLF -> LF).
    Each block ends at a line start followed by a non-space, where a tokenizer's word split falls anyway."""
    decoder, parts, carry, offset = codecs.getincrementaldecoder("utf-8-sig")(), [], "", 0
    with _open(path) as f:
        while True:
            try:
                raw = f.read(BLOCK_BYTES)
            except OSError as e:
                raise UserError(f"cannot read {path}: {e.strerror or e}; check that the file is readable") from None
            try:
                text = carry + decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise UserError(f"{path} is not UTF-8 text (invalid byte at offset {offset + e.start}); "
                                "save it as UTF-8") from None
            offset += len(raw)
            tail = "\r" if raw and text.endswith("\r") else ""  # a CRLF may be split over two reads
            text = text[:-1] if tail else text
            cut = _block_end(text) if raw else len(text)  # never inside a CRLF: cuts follow a "\n"
            block, carry = text[:cut].replace("\r\n", "\n"), text[cut:] + tail
            if block:
                parts.append(block)
                if take:
                    take(block)
            if not raw:
                return "".join(parts)


def _block_end(text: str) -> int:
    """After the last newline that a non-space follows (the whole text when there is none)."""
    i = len(text) - 1
    while True:
        i = text.rfind("\n", 0, i)
        if i < 0:
            return len(text)
        if i + 1 < len(text) and not text[i + 1].isspace():
            return i + 1


PDF_BYTES = 512 << 20  # the file itself: pypdf holds it in memory


class _Runs:
    """Text runs as pypdf's extraction meets them, handed to `take` in blocks of about BLOCK_BYTES
    characters: a page holding megabytes of text is counted, and refused, while it is extracted.
    The runs are joined without separators, so they count at most the tokens of the text that
    extract_text returns (which adds spaces and newlines between them)."""

    def __init__(self, take: Callable[[str], None]):
        self.take, self.runs, self.size = take, [], 0

    def __call__(self, text, *_):
        if not text:
            return
        self.runs.append(text)
        self.size += len(text)
        if self.size >= BLOCK_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.runs:
            text, self.runs, self.size = "".join(self.runs), [], 0
            for i in range(0, len(text), BLOCK_BYTES):  # one run may itself be megabytes
                self.take(text[i:i + BLOCK_BYTES])


@contextmanager
def _quiet_pypdf():
    """pypdf reports what it repairs through logging and warnings: not the user's lines to read."""
    logger = logging.getLogger("pypdf")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.CRITICAL + 1)
    logger.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
        logger.propagate = propagate


def _read_pdf(path: Path, take: Callable[[str], None] | None = None) -> str:
    """Page by page; `take` sees each page's text as it is extracted (and may refuse, raising)."""
    try:
        from pypdf import PdfReader
    except ImportError:
        raise UserError(f"{path}: reading PDF needs pypdf; install it with: pip install hybrid-npu[pdf]") from None
    size = path.stat().st_size
    if size > PDF_BYTES:
        raise UserError(f"{path} is {size} bytes, more than the {PDF_BYTES} a PDF may have here; "
                        "export its text as .txt and summarize that")
    pages = []
    try:
        with _quiet_pypdf():
            reader = PdfReader(path)
            if reader.is_encrypted and not reader.decrypt(""):
                raise UserError(f"{path} is password-protected; save an unprotected copy or export it as .txt")
            for page in reader.pages:
                runs = _Runs(take) if take else None
                text = (page.extract_text(visitor_text=runs) or "").strip()
                if runs:
                    runs.flush()
                if text:
                    pages.append(text)
    except UserError:
        raise
    except RecursionError:
        raise UserError(f"{path} is not a readable PDF (its objects nest too deeply); "
                        "check the file or export it as .txt") from None
    except Exception as e:  # noqa: BLE001 - a damaged PDF fails anywhere inside pypdf; the user needs one line
        reason = " ".join(str(e).split())[:200]  # pypdf messages may span lines
        raise UserError(f"{path} is not a readable PDF ({type(e).__name__}: {reason}); "
                        "check the file or export it as .txt") from None
    return "\n\n".join(pages)
