"""The native bf16 linear (kernels/native.py, native/bf16_linear.cpp): its values, its
invariance by construction on both of its paths (AVX512-BF16 and AMX tiles), and how it is chosen.

The kernel runs only on a CPU with AVX512-BF16 (AMX where the CPU has it); elsewhere those tests are
skipped and the engine runs linear.py's other paths, which test_linear.py covers.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tritonllm.kernels import cpu_isa, linear, native

KERNEL = native.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"native kernel {native.describe()}")
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
