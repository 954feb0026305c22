"""model.json and drafter.json as typed records: the exporter builds them and writes `to_json()`, the
runtime loads them once (`load_manifest`, `load_drafter_manifest`), checked, and reads fields.

Only this module reads the files' keys (tests/test_manifest_keys.py holds that). Entries the runtime
does not interpret stay plain JSON objects: `source`, `config` (ModelConfig.from_dict reads it),
`state`, `integrity` (src/hybrid_npu/integrity.py checks its own entry), `generation`, an NPU
entry's `profile`, a drafter's `config`, `taps` and `weights`. Every check answers a
damaged or lying file in one line naming the fix (hybrid_npu.errors.UserError).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hybrid_npu.config import ModelConfig
from hybrid_npu.errors import UserError
from hybrid_npu.format import (DRAFTER_DIR, DRAFTER_FORMAT, DRAFTER_MANIFEST, EAGLE3_KIND, FORMAT, KV_CACHES,
                               LEGACY_KV_CACHE, MANIFEST, NPU_GRAPHS, VERIFY_ANY_COUNT)
from hybrid_npu.safe_files import CONFIG_BYTES, inside, read_json

MAX_GRAPH_TOKENS = 4096  # a graph's N (chunk, verify nodes): its feeds hold N x (T + N) fp32 masks
DRAFTER_FIX = "re-export the drafter with: export-hybrid SOURCE OUT --drafter DRAFTER"


def _json(record) -> dict:
    """A record's JSON object: its fields in order, those that are None left out (absent on disk)
    unless the record's KEEP_NONE names them (written as null)."""
    out = {}
    keep = getattr(record, "KEEP_NONE", ())
    for f in fields(record):
        v = getattr(record, f.name)
        if v is None and f.name not in keep:
            continue
        key = f.metadata.get("key", f.name)
        if hasattr(v, "to_json"):
            v = v.to_json()
        elif isinstance(v, tuple) and v and hasattr(v[0], "to_json"):
            v = [x.to_json() for x in v]
        elif isinstance(v, tuple):
            v = list(v)
        elif isinstance(v, dict) and v and all(hasattr(x, "to_json") for x in v.values()):
            v = {k: x.to_json() for k, x in v.items()}
        out[key] = v
    return out


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}


@dataclass(frozen=True)
class Graph:
    """One ONNX graph of the export (or an NPU part, or a drafter graph): its file and its N tokens."""
    file: str
    n: int | None = None
    nodes: int | None = None
    sizes: tuple[int, ...] | None = None     # cpu_verify: its cores' tree sizes
    any_count: bool | None = field(default=None, metadata={"key": VERIFY_ANY_COUNT})  # any 2..n nodes a call
    inputs: tuple | None = None
    outputs: tuple | None = None
    layers: tuple[int, int] | None = None    # an NPU part's layer range
    after_attention: bool | None = None      # an NPU prefill segment's cuts (docs/long-context.md)
    to_attention: bool | None = None

    to_json = _json

    @classmethod
    def from_json(cls, g: dict) -> "Graph":
        sizes = g.get("sizes")
        return cls(file=g.get("file"), n=g.get("n"), nodes=g.get("nodes"),
                   sizes=tuple(sizes) if isinstance(sizes, list) else None, any_count=g.get(VERIFY_ANY_COUNT),
                   inputs=_tuple(g.get("inputs")), outputs=_tuple(g.get("outputs")), layers=_tuple(g.get("layers")),
                   after_attention=g.get("after_attention"), to_attention=g.get("to_attention"))


def _tuple(v):
    return tuple(v) if isinstance(v, list) else None


@dataclass(frozen=True)
class Contexts:
    """Precompiled QNN context binaries of some graphs, and what they were built for."""
    files: tuple[str, ...]
    qnn_version: str | None = None
    soc_model: str | None = None
    htp_arch: Any = None
    compile_s: float | None = None

    to_json = _json

    def built_for(self, key: str):
        return {"qnn_version": self.qnn_version, "soc_model": self.soc_model, "htp_arch": self.htp_arch}[key]

    @classmethod
    def from_json(cls, c) -> "Contexts | None":
        if not c:
            return None
        return cls(tuple(c.get("files") or ()), c.get("qnn_version"), c.get("soc_model"), c.get("htp_arch"),
                   c.get("compile_s"))


