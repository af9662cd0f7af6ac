"""The load test: workload sampler, sample maths and report (no server), then real headless Locust
runs of every user class against the tiny-model tritonserver, the report built from them, and
`tritonllm-compare` end to end.

Locust is only ever run in subprocesses: importing it monkey-patches the standard library.
"""

from __future__ import annotations

import csv
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tritonllm_loadtest import compare, protocol
from tritonllm_loadtest.arrivals import ArrivalSchedule
from tritonllm_loadtest.metrics_scraper import interval_points, parse_prometheus, series, wait_until_idle
from tritonllm_loadtest.report import ReportSettings, build_report
from tritonllm_loadtest.samples import Measurement, Sample, SampleWriter, load_samples
from tritonllm_loadtest.summary import SCHEME_OF_MODEL, RunInfo, ratios, summarize
from tritonllm_loadtest.sweep import Slo, auto_rates, capacity, choose_slo, next_rate, point_requests
from tritonllm_loadtest.workload import PROMPTS_FILE, LengthDist, Workload, load_prompts

LOCUSTFILE = Path(compare.__file__).resolve().parent / "locustfile.py"
STAGES = {"GrpcStreamUser": {"ttft", "itl", "tpot", "e2e"}, "SseStreamUser": {"ttft", "itl", "tpot", "e2e"},
          "GrpcInferUser": {"e2e"}, "HttpInferUser": {"e2e"}}


# ---------------------------------------------------------------- workload (no server)

