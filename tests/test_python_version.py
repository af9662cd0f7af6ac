"""The code runs on Python 3.10, the Python of the NGC Triton 24.10 image (docker-compose.yml):
a static check with vermin over everything that image would import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_code_needs_no_python_newer_than_3_10():
    vermin = Path(sys.executable).parent / "vermin"  # its console script (the package has no __main__)
    proc = subprocess.run([str(vermin), "--target=3.10-", "--violations", "--no-tips",
                           "--eval-annotations", "src", "client", "loadtest", "model_repository", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Minimum required versions" in proc.stdout  # it analysed the files