@dataclass(frozen=True)
class Tile:
    """The NPU's attention tile graph (and its bulk form: several tiles a call), one for every layer."""
    file: str
    rows: int
    nodes: int | None = None
    bulk_file: str | None = None
    bulk_rows: int | None = None
    bulk_nodes: int | None = None
    n: int | None = None
    inputs: tuple | None = None
    outputs: tuple | None = None

    to_json = _json

    @property
    def files(self) -> list[str]:
        return [self.file] + ([self.bulk_file] if self.bulk_file else [])

    @classmethod
    def from_json(cls, t) -> "Tile | None":
        if not t:
            return None
        return cls(t.get("file"), t.get("rows"), t.get("nodes"), t.get("bulk_file"), t.get("bulk_rows"),
                   t.get("bulk_nodes"), t.get("n"), _tuple(t.get("inputs")), _tuple(t.get("outputs")))


@dataclass(frozen=True)
class Calibration:
    """The text a QDQ export calibrated its activation ranges on."""
    file: str
    sha256: str | None = None
    tokens: int | None = None

    to_json = _json


@dataclass(frozen=True)
class NpuWeights:
    """How a profile's NPU parts hold their weights: "float", "nbits" (the CPU graphs' MatMulNBits, as
    Weights) or "qdq" (int-N weights, 16-bit activations, calibrated)."""
    method: str
    mode: str | None = None
    bits: int | None = None
    block_size: int | None = None
    symmetric: bool | None = None
    head_bits: int | None = None
    embedding_dtype: str | None = None
    activations: str | None = None
    weights: str | None = None
    per_channel: bool | None = None
    head_weights: str | None = None
    float: tuple[str, ...] | None = None    # what stays float in a QDQ part
    calibration: Calibration | None = None

    to_json = _json

    @classmethod
    def from_json(cls, w) -> "NpuWeights | None":
        if not isinstance(w, dict) or not isinstance(w.get("method"), str):
            return None
        known = {f.name: w[f.name] for f in fields(cls) if f.name in w and f.name not in ("float", "calibration")}
        c = w.get("calibration")
        return cls(**known, float=_tuple(w.get("float")),
                   calibration=Calibration(c.get("file"), c.get("sha256"), c.get("tokens")) if isinstance(c, dict)
                   else None)


@dataclass(frozen=True)
class NpuEntry:
    """A profile's NPU graphs: prefill parts (segments around the attention cores), verify parts, the
    attention tile, and the context binaries of each (None: compiled at load)."""
    attention_capacity: int | None = None
    chunk: int | None = None
    max_context: int | None = None
    profile: dict | None = None             # the profile as exported (Profile.to_dict)
    weights: NpuWeights | None = None
    parts: tuple[Graph, ...] = ()
    context: Contexts | None = None
    verify_parts: tuple[Graph, ...] | None = None
    verify_context: Contexts | None = None
    tile: Tile | None = None
    tile_context: Contexts | None = None

    to_json = _json

    @property
    def KEEP_NONE(self) -> tuple[str, ...]:  # noqa: N802 - the name _json reads
        """null on disk: no limit set, no context binaries compiled (the runtime compiles the graphs)."""
        return ("max_context", "context", "tile_context") + (("verify_context",) if self.verify_parts else ())

    def graph_parts(self, graph: str) -> tuple[Graph, ...]:
        return self.parts if graph == "prefill" else (self.verify_parts or ())

    def graph_contexts(self, graph: str) -> Contexts | None:
        return self.context if graph == "prefill" else self.verify_context

    @property
    def attention_tile(self):
        """The tile rows its prefill segments were built for."""
        return _dict(_dict(self.profile).get("shapes")).get("attention_tile")

    def files(self) -> list:
        """Every file the entry names (parts, context binaries)."""
        out = []
        for graph in NPU_GRAPHS:
            out += [p.file for p in self.graph_parts(graph)]
            ctx = self.graph_contexts(graph)
            out += list(ctx.files) if ctx else []
        return out


