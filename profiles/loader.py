"""Device profiles: read, validate and write the TOML files that describe one target device.

A profile holds what changes between devices and nothing else (docs/profiles.md): the QNN provider
options of the NPU, the static graph shapes, the memory budget and the dispatch thresholds.
Built-in profiles ship next to this file; user profiles (written by a calibrate command, or by
hand) live in `user_profile_dir()` and shadow built-ins of the same name.

Every problem with a file is a UserError of one line that names the file, the [table] and key,
and the fix. Schema (all keys required unless noted; unknown keys are errors):

    name, description                      top level; name == file stem
    [npu]       (optional: absent = no NPU) backend, soc_model, htp_arch, precision,
                                           performance_mode, graph_finalization, vtcm_mb
    [shapes]    prefill_chunk, verify_tree_size, attention_capacity, part_weight_bytes
    [memory]    budget_bytes
    [dispatch]  npu_prefill_min_tokens (only with [npu]), verify_device
    [verify]    (optional, written by npu-bench calibrate) sizes, devices, cpu_us, npu_us: per verify
                tree size, the device that verifies it and the measured costs (microseconds, 0 = not
                measured). A missing table leaves [dispatch] verify_device in charge; a damaged one
                is reported in one line and left out the same way, so a hand edit never stops a chat.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_npu.errors import UserError

BUILTIN_DIR = Path(__file__).resolve().parent
ENV_DIR = "HYBRID_NPU_PROFILE_DIR"
INT32_MAX = 2**31 - 1  # HTP narrows int64 to int32 (docs/htp-traps.md, trap 2): positions must stay below

# Values onnxruntime-qnn accepts; it only logs a warning for anything else and runs with its
# default, so we refuse them here (qnn_execution_provider.cc ParseHtpPerformanceMode /
# ParseHtpArchitecture; docs/profiles.md).
PERFORMANCE_MODES = ("burst", "sustained_high_performance", "high_performance", "balanced",
                     "low_balanced", "default", "high_power_saver", "power_saver",
                     "low_power_saver", "extreme_power_saver")
HTP_ARCHS = (68, 69, 73, 75, 79, 81)
PRECISIONS = ("fp16", "quantized")  # fp16: enable_htp_fp16_precision=1; quantized: QDQ models, =0
BACKENDS = ("htp",)
VERIFY_DEVICES = ("cpu", "npu")
# QNN soc_model id -> Hexagon arch, for ids with two agreeing public sources (quic/ai-hub-apps
# manual_bundle.md via npu-runtimes.md §2; alibaba/MNN QNN docs). soc_model wins over htp_arch
# in QNN when both are given, so a mismatch would silently compile for the wrong arch.
KNOWN_SOCS = {43: 73, 57: 75, 60: 73, 69: 79, 87: 81}


@dataclass(frozen=True)
class _Key:
    kind: type                       # int or str (bool is never an int here)
    example: str                     # shown in "missing key" and "wrong type" fixes
    choices: tuple = ()              # allowed values, when the key is an enum
    lo: int | None = None
    hi: int | None = None


SCHEMA: dict[str, dict[str, _Key]] = {
    "": {
        "name": _Key(str, '"snapdragon-x-elite"'),
        "description": _Key(str, '"Snapdragon X Elite laptop"'),
    },
    "npu": {
        "backend": _Key(str, '"htp"', BACKENDS),
        "soc_model": _Key(int, "60", lo=1, hi=INT32_MAX),
        "htp_arch": _Key(int, "73", HTP_ARCHS),
        "precision": _Key(str, '"fp16"', PRECISIONS),
        "performance_mode": _Key(str, '"burst"', PERFORMANCE_MODES),
        "graph_finalization": _Key(int, "3", lo=0, hi=3),
        "vtcm_mb": _Key(int, "0", lo=0, hi=1024),
    },
    "shapes": {
        "prefill_chunk": _Key(int, "128", lo=2, hi=4096),
        "verify_tree_size": _Key(int, "64", lo=2, hi=512),
        "attention_capacity": _Key(int, "16384", lo=2, hi=INT32_MAX),
        "part_weight_bytes": _Key(int, "1_500_000_000", lo=1, hi=2**63 - 1),
        # key rows per NPU attention tile (docs/long-context.md); NPU profiles only. At most 32,768: a
        # tile's softmax sum (<= its rows) stays inside fp16 on the HTP
        "attention_tile": _Key(int, "2048", lo=8, hi=32768),
    },
    "memory": {
        "budget_bytes": _Key(int, "0", lo=0, hi=2**63 - 1),
    },
    "dispatch": {
        "npu_prefill_min_tokens": _Key(int, "8192", lo=1, hi=INT32_MAX),
        "verify_device": _Key(str, '"cpu"', VERIFY_DEVICES),
    },
}
OPTIONAL_TABLES = ("npu",)
# Profile field -> (table, key) for the flat fields that live in a table.
FLAT_FIELDS = {
    "prefill_chunk": ("shapes", "prefill_chunk"),
    "verify_tree_size": ("shapes", "verify_tree_size"),
    "attention_capacity": ("shapes", "attention_capacity"),
    "part_weight_bytes": ("shapes", "part_weight_bytes"),
    "attention_tile": ("shapes", "attention_tile"),
    "memory_budget_bytes": ("memory", "budget_bytes"),
    "npu_prefill_min_tokens": ("dispatch", "npu_prefill_min_tokens"),
    "verify_device": ("dispatch", "verify_device"),
}
VERIFY_KEYS = ("sizes", "devices", "cpu_us", "npu_us")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class NpuOptions:
    backend: str
    soc_model: int
    htp_arch: int
    precision: str
    performance_mode: str
    graph_finalization: int
    vtcm_mb: int


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    source: Path = field(compare=False)  # the file it came from; two equal profiles may differ here
    npu: NpuOptions | None
    prefill_chunk: int
    verify_tree_size: int
    attention_capacity: int
    part_weight_bytes: int
    attention_tile: int                  # key rows per NPU attention tile; 0 when there is no [npu] table
    memory_budget_bytes: int             # 0 = auto (psutil available memory minus a margin)
    npu_prefill_min_tokens: int          # 0 when there is no [npu] table (never used then)
    verify_device: str
    # measured per verify tree size (npu-bench calibrate): ((size, device, cpu_us, npu_us), ...) by size;
    # () = not measured, [dispatch] verify_device decides
    verify_by_size: tuple = ()

    @property
    def has_npu(self) -> bool:
        return self.npu is not None

    def verify_device_for(self, nodes: int) -> str:
        """The device the profile verifies a tree of `nodes` on: the measured choice of the smallest
        measured size that holds it (the largest, past them all); else [dispatch] verify_device."""
        if not self.verify_by_size:
            return self.verify_device
        return next((e for e in self.verify_by_size if e[0] >= nodes), self.verify_by_size[-1])[1]

    @property
    def verifies_on_npu(self) -> bool:
        """Whether any round may verify on the NPU (its verify graph is opened then)."""
        if self.verify_by_size:
            return any(e[1] == "npu" for e in self.verify_by_size)
        return self.verify_device == "npu"

    def qnn_provider_options(self) -> dict[str, str]:
        """onnxruntime-qnn provider options (names and string values as the EP parses them)."""
        if self.npu is None:
            raise UserError(f"profile {self.name} ({self.source}) has no [npu] table, so there are no QNN "
                            f"options; pick an NPU profile ({', '.join(n for n in builtin_profiles() if n != 'cpu')})")
        n = self.npu
        opts = {
            "backend_type": n.backend,
            "soc_model": str(n.soc_model),
            "htp_arch": str(n.htp_arch),
            "enable_htp_fp16_precision": "1" if n.precision == "fp16" else "0",
            "htp_performance_mode": n.performance_mode,
            "htp_graph_finalization_optimization_mode": str(n.graph_finalization),
        }
        if n.vtcm_mb:
            opts["vtcm_mb"] = str(n.vtcm_mb)
        return opts

    def to_dict(self) -> dict:
        """Plain data laid out like the TOML file (no [npu] table, no threshold when there is no NPU)."""
        d: dict = {"name": self.name, "description": self.description}
        if self.npu is not None:
            d["npu"] = dataclasses.asdict(self.npu)
        for f, (table, key) in FLAT_FIELDS.items():
            if f in ("npu_prefill_min_tokens", "attention_tile") and self.npu is None:
                continue
            d.setdefault(table, {})[key] = getattr(self, f)
        if self.verify_by_size:
            d["verify"] = {k: [e[i] for e in self.verify_by_size] for i, k in enumerate(VERIFY_KEYS)}
        return d


# ------------------------------------------------------------------ where profiles live
def user_profile_dir() -> Path:
    """$HYBRID_NPU_PROFILE_DIR, else %APPDATA%\\hybrid-npu\\profiles on Windows, else
    $XDG_CONFIG_HOME/hybrid-npu/profiles (default ~/.config/hybrid-npu/profiles)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    if sys.platform.startswith("win"):
        base = os.environ.get("APPDATA") or str(Path.home() / "AppData" / "Roaming")
    else:
        xdg = os.environ.get("XDG_CONFIG_HOME", "")
        base = xdg if os.path.isabs(xdg) else str(Path.home() / ".config")  # XDG: relative = unset
    return Path(base) / "hybrid-npu" / "profiles"


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def _user_profiles() -> list[str]:
    d = user_profile_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def _known() -> str:
    builtin, user = builtin_profiles(), _user_profiles()
    text = ", ".join(builtin)
    if user:
        text += "; user: " + ", ".join(user)
    return text


