"""The runtime on ARM64 (the users' Snapdragon CPUs) against x86_64, in one job on an x86_64 Linux
host: a Debian arm64 root built with debootstrap and run through qemu-user-static, cached between
runs, holding the runtime's aarch64 wheels (the host's versions) and this tree's wheel.
docs/arm64.md says what is compared and why the tolerances are what they are.

    python scripts/check_arm64.py            # exit 0 same, 1 differs, 3 cannot run here (one line why)

Needs root (debootstrap, chroot, mount), apt-get for the two host packages when missing, binfmt_misc,
and the network for the first build (Debian's packages, PyPI's aarch64 wheels). Needs the test
extras on the host side (torch/transformers build the small checkpoint, as tests/fixtures.py does).
Cache: $HYBRID_NPU_ARM64_CACHE, else ~/.cache/hybrid-npu/arm64-root; a change of ROOT_VERSION or of
the pinned wheel versions rebuilds what depends on it. Nothing here measures speed (emulated).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SKIP_EXIT = 3
# the root's recipe: change it and the cached root is rebuilt
ROOT_VERSION = "debian bookworm arm64 minbase +python3, v1"
SUITE = "bookworm"
# the runtime's dependencies (pyproject.toml), at the versions the host runs, so that a difference is
# the architecture's and not a release's
RUNTIME_PACKAGES = ["numpy", "onnx", "onnxruntime", "safetensors", "tokenizers", "jinja2", "psutil",
                    "prompt_toolkit", "rich"]
AARCH64_PLATFORMS = ["manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"]
# The emulated CPU: qemu's "max" has SVE and SME, which Snapdragon X's Oryon cores lack and under
# which ONNX Runtime picks SME kernels that qemu runs over 10x slower; without them it advertises NEON,
# dot product, i8mm and bf16, as Oryon does.
QEMU_CPU = "max,sve=off,sme=off"
IN_ROOT = "/opt/hybrid-npu"  # where the project, its wheels, the probe and the work go inside the root
# relative max |arm64 - x86_64| / max |x86_64| over every compared logit row (docs/arm64.md has the
# measured values). fp32 and the quantised exports multiplying in fp32 (accuracy_level 0): only the
# order of sums differs, which this random fixture amplifies to ~1e-5 over 17 steps.
TOLERANCES = {"fp32": 1e-4, "int8-fp32compute": 1e-4, "int4-fp32compute": 1e-4}
# As shipped, int8/int4 round activations to int8 per block (accuracy_level 4), which the ARM64
# kernels do their own way: ARM64 may differ from x86_64 by at most what that rounding moves the
# logits on x86_64 at all (shipped against its fp32-multiplying copy, measured in the same run).
ROUNDING_BOUND = {"int8": "int8-fp32compute", "int4": "int4-fp32compute"}
# exports whose free-running greedy ids must be identical: those whose logits differ by far less than
# this fixture's nearest top-2 gaps (~1e-3 of the peak). Shipped int4 is not among them: its 1-9%
# difference flips a near-tie (docs/arm64.md); its logits are compared on the same fed tokens instead.
GREEDY_EXACT = {"fp32", "int8-fp32compute", "int4-fp32compute", "int8"}
CHUNK = 8
# the probe's exact comparisons: greedy ids, the snapshot's continuation, rendered templates
EXACT_KEYS = ["template_text", "template_ids", "embedded_plain", "embedded_speculative", "resumed_position", "resumed"]


def say(msg: str) -> None:
    print(f"check_arm64: {msg}", flush=True)


class Unavailable(Exception):
    """The check cannot run on this host; str() is the one-line reason."""


def run(cmd: list[str], timeout: float, stream: bool = False, **kw) -> subprocess.CompletedProcess:
    """cmd's stdout captured; its stderr too, or passed on as it comes (stream: a long run's progress)."""
    return subprocess.run(cmd, timeout=timeout, check=True, text=True, stdout=subprocess.PIPE,
                          stderr=None if stream else subprocess.PIPE, **kw)


def tail(e: subprocess.CalledProcessError) -> str:
    lines = (e.stderr or e.stdout or "").strip().splitlines()
    return lines[-1] if lines else f"exit status {e.returncode}"


# ------------------------------------------------------------------ host
def host_ready() -> None:
    """Raise Unavailable with why the host cannot run arm64 binaries, after trying to make it able."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise Unavailable(f"it runs on Linux x86_64 hosts (this is {sys.platform} {platform.machine()})")
    if os.geteuid() != 0:
        raise Unavailable("it needs root (debootstrap, chroot and mount); run it as root, as .ci/run does")
    missing = [p for p, exe in (("debootstrap", "debootstrap"), ("qemu-user-static", "qemu-aarch64-static"))
               if not shutil.which(exe)]
    if missing:
        if not shutil.which("apt-get"):
            raise Unavailable(f"{' and '.join(missing)} missing and no apt-get to install them")
        say(f"installing {' '.join(missing)} with apt-get")
        try:
            run(["apt-get", "update", "-q"], 600)
            run(["apt-get", "install", "-y", "-q", *missing, "binfmt-support"], 900,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            why = tail(e) if isinstance(e, subprocess.CalledProcessError) else "timed out"
            raise Unavailable(f"apt-get could not install {' '.join(missing)} (no network?): {why}") from None
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if not (binfmt / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(binfmt)], capture_output=True, timeout=30)
    entry = binfmt / "qemu-aarch64"
    if not entry.exists() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True, timeout=60)
    if not entry.exists():
        raise Unavailable("the kernel has no binfmt_misc entry for aarch64 (binfmt_misc not mountable here, "
                          "or qemu-user-static's entry not registered)")
    lines = entry.read_text().splitlines()
    flags = next((ln.split(":", 1)[1] for ln in lines if ln.startswith("flags:")), "")
    if lines[:1] != ["enabled"] or "F" not in flags:
        raise Unavailable("binfmt_misc's qemu-aarch64 entry is disabled or lacks the F flag (the interpreter must be "
                          "opened at registration to run inside a chroot)")


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRID_NPU_ARM64_CACHE") or Path.home() / ".cache" / "hybrid-npu" / "arm64-root")


