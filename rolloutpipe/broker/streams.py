"""The standard Redis-streams recipe, in one small class.

* ``XGROUP CREATE ... MKSTREAM`` tolerating only ``BUSYGROUP``;
* ``XADD`` with an approximate ``MAXLEN`` trim;
* ``XREADGROUP`` with ``BLOCK`` and ``COUNT``;
* ``XAUTOCLAIM`` for entries abandoned by dead consumers;
* ``XACK`` only after the effect is durable (callers decide when).

Every key of a run lives under ``rp:{run}:``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import PipelineCommand
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    MaxConnectionsError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry
from redis.typing import KeyT

from rolloutpipe import metrics
from rolloutpipe.broker.codec import DEFAULT_CODEC, MsgpackCodec
from rolloutpipe.broker.events import (
    Allocation,
    DeadLetter,
    Event,
    Group,
    GroupStats,
    PolicyVersion,
    RolloutRequest,
    Sample,
    StepMetrics,
    StepPlan,
    StepSeal,
)
from rolloutpipe.errors import CodecError, ConfigError, CrossSlotError

log = logging.getLogger("rolloutpipe.broker")

E = TypeVar("E", bound=Event)
T = TypeVar("T")
DATA = b"d"


class Groups:
    """Consumer-group names: the role that must acknowledge each stream's entries."""

    ROLLOUT = "rollout"  # requests
    AGGREGATOR = "aggregator"  # samples (and allocations)
    TRAINER = "trainer"  # groups (and seals)
    CONTROLLER = "controller"  # control (audit) and feedback


# A write applied at most once (issue 15).  redis-py retries a command whose connection dropped
# (``connect``), and Redis may have run it already: the reply, not the command, was lost.  Every
# write that a repeat would change (an XADD, a counter) is one run of this script, with a token of
# its own that a retry sends again:
# KEYS[1]: the record of tokens already applied: the step's ``ops:k`` hash (ARGV[2] == '0'), or,
#   for a write of no step, a key ``op:<token>`` of its own that expires after ARGV[2] seconds;
# ARGV[1]: the token; KEYS[2..]: the key of each command; ARGV[3..]: each command as mode, number
#   of arguments, name, arguments.  Mode 'g' is a guard (SADD, SET NX): if it changes nothing, the
#   write was applied by another call and the commands after it are skipped; mode 'r': its reply
#   is the write's result (else '1'; '0' when a guard skipped the rest).
# A token already recorded returns the recorded result and runs nothing: the repeat is a no-op.
ONCE_LUA = """
local ttl = tonumber(ARGV[2])
local done
if ttl > 0 then done = redis.call('GET', KEYS[1]) else done = redis.call('HGET', KEYS[1], ARGV[1]) end
if done then return done end
local pos, ok, result = 3, true, '1'
for c = 2, #KEYS do
  local mode, n = ARGV[pos], tonumber(ARGV[pos + 1])
  if ok then
    local r = redis.call(ARGV[pos + 2], KEYS[c], unpack(ARGV, pos + 3, pos + 2 + n))
    if mode == 'g' and r ~= 1 and not (type(r) == 'table' and r['ok'] == 'OK') then
      ok, result = false, '0'
    elseif mode == 'r' then
      result = tostring(r)
    end
  end
  pos = pos + 3 + n
end
if ttl > 0 then
  redis.call('SET', KEYS[1], result, 'EX', ttl)
else
  redis.call('HSET', KEYS[1], ARGV[1], result)
end
return result
"""
# Long-tail migration (``Broker.migrate``): a preempted request's continuation onto ``requests``
# in one script run on the run's slot.
#   KEYS: ops:{k}, requests, migrated:{k}, finished:{k}:ids, stats
#   ARGV: token, consumer group, entry (the preempted segment), origin (segment 0's entry),
#         continuation payload, step, tokens carried, maxlen
# The entry is acknowledged whatever happens (its work moves on, or it is done).  The
# continuation goes out only if the request is not finished (``finished:{k}:ids`` lacks its
# origin) and this entry was never migrated before (``SADD migrated:{k}``).  Returns the
# continuation's entry id, or '0' when nothing was put back.  Like ``ONCE_LUA``, a resend with
# the same token returns the first result and changes nothing.
MIGRATE_LUA = """
local done = redis.call('HGET', KEYS[1], ARGV[1])
if done then return done end
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
local result = '0'
if redis.call('SISMEMBER', KEYS[4], ARGV[4]) == 0 and redis.call('SADD', KEYS[3], ARGV[3]) == 1 then
  result = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', 'd', ARGV[5])
  redis.call('HINCRBY', KEYS[5], 'migrations', 1)
  redis.call('HINCRBY', KEYS[5], 'migrations:' .. ARGV[6], 1)
  redis.call('HINCRBY', KEYS[5], 'migrated_tokens', ARGV[7])
  redis.call('HINCRBY', KEYS[5], 'migrated_tokens:' .. ARGV[6], ARGV[7])
end
redis.call('HSET', KEYS[1], ARGV[1], result)
return result
"""
OP_TTL_S = 3600  # a step-less write's token outlives any retry (``connect``: ~30 s) by far
_CHUNK = 1000  # ids per SADD/XACK inside the script (Lua's unpack has a stack limit)


