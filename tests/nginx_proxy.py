"""A real nginx (Debian's, installed when missing) in front of Triton replicas on loopback, from
deploy/nginx/tritonllm.conf.template: per-request balancing of HTTP and gRPC."""

from __future__ import annotations

import signal
import socket
import string
import subprocess
import time
from pathlib import Path

from debian_packages import install_missing
from tritonllm.server.tritonserver import find_free_ports

TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "nginx" / "tritonllm.conf.template"
START_TIMEOUT = 30


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class NginxProxy:
    """nginx on two free loopback ports (HTTP, gRPC) before the given replicas; stop() ends it."""

    def __init__(self, work_dir: Path, replicas):
        self.prefix = Path(work_dir)
        self.replicas = list(replicas)
        self.http_port, self.grpc_port = find_free_ports(2)
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def config(self) -> str:
        def servers(urls):
            return "\n".join(f"        server {url} max_fails=1 fail_timeout=10s;" for url in urls)
        return string.Template(TEMPLATE.read_text()).substitute(
            prefix=self.prefix, http_listen=self.http_url, grpc_listen=self.grpc_url,
            http_servers=servers(r.http_url for r in self.replicas),
            grpc_servers=servers(r.grpc_url for r in self.replicas),
            # replicas without an OpenAI front (openai_url) get a placeholder nginx never uses
            openai_servers=servers(r.openai_url for r in self.replicas if getattr(r, "openai_url", None))
            or "        server 127.0.0.1:1 down;")

    def start(self) -> "NginxProxy":
        install_missing({"nginx": "nginx"})
        for temp in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.prefix / temp).mkdir(parents=True, exist_ok=True)
        conf = self.prefix / "nginx.conf"
        conf.write_text(self.config())
        self.process = subprocess.Popen(["nginx", "-p", str(self.prefix), "-c", str(conf)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=open(self.prefix / "stderr.log", "wb"), start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while not (_listening(self.http_port) and _listening(self.grpc_port)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("nginx did not start: " + (self.prefix / "stderr.log").read_text()
                                   + (self.prefix / "error.log").read_text(errors="replace")[-2000:])
            time.sleep(0.1)
        return self

    def access_log(self) -> list[tuple[list[str], str, str]]:
        """(replicas tried in order, status, request line) per request answered so far."""
        path = self.prefix / "access.log"
        entries = []
        for line in (path.read_text().splitlines() if path.exists() else []):
            upstreams, status, _, request = line.split("|", 3)
            entries.append(([u.strip() for u in upstreams.replace(" : ", ", ").split(",") if u.strip() != "-"],
                            status, request.strip('"')))
        return entries

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
