"""A random rollout workload for the oracle's tests: groups of (prompt, response) token counts
whose lengths share a per-prompt factor, as the paper suite's length model does."""

from __future__ import annotations

import numpy as np


def workload(seed: int, n: int = 12, g: int = 4, prompt: int = 20) -> list[list[tuple[int, int]]]:
    r = np.random.default_rng(seed)
    share = r.uniform(0.2, 0.8)
    zp = r.standard_normal(n)[:, None]
    z = np.sqrt(share) * zp + np.sqrt(1 - share) * r.standard_normal((n, g))
    L = np.clip(np.round(np.exp(np.log(200) + 0.8 * z)), 1, 2000).astype(int)
    return [[(prompt, int(x)) for x in row] for row in L]
