#!/usr/bin/env bash
# The DeepSpeed trainer's tests (tests/deepspeed: 2 processes under torchrun, CPU, gloo), in a
# virtualenv of their own: deepspeed is not a core dependency.  Idempotent: the venv is rebuilt
# only when pyproject.toml, this script or the DeepSpeed spec change.
#
#   scripts/test-deepspeed.sh [PYTEST ARGS...]
#   DS_VENV   where to build it (default .venv-ds, git-ignored by .venv-*/)
#   DS_SPEC   the DeepSpeed distribution (default deepspeed==0.19.8: managed_gradient_accumulation)
#   PYTHON    the interpreter to build it from (default python3, 3.11+)
#
# torch==2.13.0 goes in first so that pip keeps the CPU wheel instead of pulling a CUDA build.
# DeepSpeed installs with no compiled ops and picks its CPU accelerator; its first run JIT-compiles
# a small shared-memory op into ~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR), once.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${DS_VENV:-.venv-ds}
SPEC=${DS_SPEC:-deepspeed==0.19.8}
PY=${PYTHON:-python3}
STAMP="$VENV/.installed"
KEY="$SPEC $(cat pyproject.toml scripts/test-deepspeed.sh | sha256sum | cut -c1-16)"

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$KEY" ]]; then
  start=$(date +%s)
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[dev]' "$SPEC"
  echo "$KEY" >"$STAMP"
  echo "built $VENV in $(($(date +%s) - start)) s" >&2
fi

# RP_SUITE: a deepspeed that does not import in this venv fails the run (tests/support/config.py engine_suite)
RP_SUITE=deepspeed exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/deepspeed "$@"
