"""Start and stop a local Triton Inference Server from the nvidia-pytriton wheel.

The wheel ships a real ``tritonserver`` binary, the Python backend and one
backend stub per Python version (see docs/DESIGN section 5). This module copies
that tree into a cache dir, picks the stub for the running interpreter, and runs
the server with an environment in which the stub finds the right libpython and
this virtualenv's packages.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tritonllm.openai.process import FrontStartError, OpenAIFront
from tritonllm.server.children import die_with_parent

PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
DEFAULT_MODEL_REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"
_COMPLETE = ".tritonllm-complete"
TRITON_HOME_ENV = "TRITONLLM_TRITON_HOME"
NGC_TRITON_HOME = Path("/opt/tritonserver")  # where NGC's Triton images install the server


def _pytriton_dir() -> Path:
    """The nvidia-pytriton package, imported only to run its server (the load-test image has none)."""
    import pytriton
    return Path(pytriton.__file__).resolve().parent


def _package_libs() -> Path:
    """auditwheel puts the wheel server's shared libraries next to the package."""
    return _pytriton_dir().parent / "nvidia_pytriton.libs"


class ServerStartError(RuntimeError):
    """The server exited or did not become ready in time."""


def _cache_root() -> Path:
    root = os.environ.get("TRITONLLM_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "tritonllm"


def prepare_triton_home(dest: Path | None = None) -> Path:
    """Copy the wheel's tritonserver tree to ``dest`` once; return ``dest``.

    The stub for the running Python goes to backends/python/, where the Python
    backend looks for it.
    """
    if dest is None:
        version = importlib.metadata.version("nvidia-pytriton")
        dest = _cache_root() / f"tritonserver-{version}-py{PYVER}"
    dest = Path(dest)
    if (dest / _COMPLETE).exists():
        return dest
    package_triton = _pytriton_dir() / "tritonserver"
    stub_src = package_triton / "python_backend_stubs" / PYVER / "triton_python_backend_stub"
    if not stub_src.exists():
        raise FileNotFoundError(f"nvidia-pytriton has no backend stub for Python {PYVER}")

    # Build in a temp dir beside dest and rename, so concurrent callers never
    # see a half-copied tree.
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp-", dir=dest.parent))
    try:
        shutil.copytree(package_triton, tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        stub = tmp / "backends" / "python" / "triton_python_backend_stub"
        shutil.copy2(stub_src, stub)
        for exe in (stub, tmp / "bin" / "tritonserver"):
            exe.chmod(0o755)
        (tmp / _COMPLETE).write_text(f"python {PYVER}\n")
        if not (dest / _COMPLETE).exists():  # else another process finished first
            if dest.exists():  # stale incomplete copy
                shutil.rmtree(dest)
            os.rename(tmp, dest)
    except OSError:
        # rename fails if another process created dest meanwhile; fine if complete
        if not (dest / _COMPLETE).exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def installed_triton(setting: str | None) -> Path | None:
    """An installed Triton to run instead of the wheel's, from ``$TRITONLLM_TRITON_HOME``.

    Empty: the wheel's. ``auto``: NGC's /opt/tritonserver when the image has one, else the wheel's
    (one container image recipe for both). Otherwise a directory with bin/tritonserver and backends/.
    """
    if not setting:
        return None
    if setting == "auto":
        return NGC_TRITON_HOME if (NGC_TRITON_HOME / "bin" / "tritonserver").is_file() else None
    home = Path(setting)
    if not (home / "bin" / "tritonserver").is_file():
        raise ServerStartError(f"{TRITON_HOME_ENV}={setting}: no bin/tritonserver there")
    return home


def server_env(overrides: dict[str, str] | None = None, wheel_libs: bool = True) -> dict[str, str]:
    """Environment for tritonserver and its Python backend stubs (``wheel_libs``: the wheel's server)."""
    env = dict(os.environ)
    # LIBDIR first: otherwise the stub may load another libpython
    # ("undefined symbol: _PyModule_Add").
    libs = [sysconfig.get_config_var("LIBDIR"), str(_package_libs()) if wheel_libs else None,
            env.get("LD_LIBRARY_PATH")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libs if p)
    # The venv's bin first, so the stub imports packages from this environment.
    path = [str(Path(sys.executable).parent), env.get("PATH")]
    env["PATH"] = os.pathsep.join(p for p in path if p)
    env.update(overrides or {})
    return env


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


def _http_get_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


# Triton APIs that change or reveal the server, closed to clients without the admin key when the
# server listens beyond loopback. Inference, health, metadata, model config, statistics and the
# metrics port stay open.
ADMIN_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_KEY_HEADER = "triton-admin-key"
ADMIN_KEY_ENV = "TRITONLLM_ADMIN_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEAD_STUB_STOP_S = 5  # seconds the other models get to finish when one model's stub has died
OPENAI_PORT = 9000  # the OpenAI-compatible front's default port (0: not started)
API_KEY_ENV = "TRITONLLM_API_KEY"
OPENAI_MODELS = ("llm_inflight", "llm_dynamic", "llm_static")  # what the front serves, in /v1/models' order


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
        self.process: subprocess.Popen | None = None
        self.stubs: dict[int, str] = {}
        self.ready_seconds: float | None = None
        self.terminated = False  # SIGTERM sent (a second one could cut Triton's drain short)

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
        if self.process is not None:
            raise RuntimeError("server already started")
        if not self.model_repository.is_dir():
            raise ServerStartError(f"model repository not found: {self.model_repository}")
        installed = installed_triton(os.environ.get(TRITON_HOME_ENV))
        home = installed or prepare_triton_home(self.triton_home)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_file, "wb") as log:
            # Own session/process group: stop() signals the server and its stubs together.
            self.process = subprocess.Popen(
                self.command(home), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=server_env(self.env_overrides, wheel_libs=installed is None),
                start_new_session=True, preexec_fn=die_with_parent,
            )
        try:
            problem = self._wait_ready(t0)
        except BaseException:  # e.g. Ctrl-C while waiting
            self.stop()
            raise
        if problem is None:
            self.ready_seconds = time.monotonic() - t0
            self._scan_stubs()
            return self
        self.stop()
        raise ServerStartError(self._failure_message(problem))

    def _scan_stubs(self) -> None:
        """Remember the Python-backend stubs in the server's process group: pid -> model name.

        Called once the server is ready (while models load, a short-lived stub answers Triton's
        config auto-completion, then exits), and again at every check."""
        for pid in group_pids(self.process.pid):
            if pid in self.stubs:
                continue
            try:
                if not os.readlink(f"/proc/{pid}/exe").endswith("triton_python_backend_stub"):
                    continue
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

    def _wait_ready(self, t0: float) -> str | None:
        """Poll readiness; return None once ready, else what went wrong."""
        ready_url = f"http://{self.http_url}/v2/health/ready"
        while True:
            if self.process.poll() is not None:
                return f"tritonserver exited with code {self.process.returncode}"
            if _http_get_status(ready_url) == 200:
                return None
            if time.monotonic() - t0 > self.ready_timeout:
                return f"tritonserver not ready after {self.ready_timeout:.0f} s"
            time.sleep(0.2)

    def _failure_message(self, problem: str) -> str:
        log = self.read_log()
        failures = parse_load_failures(log)
        lines = [f"{problem} (log: {self.log_file})"]
        if failures:
            lines += [f"  model '{name}' failed to load: {why}" for name, why in failures.items()]
        else:
            # Skip the option/backend tables, which carry no error.
            tail = [l for l in log.splitlines() if l.strip() and l[:1] not in "+|"][-20:]
            lines += ["  last log lines:"] + ["    " + l for l in tail]
        return "\n".join(lines)

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) used so far by the server's running processes (tritonserver and its stubs)."""
        if self.process is None:
            return None
        return sum(process_cpu_seconds(pid) for pid in group_pids(self.process.pid))

    def read_log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM the process group once and return at once: the server drains, then exits
        (stop() waits for that)."""
        if self.process is not None and not self.terminated:
            _signal_group(self.process.pid, signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the process group, then SIGKILL it after ``timeout`` seconds.

        The stubs get SIGTERM too: llm_inflight ends its open requests (triton/termination.py).
        Triton waits up to its exit timeout for models to unload; a client that keeps an idle gRPC
        stream open holds a decoupled model past that, and the server then waits for the client.
        The default timeout is the exit timeout plus 10 s, after which the group is killed.
        """
        proc = self.process
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        self.terminate()
        try:
            proc.wait(timeout=self.exit_timeout + 10 if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            pass
        # Stubs left behind (or a hung server) get SIGKILL.
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()
        self.process = None
        self.terminated = False
        # killpg returns before the targets are gone: wait until the group is empty.
        deadline = time.monotonic() + 5
        while _signal_group(pgid, 0) and time.monotonic() < deadline:
            time.sleep(0.05)

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False if it has no members left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


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


def admin_key_for(host: str, given: str | None) -> str | None:
    """The admin key to restrict the server with: the one given, else a random one off loopback."""
    if given:
        return given
    return None if host in LOOPBACK else secrets.token_urlsafe(18)


def _openai_front(server: TritonServer, args) -> OpenAIFront:
    """The OpenAI front for the LLM models this server has ready (all of them when it has none of ours)."""
    models = args.models
    if not models:
        ready = [m["name"] for m in repository_index(server) if m.get("state") == "READY"]
        models = [m for m in OPENAI_MODELS if m in ready] or ready
    grpc_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    return OpenAIFront(f"{grpc_host}:{args.grpc_port}", port=args.openai_port, host=args.host, models=models,
                       api_key=args.api_key or None, graceful_timeout=args.exit_timeout + 5,
                       log_file=server.log_file.with_name(server.log_file.stem + "-openai.log"))


def _openai_lines(front) -> list[str]:
    """The OpenAI front's URL and a request to paste (the API key, if any, is not printed)."""
    if front is None:
        return []
    body = ('{"model": "llm_inflight", "messages": [{"role": "user", "content": "What is the capital of France?"}], '
            '"max_tokens": 32}')
    auth = ' -H "Authorization: Bearer $TRITONLLM_API_KEY"' if front.api_key else ""
    return [f"  OpenAI:  {front.url}  (log: {front.log_file})",
            f"  curl -s {front.url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"]


def _banner(server: TritonServer, key_made: bool, front=None) -> str:
    """What the server offers; a key given by the user is not printed (logs are often shared)."""
    runs = model_runs(server.metrics_url)
    try:
        models = [f"{m['name']} ({m.get('state', '?')}{', ' + runs[m['name']] if m['name'] in runs else ''})"
                  for m in repository_index(server)]
    except (OSError, ValueError) as e:
        models = [f"<could not list models: {e}>"]
    base = f"http://{server.http_url}"
    body = '{"text_input": "What is the capital of France?", "max_tokens": 32}'
    stream_body = '{"text_input": "What is the capital of France?", "max_tokens": 32, "stream": true}'
    return "\n".join([
        f"Triton ready in {server.ready_seconds:.1f} s (log: {server.log_file})",
        f"  HTTP:    {base}",
        f"  gRPC:    {server.grpc_url}",
        f"  metrics: {server.metrics_url}",
        *_openai_lines(front)[:1],
        "  models:  " + (", ".join(models) or "<none>"),
        *([f"  admin:   {', '.join(ADMIN_APIS)} need header {ADMIN_KEY_HEADER}: "
           + (server.admin_key if key_made else f"(the key given, ${ADMIN_KEY_ENV} or --admin-key)")]
          if server.admin_key else []),
        "Try:",
        f"  curl -s {base}/v2/models/llm_inflight/generate -d '{body}'",
        f"  curl -sN {base}/v2/models/llm_inflight/generate_stream -d '{stream_body}'",
        *_openai_lines(front)[1:],
        "Ctrl-C stops the server.",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run Triton Inference Server on this repo's models.")
    p.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback); beyond loopback the admin APIs need a key")
    p.add_argument("--admin-key", default=os.environ.get(ADMIN_KEY_ENV),
                   help=f"key (header/metadata {ADMIN_KEY_HEADER}) for the {', '.join(ADMIN_APIS)} APIs; "
                        f"default ${ADMIN_KEY_ENV}, or a random one when --host is not loopback")
    p.add_argument("--exit-timeout", type=int, default=30,
                   help="seconds Triton waits for requests to end on SIGTERM before it exits")
    p.add_argument("--model", action="append", dest="models", metavar="NAME",
                   help="load only this model (repeatable); default: all")
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument("--log-file", type=Path, default=None)
    p.add_argument("--openai-port", type=int, default=OPENAI_PORT,
                   help="port of the OpenAI-compatible API (tritonllm-openai) on --host; 0: do not start it")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"key the OpenAI API requires as 'Authorization: Bearer KEY' (default ${API_KEY_ENV}; "
                        "unset: none, as Triton's own inference APIs)")
    args = p.parse_args(argv)

    server = TritonServer(
        model_repository=args.model_repository, http_port=args.http_port,
        grpc_port=args.grpc_port, metrics_port=args.metrics_port, host=args.host,
        models=args.models, log_file=args.log_file, ready_timeout=args.ready_timeout,
        exit_timeout=args.exit_timeout, admin_key=admin_key_for(args.host, args.admin_key),
    )
    front = None
    stop_timeout = None  # the server's exit timeout
    # SIGTERM and SIGINT (also when inherited as ignored) raise KeyboardInterrupt.
    old_handlers = {s: signal.signal(s, signal.default_int_handler)
                    for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"Starting tritonserver (log: {server.log_file}) ...", flush=True)
        server.start()
        if args.openai_port:
            front = _openai_front(server, args)
            front.start()
        print(_banner(server, key_made=not args.admin_key, front=front), flush=True)
        if front is not None and args.host not in LOOPBACK and not front.api_key:
            print(f"note: the OpenAI API listens beyond loopback without a key (--api-key / ${API_KEY_ENV})",
                  flush=True)
        while server.is_running():
            if front is not None and not front.is_running():
                print(f"error: the OpenAI front exited (code {front.process.returncode}); stopping the server so "
                      f"that a supervisor can restart both; see {front.log_file}", file=sys.stderr)
                return 1
            dead = server.dead_stubs()
            if dead:
                print(f"error: the Python process of {', '.join(dead)} died; Triton does not restart it and "
                      "would keep answering 'not healthy' (open streams would hang). Stopping the server "
                      "so that a supervisor can restart it; see " + str(server.log_file), file=sys.stderr)
                stop_timeout = DEAD_STUB_STOP_S  # the dead model can never unload: do not wait for it
                return 1
            time.sleep(1)
        code = server.process.returncode
        how = f" (killed by {signal.Signals(-code).name})" if code < 0 else ""
        print(f"tritonserver exited with code {code}{how}; see {server.log_file}", file=sys.stderr)
        return 1
    except (ServerStartError, FrontStartError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nStopping tritonserver ...", flush=True)
        return 0
    finally:
        for sig in old_handlers:  # a second Ctrl-C must not interrupt the stop
            signal.signal(sig, signal.SIG_IGN)
        if front is not None:
            front.terminate()  # it stops taking requests; open ones end as Triton drains them
        server.stop(stop_timeout)
        if front is not None:
            front.stop(timeout=10)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
