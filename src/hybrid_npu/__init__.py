"""hybrid-npu: Qwen3.5-style hybrid models (Gated DeltaNet + attention) as state-explicit ONNX,
prefilled on a Snapdragon NPU and decoded on the CPU."""
from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

# The embedded default model (an export of the model scripts/train/train_target.py trains, with its
# EAGLE-3 drafter): what npu-chat and npu-summarize open when no model is given.
DEFAULT_MODEL = Path(__file__).resolve().parent / "models" / "default"


def default_model() -> Path:
    from hybrid_npu.errors import UserError
    from hybrid_npu.format import MANIFEST

    if not (DEFAULT_MODEL / MANIFEST).exists():
        raise UserError(f"this install has no embedded default model ({DEFAULT_MODEL}); "
                        "pass an export-hybrid output directory")
    return DEFAULT_MODEL


def load(path, profile: str = "cpu", prefill: str = "auto", threads: int | None = None, memory: int | None = None,
         drafter=None, checkpoints: int | None = None):
    """Open an exported model directory; returns the Model (runtime/model.py): its sessions,
    tokenizer, drafter and memory plan. Conversations are contexts made from it
    (`model.new_context()`), run by `hybrid_npu.stream(model, context, prompt_ids, ...)`.

    profile: a device profile name or TOML path ("cpu", "snapdragon-x-elite", ...).
    prefill: "npu" runs every prefill chunk on the NPU, "cpu" never, "auto" follows the profile.
    memory: the budget in bytes for weights + state + K/V of every context (default: the profile's,
    else psutil's available memory minus 1 GiB); a context beyond it is refused up front.
    drafter: None (the export's default drafter, if it ships one), "eagle3" or "mtp" (its drafter of
    that kind), an exported drafter directory, or a drafter object (reset/observe/propose);
    generation then speculates.
    checkpoints: how many turn checkpoints (copies of the GDN state) a context may keep to resume
    from when its next prompt departs from it (default 8; 0: none); the memory plan counts them.
    """
    from hybrid_npu.errors import UserError
    from hybrid_npu.runtime.model import Model
    from hybrid_npu.safe_files import check_names

    check_names(path, "model path")
    extra = {} if checkpoints is None else {"checkpoints": checkpoints}
    try:
        return Model(path, profile=profile, prefill=prefill, threads=threads, memory=memory, drafter=drafter, **extra)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
        # a damage the specific checks (runtime/export_check.py, src/hybrid_npu/integrity.py) did not name
        first = (str(e).splitlines() or [""])[0][:200]
        raise UserError(f"cannot load {path} ({type(e).__name__}: {first}); the export looks damaged: "
                        "re-export it with export-hybrid") from None


def load_engine(path, **kwargs):
    """load(path, ...) with one conversation on it: an Engine (runtime/engine.py) whose `generate`
    returns the new ids and keeps the call's stats in `last_stats`."""
    from hybrid_npu.runtime.engine import Engine

    return Engine(load(path, **kwargs))


def stream(model, context, prompt_ids, max_new_tokens: int = 256, temperature: float | None = None,
           top_k: int | None = None, top_p: float | None = None, seed: int | None = None, **kwargs):
    """Generate into `context` (one of model.new_context()): yields each new token; the stream's
    `response` (text, ids, finish_reason, stats) once it is done or closed. Sampling left None takes
    the model's own defaults (its generation_config; greedy unless that samples); temperature 0 is
    greedy. kwargs: append (continue the context), speculative, stop_at_eos, should_stop, progress,
    checkpoint_at (runtime/generation.py)."""
    from hybrid_npu.runtime.generation import stream as run
    from hybrid_npu.runtime.sampling import Sampler

    sampler = Sampler.from_defaults(model.sampling_defaults, temperature, top_k, top_p, seed, max_new_tokens)
    return run(model, context, prompt_ids, sampler, max_new_tokens, **kwargs)
