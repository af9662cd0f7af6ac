"""The one switch for the CPU-dependent paths (kernels/cpu_isa.py): oneDNN's ONEDNN_MAX_CPU_ISA.
Lowered, it turns off what the CPU would otherwise choose: AMX row blocks, shared prefill calls,
oneDNN's bf16 weights (below AVX512)."""

from __future__ import annotations

import torch

from tritonllm.kernels import cpu_isa, linear, prefill_attention


def test_a_cap_below_amx_turns_every_amx_path_off(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: ["avx512f", "avx512_bf16", "amx_bf16", "amx_tile"])
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    assert cpu_isa.amx_enabled() and linear.invariant_row_block() == linear.AMX_ROW_BLOCK
    for cap in ("AVX512_CORE_AMX", "avx10_1_512_amx", "ALL", "default"):
        monkeypatch.setenv(cpu_isa.ISA_ENV, cap)
        assert cpu_isa.amx_enabled(), cap
    for cap in ("AVX512_CORE_BF16", "AVX512_CORE", "AVX2"):
        monkeypatch.setenv(cpu_isa.ISA_ENV, cap)
        assert not cpu_isa.amx_enabled(), cap
        assert linear.invariant_row_block() is None
        assert prefill_attention.shared_call_rows(9, 3, 64, torch.bfloat16, "cpu") == prefill_attention.PREFILL_TILE


def test_no_amx_flag_no_amx_path(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: ["avx2", "avx512f", "avx512_bf16"])
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    assert not cpu_isa.amx_enabled()
    assert cpu_isa.describe()["amx_paths"] is False


def test_a_cap_below_avx512_leaves_bf16_to_plain_matmuls(monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_ENV, "AVX2")
    assert not linear.prepack_enabled(torch.bfloat16, torch.device("cpu"))
    weight = torch.randn(16, 8).to(torch.bfloat16)
    assert isinstance(linear.prepare(weight, "none", 8), torch.Tensor)


def test_the_cpu_is_described_for_reports():
    info = cpu_isa.describe()
    assert info["cpu"] and set(info) >= {"amx_bf16", "avx512_bf16", "onednn_max_cpu_isa", "amx_paths"}
    assert info["amx_bf16"] == ("amx_bf16" in cpu_isa.cpu_flags())
