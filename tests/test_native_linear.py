"""The native linears (kernels/native.py): the bf16 one (native/bf16_linear.cpp) on both of its paths
(AVX512-BF16 and AMX tiles) and the int8 one (native/int8_linear.cpp, AVX512-VNNI): their values,
their invariance by construction, and how they are chosen.

The kernel runs only on a CPU with AVX512-BF16 (AMX where the CPU has it); elsewhere those tests are
skipped and the engine runs linear.py's other paths, which test_linear.py covers.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tritonllm.kernels import cpu_isa, linear, native
from tritonllm.kernels.quantization import Int8GroupWeight, Int8Weight

KERNEL = native.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"native kernel {native.describe()}")
needs_vnni = pytest.mark.skipif(KERNEL is None or "avx512_vnni" not in cpu_isa.cpu_flags(),
                                reason="no native kernel, or no AVX512-VNNI for the int8 one")
PATHS = ["avx512"] + (["amx"] if "amx_bf16" in cpu_isa.cpu_flags() else [])
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576), (16, 32), (48, 96), (80, 64)]  # (out, in)


def weights(out_features: int, in_features: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).bfloat16()
    return weight, torch.randn(out_features, generator=g).bfloat16()


@needs_kernel
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_kernel_computes_the_linear_within_bf16_rounding(shape, isa):
    weight, bias = weights(*shape)
    x = torch.randn(37, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    got = KERNEL.linear(x, KERNEL.pack(weight), bias, isa == "amx").float()
    exact = x.double() @ weight.double().T + bias.double()
    # the float32 sum is rounded once to bf16 (8 bits): within half a bf16 step of the exact value,
    # plus float32 accumulation error
    assert ((got - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()
    torch.testing.assert_close(got, F.linear(x, weight, bias).float(), rtol=2 ** -7, atol=1e-2)


@needs_kernel
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("shape", SHAPES[:4] + SHAPES[5:], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_rows_bits_do_not_depend_on_the_call(shape, isa):
    """Every row alone, in calls of every size from 2 to 40, and at every place in a call of 40."""
    weight, bias = weights(*shape)
    packed = KERNEL.pack(weight)
    x = torch.randn(40, shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    whole = KERNEL.linear(x, packed, bias, isa == "amx")
    alone = torch.cat([KERNEL.linear(x[i:i + 1], packed, bias, isa == "amx") for i in range(len(x))])
    assert torch.equal(alone, whole)
    for size in range(2, 40):
        parts = torch.cat([KERNEL.linear(x[i:i + size], packed, bias, isa == "amx") for i in range(0, len(x), size)])
        assert torch.equal(parts, whole), f"calls of {size} rows"
    rolled = KERNEL.linear(x.roll(7, 0), packed, bias, isa == "amx")
    assert torch.equal(rolled, whole.roll(7, 0))


@needs_kernel
def test_bad_inputs_are_refused_with_what_is_wrong():
    weight, _ = weights(32, 64)
    packed = KERNEL.pack(weight)
    with pytest.raises(RuntimeError, match="rows have 32 features, the weight 64"):
        KERNEL.linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed, None, False)
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNEL.linear(torch.zeros(2, 64), packed, None, False)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        KERNEL.pack(torch.zeros(24, 64, dtype=torch.bfloat16))
    assert KERNEL.linear(torch.zeros(0, 64, dtype=torch.bfloat16), packed, None, False).shape == (0, 32)


@needs_kernel
def test_prepare_picks_the_kernel_where_it_fits_and_the_switch_turns_it_off(monkeypatch):
    weight, bias = weights(96, 64)
    prepared = linear.prepare(weight, "none", rows_hint=8)
    assert isinstance(prepared, linear.NativeWeight) and prepared.amx == cpu_isa.amx_enabled()
    assert linear.nbytes(prepared) == weight.numel() * 2
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(linear.linear(x, prepared, bias), KERNEL.linear(x, prepared.packed, bias, prepared.amx))
    assert not isinstance(linear.prepare(weights(24, 64)[0], "none", 8), linear.NativeWeight)  # out % 16
    assert not isinstance(linear.prepare(weight.float(), "none", 8), linear.NativeWeight)  # float32: F.linear
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert not isinstance(linear.prepare(weight, "none", 8), linear.NativeWeight)
    assert native.describe().startswith("off")


def q8_0_linear(x: torch.Tensor, weight: Int8GroupWeight, bias: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel computes, in float64: rows quantized a 32 of K (absmax / 127, rounded to
    nearest even), exact integer dot products a group, scaled by both scales."""
    groups = x.float().view(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(groups * inverse).double()
    sums = torch.einsum("mgk,ngk->mng", q, weight.values.double().view(weight.values.shape[0], -1, 32))
    return (sums * (amax / 127).double().squeeze(-1)[:, None, :] * weight.scales.double()).sum(-1) + bias.double()


@needs_vnni
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_int8_kernel_computes_int8_rows_times_int8_weights(shape):
    weight, bias = weights(*shape)
    grouped = Int8GroupWeight.of(weight)
    packed, scales = KERNEL.pack_int8(grouped.values, grouped.scales)
    x = torch.randn(37, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    x[3, :32] = 0  # a group of zeros: scale 0
    got = KERNEL.linear_int8(x, packed, scales, bias).double()
    want = q8_0_linear(x, grouped, bias)
    assert ((got - want).abs() <= want.abs() * 2 ** -8 + 1e-4).all()  # rounded once to bf16
    exact = x.double() @ weight.double().T + bias.double()
    assert (got - exact).norm() / exact.norm() < 0.02  # and int8 stays near the bf16 linear


@needs_vnni
@pytest.mark.parametrize("shape", SHAPES[:4] + SHAPES[5:], ids=lambda s: f"{s[0]}x{s[1]}")
def test_an_int8_rows_bits_do_not_depend_on_the_call(shape):
    weight, bias = weights(*shape)
    grouped = Int8GroupWeight.of(weight)
    packed, scales = KERNEL.pack_int8(grouped.values, grouped.scales)
    x = torch.randn(40, shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    whole = KERNEL.linear_int8(x, packed, scales, bias)
    alone = torch.cat([KERNEL.linear_int8(x[i:i + 1], packed, scales, bias) for i in range(len(x))])
    assert torch.equal(alone, whole)
    for size in (2, 3, 4, 5, 7, 8, 13, 16, 17, 32, 33):
        parts = torch.cat([KERNEL.linear_int8(x[i:i + size], packed, scales, bias) for i in range(0, len(x), size)])
        assert torch.equal(parts, whole), f"calls of {size} rows"
    assert torch.equal(KERNEL.linear_int8(x.roll(7, 0), packed, scales, bias), whole.roll(7, 0))


@needs_vnni
def test_the_int8_kernel_refuses_bad_inputs_with_what_is_wrong():
    grouped = Int8GroupWeight.of(weights(32, 64)[0])
    packed, scales = KERNEL.pack_int8(grouped.values, grouped.scales)
    with pytest.raises(RuntimeError, match="rows have 32 features, the weight 64"):
        KERNEL.linear_int8(torch.zeros(2, 32, dtype=torch.bfloat16), packed, scales, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNEL.linear_int8(torch.zeros(2, 64), packed, scales, None)
    with pytest.raises(RuntimeError, match="scales from pack_int8"):
        KERNEL.linear_int8(torch.zeros(2, 64, dtype=torch.bfloat16), packed, scales[:1], None)
    with pytest.raises(RuntimeError, match="one a 32 of K"):
        KERNEL.pack_int8(grouped.values, grouped.scales[:, :1])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        KERNEL.pack_int8(torch.zeros(24, 64, dtype=torch.int8), torch.zeros(24, 2))
    assert KERNEL.linear_int8(torch.zeros(0, 64, dtype=torch.bfloat16), packed, scales, None).shape == (0, 32)


@needs_vnni
def test_int8_takes_the_native_kernel_where_the_cpu_has_vnni(monkeypatch):
    weight, bias = weights(96, 64)
    prepared = linear.prepare(weight, "int8", rows_hint=8)
    assert isinstance(prepared, linear.NativeInt8Weight)
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(linear.linear(x, prepared, bias), KERNEL.linear_int8(x, prepared.packed, prepared.scales, bias))
    flags = [f for f in cpu_isa.cpu_flags() if f != "avx512_vnni"]
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
    assert isinstance(linear.prepare(weight, "int8", 8), Int8Weight)  # weight-only, torch's kernel
    monkeypatch.undo()
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert isinstance(linear.prepare(weight, "int8", 8), Int8Weight)


def test_the_kernel_follows_the_cpu_and_the_isa_cap(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: ["avx512f", "avx512_bf16", "amx_bf16"])
    for cap, runs in (("", True), ("AVX512_CORE_BF16", True), ("AVX512_CORE_AMX", True), ("AVX512_CORE", False),
                      ("AVX2", False)):
        monkeypatch.setenv(cpu_isa.ISA_ENV, cap)
        assert native.cpu_runs_it() is runs, cap
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: ["avx2", "fma"])
    monkeypatch.delenv(cpu_isa.ISA_ENV)
    assert not native.cpu_runs_it() and native.kernel() is None


def test_a_kernel_not_built_is_said_once_and_the_previous_path_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TRITONLLM_CACHE", str(tmp_path))
    monkeypatch.setenv(native.SWITCH_ENV, "1")
    native._loaded.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=native.__name__):
            assert native._loaded() is None and native._loaded() is None
        assert [r.getMessage() for r in caplog.records if "not built" in r.getMessage()].__len__() == 1
        if native.cpu_runs_it():
            assert native.describe() == "off (not built)"
            assert not isinstance(linear.prepare(weights(96, 64)[0], "none", 8), linear.NativeWeight)
    finally:
        native._loaded.cache_clear()


def test_the_build_names_its_source_and_torch():
    name = native.module_name()
    assert name.startswith("tritonllm_native_") and native.build_dir().name == name
    assert all(source.exists() for source in native.SOURCES)


def test_a_kernel_that_cannot_load_leaves_the_previous_path(monkeypatch, caplog):
    """As in an image whose package lacks the source: said once, never a model that fails to load."""
    monkeypatch.setattr(native, "SOURCES", native.SOURCES + (native.SOURCES[0].with_name("missing.cpp"),))
    native._loaded.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert native._loaded() is None
        assert any("missing.cpp" in r.getMessage() for r in caplog.records)
        assert not isinstance(linear.prepare(weights(96, 64)[0], "none", 8), linear.NativeWeight)
    finally:
        native._loaded.cache_clear()


@pytest.mark.skipif(not native.cpu_runs_it(), reason="no AVX512-BF16: the kernel is not for this CPU")
def test_setup_built_the_kernel_where_the_cpu_runs_it():
    # a build that failed quietly would otherwise only show as the other tests here skipping
    import shutil

    if not shutil.which("c++"):
        pytest.fail("this CPU runs the native kernel but there is no C++ compiler to build it")
    assert native._library().exists(), f"not built: {native._library()}; ./setup.sh builds it"
    assert native._loaded() is not None