@dataclass(frozen=True)
class Weights:
    """weights.bin: its size, the model's parameters and how they are stored (float or int-N)."""
    file: str | None = None
    bytes: int | None = None
    params: int | None = None
    mode: str = "float"
    bits: int | None = None
    block_size: int | None = None
    symmetric: bool | None = None
    head_bits: int | None = None
    embedding_dtype: str | None = None
    prepacked_bytes: int | None = None

    to_json = _json

    @classmethod
    def of(cls, w: "Weights | dict") -> "Weights":
        """A Weights record, from a manifest's JSON entry where given one (scripts, tests)."""
        return w if isinstance(w, Weights) else cls.from_json(w)

    @classmethod
    def from_json(cls, w: dict) -> "Weights":
        return cls(**{f.name: w[f.name] for f in fields(cls) if f.name in w})


@dataclass(frozen=True)
class Tokenizer:
    files: tuple[str, ...] = ()
    chat_template: str | None = None        # what the exporter chose, by transformers' precedence
    chat_template_file: str | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_token_sources: dict | None = None
    KEEP_NONE = ("chat_template", "chat_template_file", "stop_token_sources")

    to_json = _json

    @classmethod
    def from_json(cls, t) -> "Tokenizer | None":
        if not isinstance(t, dict):
            return None
        template = t.get("chat_template")
        return cls(tuple(t.get("files") or ()), template if isinstance(template, str) else None,
                   t.get("chat_template_file"), tuple(t.get("stop_token_ids") or ()), t.get("stop_token_sources"))


@dataclass(frozen=True)
class DraftShape:
    """The draft tree a round grows (EAGLE-2): top_k children a node, depth levels, total_tokens nodes."""
    top_k: int
    depth: int
    total_tokens: int

    to_json = _json

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if type(v) is not int or v < 1:
                raise ValueError(f"draft_shape {f.name} {v!r} is not a positive integer")

    def as_dict(self) -> dict:
        return self.to_json()


@dataclass(frozen=True)
class DraftVocab:
    """vocab.safetensors: the target id of each draft id (EAGLE-3's own vocabulary, a trimmed MTP head's)."""
    file: Any
    tensor: Any
    draft_vocab_size: int | None = None
    target_vocab_size: int | None = None

    to_json = _json


@dataclass(frozen=True)
class DrafterDims:
    """The numbers a drafter's runtime sizes its buffers and rotary rows by."""
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    rotary_dim: int
    rope_theta: float
    vocab_size: int
    target_hidden_size: int


@dataclass(frozen=True)
class DrafterManifest:
    """drafter.json, and model.json's `drafter` entry (the same record with its `dir`)."""
    format: str
    config: dict
    taps: dict
    graphs: dict[str, Graph]
    weights: dict
    kind: str | None = None                 # absent: an EAGLE-3 drafter
    source: str | None = None
    vocab: DraftVocab | None = None         # absent: the target's own vocabulary (an untrimmed MTP head)
    draft_shape: DraftShape | None = None   # the shape measured best for it (model.json's entry only)
    dir: str | None = None                  # model.json's entry only: where it lies in the export

    def to_json(self) -> dict:
        keys = ("dir", "format", "kind", "source", "config", "taps", "graphs", "weights", "vocab", "draft_shape")
        d = _json(self)
        return {k: d[k] for k in keys if k in d}

    def write(self, folder: Path) -> None:
        import json

        (Path(folder) / DRAFTER_MANIFEST).write_text(json.dumps(self.to_json(), indent=1), encoding="utf-8")

    @property
    def drafter_kind(self) -> str:
        return self.kind or EAGLE3_KIND

    @property
    def input_order(self) -> tuple[int, ...]:
        """The target tap layers whose rows it reads, in the order it concatenates them."""
        return tuple(self.taps["input_order"])

    @property
    def mtp_graphs(self) -> tuple[Graph, Graph] | None:
        """An MTP head's two graphs: the hidden-state input, the step (None: not an MTP drafter's)."""
        if "mtp_in" in self.graphs and "mtp" in self.graphs:
            return self.graphs["mtp_in"], self.graphs["mtp"]
        return None

    @property
    def weights_file(self):
        return self.weights.get("file")

    @property
    def dims(self) -> DrafterDims:
        c = self.config
        return DrafterDims(c["num_key_value_heads"], c["head_dim"], c["hidden_size"], c["rotary_dim"],
                           c["rope_theta"], c["vocab_size"], c.get("target_hidden_size", c["hidden_size"]))

    @classmethod
    def from_json(cls, m: dict, where: str, fix: str = DRAFTER_FIX, opened: bool = True) -> "DrafterManifest":
        """One line naming what is wrong when the record does not hold what a drafter is opened by
        (opened False: model.json's entry, of which the runtime reads only dir, kind and draft_shape).
        where: what the line names (the file, or the drafter that does not load)."""
        config, taps, graphs = m.get("config"), m.get("taps"), m.get("graphs")
        if not opened:
            config, taps, graphs = _dict(config), _dict(taps), _dict(graphs)
        if not isinstance(config, dict) or not isinstance(taps, dict) or not isinstance(graphs, dict) \
                or not all(isinstance(g, dict) for g in graphs.values()):
            raise UserError(f"{where}: its drafter entry is damaged (config, taps, graphs); {fix}")
        vocab, shape = m.get("vocab"), m.get("draft_shape")
        try:
            rec = cls(format=m.get("format"), config=config, taps=taps,
                      graphs={k: Graph.from_json(g) for k, g in graphs.items()}, weights=_dict(m.get("weights")),
                      kind=m.get("kind"), source=m.get("source"),
                      vocab=DraftVocab(vocab.get("file"), vocab.get("tensor"), vocab.get("draft_vocab_size"),
                                       vocab.get("target_vocab_size")) if isinstance(vocab, dict) else None,
                      draft_shape=DraftShape(**shape) if shape else None, dir=m.get("dir"))
            if opened:  # read once here: a missing number is this line, not a KeyError later
                rec.input_order, rec.dims  # noqa: B018
        except (TypeError, KeyError, ValueError) as e:
            raise UserError(f"{where}: its drafter entry is damaged ({type(e).__name__} {str(e)[:120]}); {fix}") from None
        return rec


