"""Two replicas behind a real L7 load balancer, on loopback: two tritonservers (tiny model) and
Debian's nginx with deploy/nginx/tritonllm.conf.template.

Requests spread over both replicas (HTTP and gRPC, balanced per request); `tritonllm-compare`
runs through the proxy; and a replica stopped in the middle of a Locust run (SIGTERM: drained;
SIGKILL: crashed): its in-flight requests end with an error, exactly those are the load test's
errors, new requests go to the other replica, nothing hangs. Held requests (`[[hold:N]]`, test faults on) make "in flight"
certain rather than a matter of timing.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import start_test_server
from e2e_clients import SETTLE, TIMEOUT, generate, grpc_infer, metric, stream_one, text_of, wait_for_metric
from nginx_proxy import NginxProxy

from tritonllm.engine.faults import hold_prompt

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
USERS = 4  # Locust users, each with one held request at a time
RUNNING = "tritonllm_num_requests_running"
TOKENS = "tritonllm_generation_tokens_total"


@contextlib.contextmanager
def _balanced(work: Path):
    """Replicas a and b (tiny model, test faults on) behind nginx: (proxy, [a, b]); all stopped after."""
    replicas, proxy = [], None
    try:
        for name in ("a", "b"):
            (work / name).mkdir()
            replicas.append(start_test_server(work / name))
        proxy = NginxProxy(work / "nginx", replicas).start()
        yield proxy, replicas
    finally:
        if proxy is not None:
            proxy.stop()
        for replica in replicas:
            replica.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with _balanced(tmp_path_factory.mktemp("balanced")) as balanced:
        yield balanced


@pytest.fixture
def fresh_cluster(tmp_path_factory):
    """A pair of its own, for a test that stops one."""
    with _balanced(tmp_path_factory.mktemp("failover")) as balanced:
        yield balanced


def _served(proxy, prefix: str) -> Counter:
    """Replica that answered (the last one tried) -> requests whose path starts with prefix."""
    return Counter(upstreams[-1] for upstreams, status, request in proxy.access_log()
                   if request.split(" ")[1].startswith(prefix) and status == "200")


def test_http_and_grpc_requests_spread_over_both_replicas(cluster):
    proxy, replicas = cluster
    for i in range(6):
        response = generate(proxy, "llm_dynamic", text_input=f"Hello {i}", max_tokens=2)
        assert response.status_code == 200, response.text
        assert text_of(grpc_infer(proxy, "llm_dynamic", text_input=f"Hi {i}", max_tokens=2))
    for i in range(4):  # one gRPC stream each: a stream is one call, balanced as a whole
        assert stream_one(proxy, text_input=f"Hey {i}", max_tokens=2).finals == 1
    http = _served(proxy, "/v2/models/llm_dynamic/generate")
    assert set(http) == {r.http_url for r in replicas} and min(http.values()) >= 2, http
    grpc = _served(proxy, "/inference.GRPCInferenceService/ModelInfer")
    assert set(grpc) == {r.grpc_url for r in replicas} and min(grpc.values()) >= 2, grpc
    streams = _served(proxy, "/inference.GRPCInferenceService/ModelStreamInfer")
    assert set(streams) == {r.grpc_url for r in replicas}, streams
    print(f"per replica: HTTP generate {sorted(http.values())}, gRPC infer {sorted(grpc.values())}, "
          f"gRPC streams {sorted(streams.values())}")


def test_compare_runs_through_the_proxy(cluster, tmp_path):
    proxy, replicas = cluster
    before = Counter(upstreams[-1] for upstreams, _, _ in proxy.access_log())
    out = tmp_path / "compare"
    proc = subprocess.run(
        [sys.executable, "-m", "tritonllm_loadtest.compare", "--server", "never", "--url", proxy.http_url,
         "--grpc-url", proxy.grpc_url, "--metrics-url", replicas[0].metrics_url, "--quick",
         "--schemes", "inflight,dynamic", "--concurrency", "2", "--max-requests", "8", "--warmup", "0",
         "--output-tokens", "fixed:4", "--out", str(out), "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert {r["scheme"] for r in runs} == {"inflight", "dynamic"}
    assert all(r["ok"] == 8 and r["errors"] == 0 for r in runs), [(r["name"], r["ok"], r["errors"]) for r in runs]
    after = Counter(upstreams[-1] for upstreams, _, _ in proxy.access_log())
    grew = {replica for replica in after if after[replica] > before[replica]}
    assert {r.grpc_url for r in replicas} <= grew, (before, after)
    print("compare through the proxy, calls per replica:",
          {replica: after[replica] - before[replica] for replica in sorted(grew)},
          {r["name"]: (r["ok"], r["errors"], round(r["tokens_per_s"], 1)) for r in runs})


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_replica_stopped_mid_run_fails_exactly_its_requests(fresh_cluster, tmp_path, how):
    """Locust's 4 users hold one request each (2 per replica: least_conn). Replica a is stopped,
    with SIGTERM as Kubernetes does (it drains: its requests end with an error after 10 s) or
    SIGKILL as a crash does (its streams are cut at once). Either way a's 2 requests are Locust's
    errors, exactly, except one whose answer had not begun, which nginx passes on to b; requests
    sent meanwhile and the users' next ones go to b, and the run ends when told."""
    proxy, (a, b) = fresh_cluster
    prompts = tmp_path / "held.jsonl"
    prompts.write_text(json.dumps({"id": "held", "prompt": hold_prompt(3, "Tell me a story")}) + "\n")
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(USERS), "-r", str(USERS),
           "-t", "600s", "--host", f"http://{proxy.http_url}", "--csv", str(tmp_path / "locust"), "--only-summary",
           "--samples-file", str(tmp_path / "samples.jsonl"), "--prompts-file", str(prompts),
           "--output-tokens", "fixed:64", "SseStreamUser"]
    tokens0 = metric(a, TOKENS)
    locust = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for replica in (a, b):
            assert wait_for_metric(replica, RUNNING, lambda v: v == USERS / 2, timeout=TIMEOUT) == USERS / 2
        on_a = metric(a, RUNNING)
        # Each held request's answer has begun (its 3 tokens made) before a goes: nginx passes a
        # request whose answer had not begun on to b, so on a busy machine a cut could fail none.
        begun = wait_for_metric(a, TOKENS, lambda v: v - tokens0 >= 3 * on_a, timeout=TIMEOUT) - tokens0
        assert begun >= 3 * on_a, f"a made {begun} tokens for its {on_a} held requests"
        t0 = time.monotonic()
        if how == "SIGTERM":  # a drains (refuses new work, gives running requests 10 s, ends the rest), exits
            a.terminate()
        else:
            os.killpg(a.process.pid, signal.SIGKILL)  # a and its stubs, as when a machine dies
        during = [generate(proxy, "llm_dynamic", text_input=f"During {i}", max_tokens=2) for i in range(4)]
        if how == "SIGTERM":  # a's held requests keep it alive through its grace: these came during the drain
            assert metric(b, RUNNING) == USERS / 2, "a's held requests ended before the requests during its drain"
        a.stop()
        assert [r.status_code for r in during] == [200] * 4, [r.text for r in during]
        stopped_s = time.monotonic() - t0
        # The 2 users whose requests a ended send new ones: b now holds all 4.
        assert wait_for_metric(b, RUNNING, lambda v: v == USERS, timeout=SETTLE) == USERS
        failover_s = time.monotonic() - t0
        for i in range(4):  # and plain requests go to b, through the proxy
            assert generate(proxy, "llm_dynamic", text_input=f"After {i}", max_tokens=2).status_code == 200
        locust.send_signal(signal.SIGTERM)  # ends the run: the 4 requests held on b are cut off
        output, _ = locust.communicate(timeout=TIMEOUT)
    finally:
        if locust.poll() is None:
            locust.kill()
            locust.wait()
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    errors = [s for s in samples if s["error"]]
    assert wait_for_metric(b, RUNNING, lambda v: v == 0) == 0  # b let its held requests go with their
    # connections; nginx logged them first. Requests tried on a, then b: a killed request whose answer
    # had not begun (a busy machine: no token sent yet), or a new one that met a while it went.
    streams = [upstreams for upstreams, _, request in proxy.access_log() if "/llm_inflight/generate_stream" in request]
    retried = sum(upstreams == [a.http_url, b.http_url] for upstreams in streams)
    assert on_a == 2, on_a
    if how == "SIGTERM":  # the drain ends each of a's requests with an error, begun or not
        assert len(errors) == on_a, (retried, output[-3000:])
    else:  # a's requests that had begun are cut; the others went on to b
        assert 1 <= len(errors) <= on_a and len(errors) + retried >= on_a, (retried, output[-3000:])
    if how == "SIGTERM":  # a told its clients; after SIGKILL they see the stream cut (any error)
        assert all("shutting down" in s["error"] for s in errors), [s["error"] for s in errors]
    with open(tmp_path / "locust_stats.csv") as f:
        e2e = next(row for row in csv.DictReader(f) if row["Name"] == "e2e")
    assert int(e2e["Failure Count"]) == len(errors), e2e
    assert len(samples) == len(errors)  # b's 4 never ended by themselves: the run's end cut them off
    after = [upstreams for upstreams, status, request in proxy.access_log() if "/llm_dynamic/generate" in request]
    # Those sent once a was gone went to b. (Those sent while it stopped all got 200, asserted above:
    # from b, or from a before its signal handler ran, on a busy machine.)
    assert all(upstreams[-1] == b.http_url for upstreams in after[-4:]), after[-4:]
    print(f"{how}: replica a stopped in {stopped_s:.1f} s; b held all {USERS} requests {failover_s:.1f} s after the "
          f"stop; Locust errors {len(errors)} (a had {on_a:.0f} running, {retried} passed on to b): {sorted({e['error'][:60] for e in errors})}; "
          f"requests sent while a stopped: {[r.status_code for r in during]}")
