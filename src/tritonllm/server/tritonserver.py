"""A tritonserver child process on chosen ports (`TritonServer`), and what it tells while it runs:
load failures from its log, its stubs, its CPU time, its repository index and model info."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tritonllm.server.children import Child, http_status
from tritonllm.server.triton_install import TRITON_HOME_ENV, ServerStartError, installed_triton, prepare_triton_home, server_env

DEFAULT_MODEL_REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"


def find_free_ports(n: int) -> list[int]:
    """Return ``n`` distinct free TCP ports on 127.0.0.1."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# Model load failures as Triton 2.51 logs them:
#   E... model_lifecycle.cc:642] "failed to load 'echo' version 1: Internal: ValueError: boom\n\nAt:..."
#   E... model_repository_manager.cc:1460] "Poll failed for model directory 'echo': failed to read text proto from ..."
#   E... model_repository_manager.cc:1415] "failed to poll model 'echo': model not found in any model repository."
#   | echo  | 1       | UNAVAILABLE: Internal: ValueError: boom |   (the model table; reasons may wrap rows)
_LOG_FAILURES = [
    re.compile(r"failed to load '([^']+)' version \d+: (.*)$"),
    re.compile(r"Poll failed for model directory '([^']+)': (.*)$"),
    re.compile(r"failed to poll model '([^']+)': (.*)$"),
    re.compile(r"^\|\s*(\S+)\s*\|\s*\d+\s*\|\s*UNAVAILABLE:\s*(.*?)\s*\|$"),
]
# Precedes "Poll failed" when config.pbtxt does not parse.
STACK_LINES = 200  # of the stubs' stacks in a start failure's message
_PROTO_ERROR = re.compile(r"Error parsing text-format inference\.ModelConfig: (.*)$")


def parse_load_failures(log: str) -> dict[str, str]:
    """Map model name -> first line of its load failure reason, from a server log."""
    failures: dict[str, str] = {}
    proto_error = None
    for line in log.splitlines():
        line = line.strip()
        if m := _PROTO_ERROR.search(line):
            proto_error = m.group(1)
            continue
        for i, pattern in enumerate(_LOG_FAILURES):
            if (m := pattern.search(line)) and m.group(1) not in failures:
                # Reasons are quoted with escaped newlines: keep the first line.
                reason = m.group(2).rstrip('"').split("\\n")[0].strip()
                if i == 1 and proto_error:
                    reason += f" ({proto_error})"
                failures[m.group(1)] = reason
                break
        proto_error = None
    return failures


# Triton APIs that change or reveal the server, closed to clients without the admin key when the
# server listens beyond loopback. Inference, health, metadata, model config, statistics and the
# metrics port stay open.
ADMIN_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_KEY_HEADER = "triton-admin-key"


