"""State snapshots: resuming is bitwise the same as never having stopped; another model's, a
damaged, a truncated or a missing file is refused with one line; saves are atomic and small."""
import json

import numpy as np
import pytest
from conftest import CHUNK

import hybrid_npu
from hybrid_npu.errors import UserError
from hybrid_npu.runtime import snapshot
from hybrid_npu.format import manifest_hash
from hybrid_npu.runtime.snapshot import FORMAT, load_state
from hybrid_npu.runtime.state import KV_BLOCK


def _prompt(engine, n, seed=0):
    return np.random.default_rng(seed).integers(0, engine.config.vocab_size, n).tolist()


def _greedy(engine, first, steps):
    """Feed `first`, then `steps` greedy tokens; returns every token fed."""
    fed, token = [], first
    for _ in range(steps + 1):
        fed.append(token)
        token = int(np.argmax(engine.decode(token)))
    return fed


def _copy(state):
    return (state.position, list(state.tokens), state.capacity,
            {i: (g.conv.copy(), g.recurrent.copy()) for i, g in state.gdn.items()},
            {i: (a.key.copy(), a.values(a.key.shape[1]).copy()) for i, a in state.attention.items()})  # rows


def _assert_same_state(a, b, same_capacity=True):
    """Bitwise: GDN states, K/V rows in use, position, tokens (and the K/V capacity unless told not)."""
    pos_a, tok_a, cap_a, gdn_a, attn_a = _copy(a) if not isinstance(a, tuple) else a
    pos_b, tok_b, cap_b, gdn_b, attn_b = _copy(b) if not isinstance(b, tuple) else b
    assert (pos_a, tok_a) == (pos_b, tok_b)
    assert cap_a == cap_b if same_capacity else cap_b >= pos_b
    assert gdn_a.keys() == gdn_b.keys() and attn_a.keys() == attn_b.keys()
    for i in gdn_a:
        for x, y in zip(gdn_a[i], gdn_b[i]):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), f"gdn layer {i}"
    for i in attn_a:
        for x, y in zip(attn_a[i], attn_b[i]):
            assert x.shape == y.shape and x[:, :pos_a].tobytes() == y[:, :pos_b].tobytes(), f"attention layer {i}"


def _one_line(err):
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def saved(text_tied, tmp_path_factory):
    """Engine A: prompt of 2C+3 tokens, 5 greedy decode steps, saved right after the last fed token."""
    engine = hybrid_npu.load_engine(text_tied.out)
    logits = engine.prefill(_prompt(engine, 2 * CHUNK + 3))
    for _ in range(5):
        logits = engine.decode(int(np.argmax(logits)))
    path = tmp_path_factory.mktemp("snap") / "chat.state"
    engine.save_state(path)
    return engine, path, int(np.argmax(logits)), _copy(engine.state)


def test_resume_equals_never_stopping(text_tied, saved):
    a, path, next_token, at_save = saved
    b = hybrid_npu.load_engine(text_tied.out)
    b.load_state(path)
    _assert_same_state(at_save, b.state)           # the file holds the state exactly
    assert b.state.position == 2 * CHUNK + 3 + 5

    a_fed = _greedy(a, next_token, 20)             # A never stopped
    b_fed = _greedy(b, next_token, 20)             # B resumed from the file
    assert a_fed == b_fed
    _assert_same_state(a.state, b.state)


def test_resume_past_a_kv_block(text_tied, tmp_path):
    """A context longer than one K/V block: the loader grows the buffers to hold it. The capacity
    may differ from the saving engine's (it depends on growth history); the masked rows past the
    position do not change the result."""
    a = hybrid_npu.load_engine(text_tied.out)
    a.prefill(_prompt(a, KV_BLOCK + 2 * CHUNK + 1, seed=1))
    a.save_state(tmp_path / "long.state")
    b = hybrid_npu.load_engine(text_tied.out)
    b.load_state(tmp_path / "long.state")
    _assert_same_state(a.state, b.state, same_capacity=False)
    assert b.state.capacity > KV_BLOCK
    np.testing.assert_array_equal(a.decode(3), b.decode(3))


def test_empty_state_round_trips(text_tied, tmp_path):
    a = hybrid_npu.load_engine(text_tied.out)
    a.save_state(tmp_path / "empty.state")
    b = hybrid_npu.load_engine(text_tied.out)
    b.prefill([1, 2, 3])
    b.load_state(tmp_path / "empty.state")
    _assert_same_state(a.state, b.state)


def test_another_model_refused(text_tied, saved, tmp_path):
    import fixtures

    from hybrid_npu.export.exporter import export

    fixtures.write_text_checkpoint(tmp_path / "hf2", seed=7)
    export(tmp_path / "hf2", tmp_path / "out2", chunk=CHUNK)
    other = hybrid_npu.load_engine(tmp_path / "out2")
    assert manifest_hash(tmp_path / "out2") != manifest_hash(text_tied.out)
    with pytest.raises(UserError) as err:
        other.load_state(saved[1])
    msg = _one_line(err)
    assert "belongs to another model" in msg and manifest_hash(text_tied.out)[:12] in msg
    assert "load it with the model it was saved from" in msg