def pins() -> list[str]:
    return [f"{p}=={metadata.version(p)}" for p in RUNTIME_PACKAGES]


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_stamp(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------ the root
def ensure_root(cache: Path) -> tuple[Path, str]:
    """The cached root (built when missing or of another ROOT_VERSION) and its python's X.Y."""
    root, stamp = cache / "root", cache / "root.json"
    have = read_stamp(stamp)
    if have.get("version") == ROOT_VERSION and (root / "usr/bin/python3").exists():
        return root, have["python"]
    say(f"building the arm64 root ({ROOT_VERSION}) with debootstrap, once")
    stamp.unlink(missing_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    building = cache / "root.building"
    for old in (building, root):
        unmount(old)
        shutil.rmtree(old, ignore_errors=True)
    try:  # Debian's default archive: no mirror named here
        run(["debootstrap", "--arch=arm64", "--variant=minbase", "--include=python3", SUITE, str(building)], 1800)
    except subprocess.CalledProcessError as e:
        raise Unavailable(f"debootstrap failed (no network for the first build?): {tail(e)}") from None
    except subprocess.TimeoutExpired:
        raise Unavailable("debootstrap took over 30 minutes") from None
    building.rename(root)
    py = in_root(root, ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], timeout=120).strip()
    stamp.write_text(json.dumps({"version": ROOT_VERSION, "python": py}), encoding="utf-8")
    return root, py


def ensure_wheels(cache: Path, root: Path, python: str) -> Path:
    """The runtime's aarch64 wheels installed in the root (site/), reinstalled when the pins change."""
    want = pins()
    site, stamp = root / IN_ROOT.lstrip("/") / "site", root / IN_ROOT.lstrip("/") / "site.json"
    key = _key(json.dumps([want, python]))
    if read_stamp(stamp).get("key") == key and site.is_dir():
        return site
    wheels = cache / f"wheels-{key}"
    target = ["--platform", *" --platform ".join(AARCH64_PLATFORMS).split(), "--only-binary", ":all:",
              "--python-version", python, "--implementation", "cp"]
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    if not wheels.is_dir():
        say(f"downloading the aarch64 wheels for python {python}: {' '.join(want)}")
        part = cache / f"wheels-{key}.part"
        shutil.rmtree(part, ignore_errors=True)
        try:
            run([*pip, "download", "--dest", str(part), *target, *want], 900)
        except subprocess.CalledProcessError as e:
            raise Unavailable(f"pip could not download the aarch64 wheels (no network?): {tail(e)}") from None
        part.rename(wheels)
    stamp.unlink(missing_ok=True)
    shutil.rmtree(site, ignore_errors=True)
    run([*pip, "install", "--no-index", "--find-links", str(wheels), "--target", str(site), *target, *want], 900)
    stamp.write_text(json.dumps({"key": key, "pins": want}), encoding="utf-8")
    return site


def install_project(root: Path) -> None:
    """This tree as a wheel (what users install), built from a copy so the tree gets no build/."""
    dest = root / IN_ROOT.lstrip("/") / "project"
    shutil.rmtree(dest, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (REPO / name).exists():
                src.mkdir(exist_ok=True)
                shutil.copy2(REPO / name, src / name)
        for pkg in ("src", "export", "runtime", "kernels", "profiles"):
            shutil.copytree(REPO / pkg, src / pkg, ignore=ignore)
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
        run([*pip, "wheel", "--no-deps", "-w", str(Path(tmp) / "dist"), str(src)], 600)
        wheel = next((Path(tmp) / "dist").glob("hybrid_npu-*.whl"))
        run([*pip, "install", "--no-deps", "--no-index", "--target", str(dest), str(wheel)], 300)


# ------------------------------------------------------------------ running inside the root
def mounted(path: Path) -> bool:
    target = str(path.resolve())
    return any(line.split()[1] == target for line in Path("/proc/mounts").read_text().splitlines())


def unmount(root: Path) -> None:
    proc = root / "proc"
    if proc.is_dir() and mounted(proc):
        subprocess.run(["umount", "-l", str(proc)], capture_output=True, timeout=60)


def in_root(root: Path, cmd: list[str], timeout: float, stream: bool = False) -> str:
    """cmd inside the root, with its own /proc (ONNX Runtime's external-data check opens
    /proc/self/fd) and never the host's /sys (ORT's cpuinfo would read x86 CPU lists and crash)."""
    proc = root / "proc"
    if not mounted(proc):
        subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True, timeout=60)
    env = ["/usr/bin/env", "-i", f"QEMU_CPU={QEMU_CPU}", "PATH=/usr/bin:/bin", "HOME=/tmp", "LANG=C.UTF-8",
           "PYTHONUTF8=1", f"PYTHONPATH={IN_ROOT}/project:{IN_ROOT}/site"]
    try:
        return run(["chroot", str(root), *env, *cmd], timeout, stream,
                   env={**os.environ, "QEMU_CPU": QEMU_CPU}).stdout
    finally:
        unmount(root)


# ------------------------------------------------------------------ x86_64 side
def prepare(work: Path) -> None:
    """A small checkpoint (tests/fixtures.py's text model, built with transformers), exported fp32 /
    int8 / int4 on x86_64; the embedded model's state saved on x86_64 mid-reply."""
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "scripts" / "train")]  # pytest's pythonpath (pyproject)
    import fixtures  # noqa: E402  (torch/transformers: the test extras)

    import hybrid_npu
    from hybrid_npu.export.exporter import export

    fixtures.write_text_checkpoint(work / "hf", seed=1, tie=True)
    for name, weights in (("fp32", None), ("int8", "int8"), ("int4", "int4")):
        export(work / "hf", work / "exports" / name, chunk=CHUNK, **({"weights": weights} if weights else {}))
    shutil.rmtree(work / "hf")
    from hybrid_npu import integrity

    for name in ("int8", "int4"):  # the same weights multiplied in fp32: does ARM64 read them the same?
        dest = shutil.copytree(work / "exports" / name, work / "exports" / f"{name}-fp32compute")
        fixtures.fp32_compute(dest / "graphs")
        manifest = json.loads((dest / "model.json").read_text(encoding="utf-8"))
        manifest["integrity"] = integrity.record(dest)  # the graphs were edited on purpose: hash them again
        (dest / "model.json").write_text(json.dumps(manifest), encoding="utf-8")

    sys.path.insert(0, str(REPO / "scripts"))
    from arm64_probe import PROMPT, THREADS

    from hybrid_npu.runtime.chat.template import ChatTemplate

    engine = hybrid_npu.load_engine(hybrid_npu.default_model(), threads=THREADS)
    text = ChatTemplate.from_export(engine.path).render([{"role": "user", "content": PROMPT}], enable_thinking=False)
    logits = engine.prefill(engine.tokenizer.encode(text, add_special_tokens=False).ids)
    for _ in range(5):
        logits = engine.decode(int(np.argmax(logits)))
    engine.save_state(work / "snapshot.state")
    (work / "snapshot.json").write_text(json.dumps({"next_token": int(np.argmax(logits))}), encoding="utf-8")


