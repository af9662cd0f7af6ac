"""The native kernels against the paths they replace, side by side in one process
(`tritonllm-bench-engine --only linears native`):

- linears: each matmul shape of the model at 1-512 rows, the native kernel against linear.py's
  previous path (oneDNN prepacked, cut into the calls batch invariance needs: decode rows in calls
  of the AMX row block, more than 32 rows as prompt tiles); microseconds, GB/s of weights against
  this machine's `t.sum()` over 1 GiB, and TFLOP/s against the dot-product instruction's peak on
  every thread (`vdpbf16ps`, or AMX's `tdpbf16ps`: the kernel's `peak_flops`, no memory); and the
  same weight in int8, the native int8 kernel (where the CPU has AVX512-VNNI) against torch's;
- native: the runner's decode steps (8 x 32, 32 x 128) and a cold 1,280-token prefill, with the native
  kernels and with them off (TRITONLLM_NATIVE_KERNELS=0), with the layers a piece a call instead of
  one native call (decode_layers.py), and, in that loop, the Numba paged attention or the Numba layer
  ops in place of one native kernel (what each buys), the native runner with batch
  invariance off, and with `quantization: int8` with the kernels on (the native int8 linear) and off
  (torch's weight-only int8), alternating in one process.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

from tritonllm.engine.model_runner import Chunk, ModelRunner
from tritonllm.kernels import linear as linear_module
from tritonllm.kernels import cpu_isa, layer_kernels, native
from tritonllm.kernels.quantization import Int8Weight

ROWS = (1, 8, 32, 128, 512)
TILE = linear_module.TILE_ROWS


@contextlib.contextmanager
def native_kernels(on: bool):
    old = os.environ.get(native.SWITCH_ENV)
    os.environ[native.SWITCH_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[native.SWITCH_ENV]
        else:
            os.environ[native.SWITCH_ENV] = old


def memory_bandwidth() -> float:
    """Bytes/s of `t.sum()` over 1 GiB of float32, the best of 5."""
    t = torch.ones(2 ** 28)
    t.sum()
    best = min(_seconds(t.sum) for _ in range(5))
    return t.numel() * 4 / best


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed(fns: dict, repeats: int, inner: int) -> dict:
    """Median seconds a call of each fn, the fns alternating (a noisy moment touches all alike)."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for rep in range(repeats):
        for name in (list(fns) if rep % 2 else list(fns)[::-1]):
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(t) for name, t in times.items()}


def _previous_calls(rows: int, weight) -> list | None:
    """The calls the runner makes for batch invariance: decode rows up to 32, else prompt tiles."""
    if rows <= 32 or getattr(weight, "row_block", None) is None:
        return None
    tiles = [(first, min(first + TILE, rows)) for first in range(0, rows, TILE)]
    return linear_module.call_ranges(tiles, weight.row_block, weight.tile_rows)


def run_linears(model, rows=ROWS, repeats: int = 7) -> dict:
    if native.kernel() is None:
        return {"error": f"native kernel {native.describe()}"}
    runner_layer = model.model.layers[0]
    attn, mlp = runner_layer.self_attn, runner_layer.mlp
    shapes = {"qkv": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
              "o": attn.o_proj.weight, "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
              "down": mlp.down_proj.weight, "lm_head": model.lm_head.weight}
    bandwidth = memory_bandwidth()
    peak = native.kernel().peak_flops(cpu_isa.amx_enabled(), 0.5)
    out = {"t_sum_gb_per_s": bandwidth / 1e9, "peak_tflop_per_s": peak / 1e12, "path": native.describe(),
           "int8_path": "native" if "avx512_vnni" in cpu_isa.cpu_flags() else "weight-only", "shapes": {}}
    for name, weight in shapes.items():
        weight = weight.detach().to(torch.bfloat16)
        with native_kernels(False):
            previous = linear_module.prepare(weight, "none", 8)
        with native_kernels(True):
            mine = linear_module.prepare(weight, "none", 8)
            int8 = linear_module.prepare(weight, "int8", 8)  # the native int8 kernel where the CPU has VNNI
        int8_previous = Int8Weight.of(weight)  # torch's weight-only int8
        nbytes = weight.numel() * 2
        for m in rows:
            x = torch.randn(m, weight.shape[1]).bfloat16()
            calls = _previous_calls(m, previous)
            inner = max(1, int(2e-3 / max(nbytes / 20e9, 2 * m * weight.numel() / 5e11)))
            t = _timed({"previous": lambda: linear_module.linear(x, previous, calls=calls),
                        "native": lambda: linear_module.linear(x, mine),
                        "int8": lambda: linear_module.linear(x, int8),
                        "int8_previous": lambda: linear_module.linear(x, int8_previous)}, repeats, inner)
            out["shapes"][f"{name} {tuple(weight.shape)} x {m}"] = {
                "previous_us": t["previous"] * 1e6, "native_us": t["native"] * 1e6,
                "int8_us": t["int8"] * 1e6, "int8_previous_us": t["int8_previous"] * 1e6,
                "native_over_previous": t["native"] / t["previous"],
                "native_gb_per_s": nbytes / t["native"] / 1e9, "previous_gb_per_s": nbytes / t["previous"] / 1e9,
                "native_tflop_per_s": 2 * m * weight.numel() / t["native"] / 1e12,
                "previous_tflop_per_s": 2 * m * weight.numel() / t["previous"] / 1e12}
    return out