def load_drafter_manifest(d: Path) -> DrafterManifest:
    """drafter.json of directory d: a bounded regular file holding a drafter record of this format,
    or one UserError line."""
    mf = Path(d) / DRAFTER_MANIFEST
    m = read_json(mf, CONFIG_BYTES, "the drafter manifest", DRAFTER_FIX)
    if not isinstance(m, dict):
        raise UserError(f"{mf}: not a drafter manifest (a JSON {type(m).__name__}); {DRAFTER_FIX}")
    if m.get("format") != DRAFTER_FORMAT:
        raise UserError(f"{mf}: format {m.get('format')!r}, expected {DRAFTER_FORMAT!r}; re-export the drafter")
    return DrafterManifest.from_json(m, f"drafter {d} does not load ({mf.name})")


@dataclass(frozen=True)
class Manifest:
    """model.json: everything the runtime needs to know about an export, and nothing it must guess."""
    format: str
    source: dict
    config: dict
    dtype: str
    chunk: int
    graphs: dict[str, Graph]
    weights: Weights
    npu: dict[str, NpuEntry] = field(default_factory=dict)
    kv_cache: str = LEGACY_KV_CACHE          # exports made before the option keep fp32 rows
    state: dict | None = None
    tokenizer: Tokenizer | None = None
    generation: dict | None = None           # the chat defaults; None: read the export's own file
    drafter: DrafterManifest | None = None   # the default drafter
    drafters: dict[str, str] | None = None   # every drafter it ships: kind -> directory
    integrity: dict | None = None            # sha256 and size of every file (src/hybrid_npu/integrity.py)
    KEEP_NONE = ("generation",)

    def to_json(self) -> dict:
        keys = ("format", "source", "config", "dtype", "kv_cache", "chunk", "graphs", "npu", "weights", "state",
                "tokenizer", "generation", "drafter", "drafters", "integrity")
        d = _json(self)
        return {k: d[k] for k in keys if k in d}

    def write(self, folder: Path) -> None:
        import json

        (Path(folder) / MANIFEST).write_text(json.dumps(self.to_json(), indent=1), encoding="utf-8")

    @classmethod
    def of(cls, m: "Manifest | dict", path: Path) -> "Manifest":
        """A Manifest record, from model.json as parsed where given that (scripts, tests)."""
        return m if isinstance(m, Manifest) else cls.from_json(m, Path(path))

    @property
    def source_path(self) -> str | None:
        """The checkpoint directory it was exported from."""
        return self.source.get("path")

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.config)

    @property
    def verify(self) -> Graph | None:
        """The static tree-verify graph (None: an export made before speculation)."""
        return self.graphs.get("verify")

    @property
    def prefill(self) -> Graph:
        return self.graphs["prefill"]

    @property
    def decode(self) -> Graph:
        return self.graphs["decode"]

    @property
    def cpu(self) -> Graph | None:
        """The any-N CPU graph prefill and decode share (None: they run their own graphs)."""
        return self.graphs.get("cpu")

    @property
    def cpu_verify(self) -> Graph | None:
        """The CPU's verify graph sized to the draft (None: the static verify graph serves the CPU too)."""
        return self.graphs.get("cpu_verify")

    def without_contexts(self, profile: str) -> "Manifest":
        """This manifest with the profile's NPU graphs compiled at load (its context binaries are damaged)."""
        entry = replace(self.npu[profile], context=None, verify_context=None, tile_context=None)
        return replace(self, npu={**self.npu, profile: entry})

    @property
    def drafter_dirs(self) -> dict[str, str]:
        """Every drafter the export ships, kind -> directory (the default's kind included)."""
        shipped = dict(self.drafters or {})
        if self.drafter is not None and self.drafter.dir:
            shipped.setdefault(self.drafter.drafter_kind, self.drafter.dir)
        return shipped

    @property
    def default_drafter_dir(self) -> str:
        return (self.drafter.dir if self.drafter is not None and self.drafter.dir else None) or DRAFTER_DIR

    @classmethod
    def from_json(cls, m: dict, path: Path) -> "Manifest":
        """The record of a parsed model.json whose shape load_manifest has checked."""
        drafter = m.get("drafter")
        return cls(format=m["format"], source=_dict(m.get("source")), config=m["config"], dtype=m.get("dtype"),
                   chunk=m["chunk"], graphs={k: Graph.from_json(g) for k, g in m["graphs"].items()},
                   weights=Weights.from_json(m["weights"]),
                   npu={k: _npu_entry(e) for k, e in (m.get("npu") or {}).items()},
                   kv_cache=m.get("kv_cache", LEGACY_KV_CACHE), state=m.get("state"),
                   tokenizer=Tokenizer.from_json(m.get("tokenizer")), generation=m.get("generation"),
                   drafter=DrafterManifest.from_json(drafter, str(path / MANIFEST), _reexport(path), opened=False) if drafter else None,
                   drafters=m.get("drafters"), integrity=m.get("integrity"))


