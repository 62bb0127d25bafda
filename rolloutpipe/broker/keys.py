"""The key schema of a run: the name of every stream, key and consumer group, defined once here.

Every key of a run lives under ``rp:{run}:`` (one Redis Cluster slot per run); a shared rollout
pool's under ``rp:{pool:NAME}:``.  Other modules import these names (``Keys``, ``Groups``, ``DATA``)
instead of spelling them; ``tests/unit/test_wire_doc.py`` checks docs/architecture.md's key table
against ``Keys``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, cast

import redis
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.crc import key_slot

from rolloutpipe.broker.connect import is_cluster
from rolloutpipe.errors import CrossSlotError

DATA = b"d"  # the one field of every stream entry: the event's msgpack bytes
# the streams of a run (attributes of ``Keys``), as ``rolloutpipe tail`` and ``status`` name them
STREAMS = ("requests", "samples", "groups", "control", "feedback", "dlq")
POOL_STREAMS = ("leases",)  # a shared pool's (``--run pool:NAME``): every change of a worker's run


class Groups:
    """Consumer-group names: the role that must acknowledge each stream's entries."""

    ROLLOUT = "rollout"  # requests
    AGGREGATOR = "aggregator"  # samples (and allocations)
    TRAINER = "trainer"  # groups (and seals)
    CONTROLLER = "controller"  # control (audit) and feedback


class Keys:
    """Names of every stream and key of one run."""

    def __init__(self, run: str) -> None:
        if not run:  # ``rp:{}:`` is no hash tag: Redis Cluster would spread the run over every slot
            raise ValueError("a run needs a non-empty name")
        self.run = run
        p = f"rp:{{{run}}}:"  # the braces are a Redis Cluster hash tag: one slot per run
        self.prefix = p
        self.slot = key_slot(p.encode())  # every key of the run hashes here (``{run}``)
        self.requests = p + "requests"
        self.samples = p + "samples"
        self.groups = p + "groups"
        self.control = p + "control"
        self.dlq = p + "dlq"
        self.dlq_replayed = p + "dlq:replayed"  # dead-letter id -> where ``rolloutpipe dlq replay`` put it
        self.version = p + "version"
        self.feedback = p + "feedback"  # GroupStats: aggregator -> controller
        self.stats = p + "stats"
        self.done = p + "done"
        self.prompt_history = p + "prompt_history"  # prompt index -> recent PromptRecords (JSON)
        self.prompt_cursor = p + "prompt_cursor"  # "step:position": where step ``step`` starts in the dataset
        self.step_rollouts = p + "step_rollouts"  # hash: step -> requests it released (``max_rollouts``)
        self.workers = p + "workers"  # rollout worker ids, scored by their heartbeat's expiry time
        self.sample_shards = p + "sample_shards"  # the run's number of samples streams
        # A shared rollout pool's namespace is that of the pseudo-run ``pool:NAME`` (``PoolKeys``):
        self.lease = p + "lease"  # hash: worker id -> the run it serves (the pool scheduler's)
        self.leases = p + "leases"  # stream: ``lease`` events, each change of a worker's run

    def samples_shard(self, i: int) -> str:
        """Samples stream ``i`` of a run split across aggregators: ``samples``, ``samples:1``, …"""
        return self.samples if i == 0 else f"{self.samples}:{i}"

    def sample_streams(self, shards: int) -> list[str]:
        return [self.samples_shard(i) for i in range(max(1, shards))]

    def plan(self, step: int) -> str:
        return f"{self.prefix}plan:{step}"

    def emitted(self, step: int) -> str:
        """Set of group ids already written to ``groups`` for a step (exactly-once)."""
        return f"{self.prefix}emitted:{step}"

    def released(self, step: int) -> str:
        return f"{self.prefix}released:{step}"

    def finished(self, step: int) -> str:
        """Counter of requests of a step whose sample was published (or that a worker dropped)."""
        return f"{self.prefix}finished:{step}"

    def finished_ids(self, step: int) -> str:
        """Set of the ``requests`` entry ids counted in ``finished:k`` (each request counts once)."""
        return f"{self.prefix}finished:{step}:ids"

    def ops(self, step: int) -> str:
        """Hash token -> result of the writes of a step already applied (``ONCE_LUA``)."""
        return f"{self.prefix}ops:{step}"

    def op(self, token: str) -> str:
        """The record of one applied write that has no step (it expires: ``OP_TTL_S``)."""
        return f"{self.prefix}op:{token}"

    def consumed(self, step: int) -> str:
        return f"{self.prefix}consumed:{step}"

    def released_ids(self, step: int) -> str:
        """Set of the request ids of a step already on ``requests`` (the controller's restart record)."""
        return f"{self.prefix}released:{step}:ids"

    def alloc(self, step: int) -> str:
        """Hash group id -> the latest ``Allocation`` of a group that was not final at plan time."""
        return f"{self.prefix}alloc:{step}"

    def closed(self, step: int) -> str:
        """Set of group ids closed or skipped: their outstanding requests are aborted."""
        return f"{self.prefix}closed:{step}"

    def migrated(self, step: int) -> str:
        """Set of the ``requests`` entry ids of step k that were preempted and put back as a
        continuation (each entry at most once: ``Broker.migrate``)."""
        return f"{self.prefix}migrated:{step}"

    def tool_calls(self, step: int) -> str:
        """Hash ``<request origin>:<call index>`` -> the results an episode's call got (JSON), so
        a redone episode replays them instead of calling its tools again (``engines/episode.py``)."""
        return f"{self.prefix}toolcalls:{step}"

    def step_keys(self, step: int) -> list[str]:
        """Every per-step key (trimmed once the step is old)."""
        return [self.plan(step), self.emitted(step), self.released(step), self.released_ids(step),
                self.finished(step), self.finished_ids(step), self.consumed(step), self.alloc(step),
                self.closed(step), self.ops(step), self.migrated(step), self.tool_calls(step)]  # fmt: skip

    def heartbeat(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}"


