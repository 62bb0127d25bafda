#!/usr/bin/env bash
# A local base image for docker/Dockerfile.cpu and the compose Redis, built from Debian's packages
# with debootstrap: for hosts that cannot pull `python:3.11-slim` or `redis:7.2` from a registry.
#
#   scripts/docker-base.sh [IMAGE]      (default rolloutpipe-base:bookworm; needs root, debootstrap)
#   DEBIAN_MIRROR   the apt mirror (default http://deb.debian.org/debian)
#   FORCE=1         rebuild even when IMAGE exists
#   CA_BUNDLE       the CA bundle the image trusts (default this host's /etc/ssl/certs/ca-certificates.crt)
#
# Then build and run with it (README, "Scaling out"; docs/operations.md):
#   RP_BASE_IMAGE=rolloutpipe-base:bookworm RP_REDIS_IMAGE=rolloutpipe-base:bookworm ...
#
# bookworm's python3 is 3.11 (the package needs >= 3.11) and its redis-server 7.0 (the ACLs need
# >= 7).  The image trusts what this host trusts: the host's CA bundle replaces the image's, so pip
# works inside a build behind a TLS-intercepting egress proxy.  Idempotent: an existing IMAGE is
# kept (Docker's own image store is the only cache).
set -euo pipefail
IMAGE=${1:-rolloutpipe-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

if [[ -z "${FORCE:-}" ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "docker-base: $IMAGE exists (FORCE=1 rebuilds it)" >&2
  exit 0
fi
command -v debootstrap >/dev/null || { echo "docker-base: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
[[ $(id -u) == 0 ]] || { echo "docker-base: debootstrap needs root" >&2; exit 1; }

start=$(date +%s)
root=$(mktemp -d /tmp/rp-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase \
  --include=python3,python3-venv,python3-pip,redis-server,ca-certificates \
  bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
  || { tail -30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
[[ -f "$CA" ]] && cp "$CA" "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["/bin/bash"]' \
  - "$IMAGE" >/dev/null
echo "docker-base: built $IMAGE in $(($(date +%s) - start)) s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%d MB", $1/1e6}'))" >&2
