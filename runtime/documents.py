"""The text of a document to summarise: .txt and .md as UTF-8, .pdf through pypdf (the `pdf` extra).

Every problem (missing, unreadable, not UTF-8, an unknown suffix, no text at all) is a UserError
of one line that names the file and the fix.
"""
from __future__ import annotations

from pathlib import Path

from hybrid_npu.errors import UserError

TEXT_SUFFIXES = (".txt", ".md")
PDF_SUFFIX = ".pdf"
SUFFIXES = TEXT_SUFFIXES + (PDF_SUFFIX,)


def read_document(path) -> str:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist; give the document to summarize")
    if not path.is_file():
        raise UserError(f"{path} is not a file; give a {', '.join(SUFFIXES)} document")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UserError(f"{path}: {suffix or 'a file without a suffix'} is not a supported document type; "
                        f"give a {', '.join(SUFFIXES)} file (convert it to .txt first)")
    text = _read_pdf(path) if suffix == PDF_SUFFIX else _read_text(path)
    if not text.strip():
        hint = " (a scanned PDF needs OCR first)" if suffix == PDF_SUFFIX else ""
        raise UserError(f"{path} has no text to summarize{hint}; give a non-empty document")
    return text


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}; check that the file is readable") from None
    try:
        text = raw.decode("utf-8-sig")  # a BOM (Windows editors write one) is not part of the text
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (invalid byte at offset {e.start}); save it as UTF-8") from None
    return text.replace("\r\n", "\n")


def _read_pdf(path: Path) -> str:
    try:
        from pypdf import PdfReader
    except ImportError:
        raise UserError(f"{path}: reading PDF needs pypdf; install it with: pip install hybrid-npu[pdf]") from None
    try:
        reader = PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            raise UserError(f"{path} is password-protected; save an unprotected copy or export it as .txt")
        pages = [page.extract_text() or "" for page in reader.pages]
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged PDF fails anywhere inside pypdf; the user needs one line
        reason = " ".join(str(e).split())  # pypdf messages may span lines
        raise UserError(f"{path} is not a readable PDF ({type(e).__name__}: {reason}); "
                        "check the file or export it as .txt") from None
    return "\n\n".join(p.strip() for p in pages if p.strip())
