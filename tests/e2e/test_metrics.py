"""Prometheus ``/metrics``: every role of a live run serves its ``rolloutpipe_*`` metrics."""

from __future__ import annotations

import random
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

from rolloutpipe.launch.cluster import run_cluster
from tests.support.config import EMULATED_FAST, make_config

# What each role must serve (spawn order of Cluster.start: trainer, aggregator, rollout…, controller).
EXPECTED = {
    "trainer": [
        'rolloutpipe_groups_total{role="trainer"}',
        "rolloutpipe_group_dispatch_seconds_bucket",
        "rolloutpipe_trainer_wait_ratio",
        "rolloutpipe_rollout_to_train_end_seconds",
        'rolloutpipe_policy_version{role="trainer"}',
        "rolloutpipe_groups_skipped_total",
        "rolloutpipe_samples_wasted_total",
        "rolloutpipe_eval_reward",
    ],
    "aggregator": [
        'rolloutpipe_samples_total{role="aggregator"}',
        'rolloutpipe_groups_total{role="aggregator"}',
    ],
    "rollout": [
        'rolloutpipe_samples_total{role="rollout"}',
        "rolloutpipe_generation_seconds_count",
        "rolloutpipe_inflight_requests",
    ],
    "controller": ["rolloutpipe_requests_released_total", 'rolloutpipe_step{role="controller"}'],
}


def _free_port_block(n: int) -> int:
    """A base port with ``n`` free ports above it, below the kernel's ephemeral range.

    A block picked from the ephemeral range can be taken, between this probe and the roles' own
    bind, as the source port of any outgoing connection (the roles' Redis clients among them).
    """
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768  # Linux's default
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(max(1024, lo // 2), lo - n)
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports")


def _value(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, f"{series} not served"
    return float(m.group(1))


def test_every_role_serves_its_metrics(tmp_path: Path, redis_url: str, run_name: str) -> None:
    base = _free_port_block(5)
    over = ["controller.steps=8", f"metrics.port={base}", "metrics.host=127.0.0.1"]
    cfg = make_config(tmp_path, run_name, *EMULATED_FAST, *over)
    roles = ["trainer", "aggregator", "rollout", "rollout", "controller"]
    scraped: dict[int, str] = {}
    done = threading.Event()

    def scrape() -> None:  # keep the last good page of every port while the run lasts
        while not done.is_set():
            for i in range(len(roles)):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{base + i}/metrics", timeout=1) as r:
                        page = r.read().decode()
                except OSError:
                    continue
                if page:  # a role that is stopping can answer with nothing: that is no page
                    scraped[i] = page
            time.sleep(0.05)

    t = threading.Thread(target=scrape, daemon=True)
    t.start()
    try:
        metrics = run_cluster(cfg, redis_url, tmp_path / run_name, progress=False, timeout_s=240)
    finally:
        done.set()
        t.join()
    assert len(metrics) == 8
    for i, role in enumerate(roles):
        assert i in scraped, f"{role} (port {base + i}) never served /metrics"
        for series in EXPECTED[role]:
            assert series in scraped[i], f"{role} does not serve {series}"
        assert "process_resident_memory_bytes" in scraped[i]
    assert "rolloutpipe_trainer_wait_ratio" not in scraped[4], "each role serves only its own metrics"
    assert "rolloutpipe_requests_released" not in scraped[2]
    # values move: every sample the workers published, the aggregator consumed
    published = sum(_value(scraped[i], 'rolloutpipe_samples_total{role="rollout"}') for i in (2, 3))
    assert published > 0
    assert _value(scraped[0], 'rolloutpipe_groups_total{role="trainer"}') > 0
    assert 0.0 <= _value(scraped[0], "rolloutpipe_trainer_wait_ratio") <= 1.0


def test_a_taken_metrics_port_is_a_clear_config_error() -> None:
    import pytest

    from rolloutpipe import metrics
    from rolloutpipe.errors import ConfigError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"metrics.port {port}"):
            metrics.serve(port, "127.0.0.1", "controller")
