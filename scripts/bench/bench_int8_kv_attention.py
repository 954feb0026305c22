"""A decode step's attention over a long context, every attention layer, in the forms a K/V cache
could take, timed in one process: this project's untiled graph (kernels/attention.emit_gqa_attention
over the fp32 K/V buffers as runtime/step_inputs.py feeds them: the whole capacity, rows past the
context masked), the CPU graphs' tiled form (emit_tiled_gqa_attention) over an fp32, fp16 and int8
cache (a scale per row), and ONNX Runtime's com.microsoft GroupQueryAttention over an fp16 and an
int8 cache (per-channel scales; the new row written in place: past and present bound to one
buffer). Each layer has its own buffers, so the K/V come from memory as in a real step, not from
the cache. Shapes default to Qwen3.5-0.8B's (6 attention layers, 8 query / 2 K/V heads of 256).

Before timing, the int8 arm's output is checked against a numpy reference of the same arithmetic
(keys and values rounded to int8 with their scales, then exact attention): that is what the kernel
computes, so the JSON's `int8_vs_reference` is ~1e-6; `int8_vs_fp32` is what the rounding itself
costs against the fp32 cache. Prints one JSON object.

    python scripts/bench/bench_int8_kv_attention.py [--contexts 2048,8192,32768] [--layers 6] [--rounds 4]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_model, emit  # noqa: E402

from hybrid_npu.kernels.attention import (MASKED, emit_gqa_attention, emit_tiled_gqa_attention,  # noqa: E402
                                          gqa_attention_ref)
from hybrid_npu.runtime.state import quantize_rows  # noqa: E402
from hybrid_npu.kernels.graph import GraphBuilder  # noqa: E402

NH, NKV, HD = 8, 2, 256
SLACK = 256  # capacity beyond the context, as the State's block growth leaves it


def median_ms(run, calls: int = 25) -> float:
    """Median wall time of `run` in ms, after three warm-up calls."""
    for _ in range(3):
        run()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def own_model(n_layers: int):
    """n_layers independent copies of the graph's one-token attention (inputs suffixed by layer)."""
    g = GraphBuilder("attention")
    for i in range(n_layers):
        q = g.input(f"q{i}", np.float32, [1, NH, HD])
        pk, pv = g.input(f"pk{i}", np.float32, [NKV, "T", HD]), g.input(f"pv{i}", np.float32, [NKV, HD, "T"])
        nk, nv = g.input(f"nk{i}", np.float32, [NKV, 1, HD]), g.input(f"nv{i}", np.float32, [NKV, 1, HD])
        mask = g.input(f"m{i}", np.float32, [1, "T1"])
        g.output(emit_gqa_attention(g, q, pk, pv, nk, nv, mask, n=1, nh=NH, nkv=NKV, hd=HD), f"o{i}", np.float32,
                 [1, NH, HD])
    return g.model()


def own_tiled_model(n_layers: int, cache: str):
    """The CPU graphs' form (kernels/attention.emit_tiled_gqa_attention) over a `cache` K/V: fp32,
    fp16, or int8 rows with a scale each (runtime/state.quantize_rows)."""
    dtype = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}[cache]
    g = GraphBuilder("attention_tiled")
    for i in range(n_layers):
        q = g.input(f"q{i}", np.float32, [1, NH, HD])
        pk, pv = g.input(f"pk{i}", dtype, [NKV, "T", HD]), g.input(f"pv{i}", dtype, [NKV, HD, "T"])
        nk, nv = g.input(f"nk{i}", np.float32, [NKV, 1, HD]), g.input(f"nv{i}", np.float32, [NKV, 1, HD])
        mask = g.input(f"m{i}", np.float32, [1, "T1"])
        scales = ((g.input(f"ks{i}", np.float32, [NKV, 1, "T"]), g.input(f"vs{i}", np.float32, [NKV, 1, "T"]))
                  if cache == "int8" else (None, None))
        g.output(emit_tiled_gqa_attention(g, q, pk, pv, nk, nv, mask, n=1, nh=NH, nkv=NKV, hd=HD, widen=cache != "fp32",
                                          k_scale=scales[0], v_scale=scales[1]), f"o{i}", np.float32, [1, NH, HD])
    return g.model()


