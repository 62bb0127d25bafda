"""Prometheus metrics of one role process: ``rolloutpipe_*``, base units, low-cardinality labels.

Each role serves ``/metrics`` on ``metrics.port`` when it is set (``rolloutpipe run`` gives role
``i`` the port ``metrics.port + i``; in compose every container uses the same port).  Labels are
the role (``controller``, ``rollout``, ``aggregator``, ``trainer``) and, for broker counters, the
counter's name, a fixed set; never a run, step, group or worker id.  The process collector adds
``process_resident_memory_bytes`` and friends.

Metrics are defined once per process at import; until :func:`serve` is called they are only
counted in memory (cheap), so roles update them unconditionally.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("rolloutpipe.metrics")

_LATENCY = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_LONG = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

SAMPLES = Counter("rolloutpipe_samples", "Samples published (rollout) or consumed (aggregator)", ["role"])
GROUPS = Counter("rolloutpipe_groups", "Groups emitted (aggregator) or trained on (trainer)", ["role"])
REQUESTS_RELEASED = Counter("rolloutpipe_requests_released", "Rollout requests released by the controller")
FENCE_REJECTIONS = Counter(
    "rolloutpipe_fence_rejections", "Requests, samples or groups refused for a stale policy version", ["role"]
)
DEAD_LETTERS = Counter("rolloutpipe_dead_letters", "Entries written to the dlq stream", ["role"])
BROKER_EVENTS = Counter(
    "rolloutpipe_broker_events", "Counters of the run's stats hash incremented here", ["role", "event"]
)
GROUP_DISPATCH = Histogram(
    "rolloutpipe_group_dispatch_seconds",
    "From a group's last sample finishing to the trainer reading the group",
    buckets=_LATENCY,
)
GENERATION = Histogram(
    "rolloutpipe_generation_seconds", "From a request's admission to its sample's completion", buckets=_LONG
)
WEIGHT_LOAD = Histogram("rolloutpipe_weight_load_seconds", "Verify and load a policy version", buckets=_LONG)
INFLIGHT = Gauge("rolloutpipe_inflight_requests", "Requests this rollout worker is generating")
POLICY_VERSION = Gauge("rolloutpipe_policy_version", "Policy version this process is on", ["role"])
STEP = Gauge("rolloutpipe_step", "Step this process is working on", ["role"])
WAIT_RATIO = Gauge("rolloutpipe_trainer_wait_ratio", "Trainer idle share of the last step's window")
ROLLOUT_TO_TRAIN_END = Gauge(
    "rolloutpipe_rollout_to_train_end_seconds", "Last step: first admission to the end of training"
)
FIRST_GROUP = Gauge("rolloutpipe_first_group_seconds", "Last step: first admission to the first group read")
REWARD_MEAN = Gauge("rolloutpipe_reward_mean", "Last step's mean reward")
TRAIN_BUSY = Counter("rolloutpipe_trainer_busy_seconds", "Seconds the trainer spent computing")
TOKENS = Counter("rolloutpipe_trained_tokens", "Response tokens trained on")

_served: dict[int, str] = {}


def serve(port: int, host: str = "0.0.0.0", role: str = "") -> None:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread (idempotent per port)."""
    if port <= 0 or port in _served:
        return
    start_http_server(port, addr=host)
    _served[port] = role
    log.info("%s: Prometheus metrics on http://%s:%d/metrics", role or "process", host, port)
