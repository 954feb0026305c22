"""The HTP's quantised path: the NPU graph parts in QDQ form, 16-bit activations with 8- or 4-bit
weights (w8a16 / w4a16), calibrated on text the user gives (export-hybrid --weights int8|int4
--profile P --calibration FILE).

What is quantised: every linear layer (a Gemm over a stored matrix): its weights per output
channel, symmetric (int8, or int4 with the lm_head at --head-bits as on the CPU path), its input and
output activations uint16 with ranges measured by running the calibration text through the float
parts on the CPU, exactly as the NPU would be fed (chunks of C, or chain-shaped trees for verify).
What stays float (fp16 on the HTP): the GDN gate projections b/a, the conv, the delta-rule state
path, norms, attention and the embedding gather. The recurrent state compounds every token, so
an error there grows with the context instead of staying per token. The formats are ones the HTP
emulator was seen to run (docs/htp-traps.md, trap 10: get_qnn_qdq_config, u16 activations).

The quantiser is ONNX Runtime's own (onnxruntime.quantization: get_qnn_qdq_config + quantize);
this module only supplies the calibration data and says which nodes to leave alone.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Iterator

import numpy as np
import onnx

from hybrid_npu.config import ModelConfig

from ..text_input import read_text_input, text_tokenizer

NPU_QUANT_MODES = ("qdq", "nbits")
# Enough text for stable activation ranges (MinMax over every position), bounded so calibration
# stays a small part of an export: 32 chunks of 128.
MAX_CALIBRATION_TOKENS = 4096
ACTIVATIONS = "uint16"


def read_calibration(path, tokenizer_file: Path) -> tuple[list[int], dict]:
    """The calibration text as token ids (at most MAX_CALIBRATION_TOKENS) and what to record of it."""
    path = Path(path)
    text = read_text_input("--calibration", path, "a UTF-8 text file of the kind of text the model will read "
                           "(a few thousand tokens is enough)")
    ids = text_tokenizer("--calibration", tokenizer_file).encode(text).ids[:MAX_CALIBRATION_TOKENS]
    return ids, {"file": path.name, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "tokens": len(ids)}


def calibration_steps(cfg: ModelConfig, ids: list[int], n: int, tree: bool,
                      capacity: int | None = None) -> Iterator[tuple[dict, callable]]:
    """(feed, commit) for each n-token step over ids from an empty context: chain steps (prefill)
    or chain-shaped trees (verify, every node committed); commit(outputs) advances the state.
    capacity: K/V rows from the start (an NPU graph reads exactly T_max), else grown as needed."""
    from hybrid_npu.runtime.for_export import State, Tree, chain_feed, commit_chain, commit_path, tree_feed

    state = State.fresh(cfg) if capacity is None else State.fresh(cfg, capacity)
    for s in range(0, len(ids), n):
        chunk = list(ids[s: s + n])
        state.ensure_capacity(state.position + n)
        if tree:
            t, real = Tree.from_draft(chunk[0], chunk[1:], list(range(-1, len(chunk) - 2)), n)
            yield tree_feed(cfg, state, t), (lambda out, t=t, real=real:
                                             commit_path(state, out, t, list(range(real)), cfg.linear_conv_kernel_dim))
        else:
            yield chain_feed(cfg, state, chunk, n), lambda out, chunk=chunk: commit_chain(state, out, chunk)


def part_inputs(cfg: ModelConfig, pipe, ids: list[int], n: int, tree: bool, part: int) -> Iterator[dict]:
    """What NPU part `part` is fed at each step: the float parts (pipe) run in order on the CPU.
    Each part's calibration runs the float pipeline again rather than keeping every part's feeds:
    a step's K/V feeds reach ~100 MB on a 0.8B model, and the float run costs far less than the
    quantiser's own calibration pass."""
    for feed, commit in calibration_steps(cfg, ids, n, tree):
        seen: dict = {}
        out = pipe.run(feed, on_part=lambda i, inputs: seen.update(inputs) if i == part else None)
        yield {k: np.array(v) for k, v in seen.items()}  # copies: commit writes K/V rows in place
        commit(out)


class _Reader:
    """onnxruntime.quantization's CalibrationDataReader protocol over an iterator of feeds."""

    def __init__(self, feeds: Iterator[dict]):
        self.feeds = feeds

    def get_next(self) -> dict | None:
        return next(self.feeds, None)


# Stored matrices whose Gemm stays float (step_graph: WeightPlan.quantizable): the GDN gates b/a
FLOAT_LINEARS = (".in_proj_ba",)
HEAD = "lm_head"


def quantize_graph(src: Path, dst: Path, feeds: Iterator[dict], bits: int, head_bits: int = 8) -> tuple[int, int]:
    """One float graph -> its QDQ twin (dst + dst.data), activation ranges from `feeds`; the
    lm_head at head_bits. Returns (linear layers quantised, kept float)."""
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    graph = onnx.load(str(src), load_external_data=False).graph
    stored = {t.name for t in graph.initializer}
    linears = [nd for nd in graph.node if nd.op_type == "Gemm" and nd.input[1] in stored]
    keep_float = [nd.name for nd in linears if nd.input[1].endswith(FLOAT_LINEARS)]
    types = {8: QuantType.QInt8, 4: QuantType.QInt4}
    overrides = ({HEAD: [{"quant_type": types[head_bits], "symmetric": True}]}
                 if head_bits != bits and HEAD in stored else None)
    config = get_qnn_qdq_config(str(src), _Reader(feeds), activation_type=QuantType.QUInt16,
                                weight_type=types[bits], per_channel=True,
                                weight_symmetric=True, init_overrides=overrides, op_types_to_quantize=["Gemm"],
                                nodes_to_exclude=keep_float)
    config.use_external_data_format = True
    quiet = logging.getLogger()
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the quantiser's "consider pre-processing" advice is not the user's business
    try:
        quantize(str(src), str(dst), config)
    finally:
        quiet.setLevel(level)
    data = dst.with_name(dst.name + ".data")
    if data.exists():  # onnx writes external data owner-only; the export's other files follow the umask
        data.chmod(dst.stat().st_mode & 0o777)
    return len(linears) - len(keep_float), len(keep_float)


def quantize_parts(cfg: ModelConfig, float_files: list[Path], out_files: list[Path], ids: list[int], n: int,
                   tree: bool, bits: int, say=lambda m: None, head_bits: int = 8) -> dict:
    """Quantise each float part into its QDQ twin, calibrated on what it is fed over `ids`."""
    from hybrid_npu.runtime.for_export import Pipeline, cpu_inference_session

    pipe = Pipeline([cpu_inference_session(f) for f in float_files], "CPU")
    for k, (src, dst) in enumerate(zip(float_files, out_files)):
        done, kept = quantize_graph(src, dst, part_inputs(cfg, pipe, ids, n, tree, k), bits, head_bits)
        say(f"quantised {dst.name}: {done} linear layers w{bits}a16, {kept} kept float")
    return {"method": "qdq", "activations": ACTIVATIONS, "weights": f"int{bits}", "per_channel": True,
            "symmetric": True, "head_weights": f"int{head_bits}",
            "float": ["GDN gate projections b/a", "conv", "delta-rule state path", "norms", "attention",
                      "embedding gather"]}
