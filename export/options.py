"""What an export is made of, as data: ExportOptions holds every choice export-hybrid offers (one
field per flag; the CLI and the optimum plugin build it from argparse), and `resolve` checks them
once, before anything is read, into the ExportPlan the exporter follows."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from hybrid_npu.errors import UserError
from hybrid_npu.format import DEFAULT_KV_CACHE, KV_CACHES, MTP_KIND, STORAGE_DTYPES
from hybrid_npu.profiles import Profile
from hybrid_npu.profiles.loader import load_profile

from .npu.qdq import NPU_QUANT_MODES
from .quantize import WEIGHT_MODES, QuantSpec, quant_spec

DEFAULT_CHUNK = 128
DEFAULT_VERIFY = 32
MAX_CHUNK = 4096  # the prefill graph's scores are [C, T + C] per head: 4096 is far past any NPU's sweet spot


@dataclass(frozen=True)
class ExportOptions:
    chunk: int | None = None               # tokens per prefill call (None: the profile's, or 128)
    dtype: str = "fp32"                    # how float weights are stored (compute stays fp32)
    kv_cache: str = DEFAULT_KV_CACHE       # the K/V cache's dtype: fp32 | fp16 | int8 (format.KV_CACHES)
    profile: str | Path | None = None      # a device profile: also its NPU parts (+ context binaries)
    compile_context: bool = True           # with an NPU profile: precompile its QNN context binaries
    verify: int | None = None              # tree-verify size (None: the profile's, or 32)
    drafter: str | Path | None = None      # "mtp" (the checkpoint's own head) or an EAGLE-3 checkpoint dir
    mtp: str | Path | None = None          # a trained MTP head (mtp.* tensors) to ship beside EAGLE-3
    mtp_vocab: int | None = None           # the MTP head drafts this many tokens (0: all; None: the default,
    #                                        export/drafters/vocab.py)
    mtp_vocab_text: str | Path | None = None  # ... the most frequent in this text (default: merge order)
    drafter_weights: str | None = None     # float | int8 | int4: the drafters' own (None: as the target's)
    weights: str | None = "float"          # float | int8 | int4
    block_size: int | None = None          # with weights: weights per quantisation block
    asymmetric: bool = False               # with weights: a zero point per block
    head_bits: int | None = None           # with weights: the lm_head's bits
    max_context: int | None = None         # refused (export/exporter.npu_capacity): tiles read any context
    npu_quant: str | None = None           # with weights and an NPU profile: qdq | nbits
    calibration: str | Path | None = None  # with qdq: the text the activation ranges are measured on

    @classmethod
    def from_args(cls, args) -> "ExportOptions":
        """From export-hybrid's parsed arguments (export/cli.py add_arguments)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"compile_context", "mtp"}
        return cls(compile_context=not args.no_compile, **{n: getattr(args, n) for n in names})

    def resolve(self) -> "ExportPlan":
        """The checked, defaulted plan; a bad combination is one UserError naming the fix."""
        prof = load_profile(self.profile) if self.profile is not None else None
        chunk = self.chunk if self.chunk is not None else (prof.prefill_chunk if prof else DEFAULT_CHUNK)
        verify = self.verify if self.verify is not None else (prof.verify_tree_size if prof else DEFAULT_VERIFY)
        if not 2 <= verify <= 512:
            raise UserError(f"--verify must be between 2 and 512 tree nodes (got {verify})")
        if chunk < 2:
            raise UserError(f"--chunk must be at least 2 (got {chunk}); decode uses its own 1-token graph")
        if chunk > MAX_CHUNK:
            raise UserError(f"--chunk {chunk} is too large: at most {MAX_CHUNK} tokens per prefill call "
                            f"(the profiles use 128)")
        if self.dtype not in STORAGE_DTYPES:
            raise UserError(f"--dtype {self.dtype!r} is not supported; choose one of {', '.join(STORAGE_DTYPES)}")
        if self.kv_cache not in KV_CACHES:
            raise UserError(f"--kv-cache {self.kv_cache!r} is not supported; choose one of {', '.join(KV_CACHES)}")
        if self.kv_cache == "int8" and prof is not None and prof.has_npu:
            raise UserError(f"--kv-cache int8 is for the CPU; the NPU graphs of profile {prof.name} read fp16 "
                            "K/V: use --kv-cache fp16 with an NPU --profile")
        quant = quant_spec(self.weights, self.block_size, self.asymmetric, self.head_bits)
        own_mtp = isinstance(self.drafter, str) and self.drafter == MTP_KIND  # the keyword, not a dir named mtp
        if self.mtp_vocab_text is not None and self.mtp_vocab is None:
            raise UserError("--mtp-vocab-text chooses the tokens of a trimmed MTP head: add --mtp-vocab N "
                            "(e.g. 32768)")
        if self.mtp_vocab is not None and self.mtp_vocab < 0:
            raise UserError(f"--mtp-vocab {self.mtp_vocab}: give a token count (e.g. 32768), or 0 to draft over "
                            "the whole vocabulary")
        if self.mtp_vocab_text is not None and self.mtp_vocab == 0:
            raise UserError("--mtp-vocab-text chooses the tokens of a trimmed MTP head, and --mtp-vocab 0 keeps "
                            "them all: drop one of the two")
        if self.mtp_vocab is not None and not (own_mtp or self.mtp is not None):
            raise UserError("--mtp-vocab trims the MTP drafter's vocabulary: add --drafter mtp")
        return ExportPlan(self, prof, chunk, verify, quant, npu_quant_mode(quant, prof, self.npu_quant,
                                                                            self.calibration),
                          eagle3=None if own_mtp else self.drafter, mtp=self.mtp, own_mtp=own_mtp,
                          drafter_quant=self._drafter_quant(quant))

    def _drafter_quant(self, quant: QuantSpec | None) -> QuantSpec | None:
        """The drafters' weights: the target's unless --drafter-weights says otherwise. A drafter only
        proposes (the target verifies every token), so its precision moves acceptance and speed, never
        the output: a float target may draft with int8 weights (the embedded model: a draft level 0.3 ->
        0.2 ms, acceptance unchanged; docs/speculation.md)."""
        if self.drafter_weights is None:
            return quant
        if self.drafter is None and self.mtp is None:
            raise UserError("--drafter-weights sets the drafter's weights: add --drafter mtp or --drafter DIR")
        if self.drafter_weights not in WEIGHT_MODES:
            raise UserError(f"--drafter-weights {self.drafter_weights!r} is not supported; choose one of "
                            f"{', '.join(WEIGHT_MODES)}")
        return None if self.drafter_weights == "float" else QuantSpec(bits=int(self.drafter_weights[3:]))


