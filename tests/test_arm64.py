"""scripts/check_arm64.py: the runtime on ARM64 (a Debian arm64 root under qemu-user-static) gives
what it gives on x86_64. The comparison itself is held against results made different by hand;
the check runs when HYBRID_NPU_ARM64=1 (.ci/run sets it) and says in one line why when it cannot."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import check_arm64  # noqa: E402
from check_arm64 import TOLERANCES, compare  # noqa: E402


def result(seed=0):
    """Two sides' results as the probe writes them: ids, texts and logits for every export."""
    rng = np.random.default_rng(seed)
    fields = {"template_text": ["<|im_start|>user\nSay 你好<|im_end|>\n"], "template_ids": [[1, 2, 3]],
              "embedded_plain": [5, 6, 7], "embedded_speculative": [5, 6, 7], "resumed_position": 40,
              "resumed": [9, 8, 7]}
    logits = {name: rng.standard_normal((3, 20)).astype(np.float32) for name in TOLERANCES}
    fields.update({f"export_{name}_ids": [int(i) for i in np.argmax(x, axis=1)] for name, x in logits.items()})
    return fields, logits


def with_logit(side, name, row, col, value):
    fields, logits = side
    logits = {k: v.copy() for k, v in logits.items()}
    logits[name][row, col] = value
    return fields, logits


def test_identical_sides_agree_with_zero_difference():
    problems, measured = compare(result(), result())
    assert problems == [] and measured == {name: 0.0 for name in TOLERANCES}


@pytest.mark.parametrize("key", check_arm64.EXACT_KEYS)
def test_any_exact_field_differing_is_refused(key):
    x86 = result()
    arm_fields = dict(x86[0])
    arm_fields[key] = arm_fields[key] + 1 if isinstance(arm_fields[key], int) else list(arm_fields[key])[:-1]
    problems, _ = compare(x86, (arm_fields, x86[1]))
    assert len(problems) == 1 and problems[0].startswith(f"{key}:")


def test_a_different_greedy_id_of_an_export_is_refused():
    x86 = result()
    fields = dict(x86[0], export_int4_ids=x86[0]["export_int4_ids"][:-1] + [x86[0]["export_int4_ids"][-1] + 1])
    problems, _ = compare(x86, (fields, x86[1]))
    assert problems == [f"export int4 greedy ids: x86_64 {check_arm64.short(x86[0]['export_int4_ids'])} "
                        f"!= arm64 {check_arm64.short(fields['export_int4_ids'])}"]


@pytest.mark.parametrize("name", sorted(TOLERANCES))
def test_logits_beyond_the_tolerance_are_refused_and_within_it_pass(name):
    x86 = result()
    x = x86[1][name]
    peak = float(np.max(np.abs(x)))
    # moved at a position that is not its row's maximum, so only the logits differ (not the greedy ids)
    row, col = 1, int(np.argmin(x[1]))
    for factor, refused in ((3.0, True), (0.5, False)):
        moved = with_logit(x86, name, row, col, x[row, col] - factor * TOLERANCES[name] * peak)
        problems, measured = compare(x86, moved)
        assert measured[name] == pytest.approx(factor * TOLERANCES[name], rel=0.05)  # fp32 storage rounds the move
        assert bool(problems) is refused, problems
        if refused:
            assert problems[0].startswith(f"export {name} logits: relative max difference")


def test_nan_logits_are_refused():
    x86 = result()
    problems, _ = compare(x86, with_logit(x86, "fp32", 0, 0, np.nan))
    assert any(p.startswith("export fp32 logits") for p in problems)


def test_an_export_one_side_lacks_is_refused():
    x86 = result()
    fields, logits = x86
    problems, _ = compare(x86, (fields, {k: v for k, v in logits.items() if k != "int8"}))
    assert problems == ["export int8: only one side ran it"]


def test_without_root_it_says_why_in_one_line(monkeypatch):
    monkeypatch.setattr(check_arm64.os, "geteuid", lambda: 1000, raising=False)
    monkeypatch.setattr(check_arm64.sys, "platform", "linux")
    monkeypatch.setattr(check_arm64.platform, "machine", lambda: "x86_64")
    with pytest.raises(check_arm64.Unavailable) as e:
        check_arm64.host_ready()
    assert "\n" not in str(e.value) and "root" in str(e.value)


def test_arm64_gives_what_x86_64_gives():
    """The whole check (a cold cache builds the root: minutes; docs/arm64.md has the times)."""
    if os.environ.get("HYBRID_NPU_ARM64") != "1":
        pytest.skip("ARM64 check off: set HYBRID_NPU_ARM64=1 to run it (needs root; .ci/run sets it)")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "check_arm64.py")], capture_output=True, text=True,
                          timeout=40 * 60)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == check_arm64.SKIP_EXIT:
        pytest.skip(lines[-1])
    assert proc.returncode == 0, "\n".join(lines[-15:]) + proc.stderr[-3000:]
