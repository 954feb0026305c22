"""Device profiles: the shipped TOML files, their validation errors, user profiles and writing."""
import copy
import dataclasses
import sys
from pathlib import Path

import pytest

from hybrid_npu.errors import UserError
from hybrid_npu.profiles import Profile, load_profile
from hybrid_npu.profiles import loader
from hybrid_npu.profiles.loader import dumps, user_profile_dir, write_user_profile

BUILTINS = ["cpu", "snapdragon-8-elite", "snapdragon-8-gen-3", "snapdragon-x-elite", "snapdragon-x-plus"]


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch):
    """Every test gets its own empty user profile folder: the real ~/.config never leaks in."""
    d = tmp_path / "user-profiles"
    monkeypatch.setenv("HYBRID_NPU_PROFILE_DIR", str(d))
    return d


def x_elite_data() -> dict:
    return load_profile("snapdragon-x-elite").to_dict()


def write(folder: Path, data: dict, stem: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem or data['name']}.toml"
    path.write_text(dumps(data))
    return path


def load_error(path) -> str:
    with pytest.raises(UserError) as e:
        load_profile(path)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------ built-ins
@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_loads_and_round_trips(name, tmp_path):
    p = load_profile(name)
    assert isinstance(p, Profile)
    assert p.name == name and p.description
    assert p.source == loader.BUILTIN_DIR / f"{name}.toml"
    assert p.attention_capacity >= p.prefill_chunk
    assert p.verify_device in ("cpu", "npu")
    # to_dict is the file's own layout: written back it loads equal (source aside)
    assert load_profile(write(tmp_path / "copy", p.to_dict())) == p


def _qnn_runs(provider_options: dict, tmp_path) -> bool:
    """Does QNN's own HTP backend (the emulator) set up a device from these options and run a graph
    on it with CPU fallback disabled? QNN refuses a soc_model it does not know."""
    import numpy as np
    import onnx
    from onnx import helper

    from hybrid_npu.runtime.qnn import qnn_session, qnn_session_options
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "add",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])])
    path = tmp_path / "add.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    try:
        session = qnn_session(str(path), qnn_session_options(provider_options))
    except Exception:
        return False
    return bool(np.allclose(session.run(None, {"x": np.ones((2, 3), np.float32)})[0], 2, atol=1e-3))


@pytest.mark.parametrize("name", [n for n in BUILTINS if n != "cpu"])
def test_builtin_chips_are_devices_qnn_knows(name, tmp_path):
    """The reference is QNN itself: each shipped profile's soc_model/htp_arch set up an HTP device
    (and a made-up soc_model does not, so the check can fail)."""
    pytest.importorskip("onnxruntime_qnn", reason="needs the qnn extra")
    p = load_profile(name)
    assert p.has_npu and p.npu.backend == "htp" and p.npu_prefill_min_tokens > 0
    options = p.qnn_provider_options()
    assert _qnn_runs(options, tmp_path)
    assert not _qnn_runs({**options, "soc_model": "12345"}, tmp_path)


def test_cpu_has_no_npu():
    p = load_profile("cpu")
    assert p.npu is None and not p.has_npu
    assert p.verify_device == "cpu"
    assert p.npu_prefill_min_tokens == 0
    d = p.to_dict()
    assert "npu" not in d and "npu_prefill_min_tokens" not in d["dispatch"]
    with pytest.raises(UserError, match="no \\[npu\\] table"):
        p.qnn_provider_options()


def test_qnn_provider_options_x_elite():
    assert load_profile("snapdragon-x-elite").qnn_provider_options() == {
        "backend_type": "htp",
        "soc_model": "60",
        "htp_arch": "73",
        "enable_htp_fp16_precision": "1",
        "htp_performance_mode": "burst",
        "htp_graph_finalization_optimization_mode": "3",
        "vtcm_mb": "8",
    }


def test_qnn_provider_options_quantized_and_default_vtcm(tmp_path):
    data = x_elite_data()
    data["npu"].update(precision="quantized", vtcm_mb=0, performance_mode="sustained_high_performance")
    opts = load_profile(write(tmp_path, data)).qnn_provider_options()
    assert opts["enable_htp_fp16_precision"] == "0"
    assert opts["htp_performance_mode"] == "sustained_high_performance"
    assert "vtcm_mb" not in opts
    assert all(isinstance(v, str) for v in opts.values())


def test_load_by_path_str_and_path(tmp_path):
    path = write(tmp_path, x_elite_data())
    assert load_profile(str(path)) == load_profile(path) == load_profile("snapdragon-x-elite")
    assert load_profile(path).source == path