def pool_keys(pool: str) -> Keys:
    """The keys of shared rollout pool ``pool``: those of the pseudo-run ``pool:NAME``, in a slot
    of their own (``rp:{pool:NAME}:…``).  Its ``workers`` and ``worker:{id}`` are the pool's
    members, ``lease`` says which run each serves and ``leases`` logs every change.  No write
    touches a pool key and a run key at once (docs/architecture.md, "Shared rollout pools")."""
    return Keys(f"pool:{pool}")


def one_slot(keys: Keys, names: Sequence[str]) -> None:
    """Raise ``CrossSlotError`` unless every key is the run's (``rp:{run}:…``, so in its one slot).

    A script or MULTI runs on one Redis Cluster node, so all its keys must hash to one slot; the
    run's hash tag puts every key of ``Keys`` there.  ``tests/e2e/test_cluster.py`` checks the slot of
    every key each Broker write touches.
    """
    bad = [n for n in names if not n.startswith(keys.prefix)]
    if bad:
        raise CrossSlotError(f"keys outside run {keys.run!r} (slot {keys.slot}) in one write: {bad[:5]}")


def shard_of(group_id: str, shards: int) -> int:
    """The samples shard of a group: CRC-32 of its id mod ``shards`` (the same in every process and
    host, unlike ``hash``), so every sample and allocation of a group meets in one aggregator."""
    return zlib.crc32(group_id.encode()) % shards if shards > 1 else 0


def run_keys(r: redis.Redis, keys: Keys, match: str, count: int = 1000) -> list[str]:
    """The names of the run's keys that match ``match`` (a glob under ``rp:{run}:``).

    One server: SCAN.  A cluster: SCAN of the one master that owns the run's slot, never of every
    node (a run's keys all live there).
    """
    if not match.startswith(keys.prefix):
        raise CrossSlotError(f"{match!r} is not a pattern of run {keys.run!r}")
    if is_cluster(r):
        node = cast(SyncRedisCluster, r).get_node_from_key(keys.prefix)  # type: ignore[no-untyped-call]
        found = r.scan_iter(match=match, count=count, target_nodes=node)
    else:
        found = r.scan_iter(match=match, count=count)
    return [as_str(k) for k in found]


def as_str(v: Any) -> str:
    """A Redis reply (a key name, an entry id, a member) as ``str``."""
    return v.decode() if isinstance(v, bytes) else str(v)


def as_bytes(v: bytes | str) -> bytes:
    return v if isinstance(v, bytes) else v.encode()
