"""Where a benchmark command leaves its figures: results.json (every number) and results.md (the table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(out: Path, data: Any, markdown: str) -> None:
    (out / "results.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "results.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