# ------------------------------------------------------------------ validation errors
def _set(table, key, value):
    def edit(d):
        (d if table == "" else d[table])[key] = value
    return edit


def _drop(table, key):
    def edit(d):
        del (d if table == "" else d[table])[key]
    return edit


def _cpu_like(d):
    del d["npu"]
    del d["dispatch"]["npu_prefill_min_tokens"]


def _compose(*edits):
    def edit(d):
        for e in edits:
            e(d)
    return edit


BAD = [
    # id, edit, substrings the one-line message must contain
    ("unknown-npu-key", _set("npu", "foo", 1), ["unknown key 'foo' in [npu]", "known keys: backend"]),
    ("unknown-top-key", _set("", "colour", "red"), ["unknown key 'colour' in the top level", "shapes"]),
    ("unknown-shapes-key", _set("shapes", "chunk", 64), ["unknown key 'chunk' in [shapes]", "prefill_chunk"]),
    ("missing-soc", _drop("npu", "soc_model"), ["missing key 'soc_model' in [npu]", "soc_model = 60"]),
    ("missing-name", _drop("", "name"), ["missing key 'name' in the top level"]),
    ("missing-verify", _drop("dispatch", "verify_device"), ["missing key 'verify_device' in [dispatch]"]),
    ("missing-threshold", _drop("dispatch", "npu_prefill_min_tokens"),
     ["missing key 'npu_prefill_min_tokens' in [dispatch]"]),
    ("missing-table", _drop("", "shapes"), ["missing table [shapes]", "prefill_chunk"]),
    ("bool-not-int", _set("npu", "soc_model", True), ["[npu] soc_model must be an integer", "boolean"]),
    ("float-not-int", _set("shapes", "prefill_chunk", 128.0), ["[shapes] prefill_chunk must be an integer", "float"]),
    ("str-not-int", _set("memory", "budget_bytes", "8GB"), ["[memory] budget_bytes must be an integer", "string"]),
    ("int-not-str", _set("", "name", 3), ["name must be a string", "integer"]),
    ("table-not-scalar", _set("", "npu", 3), ["npu must be a table", "[npu]"]),
    ("chunk-low", _set("shapes", "prefill_chunk", 1), ["[shapes] prefill_chunk = 1 is out of range", "2..4096"]),
    ("chunk-high", _set("shapes", "prefill_chunk", 5000), ["prefill_chunk = 5000 is out of range", "2..4096"]),
    ("tree-high", _set("shapes", "verify_tree_size", 513), ["verify_tree_size = 513 is out of range", "2..512"]),
    ("finalization", _set("npu", "graph_finalization", 4), ["[npu] graph_finalization = 4 is out of range", "0..3"]),
    ("vtcm-negative", _set("npu", "vtcm_mb", -1), ["[npu] vtcm_mb = -1 is out of range"]),
    ("part-zero", _set("shapes", "part_weight_bytes", 0), ["[shapes] part_weight_bytes = 0 is out of range"]),
    ("budget-negative", _set("memory", "budget_bytes", -1), ["[memory] budget_bytes = -1 is out of range"]),
    ("threshold-zero", _set("dispatch", "npu_prefill_min_tokens", 0), ["npu_prefill_min_tokens = 0 is out of range"]),
    ("capacity-below-chunk", _set("shapes", "attention_capacity", 64),
     ["attention_capacity = 64 is below prefill_chunk = 128", "at least 128"]),
    ("perf-mode", _set("npu", "performance_mode", "turbo"),
     ["[npu] performance_mode = 'turbo' is not allowed", "burst", "sustained_high_performance", "power_saver"]),
    ("htp-arch", _set("npu", "htp_arch", 74), ["[npu] htp_arch = 74 is not allowed", "73, 75, 79"]),
    ("precision", _set("npu", "precision", "int8"), ["precision = 'int8' is not allowed", "fp16, quantized"]),
    ("backend", _set("npu", "backend", "gpu"), ["backend = 'gpu' is not allowed", "htp"]),
    ("verify-device", _set("dispatch", "verify_device", "gpu"), ["verify_device = 'gpu' is not allowed", "cpu, npu"]),
    ("soc-arch-mismatch", _set("npu", "htp_arch", 75), ["soc_model = 60 is a v73 chip but htp_arch = 75",
                                                        "htp_arch = 73"]),
    ("threshold-without-npu", _compose(_cpu_like, _set("dispatch", "npu_prefill_min_tokens", 4096)),
     ["[dispatch] npu_prefill_min_tokens needs an [npu] table"]),
    ("npu-verify-without-npu", _compose(_cpu_like, _set("dispatch", "verify_device", "npu")),
     ["verify_device = 'npu' needs an [npu] table", 'verify_device = "cpu"']),
]