def gqa_fp16_model(capacity: int):
    """One layer: GroupQueryAttention in fp16 (q, k, v and the past/present [1, nKV, capacity, hd])."""
    h = TensorProto.FLOAT16
    inputs = [helper.make_tensor_value_info("q", h, [1, 1, NH * HD]),
              helper.make_tensor_value_info("k", h, [1, 1, NKV * HD]),
              helper.make_tensor_value_info("v", h, [1, 1, NKV * HD]),
              helper.make_tensor_value_info("past_k", h, [1, NKV, capacity, HD]),
              helper.make_tensor_value_info("past_v", h, [1, NKV, capacity, HD]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_len", TensorProto.INT32, [])]
    node = helper.make_node("GroupQueryAttention", [v.name for v in inputs], ["out", "present_k", "present_v"],
                            domain="com.microsoft", num_heads=NH, kv_num_heads=NKV)
    outputs = [helper.make_tensor_value_info(n, h, None) for n in ("out", "present_k", "present_v")]
    return helper.make_model(helper.make_graph([node], "gqa_fp16", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def gqa_int8_model(capacity: int):
    """One layer: GroupQueryAttention, int8 past/present [1, nKV, capacity, hd], per-channel scales."""
    f, i8 = TensorProto.FLOAT, TensorProto.INT8
    inputs = [helper.make_tensor_value_info("q", f, [1, 1, NH * HD]),
              helper.make_tensor_value_info("k", f, [1, 1, NKV * HD]),
              helper.make_tensor_value_info("v", f, [1, 1, NKV * HD]),
              helper.make_tensor_value_info("past_k", i8, [1, NKV, capacity, HD]),
              helper.make_tensor_value_info("past_v", i8, [1, NKV, capacity, HD]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_len", TensorProto.INT32, []),
              helper.make_tensor_value_info("k_scale", f, [NKV * HD]),
              helper.make_tensor_value_info("v_scale", f, [NKV * HD])]
    # inputs 7-11 (rotary caches, position ids, bias, sink) unused: q and k arrive rotated
    names = [v.name for v in inputs[:7]] + [""] * 5 + ["k_scale", "v_scale"]
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_k", "present_v"], domain="com.microsoft",
                            num_heads=NH, kv_num_heads=NKV, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
                            kv_cache_bit_width=8)
    outputs = [helper.make_tensor_value_info("out", f, None), helper.make_tensor_value_info("present_k", i8, None),
               helper.make_tensor_value_info("present_v", i8, None)]
    graph = helper.make_graph([node], "gqa_int8", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def quantise(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x [..., nKV, T, hd] to int8 with per-(head, channel) scales [nKV, 1, hd]."""
    return np.clip(np.rint(x / scale), -128, 127).astype(np.int8)


def measure(context: int, n_layers: int, rounds: int, threads: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    cap = context + SLACK
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    own = ort.InferenceSession(own_model(n_layers).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    gqa = ort.InferenceSession(gqa_int8_model(cap).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    tiled = {c: ort.InferenceSession(own_tiled_model(n_layers, c).SerializeToString(), opts,
                                     providers=["CPUExecutionProvider"]) for c in ("fp32", "fp16", "int8")}
    gqa16 = ort.InferenceSession(gqa_fp16_model(cap).SerializeToString(), opts, providers=["CPUExecutionProvider"])
    tiled_feed = {c: {} for c in tiled}
    bindings16 = []
    own_feed, bindings, keep, errors = {}, [], [], {"int8_vs_reference": 0.0, "int8_vs_fp32": 0.0}
    mask = np.where(np.arange(cap + 1)[None] < context, 0.0, MASKED).astype(np.float32)
    mask[0, cap] = 0.0  # the new token sees itself
    for i in range(n_layers):
        keys = rng.standard_normal((NKV, cap, HD)).astype(np.float32)
        values = rng.standard_normal((NKV, cap, HD)).astype(np.float32)
        q, nk, nv = (rng.standard_normal(s).astype(np.float32) for s in ((1, NH, HD), (NKV, 1, HD), (NKV, 1, HD)))
        own_feed.update({f"q{i}": q, f"pk{i}": keys, f"pv{i}": np.ascontiguousarray(values.transpose(0, 2, 1)),
                         f"nk{i}": nk, f"nv{i}": nv, f"m{i}": mask})
        values_t = np.ascontiguousarray(values.transpose(0, 2, 1))
        (k8, ks), (v8, vs) = quantize_rows(keys, -1), quantize_rows(values, -1)
        for c, (pk, pv, extra) in {"fp32": (keys, values_t, {}),
                                   "fp16": (keys.astype(np.float16), values_t.astype(np.float16), {}),
                                   "int8": (k8, np.ascontiguousarray(v8.transpose(0, 2, 1)),
                                            {f"ks{i}": ks.transpose(0, 2, 1).copy(), f"vs{i}": vs.transpose(0, 2, 1).copy()})}.items():
            tiled_feed[c].update({f"q{i}": q, f"pk{i}": pk, f"pv{i}": pv, f"nk{i}": nk, f"nv{i}": nv, f"m{i}": mask,
                                  **extra})
        hk, hv = (ort.OrtValue.ortvalue_from_numpy(x.astype(np.float16)[None]) for x in (keys, values))
        b16 = gqa16.io_binding()
        for name, x in (("q", q.reshape(1, 1, -1).astype(np.float16)),
                        ("k", nk.transpose(1, 0, 2).reshape(1, 1, -1).astype(np.float16)),
                        ("v", nv.transpose(1, 0, 2).reshape(1, 1, -1).astype(np.float16)),
                        ("seqlens_k", np.array([context], np.int32)), ("total_len", np.array(context + 1, np.int32))):
            b16.bind_cpu_input(name, np.ascontiguousarray(x))
        b16.bind_ortvalue_input("past_k", hk)
        b16.bind_ortvalue_input("past_v", hv)
        b16.bind_output("out", "cpu")
        b16.bind_ortvalue_output("present_k", hk)
        b16.bind_ortvalue_output("present_v", hv)
        keep.append((hk, hv))
        bindings16.append(b16)
        # scales from the keys and values themselves (a real cache would calibrate them)
        k_scale = (np.abs(keys).max(1, keepdims=True) / 127).astype(np.float32)
        v_scale = (np.abs(values).max(1, keepdims=True) / 127).astype(np.float32)
        qk, qv = quantise(keys, k_scale)[None], quantise(values, v_scale)[None]
        ok, ov = ort.OrtValue.ortvalue_from_numpy(qk), ort.OrtValue.ortvalue_from_numpy(qv)
        b = gqa.io_binding()
        for name, x in (("q", q.reshape(1, 1, -1)), ("k", nk.transpose(1, 0, 2).reshape(1, 1, -1)),
                        ("v", nv.transpose(1, 0, 2).reshape(1, 1, -1)), ("seqlens_k", np.array([context], np.int32)),
                        ("total_len", np.array(context + 1, np.int32)), ("k_scale", k_scale.ravel()),
                        ("v_scale", v_scale.ravel())):
            b.bind_cpu_input(name, np.ascontiguousarray(x))
        b.bind_ortvalue_input("past_k", ok)
        b.bind_ortvalue_input("past_v", ov)
        b.bind_output("out", "cpu")  # first: get_outputs() is in binding order
        b.bind_ortvalue_output("present_k", ok)  # one buffer: ORT writes only the new row
        b.bind_ortvalue_output("present_v", ov)
        keep.append((qk, qv, ok, ov))
        bindings.append(b)
        if i == 0:  # the check: one layer, before any timing call writes its row again
            gqa.run_with_iobinding(b)
            got = b.get_outputs()[0].numpy().reshape(1, NH, HD)
            rows_k = np.concatenate([keys[:, :context], nk], 1)
            rows_v = np.concatenate([values[:, :context], nv], 1)
            exact = gqa_attention_ref(q, rows_k, rows_v, np.zeros((1, context + 1), np.float32))
            deq = gqa_attention_ref(q, quantise(rows_k, k_scale) * k_scale, quantise(rows_v, v_scale) * v_scale,
                                    np.zeros((1, context + 1), np.float32))
            errors = {"int8_vs_reference": float(np.abs(got - deq).max()),
                      "int8_vs_fp32": float(np.abs(got - exact).max()),
                      "new_row_written_in_place": bool(np.array_equal(qk[0, :, context], quantise(nk, k_scale)[:, 0]))}
    arms = {"own_fp32_ms": lambda: own.run(None, own_feed),
            **{f"tiled_{c}_ms": (lambda c=c: tiled[c].run(None, tiled_feed[c])) for c in tiled},
            "gqa_fp16_ms": lambda: [gqa16.run_with_iobinding(b) for b in bindings16],
            "gqa_int8_ms": lambda: [gqa.run_with_iobinding(b) for b in bindings]}
    best = {name: float("inf") for name in arms}
    fp32_out = own.run(None, own_feed)
    for c in tiled:  # the tiled forms compute the same attention (within their cache's rounding)
        errors[f"tiled_{c}_vs_fp32"] = max(float(np.abs(a - b).max()) for a, b in zip(tiled[c].run(None, tiled_feed[c]), fp32_out))
    for r in range(rounds):  # alternated, best median of each
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            best[name] = min(best[name], median_ms(arms[name], 15))
    kv_bytes = {"fp32": n_layers * 2 * NKV * cap * HD * 4, "fp16": n_layers * 2 * NKV * cap * HD * 2,
                "int8": n_layers * 2 * NKV * cap * HD}
    return {"context": context, "capacity": cap, **{k: round(v, 3) for k, v in best.items()},
            "int8_over_fp32": round(best["gqa_int8_ms"] / best["own_fp32_ms"], 3), "kv_bytes": kv_bytes, **errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        if min(contexts) < 1 or args.layers < 1 or args.rounds < 1:
            raise ValueError
    except ValueError:
        print(f"bench_int8_kv_attention: --contexts takes positive integers joined by commas (got {args.contexts!r}), "
              "--layers and --rounds at least 1", file=sys.stderr)
        return 2
    rows = [measure(c, args.layers, args.rounds, args.threads) for c in contexts]
    emit({"machine": {"cpu": cpu_model()}, "onnxruntime": ort.__version__, "threads": args.threads,
                     "layers": args.layers, "heads": {"query": NH, "kv": NKV, "dim": HD}, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