def _npu_entry(e: dict) -> NpuEntry:
    def parts(key):
        got = e.get(key)
        return None if got is None else tuple(Graph.from_json(p) for p in got)

    return NpuEntry(attention_capacity=e.get("attention_capacity"), chunk=e.get("chunk"),
                    max_context=e.get("max_context"), profile=e.get("profile"), weights=NpuWeights.from_json(e.get("weights")),
                    parts=parts("parts") or (), context=Contexts.from_json(e.get("context")),
                    verify_parts=parts("verify_parts"), verify_context=Contexts.from_json(e.get("verify_context")),
                    tile=Tile.from_json(e.get("tile")), tile_context=Contexts.from_json(e.get("tile_context")))


def _reexport(path: Path) -> str:
    return f"re-export it with: export-hybrid SOURCE {path}"


REQUIRED = {"config": dict, "chunk": int, "graphs": dict, "weights": dict}


def load_manifest(path: Path) -> Manifest:
    """model.json of the export at path, checked: a bounded JSON object of this format whose entries
    have the types the runtime reads, whose graphs take sane token counts, and whose every named file
    lies inside the export; else one UserError line naming what is wrong and the fix. The config's
    own sanity (sizes, layer kinds, state bytes) is runtime/export_check.py's."""
    mf = path / MANIFEST
    m = read_json(mf, CONFIG_BYTES, "the manifest", f"the export is damaged: {_reexport(path)}")
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise UserError(f"{mf}: not a {FORMAT} manifest (format {got!r}); {_reexport(path)}")
    for key, kind in REQUIRED.items():
        if not isinstance(m.get(key), kind) or (kind is int and isinstance(m.get(key), bool)):
            raise UserError(f"{mf} has no valid {key!r} entry; the export is damaged: {_reexport(path)}")
    fix = f"the export is damaged or was edited: {_reexport(path)}"
    for name, g in m["graphs"].items():
        if not isinstance(g, dict) or not isinstance(g.get("file"), str) or type(g.get("n")) is not int \
                or not 1 <= g["n"] <= MAX_GRAPH_TOKENS:
            raise UserError(f"{mf}: graph entry {name!r} is damaged; {_reexport(path)}")
        if "sizes" in g and (not isinstance(g["sizes"], list) or not all(type(s) is int for s in g["sizes"])):
            raise UserError(f"{mf}: graph entry {name!r} is damaged; {_reexport(path)}")
    if "file" in m["weights"]:
        inside(path, m["weights"].get("file"), "weights file", fix)
    drafters, default = m.get("drafters") or {}, m.get("drafter")
    if not isinstance(drafters, dict) or (default is not None and not isinstance(default, dict)):
        raise UserError(f"{mf}: its drafter entries are damaged; {_reexport(path)}")
    for kind, d in [*drafters.items(), *((("default", default.get("dir", DRAFTER_DIR)),) if default else ())]:
        inside(path, d, f"{kind} drafter directory", fix)
    _check_npu(m.get("npu"), mf, path)
    tok = m.get("tokenizer")
    if tok is not None and not isinstance(tok, dict):
        raise UserError(f"{mf}: its tokenizer entry is damaged; {_reexport(path)}")
    if "prefill" not in m["graphs"] or "decode" not in m["graphs"]:
        raise UserError(f"{mf} lists no prefill/decode graphs; {_reexport(path)}")
    kv_cache = m.get("kv_cache", LEGACY_KV_CACHE)
    if not isinstance(kv_cache, str) or kv_cache not in KV_CACHES:
        raise UserError(f"{path}: kv_cache {kv_cache!r} in {MANIFEST} is not one of {', '.join(KV_CACHES)}; "
                        "re-export it with this hybrid-npu (export-hybrid --kv-cache)")
    manifest = Manifest.from_json(m, path)
    for rel in [f for e in manifest.npu.values() for f in e.files()]:
        inside(path, rel, "NPU graph or context file", fix)
    return manifest


