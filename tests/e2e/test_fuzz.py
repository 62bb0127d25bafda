"""Fuzzing: 10,000 mutated events at every decoder and at every role's entry handler.

``tests/unit/test_codec.py`` throws random bytes and light mutations at ``decode`` as a whole.  Here
each event kind gets its own 10,000 mutations of a valid encoding: bit flips, truncation, spliced bytes,
fields deleted, duplicated (a msgpack map with the key twice) or given the wrong type, huge
length headers, NaN and infinities, negative sizes, packed arrays of the wrong dtype or length, in
nested samples and frontiers too.  Then the same mutations go through each role's entry handler,
the way a bad entry on its stream would reach it:

* the rollout worker's ``admit`` (``requests``), the aggregator's ``on_entry`` (``samples``: samples
  and allocations),
* the trainer's group path (``_reader``'s decode, then ``train_step``'s fence) (``groups``),
* the controller's ``audit_control`` (``control``) and one round of its ``drive`` (``feedback``:
  group statistics to its policy).

Nothing may raise, and every reject lands in ``dlq`` with a reason while ``dead_letters`` goes up
by one: rejects == dlq entries == counter, per example and in total.  Every role's 10,000 examples
run against the session's real ``redis-server`` (XADD, XREADGROUP, the real transactions and Lua
script; outcomes read back with XRANGE, HGET and XPENDING).  ``RP_FUZZ_EXAMPLES`` lowers the count
to iterate locally; CI runs the default.

The counts are printed at the end of the module (``pytest -s`` or the terminal summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.connect import connect
from rolloutpipe.broker.events import (
    SCHEMA_VERSION,
    Allocation,
    AllocationRecord,
    DeadLetter,
    Event,
    FrontierStatus,
    Group,
    GroupPlan,
    GroupStats,
    PolicyVersion,
    RolloutRequest,
    Sample,
    StepMetrics,
    StepPlan,
    StepSeal,
)
from rolloutpipe.broker.keys import DATA
from rolloutpipe.broker.streams import Broker, Entry
from rolloutpipe.config import Config
from rolloutpipe.engines.base import Generation
from rolloutpipe.errors import CodecError
from rolloutpipe.roles.aggregator import Aggregator, Partial
from rolloutpipe.roles.controller import Controller
from rolloutpipe.roles.rollout import RolloutWorker
from rolloutpipe.roles.trainer.trainer import Trainer
from tests.support.config import EMULATED_FAST, make_config

pytestmark = [
    pytest.mark.slow,
    # a packed float32 array sent as a msgpack *list* holding a float beyond float32 (1e308) decodes
    # to inf with numpy's cast-overflow RuntimeWarning (events.py ``_packer``): not a crash, and
    # the same inf can be sent as packed bytes; known and reported, so not an error here
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
]

T = TypeVar("T")
EXAMPLES = int(os.environ.get("RP_FUZZ_EXAMPLES", "10000"))  # lower it only to iterate locally
STEP = 3  # the step (= policy version) every valid seed event belongs to and every role is at
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,  # a fixed seed: the same 10,000 examples on every run
    suppress_health_check=list(HealthCheck),
)

# target -> Counter(examples, rejects, dlq, counter, accepted, ...), printed at the end
COUNTS: dict[str, Counter[str]] = defaultdict(Counter)


# ----------------------------------------------------------------------------------------------- seeds


def make_events(run: str) -> dict[str, Event]:
    """One valid event of each kind, all of step ``STEP``, as the roles would write them."""

    def sample(i: int) -> Sample:
        n = 3 + i
        return Sample(
            run=run, step=STEP, policy_version=STEP, sample_id=f"{STEP}:0:{i}", request_id=f"{STEP}:0:{i}",
            group_id=f"{STEP}:0", prompt_index=7, sample_index=i, worker="w0",
            prompt_ids=np.arange(4, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32) + 5,
            logprobs=np.full(n, -0.5, dtype=np.float32), reward=float(i % 2), released_at=1.0,
            admitted_at=1.5, finished_at=2.0 + i,
        )  # fmt: skip

    samples = [sample(i) for i in range(4)]
    return {
        "request": RolloutRequest(
            run=run,
            step=STEP,
            policy_version=STEP,
            request_id=f"{STEP}:0:1",
            group_id=f"{STEP}:0",
            prompt_index=7,
            sample_index=1,
            prompt="3+4=",
            answer="7",
            seed=11,
            max_new_tokens=2,
            temperature=0.9,
            minibatch_hint=0,
            released_at=1.0,
        ),
        "sample": samples[1],
        "group": Group(
            run=run,
            step=STEP,
            policy_version=STEP,
            group_id=f"{STEP}:0",
            prompt_index=7,
            samples=samples,
            advantages=np.array([-1, 1, -1, 1], dtype=np.float32),
            frontier=FrontierStatus(minibatch=0, position=0, minibatch_size=2, needed=1, total_groups=4),
            allocation=AllocationRecord(initial=4, counts=[4]),
            completed_at=3.0,
        ),
        # group 3:0 is final at 4 samples (the aggregator emits it), 3:1 is open (the policy decides)
        "plan": StepPlan(
            run=run,
            step=STEP,
            policy_version=STEP,
            policy="fgd",
            groups=[
                GroupPlan(group_id=f"{STEP}:{g}", prompt_index=7 + g, n=4, final=g != 1) for g in range(4)
            ],
            minibatches=2,
            groups_per_minibatch=2,
            created_at=1.0,
        ),
        "allocation": Allocation(
            run=run,
            step=STEP,
            policy_version=STEP,
            group_id=f"{STEP}:1",
            prompt_index=8,
            n=6,
            final=True,
            status="final",
            reason="extend",
            initial=4,
            counts=[4, 6],
            revision=1,
            minibatch_hint=1,
            created_at=1.0,
        ),
        # more groups than the trainer's plan below: a valid seal never ends its step
        "seal": StepSeal(run=run, step=STEP, policy_version=STEP, n_groups=4, skipped=[], created_at=1.0),
        "group_stats": GroupStats(
            run=run,
            step=STEP,
            policy_version=STEP,
            group_id=f"{STEP}:1",
            prompt_index=8,
            n=4,
            rewards=np.array([0, 1, 0, 1], dtype=np.float32),
            lengths=np.array([3, 4, 5, 6], dtype=np.int32),
            truncated=1,
            emitted=False,
            created_at=1.0,
        ),
        "policy_version": PolicyVersion(
            run=run,
            step=STEP,
            policy_version=STEP,
            path="/w/v3",
            sha256={"model.safetensors": "ab" * 32},
            published_at=1.0,
        ),
        "metrics": StepMetrics(
            run=run,
            step=STEP,
            policy_version=STEP,
            mode="cgp",
            rollout_to_train_end_s=1.0,
            trainer_wait_ratio=0.5,
            first_group_s=0.1,
            reward_mean=0.5,
            groups=4,
            samples=16,
            tokens=80,
            fence_rejections=0,
            dead_letters=1,
            train_busy_s=0.5,
            rollout_makespan_s=0.8,
            last_minibatch_train_s=0.2,
            dispatch_latency_p50_s=0.01,
            dispatch_latency_p99_s=0.02,
            minibatches=[[f"{STEP}:0", f"{STEP}:1"]],
        ),
        "dead_letter": DeadLetter(
            run=run,
            step=STEP,
            policy_version=STEP,
            source_stream=f"rp:{{{run}}}:samples",
            entry_id="1-0",
            role="aggregator",
            reason="decode: x",
            payload=b"\xc1",
            created_at=1.0,
        ),
    }


KINDS = ("request", "sample", "group", "plan", "allocation", "seal", "group_stats", "policy_version",
         "metrics", "dead_letter")  # fmt: skip
FUZZ_RUN = "fuzz"
SEEDS = {
    kind: msgpack.unpackb(DEFAULT_CODEC.encode(ev), raw=False) for kind, ev in make_events(FUZZ_RUN).items()
}


# ----------------------------------------------------------------------------------------------- mutations


class Draws:
    """The few choices a mutation makes, from one seeded ``random.Random``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def n(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, seq: Sequence[T]) -> T:
        return seq[self.rng.randrange(len(seq))]

    def coin(self) -> bool:
        return self.rng.random() < 0.5

    def blob(self, lo: int, hi: int) -> bytes:
        return self.rng.randbytes(self.rng.randint(lo, hi))