def _is_path(x: str | Path) -> bool:
    if isinstance(x, Path):
        return True
    return x.endswith(".toml") or "/" in x or "\\" in x


def load_profile(name_or_path: str | Path) -> Profile:
    """A path to a .toml file, or a profile name: looked up in user_profile_dir() first, then
    among the built-ins."""
    if _is_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise UserError(f"profile file not found: {path}; check the path, or give a profile name "
                            f"(known: {_known()})")
        return _load_file(path)
    name = str(name_or_path)
    for d in (user_profile_dir(), BUILTIN_DIR):
        path = d / f"{name}.toml"
        if NAME_RE.fullmatch(name) and path.is_file():
            return _load_file(path)
    close = difflib.get_close_matches(name, builtin_profiles() + _user_profiles(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UserError(f"unknown profile {name!r}; {hint}known profiles: {_known()} "
                    f"(or give a path to a .toml file; user profiles go in {user_profile_dir()})")


PROFILE_BYTES = 1 << 20  # a profile is a few dozen lines


def _load_file(path: Path) -> Profile:
    from hybrid_npu.safe_files import read_text

    text = read_text(path, PROFILE_BYTES, "the profile", "check the file, or give a profile name")
    try:
        return _parse(text, path)
    except RecursionError:
        raise UserError(f"profile {path}: its TOML nests too deeply; check the file") from None


# ------------------------------------------------------------------ validation
_TOML_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string", dict: "table", list: "array"}


def _type_name(v) -> str:
    return _TOML_TYPES.get(type(v), type(v).__name__)


def _literal(v) -> str:
    try:
        return _toml_value(v)
    except UserError:
        return "{...}" if isinstance(v, dict) else repr(v)


def _where(table: str) -> str:
    return f"[{table}]" if table else "the top level"


def _parse(text: str, path: Path) -> Profile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = " ".join(str(e).split())
        raise UserError(f"profile {path}: invalid TOML: {msg}; fix the syntax there") from None
    return _from_data(data, path)


def _check_table(data: dict, table: str, path: Path, skip: tuple[str, ...] = ()) -> dict:
    """Validate one table against SCHEMA; returns its values."""
    spec = SCHEMA[table]
    allowed = spec.keys() | ({k for k in SCHEMA if k} if table == "" else set())
    for key in data:
        if key not in allowed:
            known = ", ".join(k for k in [*spec, *sorted(allowed - spec.keys())] if k not in skip)
            raise UserError(f"profile {path}: unknown key {key!r} in {_where(table)}; known keys: {known}; "
                            f"remove or rename it")
    out = {}
    for key, k in spec.items():
        if key in skip:
            continue
        if key not in data:
            raise UserError(f"profile {path}: missing key {key!r} in {_where(table)}; add it, e.g. {key} = {k.example}")
        v = data[key]
        if type(v) is not k.kind:  # exact type: TOML true/false must not pass as 1/0
            want = _TOML_TYPES[k.kind]
            raise UserError(f"profile {path}: {_where(table)} {key} must be {'an' if want == 'integer' else 'a'} "
                            f"{want}, got {_type_name(v)} {_literal(v)}; write e.g. {key} = {k.example}")
        if k.choices and v not in k.choices:
            raise UserError(f"profile {path}: {_where(table)} {key} = {v!r} is not allowed; "
                            f"use one of: {', '.join(map(str, k.choices))}")
        if (k.lo is not None and v < k.lo) or (k.hi is not None and v > k.hi):
            raise UserError(f"profile {path}: {_where(table)} {key} = {v} is out of range; "
                            f"use an integer in {k.lo}..{k.hi}")
        out[key] = v
    return out


_REPORTED: set[str] = set()


def _verify_table(data, path: Path, has_npu: bool) -> tuple:
    """The measured [verify] table as verify_by_size; a damaged one is reported in one line and
    left out (the seed verify_device decides then): measured costs are an optimisation, never a
    reason to refuse a chat."""
    try:
        if not isinstance(data, dict):
            raise ValueError("it is not a table")
        unknown = sorted(set(data) - set(VERIFY_KEYS))
        if unknown or len(data) != len(VERIFY_KEYS):
            raise ValueError(f"its keys must be exactly {', '.join(VERIFY_KEYS)}")
        cols = [data[k] for k in VERIFY_KEYS]
        if not all(isinstance(c, list) for c in cols) or len({len(c) for c in cols}) != 1 or not cols[0]:
            raise ValueError("sizes, devices, cpu_us and npu_us must be lists of one equal, non-zero length")
        rows = list(zip(*cols))
        for size, device, cpu_us, npu_us in rows:
            if not all(type(v) is int for v in (size, cpu_us, npu_us)) or not 2 <= size <= 512:
                raise ValueError(f"entry for size {size!r}: sizes must be integers in 2..512 and costs integers")
            if cpu_us < 0 or npu_us < 0 or cpu_us > 10**9 or npu_us > 10**9:
                raise ValueError(f"entry for size {size}: costs must be in 0..1000000000 microseconds")
            if device not in VERIFY_DEVICES or (device == "npu" and not (has_npu and npu_us)) \
                    or (device == "cpu" and not cpu_us):
                raise ValueError(f"entry for size {size}: device {device!r} has no measured cost there")
        if [r[0] for r in rows] != sorted({r[0] for r in rows}):
            raise ValueError("sizes must rise")
    except ValueError as e:
        line = (f"hybrid-npu: profile {path}: [verify] measured costs are damaged ({e}); using [dispatch] "
                f"verify_device instead; re-measure with: npu-bench calibrate --profile {path.stem}")
        if line not in _REPORTED:  # once a process: a command reads its profile more than once
            _REPORTED.add(line)
            print(line, file=sys.stderr)
        return ()
    return tuple(rows)


def _from_data(data: dict, path: Path) -> Profile:
    data = dict(data)
    verify_data = data.pop("verify", None)
    top = _check_table(data, "", path)
    for table in SCHEMA:
        if not table:
            continue
        if table not in data:
            if table in OPTIONAL_TABLES:
                continue
            raise UserError(f"profile {path}: missing table [{table}]; add it with keys "
                            f"{', '.join(SCHEMA[table])}")
        if not isinstance(data[table], dict):
            raise UserError(f"profile {path}: {table} must be a table ([{table}]), got {_type_name(data[table])}; "
                            f"write it as a [{table}] section")
    if top["name"] != path.stem:
        raise UserError(f"profile {path}: name = {top['name']!r} does not match the file name {path.name!r}; "
                        f"set name = \"{path.stem}\" or rename the file")

    npu = None
    if "npu" in data:
        npu = NpuOptions(**_check_table(data["npu"], "npu", path))
        want = KNOWN_SOCS.get(npu.soc_model)
        if want is not None and want != npu.htp_arch:
            raise UserError(f"profile {path}: [npu] soc_model = {npu.soc_model} is a v{want} chip but htp_arch = "
                            f"{npu.htp_arch}; set htp_arch = {want} or correct soc_model")
    shapes = _check_table(data["shapes"], "shapes", path, skip=() if npu else ("attention_tile",))
    memory = _check_table(data["memory"], "memory", path)
    dispatch_data = data["dispatch"]
    if npu is None and "npu_prefill_min_tokens" in dispatch_data:
        raise UserError(f"profile {path}: [dispatch] npu_prefill_min_tokens needs an [npu] table; "
                        f"remove it (no NPU here) or add [npu]")
    dispatch = _check_table(dispatch_data, "dispatch", path, skip=() if npu else ("npu_prefill_min_tokens",))

    if shapes["attention_capacity"] < shapes["prefill_chunk"]:
        raise UserError(f"profile {path}: [shapes] attention_capacity = {shapes['attention_capacity']} is below "
                        f"prefill_chunk = {shapes['prefill_chunk']}; raise attention_capacity to at least "
                        f"{shapes['prefill_chunk']}")
    if npu is None and dispatch["verify_device"] == "npu":
        raise UserError(f"profile {path}: [dispatch] verify_device = 'npu' needs an [npu] table; "
                        f"set verify_device = \"cpu\" or add [npu]")

    return Profile(
        name=top["name"], description=top["description"], source=path, npu=npu,
        prefill_chunk=shapes["prefill_chunk"], verify_tree_size=shapes["verify_tree_size"],
        attention_capacity=shapes["attention_capacity"], part_weight_bytes=shapes["part_weight_bytes"],
        attention_tile=shapes.get("attention_tile", 0), memory_budget_bytes=memory["budget_bytes"],
        npu_prefill_min_tokens=dispatch.get("npu_prefill_min_tokens", 0),
        verify_device=dispatch["verify_device"],
        verify_by_size=() if verify_data is None else _verify_table(verify_data, path, npu is not None),
    )


# ------------------------------------------------------------------ writing
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        out = []
        for ch in v:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04X}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    raise UserError(f"cannot write {v!r} ({type(v).__name__}) to a profile; use an integer or a string")


def dumps(data: dict, header: str = "") -> str:
    """A tiny TOML emitter for profile-shaped data: top-level scalars, then one level of tables."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for table, values in data.items():
        if isinstance(values, dict):
            lines += ["", f"[{table}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def write_user_profile(profile: Profile, **overrides) -> Path:
    """Write `profile` (with `overrides` applied) to user_profile_dir()/<name>.toml and return the
    path. Overrides use the flat Profile field names (npu_prefill_min_tokens=3000, name="mine"),
    the NpuOptions field names (performance_mode="sustained_high_performance"), or npu=... .
    The text is validated exactly as load_profile() will read it before anything is written."""
    npu_fields = {f.name for f in dataclasses.fields(NpuOptions)}
    profile_fields = {f.name for f in dataclasses.fields(Profile)} - {"source"}
    bad = sorted(set(overrides) - npu_fields - profile_fields)
    if bad:
        raise TypeError(f"write_user_profile: unknown override(s) {', '.join(bad)}; use Profile or NpuOptions "
                        f"field names ({', '.join(sorted(profile_fields | npu_fields))})")
    npu_over = {k: overrides.pop(k) for k in list(overrides) if k in npu_fields}
    p = dataclasses.replace(profile, **overrides)
    if npu_over:
        if p.npu is None:
            raise UserError(f"profile {p.name} has no [npu] table; cannot set {', '.join(sorted(npu_over))} "
                            f"(start from an NPU profile)")
        p = dataclasses.replace(p, npu=dataclasses.replace(p.npu, **npu_over))
    if p.npu is None and p.npu_prefill_min_tokens:  # to_dict() leaves it out: don't drop it silently
        raise UserError(f"profile {p.name}: [dispatch] npu_prefill_min_tokens needs an [npu] table; "
                        f"leave it at 0 (no NPU here) or start from an NPU profile")
    if not NAME_RE.fullmatch(p.name):
        raise UserError(f"profile name {p.name!r} cannot be a file name; use letters, digits, '.', '_' and '-'")

    directory = user_profile_dir()
    path = directory / f"{p.name}.toml"
    text = dumps(p.to_dict(), header=f"hybrid-npu device profile, written from {profile.source}.\n"
                                     f"Edit freely: load_profile('{p.name}') validates it.")
    _parse(text, path)  # refuse to write a file that would not load back
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".toml.tmp")
        tmp.write_text(text, encoding="utf-8", newline="\n")
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"cannot write profile {path} ({e}); set {ENV_DIR} to a writable folder") from None
    return path