def test_missing_file_refused(text_tied, tmp_path):
    engine = hybrid_npu.load_engine(text_tied.out)
    with pytest.raises(UserError) as err:
        engine.load_state(tmp_path / "nope.state")
    assert "no such file" in _one_line(err)


@pytest.mark.parametrize("keep", [0, 5, 100, -16, -1])
def test_truncated_file_refused(text_tied, saved, tmp_path, keep):
    data = saved[1].read_bytes()
    cut = tmp_path / "cut.state"
    cut.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(UserError) as err:
        load_state(cut, hybrid_npu.load_engine(text_tied.out).config, manifest_hash(text_tied.out), KV_BLOCK)
    assert "not a readable safetensors file" in _one_line(err)


def _data_offset(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def test_altered_file_refused(text_tied, saved, tmp_path):
    data = bytearray(saved[1].read_bytes())
    header = json.loads(data[8:_data_offset(data)])
    begin, end = header["gdn.0.recurrent"]["data_offsets"]
    data[_data_offset(data) + (begin + end) // 2] ^= 0x01     # one bit inside a tensor's bytes
    bad = tmp_path / "bad.state"
    bad.write_bytes(bytes(data))
    with pytest.raises(UserError) as err:
        hybrid_npu.load_engine(text_tied.out).load_state(bad)
    assert "altered or damaged: checksum mismatch" in _one_line(err)


def _rewrite(src, dst, edit_tensors=None, edit_meta=None):
    """Re-save a snapshot with edited tensors/metadata (checksum recomputed, so only the edit is wrong)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(src), framework="np") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if edit_tensors:
        edit_tensors(tensors)
    meta["checksum"] = snapshot.checksum(tensors, snapshot.hashed_metadata(meta))
    if edit_meta:
        edit_meta(meta)
    save_file(tensors, str(dst), metadata=meta)


def test_other_format_refused(text_tied, saved, tmp_path):
    _rewrite(saved[1], tmp_path / "f.state", edit_meta=lambda m: m.update(format="hybrid-npu-state/0"))
    with pytest.raises(UserError) as err:
        hybrid_npu.load_engine(text_tied.out).load_state(tmp_path / "f.state")
    msg = _one_line(err)
    assert "hybrid-npu-state/0" in msg and FORMAT in msg


def test_shape_mismatch_names_tensor_and_shapes(text_tied, saved, tmp_path):
    engine = hybrid_npu.load_engine(text_tied.out)
    i = engine.config.linear_layers[0]
    name = f"gdn.{i}.conv"
    want = list(engine.state.gdn[i].conv.shape)

    def widen(t):
        t[name] = np.zeros((want[0], want[1] + 1), np.float32)

    _rewrite(saved[1], tmp_path / "s.state", edit_tensors=widen)
    with pytest.raises(UserError) as err:
        engine.load_state(tmp_path / "s.state")
    msg = _one_line(err)
    assert name in msg and str([want[0], want[1] + 1]) in msg and str(want) in msg

    _rewrite(saved[1], tmp_path / "m.state", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(UserError) as err:
        engine.load_state(tmp_path / "m.state")
    assert f"tensor {name} is missing" in _one_line(err)


def test_save_is_atomic_and_leaves_no_temp_files(text_tied, tmp_path, monkeypatch):
    import safetensors.numpy

    engine = hybrid_npu.load_engine(text_tied.out)
    engine.prefill(_prompt(engine, CHUNK + 2))
    path = tmp_path / "chat.state"
    engine.save_state(path)
    assert [p.name for p in tmp_path.iterdir()] == ["chat.state"]
    before = path.read_bytes()

    engine.decode(5)
    engine.save_state(path)                          # overwrite in place
    assert [p.name for p in tmp_path.iterdir()] == ["chat.state"] and path.read_bytes() != before
    before = path.read_bytes()

    real = safetensors.numpy.save_file

    def interrupted(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(100)                          # half a file, then the process is interrupted
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", interrupted)
    engine.decode(6)
    with pytest.raises(KeyboardInterrupt):
        engine.save_state(path)
    assert [p.name for p in tmp_path.iterdir()] == ["chat.state"]
    assert path.read_bytes() == before               # the previous snapshot is intact


def test_snapshot_is_small(text_tied, saved):
    engine, path, _, at_save = saved
    cfg, position = engine.config, at_save[0]
    analytic = cfg.state_bytes() + position * cfg.kv_bytes_per_token() + 8 * position
    size = path.stat().st_size
    assert analytic < size < analytic + 4096, (size, analytic)
    assert size < cfg.state_bytes() + engine.state.capacity * cfg.kv_bytes_per_token()  # not the whole K/V buffer