def _check_npu(npu, mf: Path, path: Path) -> None:
    """model.json's "npu" entry has the shape its records are read from."""
    if npu is None:
        return
    damaged = UserError(f"{mf}: its npu entry is damaged; {_reexport(path)}")
    if not isinstance(npu, dict):
        raise damaged
    for entry in npu.values():
        if not isinstance(entry, dict):
            raise damaged
        for parts_key, context_key in NPU_GRAPHS.values():
            parts, ctx = entry.get(parts_key) or [], entry.get(context_key) or {}
            if not isinstance(parts, list) or not all(isinstance(q, dict) for q in parts) or not isinstance(ctx, dict) \
                    or not isinstance(ctx.get("files") or [], list):
                raise damaged
        for key in ("tile", "tile_context", "profile", "weights"):
            if not isinstance(entry.get(key) or {}, dict):
                raise damaged


def read_manifest_json(path: Path):
    """model.json of a folder as parsed JSON (any type), or None when it is absent or unreadable as
    a bounded regular JSON file (a link to /dev/zero, a FIFO, 100k nested lists): for deciding
    whether a folder is an export, not for loading one."""
    try:
        return read_json(path / MANIFEST, CONFIG_BYTES, "the manifest", "")
    except (UserError, OSError):
        return None


def is_export(path: Path) -> bool:
    """A folder whose model.json is of this format (it may still be damaged: load_manifest says)."""
    m = read_manifest_json(path)
    return isinstance(m, dict) and m.get("format") == FORMAT


def listed_files(path: Path) -> set[str] | None:
    """The files the export at path says it wrote (its integrity entry, and model.json), or None
    when it cannot say (no readable manifest, an export made before the entry)."""
    m = read_manifest_json(path)
    entry = m.get("integrity") if isinstance(m, dict) else None
    files = entry.get("files") if isinstance(entry, dict) else None
    return {*files, MANIFEST} if isinstance(files, dict) else None