def _pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


WRONG = [
    None, True, False, 0, -1, -(2**31), 2**31, -(2**63), 2**64 - 1, math.nan, math.inf, -math.inf, 0.5,
    "", "x", "nan", "3", "\x00\udfff"[:1], b"", b"\x00", b"\x00" * 3, b"\x00" * 8, [], [1, 2], [[1]], [None],
    {}, {"a": 1}, {"kind": "sample"},
]  # fmt: skip
INT_EDGES = [0, -1, -2, -(2**31), 2**31 - 1, 2**31, -(2**63), 2**63 - 1, 2**64 - 1]
FLOAT_EDGES = [math.nan, math.inf, -math.inf, -0.0, 1e308, -1e-320]
ARRAY_FIELDS = {"prompt_ids": "<i4", "response_ids": "<i4", "logprobs": "<f4", "advantages": "<f4",
                "rewards": "<f4", "lengths": "<i4"}  # fmt: skip


def _wrong_array(d: Draws, dtype: str, n: int) -> Any:
    """A packed array of the wrong dtype or length, or not packed at all."""
    op = d.n(0, 9)
    if op == 0:
        return np.arange(n, dtype="<f8").tobytes()  # float64: twice the bytes
    if op == 1:
        return np.arange(n, dtype="<i8").tobytes()
    if op == 2:
        return b"\x01" * d.n(1, 4 * n + 3)  # any length, often not a multiple of 4
    if op == 3:
        return np.full(d.n(0, 3 * n + 2), np.nan if dtype == "<f4" else -1, dtype=dtype).tobytes()
    if op == 4:
        return np.array([np.nan, np.inf, -np.inf, 1e38], dtype="<f4").tobytes()  # read as int32 too
    if op == 5:
        return [d.pick(INT_EDGES + FLOAT_EDGES) for _ in range(d.n(0, 4))]
    if op == 6:
        return b""
    if op == 7:
        return np.arange(n, dtype=">i4").tobytes()  # big-endian
    if op == 8:
        return [[1, 2], [3]]
    return d.pick(WRONG)


