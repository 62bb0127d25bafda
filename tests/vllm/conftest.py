"""Collected only where vllm imports; under its script (RP_SUITE=vllm) a missing vllm is an error."""

from tests.support.config import engine_suite

collect_ignore_glob = engine_suite("vllm")