def test_length_dist_parses_and_rejects():
    assert LengthDist.parse("fixed:16").sample(random.Random(0)) == 16
    assert str(LengthDist.parse("exp:48:256")) == "exp:48:256"
    assert LengthDist.parse("exp:10:100:5").minimum == 5
    u = LengthDist.parse("uniform:3:7")
    assert {u.sample(random.Random(i)) for i in range(200)} == {3, 4, 5, 6, 7}
    for bad in ("fixed:0", "uniform:5:2", "exp:48", "exp:-1:10", "exp:10:100:200", "pareto:1:2", "fixed:x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_workload_is_deterministic_per_index_and_seed():
    a, b = Workload(seed=7), Workload(seed=7)
    first = [a.request(i) for i in range(100)]
    assert [b.request(i) for i in reversed(range(100))][::-1] == first  # order of asking does not matter
    assert [Workload(seed=8).request(i) for i in range(100)] != first
    assert [a.request(i, stream=1) for i in range(100)] != first  # distributed workers get their own stream
    assert len({r.prompt_id for r in first}) > 20  # the prompt set is really sampled
    spec = first[0]
    sampling = json.loads(spec.sampling_json)
    assert sampling == {"max_tokens": spec.max_tokens, "ignore_eos": True, "temperature": 0.0}
    hot = Workload(seed=7, temperature=0.8).request(0)
    assert json.loads(hot.sampling_json)["seed"] == Workload(seed=7, temperature=0.8).request(0).sampling["seed"]


def test_default_output_lengths_are_capped_and_heavy_tailed():
    w = Workload(seed=1)
    lengths = [w.request(i).max_tokens for i in range(20000)]
    assert min(lengths) >= 1 and max(lengths) == 256  # capped, and the cap is reached (tail ~0.5%)
    mean = sum(lengths) / len(lengths)
    assert abs(mean - w.output_tokens.mean()) < 2.0 and 45 < mean < 51
    median = sorted(lengths)[len(lengths) // 2]
    assert median < 0.75 * mean  # exponential: median = ln 2 * mean, far below the mean
    assert sum(x <= 8 for x in lengths) > 0.1 * len(lengths)  # many short requests beside the long ones


def test_prompt_words_distribution_builds_prompts_of_that_length():
    w = Workload(prompt_words="fixed:300", seed=3)
    assert {w.request(i).prompt_words for i in range(20)} == {300}
    w = Workload(prompt_words="uniform:5:9", seed=3)
    assert {w.request(i).prompt_words for i in range(200)} <= set(range(5, 10))


def test_shipped_prompt_set():
    prompts = load_prompts()
    assert PROMPTS_FILE.parent.name == "loadtest"
    assert len(prompts) >= 50
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({p.kind for p in prompts}) >= 6
    words = sorted(len(p.text.split()) for p in prompts)
    assert words[0] <= 8 and words[-1] >= 60  # short questions and long contexts
    assert any(ord(c) > 127 for p in prompts for c in p.text)  # multi-byte text too


# ---------------------------------------------------------------- protocol, samples, summary (no server)

def test_protocol_bodies_and_sse_parsing():
    spec = Workload(seed=0).request(0)
    body = protocol.infer_body(spec)
    assert all(t["shape"] == [1, 1] for t in body["inputs"])
    assert protocol.infer_output_tokens({"outputs": [{"name": "num_output_tokens", "data": [5]}]}) == 5
    with pytest.raises(ValueError):
        protocol.infer_output_tokens({"outputs": []})
    gen = protocol.generate_body(spec, stream=True)
    assert gen["stream"] is True and json.loads(gen["sampling_parameters"])["ignore_eos"] is True
    assert protocol.parse_sse_line(b"") is None
    assert protocol.parse_sse_line(b": comment") is None
    event = protocol.parse_sse_line(b'data: {"text_output": "a", "num_output_tokens": 1}')
    assert protocol.event_tokens(event) == 1
    assert "error" in protocol.parse_sse_line(b'data: {"error": "boom"}')
    assert "error" in protocol.parse_sse_line(b"data: {not json")


def test_measurement_times_stages_and_checks_token_count():
    clock = iter([0.0, 0.5, 0.6, 0.8, 1.0])
    m = Measurement(Sample("llm_inflight", "U", "grpc-stream", 0, expected_tokens=3), clock=lambda: next(clock))
    m.tokens(1)
    m.tokens(0)  # the empty final response carries no token
    m.tokens(1, now=0.6)
    m.tokens(1, now=0.8)
    s = m.finish(now=1.0)
    assert s.ok and s.ttft == 0.5 and s.e2e == 1.0 and s.output_tokens == 3
    assert s.itl == pytest.approx([0.1, 0.2]) and s.tpot == pytest.approx(0.25)
    short = Measurement(Sample("m", "U", "p", 1, expected_tokens=5), clock=iter([0.0, 1.0, 2.0]).__next__)
    short.tokens(2)
    assert "expected 5 output tokens" in short.finish().error


def _sample(i, start, ttft, e2e, tokens, error=None, interrupted=False, model="llm_inflight", proto="grpc-stream"):
    return Sample(model, "U", proto, i, start=start, ttft=ttft, e2e=e2e, output_tokens=tokens,
                  itl=[0.1] * max(tokens - 1, 0), error=error, interrupted=interrupted)


def test_summary_and_ratios():
    inflight = [_sample(0, 100.0, 0.1, 1.0, 10), _sample(1, 100.5, 0.3, 2.5, 20),
                _sample(2, 101.0, None, 0.2, 0, error="boom"), _sample(3, 102.0, None, 5.0, 3, interrupted=True)]
    s = summarize(RunInfo("a", "inflight", "llm_inflight", protocol="grpc-stream", concurrency=8), inflight)
    assert (s.finished, s.ok, s.errors, s.interrupted) == (3, 2, 1, 1)
    assert s.error_rate == pytest.approx(1 / 3)
    assert s.duration_s == pytest.approx(3.0)  # 100.0 -> 103.0 (the interrupted one does not count)
    assert s.tokens_per_s == pytest.approx(10.0) and s.requests_per_s == pytest.approx(2 / 3)
    assert s.ttft_p50 == pytest.approx(0.2) and s.itl_p50 == pytest.approx(0.1) and s.streaming
    static = [_sample(i, 100.0, 6.0, 6.0, 10, model="llm_static", proto="grpc-infer") for i in range(3)]
    b = summarize(RunInfo("b", "static", "llm_static", protocol="grpc-infer", concurrency=8), static)
    assert b.tokens_per_s == pytest.approx(5.0) and not b.streaming and b.tpot_p50 is None
    (r,) = ratios([s, b])
    assert r.baseline == "static" and r.tokens_per_s == pytest.approx(2.0) and r.ttft_p50 == pytest.approx(0.2 / 6)


def test_prometheus_parsing_and_interval_waste_and_occupancy():
    text = ('# HELP x\ntritonllm_generation_tokens_total{model="llm_inflight"} 10\n'
            'tritonllm_slot_steps_total{model="llm_inflight"} 80\n'
            'tritonllm_time_to_first_token_seconds_bucket{model="llm_inflight",le="0.1"} 3\n'
            'nv_inference_count{version="1",model="llm_static"} 16\nsomething_else 1\n')
    values = parse_prometheus(text)
    assert values[series("tritonllm_generation_tokens_total", model="llm_inflight")] == 10
    assert values[series("nv_inference_count", model="llm_static", version="1")] == 16
    assert not any("bucket" in k or "something" in k for k in values)
    g, rows, seqs, sl = (series(f"tritonllm_{n}_total", model="llm_inflight")
                         for n in ("generation_tokens", "rows_computed", "sequence_rows", "slot_steps"))
    # interval 1: 40 tokens from 50 rows (a prompt's 10 rows before its last), 40 sequences of 5 x 8 allowed
    scrapes = [{"time": 0.0, "values": {g: 10, rows: 20, seqs: 10, sl: 80}},
               {"time": 1.0, "values": {g: 50, rows: 70, seqs: 50, sl: 120}},
               {"time": 2.0, "values": {g: 50, rows: 70, seqs: 50, sl: 120}}]
    points = interval_points(scrapes)
    assert points[0].waste == pytest.approx(0.2) and points[0].occupancy == pytest.approx(1.0)
    assert points[0].tokens_per_s == pytest.approx(40)
    assert points[1].waste is None and points[1].occupancy is None  # no forward in that interval


def test_shapes_schedules():
    code = """
import json
from tritonllm_loadtest.shapes import ConcurrencySteps, Spike, Soak
steps = ConcurrencySteps([1, 4, 8], 10)
spike = Spike(2, 16, 30, 20, 90)
soak = Soak(8, 100, 10)
print(json.dumps([steps.at(0), steps.at(15), steps.at(29.9), steps.at(30), spike.at(0), spike.at(35), spike.at(60),
                  spike.at(90), soak.at(5), soak.at(100)]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        [1, 1], [4, 4], [8, 8], None, [2, 16], [16, 16], [2, 16], None, [8, 0.8], None]


def test_compare_argument_checks(capsys):
    args = compare.parse_args(["--concurrency", "1,8", "--schemes", "inflight,static"])
    assert args.concurrency == [1, 8] and args.schemes == ["inflight", "static"] and args.rates == "auto"
    assert compare.parse_args(["--quick"]).rates == "none"
    assert compare.parse_args(["--rates", "2,0.5", "--concurrency", "none"]).rates == [0.5, 2.0]
    for bad in (["--schemes", "inflight,turbo"], ["--concurrency", "0"], ["--run-time", "0"], ["--rates", "0"],
                ["--rates", "fast"], ["--concurrency", "none"], ["--concurrency", "none", "--quick"],
                ["--point-time", "0"], ["--max-users", "0"]):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)
    assert compare.host_port("http://10.0.0.1:9000/x", 8000) == ("10.0.0.1", 9000)
    assert compare.host_port("triton", 8001) == ("triton", 8001)


def test_arrival_schedule_is_a_seeded_poisson_process():
    a, b = ArrivalSchedule(4.0, seed=1), ArrivalSchedule(4.0, seed=1)
    offsets = [a.at(i) for i in range(2000)]
    assert [b.at(i) for i in reversed(range(2000))][::-1] == offsets  # any order of asking, the same times
    assert all(x < y for x, y in zip(offsets, offsets[1:]))
    assert offsets[-1] / 2000 == pytest.approx(1 / 4.0, rel=0.1)  # mean gap 1/rate
    assert ArrivalSchedule(4.0, seed=2).at(5) != offsets[5] and ArrivalSchedule(5.0, seed=1).at(5) != offsets[5]
    with pytest.raises(ValueError):
        ArrivalSchedule(0)


def test_measurement_of_a_late_request_counts_from_its_arrival():
    m = Measurement(Sample("m", "U", "p", 0), clock=iter([10.0, 10.5]).__next__, wall=lambda: 1000.0, late=0.25)
    m.tokens(1)
    s = m.finish(now=11.0)
    assert s.late == 0.25 and s.start == 999.75 and s.ttft == pytest.approx(0.75) and s.e2e == pytest.approx(1.25)


def test_a_whole_answer_has_its_first_token_at_the_end():
    m = Measurement(Sample("m", "U", "p", 0, expected_tokens=4), clock=iter([10.0, 10.5, 10.6]).__next__,
                    streams=False)
    m.tokens(4)  # read at 10.5, but the answer is done only when the call returns (10.6)
    s = m.finish()
    assert s.ttft == s.e2e == pytest.approx(0.6) and s.itl == [] and s.ok


def _point(scheme, rate, e2e, tokens=10, n=10, errors=0):
    samples = [_sample(i, 100.0 + i, e2e, e2e, tokens, proto="grpc-infer") for i in range(n - errors)]
    samples += [_sample(n + i, 100.0, None, 1.0, 0, error="queue full", proto="grpc-infer") for i in range(errors)]
    return summarize(RunInfo(f"{scheme}-r{rate:g}", scheme, f"llm_{scheme}", protocol="grpc-infer", concurrency=96,
                             arrival_rate=rate, max_requests=n), samples)


def test_sweep_rates_slo_and_capacity():
    assert auto_rates(5.0) == [0.5, 1.0, 2.0, 4.0, 8.0]  # 0.1x to 1.6x of saturation, doubling
    assert auto_rates(5.0, 1) == [0.5] and auto_rates(5.0, 3) == [0.5, 2.0, 8.0]
    assert point_requests(0.5, 12, 8) == 8 and point_requests(3.0, 12, 8) == 36
    low = [_point("inflight", 1.0, 1.0), _point("static", 1.0, 6.0)]
    slo = choose_slo(low)
    assert slo.e2e_p90_s == pytest.approx(9.0) and slo.normalized_s == pytest.approx(0.9)  # 1.5x static's
    assert "static" in slo.how and choose_slo(low, 0.2, 3.0) == Slo(0.2, 3.0, "given")
    # inflight meets it up to 4 req/s; static misses at 2 (ratio 2 on p90) after 0.5 at 1: interpolated on log ratio
    slo = Slo(normalized_s=10.0, e2e_p90_s=12.0, how="given")
    inflight = capacity([_point("inflight", r, e) for r, e in ((1, 1.0), (2, 2.0), (4, 3.0))], slo)
    assert inflight.rate == 4 and inflight.bound == ">=" and str(inflight) == "≥ 4 req/s"
    static = capacity([_point("static", 1, 6.0), _point("static", 2, 24.0)], slo)
    assert static.bound == "=" and static.rate == pytest.approx(1.5)  # log 0.5 -> log 2: halfway
    refused = capacity([_point("dynamic", 1, 1.0), _point("dynamic", 2, 1.0, errors=1)], slo)
    assert refused.rate == 1 and refused.bound == "="  # an unanswered request misses the SLO whatever the times
    never = capacity([_point("dynamic", 1, 20.0)], slo)
    assert never.rate is None and str(never) == "< 1 req/s"
    # A server that falls behind misses, however short its latencies: 10 arrivals over 4.5 s (2 req/s)
    # answered one a second (each 1 s after it was due, then later and later): 4 answers in the window
    # shifted by the median latency, under the floor of (0.9 x 9 - 3) / 4.5 s.
    behind = _point("inflight", 2, 1.0)
    samples = [_sample(i, 100.0 + 0.5 * i, 1.0 + 0.5 * i, 1.0 + 0.5 * i, 10, proto="grpc-infer") for i in range(10)]
    behind = summarize(RunInfo("inflight-r2", "inflight", "llm_inflight", protocol="grpc-infer", concurrency=96,
                               arrival_rate=2, max_requests=10), samples)
    assert behind.offered_rps == pytest.approx(2.0) and behind.sustained_rps == pytest.approx(4 / 4.5)
    assert behind.keep_up_floor_rps == pytest.approx((0.9 * 9 - 3) / 4.5)
    assert slo.ratio(behind) > 1 and not slo.met(behind)
    kept_up = summarize(RunInfo("inflight-r2", "inflight", "llm_inflight", protocol="grpc-infer", concurrency=96,
                                arrival_rate=2, max_requests=10),
                        [_sample(i, 100.0 + 0.5 * i, 1.0, 1.0, 10, proto="grpc-infer") for i in range(10)])
    assert kept_up.sustained_rps == pytest.approx(10 / 4.5) and slo.met(kept_up)  # every answer in the window
    assert next_rate([_point("inflight", r, 1.0) for r in (1, 2)], slo) == 3.2  # met every rate: offered more
    assert next_rate([_point("static", 1, 6.0), _point("static", 2, 24.0)], slo) is None  # bracketed


class _SweepComparison:
    """Stands in for compare.Comparison in a unit test of the sweep's order: a scheme's point meets the
    SLO below its capacity here (e2e 1 s) and misses above (e2e 30 s)."""

    def __init__(self, capacities):
        self.capacities, self.summaries, self.ran = capacities, [], []
        self.workload = Workload(output_tokens="fixed:4")

    def run_one(self, scheme, point):
        self.ran.append((scheme, point.rate))
        s = _point(scheme, point.rate, 1.0 if point.rate <= self.capacities[scheme] else 30.0)
        self.summaries.append(s)
        return s


def test_the_sweep_brackets_every_capacity_and_starts_the_shipped_cap_late():
    args = compare.parse_args(["--slo-normalized", "1.0", "--slo-e2e-p90", "5.0", "--time-budget", "1e9"])
    fake = _SweepComparison({"inflight": 2.5, "dynamic": 1.5, "static": 1.0, "inflight_shipped": 7.0})
    compare.run_sweep(args, fake, [1.0, 2.0, 4.0], time.monotonic())
    ran = {scheme: [r for s, r in fake.ran if s == scheme] for scheme in fake.capacities}
    assert ran["static"] == [1.0, 2.0] and ran["dynamic"] == [1.0, 2.0]  # stopped at its first miss
    assert ran["inflight"] == [1.0, 2.0, 4.0]
    assert ran["inflight_shipped"] == [2.0, 4.0, 6.4, 10.2]  # from inflight's highest met rate, then extended
    slo = Slo(1.0, 5.0, "given")
    for scheme in fake.capacities:
        assert capacity([s for s in fake.summaries if s.scheme == scheme], slo).bound == "=", scheme
    # Past the time budget a scheme that met every rate gets one rate more, not more than one.
    args = compare.parse_args(["--slo-normalized", "1.0", "--slo-e2e-p90", "5.0", "--time-budget", "1"])
    fake = _SweepComparison({"inflight": 2.5, "dynamic": 1.5, "static": 1.0, "inflight_shipped": 7.0})
    compare.run_sweep(args, fake, [1.0, 2.0, 4.0], time.monotonic())
    assert [r for s, r in fake.ran if s == "inflight_shipped"] == [2.0, 4.0, 6.4]


def test_a_point_drains_long_enough_for_its_longest_request():
    args = compare.parse_args(["--drain-time", "15", "--point-time", "10", "--point-min-requests", "8"])
    workload = Workload(output_tokens="exp:48:256")
    (fast,) = compare.open_loop_points(args, [1.0], workload, step_s=0.01)
    (slow,) = compare.open_loop_points(args, [1.0], workload, step_s=0.2)
    (unmeasured,) = compare.open_loop_points(args, [1.0], workload)
    longest = max(workload.request(i).max_tokens for i in range(fast.requests))
    last = ArrivalSchedule(1.0, 0).at(fast.requests - 1)
    assert fast.run_time == unmeasured.run_time == math.ceil(last + 15)  # 2 x longest x 10 ms < 15 s
    assert slow.run_time == math.ceil(last + 2 * longest * 0.2)


def test_ideal_inflight_ratio_of_a_workload():
    assert Workload(output_tokens="fixed:10").ideal_inflight_ratio(16, 8) == pytest.approx(1.0)
    work = Workload(output_tokens="exp:48:256")
    lengths = [work.request(i).max_tokens for i in range(16)]
    expected = (max(lengths[:8]) + max(lengths[8:])) / (sum(lengths) / 8)
    assert work.ideal_inflight_ratio(16, 8) == pytest.approx(expected) and expected > 1.5


def test_report_with_a_sweep(tmp_path):
    def write(name, scheme, rate, e2e, ttft=None, n=12):
        run_dir = tmp_path / "runs" / name
        run_dir.mkdir(parents=True)
        model = f"llm_{scheme}"
        proto = "grpc-stream" if scheme == "inflight" else "grpc-infer"
        RunInfo(name, scheme, model, protocol=proto, concurrency=8 if not rate else 96, arrival_rate=rate,
                max_requests=n, server_cpu_s=3.0).save(run_dir)
        writer = SampleWriter(run_dir / "samples.jsonl")
        for i in range(n):
            writer.write(Sample(model, "U", proto, i, start=100.0 + i * 0.5, ttft=ttft or e2e, e2e=e2e,
                                output_tokens=10, expected_tokens=10))
        writer.close()
        q = series("nv_inference_queue_duration_us", model=model, version="1")
        ok = series("nv_inference_request_success", model=model, version="1")
        wait = {"static": 2.0, "dynamic": 0.05, "inflight": 0.0}[scheme]
        rows = [{"time": 100.0, "values": {q: 0.0, ok: 0.0}}, {"time": 110.0, "values": {q: wait * 1e6 * n, ok: n}}]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    for scheme, e2e in (("inflight", 1.0), ("dynamic", 2.0), ("static", 4.0)):
        write(f"{scheme}-c8", scheme, 0.0, e2e, ttft=0.1 if scheme == "inflight" else None)
    for rate, factor in ((1.0, 1.0), (2.0, 1.2), (4.0, 3.0)):
        write(f"inflight-r{rate:g}", "inflight", rate, 1.0 * factor, ttft=0.1)
        write(f"dynamic-r{rate:g}", "dynamic", rate, 2.0 * factor * factor)
        write(f"static-r{rate:g}", "static", rate, 5.0 * factor * factor)
    ReportSettings(price_per_hour=3.6, ideal_ratio={8: 2.0}).save(tmp_path)
    text = build_report(tmp_path).read_text()
    assert "## Under live traffic (open-loop sweep)" in text and "![Under live traffic" in text
    assert "| inflight | ≥ 4 req/s |" in text  # never missed: a lower bound
    assert "(normalized latency 1.5 x static's at 1 req/s; p90 end-to-end 1.5 x static's at 1 req/s)" in text
    assert "| 1 | static | 12 / 12 | 0 | 0 |" in text and "| met |" in text and "| missed |" in text
    assert "static's mean queue wait is 40x dynamic's (2 s vs 0.05 s)" in text  # information, not a target
    assert "cost per million output tokens at 3.6/hour" in text
    assert "ideal 2x" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["capacity"]["inflight"]["bound"] == ">=" and summary["slo"]["e2e_p90_s"] == pytest.approx(7.5)
    runs = {r["name"]: r for r in summary["runs"]}
    assert runs["static-r1"]["queue_wait_s"] == pytest.approx(2.0)
    assert runs["inflight-c8"]["core_s_per_1k_tokens"] == pytest.approx(1000 * 3.0 / 120)
    assert (tmp_path / "plots" / "sweep.png").stat().st_size > 20000


def test_report_from_synthetic_runs(tmp_path):
    for name, scheme, model, proto, e2e in (("inflight-c8", "inflight", "llm_inflight", "grpc-stream", 1.0),
                                            ("static-c8", "static", "llm_static", "grpc-infer", 3.0)):
        run_dir = tmp_path / "runs" / name
        run_dir.mkdir(parents=True)
        RunInfo(name, scheme, model, protocol=proto, concurrency=8).save(run_dir)
        writer = SampleWriter(run_dir / "samples.jsonl")
        for i in range(20):
            ttft = 0.1 if proto == "grpc-stream" else e2e
            writer.write(Sample(model, "U", proto, i, start=100.0 + i * 0.5, ttft=ttft, e2e=e2e, output_tokens=10,
                                expected_tokens=10, itl=[0.1] * 9 if proto == "grpc-stream" else []))
        writer.close()
    report = build_report(tmp_path)
    text = report.read_text()
    assert "| inflight-c8 | inflight | grpc-stream | 8 users | 20 | 0 |" in text
    assert "| 8 users | static |" in text
    assert len(load_samples(tmp_path / "runs" / "static-c8")) == 20
    for png in ("throughput", "ttft_cdf", "e2e_cdf", "itl", "e2e_vs_tokens"):
        assert (tmp_path / "plots" / f"{png}.png").stat().st_size > 5000
        assert f"plots/{png}.png" in text
    assert not (tmp_path / "plots" / "occupancy.png").exists()  # no metrics were scraped


# ---------------------------------------------------------------- real Locust runs against tritonserver

def run_locust(server, run_dir: Path, user_class: str, users: int, max_requests: int, *extra: str,
               run_time: int = 15) -> subprocess.CompletedProcess:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users), "-r", str(users),
           "-t", f"{run_time}s", "--host", f"http://{server.http_url}", "--grpc-url", server.grpc_url,
           "--csv", str(run_dir / "locust"), "--html", str(run_dir / "locust.html"), "--only-summary",
           "--samples-file", str(run_dir / "samples.jsonl"), "--max-requests", str(max_requests),
           "--output-tokens", "exp:6:24", *extra, user_class]
    return subprocess.run(cmd, cwd=run_dir, capture_output=True, text=True, timeout=run_time + 60)


# (run name, user class, model, users, requests, extra args)
RUNS = [
    ("inflight-grpc", "GrpcStreamUser", "llm_inflight", 4, 32, ()),
    ("inflight-sse", "SseStreamUser", "llm_inflight", 4, 32, ()),
    ("static-grpc", "GrpcInferUser", "llm_static", 8, 24, ()),  # 8 users: full batches, no 5 s wait
    ("dynamic-http", "HttpInferUser", "llm_dynamic", 8, 24, ("--arrival-rate", "16")),  # Poisson arrivals
]


@pytest.fixture(scope="module")
def locust_runs(triton_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("loadtest")
    results = {}
    for name, user_class, model, users, n, extra in RUNS:
        run_dir = root / "runs" / name
        proc = run_locust(triton_server, run_dir, user_class, users, n, "--triton-model", model, *extra)
        RunInfo(name, SCHEME_OF_MODEL[model], model, user_class=user_class,
                protocol=compare.user_class_protocol(user_class), concurrency=users).save(run_dir)
        results[name] = (run_dir, proc)
    return root, results


@pytest.mark.parametrize("name,user_class,model,users,n,extra", RUNS, ids=[r[0] for r in RUNS])
def test_user_class_against_triton(locust_runs, name, user_class, model, users, n, extra):
    _, results = locust_runs
    run_dir, proc = results[name]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "requests finished (--max-requests): stopping" in proc.stderr  # ended by count, before -t
    with open(run_dir / "locust_stats.csv", newline="") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    stages = {k for k in rows if k != "Aggregated"}
    assert stages == STAGES[user_class]
    for stage in stages:
        assert int(rows[stage]["Failure Count"]) == 0, rows[stage]
        assert int(rows[stage]["Request Count"]) > 0
        assert rows[stage]["Type"] == f"{compare.user_class_protocol(user_class)} {model}"
    assert int(rows["e2e"]["Request Count"]) == n
    samples = load_samples(run_dir / "samples.jsonl")
    assert len(samples) == n and sorted(s.index for s in samples) == list(range(n))
    work = Workload()  # the same defaults the locustfile used, apart from --output-tokens
    for s in samples:
        assert s.ok, s.error
        assert s.model == model and s.user == user_class
        assert s.output_tokens == s.expected_tokens  # max_tokens + ignore_eos honoured
        assert s.prompt_id == work.request(s.index).prompt_id
        assert 0 < s.ttft <= s.e2e
        if user_class in ("GrpcStreamUser", "SseStreamUser"):
            assert len(s.itl) == s.output_tokens - 1  # one streamed response per token step
        else:
            assert s.itl == [] and s.ttft == s.e2e  # the answer comes whole
    assert len({s.expected_tokens for s in samples}) > 3  # varied output lengths
    assert (run_dir / "locust.html").stat().st_size > 10000


def assert_on_schedule(samples, rate: float, seed: int = 0, tolerance: float = 0.1):
    """Request i was due (its `start`) at its seeded Poisson arrival time, relative to request 0."""
    schedule = ArrivalSchedule(rate, seed)
    by_index = {s.index: s for s in samples}
    first = by_index[0].start - schedule.at(0)
    for i, s in by_index.items():
        assert abs(s.start - first - schedule.at(i)) < tolerance, (i, s.start - first, schedule.at(i))


def test_arrival_rate_sends_on_the_seeded_schedule(locust_runs):
    _, results = locust_runs
    samples = load_samples(results["dynamic-http"][0] / "samples.jsonl")
    starts = sorted(s.start for s in samples)
    assert starts[-1] - starts[0] > 0.5  # 24 requests at 16/s take ~1.5 s
    assert sum(t - starts[0] < 0.05 for t in starts) < 8  # no burst of all 8 users at t=0 (closed loop would)
    assert_on_schedule(samples, 16.0)


def test_report_builds_from_locust_runs(locust_runs):
    root, _ = locust_runs
    report = build_report(root)
    text = report.read_text()
    for name, *_ in RUNS:
        assert f"| {name} |" in text
    assert "| 4 users | static |" not in text  # ratios only between runs at the same load
    summary = json.loads((root / "summary.json").read_text())
    assert {r["name"]: r["errors"] for r in summary["runs"]} == {r[0]: 0 for r in RUNS}
    assert all(r["tokens_per_s"] > 0 for r in summary["runs"])
    for png in ("throughput", "ttft_cdf", "e2e_cdf", "itl", "e2e_vs_tokens"):
        assert (root / "plots" / f"{png}.png").stat().st_size > 5000


def test_distributed_processes_ship_samples_to_master(triton_server, tmp_path):
    proc = run_locust(triton_server, tmp_path, "GrpcStreamUser", 4, 24, "--processes", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = load_samples(tmp_path / "samples.jsonl")  # written by the master from the workers' reports
    finished = [s for s in samples if not s.interrupted]
    assert len(finished) == 24 and all(s.ok for s in finished)
    assert {s.worker for s in finished} == {0, 1}


def test_compare_end_to_end(triton_server, tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "tritonllm_loadtest.compare", "--server", "never",
           "--url", triton_server.http_url, "--grpc-url", triton_server.grpc_url,
           "--metrics-url", triton_server.metrics_url, "--max-requests", "16", "--run-time", "30",
           "--output-tokens", "exp:6:24", "--scrape-interval", "0.25", "--out", "results",  # relative to cwd
           "--rates", "6,40", "--point-time", "1", "--point-min-requests", "6", "--drain-time", "30",
           "--price-per-hour", "2.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=360, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"report: {(out / 'report.md').resolve()}" in proc.stdout
    text = (out / "report.md").read_text()
    for scheme in ("inflight", "dynamic", "static"):
        assert f"| {scheme}-c8 | {scheme} |" in text
        for name in ("locust.html", "locust_stats.csv", "locust.log", "samples.jsonl", "metrics.jsonl", "run.json"):
            assert (out / "runs" / f"{scheme}-c8" / name).is_file(), name
    assert "| 8 users | dynamic |" in text and "| 8 users | static |" in text
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["scheme"]: r for r in summary["runs"] if not r["arrival_rate"]}
    assert all(r["finished"] == 16 and r["errors"] == 0 for r in runs.values())
    # every scheme got the same requests
    indexes = {s: sorted((x.index, x.expected_tokens) for x in load_samples(out / "runs" / f"{s}-c8"))
               for s in runs}
    assert indexes["inflight"] == indexes["dynamic"] == indexes["static"]
    assert 0 < runs["inflight"]["occupancy"] <= 1 and 0 <= runs["inflight"]["waste"] < runs["dynamic"]["waste"]
    assert runs["static"]["triton_batch_size"] >= 4  # static waits for full batches of 8
    assert (out / "plots" / "occupancy.png").stat().st_size > 5000
    # The open-loop sweep: every scheme got the same requests at the same seeded arrival times.
    points = {(r["scheme"], r["arrival_rate"]): r for r in summary["runs"] if r["arrival_rate"]}
    assert set(points) == {(s, r) for s in ("inflight", "dynamic", "static") for r in (6.0, 40.0)}
    for (scheme, rate), r in points.items():
        assert r["planned"] == (6 if rate == 6 else 40) and r["ok"] == r["planned"] and r["errors"] == 0, r
        assert r["normalized_latency"] > 0 and r["queue_wait_s"] is not None
        assert_on_schedule(load_samples(out / "runs" / f"{scheme}-r{rate:g}"), rate)
    # 6 requests never fill static's batch of 8: each waits out its 5 s queue delay; dynamic's window is 50 ms,
    # though its requests also wait for the batch running before them (0.42 s beside busy loops).
    static_wait, dynamic_wait = points[("static", 6.0)]["queue_wait_s"], points[("dynamic", 6.0)]["queue_wait_s"]
    assert static_wait > 2.0 > dynamic_wait and static_wait > 3 * dynamic_wait
    assert summary["slo"] is not None and set(summary["capacity"]) == {"inflight", "dynamic", "static"}
    assert "## Under live traffic (open-loop sweep)" in text and "capacity under the SLO" in text
    assert "cost per million output tokens at 2.5/hour" in text
    assert "static's mean queue wait is" in text
    assert (out / "plots" / "sweep.png").stat().st_size > 20000
    assert json.loads((out / "settings.json").read_text())["price_per_hour"] == 2.5


def test_compare_fails_above_error_threshold(triton_server, tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "tritonllm_loadtest.compare", "--server", "never",
           "--url", triton_server.http_url, "--grpc-url", triton_server.grpc_url,
           "--metrics-url", triton_server.metrics_url, "--schemes", "dynamic", "--max-requests", "8",
           "--run-time", "20", "--output-tokens", "fixed:4000", "--warmup", "0", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL: error rate above --max-error-rate" in proc.stdout
    text = (out / "report.md").read_text()
    assert "exceeds max_model_len" in text  # the server's reason is in the report


def test_a_second_comparison_into_the_same_out_replaces_the_first(triton_server, tmp_path):
    """Samples are appended as they come: a second run into the same --out must not count the first's."""
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "tritonllm_loadtest.compare", "--server", "never",
           "--url", triton_server.http_url, "--grpc-url", triton_server.grpc_url,
           "--metrics-url", triton_server.metrics_url, "--schemes", "inflight", "--quick", "--concurrency", "2",
           "--run-time", "60", "--output-tokens", "fixed:3", "--warmup", "0", "--out", str(out)]
    for requests in (6, 4):
        proc = subprocess.run(cmd + ["--max-requests", str(requests)], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((out / "summary.json").read_text())["runs"]
    assert [(r["name"], r["planned"], r["finished"]) for r in run] == [("inflight-c2", 4, 4)]
    assert len(load_samples(out / "runs" / "inflight-c2")) == 4
    assert "holds the runs of an earlier comparison: replacing them" in proc.stdout


# ---------------------------------------------------------------- OpenAI-compatible servers

class _FakeCompletions:
    """Unit-test peer of OpenAIStreamUser: a loopback server that streams `/v1/completions` as
    OpenAI-compatible servers do (one text piece per token, a usage event, [DONE]) and keeps the bodies.
    `vllm_style`: as vLLM's server does it (HTTP/1.1 chunked, `usage: null` in every event, the
    finish reason on the last token's event, and events with empty text for tokens without text of
    their own: every token of a request whose max_tokens is a multiple of 5).
    The real peers, llama.cpp's and vLLM's servers, run in `tritonllm-bench-peers`."""

    def __init__(self, vllm_style: bool = False):
        import http.server
        import threading

        bodies = self.bodies = []
        self.textless = 0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if vllm_style else "HTTP/1.0"

            def handle(self):
                try:
                    super().handle()
                except ConnectionResetError:  # the client closed a kept-alive connection
                    pass

            def event(self, payload: str) -> None:
                data = f"data: {payload}\n\n".encode()
                if vllm_style:  # one HTTP chunk per event
                    data = f"{len(data):x}\r\n".encode() + data + b"\r\n"
                self.wfile.write(data)
                self.wfile.flush()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                n = body["max_tokens"]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                if vllm_style:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                textless = vllm_style and n % 5 == 0
                fake.textless += textless
                for i in range(n):
                    choice = {"index": 0, "text": "" if textless else f" t{i}", "finish_reason": None}
                    if vllm_style and i == n - 1:
                        choice["finish_reason"] = "length"
                    self.event(json.dumps({"choices": [choice], **({"usage": None} if vllm_style else {})}))
                self.event(json.dumps({"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": 3}}))
                self.event("[DONE]")
                if vllm_style:
                    self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.server
def test_openai_user_sends_the_same_workload_and_times_the_stream(tmp_path):
    fake = _FakeCompletions()
    try:
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "4", "-r", "4", "-t", "30s",
               "--host", fake.url, "--openai-model", "smollm2", "--csv", str(tmp_path / "locust"), "--only-summary",
               "--samples-file", str(tmp_path / "samples.jsonl"), "--max-requests", "12",
               "--output-tokens", "exp:6:24", "OpenAIStreamUser"]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    finally:
        fake.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    samples = load_samples(tmp_path / "samples.jsonl")
    assert len(samples) == 12
    work = Workload(output_tokens="exp:6:24")  # what the locustfile built from the same flags
    for s in samples:
        assert s.ok, s.error
        assert s.protocol == "openai-sse" and s.model == "smollm2"
        assert s.output_tokens == s.expected_tokens == work.request(s.index).max_tokens
        assert len(s.itl) == s.output_tokens - 1 and 0 < s.ttft <= s.e2e
    sent = sorted((b["prompt"], b["max_tokens"]) for b in fake.bodies)
    assert sent == sorted((work.request(s.index).prompt, s.expected_tokens) for s in samples)
    assert all(b["ignore_eos"] is True and b["stream"] is True and b["model"] == "smollm2" and b["temperature"] == 0
               for b in fake.bodies)


