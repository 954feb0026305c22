"""The flags every model-running CLI shares (npu-chat, npu-summarize): which model, on which
device profile, with what memory and threads; checked the same way and opened the same way."""
from __future__ import annotations

from pathlib import Path

from hybrid_npu.cli_common import OneLineParser, byte_size, check_threads, path_arg
from hybrid_npu.errors import UserError

from .drafters import KINDS as DRAFTER_KINDS
from .model import PREFILL_MODES


def add_engine_arguments(p: OneLineParser, prefill_help: str) -> None:
    p.add_argument("--profile", default="cpu", type=path_arg, help="device profile name or TOML path (default: cpu)")
    p.add_argument("--prefill", choices=PREFILL_MODES, default="auto", help=prefill_help)
    p.add_argument("--memory", type=byte_size, help="memory budget: bytes or e.g. 8G (default: the profile's)")
    p.add_argument("--threads", type=int, help="CPU threads")
    p.add_argument("--temperature", type=float,
                   help="0 = greedy (default: the model's generation_config.json; greedy when it does not sample)")
    p.add_argument("--no-speculative", action="store_true", help="decode token by token even with a drafter")
    p.add_argument("--drafter", choices=DRAFTER_KINDS,
                   help="which of the export's drafters speculates (default: the export's own choice, EAGLE-3 "
                        "when it ships both; mtp = the checkpoint's multi-token-prediction head)")


def check_engine_arguments(a) -> None:
    from .sampling import check_sampling

    check_sampling(a.max_new_tokens, a.temperature, getattr(a, "top_k", 0), getattr(a, "top_p", 1.0), a.seed,
                   flags=True)
    check_threads(a.threads)


def open_model(model: str | None, a, checkpoints: int | None = None):
    """The loaded model (runtime/model.py). model: an export directory, or None for the embedded
    default model; checkpoints: how many turn checkpoints a context keeps (None: the default; a
    one-shot tool needs none)."""
    import hybrid_npu

    path = Path(model) if model else hybrid_npu.default_model()
    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist; give an export-hybrid output directory")
    return hybrid_npu.load(path, profile=a.profile, prefill=a.prefill, threads=a.threads, memory=a.memory,
                           checkpoints=checkpoints, drafter=a.drafter)


def open_engine(model: str | None, a, checkpoints: int | None = None):
    """open_model with one conversation on it (runtime/engine.py): what npu-chat and npu-summarize run."""
    from .engine import Engine

    return Engine(open_model(model, a, checkpoints))