def print_linears(r: dict) -> None:
    print(f"linears, bf16 ({r['path']}; t.sum() over 1 GiB: {r['t_sum_gb_per_s']:.1f} GB/s; "
          f"peak {r['peak_tflop_per_s']:.3f} TFLOP/s):")
    print(f"  {'shape x rows':28s} {'previous us':>11s} {'native us':>10s} {'ratio':>6s}  native GB/s (of t.sum)  "
          f"TFLOP/s native (of peak) / previous  int8 us ({r['int8_path']} / torch's weight-only)")
    for name, c in r["shapes"].items():
        print(f"  {name:28s} {c['previous_us']:11.1f} {c['native_us']:10.1f} {c['native_over_previous']:6.2f}  "
              f"{c['native_gb_per_s']:7.1f} ({c['native_gb_per_s'] / r['t_sum_gb_per_s']:4.2f})  "
              f"{c['native_tflop_per_s']:6.3f} ({c['native_tflop_per_s'] / r['peak_tflop_per_s']:4.2f}) / "
              f"{c['previous_tflop_per_s']:6.3f}  {c['int8_us']:9.1f} / {c['int8_previous_us']:9.1f}", flush=True)


DECODE = {"8 x 32": [32] * 8, "32 x 128": [128] * 32, "32 x 600": [600] * 32}
PREFILL = [(0, 512), (512, 512), (1024, 256)]  # a cold 1,280-token prompt in chunks of 512


def run_native_vs_previous(model, repeats: int = 9) -> dict:
    if native.kernel() is None:
        return {"error": f"native kernel {native.describe()}"}
    if model.dtype != torch.bfloat16:
        return {"error": f"the model runs {model.dtype}; the native kernel is for bfloat16 (--dtype bfloat16)"}
    runners = {}
    for name, on, invariant, quantization in (
            ("native", True, True, None), ("previous", False, True, None), ("native, invariance off", True, False, None),
            ("int8", True, True, "int8"), ("int8, previous", False, True, "int8")):  # int8: native int8 kernel or torch's
        with native_kernels(on):
            runners[name] = ModelRunner(model, 32, 2048, quantization, batch_invariant=invariant)
    with native_kernels(True):
        runners["layer loop"] = ModelRunner(model, 32, 2048)  # what one native call for a decode step's layers buys
        runners["Numba attention"] = ModelRunner(model, 32, 2048)  # what the native attention buys (in the loop)
        runners["Numba attention"].native_attention = False
        runners["Numba layer ops"] = ModelRunner(model, 32, 2048)  # what native/layer_ops.cpp buys (in the loop)
        runners["Numba layer ops"].layer_ops = layer_kernels
        for name in ("layer loop", "Numba attention", "Numba layer ops"):
            runners[name].decode_layers = None
        layer_kernels.warm_up()
    ids = [(100 + i) % model.config.vocab_size for i in range(1280)]

    def prefill(runner):
        blocks = runner.slot_blocks(0)
        for start, n in PREFILL:
            runner.forward([Chunk(blocks, ids[start:start + n], start, True)])

    cases = {}
    for case, lengths in DECODE.items():
        t = _timed({name: (lambda r=r: r.decode_ceiling_step(lengths)) for name, r in runners.items()}, repeats, 3)
        cases[f"decode {case}"] = t
    cases["prefill cold 1280"] = _timed({name: (lambda r=r: prefill(r)) for name, r in runners.items()
                                         if name in ("native", "previous", "int8", "int8, previous")},
                                        max(3, repeats // 2), 1)
    weight_bytes = runners["native"].weight_bytes
    return {"path": native.describe(), "weight_bytes": weight_bytes, "t_sum_gb_per_s": memory_bandwidth() / 1e9,
            "cases": cases}


def print_native_vs_previous(r: dict) -> None:
    print(f"runner steps, native kernels ({r['path']}) against them off, alternating:")
    for case, t in r["cases"].items():
        extra = "".join(f"  | {name} {s * 1e3:.1f} ms ({s / t['native']:.2f}x native)" for name, s in t.items()
                        if name not in ("native", "previous"))
        gbs = (f", weights {r['weight_bytes'] / t['native'] / 1e9:.1f} GB/s = "
               f"{r['weight_bytes'] / t['native'] / 1e9 / r['t_sum_gb_per_s']:.2f} of t.sum()") if case.startswith("decode") else ""
        print(f"  {case:18s} native {t['native'] * 1e3:7.1f} ms, previous {t['previous'] * 1e3:7.1f} ms: "
              f"{t['native'] / t['previous']:.2f} of the time{gbs}{extra}", flush=True)
