"""The engine benchmark command runs end to end (tiny model, few requests); figures live in docs/."""

from __future__ import annotations

import json

from tritonllm.bench import engine as benchmark


def test_benchmark_runs_every_way_of_batching_on_the_same_requests(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert benchmark.main(["--model", "tiny", "--requests", "10", "--output-tokens", "exp:8:24",
                           "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"decode", "prefill", "ceiling", "engine", "request", "hf-cb", "static"}
    decode = results["decode"]
    assert set(decode["cases"]) >= {"8 x 128", "32 x 128", "8 x 32", "7 x 32 + 1 x 1600"}
    assert all(c["weights_gb_per_s"] > 0 and c["tokens_per_s"] > 0 for c in decode["cases"].values())
    assert decode["mixed_over_short"] > 0
    assert decode["paged_decode"]  # CPU: the paged decode kernel
    if decode["cpu_kernels"]:  # bf16 (auto where the CPU has it): each case also timed with PyTorch's ops
        assert all(c["torch_ops_seconds"] > 0 and c["torch_ops_over_kernels"] > 0 for c in decode["cases"].values())
    prefill = results["prefill"]["cases"]
    assert set(prefill) == {"cold 256", "cold 1280", "256 after 1024 cached"}
    assert prefill["cold 1280"]["tokens"] == 1280 and all(c["tokens_per_s"] > 0 for c in prefill.values())
    requested = sum(n for _, n in benchmark.make_workload(10, "exp:8:24", "uniform:8:48", 0))
    for name in ("engine", "request", "hf-cb", "static"):
        assert "error" not in results[name], results[name]
        assert results[name]["tokens"] == requested and results[name]["tokens_per_s"] > 0
    assert results["engine"]["slot_utilisation_while_waiting"] == 1.0
    printed = capsys.readouterr().out
    assert "engine / hf-cb" in printed and "engine / static" in printed
    assert "GB/s of weights" in printed and "between the matmuls" in printed and "7 x 32 + 1 x 1600 / 8 x 32 =" in printed
    assert "prefill of a lone prompt" in printed and "256 after 1024 cached" in printed


def test_benchmark_compares_dtypes_and_measures_batch_invariance(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert benchmark.main(["--model", "tiny", "--requests", "6", "--output-tokens", "exp:8:24", "--dtype", "bfloat16",
                           "--vs", "float32", "--vs", "int8", "--match", "5", "--skip", "decode", "hf-cb", "static", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["dtype"] == "bfloat16"
    assert {"ceiling", "engine", "match"} <= set(results)
    assert {f"{run}-{variant}" for run in ("ceiling", "engine", "match") for variant in ("float32", "int8")} <= set(results)
    assert all("error" not in r for r in results.values()), results
    # float32 kernels are batch-invariant: batched greedy answers equal unbatched generate, every one.
    assert results["match-float32"]["identical"] == results["match-float32"]["prompts"] == 5
    assert 0 <= results["match"]["identical"] <= 5
    printed = capsys.readouterr().out
    assert "ceiling / ceiling-float32" in printed and "engine / engine-int8" in printed


def test_closed_loop_in_process_keeps_users_busy_and_counts_every_token():
    """The in-process side of served / in-process (tritonllm-bench-peers): `users` requests in flight,
    the next sent when one ends, on an engine started as llm_inflight starts it."""
    from tritonllm.engine.llm_engine import LLMEngine
    from tritonllm.engine.scheduler import SchedulerConfig
    from tritonllm.engine.model_loader import load_model

    workload = benchmark.make_workload(7, "exp:6:16", "uniform:3:12", 1)

    def build():
        model, tokenizer = load_model("tiny", "cpu")
        return LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=3, max_model_len=256))

    engine = LLMEngine.start_in_thread(build)
    try:
        result = benchmark.run_closed_loop(engine, workload, users=3)
    finally:
        engine.shutdown()
    assert result["requests"] == 7 and result["tokens"] == sum(n for _, n in workload)
    assert result["tokens_per_s"] > 0 and result["ttft_p50"] > 0
    assert engine.stats.requests_scheduled == 7


def test_the_native_kernel_sections_run_only_when_named(tmp_path, capsys):
    from tritonllm.kernels import native

    out = tmp_path / "bench.json"
    assert benchmark.main(["--model", "tiny", "--dtype", "bfloat16", "--only", "linears", "native",
                           "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"linears", "native"}
    if native.kernel() is None:  # no AVX512-BF16 here, or the switch off: said, not timed
        assert all("error" in r and "native kernel off" in r["error"] for r in results.values())
        return
    linears, steps = results["linears"], results["native"]
    assert linears["t_sum_gb_per_s"] > 0 and len(linears["shapes"]) == 5 * 5
    assert linears["peak_tflop_per_s"] > 0
    assert all(c["native_us"] > 0 and c["native_over_previous"] > 0 for c in linears["shapes"].values())
    assert all(c["int8_us"] > 0 and c["int8_previous_us"] > 0 for c in linears["shapes"].values())
    assert set(steps["cases"]) == {"decode 8 x 32", "decode 32 x 128", "decode 32 x 600", "prefill cold 1280"}
    assert set(steps["cases"]["decode 8 x 32"]) == {"native", "previous", "native, invariance off", "layer loop",
                                                     "Numba attention", "Numba layer ops", "int8", "int8, previous"}
    assert all(s > 0 for case in steps["cases"].values() for s in case.values())


def test_the_quantization_benchmark_measures_each_variant_against_float32(capsys):
    from tritonllm.bench import quantization

    assert quantization.main(["--model", "tiny", "--prompts", "3", "--slots", "2"]) == 0
    printed = capsys.readouterr().out
    assert "against float32" in printed and "kernels off: weight-only (torch)" in printed
    r = quantization.run("tiny", prompts=3, slots=2)
    assert len(r["variants"]) == 3 and r["float32_nll_per_token"] > 0
    for name, v in r["variants"].items():
        assert 0 <= v["identical"] <= v["prompts"] == 3 and 0 <= v["mean_common_prefix"] <= quantization.ANSWER_TOKENS
        assert 0 <= v["mean_gap"] <= v["p99_gap"] <= v["max_gap"] and v["nll_per_token"] > 0
        if name.startswith("int8"):
            assert v["max_gap"] > 0, name  # int8 moves some logprob off float32's
