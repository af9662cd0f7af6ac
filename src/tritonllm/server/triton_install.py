"""Where the tritonserver binary comes from: the nvidia-pytriton wheel, or an installed Triton.

The wheel ships a real ``tritonserver`` binary, the Python backend and one backend stub per Python
version (see ../shared/DESIGN.md section 5). This module copies that tree into a cache dir, picks
the stub for the running interpreter, and makes the environment in which the stub finds the right
libpython and this virtualenv's packages.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
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
