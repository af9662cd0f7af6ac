"""llama.cpp's `llama-server`: built once from the llama.cpp sources vendored in the
`llama-cpp-python` sdist (PyPI; cmake and a C++ compiler from the system, ~10 min on 2 cores),
serving the bundled SmolLM2 with continuous batching, one slot per sequence: in bfloat16 by
default (the converted model directory llm_inflight loads, turned into a GGUF by llama.cpp's own
convert_hf_to_gguf.py), or the package's Q4_1 GGUF as shipped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from tritonllm.model_files import GGUF_FILE, bundled_dir, cache_root, gguf_dir
from tritonllm.bench.peers.peer_server import PeerServer, log

LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors llama.cpp's sources
# Its AMX kernels die with SIGILL on some CPUs that report AMX (seen on these machines): build without.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def home() -> Path:
    return cache_root() / f"llama.cpp-{LLAMA_CPP_PYTHON}"


def build_llama_server(jobs: int = 2) -> Path:
    """`llama-server` built from the pinned sdist into the cache, once; its path."""
    home_dir = home()
    binary = home_dir / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"error: building llama-server needs `{tool}` (e.g. apt-get install cmake g++)")
    home_dir.mkdir(parents=True, exist_ok=True)
    sdist = home_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (llama.cpp's sources)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(home_dir)], check=True)
    source = home_dir / "src"
    if not (source / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(home_dir, filter="data")
        shutil.rmtree(source, ignore_errors=True)
        (home_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}").rename(source)
    flags = f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"
    log(f"building llama-server with {jobs} jobs (about 10 minutes on 2 cores) in {home_dir / 'build'}")
    subprocess.run(["cmake", "-S", str(source / "vendor" / "llama.cpp"), "-B", str(home_dir / "build"),
                    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", *flags], check=True)
    subprocess.run(["cmake", "--build", str(home_dir / "build"), "--target", "llama-server", "-j", str(jobs)], check=True)
    return binary


def bundled_gguf(weights: str) -> Path:
    """The bundled model as a GGUF: `q4_1` as the model package ships it, or `bf16` converted once
    from the directory llm_inflight loads (the same weights and dtype as llm_inflight's)."""
    if weights == "q4_1":
        return gguf_dir() / GGUF_FILE
    out = home() / "SmolLM2-135M-Instruct.bf16.gguf"
    if not out.exists():
        source = home() / "src" / "vendor" / "llama.cpp"
        log(f"converting {bundled_dir()} to {out} with llama.cpp's convert_hf_to_gguf.py")
        # The converter imports sentencepiece before it falls back to the model's BPE tokenizer: a
        # target directory of its own keeps it out of the project's environment.
        extra = home() / "convert-deps"
        if not (extra / "sentencepiece").exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(extra),
                            "sentencepiece==0.2.1"], check=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source / "gguf-py"), str(extra)])}
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(bundled_dir()),
                        "--outtype", "bf16", "--outfile", str(out)], check=True, env=env)
    return out


def llama_server(binary: Path, gguf: Path, slots: int, threads: int, context_per_slot: int,
                 log_file: Path, prompt_cache: bool = True) -> PeerServer:
    """`gguf` with `slots` parallel sequences, `threads` threads for decode and for prompts.
    By default llama-server reuses the KV of prompts it has seen (per slot and in a host-RAM cache);
    `prompt_cache=False` turns both off, so that every prompt is computed, as llm_inflight does."""
    no_cache = [] if prompt_cache else ["--no-cache-prompt", "--cache-ram", "0"]
    return PeerServer("llama.cpp", [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
        "-np", str(slots), "-c", str(slots * context_per_slot), "-t", str(threads), "-tb", str(threads),
        "--no-webui", *no_cache], log_file, ready_timeout=120)
