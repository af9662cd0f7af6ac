"""The container path, for real: the CPU images built from deploy/docker/Dockerfile (base image
from Debian's packages, wheels from a host-made wheelhouse), `docker-compose up` of the server
until it is healthy, requests to all three models from the host, a headless Locust master with 2
workers in containers, and the comparison as a one-shot service; then `docker-compose down`.

Ports are published on 127.0.0.1 only (free ones); no traffic leaves the machine. The base image
and the wheelhouse are cached by content hash, and Docker's layer cache keeps the image builds,
so a second run takes minutes; untagged images of earlier builds are pruned, so the disk holds
one build's. A dockerd that the test had to start is stopped at the end.
"""

from __future__ import annotations

import csv
import json
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from e2e_clients import generate, grpc_infer, stream_one, text_of
from docker_engine import DockerEngine
from tritonllm.server.tritonserver import ADMIN_KEY_HEADER, find_free_ports

REPO = Path(__file__).resolve().parents[1]
DOCKER_DIR = REPO / "deploy" / "docker"
HEALTHY_TIMEOUT = 600  # seconds for the server container to load its models (a busy 2-core machine)
BUILD_TIMEOUT = 3600  # seconds for a cold build: base image, wheelhouse and both images
LOCUST_TIMEOUT = 600  # seconds for the headless Locust run to end by itself
LOCUST_REQUESTS = 12


def _run(cmd, env=None, timeout=BUILD_TIMEOUT, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {done.returncode}:\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


@dataclass
class ComposeProject:
    """docker-compose on this repository's file, under its own project name, ports and results dir."""
    name: str
    env: dict
    results: Path
    http_url: str  # host:port, as the e2e clients take them
    grpc_url: str
    metrics_url: str
    admin_key: str

    def compose(self, *args, timeout=BUILD_TIMEOUT, check=True) -> subprocess.CompletedProcess:
        return _run(["docker-compose", "-p", self.name, "-f", "docker-compose.yml", *args],
                    env=self.env, timeout=timeout, check=check)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service, timeout=60).stdout.split()
        assert ids, f"no container for {service}"
        return ids[0]

    def health(self) -> str:
        return _run(["docker", "inspect", "-f", "{{.State.Status}} {{.State.Health.Status}}",
                     self.container("triton")], timeout=60).stdout.strip()

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", *services, timeout=120, check=False).stdout


