"""npu-chat: the terminal REPL. Until its own issue lands it only explains itself."""
from __future__ import annotations

import sys

from hybrid_npu.cli_common import OneLineParser


def main(argv=None) -> int:
    p = OneLineParser(prog="npu-chat", description="Chat with an exported hybrid model (REPL coming; "
                                "for now use the Python API: hybrid_npu.load(DIR).generate(...)).")
    p.add_argument("model", nargs="?", help="an export-hybrid output directory")
    try:
        p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
