#!/usr/bin/env bash
# Make the wheelhouse the CPU image installs from (pip cannot reach an index inside the build
# here, as on air-gapped sites): every wheel the project, the load test and the bundled model
# need, for this machine's Python (it must match the base image's: 3.11 for bookworm).
#
#   deploy/docker/make-wheelhouse.sh DEST       # fills DEST/ (hard links into a cache)
#
# Cached by a hash of the pins and this script under $TRITONLLM_CACHE (default ~/.cache/tritonllm).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
dest=${1:?usage: make-wheelhouse.sh DEST}
py=${PYTHON:-python3}
inputs=("$repo/pyproject.toml" "$repo/loadtest/requirements.txt" "$repo/deploy/model-requirements.txt" "$0")
hash=$( (cat "${inputs[@]}"; "$py" -c 'import sys; print(sys.version_info[:2])') | sha256sum | cut -c1-12)
cache="${TRITONLLM_CACHE:-$HOME/.cache/tritonllm}/wheelhouse-$hash"

if [ ! -f "$cache/.complete" ]; then
  tmp=$(mktemp -d "${cache}.tmp-XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  # The project's dependencies (and the build backend it needs), without the project itself:
  # its source goes into the image separately.
  "$py" -m pip wheel -q --wheel-dir "$tmp" "$repo" -r "$repo/loadtest/requirements.txt" "setuptools>=68" wheel >&2
  rm -f "$tmp"/tritonllm-*.whl
  "$py" -m pip download -q --no-deps --dest "$tmp" -r "$repo/deploy/model-requirements.txt" >&2
  touch "$tmp/.complete"
  rm -rf "$cache"
  mv "$tmp" "$cache"
  trap - EXIT
fi
mkdir -p "$dest"
find "$dest" -maxdepth 1 \( -name '*.whl' -o -name '*.tar.gz' \) -delete
cp -l "$cache"/* "$dest"/ 2>/dev/null || cp "$cache"/* "$dest"/
echo "$cache"
