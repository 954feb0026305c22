"""The embedded model's training text: the Python standard library's own sources, which every
Python install carries (licence: PSF License Agreement, https://docs.python.org/3/license.html).

Three kinds of document, each assigned to train or held-out by a hash of its name, so the
target, the drafter and the benchmarks all see the same split:
  * code: a module's source (site-packages and the test suites left out);
  * write: a chat turn "Write a Python function that <docstring summary>" -> the function;
  * summarize: a chat turn "Summarize the following document." + a function without its
    docstring -> the docstring's first paragraph (what npu-summarize asks for).
"""
from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}
SUMMARIZE_INSTRUCTION = "Summarize the following document."


@dataclass(frozen=True)
class Document:
    name: str
    kind: str          # "code" | "write" | "summarize"
    text: str          # code: the source; chat kinds: the assistant's answer
    prompt: str = ""   # chat kinds: the user's message

    @property
    def held_out(self) -> bool:
        return hashlib.sha256(self.name.encode()).digest()[0] < 8      # ~3% of documents


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1]))


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            if doc and 20 <= len(doc.split("\n\n")[0]) <= 300:
                yield node, doc


def _without_docstring(seg: str, node) -> str:
    first, top = node.body[0], min([node.lineno] + [d.lineno for d in node.decorator_list])
    lines = seg.splitlines(keepends=True)
    return "".join(lines[:first.lineno - top] + lines[first.end_lineno - top + 1:])


def documents(root: Path | None = None, max_chat_chars: int = 1200) -> list[Document]:
    docs: list[Document] = []
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        docs.append(Document(rel, "code", src))
        lines = src.splitlines(keepends=True)
        for node, doc in _functions(tree):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            seg = textwrap.dedent("".join(lines[start - 1:node.end_lineno])).rstrip() + "\n"
            if len(seg) > max_chat_chars:
                continue
            summary = " ".join(doc.split("\n\n")[0].split())
            name = f"{rel}:{node.lineno}"
            docs.append(Document(name + ":write", "write", seg,
                                 f"Write a Python function that does this: {summary}"))
            body = _without_docstring(seg, node)
            docs.append(Document(name + ":summarize", "summarize", summary,
                                 f"{SUMMARIZE_INSTRUCTION}\n\n{body}"))
    return docs


def chat_text(prompt: str, answer: str | None = None) -> str:
    """ChatML, the same text the shipped chat template renders (thinking off)."""
    head = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return head if answer is None else head + answer + "<|im_end|>\n"


def training_text(doc: Document) -> str:
    return doc.text if doc.kind == "code" else chat_text(doc.prompt, doc.text)
