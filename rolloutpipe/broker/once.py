"""Exactly-once writes: the Lua scripts that apply a write at most once, and ``Once``, their builder.

redis-py resends a command whose reply was lost, and Redis may have run it already; every write
that a repeat would change goes through ``ONCE_LUA`` (or ``MIGRATE_LUA``) with a token of its own
(issue 15, docs/operations.md "Lost replies").
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rolloutpipe import metrics
from rolloutpipe.broker.connect import AsyncCluster
from rolloutpipe.broker.keys import DATA, as_str, one_slot

if TYPE_CHECKING:
    from rolloutpipe.broker.streams import Broker

log = logging.getLogger("rolloutpipe.broker")


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
        if isinstance(r, AsyncCluster) and r.rp_wait_replicas > 0:
            out, acked = await r.eval_replicated(
                ONCE_LUA, [self.record, *self.keys], [self.token, self.ttl, *self.args]
            )
            if acked < r.rp_wait_replicas:  # on the master only: a failover now could lose it
                metrics.BROKER_EVENTS.labels(self.b.role, "unreplicated_writes").inc()
                log.warning(
                    "a write reached %d of %d replicas in %d ms", acked, r.rp_wait_replicas, r.rp_wait_ms
                )
            return as_str(out)
        script = self.b.once_script()
        out = await script(keys=[self.record, *self.keys], args=[self.token, self.ttl, *self.args])
        return as_str(out)
