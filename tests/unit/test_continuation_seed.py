"""``continuation_seed``: a resumed request's vLLM seed is a function of (seed, resumed) alone.

Every rollout worker that resumes a migrated request must draw the same seed, so the value may not
depend on anything that differs between processes (``hash()`` of a str under ``PYTHONHASHSEED``,
``id()``, the time).  Checked across fresh interpreters with different hash seeds.  The module
imports vLLM lazily, so this runs in the core suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rolloutpipe.engines.vllm_engine import continuation_seed
from tests.support.config import ROOT

PAIRS = [(7, 0), (7, 24), (-1, 1), (0, 2), (2**70, 24), (123456789, 3)]
CHILD = """
import json, sys
from rolloutpipe.engines.vllm_engine import continuation_seed
pairs = json.loads(sys.argv[1])
print(json.dumps({"seeds": [continuation_seed(s, n) for s, n in pairs], "hash": hash("rolloutpipe")}))
"""


def test_continuation_seed() -> None:
    assert continuation_seed(7, 0) == 7  # segment 0: the request's own seed
    seeds = {continuation_seed(s, n) for s in (-1, 0, 7, 2**70) for n in (1, 2, 24)}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)


def test_every_process_draws_the_same_continuation_seed() -> None:
    """Fresh interpreters with different ``PYTHONHASHSEED`` compute the parent's seeds."""
    parent = [continuation_seed(s, n) for s, n in PAIRS]
    hashes = set()
    for hash_seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        p = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(PAIRS)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]
        got = json.loads(p.stdout)
        assert got["seeds"] == parent, (hash_seed, got["seeds"], parent)
        hashes.add(got["hash"])
    assert len(hashes) == 3  # the children really hashed differently: the check is not vacuous