class Once:
    """The commands of one write, applied together and at most once by ``ONCE_LUA``.

    Built like a redis-py pipeline; ``execute`` sends them with a fresh token, and redis-py's
    retries resend that same token, so a repeat of a call whose reply was lost changes nothing.
    Commands before a guard always run; those after it only if the guard changed something.
    """

    def __init__(self, broker: Broker, step: int | None) -> None:
        self.b = broker
        self.token = uuid.uuid4().hex
        k = broker.keys
        if step is not None and step >= 0:
            self.record, self.ttl = k.ops(step), 0
        else:
            self.record, self.ttl = k.op(self.token), OP_TTL_S
        self.keys: list[str] = []
        self.args: list[Any] = []

    def cmd(self, name: str, key: str, *args: Any, mode: str = "") -> Once:
        self.keys.append(key)
        self.args += [mode, len(args), name, *args]
        return self

    def xadd(self, stream: str, payload: bytes, *, mode: str = "") -> Once:
        return self.cmd("XADD", stream, "MAXLEN", "~", self.b.maxlen, "*", DATA, payload, mode=mode)

    def xack(self, stream: str, group: str, ids: Sequence[str]) -> Once:
        for i in range(0, len(ids), _CHUNK):
            self.cmd("XACK", stream, group, *ids[i : i + _CHUNK])
        return self

    def sadd(self, key: str, members: Sequence[str]) -> Once:
        for i in range(0, len(members), _CHUNK):
            self.cmd("SADD", key, *members[i : i + _CHUNK])
        return self

    async def execute(self) -> str:
        """'0' if a guard found the write applied by another call; else '1' or the 'r' command's reply."""
        one_slot(self.b.keys, [self.record, *self.keys])
        r: Any = self.b.r
        if isinstance(r, _AsyncCluster) and r.rp_wait_replicas > 0:
            out, acked = await r.eval_replicated(
                ONCE_LUA, [self.record, *self.keys], [self.token, self.ttl, *self.args]
            )
            if acked < r.rp_wait_replicas:  # on the master only: a failover now could lose it
                metrics.BROKER_EVENTS.labels(self.b.role, "unreplicated_writes").inc()
                log.warning(
                    "a write reached %d of %d replicas in %d ms", acked, r.rp_wait_replicas, r.rp_wait_ms
                )
            return _s(out)
        script = self.b.once_script()
        out = await script(keys=[self.record, *self.keys], args=[self.token, self.ttl, *self.args])
        return _s(out)


def one_slot(keys: Keys, names: Sequence[str]) -> None:
    """Raise ``CrossSlotError`` unless every key is the run's (``rp:{run}:…``, so in its one slot).

    A script or MULTI runs on one Redis Cluster node, so all its keys must hash to one slot; the
    run's hash tag puts every key of ``Keys`` there.  ``tests/e2e/test_cluster.py`` checks the slot of
    every key each Broker write touches.
    """
    bad = [n for n in names if not n.startswith(keys.prefix)]
    if bad:
        raise CrossSlotError(f"keys outside run {keys.run!r} (slot {keys.slot}) in one write: {bad[:5]}")


def lag_of(groups_info: Any, group: str) -> int | None:
    """Entries a consumer group has not acknowledged (undelivered + pending), from ``XINFO GROUPS``.

    None when the group does not exist or Redis cannot tell the lag (entries deleted mid-stream).
    """
    for g in groups_info or []:
        if _s(g["name"]) == group:
            lag = g.get("lag")
            return None if lag is None else int(lag) + int(g["pending"])
    return None


def shard_of(group_id: str, shards: int) -> int:
    """The samples shard of a group: CRC-32 of its id mod ``shards`` (the same in every process and
    host, unlike ``hash``), so every sample and allocation of a group meets in one aggregator."""
    return zlib.crc32(group_id.encode()) % shards if shards > 1 else 0


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

    def step_keys(self, step: int) -> list[str]:
        """Every per-step key (trimmed once the step is old)."""
        return [self.plan(step), self.emitted(step), self.released(step), self.released_ids(step),
                self.finished(step), self.finished_ids(step), self.consumed(step), self.alloc(step),
                self.closed(step), self.ops(step), self.migrated(step)]  # fmt: skip

    def heartbeat(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}"


def pool_keys(pool: str) -> Keys:
    """The keys of shared rollout pool ``pool``: those of the pseudo-run ``pool:NAME``, in a slot
    of their own (``rp:{pool:NAME}:…``).  Its ``workers`` and ``worker:{id}`` are the pool's
    members, ``lease`` says which run each serves and ``leases`` logs every change.  No write
    touches a pool key and a run key at once (docs/architecture.md, "Shared rollout pools")."""
    return Keys(f"pool:{pool}")


@dataclass(frozen=True)
class Entry:
    stream: str
    id: str
    fields: dict[bytes, bytes]

    @property
    def data(self) -> bytes:
        return self.fields.get(DATA, b"")


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}  # -> the node URL's scheme
# What a cluster client waits out with backoff, as ``connect`` does for one server: a node down or
# restarting, and a failover (the slot uncovered, CLUSTERDOWN/TRYAGAIN until a replica takes over).
_CLUSTER_RETRY = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    SlotNotCoveredError,
    TryAgainError,
)


def cluster_node_url(url: str) -> str | None:
    """``redis://…`` for a ``redis+cluster://…`` URL (``rediss://…`` for ``rediss+cluster://…``),
    None for any other URL (one server)."""
    scheme, sep, rest = url.partition("://")
    base = CLUSTER_SCHEMES.get(scheme.lower())
    return f"{base}://{rest}" if sep and base else None


_WAIT_PARAMS = ("wait_replicas", "wait_timeout_ms")  # cluster URL options of RolloutPipe's own