def load_result(work: Path, name: str) -> tuple[dict, dict]:
    result = json.loads((work / f"{name}.json").read_text(encoding="utf-8"))
    with np.load(work / f"{name}.npz") as z:
        return result, {k: z[k] for k in z.files}


# ------------------------------------------------------------------ the comparison
def relative_max(x: np.ndarray, y: np.ndarray) -> float:
    """max |y - x| / max |x|: NaN anywhere gives NaN."""
    return float(np.max(np.abs(x.astype(np.float64) - y)) / max(float(np.max(np.abs(x))), 1e-30))


def bounds(x86_logits: dict) -> dict[str, float]:
    """What each export's logits may differ by: TOLERANCES, and for the shipped quantised exports
    the x86_64 run's own activation-rounding effect (ROUNDING_BOUND)."""
    out = dict(TOLERANCES)
    for name, exact in ROUNDING_BOUND.items():
        if name in x86_logits and exact in x86_logits:
            out[name] = relative_max(x86_logits[name], x86_logits[exact])
    return out


def compare(x86: tuple[dict, dict], arm: tuple[dict, dict]) -> tuple[list[str], dict[str, float], dict[str, float]]:
    """(one line per difference beyond what is allowed, the relative max logit difference per export,
    the bound each was held to). Exact: rendered templates and their ids, the embedded model's greedy
    replies, the snapshot's resumed continuation, the greedy ids of the exports in GREEDY_EXACT.
    Within bounds(): every export's logits on the same fed tokens."""
    (a, a_logits), (b, b_logits) = x86, arm
    problems, measured, allowed = [], {}, bounds(a_logits)
    for key in EXACT_KEYS:
        if a.get(key) != b.get(key):
            problems.append(f"{key}: x86_64 {short(a.get(key))} != arm64 {short(b.get(key))}")
    for name in sorted(set(a_logits) | set(b_logits)):
        if name not in a_logits or name not in b_logits:
            problems.append(f"export {name}: only one side ran it")
            continue
        ids_a, ids_b = a.get(f"export_{name}_ids"), b.get(f"export_{name}_ids")
        if name in GREEDY_EXACT and ids_a != ids_b:
            problems.append(f"export {name} greedy ids: x86_64 {short(ids_a)} != arm64 {short(ids_b)}")
        x, y = a_logits[name], b_logits[name]
        if x.shape != y.shape:
            problems.append(f"export {name} logits: shapes {x.shape} != {y.shape}")
            continue
        measured[name] = rel = relative_max(x, y)
        if name not in allowed:
            problems.append(f"export {name}: no tolerance stated")
        elif not rel <= allowed[name]:  # NaN fails too
            problems.append(f"export {name} logits: relative max difference {rel:.3g} > {allowed[name]:.3g}")
    return problems, measured, allowed


