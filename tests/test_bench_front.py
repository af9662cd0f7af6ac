"""tritonllm-bench-front's arithmetic: only the requests both halves ran beside each other count."""

import statistics

import pytest

from tritonllm.bench.front import pooled, side_by_side
from tritonllm_loadtest.samples import Sample


def _sample(start, e2e, ttft, tokens=10):
    return Sample("llm_inflight", "U", "http-sse", 0, start=start, e2e=e2e, ttft=ttft, output_tokens=tokens)


def test_side_by_side_counts_the_common_window_only():
    direct = [_sample(0.0, 1.0, 0.5), _sample(1.0, 1.0, 0.1), _sample(2.0, 1.0, 0.1), _sample(3.0, 1.0, 0.1)]
    front = [_sample(1.0, 1.0, 0.2), _sample(2.0, 1.0, 0.2), _sample(3.0, 2.0, 0.9)]  # window: 1.0 .. 4.0
    r = side_by_side({"triton": direct, "openai": front})
    assert r["window_s"] == 3.0
    assert r["triton"]["requests"] == 3 and r["openai"]["requests"] == 2  # the first direct, the last front: outside
    assert r["triton"]["tokens_per_s"] == pytest.approx(30 / 3) and r["openai"]["tokens_per_s"] == pytest.approx(20 / 3)
    assert r["tokens_ratio"] == pytest.approx(2 / 3) and r["ttft_p50_delta"] == pytest.approx(0.1)


def test_side_by_side_refuses_halves_that_never_overlapped():
    with pytest.raises(SystemExit, match="never ran at the same time"):
        side_by_side({"triton": [_sample(0.0, 1.0, 0.1)], "openai": [_sample(5.0, 1.0, 0.1)]})


def test_rounds_pool_into_one_median_difference_with_an_interval():
    rounds = []
    for shift in (0.0, 0.02):  # the front 10 ms behind in one round, 30 ms in the other
        direct = [_sample(float(i), 1.0, 0.1 + 0.001 * i + shift) for i in range(40)]
        front = [_sample(float(i), 1.0, 0.11 + 0.001 * i + shift + (0.02 if shift else 0.0)) for i in range(40)]
        rounds.append(side_by_side({"triton": direct, "openai": front}))
    p = pooled(rounds)
    assert p["rounds"] == 2 and p["triton"]["requests"] == p["openai"]["requests"] == 80
    assert p["ttft_p50_delta"] == pytest.approx(statistics.median(
        [t for r in rounds for t in r["openai"]["ttfts"]]) - statistics.median([t for r in rounds for t in r["triton"]["ttfts"]]))
    lo, hi = p["ttft_p50_delta_ci95"]
    assert lo <= p["ttft_p50_delta"] <= hi and 0.0 < lo and hi < 0.05
    assert p["tokens_ratio"] == pytest.approx(1.0)
