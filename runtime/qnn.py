"""The Snapdragon NPU through ONNX Runtime's QNN execution provider, registered the plugin way
(register_execution_provider_library → get_ep_devices → add_provider_for_devices).

Every NPU session disables CPU fallback: a graph that does not place entirely on the HTP fails to
load instead of silently running half on the CPU. Without onnxruntime-qnn (Linux aarch64 has no
wheel) or without a QNN device, `qnn_devices()` says why and the caller runs on the CPU.
"""
from __future__ import annotations

import contextlib
import os
import sys
from functools import lru_cache

import onnxruntime as ort

from .session_options import session_options

EP_NAME = "QNNExecutionProvider"


class NpuUnavailable(Exception):
    """No usable QNN HTP here; the message says why and what fixes it."""


@lru_cache(maxsize=1)
def qnn_devices() -> tuple:
    try:
        import onnxruntime_qnn
    except ImportError:
        raise NpuUnavailable("onnxruntime-qnn is not installed (pip install 'hybrid-npu[qnn]'; "
                             "there is no Linux aarch64 wheel)") from None
    try:
        if not any(d.ep_name == EP_NAME for d in ort.get_ep_devices()):
            ort.register_execution_provider_library(EP_NAME, onnxruntime_qnn.get_library_path())
        devices = tuple(d for d in ort.get_ep_devices() if d.ep_name == EP_NAME)
    except Exception as e:  # an EP library that fails to load is "no NPU", not a crash
        raise NpuUnavailable(f"the QNN execution provider failed to load ({str(e).splitlines()[0]})") from None
    if not devices:
        raise NpuUnavailable("the QNN execution provider reports no device")
    return devices


def qnn_session_options(provider_options: dict[str, str], free_dims: dict[str, int] | None = None,
                        config: dict[str, str] | None = None) -> ort.SessionOptions:
    so = session_options()
    so.add_provider_for_devices(list(qnn_devices()), dict(provider_options))
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    for name, value in (free_dims or {}).items():  # the HTP compiles static shapes only
        so.add_free_dimension_override_by_name(name, int(value))
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    return so


def qnn_version() -> str | None:
    """The onnxruntime-qnn release (it pins the QNN SDK a context binary was compiled with)."""
    try:
        from importlib.metadata import version

        return version("onnxruntime-qnn")
    except Exception:
        return None


@contextlib.contextmanager
def native_stdout_silenced():
    """The x86_64 HTP emulator's native library prints a '# LIBNATIVE: ...' banner to file
    descriptor 1 when its first session opens, which would land in a reply or in --json output.
    While NPU sessions open, descriptor 1 points at the null device (QNN's own errors reach us as
    exceptions and through ONNX Runtime's log on stderr, so nothing of use is lost)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no descriptor 1 to guard (e.g. a GUI process)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def qnn_session(model_path: str, options: ort.SessionOptions) -> ort.InferenceSession:
    """An NPU session (its options from qnn_session_options), opened without the emulator's banner."""
    with native_stdout_silenced():
        return ort.InferenceSession(model_path, options)