def _wait_healthy(project: ComposeProject) -> None:
    deadline = time.monotonic() + HEALTHY_TIMEOUT
    while (state := project.health()) != "running healthy":
        if not state.startswith("running") or state.endswith("unhealthy") or time.monotonic() > deadline:
            raise AssertionError(f"server container {state} after {HEALTHY_TIMEOUT} s at most:\n"
                                 + project.logs("triton")[-4000:])
        time.sleep(2)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The server up and healthy from freshly built CPU images; down (and dockerd stopped if the
    test started it) at the end."""
    work = tmp_path_factory.mktemp("containers")
    engine = DockerEngine(work / "dockerd.log").start()
    started = int(time.time())
    try:
        base = _run([DOCKER_DIR / "make-base-image.sh"]).stdout.strip().splitlines()[-1]
        _run([DOCKER_DIR / "make-wheelhouse.sh", DOCKER_DIR / "wheels"])
        http, grpc, metrics, locust, openai_port = find_free_ports(5)
        env = dict(os.environ, TRITONLLM_BASE_IMAGE=base, TRITONLLM_TAG="e2e",
                   TRITONLLM_ADMIN_KEY=secrets.token_hex(16), TRITONLLM_RESULTS=str(work / "results"),
                   TRITONLLM_HTTP_PORT=str(http), TRITONLLM_GRPC_PORT=str(grpc),
                   TRITONLLM_METRICS_PORT=str(metrics), TRITONLLM_LOCUST_PORT=str(locust),
                   TRITONLLM_OPENAI_PORT=str(openai_port))
        project = ComposeProject(f"tritonllm-e2e-{os.getpid()}", env, work / "results",
                                 f"127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                                 f"http://127.0.0.1:{metrics}/metrics", env["TRITONLLM_ADMIN_KEY"])
        try:
            project.compose("build")
            project.compose("up", "-d", "triton", timeout=600)
            _wait_healthy(project)
            yield project
        finally:
            (work / "compose.log").write_text(project.logs())
            project.compose("down", "-v", "--remove-orphans", "-t", "30", timeout=600, check=False)
            # Untagged images of earlier builds (this build's stay: the next run's layer cache).
            _run(["docker", "image", "prune", "-f", "--filter", "label=tritonllm.image",
                  "--filter", f"until={started}"], timeout=600, check=False)
    finally:
        engine.stop()


def test_server_container_serves_all_three_models_on_loopback(project):
    http_port = project.http_url.rsplit(":", 1)[1]
    published = _run(["docker", "port", project.container("triton"), "8000/tcp"], timeout=60).stdout.split()
    assert published == [f"127.0.0.1:{http_port}"], published

    for model in ("llm_static", "llm_dynamic", "llm_inflight"):
        response = generate(project, model, text_input="The capital of France is", max_tokens=8)
        assert response.status_code == 200, response.text
        assert response.json()["text_output"].strip(), model
    streamed = stream_one(project, text_input="Count: one, two,", max_tokens=8, stream=True)
    assert streamed.finals == 1 and len(streamed.texts) >= 2 and streamed.text.strip()
    assert text_of(grpc_infer(project, "llm_dynamic", text_input="Hello", max_tokens=4)).strip()

    # Model control stays off for clients without the key.
    index = f"http://{project.http_url}/v2/repository/index"
    assert requests.post(index, timeout=30).status_code == 403
    assert requests.post(index, headers={ADMIN_KEY_HEADER: project.admin_key}, timeout=30).status_code == 200
    assert "tritonllm_num_requests_running" in requests.get(project.metrics_url, timeout=30).text


def test_locust_master_and_two_workers_in_containers(project):
    out = project.results / "locust"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(project.env, LOCUST_HEADLESS="true", LOCUST_USERS="4", LOCUST_SPAWN_RATE="4",
               LOCUST_RUN_TIME=f"{LOCUST_TIMEOUT - 60}s", LOCUST_EXPECT_WORKERS="2",
               LOCUST_USER_CLASSES="GrpcStreamUser", LOCUST_MAX_REQUESTS=str(LOCUST_REQUESTS),
               LOCUST_OUTPUT_TOKENS="fixed:8", LOCUST_CSV="/results/locust/run",
               LOCUST_SAMPLES_FILE="/results/locust/samples.jsonl", LOCUST_ONLY_SUMMARY="true")
    locust = ComposeProject(project.name, env, project.results, project.http_url, project.grpc_url,
                            project.metrics_url, project.admin_key)
    locust.compose("up", "-d", "--scale", "locust-worker=2", "locust-master", "locust-worker", timeout=600)
    master = locust.container("locust-master")
    try:
        # --max-requests ends the run; the master then quits and tells the workers to.
        code = int(_run(["docker", "wait", master], timeout=LOCUST_TIMEOUT).stdout.strip())
        logs = locust.logs("locust-master")
        assert code == 0, logs[-4000:]
        with open(out / "run_stats.csv") as f:
            rows = {row["Name"]: row for row in csv.DictReader(f)}
        assert int(rows["e2e"]["Request Count"]) == LOCUST_REQUESTS, rows["e2e"]
        assert int(rows["e2e"]["Failure Count"]) == 0, logs[-4000:]
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == LOCUST_REQUESTS and not any(s["error"] for s in samples)
        assert {s["worker"] for s in samples} == {0, 1}  # both workers sent requests
        assert all(s["output_tokens"] == 8 and s["ttft"] is not None for s in samples)
    finally:
        locust.compose("rm", "-s", "-f", "locust-master", "locust-worker", timeout=300, check=False)


def test_compare_runs_as_a_one_shot_service(project):
    done = project.compose("run", "--rm", "compare", "--quick", "--schemes", "inflight,dynamic",
                           "--concurrency", "2", "--max-requests", "6", "--warmup", "0",
                           "--output-tokens", "fixed:8", "--out", "/results/compare", timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = (project.results / "compare" / "report.md").read_text()
    assert "inflight" in report and "dynamic" in report
    summaries = json.loads((project.results / "compare" / "summary.json").read_text())
    assert summaries, "no summary"
