#!/bin/sh
# pip install inside an image build: from the wheelhouse when the build context carries one
# (deploy/docker/wheels/, made by make-wheelhouse.sh: air-gapped), else from the package index.
set -e
if ls /tmp/wheels/*.whl >/dev/null 2>&1; then
  set -- --no-index --find-links /tmp/wheels "$@"
fi
exec python3 -m pip install --no-cache-dir --disable-pip-version-check "$@"
