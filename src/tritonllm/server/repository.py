"""A model repository's settings: read from its config.pbtxt files, and copies of the shipped one with some
models' settings changed (benchmarks)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tritonllm.server.tritonserver import DEFAULT_MODEL_REPOSITORY


def configured_repository(dest: Path, models: dict[str, dict[str, str]], sources: dict[str, str] | None = None) -> Path:
    """A copy of model_repository/ with only `models`, each config.pbtxt given its settings:
    {parameter: value}, added where the file has none; `max_batch_size` and `preferred_batch_size`
    set those fields. `sources`: {model: shipped model it is a copy of}, for a model under another name."""
    for model, settings in models.items():
        source = (sources or {}).get(model, model)
        shutil.copytree(DEFAULT_MODEL_REPOSITORY / source, dest / model, ignore=shutil.ignore_patterns("__pycache__"))
        config = dest / model / "config.pbtxt"
        text = config.read_text()
        for key, value in settings.items():
            if key in ("max_batch_size", "preferred_batch_size"):
                pattern = r"(?m)^max_batch_size: \d+" if key == "max_batch_size" else r"preferred_batch_size: \[ \d+ \]"
                field = f"max_batch_size: {int(value)}" if key == "max_batch_size" else f"preferred_batch_size: [ {int(value)} ]"
                text, n = re.subn(pattern, field, text)
                if n != 1:
                    raise ValueError(f"{config}: no {key} field")
                continue
            text, n = re.subn(rf'(key: "{re.escape(key)}", value: {{ string_value: ")[^"]*', rf"\g<1>{value}", text)
            if n == 0:
                text += f'parameters {{ key: "{key}", value: {{ string_value: "{value}" }} }}\n'
        config.write_text(text)
    return dest


def read_config(model: str, repository: Path = DEFAULT_MODEL_REPOSITORY) -> tuple[str, dict]:
    """(text of config.pbtxt, its string parameters)."""
    text = (repository / model / "config.pbtxt").read_text()
    params = dict(re.findall(r'key:\s*"(\w+)",\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text))
    return text, params