@pytest.mark.server
def test_openai_user_counts_every_request_of_a_vllm_style_stream(tmp_path):
    """A request whose every event has empty text (tokens without text of their own) was never counted
    as finished against vLLM's server: the run waited out its time bound and Locust exited 1."""
    fake = _FakeCompletions(vllm_style=True)
    started = time.monotonic()
    try:
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "4", "-r", "4", "-t", "120s",
               "--host", fake.url, "--only-summary", "--samples-file", str(tmp_path / "samples.jsonl"),
               "--max-requests", "16", "--output-tokens", "exp:6:24", "OpenAIStreamUser"]
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    finally:
        fake.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - started < 100, "the run waited for its time bound"
    assert fake.textless > 0, "no request had a stream without text: the test does not test the bug"
    samples = load_samples(tmp_path / "samples.jsonl")
    assert len(samples) == 16 and all(s.ok for s in samples), [s.error for s in samples]
    for s in samples:
        assert s.output_tokens == s.expected_tokens  # from usage
        # Empty-text steps are pieces too; a closing event without text (the last of a textless stream) is not.
        textless = s.expected_tokens % 5 == 0
        assert s.ttft is not None and len(s.itl) == s.expected_tokens - 1 - textless


def test_compare_adds_an_openai_compatible_server_as_a_row(triton_server, tmp_path):
    fake = _FakeCompletions()
    out = tmp_path / "results"
    try:
        cmd = [sys.executable, "-m", "tritonllm_loadtest.compare", "--server", "never",
               "--url", triton_server.http_url, "--grpc-url", triton_server.grpc_url,
               "--metrics-url", triton_server.metrics_url, "--schemes", "inflight", "--max-requests", "8",
               "--run-time", "30", "--output-tokens", "exp:6:24", "--openai-url", fake.url,
               "--openai-name", "other-server", "--quick", "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    finally:
        fake.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Models run: llm_dynamic: float32 on cpu, ≤8 sequences at once" in proc.stdout  # what the models run
    text = (out / "report.md").read_text()
    assert "| other-server-c8 | other-server | openai-sse |" in text
    runs = {r["scheme"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}
    assert runs["other-server"]["finished"] == runs["inflight"]["finished"] == 8
    assert runs["other-server"]["errors"] == 0 and runs["other-server"]["streaming"] is True
    ratios = json.loads((out / "summary.json").read_text())["ratios"]
    assert [r["baseline"] for r in ratios] == ["other-server"]
    indexes = {s: sorted((x.index, x.expected_tokens) for x in load_samples(out / "runs" / f"{s}-c8"))
               for s in runs}
    assert indexes["inflight"] == indexes["other-server"]  # the same requests


def test_progress_counts_samples_as_they_are_written(tmp_path):
    from tritonllm_loadtest.progress import Progress

    path = tmp_path / "samples.jsonl"
    progress = Progress(path, "inflight-c8", total=4, clock=lambda: 110.0)
    assert progress.line() == "inflight-c8: 0/4 requests done, - output tok/s so far, 0 errors"  # no file yet
    with open(path, "w") as f:
        f.write('{"start": 100.0, "output_tokens": 30, "error": null}\n'
                '{"start": 101.0, "output_tokens": 5, "error": "boom"}\n'
                '{"start": 102.0, "output_tok')  # a line still being written
    assert progress.line() == "inflight-c8: 2/4 requests done, 3 output tok/s so far, 1 errors"
    with open(path, "a") as f:
        f.write('ens": 70, "error": null}\n')
    assert progress.line() == "inflight-c8: 3/4 requests done, 10 output tok/s so far, 1 errors"


def test_a_run_waits_until_no_model_has_requests_queued_or_in_hand():
    """wait_until_idle polls the metrics until every model's queue and open requests are 0: a cut-off
    client's request still runs on the server and would take the next run's CPU."""
    import http.server
    import threading

    pages = [  # one per scrape: a batch still running, then one queued, then idle
        'nv_inference_pending_request_count{model="llm_dynamic",version="1"} 0\n'
        'tritonllm_num_requests_open{model="llm_dynamic"} 8\ntritonllm_num_requests_open{model="llm_inflight"} 0\n',
        'nv_inference_pending_request_count{model="llm_dynamic",version="1"} 1\n'
        'tritonllm_num_requests_open{model="llm_dynamic"} 0\n',
        'nv_inference_pending_request_count{model="llm_dynamic",version="1"} 0\n'
        'tritonllm_num_requests_open{model="llm_dynamic"} 0\ntritonllm_generation_tokens_total{model="llm_inflight"} 9\n',
    ]
    served = []

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = pages[min(len(served), len(pages) - 1)].encode()
            served.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        waited, busy = wait_until_idle(url, timeout=60, poll=0.01)
        assert busy == {} and len(served) == 3
        del served[:]
        waited, busy = wait_until_idle(url, timeout=0, poll=0.01)  # out of time while busy: says what was busy
        assert busy == {'tritonllm_num_requests_open{model="llm_dynamic"}': 8.0}
    finally:
        server.shutdown()
    assert wait_until_idle("http://127.0.0.1:9/metrics", timeout=60)[1] == {}  # no metrics: nothing to wait on
