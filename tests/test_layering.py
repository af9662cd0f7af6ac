"""The rooms of the code and the one direction of their imports (docs/architecture.md): the engine
knows nothing of Triton, the serving layers nothing of load tests, and nothing imports the
benchmarks. Every import counts, at the top of a module or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"tritonllm": ROOT / "src" / "tritonllm", "tritonllm_client": ROOT / "client",
            "tritonllm_loadtest": ROOT / "loadtest"}
SHARED = {"tritonllm", "tritonllm.contract", "tritonllm.errors", "tritonllm.metric_names",
          "tritonllm.model_files"}  # names, paths and the request contract: no torch
# Each room and the rooms it may import (besides itself and SHARED), lowest first.
MAY_IMPORT = {
    "tritonllm.kernels": set(),
    "tritonllm.engine": {"tritonllm.kernels"},
    "tritonllm_client": set(),
    "tritonllm.triton": {"tritonllm.engine", "tritonllm.kernels"},
    "tritonllm.openai": {"tritonllm.engine", "tritonllm_client"},
    "tritonllm.server": set(),
    "tritonllm.provision": set(),
    "tritonllm_loadtest": {"tritonllm_client", "tritonllm.server", "tritonllm.kernels"},
    "tritonllm.capacity": {"tritonllm_loadtest", "tritonllm.server", "tritonllm.engine", "tritonllm.kernels"},
    "tritonllm.bench": {"tritonllm_loadtest", "tritonllm.capacity", "tritonllm.server", "tritonllm.openai",
                        "tritonllm.triton", "tritonllm.engine", "tritonllm.kernels", "tritonllm_client"},
}


def room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "tritonllm" and len(parts) > 1 else parts[0]


def modules():
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            yield ".".join(p for p in parts if p != "__init__"), path


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_the_rooms_form_no_loop():
    placed, left = [], dict(MAY_IMPORT)
    while left:
        ready = [r for r, below in left.items() if below <= set(placed)]
        assert ready, f"a loop among {sorted(left)}"
        placed += ready
        for r in ready:
            del left[r]


def test_every_module_is_in_a_room():
    rooms = {room(m) for m, _ in modules()} - SHARED
    assert rooms <= set(MAY_IMPORT), f"rooms without a place in MAY_IMPORT: {sorted(rooms - set(MAY_IMPORT))}"


@pytest.mark.parametrize("module,path", list(modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_no_import_goes_up_or_sideways(module, path):
    mine = room(module)
    allowed = MAY_IMPORT.get(mine, set()) | SHARED | {mine}
    bad = sorted({name for name in imports(path) if name.split(".")[0] in PACKAGES and room(name) not in allowed})
    assert not bad, f"{module} ({mine}) imports {bad}: outside what {mine} may import"


def test_the_shared_modules_import_no_room():
    for module, path in modules():
        if module in SHARED:
            inner = {room(name) for name in imports(path) if name.split(".")[0] in PACKAGES}
            assert inner <= SHARED, f"{module} imports {sorted(inner - SHARED)}"
