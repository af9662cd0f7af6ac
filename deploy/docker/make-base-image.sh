#!/usr/bin/env bash
# Make the CPU base image locally, from Debian's packages only (no container registry needed):
# debootstrap a minimal bookworm with Python 3.11, then `docker import` it.
#
#   deploy/docker/make-base-image.sh            # prints the image name it made or found
#
# The tag carries a hash of this script, so an unchanged script reuses the image in seconds.
# TRITONLLM_DEBIAN_MIRROR picks the mirror (default: deb.debian.org).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
name=${TRITONLLM_BASE_NAME:-tritonllm-base}
hash=$(sha256sum "$here/make-base-image.sh" | cut -c1-12)
image="$name:bookworm-$hash"
docker=${DOCKER:-docker}

if "$docker" image inspect "$image" >/dev/null 2>&1; then
  echo "$image"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }

# python3-pip: pip for the image build; libpython3.11: the Triton Python backend stub links it;
# libexpat1, libstdc++6, zlib1g: tritonserver's own libraries; curl: the healthcheck.
packages=python3,python3-pip,libpython3.11,libexpat1,libstdc++6,zlib1g,curl,ca-certificates
root=$(mktemp -d /tmp/tritonllm-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include="$packages" bookworm "$root" \
  "${TRITONLLM_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >&2
# Leave no package lists or caches in the image.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | "$docker" import \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$image" >&2
"$docker" tag "$image" "$name:bookworm"
echo "$image"