def short(value, n: int = 120) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= n else text[:n] + "..."


# ------------------------------------------------------------------ main
def main() -> int:
    t0 = time.perf_counter()
    times = {}

    def lap(name, since):
        times[name] = round(time.perf_counter() - since, 1)
        return time.perf_counter()

    try:
        host_ready()
        cache = cache_dir()
        t = time.perf_counter()
        root, python = ensure_root(cache)
        t = lap("root", t)
        ensure_wheels(cache, root, python)
        t = lap("wheels", t)
    except Unavailable as e:
        print(f"check_arm64: skipped: {e}", flush=True)
        return SKIP_EXIT
    install_project(root)
    t = lap("project", t)
    opt = root / IN_ROOT.lstrip("/")
    work = opt / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "arm64_probe.py", opt / "arm64_probe.py")
    prepare(work)
    t = lap("x86_prepare", t)
    run([sys.executable, str(REPO / "scripts" / "arm64_probe.py"), str(work), "x86_64"], 900, stream=True)
    t = lap("x86_probe", t)
    try:
        in_root(root, ["python3", f"{IN_ROOT}/arm64_probe.py", f"{IN_ROOT}/work", "arm64"], timeout=1800, stream=True)
    except subprocess.CalledProcessError as e:
        say(f"the probe failed on arm64 (exit status {e.returncode}; its traceback above)")
        return 1
    t = lap("arm64_probe", t)
    x86, arm = load_result(work, "x86_64"), load_result(work, "arm64")
    if arm[0].get("machine") != "aarch64":
        say(f"the arm64 probe ran on {arm[0].get('machine')}, not aarch64")
        return 1
    problems, measured, allowed = compare(x86, arm)
    times["total"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"arm64": arm[0]["machine"], "qemu_cpu": QEMU_CPU, "features": arm[0]["features"],
                      "onnxruntime": arm[0]["onnxruntime"],
                      "relative_max_logit_difference": {k: float(f"{v:.3g}") for k, v in measured.items()},
                      "greedy_identical": {k: x86[0].get(f"export_{k}_ids") == arm[0].get(f"export_{k}_ids")
                                           for k in measured},
                      "bounds": {k: float(f"{v:.3g}") for k, v in allowed.items()}, "same": not problems,
                      "wall_s": times}), flush=True)
    for p in problems:
        say(f"differs: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
