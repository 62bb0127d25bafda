#!/usr/bin/env bash
# docker-compose.yml run for real (tests/docker): the images built, the cpu profile up in
# containers with three rollout replicas, a rollout container killed mid-run, exactly-once checked
# from the trainer's committed-group log.  Minutes, so it is a stage of its own after the core suite.
#
#   scripts/test-compose.sh [PYTEST ARGS...]
#
# Needs the docker CLI, docker-compose (Debian's v1 works) and a Docker engine: the test uses the
# one that is running, else starts dockerd (root) and stops it by its PID.  No registry: it builds
# the Debian base image (scripts/docker-base.sh, needs debootstrap) and takes the CPU torch wheel
# from pip's own wheel source.  Outside CI without an engine the test skips and says why; under
# CI=true that is a failure (tests/conftest.py).  Caches nothing outside the clone but Docker's own
# image store (docker/wheels/*.whl is git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
RP_SUITE=docker exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -s tests/docker "$@"