def _targets(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The maps a mutation may touch: the event, its samples or plan groups, its frontier, allocation."""
    out = [obj]
    for name in ("samples", "groups"):
        if isinstance(obj.get(name), list):
            out += [s for s in obj[name] if isinstance(s, dict)]
    for name in ("frontier", "allocation"):
        if isinstance(obj.get(name), dict):
            out.append(obj[name])
    return out


@dataclass
class Dup:
    """A map to pack with one key twice (msgpack allows it; the decoder keeps the last)."""

    obj: dict[str, Any]
    key: str
    first: Any


def _pack_dup(d: Dup) -> bytes:
    items = list(d.obj.items())
    n = len(items) + 1
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    return head + _pack(d.key) + _pack(d.first) + b"".join(_pack(k) + _pack(v) for k, v in items)


def _structural(d: Draws, obj: dict[str, Any]) -> Dup | None:
    targets = _targets(obj)
    target = targets[d.n(0, len(targets) - 1)]
    if not target:
        return None
    key = d.pick(sorted(target))
    value = target[key]
    op = d.pick(["delete", "duplicate", "wrong type", "edge", "array", "shrink group", "add"])
    if op == "delete":
        del target[key]
    elif op == "duplicate":
        return Dup(obj, key, d.pick([*WRONG, value]))
    elif op == "wrong type":
        target[key] = d.pick(WRONG)
    elif op == "edge":  # negative sizes, huge ints, NaN and infinities where numbers belong
        if isinstance(value, bool) or not isinstance(value, int | float):
            target[key] = d.pick(INT_EDGES + FLOAT_EDGES)
        elif isinstance(value, int):
            target[key] = d.pick(INT_EDGES)
        else:
            target[key] = d.pick(FLOAT_EDGES)
    elif op == "array":
        name = d.pick(sorted(ARRAY_FIELDS))
        holder = next((t for t in targets if name in t), None)
        if holder is None:
            target[key] = d.pick(WRONG)
        else:
            n = len(holder[name]) // 4 if isinstance(holder[name], bytes) else 4
            holder[name] = _wrong_array(d, ARRAY_FIELDS[name], n)
    elif op == "shrink group" and isinstance(obj.get("samples"), list):
        k = d.n(0, len(obj["samples"]))  # a group of k samples, advantages to match or not
        obj["samples"] = obj["samples"][:k]
        if d.coin() and isinstance(obj.get("advantages"), bytes):
            obj["advantages"] = obj["advantages"][: 4 * k]
    else:
        target[d.pick(["x", "kind", "extra", ""])] = d.pick(WRONG)
    return None


HUGE_HEADERS = [
    b"\xc6\xff\xff\xff\xff",  # bin 32 of 4 GiB - 1
    b"\xc5\xff\xff",  # bin 16 of 64 KiB - 1
    b"\xdb\x7f\xff\xff\xff",  # str 32 of 2 GiB - 1
    b"\xdd\xff\xff\xff\xff",  # array 32 of 2**32 - 1 elements
    b"\xdf\xff\xff\xff\xff",  # map 32 of 2**32 - 1 pairs
    b"\xc9\xff\xff\xff\xff\x05",  # ext 32
]


def _bytes_op(d: Draws, buf: bytearray) -> None:
    if not buf:
        buf += d.blob(0, 4)
        return
    i = d.n(0, len(buf) - 1)
    op = d.pick(["flip", "set", "truncate", "insert", "delete", "duplicate", "huge"])
    if op == "flip":
        buf[i] ^= 1 << d.n(0, 7)
    elif op == "set":
        buf[i] = d.pick([0x00, 0xC1, 0xFF, 0x7F, 0x80, 0xC0, 0xDC, 0xDE])
    elif op == "truncate":
        del buf[i:]
    elif op == "insert":
        buf[i:i] = d.blob(1, 8)
    elif op == "delete":
        del buf[i : i + d.n(1, 16)]
    elif op == "duplicate":
        j = min(len(buf), i + d.n(1, 32))
        buf[j:j] = buf[i:j]
    else:  # a length header that promises far more than follows
        buf[i:i] = d.pick(HUGE_HEADERS)


SEMANTIC_INTS = ("step", "policy_version", "sample_index", "n", "completed", "initial", "revision",
                 "prompt_index", "n_groups", "minibatches", "groups_per_minibatch", "minibatch", "position",
                 "minibatch_size", "needed", "total_groups", "minibatch_hint", "queue_share_of", "truncated",
                 "max_new_tokens", "groups", "samples")  # fmt: skip
SEMANTIC_STRS = ("run", "group_id", "sample_id", "request_id", "mode", "policy", "status", "finish_reason",
                 "worker")  # fmt: skip


def _semantic(d: Draws, obj: dict[str, Any]) -> None:
    """A well-typed edit: the event still decodes, and the role's own checks must catch it
    (stale versions, other runs, indices outside the group, NaN rewards, …)."""
    targets = _targets(obj)
    target = targets[d.n(0, len(targets) - 1)]
    ints = [k for k in SEMANTIC_INTS if isinstance(target.get(k), int) and not isinstance(target[k], bool)]
    strs = [k for k in SEMANTIC_STRS if isinstance(target.get(k), str)]
    floats = [k for k, v in target.items() if isinstance(v, float)]
    bools = [k for k, v in target.items() if isinstance(v, bool)]
    kind = d.n(0, 3)
    if kind == 0 and ints:
        target[d.pick(ints)] = d.pick([-1, 0, 1, 2, 4, 5, 99, -(2**31), 2**62])
    elif kind == 1 and strs:
        target[d.pick(strs)] = d.pick(
            ["", "other", "3:1", "2:0", "sync", "open", "closed", "skipped", "x" * 300]
        )
    elif kind == 2 and bools:  # final, sealed, emitted
        key = d.pick(bools)
        target[key] = not target[key]
    elif floats:
        target[d.pick(floats)] = d.pick(FLOAT_EDGES)


def mutate(d: Draws, seed: dict[str, Any]) -> bytes:
    """A mutation of a valid encoding: well-typed or structural edits, then (or only) byte damage."""
    obj = msgpack.unpackb(_pack(seed), raw=False)  # a deep copy
    dup: Dup | None = None
    mode = d.n(0, 9)
    if mode < 3:  # well-typed, 1-3 edits
        for _ in range(d.n(1, 3)):
            _semantic(d, obj)
    elif mode < 8:  # structural, 1-3 edits
        for _ in range(d.n(1, 3)):
            dup = _structural(d, obj) or dup
    data = _pack_dup(dup) if dup is not None else _pack(obj)
    if mode >= 6:  # bytes: alone (8-9) or on top of a structural edit (6-7)
        buf = bytearray(data)
        for _ in range(d.n(1, 4)):
            _bytes_op(d, buf)
        data = bytes(buf)
    return data


def make_payload(d: Draws, kinds: tuple[str, ...], seeds: dict[str, Any] = SEEDS) -> bytes:
    """Mostly mutations of ``kinds``; now and then a valid event (of any kind) or random bytes."""
    roll = d.n(0, 19)
    if roll == 0:
        return _pack(seeds[d.pick(KINDS)])
    if roll == 1:
        return d.blob(0, 64)
    return mutate(d, seeds[d.pick(kinds)])


SEEDS_ST = st.integers(0, 2**64 - 1)
"""Each example is one integer: the seed of a ``random.Random`` that makes every choice of the
mutation (``make_payload``).  One draw per example instead of dozens keeps 10,000 examples a target
within the CI budget; a failure is reported as its seed, which reproduces it exactly."""


def payload(seed: int, kinds: tuple[str, ...], seeds: dict[str, Any] = SEEDS) -> bytes:
    return make_payload(Draws(random.Random(seed)), kinds, seeds)


# ----------------------------------------------------------------------------------------------- decoders


def _count_decode(target: str, data: bytes) -> Event | None:
    c = COUNTS[target]
    c["examples"] += 1
    try:
        ev = DEFAULT_CODEC.decode(data)
    except CodecError as e:
        assert str(e)
        c["rejects"] += 1
        return None
    assert isinstance(ev, Event) and ev.schema_version == SCHEMA_VERSION
    back = DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(ev))  # what decoded is valid: it round-trips
    assert type(back) is type(ev)
    c["decoded"] += 1
    return ev


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_decoder(kind: str) -> None:
    @FUZZ
    @given(SEEDS_ST)
    def run(seed: int) -> None:
        _count_decode(f"decode {kind}", payload(seed, (kind,)))

    run()
    c = COUNTS[f"decode {kind}"]
    assert c["examples"] >= EXAMPLES
    assert c["rejects"] > EXAMPLES // 4 and c["decoded"] > 0  # both paths are exercised


# ----------------------------------------------------------------------------------------------- stand-ins


class Countdown:
    """A stop event that reads unset ``n`` times, then set: the handlers' loops run ``n`` rounds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0


class Drained:
    """A stop event that is set once the trainer's read queue is empty."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def is_set(self) -> bool:
        return self.trainer.queue.empty()


class FakeEngine:
    capacity = 4

    async def start(self) -> None:
        pass

    async def generate(self, req: RolloutRequest) -> Generation:
        n = 2
        return Generation(np.arange(3, dtype=np.int32), np.arange(n, dtype=np.int32),
                          np.full(n, -0.1, dtype=np.float32), req.answer[:1] or "?", "stop")  # fmt: skip

    async def load_weights(self, pv: PolicyVersion) -> None:
        pass

    async def close(self) -> None:
        pass


class FakeBackend:
    def begin_step(self, version: int) -> None:
        pass

    def accumulate(self, group: Group) -> None:
        pass

    def optimizer_step(self) -> dict[str, float]:
        return {}


# ----------------------------------------------------------------------------------------------- roles


@dataclass
class Outcome:
    """What a handler did with one entry, read back from Redis (fake or real)."""

    dlq: list[DeadLetter]  # new dead letters
    counter: int  # how much ``dead_letters`` went up
    acked: bool


class Harness:
    """Runs one role's handler on one entry and checks the invariants; shared by fake and real Redis."""

    def __init__(self, role: str, stream: str, cfg: Config, out: Path) -> None:
        self.role = role
        self.stream = stream  # short name
        self.cfg = cfg
        self.out = out
        self.controller: Controller | None = None

    async def handle(self, b: Broker, entry: Entry, inbox: Callable[[Entry], None]) -> None:
        """Drive the role's own code on ``entry`` (read from its stream by ``inbox`` or ``b.read``)."""
        cfg = self.cfg
        if self.role == "rollout":
            w = RolloutWorker(cfg, b, FakeEngine(), "w-fuzz")
            w.version = STEP
            stop = asyncio.Event()
            stop.set()  # a request of a later version waits for its weights: stopping, it stays pending
            await w.admit(entry, stop)
            await asyncio.gather(*w.inflight.values())  # generation of an admitted request
        elif self.role == "aggregator":
            agg = Aggregator(cfg, b, "agg-fuzz")
            # three samples of group 3:0 are in: a fourth valid one completes it and it is emitted
            others = make_events(b.run)["group"]
            assert isinstance(others, Group)
            agg.partial[f"{STEP}:0"] = Partial({s.sample_index: (s, f"0-{s.sample_index + 1}")
                                                for s in others.samples if s.sample_index != 1})  # fmt: skip
            await agg.on_entry(entry)
        elif self.role == "trainer":
            t = Trainer(cfg, b, FakeBackend(), self.out)  # type: ignore[arg-type]
            inbox(entry)
            await t._reader(Countdown(1))  # type: ignore[arg-type]
            plan = StepPlan(run=b.run, step=STEP, policy_version=STEP, policy="fifo",
                            groups=[GroupPlan(group_id=f"{STEP}:{g}", prompt_index=g, n=4) for g in range(2)],
                            minibatches=1, groups_per_minibatch=2, created_at=1.0)  # fmt: skip
            # 2 groups: the step never completes here, so train_step returns once the queue is drained
            assert await t.train_step(STEP, plan, Drained(t)) is None  # type: ignore[arg-type]
        elif self.role == "controller":
            ctl = self._controller(b)
            inbox(entry)
            await ctl.audit_control(Countdown(1))  # type: ignore[arg-type]
        else:  # the controller's feedback: group statistics to its policy, one round of ``drive``
            ctl = self._controller(b)
            plan = await b.plan(STEP)
            assert plan is not None
            view = ctl.view_of(plan)
            for g in view.groups.values():
                g.released = g.target  # every request out: the round only reads feedback and decides
            inbox(entry)
            await ctl.drive(STEP, plan, view, Countdown(1))  # type: ignore[arg-type]

    def _controller(self, b: Broker) -> Controller:
        if self.controller is None:
            self.controller = Controller(self.cfg, b)  # loads the dataset: once per target
        self.controller.b = b
        return self.controller

    def check(self, target: str, entry: Entry, o: Outcome) -> None:
        c = COUNTS[target]
        assert len(o.dlq) in (0, 1), [d.reason for d in o.dlq]
        assert o.counter == len(o.dlq)  # every reject is counted, and only rejects
        try:
            ev: Event | None = DEFAULT_CODEC.decode(entry.data)
        except CodecError:
            ev = None
        if ev is None:  # what does not decode is always dead-lettered, as a decode failure
            assert len(o.dlq) == 1 and o.dlq[0].reason.startswith("decode:"), entry.data
        if o.dlq:
            dl = o.dlq[0]
            assert dl.reason.strip() and dl.role == self.role
            assert (dl.source_stream, dl.entry_id, dl.payload) == (entry.stream, entry.id, entry.data)
            assert o.acked  # acknowledged with the dead letter: never redelivered
            c["rejects"] += 1
            c["dlq"] += len(o.dlq)
            c["counter"] += o.counter
            c["reject: " + re.split(r"[:'\d]", dl.reason)[0].strip(" -")[:40]] += 1
        else:
            assert ev is not None and ev.kind in ROLE_ACCEPTS[self.role], ev
            c["accepted"] += 1


# role (a label: the Broker's role and the dlq's) -> the stream its handler reads
ROLES = {
    "rollout": "requests",
    "aggregator": "samples",
    "trainer": "groups",
    "controller": "control",
    "controller-feedback": "feedback",
}
ROLE_KINDS = {  # the kinds whose mutations go to the role
    "rollout": ("request",),
    "aggregator": ("sample", "allocation"),
    "trainer": ("group",),
    "controller": ("plan", "policy_version", "metrics"),
    "controller-feedback": ("group_stats",),
}
ROLE_ACCEPTS = {**ROLE_KINDS, "trainer": ("group", "seal")}  # the kinds a role takes when valid


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def fuzz_cfg(tmp_path_factory: pytest.TempPathFactory) -> tuple[Config, Path]:
    out = tmp_path_factory.mktemp("fuzz")
    return make_config(out, FUZZ_RUN, *EMULATED_FAST), out


class RealRole:
    """One role's handler over the session's real ``redis-server``: XADD, XREADGROUP, the real
    transactions and Lua script, and the dlq/stats read back with XRANGE/HGET/XPENDING."""

    GROUP: ClassVar[dict[str, str]] = {"rollout": "rollout", "aggregator": "aggregator", "trainer": "trainer",
             "controller": "controller", "controller-feedback": "controller"}  # fmt: skip

    def __init__(self, role: str, cfg: Config, out: Path, redis_url: str, run: str) -> None:
        self.role, self.run, self.group = role, run, self.GROUP[role]
        self.h = Harness(role, ROLES[role], cfg.model_copy(update={"run": run}), out)
        self.redis_url = redis_url
        self.seeds = {kind: msgpack.unpackb(DEFAULT_CODEC.encode(ev), raw=False)
                      for kind, ev in make_events(run).items()}  # fmt: skip

    async def start(self) -> None:
        self.r = connect(self.redis_url)
        self.b = Broker(self.r, self.run, self.role)
        ev = make_events(self.run)
        await self.r.set(self.b.keys.plan(STEP), DEFAULT_CODEC.encode(ev["plan"]))
        await self.r.set(self.b.keys.version, DEFAULT_CODEC.encode(ev["policy_version"]))
        self.stream = getattr(self.b.keys, ROLES[self.role])
        await self.b.ensure_group(self.stream, self.group)

    async def one(self, data: bytes) -> tuple[Entry, Outcome]:
        r, b = self.r, self.b
        n0 = await r.xlen(b.keys.dlq)
        c0 = int(await r.hget(b.keys.stats, "dead_letters") or 0)
        raw_id: Any = await r.xadd(self.stream, {DATA: data})
        eid = raw_id.decode()
        entry = Entry(self.stream, eid, {DATA: data})
        if self.role in ("rollout", "aggregator"):  # these handlers take the entry as the role read it
            [entry] = await b.read(self.stream, self.group, "fuzz", count=1, block_ms=100)
            assert entry.id == eid
        # the trainer's and the controller's own loops read it from the stream (XREADGROUP)
        await self.h.handle(b, entry, lambda e: None)
        n = await r.xlen(b.keys.dlq) - n0
        rows: Any = await r.xrevrange(b.keys.dlq, count=n) if n > 0 else []
        dls = [DEFAULT_CODEC.decode_as(f[DATA], DeadLetter) for _id, f in reversed(rows)]
        pending: Any = await r.xpending_range(self.stream, self.group, min=eid, max=eid, count=1)
        if self.role == "trainer" and pending:  # accepted groups wait for the step's commit: finish it
            await r.xack(self.stream, self.group, eid)
        counter = int(await r.hget(b.keys.stats, "dead_letters") or 0) - c0
        return entry, Outcome(dls, counter, not pending)

    def mutated(self, seed: int) -> bytes:
        return payload(seed, ROLE_KINDS[self.role], self.seeds)


@pytest.fixture()
def real_role(
    request: pytest.FixtureRequest,
    loop: asyncio.AbstractEventLoop,
    fuzz_cfg: tuple[Config, Path],
    redis_url: str,
    run_name: str,
) -> Iterator[Callable[[str], RealRole]]:
    made: list[RealRole] = []

    def make(role: str) -> RealRole:
        rr = RealRole(role, *fuzz_cfg, redis_url, run_name)
        loop.run_until_complete(rr.start())
        made.append(rr)
        return rr

    yield make
    for rr in made:
        loop.run_until_complete(rr.r.aclose())


@pytest.mark.parametrize("role", sorted(ROLES))
def test_fuzz_role(role: str, loop: asyncio.AbstractEventLoop, real_role: Callable[[str], RealRole]) -> None:
    """``EXAMPLES`` mutated entries through the role's own handler and the real ``redis-server``."""
    rr = real_role(role)
    target = f"{role} (real Redis)"

    @FUZZ
    @given(SEEDS_ST)
    def run_one(seed: int) -> None:
        COUNTS[target]["examples"] += 1
        entry, o = loop.run_until_complete(rr.one(rr.mutated(seed)))
        rr.h.check(target, entry, o)

    run_one()
    c = COUNTS[target]
    assert c["examples"] >= EXAMPLES and c["rejects"] == c["dlq"] == c["counter"]
    assert c["rejects"] + c["accepted"] == c["examples"]
    assert c["rejects"] > EXAMPLES // 4 and c["accepted"] > 0  # both paths are exercised


def test_an_empty_group_is_dead_lettered_not_trained(
    loop: asyncio.AbstractEventLoop, real_role: Callable[[str], RealRole]
) -> None:
    """Found by this fuzzing: a group of no samples used to pass the fence and crash the trainer
    (``max()`` of no finish times).  The ``Group`` model now refuses it, so it is dead-lettered."""
    rr = real_role("trainer")
    obj = dict(rr.seeds["group"], samples=[], advantages=b"")
    _entry, o = loop.run_until_complete(rr.one(_pack(obj)))
    assert len(o.dlq) == 1 and o.counter == 1 and o.acked  # what a fix must do: dead-letter it


def test_a_nan_reward_is_dead_lettered_not_emitted(
    loop: asyncio.AbstractEventLoop, real_role: Callable[[str], RealRole]
) -> None:
    """Found by this fuzzing: a NaN (or inf, or 1e308) reward used to be accepted and turn its
    group's advantages into NaN.  ``Sample`` now requires a finite reward within +-1e6."""
    rr = real_role("aggregator")
    _entry, o = loop.run_until_complete(rr.one(_pack(dict(rr.seeds["sample"], reward=math.nan))))
    rows: Any = loop.run_until_complete(rr.r.xrange(rr.b.keys.groups))
    groups = [DEFAULT_CODEC.decode_as(f[DATA], Group) for _id, f in rows]
    assert all(np.isfinite(g.advantages).all() for g in groups), [g.advantages for g in groups]
    assert len(o.dlq) == 1


def test_valid_samples_complete_and_emit_a_group(
    loop: asyncio.AbstractEventLoop, real_role: Callable[[str], RealRole]
) -> None:
    """The aggregator harness is not vacuous: the seed sample completes group 3:0, which is emitted."""
    rr = real_role("aggregator")
    _entry, o = loop.run_until_complete(rr.one(_pack(rr.seeds["sample"])))
    rows: Any = loop.run_until_complete(rr.r.xrange(rr.b.keys.groups))
    groups = [DEFAULT_CODEC.decode_as(f[DATA], Group) for _id, f in rows]
    assert o.dlq == [] and o.acked and [(g.group_id, len(g.samples)) for g in groups] == [(f"{STEP}:0", 4)]


def test_valid_feedback_reaches_the_policy(
    loop: asyncio.AbstractEventLoop, real_role: Callable[[str], RealRole]
) -> None:
    """The feedback harness is not vacuous: the seed's stats complete the open group 3:1, and the
    policy's decision on it is written (``alloc:k``) while the entry is acknowledged."""
    rr = real_role("controller-feedback")
    _entry, o = loop.run_until_complete(rr.one(_pack(rr.seeds["group_stats"])))
    (raw,) = loop.run_until_complete(rr.r.hgetall(rr.b.keys.alloc(STEP))).values()
    alloc = DEFAULT_CODEC.decode_as(raw, Allocation)
    assert (alloc.group_id, alloc.final, alloc.n) == (f"{STEP}:1", True, 4)
    assert o.dlq == [] and o.acked


@pytest.fixture(scope="module", autouse=True)
def report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    lines = ["", "fuzz counts: examples, rejects, dlq entries, dead_letters counter, accepted"]
    for target, c in COUNTS.items():
        if target.startswith("decode"):
            lines.append(f"  {target:<24} {c['examples']:>6} examples  {c['rejects']:>6} CodecError"
                         f"  {c['decoded']:>6} decoded (and round-trip)")  # fmt: skip
            continue
        lines.append(
            f"  {target:<24} {c['examples']:>6} examples  {c['rejects']:>6} rejects  {c['dlq']:>6} dlq"
            f"  {c['counter']:>6} counter  {c['accepted']:>6} accepted"
        )
        why = [
            (k.split(": ", 1)[1], v) for k, v in c.most_common() if k.startswith(("reject: ", "known bug"))
        ]
        lines.append("      " + ", ".join(f"{k} {v}" for k, v in why))
    capman = request.config.pluginmanager.getplugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
        print("\n".join(lines), flush=True)
