"""Redis ACL users, one per role: the keys and commands each role needs, and nothing else.

One source for both deployments: ``rolloutpipe run`` starts its private redis-server with these
users and fresh random passwords, and ``docker-compose.yml`` spells the same rules out in its
``redis`` command (``tests/e2e/test_compose.py`` checks that the two agree).  ``~`` is read and write,
``%R~`` read only; ``rp:*:`` matches every run's ``rp:{run}:`` namespace.

* ``controller`` writes ``requests``, plans, allocations (``alloc``, ``closed``, on ``samples``),
  step seals (on ``groups``), its release records, the prompt history, the dataset stream's
  position (``prompt_cursor``) and the rollouts released per step (``step_rollouts``); it reads ``feedback``,
  trims the streams and old steps' keys (``XTRIM``/``DEL``) and audits ``control``.
* ``rollout`` writes ``samples`` and its heartbeats (and the ``workers`` registry), reads
  ``version`` and ``closed``; it cannot write ``groups``, ``control`` or ``version``.
* ``aggregator`` writes ``groups`` and ``feedback``, reads ``alloc``; ``trainer`` writes
  ``version``, ``control`` and ``consumed``.
* ``pool`` (a shared pool's scheduler, ``rolloutpipe pool``) writes its pool's ``lease`` and
  ``leases`` and reads every run's stage (``version``, ``plan``, ``released``, ``finished``,
  ``done``) and its pool's heartbeats.  Pool workers connect as ``rollout``: they also read
  ``lease``, and hand requests back (``migrated``).
* ``observer`` only reads (``tail``, ``status``, healthchecks).

Every role that writes runs its writes as the ``ONCE_LUA`` script (``EVALSHA``), recording each
one's token in ``ops:k`` or ``op:<token>`` (``_ONCE``); Redis checks the commands inside the script
against the same rules.
"""

from __future__ import annotations

import secrets

_TX = ["+multi", "+exec", "+discard"]
_STREAM_CONSUMER = ["+xreadgroup", "+xack", "+xautoclaim", "+xgroup|create"]
# writes applied at most once (``once.ONCE_LUA``): the script, and its record of applied writes
_ONCE_KEYS = ["~rp:*:ops:*", "~rp:*:op:*"]
_ONCE = ["+evalsha", "+eval", "+script|load", "+get", "+set", "+hget", "+hset"]