@dataclass(frozen=True)
class ExportPlan:
    options: ExportOptions
    profile: Profile | None   # loaded; its attention_capacity set from max_context once the model is read
    chunk: int
    verify: int
    quant: QuantSpec | None   # None: float weights
    npu_quant: str | None     # how the NPU parts are quantised (None: float parts, or no NPU)
    eagle3: str | Path | None  # an EAGLE-3 drafter checkpoint to export
    mtp: str | Path | None     # an MTP head directory to export (with own_mtp: the source's own)
    own_mtp: bool
    drafter_quant: QuantSpec | None = None  # the drafters' weights (None: float)

    @property
    def dtype(self) -> str:
        return self.options.dtype

    @property
    def wants_mtp(self) -> bool:
        return self.own_mtp or self.mtp is not None


def npu_quant_mode(quant, prof, npu_quant: str | None, calibration) -> str | None:
    """How the NPU parts of a quantised export are quantised (None: float parts, or no NPU)."""
    npu = prof is not None and prof.has_npu
    if npu_quant is not None and npu_quant not in NPU_QUANT_MODES:
        raise UserError(f"--npu-quant {npu_quant!r} is not supported; choose one of {', '.join(NPU_QUANT_MODES)}")
    if quant is None or not npu:
        if calibration is not None or npu_quant is not None:
            flag = "--calibration" if calibration is not None else "--npu-quant"
            raise UserError(f"{flag} applies to the NPU graphs of a quantised export: add --weights int8|int4 "
                            "and an NPU --profile (e.g. --profile snapdragon-x-elite)")
        return None
    mode = npu_quant or "qdq"
    if mode == "qdq" and calibration is None:
        raise UserError(f"--weights {quant.mode} with NPU profile {prof.name} quantises the NPU graphs too "
                        f"(w{quant.bits}a16), calibrated on your text: add --calibration FILE (a few thousand tokens "
                        "like what the model will read), or --npu-quant nbits for uncalibrated MatMulNBits")
    if mode == "nbits" and calibration is not None:
        raise UserError("--calibration calibrates the QDQ graphs; drop it with --npu-quant nbits")
    return mode
