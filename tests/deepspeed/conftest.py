"""Collected only where deepspeed imports; under RP_SUITE=deepspeed a missing deepspeed is an error."""

from tests.support.config import engine_suite

collect_ignore_glob = engine_suite("deepspeed")