class TritonServer:
    """A tritonserver child process; use as a context manager or start()/stop()."""

    def __init__(
        self,
        model_repository: str | Path = DEFAULT_MODEL_REPOSITORY,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        host: str = "127.0.0.1",
        models: list[str] | None = None,
        log_file: str | Path | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 120.0,
        triton_home: Path | None = None,
        exit_timeout: int = 30,
        admin_key: str | None = None,
    ):
        self.model_repository = Path(model_repository).resolve()
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.host = host
        self.models = list(models) if models else None
        self.extra_args = list(extra_args or [])
        self.env_overrides = dict(env or {})
        self.ready_timeout = ready_timeout
        self.triton_home = triton_home
        self.exit_timeout = exit_timeout
        self.admin_key = admin_key
        if log_file is None:
            fd, log_file = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
        self.log_file = Path(log_file)
        self.child: Child | None = None
        self.stubs: dict[int, str] = {}
        self.stuck_loading: list[str] = []  # after a start that timed out: the models still loading
        self.ready_seconds: float | None = None
        self.terminated = False  # SIGTERM sent (a second one could cut Triton's drain short)

    @property
    def process(self) -> subprocess.Popen | None:
        return self.child.process if self.child is not None else None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self, home: Path) -> list[str]:
        cmd = [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={home / 'backends'}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.host}",
            "--allow-cpu-metrics=true",
            "--exit-on-error=true",
            "--strict-readiness=true",
            f"--exit-timeout-secs={self.exit_timeout}",
        ]
        if self.admin_key:
            protect = f"{','.join(ADMIN_APIS)}:{ADMIN_KEY_HEADER}={self.admin_key}"
            cmd += [f"--http-restricted-api={protect}", f"--grpc-restricted-protocol={protect}"]
        if self.models:
            cmd.append("--model-control-mode=explicit")
            cmd += [f"--load-model={m}" for m in self.models]
        return cmd + self.extra_args

    def start(self) -> "TritonServer":
        """Start the server and block until /v2/health/ready answers 200."""
        if self.child is not None:
            raise RuntimeError("server already started")
        if not self.model_repository.is_dir():
            raise ServerStartError(f"model repository not found: {self.model_repository}")
        installed = installed_triton(os.environ.get(TRITON_HOME_ENV))
        home = installed or prepare_triton_home(self.triton_home)
        t0 = time.monotonic()
        # Its own process group: stop() signals the server and its stubs together.
        self.child = Child(self.command(home), self.log_file, server_env(self.env_overrides, wheel_libs=installed is None))
        self.child.start()
        ready_url = f"http://{self.http_url}/v2/health/ready"
        try:
            problem = self.child.wait_until(lambda: http_status(ready_url) == 200, self.ready_timeout)
        except BaseException:  # e.g. Ctrl-C while waiting
            self.stop()
            raise
        if problem is None:
            self.ready_seconds = time.monotonic() - t0
            self._scan_stubs()
            return self
        stacks = self._stub_stacks() if self.child.is_running() else ""
        self.stuck_loading = still_loading(self.read_log()) if stacks else []
        self.stop()
        raise ServerStartError(self._failure_message(problem, stacks))

    def _scan_stubs(self) -> None:
        """Remember the Python-backend stubs in the server's process group: pid -> model name.

        Called once the server is ready (while models load, a short-lived stub answers Triton's
        config auto-completion, then exits), and again at every check."""
        for pid in group_pids(self.process.pid):
            if pid in self.stubs:
                continue
            if not _is_stub(pid):
                continue
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:  # gone meanwhile
                continue
            if len(args) > 1:  # empty while a process execs or exits: not a serving stub
                self.stubs[pid] = Path(args[1]).parent.parent.name  # <repository>/<model>/<version>/model.py

    def dead_stubs(self) -> list[str]:
        """Models whose stub, once seen, has died. Triton (2.51) neither restarts the stub of a
        decoupled model nor marks the model unready: its open requests hang and new ones fail with
        "Stub process ... is not healthy"."""
        self._scan_stubs()
        return sorted({name for pid, name in self.stubs.items() if not _running(pid)})

    def _stub_stacks(self, settle_s: float = 3.0) -> str:
        """What the stubs write when asked for their threads' stacks (SIGUSR1, triton/stack_dumps.py):
        where a model that never finishes loading is stuck."""
        start = _log_size(self.log_file)
        asked = [pid for pid in group_pids(self.process.pid) if _is_stub(pid) and _signal(pid, signal.SIGUSR1)]
        if not asked:
            return ""
        size, deadline = start, time.monotonic() + settle_s
        while time.monotonic() < deadline:  # until the log stops growing
            time.sleep(0.3)
            grown = _log_size(self.log_file)
            if grown == size > start:
                break
            size = grown
        with open(self.log_file, "rb") as log:
            log.seek(start)
            return log.read().decode(errors="replace")

    def _failure_message(self, problem: str, stacks: str = "") -> str:
        log = self.read_log()
        failures = parse_load_failures(log)
        lines = [f"{problem} (log: {self.log_file})"]
        if failures:
            lines += [f"  model '{name}' failed to load: {why}" for name, why in failures.items()]
        else:
            if self.stuck_loading:
                lines.append(f"  still loading: {', '.join(self.stuck_loading)}")
            # Skip the option/backend tables, which carry no error.
            tail = [l for l in log[: len(log) - len(stacks)].splitlines() if l.strip() and l[:1] not in "+|"][-20:]
            lines += ["  last log lines:"] + ["    " + l for l in tail]
        if stacks.strip():
            lines += ["  the stubs' stacks:"] + ["    " + l for l in stacks.splitlines()[:STACK_LINES]]
        return "\n".join(lines)

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) used so far by the server's running processes (tritonserver and its stubs)."""
        if self.process is None:
            return None
        return sum(process_cpu_seconds(pid) for pid in group_pids(self.process.pid))

    def terminate(self) -> None:
        """SIGTERM the process group once and return at once: the server drains, then exits
        (stop() waits for that)."""
        if self.child is not None and not self.terminated:
            self.child.signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the process group, then SIGKILL it after ``timeout`` seconds.

        The stubs get SIGTERM too: llm_inflight ends its open requests (triton/termination.py).
        Triton waits up to its exit timeout for models to unload; a client that keeps an idle gRPC
        stream open holds a decoupled model past that, and the server then waits for the client.
        The default timeout is the exit timeout plus 10 s, after which the group is killed.
        """
        if self.child is None:
            return
        self.terminate()
        self.child.stop(self.exit_timeout + 10 if timeout is None else timeout, terminate=False)
        self.child = None
        self.terminated = False

    def is_running(self) -> bool:
        return self.child is not None and self.child.is_running()

    def read_log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def still_loading(log: str) -> list[str]:
    """Models a server log shows loading and not (yet) loaded or failed."""
    started = re.findall(r'"loading: ([^:"]+):', log)
    ended = set(re.findall(r"successfully loaded '([^']+)'", log)) | set(parse_load_failures(log))
    return sorted(set(started) - ended)


def _is_stub(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe").endswith("triton_python_backend_stub")
    except OSError:  # gone meanwhile
        return False


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group (the server and its stubs)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except OSError:  # gone meanwhile
                continue
    return pids


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc/<pid>/stat (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _running(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a killed child stays one until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def repository_index(server: TritonServer) -> list[dict]:
    """Entries of /v2/repository/index (name, version, state, reason)."""
    headers = {ADMIN_KEY_HEADER: server.admin_key} if server.admin_key else {}
    req = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", headers=headers,
                                 data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def model_info(metrics_url: str) -> dict[str, dict[str, str]]:
    """model -> its tritonllm_model_info labels (dtype, device, quantization): what it really runs."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    info = {}
    for labels in re.findall(r"^tritonllm_model_info\{([^}]*)\}", text, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        info[fields.pop("model", "?")] = fields
    return info


def model_runs(metrics_url: str) -> dict[str, str]:
    """model -> "bfloat16 on cpu": what each of our models reports it runs (tritonllm_model_info)."""
    runs = {}
    for model, fields in model_info(metrics_url).items():
        quantized = f", {fields['quantization']} weights" if fields.get("quantization", "none") != "none" else ""
        runs[model] = f"{fields.get('dtype', '?')}{quantized} on {fields.get('device', '?')}"
    return runs