@pytest.mark.parametrize("edit, expect", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation_error(tmp_path, edit, expect):
    data = copy.deepcopy(x_elite_data())
    edit(data)
    path = write(tmp_path, data, stem="snapdragon-x-elite")
    msg = load_error(path)
    assert msg.startswith(f"profile {path}:"), msg
    for s in expect:
        assert s in msg, msg


def test_profile_without_npu_is_valid(tmp_path):
    data = x_elite_data()
    _cpu_like(data)
    p = load_profile(write(tmp_path, data))
    assert not p.has_npu and p.npu_prefill_min_tokens == 0


def test_name_must_match_file_stem(tmp_path):
    path = write(tmp_path, x_elite_data(), stem="my-laptop")
    msg = load_error(path)
    assert str(path) in msg
    assert "name = 'snapdragon-x-elite' does not match the file name 'my-laptop.toml'" in msg
    assert 'name = "my-laptop"' in msg


def test_invalid_toml(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('name = "broken"\n[npu\nsoc_model = 60\n')
    msg = load_error(path)
    assert msg.startswith(f"profile {path}: invalid TOML:"), msg
    assert "line 2" in msg


def test_file_not_found(tmp_path):
    path = tmp_path / "nowhere.toml"
    msg = load_error(path)
    assert f"profile file not found: {path}" in msg
    assert "snapdragon-x-elite" in msg


def test_unknown_name_lists_builtin_and_user_profiles(user_dir):
    data = x_elite_data()
    data["name"] = "my-laptop"
    write(user_dir, data)
    msg = load_error("snapdragon-x-ultra")
    assert "unknown profile 'snapdragon-x-ultra'" in msg
    for name in BUILTINS + ["my-laptop"]:
        assert name in msg
    assert str(user_dir) in msg


# ------------------------------------------------------------------ user profiles
def test_user_profile_shadows_builtin(user_dir):
    data = x_elite_data()
    data["dispatch"]["npu_prefill_min_tokens"] = 3000
    path = write(user_dir, data)
    p = load_profile("snapdragon-x-elite")
    assert p.source == path
    assert p.npu_prefill_min_tokens == 3000
    assert load_profile("snapdragon-x-plus").source.parent == loader.BUILTIN_DIR


def test_user_profile_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRID_NPU_PROFILE_DIR", str(tmp_path / "x"))
    assert user_profile_dir() == tmp_path / "x"


def test_user_profile_dir_platform_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("HYBRID_NPU_PROFILE_DIR")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    assert user_profile_dir() == tmp_path / ".config" / "hybrid-npu" / "profiles"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert user_profile_dir() == tmp_path / "xdg" / "hybrid-npu" / "profiles"
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("APPDATA", str(tmp_path / "Roaming"))
    assert user_profile_dir() == tmp_path / "Roaming" / "hybrid-npu" / "profiles"


def test_write_user_profile_round_trips(user_dir):
    base = load_profile("snapdragon-x-elite")
    path = write_user_profile(base, npu_prefill_min_tokens=3000, verify_device="npu")
    assert path == user_dir / "snapdragon-x-elite.toml"
    back = load_profile("snapdragon-x-elite")  # the user copy now shadows the built-in
    assert back.source == path
    assert back == dataclasses.replace(base, npu_prefill_min_tokens=3000, verify_device="npu")
    assert back != base


def test_write_user_profile_new_name_and_npu_fields(user_dir):
    base = load_profile("snapdragon-8-elite")
    desc = 'measured "on my phone"\\ — 8 Elite\tnight run'
    path = write_user_profile(base, name="my-phone", description=desc,
                              performance_mode="sustained_high_performance", vtcm_mb=8)
    back = load_profile("my-phone")
    assert back.source == path
    assert back.description == desc
    assert back.npu == dataclasses.replace(base.npu, performance_mode="sustained_high_performance", vtcm_mb=8)
    assert load_profile(path) == back


def test_write_user_profile_cpu(user_dir):
    base = load_profile("cpu")
    write_user_profile(base, name="cpu-small", prefill_chunk=64, memory_budget_bytes=4 << 30)
    back = load_profile("cpu-small")
    assert back == dataclasses.replace(base, name="cpu-small", prefill_chunk=64, memory_budget_bytes=4 << 30)
    assert "npu_prefill_min_tokens" not in back.source.read_text()


def test_write_user_profile_refuses_bad_values(user_dir):
    base = load_profile("snapdragon-x-elite")
    with pytest.raises(UserError, match="npu_prefill_min_tokens = -5 is out of range"):
        write_user_profile(base, npu_prefill_min_tokens=-5)
    with pytest.raises(UserError, match="must be an integer, got boolean"):
        write_user_profile(base, prefill_chunk=True)
    with pytest.raises(UserError, match="no \\[npu\\] table"):
        write_user_profile(load_profile("cpu"), performance_mode="burst")
    with pytest.raises(UserError, match="needs an \\[npu\\] table"):
        write_user_profile(load_profile("cpu"), npu_prefill_min_tokens=4096)
    with pytest.raises(UserError, match="cannot be a file name"):
        write_user_profile(base, name="../escape")
    with pytest.raises(TypeError, match="unknown override"):
        write_user_profile(base, threshold=5)
    assert not user_dir.exists() or not any(user_dir.iterdir())


def test_write_user_profile_can_drop_the_npu(user_dir):
    base = load_profile("snapdragon-x-elite")
    write_user_profile(base, name="no-npu", npu=None, npu_prefill_min_tokens=0)
    back = load_profile("no-npu")
    assert not back.has_npu and back.npu_prefill_min_tokens == 0



# ------------------------------------------------------------------ measured verify costs
MEASURED = ((4, "cpu", 900, 4000), (16, "cpu", 3000, 4000), (64, "npu", 11000, 4000))


def test_measured_verify_costs_round_trip_and_choose_per_size(user_dir):
    path = write_user_profile(load_profile("snapdragon-x-elite"), verify_by_size=MEASURED)
    text = path.read_text()
    assert "[verify]" in text and "sizes = [4, 16, 64]" in text
    back = load_profile("snapdragon-x-elite")
    assert back.verify_by_size == MEASURED and back.verifies_on_npu
    # the smallest measured size that holds the tree; the largest past them all
    assert [back.verify_device_for(m) for m in (2, 4, 5, 16, 17, 64, 200)] == \
        ["cpu", "cpu", "cpu", "cpu", "npu", "npu", "npu"]


def test_missing_measured_costs_leave_the_seed_device_in_charge(capsys):
    prof = load_profile("snapdragon-x-elite")
    assert prof.verify_by_size == () and not prof.verifies_on_npu
    assert prof.verify_device_for(64) == prof.verify_device == "cpu"
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("table, why", [
    ({"sizes": [4, 16], "devices": ["cpu"], "cpu_us": [1, 2], "npu_us": [0, 0]}, "equal"),
    ({"sizes": [4], "devices": ["gpu"], "cpu_us": [1], "npu_us": [1]}, "device"),
    ({"sizes": [4], "devices": ["npu"], "cpu_us": [1], "npu_us": [0]}, "no measured cost"),
    ({"sizes": [4], "devices": ["cpu"], "cpu_us": [-5], "npu_us": [0]}, "0..1000000000"),
    ({"sizes": [4], "devices": ["cpu"], "cpu_us": ["fast"], "npu_us": [0]}, "integers"),
    ({"sizes": [16, 4], "devices": ["cpu", "cpu"], "cpu_us": [1, 2], "npu_us": [0, 0]}, "rise"),
    ({"sizes": [4], "devices": ["cpu"], "cpu_us": [1]}, "keys"),
    ("npu", "not a table"),
])
def test_damaged_measured_costs_fall_back_in_one_line(tmp_path, capsys, table, why):
    data = x_elite_data()
    data["verify"] = table
    path = tmp_path / "snapdragon-x-elite.toml"
    # a top-level scalar is written before the tables, so it stays at the top level
    path.write_text(dumps(data))
    prof = load_profile(path)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and why in err and "npu-bench calibrate" in err, err
    assert prof.verify_by_size == () and prof.verify_device_for(64) == "cpu"


def test_measured_npu_choice_needs_an_npu(tmp_path, capsys):
    data = load_profile("cpu").to_dict()
    data["verify"] = {"sizes": [4], "devices": ["npu"], "cpu_us": [1], "npu_us": [1]}
    path = tmp_path / "cpu.toml"
    path.write_text(dumps(data))
    assert load_profile(path).verify_by_size == ()
    assert "no measured cost" in capsys.readouterr().err
