"""What scripts/check_arm64.py compares between x86_64 and ARM64: run on each side with only the
runtime's dependencies (no torch), it writes one JSON result (ids, rendered text) and one .npz of
logits for the exports and the snapshot that check_arm64.py prepared in WORK.

    python scripts/arm64_probe.py WORK OUT_NAME

WORK holds exports/<name>/ (a small checkpoint exported fp32 / int8 / int4, and the int8 / int4
exports multiplying in fp32), snapshot.state (the embedded model's state, saved on x86_64) and
snapshot.json (its next token); results go to WORK/OUT_NAME.json and WORK/OUT_NAME.npz.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

# ONE thread on both sides: the comparison is of the kernels, not of how a sum was split
THREADS = 1
PROMPT = "Write a Python function that does this: Return the first line of a text file."
EMBEDDED_NEW_TOKENS = 16  # emulated decode steps cost ~0.3 s of CPU each
EXPORT_PROMPT_TOKENS = 29  # 3 prefill chunks of 8 and a partial one (the exports use chunk 8)
EXPORT_STEPS = 16
RESUME_STEPS = 8

# conversations whose rendering (text and token ids) must not depend on the machine: several
# turns, a system prompt, non-ASCII text, thinking on and off, a finished conversation
CONVERSATIONS = [
    dict(messages=[{"role": "user", "content": PROMPT}], enable_thinking=False),
    dict(messages=[{"role": "system", "content": "You answer in one line."},
                   {"role": "user", "content": "Say 你好 ☃ and café"},
                   {"role": "assistant", "content": "你好 ☃ café"},
                   {"role": "user", "content": "Again, with \"quotes\" and a\ttab."}], enable_thinking=True),
    dict(messages=[{"role": "user", "content": "Line one\nline two"},
                   {"role": "assistant", "content": "Two lines."}], enable_thinking=False, add_generation_prompt=False),
]


def export_prompt() -> list[int]:
    return [int(t) for t in np.random.default_rng(53).integers(0, 300, EXPORT_PROMPT_TOKENS)]


def forced_tokens() -> list[int]:
    """The tokens decoded after the prompt for the logits: the same on both sides whatever either
    would pick, so every row compares like with like."""
    return [int(t) for t in np.random.default_rng(54).integers(0, 300, EXPORT_STEPS)]


def greedy(engine, prompt: list[int], steps: int) -> list[int]:
    engine.reset()
    ids = [int(np.argmax(engine.prefill(prompt)))]
    for _ in range(steps):
        ids.append(int(np.argmax(engine.decode(ids[-1]))))
    return ids


def forced_logits(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """Logits after the prompt and after each of `tokens` fed in turn: [1 + len(tokens), vocab]."""
    engine.reset()
    rows = [engine.prefill(prompt)]
    rows += [engine.decode(t) for t in tokens]
    return np.stack(rows).astype(np.float32)


def arm_features() -> list[str]:
    """The aarch64 features the kernel (here qemu) advertises, from the auxiliary vector: what ONNX
    Runtime picks its kernels by. Empty elsewhere."""
    if platform.machine() != "aarch64":
        return []
    import struct

    aux = dict(struct.iter_unpack("<QQ", Path("/proc/self/auxv").read_bytes()))
    hwcap, hwcap2 = aux.get(16, 0), aux.get(26, 0)  # AT_HWCAP, AT_HWCAP2 (Linux's arm64 hwcap bits)
    bits = [("asimddp", hwcap, 20), ("sve", hwcap, 22), ("i8mm", hwcap2, 13), ("bf16", hwcap2, 14), ("sme", hwcap2, 23)]
    return [name for name, word, bit in bits if word >> bit & 1]


def phase(name: str, t0: float) -> None:
    """Where the time goes (emulated: minutes), on stderr."""
    print(f"arm64_probe: {name} done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    t0 = time.perf_counter()
    import onnxruntime as ort

    import hybrid_npu
    from hybrid_npu.runtime.chat.template import ChatTemplate

    work, name = Path(argv[0]), argv[1]
    result = {"machine": platform.machine(), "features": arm_features(), "onnxruntime": ort.__version__,
              "numpy": np.__version__}
    arrays = {}

    embedded = hybrid_npu.load_engine(hybrid_npu.default_model(), threads=THREADS)
    template = ChatTemplate.from_export(embedded.path)
    rendered = [template.render(c["messages"], enable_thinking=c["enable_thinking"],
                                add_generation_prompt=c.get("add_generation_prompt", True))
                for c in CONVERSATIONS]
    result["template_text"] = rendered
    result["template_ids"] = [embedded.tokenizer.encode(t, add_special_tokens=False).ids for t in rendered]
    phase("embedded model load, templates", t0)
    prompt = result["template_ids"][0]
    result["embedded_plain"] = embedded.generate(prompt, EMBEDDED_NEW_TOKENS, speculative=False, stop_at_eos=False)
    result["embedded_speculative"] = embedded.generate(prompt, EMBEDDED_NEW_TOKENS, speculative=True,
                                                       stop_at_eos=False)

    phase("embedded replies", t0)
    snap = json.loads((work / "snapshot.json").read_text(encoding="utf-8"))
    embedded.load_state(work / "snapshot.state")
    result["resumed_position"] = embedded.state.position
    fed, token = [], snap["next_token"]
    for _ in range(RESUME_STEPS):
        fed.append(token)
        token = int(np.argmax(embedded.decode(token)))
    result["resumed"] = fed + [token]
    phase("snapshot resumed", t0)

    for export_dir in sorted((work / "exports").iterdir()):
        engine = hybrid_npu.load_engine(export_dir, threads=THREADS)
        result[f"export_{export_dir.name}_ids"] = greedy(engine, export_prompt(), EXPORT_STEPS)
        arrays[export_dir.name] = forced_logits(engine, export_prompt(), forced_tokens())
        phase(f"export {export_dir.name}", t0)

    (work / f"{name}.json").write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")
    np.savez(work / f"{name}.npz", **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
