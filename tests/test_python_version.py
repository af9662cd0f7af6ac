"""The code and its pinned dependencies run on Python 3.10, the Python of the NGC Triton 24.10
image (docker-compose.gpu.yml): vermin over everything that image would import, and the
pins' own Requires-Python."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import metadata, requires, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent


def test_code_needs_no_python_newer_than_3_10():
    vermin = Path(sys.executable).parent / "vermin"  # its console script (the package has no __main__)
    proc = subprocess.run([str(vermin), "--target=3.10-", "--violations", "--no-tips",
                           "--eval-annotations", "src", "client", "loadtest", "model_repository", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Minimum required versions" in proc.stdout  # it analysed the files


def _pins() -> list[str]:
    """Every `name==version` the images install: the project's dependencies, the load test's
    requirements and the bundled model's package."""
    deps = [r for r in requires("tritonllm") if "extra ==" not in r]  # pyproject's, as installed
    for extra in ("loadtest/requirements.txt", "deploy/model-requirements.txt"):
        deps += [line.split("#")[0].strip() for line in (ROOT / extra).read_text().splitlines()]
    return sorted({d for d in deps if "==" in d})


def test_every_pinned_dependency_supports_python_3_10():
    """A release that needs Python 3.11 cannot install into NGC 24.10's Python 3.10 (transformers
    5.21+, locust 2.46.1+ and matplotlib 3.11 do). Read from the installed packages' metadata, which
    must be the pinned versions."""
    pins = _pins()
    assert len(pins) >= 10, pins
    too_new = []
    for pin in pins:
        req = Requirement(pin)
        assert req.specifier.contains(version(req.name)), f"{req.name} {version(req.name)} installed, {pin} pinned"
        requires = metadata(req.name).get("Requires-Python") or ""
        if not SpecifierSet(requires).contains("3.10.16"):
            too_new.append(f"{pin} (Requires-Python {requires})")
    assert not too_new, "pins that need a newer Python than 3.10: " + ", ".join(too_new)
