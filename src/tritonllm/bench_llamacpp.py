"""`tritonllm-bench-llamacpp`: llm_inflight against llama.cpp's `llama-server`, side by side, one run.

What a CPU user would deploy instead of this project is llama.cpp's server: continuous batching,
a slot per sequence, hand-written kernels. This command builds `llama-server` once from the
llama.cpp sources vendored in the `llama-cpp-python` sdist (PyPI; cmake and a C++ compiler from the
system) into the cache, serves the bundled SmolLM2 GGUF with the same slots and threads as
llm_inflight, and runs `tritonllm-compare` with it as an extra row (`--openai-url`): the same
requests, the same Locust users, one report.

    tritonllm-bench-llamacpp                      # build once (~10 min on 2 cores), then compare
    tritonllm-bench-llamacpp --build-only
    tritonllm-bench-llamacpp -- --max-requests 96 # anything after -- goes to tritonllm-compare

A benchmark, not a test: it needs the network once (PyPI) and minutes of CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from tritonllm.models import GGUF_FILE, cache_root, gguf_dir
from tritonllm.server.launcher import find_free_ports

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp's sources
# Its AMX kernels die with SIGILL on some CPUs that report AMX (seen on these machines): build without.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def log(msg: str) -> None:
    print(f"[bench-llamacpp {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_llama_server(jobs: int = 2) -> Path:
    """`llama-server` built from the pinned sdist into the cache, once; its path."""
    home = cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    binary = home / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"error: building llama-server needs `{tool}` (e.g. apt-get install cmake g++)")
    home.mkdir(parents=True, exist_ok=True)
    sdist = home / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (llama.cpp's sources)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(home)], check=True)
    source = home / "src"
    if not (source / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(home, filter="data")
        shutil.rmtree(source, ignore_errors=True)
        (home / f"llama_cpp_python-{LLAMA_CPP_PYTHON}").rename(source)
    flags = f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"
    log(f"building llama-server with {jobs} jobs (about 10 minutes on 2 cores) in {home / 'build'}")
    subprocess.run(["cmake", "-S", str(source / "vendor" / "llama.cpp"), "-B", str(home / "build"),
                    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", *flags], check=True)
    subprocess.run(["cmake", "--build", str(home / "build"), "--target", "llama-server", "-j", str(jobs)], check=True)
    return binary


class LlamaServer:
    """`llama-server` on a loopback port serving the bundled GGUF; stopped on exit."""

    def __init__(self, binary: Path, slots: int, threads: int, context_per_slot: int, log_file: Path):
        self.port = find_free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [str(binary), "-m", str(gguf_dir() / GGUF_FILE), "--host", "127.0.0.1",
                        "--port", str(self.port), "-np", str(slots), "-c", str(slots * context_per_slot),
                        "-t", str(threads), "-tb", str(threads), "--no-webui"]
        self.log_file = log_file
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LlamaServer":
        log(f"starting {' '.join(self.command)} (log {self.log_file})")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"error: llama-server exited with {self.process.returncode}; see {self.log_file}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise SystemExit(f"error: llama-server not healthy after 120 s; see {self.log_file}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    compare_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="tritonllm-bench-llamacpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=8, help="llama-server -np (llm_inflight's max_num_seqs is 8)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t / -tb")
    p.add_argument("--context-per-slot", type=int, default=1024, help="KV room per slot (tokens)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="results directory (default results/llamacpp-<timestamp>)")
    args = p.parse_args(own)
    binary = build_llama_server(args.jobs)
    log(f"llama-server: {binary}")
    if args.build_only:
        return 0
    out = (args.out or Path("results") / time.strftime("llamacpp-%Y%m%d-%H%M%S")).resolve()
    from tritonllm_loadtest import compare

    with LlamaServer(binary, args.slots, args.threads, args.context_per_slot, out / "llama-server.log") as server:
        return compare.main(["--schemes", "inflight", "--openai-url", server.url, "--openai-name", "llama.cpp",
                             "--out", str(out), *compare_args])


if __name__ == "__main__":
    raise SystemExit(main())