def _pop_query(url: str, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """``url`` without the query parameters ``names`` (RolloutPipe's, not redis-py's), and them."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in names}
    rest = urlencode([(k, v) for k, v in query if k not in names])
    return urlunsplit(parts._replace(query=rest)), ours


def is_cluster(r: Any) -> bool:
    """Whether ``r`` is a Redis Cluster client (``connect``/``connect_sync`` of a cluster URL)."""
    return isinstance(r, AsyncRedisCluster | SyncRedisCluster)


def _retry_cluster(e: Exception) -> bool:
    if isinstance(e, AuthenticationError | AuthorizationError):
        return False  # a wrong password does not get better by waiting
    if isinstance(e, _CLUSTER_RETRY):
        return True
    if isinstance(e, RedisClusterException):  # no node reachable to read the slot map from
        return isinstance(e.__cause__, RedisConnectionError | RedisTimeoutError)
    # a blocked XREAD/XREADGROUP on a master that turned replica (a manual failover)
    return isinstance(e, ResponseError) and str(e).startswith("UNBLOCKED")


class _AsyncCluster(AsyncRedisCluster):
    """redis-py's cluster client, with the retries of :func:`connect`.

    Its own retry loop re-reads the slot map and resends at once, without backoff, so a failover
    (a second or more) would use up every attempt within milliseconds.  Here each command is retried
    with the same exponential backoff as one server's client, for about ``retry_s`` seconds; each
    retry starts from a fresh slot map.  Retried commands are the same ones ``connect`` retries,
    and a write resent after a lost reply is made harmless the same way (``ONCE_LUA``).

    The fresh slot map is forced, and read before the retry: redis-py asks its "default node"
    for the keys of some commands (``COMMAND GETKEYS`` for XREAD and XREADGROUP) before it looks
    at its map, and re-reads the map only when the command's own node fails, so with the default
    node dead every such command would fail until the retries ran out, even after a replica had
    taken over (measured: the roles died).
    """

    rp_retries = 0
    rp_wait_replicas = 0  # ``?wait_replicas=N``: each ONCE_LUA write waits for N replicas
    rp_wait_ms = 1000  # ``?wait_timeout_ms=T``: for at most T ms (then it goes on, warning)

    async def eval_replicated(self, script: str, keys: list[str], args: list[Any]) -> tuple[Any, int]:
        """``EVAL`` then ``WAIT rp_wait_replicas rp_wait_ms`` on one connection of the master of the
        keys' slot (WAIT counts the replicas that have this connection's writes): the result and
        how many replicas acknowledged it.  Retried like any command; a retry resends the same
        script and token, so a write that died with its master is applied on the promoted
        replica, and one the replica already has is not applied twice."""
        backoff = ExponentialBackoff(cap=1.0, base=0.05)
        for failures in range(self.rp_retries + 1):
            try:
                await self.initialize()
                node = self.get_node_from_key(keys[0])
                if node is None:
                    raise SlotNotCoveredError(f"no master serves {keys[0]!r}")
                cmds = [
                    PipelineCommand(0, "EVAL", script, len(keys), *keys, *args),
                    PipelineCommand(1, "WAIT", self.rp_wait_replicas, self.rp_wait_ms),
                ]
                await node.execute_pipeline(cmds)
                for c in cmds:
                    if isinstance(c.result, Exception):
                        raise c.result
                acked: Any = cmds[1].result
                return cmds[0].result, int(acked)
            except Exception as e:
                if failures >= self.rp_retries or not (_retry_cluster(e) or isinstance(e, AskError)):
                    raise  # (MovedError is an AskError: the slot has a new master)
                log.debug("EVAL+WAIT on the cluster (%s); retrying", e)
                await asyncio.sleep(backoff.compute(failures))
                self._initialize = True
        raise AssertionError("unreachable")

    async def _split_command_across_slots(self, command: str, *keys: KeyT) -> int:  # type: ignore[override]
        """DEL, EXISTS, TOUCH, UNLINK: one command per slot through ``execute_command``, so retried.

        redis-py sends them as a pipeline, which its retry count (0 here) does not retry: an
        ``EXISTS done`` during a failover killed a role (measured).  A run's keys are one slot.
        """
        total = 0
        for names in self._partition_keys_by_slot(keys).values():
            total += int(await self.execute_command(command, *names))
        return total

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        backoff = ExponentialBackoff(cap=1.0, base=0.05)
        for failures in range(self.rp_retries + 1):
            try:
                return await super().execute_command(*args, **kwargs)
            except Exception as e:
                if failures >= self.rp_retries or not _retry_cluster(e):
                    raise
                log.debug("%s on the cluster (%s); retrying", args[0], e)
                await asyncio.sleep(backoff.compute(failures))
                if not isinstance(e, MaxConnectionsError):  # a node failed, not our pool: new map
                    self._initialize = True
                    with contextlib.suppress(RedisError, RedisClusterException):
                        await self.initialize()  # (the next try may find the slot before it would)
        raise AssertionError("unreachable")


class _SyncCluster(SyncRedisCluster):
    """The blocking cluster client, with the retries of :func:`connect_sync` (see ``_AsyncCluster``)."""

    rp_retries = 0

    def _split_command_across_slots(self, command: str, *keys: KeyT) -> int:
        """As ``_AsyncCluster._split_command_across_slots``: one retried command per slot."""
        total = 0
        for names in self._partition_keys_by_slot(keys).values():
            total += int(self.execute_command(command, *names))
        return total

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        backoff = ExponentialBackoff(cap=1.0, base=0.05)
        for failures in range(self.rp_retries + 1):
            try:
                return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]
            except Exception as e:
                if failures >= self.rp_retries or not _retry_cluster(e):
                    raise
                log.debug("%s on the cluster (%s); retrying", args[0], e)
                time.sleep(backoff.compute(failures))
                if not isinstance(e, MaxConnectionsError):  # a node failed: a new map, default node
                    with contextlib.suppress(RedisError, RedisClusterException):
                        self.nodes_manager.initialize()
        raise AssertionError("unreachable")


def connect(url: str, max_connections: int = 32, *, retry_s: float = 30.0) -> aioredis.Redis:
    """A client whose pool waits for a free connection instead of failing under bursts.

    ``url`` may be ``redis://`` or ``rediss://`` (TLS; redis-py reads ``ssl_ca_certs``,
    ``ssl_cert_reqs``, ``ssl_certfile``, ``ssl_keyfile`` … from the query string).  A command that
    fails with ``ConnectionError``/``TimeoutError`` (a Redis restart, ``LOADING`` while the AOF is
    replayed) is retried on a fresh connection with exponential backoff (50 ms doubling, at most
    1 s apart) for about ``retry_s`` seconds before the error reaches the role.

    ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS) is a Redis Cluster reached
    through any of its nodes: redis-py's cluster client, with the same retries (a failover is
    waited out) and at most ``max_connections`` connections a node (a command that finds them all
    busy waits, with the same backoff).  It is typed as ``Redis``: the roles use only commands
    the two clients share, on keys of one run (one slot; see docs/operations.md).
    """
    node_url = cluster_node_url(url)
    if node_url is not None:
        node_url, wait = _pop_query(node_url, _WAIT_PARAMS)
        rc = cast(
            _AsyncCluster,
            _AsyncCluster.from_url(
                node_url,
                max_connections=max_connections,
                socket_timeout=None,  # as one server's client: a blocking XREAD is never cut short
                health_check_interval=30,
                retry=Retry(NoBackoff(), retries=0),  # _AsyncCluster retries, with backoff
            ),
        )
        rc.rp_retries = retries_for(retry_s)
        rc.rp_wait_replicas = int(wait.get("wait_replicas", 0))
        rc.rp_wait_ms = int(wait.get("wait_timeout_ms", rc.rp_wait_ms))
        return cast(aioredis.Redis, rc)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=None,
        health_check_interval=30,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=retries_for(retry_s)),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    # from_pool: the client owns its pool, so ``aclose()`` also closes the pool's connections
    return aioredis.Redis.from_pool(pool)  # the pool's decode_responses defaults to False


def connect_sync(url: str, *, retry_s: float = 30.0, **kwargs: Any) -> redis.Redis:
    """A blocking client with the same retries as :func:`connect` (``rolloutpipe run``'s follower),
    for one server or (``redis+cluster://``) a cluster; ``kwargs`` go to redis-py's client."""
    node_url = cluster_node_url(url)
    if node_url is not None:
        node_url, _wait = _pop_query(node_url, _WAIT_PARAMS)  # (for the roles' writes only)
        src = _SyncCluster.from_url(node_url, retry=SyncRetry(NoBackoff(), retries=0), **kwargs)
        src = cast(_SyncCluster, src)
        src.rp_retries = retries_for(retry_s)
        return cast(redis.Redis, src)
    return redis.Redis.from_url(
        url,
        retry=SyncRetry(ExponentialBackoff(cap=1.0, base=0.05), retries=retries_for(retry_s)),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        **kwargs,
    )


def retries_for(seconds: float, *, base: float = 0.05, cap: float = 1.0) -> int:
    """How many exponential-backoff retries (``base`` doubling up to ``cap``) span ``seconds``."""
    n, waited = 0, 0.0
    while waited < seconds:
        waited += min(cap, base * 2**n)
        n += 1
    return n


class Broker:
    """Stream helper bound to one run's namespace."""

    def __init__(
        self,
        r: aioredis.Redis,
        run: str,
        role: str,
        *,
        maxlen: int = 100_000,
        codec: MsgpackCodec | None = None,
        sample_shards: int = 1,
    ) -> None:
        self.r = r
        self.keys = Keys(run)
        self.shards = max(1, sample_shards)  # samples streams: one aggregator each (``shard_of``)
        self.run = run
        self.role = role
        self.maxlen = maxlen
        self.codec = codec or DEFAULT_CODEC
        self._once: Any = None  # the ONCE_LUA script, registered on first use
        self._once_loaded = 0  # id of the client that SCRIPT LOADed it (``execute_all``)

    async def ensure_group(self, stream: str, group: str, start: str = "0") -> None:
        try:
            await self.r.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def encode(self, event: Event) -> bytes:
        return self.codec.encode(event)

    def once(self, step: int | None) -> Once:
        """A write applied at most once, however often a lost reply makes redis-py send it."""
        return Once(self, step)

    def sample_stream(self, group_id: str) -> str:
        """The samples stream a group's samples and allocations go to."""
        return self.keys.samples_shard(shard_of(group_id, self.shards))

    async def check_shards(self) -> None:
        """Every role of a run must split ``samples`` the same way, or a group's samples would wait on
        a stream no aggregator of theirs reads: the first role to start records the count, and a
        role configured with another count stops with a ConfigError that names both."""
        await self.r.set(self.keys.sample_shards, self.shards, nx=True)
        have = int(await self.r.get(self.keys.sample_shards) or self.shards)
        if have != self.shards:
            raise ConfigError(
                f"run {self.run!r} splits its samples into {have} streams (redis.sample_shards), but this "
                f"{self.role} was started with {self.shards}: start every role with the same value"
            )

    def once_script(self) -> Any:
        if self._once is None:
            self._once = self.r.register_script(ONCE_LUA)
        return self._once

    async def execute_all(self, ops: Sequence[Once]) -> list[str]:
        """Several writes in one round trip, each applied at most once and in order.

        A pipeline without MULTI: each write is still atomic on its own (one script run), and a
        resend of the pipeline after a lost reply changes nothing (each keeps its token).
        """
        if not ops:
            return []
        if len(ops) == 1 or isinstance(self.r, _AsyncCluster):
            # a cluster: each on its own (its slot checked, and its WAIT for replicas when asked)
            return [await op.execute() for op in ops]
        for op in ops:
            one_slot(self.keys, [op.record, *op.keys])
        script = self.once_script()
        if self._once_loaded != id(self.r):
            await self.r.script_load(ONCE_LUA)  # then EVALSHA, without a SCRIPT EXISTS per pipeline
            self._once_loaded = id(self.r)
        for attempt in range(2):
            pipe = self.r.pipeline(transaction=False)
            for op in ops:
                pipe.evalsha(script.sha, len(op.keys) + 1, op.record, *op.keys, op.token, op.ttl, *op.args)
            try:
                return [_s(x) for x in await pipe.execute()]
            except NoScriptError:  # a restarted Redis forgot the script: load it, send them again
                if attempt:
                    raise
                await self.r.script_load(ONCE_LUA)
        raise AssertionError("unreachable")

    async def publish(self, stream: str, event: Event) -> str:
        """``event`` onto ``stream`` once (its entry id)."""
        return await self.once(event.step).xadd(stream, self.encode(event), mode="r").execute()

    async def read(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 16,
        block_ms: int = 100,
        start: str = ">",
    ) -> list[Entry]:
        return await self.read_streams([stream], group, consumer, count=count, block_ms=block_ms, start=start)

    async def read_streams(
        self,
        streams: Sequence[str],
        group: str,
        consumer: str,
        *,
        count: int = 16,
        block_ms: int = 100,
        start: str = ">",
    ) -> list[Entry]:
        """One XREADGROUP over several streams (an aggregator serving several samples shards)."""
        resp = await self.r.xreadgroup(
            group, consumer, dict.fromkeys(streams, start), count=count, block=block_ms
        )
        return _entries(resp)

    async def autoclaim(
        self, stream: str, group: str, consumer: str, *, min_idle_ms: int, count: int = 64
    ) -> list[Entry]:
        """Claim entries idle for ``min_idle_ms`` (their consumer is presumed dead)."""
        out: list[Entry] = []
        cursor = "0-0"
        for _ in range(16):
            resp = await self.r.xautoclaim(stream, group, consumer, min_idle_ms, start_id=cursor, count=count)
            cursor = _s(resp[0])
            for eid, fields in resp[1]:
                if fields is None:  # deleted while pending (trimmed); nothing to claim
                    await self.ack(stream, group, _s(eid))
                    continue
                out.append(Entry(stream, _s(eid), dict(fields)))
            if cursor == "0-0":
                break
        return out

    async def touch(self, stream: str, group: str, consumer: str, ids: list[str]) -> None:
        """Reset the idle time of entries we still work on, so XAUTOCLAIM leaves them alone."""
        if ids:
            await self.r.xclaim(stream, group, consumer, 0, list[Any](ids), justid=True)

    async def ack(self, stream: str, group: str, *ids: str) -> None:
        if ids:
            await self.r.xack(stream, group, *ids)

    def decode(self, entry: Entry) -> Event:
        return self.codec.decode(entry.data)

    async def deliveries(self, entry: Entry, group: str) -> int:
        """How many times ``entry`` was delivered to ``group``'s consumers (0 once acknowledged)."""
        got: Any = await self.r.xpending_range(entry.stream, group, min=entry.id, max=entry.id, count=1)
        return int(got[0]["times_delivered"]) if got else 0

    async def dead_letter(
        self,
        entry: Entry | None,
        reason: str,
        *,
        step: int = -1,
        policy_version: int = -1,
        payload: bytes | None = None,
        counter: str = "dead_letters",
        ack_group: str | None = None,
        finished: bool = False,
        origin: str = "",
    ) -> None:
        """Write to ``dlq`` with a reason and count it.  Never silent.

        With ``ack_group`` the entry is acknowledged in the same transaction, so it is either still
        pending (and will be looked at again) or dead-lettered, never both or neither.  With
        ``finished`` (a request a worker drops) the step's ``finished`` counter counts it too, unless
        the request was counted already (under ``origin`` for a migrated request's continuation).
        Applied once, even when its reply is lost and it is retried.
        """
        dl = DeadLetter(
            run=self.run,
            step=step,
            policy_version=policy_version,
            source_stream=entry.stream if entry else "",
            entry_id=entry.id if entry else "",
            role=self.role,
            reason=reason,
            payload=payload if payload is not None else (entry.data if entry else b""),
            created_at=time.time(),
        )
        op = self.once(step).xadd(self.keys.dlq, self.encode(dl))
        if ack_group is not None and entry is not None:
            op.xack(entry.stream, ack_group, [entry.id])
        names = ["dead_letters"] if counter == "dead_letters" else ["dead_letters", counter]
        for name in names:
            op.cmd("HINCRBY", self.keys.stats, name, 1)
            if step >= 0:
                op.cmd("HINCRBY", self.keys.stats, f"{name}:{step}", 1)
        if finished and step >= 0 and entry is not None:  # a request dropped by a worker frees its slot
            op.cmd("SADD", self.keys.finished_ids(step), origin or entry.id, mode="g")
            op.cmd("INCRBY", self.keys.finished(step), 1)
        await op.execute()
        metrics.DEAD_LETTERS.labels(self.role).inc()
        if counter == "fence_rejections":
            metrics.FENCE_REJECTIONS.labels(self.role).inc()
        if counter != "dead_letters":
            metrics.BROKER_EVENTS.labels(self.role, counter).inc()
        log.warning("dead letter from %s %s: %s", dl.source_stream or "-", dl.entry_id or "-", reason)

    async def decode_or_dlq(
        self, entry: Entry, group: str, expected: tuple[type[Event], ...]
    ) -> Event | None:
        """Decode an entry; on failure dead-letter it, ack it, and return None."""
        try:
            event = self.decode(entry)
        except CodecError as e:
            await self.dead_letter(entry, f"decode: {e}", ack_group=group)
            return None
        if not isinstance(event, expected):
            await self.dead_letter(
                entry,
                f"unexpected kind {event.kind!r} on {entry.stream}",
                step=event.step,
                policy_version=event.policy_version,
                ack_group=group,
            )
            return None
        if event.run != self.run:
            await self.dead_letter(
                entry, f"event of run {event.run!r} on run {self.run!r}", step=event.step, ack_group=group
            )
            return None
        return event

    async def stat(self, name: str, step: int | None = None) -> int:
        field = name if step is None else f"{name}:{step}"
        v = await self.r.hget(self.keys.stats, field)
        return int(v) if v is not None else 0

    async def incr(self, name: str, step: int | None = None, by: int = 1) -> None:
        """Count ``by`` under ``name`` (and ``name:step``) in ``stats``, once."""
        op = self.once(step).cmd("HINCRBY", self.keys.stats, name, by)
        if step is not None:
            op.cmd("HINCRBY", self.keys.stats, f"{name}:{step}", by)
        await op.execute()
        metrics.BROKER_EVENTS.labels(self.role, name).inc(by)

    async def get_event(self, key: str, cls: type[E]) -> E | None:
        raw = await self.r.get(key)
        if raw is None:
            return None
        return self.codec.decode_as(raw, cls)

    # ------------------------------------------------------------------ typed operations of the roles

    async def version(self) -> PolicyVersion | None:
        return await self.get_event(self.keys.version, PolicyVersion)

    async def version_number(self) -> int:
        pv = await self.version()
        return -1 if pv is None else pv.policy_version

    async def control_tail(self) -> str:
        """The id of the newest ``control`` entry ("0-0" if none): news after it is new."""
        last: Any = await self.r.xrevrange(self.keys.control, count=1)
        return _s(last[0][0]) if last else "0-0"

    async def wait_control(
        self, check: Callable[[], Awaitable[T | None]], stop: asyncio.Event, *, block_ms: int = 1000
    ) -> T | None:
        """Wait until ``check()`` returns something, waking on each new ``control`` entry.

        Versions and plans are announced on ``control``, so a waiter blocks there (XREAD BLOCK)
        instead of polling their keys.  The tail id is read before ``check`` so that news written in
        between is seen; ``block_ms`` bounds the wait for a writer that announces nothing.
        """
        while not stop.is_set():
            last = await self.control_tail()
            got = await check()
            if got is not None:
                return got
            if await self.is_done():
                return None
            await self.r.xread({self.keys.control: last}, count=1, block=block_ms)
        return None

    async def wait_version(self, v: int, stop: asyncio.Event) -> PolicyVersion | None:
        """The published version once it is >= ``v`` (None if stopped or the run is done)."""

        async def at_least() -> PolicyVersion | None:
            pv = await self.version()
            return pv if pv is not None and pv.policy_version >= v else None

        return await self.wait_control(at_least, stop)

    async def plan(self, step: int) -> StepPlan | None:
        return await self.get_event(self.keys.plan(step), StepPlan)

    async def wait_plan(self, step: int, stop: asyncio.Event) -> StepPlan | None:
        return await self.wait_control(lambda: self.plan(step), stop)

    async def write_plan(self, plan: StepPlan) -> None:
        """The plan key and its announcement on ``control``, together, once: a step's plan is written
        once (``SET NX``), and only the call that wrote it announces it."""
        raw = self.encode(plan)
        op = self.once(plan.step).cmd("SET", self.keys.plan(plan.step), raw, "NX", mode="g")
        await op.xadd(self.keys.control, raw).execute()

    async def publish_version(self, pv: PolicyVersion, metrics_ev: StepMetrics | None) -> None:
        """Together and once: the previous step's metrics, the version key and its announcement."""
        raw = self.encode(pv)
        op = self.once(pv.step)
        if metrics_ev is not None:
            op.xadd(self.keys.control, self.encode(metrics_ev))
        await op.cmd("SET", self.keys.version, raw).xadd(self.keys.control, raw).execute()

    async def step_metrics(self, step: int, look_back: int = 64) -> StepMetrics | None:
        """The trainer's metrics of ``step``, from the newest ``control`` entries."""
        if step < 0:
            return None
        entries: Any = await self.r.xrevrange(self.keys.control, count=look_back)
        for _id, fields in entries or []:
            try:
                ev = self.codec.decode((fields or {}).get(DATA, b""))
            except CodecError:
                continue
            if isinstance(ev, StepMetrics) and ev.step == step:
                return ev
        return None

    async def mark_done(self) -> None:
        await self.r.set(self.keys.done, b"1")

    async def is_done(self) -> bool:
        return bool(await self.r.exists(self.keys.done))

    async def release(self, step: int, reqs: Sequence[RolloutRequest]) -> None:
        """Requests onto ``requests`` and recorded as released (counter and id set), or neither; once."""
        if not reqs:
            return
        op = self.once(step)
        for rq in reqs:
            op.xadd(self.keys.requests, self.encode(rq))
        op.cmd("INCRBY", self.keys.released(step), len(reqs))
        await op.sadd(self.keys.released_ids(step), [rq.request_id for rq in reqs]).execute()

    async def released_ids(self, step: int) -> set[str]:
        return {_s(x) for x in await self.r.smembers(self.keys.released_ids(step))}

    async def released_count(self, step: int) -> int:
        """Requests of ``step`` released so far (final once the step's counts are all final)."""
        return int(await self.r.get(self.keys.released(step)) or 0)

    async def finished(self, step: int) -> int:
        """Requests of ``step`` whose sample was published (the workers' counter)."""
        return int(await self.r.get(self.keys.finished(step)) or 0)

    async def publish_sample(self, sample: Sample, request_entry: str, origin: str = "") -> None:
        """The request acknowledged, and its sample out and counted in ``finished:k``, atomically.

        A request's sample goes out at most once (``finished:k:ids`` holds its entry id, or for a
        continuation its ``origin``, segment 0's entry id): a retry whose first reply was lost, a
        request redone after it was reclaimed, or one segment of a migrated request finished twice
        adds nothing.
        """
        k = self.keys
        op = self.once(sample.step).xack(k.requests, Groups.ROLLOUT, [request_entry])
        op.cmd("SADD", k.finished_ids(sample.step), origin or request_entry, mode="g")
        op.xadd(self.sample_stream(sample.group_id), self.encode(sample))
        await op.cmd("INCRBY", k.finished(sample.step), 1).execute()

    async def migrate(self, request_entry: str, cont: RolloutRequest) -> str:
        """Put a preempted request back on ``requests`` as its continuation ``cont``, once.

        In one script run (``MIGRATE_LUA``): ``request_entry`` acknowledged, ``cont`` added (only
        if the request is not finished and this entry was never migrated), and counted
        (``migrations``, ``migrated_tokens``).  Either the entry is still pending (its worker was
        killed before this ran: it is reclaimed and redone from its own prefix) or its continuation
        is on ``requests``, never both or neither.  Workers blocked on ``requests`` are idle, and
        Redis hands the continuation to one of them at once.  Returns the continuation's entry id,
        or ``""`` when nothing was put back (the request was done already).
        """
        k, step = self.keys, cont.step
        keys = [k.ops(step), k.requests, k.migrated(step), k.finished_ids(step), k.stats]
        one_slot(k, keys)
        token, payload = uuid.uuid4().hex, self.encode(cont)
        args: list[str | bytes | int] = [token, Groups.ROLLOUT, request_entry, cont.origin, payload, step,
                                         len(cont.prefix_ids), self.maxlen]  # fmt: skip
        out = _s(await self.r.eval(MIGRATE_LUA, len(keys), *keys, *args))
        if out != "0":
            metrics.BROKER_EVENTS.labels(self.role, "migrations").inc()
        return "" if out == "0" else out

    async def write_allocation(self, alloc: Allocation) -> None:
        """The decision on record (``alloc:k``), its news to the aggregator, and a close mark: together,
        once."""
        raw = self.encode(alloc)
        op = self.once(alloc.step).cmd("HSET", self.keys.alloc(alloc.step), alloc.group_id, raw)
        op.xadd(self.sample_stream(alloc.group_id), raw)
        if alloc.status in ("closed", "skipped"):
            op.cmd("SADD", self.keys.closed(alloc.step), alloc.group_id)
        await op.execute()

    async def allocations(self, step: int) -> dict[str, Allocation]:
        raw: Any = await self.r.hgetall(self.keys.alloc(step))
        return {_s(k): self.codec.decode_as(v, Allocation) for k, v in (raw or {}).items()}

    async def closed_groups(self, step: int) -> set[str]:
        """Group ids of ``step`` that were closed or skipped."""
        return {_s(x) for x in await self.r.smembers(self.keys.closed(step))}

    async def seal(self, seal: StepSeal) -> None:
        await self.publish(self.keys.groups, seal)

    async def emitted_count(self, step: int) -> int:
        return int(await self.r.scard(self.keys.emitted(step)))

    async def emitted_ids(self, step: int) -> set[str]:
        return {_s(x) for x in await self.r.smembers(self.keys.emitted(step))}

    async def is_emitted(self, step: int, group_id: str) -> bool:
        return bool(await self.r.sismember(self.keys.emitted(step), group_id))

    async def emit_group(self, group: Group, stats: GroupStats, entry_ids: Sequence[str]) -> bool:
        """Group to the trainer, its stats to the controller, its entries acknowledged: atomically.

        The group goes out only if its id is new in ``emitted:k``.  False when another call emitted
        it before (a duplicate); its entries are acknowledged anyway.  True when this call emitted
        it, also when that first attempt's reply was lost and redis-py sent it again.
        """
        return await self.emit_op(group, stats, entry_ids).execute() == "1"

    def emit_op(
        self,
        group: Group,
        stats: GroupStats,
        entry_ids: Sequence[str],
        raw_samples: Sequence[bytes | None] | None = None,
    ) -> Once:
        """The write of :meth:`emit_group`, to run alone or with others (:meth:`execute_all`).

        ``raw_samples``: the samples' bytes as they arrived, spliced into the group unencoded.
        """
        k = self.keys
        op = self.once(group.step).xack(
            self.sample_stream(group.group_id), Groups.AGGREGATOR, list(entry_ids)
        )
        op.cmd("SADD", k.emitted(group.step), group.group_id, mode="g")
        raw = self.encode(group) if raw_samples is None else self.codec.encode_group(group, raw_samples)
        return op.xadd(k.groups, raw).xadd(k.feedback, self.encode(stats))

    async def emitted_among(self, pairs: Sequence[tuple[int, str]]) -> list[bool]:
        """For each (step, group id): is it in ``emitted:step``?  One round trip."""
        if not pairs:
            return []
        pipe = self.r.pipeline(transaction=False)
        for step, gid in pairs:
            pipe.sismember(self.keys.emitted(step), gid)
        return [bool(x) for x in await pipe.execute()]

    async def consumed(self, step: int) -> set[str]:
        return {_s(m) for m in await self.r.smembers(self.keys.consumed(step))}

    async def commit_consumed(self, step: int, group_ids: Sequence[str], entry_ids: Sequence[str]) -> None:
        """The step's groups recorded as consumed and their entries acknowledged, together.

        One ``ONCE_LUA`` run (one slot, so it runs on a cluster too, where redis-py's client would
        need a transaction of its own); both commands are idempotent, so a resend is harmless anyway.
        """
        if not group_ids and not entry_ids:
            return
        op = self.once(step).sadd(self.keys.consumed(step), list(group_ids))
        await op.xack(self.keys.groups, Groups.TRAINER, list(entry_ids)).execute()

    async def trainer_lag(self) -> int:
        """Groups in ``groups`` the trainer has not acknowledged: undelivered (lag) + pending."""
        try:
            info: Any = await self.r.xinfo_groups(self.keys.groups)
        except ResponseError:  # no stream yet
            return 0
        names = {_s(g["name"]) for g in info}
        if Groups.TRAINER not in names:
            return int(await self.r.xlen(self.keys.groups))  # no trainer group yet: nothing consumed
        lag = lag_of(info, Groups.TRAINER)
        if lag is None:  # Redis cannot tell (entries deleted mid-stream): count them
            g = next(g for g in info if _s(g["name"]) == Groups.TRAINER)
            after: Any = await self.r.xrange(self.keys.groups, min="(" + _s(g["last-delivered-id"]), max="+")
            lag = len(after) + int(g["pending"])
        return lag

    async def heartbeat(self, worker: str, info: dict[str, Any], ttl_s: int) -> None:
        """The worker's TTL key, and its id in the run's ``workers`` registry (no SCAN finds it).

        The key's TTL (the server's clock) says whether the worker lives; the registry only lists
        ids to look at, scored by this host's idea of the expiry time so that ids of workers dead
        long ago (``REGISTRY_GRACE_S``, far beyond any clock skew) are dropped from it.
        """
        now = time.time()
        await self.r.zadd(self.keys.workers, {worker: now + ttl_s})
        await self.r.set(self.keys.heartbeat(worker), json.dumps(info).encode(), ex=ttl_s)
        await self.r.zremrangebyscore(self.keys.workers, "-inf", now - REGISTRY_GRACE_S)

    async def drop_heartbeat(self, worker: str) -> None:
        await self.r.delete(self.keys.heartbeat(worker))
        await self.r.zrem(self.keys.workers, worker)

    async def live_workers(self) -> list[dict[str, Any]]:
        """The heartbeat records of live workers (their keys expire with the worker)."""
        out = []
        for _wid, raw in await live_heartbeats(self.r, self.keys):
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    async def capacity(self) -> int:
        """Sum of live workers' engine slots."""
        total = 0
        for w in await self.live_workers():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                total += int(w["capacity"])
        return total

    async def read_feedback(
        self, consumer: str, *, block_ms: int, count: int = 256, start: str = ">"
    ) -> list[Entry]:
        return await self.read(
            self.keys.feedback, Groups.CONTROLLER, consumer, count=count, block_ms=block_ms, start=start
        )

    async def prompt_history(self) -> dict[int, list[list[Any]]]:
        raw: Any = await self.r.hgetall(self.keys.prompt_history)
        return {int(_s(k)): json.loads(v) for k, v in (raw or {}).items()}

    async def save_prompt_history(self, records: dict[int, list[tuple[Any, ...]]]) -> None:
        """Each prompt's records, replaced (a prompt's list is as long as its policy keeps)."""
        if records:
            await self.r.hset(
                self.keys.prompt_history, mapping={str(k): json.dumps(v) for k, v in records.items()}
            )


REGISTRY_GRACE_S = 300.0  # a registered worker whose heartbeat expired this long ago is unlisted


async def live_heartbeats(r: aioredis.Redis, keys: Keys) -> list[tuple[str, bytes]]:
    """``(worker id, heartbeat record)`` of each live worker: the ids in ``workers`` scored within
    ``REGISTRY_GRACE_S`` of now, and one MGET of their keys (all in the run's slot)."""
    ids = [_s(w) for w in await r.zrangebyscore(keys.workers, time.time() - REGISTRY_GRACE_S, "+inf")]
    if not ids:
        return []
    raws = await r.mget([keys.heartbeat(w) for w in ids])
    return [(w, _b(raw)) for w, raw in zip(ids, raws, strict=True) if raw]


def live_heartbeats_sync(r: redis.Redis, keys: Keys) -> list[tuple[str, bytes, int]]:
    """``live_heartbeats`` for a blocking client, with each key's TTL (seconds) as well."""
    ids = [_s(w) for w in r.zrangebyscore(keys.workers, time.time() - REGISTRY_GRACE_S, "+inf")]
    out: list[tuple[str, bytes, int]] = []
    if not ids:
        return out
    raws: Any = r.mget([keys.heartbeat(w) for w in ids])
    for w, raw in zip(ids, raws, strict=True):
        if raw:
            ttl = int(r.ttl(keys.heartbeat(w)))
            if ttl != -2:  # expired since MGET
                out.append((w, _b(raw), ttl))
    return out


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
    return [_s(k) for k in found]


def _b(v: bytes | str) -> bytes:
    return v if isinstance(v, bytes) else v.encode()


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _entries(resp: Any) -> list[Entry]:
    out: list[Entry] = []
    if not resp:
        return out
    for stream, items in resp:
        for eid, fields in items:
            if fields is None:
                continue
            out.append(Entry(_s(stream), _s(eid), dict(fields)))
    return out
