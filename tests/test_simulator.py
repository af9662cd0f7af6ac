"""The simulator (src/tritonllm/capacity/): the step-cost fit, and the three schemes driven by the real
schedulers on a profile measured from the tiny model, checked for the invariants a simulation must keep."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tritonllm.capacity.replay import RequestSource, run_scheme
from tritonllm.capacity.simulator import (BatchedReplica, BatcherConfig, InflightReplica, SimRequest,
                                          batcher_config, engine_config, simulate)
from tritonllm.capacity.step_cost import StepCost
from tritonllm.capacity.validation import ENGINE_TTFT, Calibration, calibrate, hop_time, validate
from tritonllm_loadtest.samples import Sample, SampleWriter
from tritonllm_loadtest.summary import RunInfo, summarize_run_dir
from tritonllm_loadtest.workload import Workload


def test_step_cost_interpolates_the_measured_grid():
    def seconds(rows, ctx, p):  # a made-up machine: 10 ms a step, 1 ms a row, 0.5 ms a prompt token
        return 0.010 + 0.001 * rows + 0.0005 * p + 0.00001 * ctx
    grid = [{"rows": r, "decode_context": c, "prefill": p, "seconds": seconds(r, c, p)}
            for r in (1, 2, 4, 8) for c in (32, 384) for p in (0, 32, 256)]
    cost = StepCost.from_measurements(grid)
    assert cost.seconds_for(4, 32, 32) == pytest.approx(seconds(4, 32, 32))  # a measured point
    assert cost.seconds_for(3, 100, 200) == pytest.approx(seconds(3, 200, 100))  # between points
    assert cost.seconds_for(12, 512, 32) == pytest.approx(seconds(12, 32, 512))  # past the edges: linear
    assert cost.scaled(2.0).seconds_for(8, 0, 384) == pytest.approx(2 * seconds(8, 384, 0))
    with pytest.raises(ValueError, match="full grid"):
        StepCost.from_measurements(grid[:-1])


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory) -> Path:
    """The tiny model's step costs, measured by the real command."""
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    proc = subprocess.run([sys.executable, "-m", "tritonllm.bench.engine", "--model", "tiny", "--dtype", "float32",
                           "--profile-steps", str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return path


@pytest.fixture(scope="module")
def cost(tiny_profile) -> StepCost:
    data = json.loads(tiny_profile.read_text())
    assert data["model"] == "tiny" and len(data["measurements"]) >= 30
    assert {m["rows"] for m in data["measurements"]} == {1, 2, 4, 8}
    return StepCost.load(tiny_profile)


def test_the_profile_prices_every_shape_and_never_cheaper_past_its_edges(cost):
    # The tiny model's step times are mostly per-op overhead and noise (a busy machine reorders them), so
    # only what holds for any measurement is asserted here; the bundled model's profile is in docs/simulation.
    assert all(0 < cost.seconds_for(r, p, c) < 5 for r in (1, 3, 8) for p in (0, 100, 256) for c in (0, 50, 384))
    assert cost.seconds_for(8, 0, 4000) >= cost.seconds_for(8, 0, 384)
    assert cost.seconds_for(16, 0, 384) >= cost.seconds_for(8, 0, 384)
    assert cost.seconds_for(8, 2048, 384) >= cost.seconds_for(8, 256, 384)


@pytest.fixture(scope="module")
def source() -> RequestSource:
    return RequestSource(Workload(output_tokens="exp:24:96"))  # prompt tokens ≈ 1.3 x words (no tokenizer)


def _by_replica(reqs):
    groups = defaultdict(list)
    for r in reqs:
        groups[r.replica].append(r)
    return groups


@pytest.mark.parametrize("scheme", ["inflight", "dynamic", "static"])
@pytest.mark.parametrize("replicas,routing", [(1, "least-loaded"), (3, "round-robin"), (3, "least-loaded")])
def test_every_request_is_answered_once_in_arrival_order(scheme, replicas, routing, cost, source):
    reqs = source.open_loop(rate=40.0, n=300, seed=1)
    done, reps = run_scheme(scheme, reqs, cost, replicas, routing)
    assert len(done) == 300 and {r.index for r in done} == set(range(300))
    for r in done:  # a profile measured on a busy machine can be slow enough to fill a bounded queue
        if r.rejected:
            assert r.end == r.arrival and r.started is None and r.e2e is None, r
        else:
            assert r.arrival <= r.started <= r.first_token <= r.end, r
    assert all(rep.load == 0 and rep.next_event() == float("inf") for rep in reps)  # nothing left anywhere
    served = [r for r in done if not r.rejected]
    assert {r.replica for r in served} == set(range(replicas))
    for group in _by_replica(served).values():  # first come, first served on every replica
        by_arrival = sorted(group, key=lambda r: (r.arrival, r.index))
        starts = [r.started for r in by_arrival]
        assert starts == sorted(starts)
    if routing == "round-robin":
        assert [r.replica for r in sorted(done, key=lambda r: r.index)][:6] == [0, 1, 2, 0, 1, 2]


def test_tokens_are_conserved_and_each_request_gets_its_own(cost, source):
    """The in-flight replica's scheduler produces exactly max_tokens per request, no more in total."""
    config, _ = engine_config()
    replica = InflightReplica(config, cost)
    produced = defaultdict(int)
    original = replica.advance

    def counting(now):
        for c in replica.chunks:
            if c.samples:
                produced[c.seq.request_id] += 1
        return original(now)
    replica.advance = counting
    reqs = source.open_loop(rate=30.0, n=120, seed=2)
    simulate(reqs, [replica])
    assert sum(produced.values()) == sum(r.max_tokens for r in reqs)
    assert all(produced[str(r.index)] == r.max_tokens for r in reqs)


def test_static_batches_are_full_or_waited_out_their_delay(cost, source):
    batcher = batcher_config("llm_static")
    assert (batcher.max_batch_size, batcher.preferred_batch_size, batcher.max_queue_delay_s) == (8, 8, 5.0)
    reqs = source.open_loop(rate=2.0, n=50, seed=3)
    done, _ = run_scheme("static", reqs, cost)
    batches = defaultdict(list)
    for r in done:
        batches[r.started].append(r)
    for started, members in batches.items():
        oldest = min(r.arrival for r in members)
        assert len(members) == 8 or started >= oldest + 5.0 - 1e-9, (len(members), started - oldest)
        assert len({r.end for r in members}) == 1  # answered together at the batch's end
    assert any(len(m) < 8 for m in batches.values())  # the last requests never make a full batch


def test_dynamic_batcher_dispatches_after_its_window(cost, source):
    batcher = batcher_config("llm_dynamic")
    assert (batcher.max_batch_size, batcher.preferred_batch_size, batcher.max_queue_delay_s) == (8, None, 0.05)
    lone = [SimRequest(0, 1.0, 10, 5)]
    done, _ = run_scheme("dynamic", lone, cost)
    assert done[0].started == pytest.approx(1.05)  # a lone request waits out the 50 ms window


def test_a_full_queue_refuses_at_once(cost):
    replica = BatchedReplica(BatcherConfig(max_batch_size=2, max_queue_delay_s=0.0, max_queue_size=2), cost)
    reqs = [SimRequest(0, 0.0, 10, 50)] + [SimRequest(i, 0.001, 10, 50) for i in range(1, 6)]
    done = simulate(reqs, [replica])  # request 0 runs alone; 1 and 2 queue behind it; 3-5 find the queue full
    refused = [r for r in done if r.rejected]
    assert [r.index for r in refused] == [3, 4, 5] and all(r.end == 0.001 and r.e2e is None for r in refused)
    assert all(r.e2e > 0 for r in done if not r.rejected)


def test_closed_loop_keeps_its_users_busy_and_no_more(cost, source):
    first = [source.make(i, 0.0) for i in range(4)]
    done, _ = run_scheme("inflight", first, cost, users=4, source=source, total=20)
    assert sorted(r.index for r in done) == list(range(20))
    events = sorted([(r.arrival, 1) for r in done] + [(r.end, -1) for r in done], key=lambda e: (e[0], e[1]))
    outstanding = peak = 0
    for _, delta in events:
        outstanding += delta
        peak = max(peak, outstanding)
    assert peak == 4


def test_simulation_is_deterministic_and_in_flight_waits_less_under_load(source):
    # A made-up memory-bound machine (17 ms a step, 1 ms a row, 0.5 ms a prompt token), not the tiny model's
    # noisy profile: the comparison is about scheduling, not about this machine's timings.
    machine = StepCost.from_measurements([{"rows": r, "decode_context": c, "prefill": p,
                                           "seconds": 0.017 + 0.001 * r + 0.0005 * p}
                                          for r in (1, 8) for c in (32, 384) for p in (0, 256)])
    runs = {}
    for scheme in ("inflight", "dynamic"):
        a, _ = run_scheme(scheme, source.open_loop(20.0, 200, 4), machine)
        b, _ = run_scheme(scheme, source.open_loop(20.0, 200, 4), machine)
        assert [(r.first_token, r.end) for r in a] == [(r.first_token, r.end) for r in b]
        runs[scheme] = sum(r.e2e / r.max_tokens for r in a) / len(a)
    assert runs["inflight"] < runs["dynamic"]


def test_validation_calibrates_on_the_closed_loop_and_predicts_each_point(tmp_path, cost, source):
    """A results directory as tritonllm-compare writes it (samples made up; the code path is real)."""
    work = source.workload
    for name, scheme, rate, n in (("inflight-c8", "inflight", 0.0, 16), ("inflight-r20", "inflight", 20.0, 30)):
        run_dir = tmp_path / "runs" / name
        run_dir.mkdir(parents=True)
        RunInfo(name, scheme, "llm_inflight", protocol="grpc-stream", concurrency=8 if not rate else 96,
                arrival_rate=rate, max_requests=n).save(run_dir)
        writer = SampleWriter(run_dir / "samples.jsonl")
        for i in range(n):
            tokens = work.request(i).max_tokens
            writer.write(Sample("llm_inflight", "U", "grpc-stream", i, start=100.0 + 0.05 * i, ttft=0.01,
                                e2e=0.002 * tokens + 0.01, output_tokens=tokens, expected_tokens=tokens))
        writer.close()
    v = validate(tmp_path, cost, source, seed=0)
    assert v["schemes"]["inflight"]["scale"] > 0 and v["schemes"]["inflight"]["overhead_s"] >= 0
    (point,) = v["points"]
    assert point["rate"] == 20.0 and point["requests"] == 30
    for metric in ("tokens_per_s", "ttft_p50", "e2e_p90"):
        m = point[metric]
        assert m["predicted"] > 0 and m["error"] == pytest.approx((m["predicted"] - m["measured"]) / m["measured"])


def test_calibration_recovers_a_served_machines_step_factor_row_time_and_request_overhead(tmp_path, source):
    """A closed-loop run "measured" on a served machine that is the profile's machine at 1.3x every step
    plus 1 ms a row and 20 ms per request outside the engine: calibration on that run alone finds the
    step's factor and row time; of the 20 ms a closed loop shows only what its users' waits for a step do
    not hide."""
    machine = StepCost.from_measurements([{"rows": r, "decode_context": c, "prefill": p,
                                           "seconds": 0.017 + 0.001 * r + 0.0005 * p}
                                          for r in (1, 8) for c in (32, 384) for p in (0, 256)])
    served = Calibration(1.3, 0.001, 0.020)
    first = [source.make(i, 0.0) for i in range(8)]
    reqs, _ = run_scheme("inflight", first, served.cost(machine), users=8, source=source, total=64,
                         overhead_s=served.overhead_s, record_tokens=True)
    run_dir = tmp_path / "runs" / "inflight-c8"
    run_dir.mkdir(parents=True)
    info = RunInfo("inflight-c8", "inflight", "llm_inflight", protocol="grpc-stream", concurrency=8, max_requests=64)
    info.save(run_dir)
    writer = SampleWriter(run_dir / "samples.jsonl")
    for r in reqs:
        gaps = [b - a for a, b in zip(r.token_times, r.token_times[1:])]
        writer.write(Sample("llm_inflight", "U", "grpc-stream", r.index, start=100.0 + r.arrival, ttft=r.ttft,
                            itl=gaps, e2e=r.e2e, output_tokens=r.max_tokens, expected_tokens=r.max_tokens))
    writer.close()
    info, samples, _, summary = summarize_run_dir(run_dir)
    cal = calibrate("inflight", summary, info, samples, machine, source)
    assert cal.scale == pytest.approx(1.3, rel=0.1)
    assert cal.per_row_s == pytest.approx(0.001, abs=0.0003)
    assert 0.0 <= cal.overhead_s <= 0.020
    # With the engine's own first-token times scraped (each client TTFT less the 20 ms outside), it is all of it.
    scrapes = _engine_ttft_scrapes("llm_inflight", [r.ttft - served.overhead_s for r in reqs])
    cal = calibrate("inflight", summary, info, samples, machine, source,
                    hop_s=hop_time(samples, scrapes, "llm_inflight"))
    assert cal.overhead_s == pytest.approx(0.020, abs=1e-6) and cal.scale == pytest.approx(1.3, rel=0.1)


def _engine_ttft_scrapes(model: str, ttfts: list[float], warmup: int = 8) -> list[dict]:
    """metrics.jsonl rows before and after a run: the engine's TTFT histogram's sum and count."""
    total, count = (f'{ENGINE_TTFT}_{part}{{model="{model}"}}' for part in ("sum", "count"))
    return [{"time": 0.0, "values": {total: 0.5, count: float(warmup)}},
            {"time": 1.0, "values": {total: 0.5 + sum(ttfts), count: float(warmup + len(ttfts))}}]


def test_the_hop_time_is_what_clients_waited_beyond_the_engines_own_first_tokens():
    samples = [Sample("llm_inflight", "U", "grpc-stream", i, ttft=0.100 + 0.010 * i, e2e=1.0, output_tokens=5,
                      expected_tokens=5) for i in range(4)]  # client mean 0.115 s
    scrapes = _engine_ttft_scrapes("llm_inflight", [0.100] * 4)
    assert hop_time(samples, scrapes, "llm_inflight") == pytest.approx(0.015)
    assert hop_time(samples, scrapes, "llm_dynamic") is None  # no histogram for that model
    assert hop_time(samples, scrapes[:1], "llm_inflight") is None  # one scrape: no difference to take
    assert hop_time(samples, _engine_ttft_scrapes("llm_inflight", [0.1]), "llm_inflight") is None  # saw too few


def test_a_batching_models_hop_time_is_its_answer_beyond_tritons_queue_and_compute_time():
    samples = [Sample("llm_dynamic", "U", "grpc-infer", i, ttft=2.0, e2e=2.0, output_tokens=5, expected_tokens=5)
               for i in range(4)]
    labels = '{model="llm_dynamic",version="1"}'
    before = {f"nv_inference_request_success{labels}": 8.0, f"nv_inference_queue_duration_us{labels}": 1e6,
              f"nv_inference_compute_infer_duration_us{labels}": 9e6}
    after = {f"nv_inference_request_success{labels}": 12.0, f"nv_inference_queue_duration_us{labels}": 1e6 + 4 * 0.5e6,
             f"nv_inference_compute_infer_duration_us{labels}": 9e6 + 4 * 1.49e6}  # 1.99 s a request in Triton
    scrapes = [{"time": 0.0, "values": before}, {"time": 1.0, "values": after}]
    assert hop_time(samples, scrapes, "llm_dynamic", streams=False) == pytest.approx(0.010)
    assert hop_time(samples, scrapes, "llm_dynamic", streams=True) is None  # no engine histogram for it
