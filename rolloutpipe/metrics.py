"""Prometheus metrics of one role process: ``rolloutpipe_*``, base units, low-cardinality labels.

Each role serves ``/metrics`` on ``metrics.port`` when it is set (``rolloutpipe run`` gives role
``i`` the port ``metrics.port + i``; in compose every container uses the same port).  Labels are
the role (``controller``, ``rollout``, ``aggregator``, ``trainer``) and, for broker counters, the
counter's name, a fixed set; never a run, step, group or worker id.  The process collector adds
``process_resident_memory_bytes`` and friends.

Metrics are defined once per process at import, outside any registry, and counted in memory
(cheap), so roles update them unconditionally.  :func:`serve` registers the ones that belong to
its role (``ROLE_METRICS``), so a scrape shows no series that stay zero in that process.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from rolloutpipe.errors import ConfigError

log = logging.getLogger("rolloutpipe.metrics")

_LATENCY = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_LONG = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

SAMPLES = Counter(
    "rolloutpipe_samples", "Samples published (rollout) or consumed (aggregator)", ["role"], registry=None
)
GROUPS = Counter(
    "rolloutpipe_groups", "Groups emitted (aggregator) or trained on (trainer)", ["role"], registry=None
)
REQUESTS_RELEASED = Counter(
    "rolloutpipe_requests_released", "Rollout requests released by the controller", registry=None
)
FENCE_REJECTIONS = Counter(
    "rolloutpipe_fence_rejections",
    "Requests, samples or groups refused for a stale policy version",
    ["role"],
    registry=None,
)
DEAD_LETTERS = Counter(
    "rolloutpipe_dead_letters", "Entries written to the dlq stream", ["role"], registry=None
)
BROKER_EVENTS = Counter(
    "rolloutpipe_broker_events",
    "Counters of the run's stats hash incremented here",
    ["role", "event"],
    registry=None,
)
GROUP_DISPATCH = Histogram(
    "rolloutpipe_group_dispatch_seconds",
    "From a group's last sample finishing to the trainer reading the group",
    buckets=_LATENCY,
    registry=None,
)
GENERATION = Histogram(
    "rolloutpipe_generation_seconds",
    "From a request's admission to its sample's completion",
    buckets=_LONG,
    registry=None,
)
WEIGHT_LOAD = Histogram(
    "rolloutpipe_weight_load_seconds", "Verify and load a policy version", buckets=_LONG, registry=None
)
INFLIGHT = Gauge("rolloutpipe_inflight_requests", "Requests this rollout worker is generating", registry=None)
POLICY_VERSION = Gauge(
    "rolloutpipe_policy_version", "Policy version this process is on", ["role"], registry=None
)
STEP = Gauge("rolloutpipe_step", "Step this process is working on", ["role"], registry=None)
WAIT_RATIO = Gauge(
    "rolloutpipe_trainer_wait_ratio", "Trainer idle share of the last step's window", registry=None
)
ROLLOUT_TO_TRAIN_END = Gauge(
    "rolloutpipe_rollout_to_train_end_seconds",
    "Last step: first admission to the end of training",
    registry=None,
)
FIRST_GROUP = Gauge(
    "rolloutpipe_first_group_seconds", "Last step: first admission to the first group read", registry=None
)
REWARD_MEAN = Gauge("rolloutpipe_reward_mean", "Last step's mean reward", registry=None)
TRAIN_BUSY = Counter("rolloutpipe_trainer_busy_seconds", "Seconds the trainer spent computing", registry=None)
TOKENS = Counter("rolloutpipe_trained_tokens", "Response tokens trained on", registry=None)
GROUPS_SKIPPED = Counter(
    "rolloutpipe_groups_skipped",
    "Groups the allocation policy skipped (counted at the step's commit)",
    registry=None,
)
SAMPLES_WASTED = Counter(
    "rolloutpipe_samples_wasted",
    "Rollouts released but not trained: skipped pilots, dropped groups, aborted extras",
    registry=None,
)
EVAL_REWARD = Gauge(
    "rolloutpipe_eval_reward", "Held-out reward of the latest evaluated version", registry=None
)
POOL_SHARE = Gauge(
    "rolloutpipe_pool_share_workers", "Workers of the shared pool leased to each run", ["run"], registry=None
)
POOL_SWITCHES = Counter(
    "rolloutpipe_pool_switches", "Times this pool worker changed the run it serves", registry=None
)

ROLE_METRICS: dict[str, tuple[Any, ...]] = {
    "controller": (REQUESTS_RELEASED, STEP, DEAD_LETTERS, BROKER_EVENTS),
    "rollout": (
        SAMPLES, GENERATION, WEIGHT_LOAD, INFLIGHT, POLICY_VERSION, STEP, FENCE_REJECTIONS, DEAD_LETTERS,
        BROKER_EVENTS, POOL_SWITCHES,
    ),
    "pool": (POOL_SHARE,),
    "aggregator": (SAMPLES, GROUPS, STEP, FENCE_REJECTIONS, DEAD_LETTERS, BROKER_EVENTS),
    "trainer": (
        GROUPS, GROUP_DISPATCH, WAIT_RATIO, ROLLOUT_TO_TRAIN_END, FIRST_GROUP, REWARD_MEAN, TRAIN_BUSY,
        TOKENS, GROUPS_SKIPPED, SAMPLES_WASTED, EVAL_REWARD, POLICY_VERSION, STEP, FENCE_REJECTIONS,
        DEAD_LETTERS, BROKER_EVENTS,
    ),
}  # fmt: skip
_BY_ROLE = (SAMPLES, GROUPS, FENCE_REJECTIONS, DEAD_LETTERS, POLICY_VERSION, STEP)  # label: role only
_served: dict[int, str] = {}
_registered: set[int] = set()


def serve(port: int, host: str = "0.0.0.0", role: str = "") -> None:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread (idempotent per port)."""
    if port <= 0 or port in _served:
        return
    for m in ROLE_METRICS.get(role, ()):
        if id(m) not in _registered:
            REGISTRY.register(m)
            _registered.add(id(m))
        if any(m is x for x in _BY_ROLE):
            m.labels(role)  # the role's series exists (at 0) from the first scrape
    try:
        start_http_server(port, addr=host)
    except OSError as e:  # a taken port is a configuration error, said plainly
        raise ConfigError(f"metrics.port {port} on {host}: {e.strerror or e}") from e
    _served[port] = role
    log.info("%s: Prometheus metrics on http://%s:%d/metrics", role or "process", host, port)
