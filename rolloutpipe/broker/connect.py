"""Connecting to Redis: one server or a Redis Cluster, TLS, and retries that wait out a restart.

``connect`` (asyncio, the roles) and ``connect_sync`` (blocking: the operator commands, the
launchers, ``rolloutpipe run``'s follower) are the only ways RolloutPipe opens a client; both take
``redis://``, ``rediss://`` (TLS), ``redis+cluster://`` and ``rediss+cluster://`` URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import PipelineCommand
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    MaxConnectionsError,
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

log = logging.getLogger("rolloutpipe.broker")

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


class AsyncCluster(AsyncRedisCluster):
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
    """The blocking cluster client, with the retries of :func:`connect_sync` (see ``AsyncCluster``)."""

    rp_retries = 0

    def _split_command_across_slots(self, command: str, *keys: KeyT) -> int:
        """As ``AsyncCluster._split_command_across_slots``: one retried command per slot."""
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
            AsyncCluster,
            AsyncCluster.from_url(
                node_url,
                max_connections=max_connections,
                socket_timeout=None,  # as one server's client: a blocking XREAD is never cut short
                health_check_interval=30,
                retry=Retry(NoBackoff(), retries=0),  # AsyncCluster retries, with backoff
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


def connect_sync(url: str, *, retry_s: float = 30.0, fail_fast: bool = False, **kwargs: Any) -> redis.Redis:
    """A blocking client with the same retries as :func:`connect` (``rolloutpipe run``'s follower),
    for one server or (``redis+cluster://``) a cluster; ``kwargs`` go to redis-py's client.

    ``fail_fast`` (the operator commands: ``status``, ``tail``, ``dlq`` …): no retries and a 3 s
    connect timeout, so a Redis that is down is reported at once; a blocking ``XREAD`` is still
    never timed out.
    """
    if fail_fast:
        retry_s = 0
        kwargs = {"socket_connect_timeout": 3, "socket_timeout": None, **kwargs}
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