ROLE_RULES: dict[str, list[str]] = {
    "controller": [
        "~rp:*:requests", "~rp:*:control", "~rp:*:dlq", "~rp:*:stats", "~rp:*:plan:*",
        "~rp:*:released:*", "~rp:*:done", "~rp:*:samples", "~rp:*:groups", "~rp:*:finished:*",
        "~rp:*:emitted:*", "~rp:*:consumed:*", "~rp:*:feedback", "~rp:*:alloc:*", "~rp:*:closed:*",
        "~rp:*:prompt_history", "~rp:*:prompt_cursor", "~rp:*:step_rollouts",
        "~rp:*:samples:*", "~rp:*:sample_shards", "~rp:*:migrated:*", "~rp:*:toolcalls:*",
        *_ONCE_KEYS, "%R~rp:*:version", "%R~rp:*:worker:*", "%R~rp:*:workers",
        "-@all", "+@connection", *_TX, *_ONCE, "+xadd", *_STREAM_CONSUMER, "+xrange", "+xrevrange",
        "+xread", "+exists", "+incrby", "+hincrby", "+hgetall", "+hvals", "+scard",
        "+scan", "+sadd", "+smembers", "+sismember", "+xtrim", "+xinfo|groups", "+xpending", "+xlen",
        "+del", "+zrangebyscore", "+mget",
    ],
    "rollout": [
        "~rp:*:requests", "~rp:*:samples", "~rp:*:dlq", "~rp:*:stats", "~rp:*:finished:*",
        "~rp:*:worker:*", "~rp:*:samples:*", "~rp:*:sample_shards", "~rp:*:workers", "~rp:*:migrated:*",
        "~rp:*:toolcalls:*", *_ONCE_KEYS, "%R~rp:*:version", "%R~rp:*:control", "%R~rp:*:plan:*",
        "%R~rp:*:done", "%R~rp:*:closed:*", "%R~rp:*:lease",
        "-@all", "+@connection", *_TX, *_ONCE, "+xadd", *_STREAM_CONSUMER, "+xclaim", "+xpending", "+xread",
        "+xrevrange", "+del", "+exists", "+incr", "+incrby", "+hincrby", "+scan", "+sadd", "+smembers",
        "+sismember", "+zadd", "+zrem", "+zremrangebyscore", "+zrangebyscore", "+mget",
    ],
    "aggregator": [
        "~rp:*:samples", "~rp:*:groups", "~rp:*:dlq", "~rp:*:stats", "~rp:*:emitted:*",
        "~rp:*:feedback", "~rp:*:samples:*", "~rp:*:sample_shards", *_ONCE_KEYS, "%R~rp:*:version",
        "%R~rp:*:plan:*", "%R~rp:*:done",
        "%R~rp:*:alloc:*",
        "-@all", "+@connection", *_TX, *_ONCE, "+xadd", *_STREAM_CONSUMER, "+exists", "+sadd",
        "+sismember", "+scard", "+hincrby", "+hgetall",
    ],
    "trainer": [
        "~rp:*:groups", "~rp:*:control", "~rp:*:version", "~rp:*:dlq", "~rp:*:stats",
        "~rp:*:consumed:*", *_ONCE_KEYS, "%R~rp:*:plan:*", "%R~rp:*:done", "%R~rp:*:released:*",
        "-@all", "+@connection", *_TX, *_ONCE, "+xadd", "+xreadgroup", "+xack", "+xgroup|create",
        "+xread", "+xrevrange", "+xpending", "+exists", "+sadd", "+smembers", "+hincrby",
    ],
    # a shared pool's scheduler: its pool's lease and lease log; every run's stage, read only
    "pool": [
        "~rp:*:lease", "~rp:*:leases", "~rp:*:stats", *_ONCE_KEYS, "%R~rp:*:workers",
        "%R~rp:*:worker:*", "%R~rp:*:version", "%R~rp:*:plan:*", "%R~rp:*:released:*",
        "%R~rp:*:finished:*", "%R~rp:*:done",
        "-@all", "+@connection", *_TX, *_ONCE, "+xadd", "+hincrby", "+hgetall", "+exists",
        "+zrangebyscore", "+mget",
    ],
    "observer": [
        "%R~rp:*", "-@all", "+@connection", *_TX, "+@read", "-@dangerous", "+xinfo|groups",
        "+xinfo|consumers", "+xinfo|stream", "+info",
    ],
}  # fmt: skip
ROLES = tuple(ROLE_RULES)


def server_args(passwords: dict[str, str], admin_password: str = "", sealed_default: str = "") -> list[str]:
    """redis-server arguments: the default user off, one user per role (and an admin, if given).

    ``sealed_default``: instead of off, the default user gets every permission behind this password,
    which nobody is given.  To a client that is the same as off (a connection is logged in as
    ``default`` only while it has ``nopass``), but Redis 7.0 replays its AOF as the default user and
    checks each ``EXEC`` against it: with the default user off it drops every transaction of the AOF
    (``-NOPERM ... after processing the command 'exec'`` in its log), and a restarted or resumed run
    would lose its versions, plans and commits (tests/e2e/test_run_supervision.py).
    """
    if sealed_default:
        args = ["--user", "default", "on", f">{sealed_default}", "~*", "&*", "+@all"]
    else:
        args = ["--user", "default", "off"]
    for role, rules in ROLE_RULES.items():
        args += ["--user", role, "on", f">{passwords[role]}", *rules]
    if admin_password:  # ``rolloutpipe run`` itself: sets ``done``, follows ``control``
        args += ["--user", "admin", "on", f">{admin_password}", "~*", "&*", "+@all"]
    return args


def random_passwords() -> dict[str, str]:
    return {role: secrets.token_hex(16) for role in (*ROLES, "admin")}


def user_url(url: str, user: str, password: str) -> str:
    """``redis://host:port/db`` -> ``redis://user:password@host:port/db`` (also ``rediss://``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a Redis URL: {url!r}")
    rest = rest.split("@", 1)[-1]
    return f"{scheme}://{user}:{password}@{rest}"
