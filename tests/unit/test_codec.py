"""The msgpack codec: every event kind round-trips; anything else is a CodecError, never a crash."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from rolloutpipe.broker.codec import DEFAULT_CODEC, MsgpackCodec
from rolloutpipe.broker.events import (
    SCHEMA_VERSION,
    Event,
    FrontierStatus,
    Group,
    Sample,
)
from rolloutpipe.errors import CodecError
from tests.support.events import (
    RUN,
    make_allocation,
    make_dead_letter,
    make_group,
    make_group_stats,
    make_metrics,
    make_plan,
    make_request,
    make_sample,
    make_seal,
    make_version,
)

ALL_EVENTS: dict[str, Callable[[], Event]] = {
    "request": make_request,
    "sample": make_sample,
    "group": make_group,
    "plan": make_plan,
    "allocation": make_allocation,
    "seal": make_seal,
    "group_stats": make_group_stats,
    "policy_version": make_version,
    "metrics": make_metrics,
    "dead_letter": make_dead_letter,
}


def assert_same(a: Any, b: Any) -> None:
    """Field-by-field equality that understands numpy arrays (dtype and values)."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, BaseModel):  # events and their nested models (frontier, allocation, plan groups)
        assert type(a) is type(b)
        for name in type(a).model_fields:
            assert_same(getattr(a, name), getattr(b, name))
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and a != a:  # NaN
        assert isinstance(b, float) and b != b
    else:
        assert a == b and type(a) is type(b)


def wire(event: Event) -> dict[str, Any]:
    obj = msgpack.unpackb(DEFAULT_CODEC.encode(event), raw=False)
    assert isinstance(obj, dict)
    return obj


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(ALL_EVENTS))
def test_round_trip(kind: str) -> None:
    ev = ALL_EVENTS[kind]()
    assert ev.kind == kind
    data = DEFAULT_CODEC.encode(ev)
    assert isinstance(data, bytes)
    back = DEFAULT_CODEC.decode(data)
    assert_same(ev, back)
    assert DEFAULT_CODEC.encode(back) == data  # stable: re-encoding gives the same bytes
    assert MsgpackCodec().decode_as(data, type(ev)).kind == kind


def test_round_trip_group_keeps_frontier_and_samples() -> None:
    g = make_group()
    back = DEFAULT_CODEC.decode_as(DEFAULT_CODEC.encode(g), Group)
    assert back.frontier == FrontierStatus(
        minibatch=0, position=1, minibatch_size=4, needed=2, total_groups=8
    )
    assert [s.sample_index for s in back.samples] == [0, 1, 2, 3]
    assert [len(s.response_ids) for s in back.samples] == [3, 4, 5, 6]
    assert back.samples[0].prompt_ids.dtype == np.dtype("<i4")
    assert back.samples[0].logprobs.dtype == np.dtype("<f4")
    assert back.advantages.dtype == np.dtype("<f4")


def test_a_group_with_spliced_sample_bytes_decodes_to_the_group_encode_gives() -> None:
    """``encode_group`` (the aggregator's: each sample's bytes as they arrived) against ``encode``
    (the reference: every field packed anew): the same wire map, field for field, and the same group."""
    g = make_group()
    raws: list[bytes | None] = [DEFAULT_CODEC.encode(s) for s in g.samples]
    raws[2] = None  # a sample whose bytes were not kept is packed anew
    spliced = DEFAULT_CODEC.encode_group(g, raws)
    assert msgpack.unpackb(spliced, raw=False) == wire(g)
    assert_same(
        DEFAULT_CODEC.decode_as(spliced, Group), DEFAULT_CODEC.decode_as(DEFAULT_CODEC.encode(g), Group)
    )
    with pytest.raises(ValueError, match="3 raw samples for a group of 4"):
        DEFAULT_CODEC.encode_group(g, raws[:3])


def test_a_spliced_sample_sent_as_a_list_of_ints_still_decodes() -> None:
    """A client may send arrays as msgpack arrays of numbers (the decoder converts them); spliced
    as they came, the group still decodes to the same arrays."""
    g = make_group()
    obj = wire(g.samples[0])
    obj["response_ids"] = [int(x) for x in g.samples[0].response_ids]
    raws: list[bytes | None] = [msgpack.packb(obj, use_bin_type=True), *(None for _ in g.samples[1:])]
    back = DEFAULT_CODEC.decode_as(DEFAULT_CODEC.encode_group(g, raws), Group)
    np.testing.assert_array_equal(back.samples[0].response_ids, g.samples[0].response_ids)
    assert back.samples[0].response_ids.dtype == np.dtype("<i4")


def test_empty_arrays_round_trip() -> None:
    s = make_sample(n_resp=0)
    back = DEFAULT_CODEC.decode_as(DEFAULT_CODEC.encode(s), Sample)
    assert back.response_ids.shape == (0,) and back.logprobs.shape == (0,)


def test_decode_as_wrong_kind() -> None:
    with pytest.raises(CodecError, match="expected a Sample"):
        DEFAULT_CODEC.decode_as(DEFAULT_CODEC.encode(make_plan()), Sample)


# --- the wire format -----------------------------------------------------------------------------


def test_arrays_travel_as_msgpack_bin() -> None:
    s = make_sample(n_resp=7)
    obj = wire(s)
    for name, dtype in (("prompt_ids", "<i4"), ("response_ids", "<i4"), ("logprobs", "<f4")):
        assert isinstance(obj[name], bytes), f"{name} is {type(obj[name]).__name__}, not bin"
        np.testing.assert_array_equal(np.frombuffer(obj[name], dtype=dtype), getattr(s, name))
    assert len(obj["response_ids"]) == 7 * 4
    # raw=True keeps str as bytes too, so check the bin type at the msgpack byte level: 0xc4/c5/c6 = bin
    raw = DEFAULT_CODEC.encode(s)
    key = msgpack.packb("response_ids", use_bin_type=True)
    at = raw.index(key) + len(key)
    assert raw[at] in (0xC4, 0xC5, 0xC6)


def test_group_arrays_are_bin_all_the_way_down() -> None:
    obj = wire(make_group())
    assert isinstance(obj["advantages"], bytes) and len(obj["advantages"]) == 4 * 4
    for s in obj["samples"]:
        assert isinstance(s["prompt_ids"], bytes)
        assert isinstance(s["response_ids"], bytes)
        assert isinstance(s["logprobs"], bytes)
        assert not any(isinstance(v, list) and v and isinstance(v[0], int) for v in s.values())


def test_every_event_carries_the_envelope() -> None:
    for make in ALL_EVENTS.values():
        obj = wire(make())
        assert obj["schema_version"] == SCHEMA_VERSION
        assert {"kind", "schema_version", "run", "step", "policy_version"} <= obj.keys()


# --- bad input -----------------------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def _mutated(make: Any = make_sample, **changes: Any) -> bytes:
    obj = wire(make())
    for k, v in changes.items():
        if v is _DROP:
            del obj[k]
        else:
            obj[k] = v
    return _pack(obj)


_DROP = object()

BAD_INPUTS = {
    "empty": b"",
    "garbage": b"\xc1\xc1\xc1 not msgpack at all",
    "truncated": DEFAULT_CODEC.encode(make_sample())[:-7],
    "trailing bytes": DEFAULT_CODEC.encode(make_plan()) + b"\x00",
    "list": _pack([1, 2, 3]),
    "int": _pack(42),
    "str": _pack("request"),
    "nil": _pack(None),
    "empty map": _pack({}),
    "int keys": b"\x81\x01\x02",  # {1: 2}: strict_map_key refuses non-string keys
    "map missing fields": _pack({"kind": "sample", "schema_version": SCHEMA_VERSION, "run": RUN}),
    "missing field": _mutated(make_sample, reward=_DROP),
    "extra field": _mutated(make_plan, surprise=1),
    "unknown kind": _mutated(make_plan, kind="teleport"),
    "no kind": _mutated(make_plan, kind=_DROP),
    "wrong schema_version": _mutated(make_plan, schema_version=SCHEMA_VERSION + 1),
    "schema_version 0": _mutated(make_plan, schema_version=0),
    "no schema_version": _mutated(make_plan, schema_version=_DROP),
    "schema_version as str": _mutated(make_plan, schema_version="1"),
    "old schema_version": _mutated(make_plan, schema_version=1),
    "plan group of 0 samples": _mutated(
        make_plan, groups=[{"group_id": "3:0", "prompt_index": 24, "n": 0, "final": True}]
    ),
    "groups_per_minibatch 0": _mutated(make_plan, groups_per_minibatch=0),
    "plan without groups": _mutated(make_plan, groups=_DROP),
    "allocation of -1 samples": _mutated(make_allocation, n=-1),
    "bad allocation status": _mutated(make_allocation, status="maybe"),
    "group without allocation": _mutated(make_group, allocation=_DROP),
    "step as str": _mutated(make_plan, step="three"),
    "int32 array of 7 bytes": _mutated(make_sample, response_ids=b"\x01" * 7),
    "float32 array of 5 bytes": _mutated(make_sample, logprobs=b"\x00" * 5),
    "advantages of 3 bytes": _mutated(make_group, advantages=b"\x00" * 3),
    "array as str": _mutated(make_sample, prompt_ids="1,2,3"),
    "array as map": _mutated(make_sample, prompt_ids={"a": 1}),
    "array as nil": _mutated(make_sample, prompt_ids=None),
    "array of maps": _mutated(make_sample, response_ids=[{}]),
    "array of strs": _mutated(make_sample, response_ids=["x"]),
    "int32 overflow in array": _mutated(make_sample, response_ids=[1, 2**40]),
    "nested array": _mutated(make_sample, response_ids=[[1, 2], [3, 4]]),
    "samples not a list": _mutated(make_group, samples={"0": 1}),
    "sample of wrong shape": _mutated(make_group, samples=[[1, 2]]),
    "frontier missing": _mutated(make_group, frontier=_DROP),
    "frontier extra": _mutated(
        make_group,
        frontier={"minibatch": 0, "position": 0, "minibatch_size": 1, "needed": 0, "total_groups": 1, "x": 1},
    ),
    "sha256 of ints": _mutated(make_version, sha256={"a": 1}),
    "ext type": _pack(msgpack.ExtType(5, b"abc")),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises_codec_error(name: str) -> None:
    with pytest.raises(CodecError) as info:
        DEFAULT_CODEC.decode(BAD_INPUTS[name])
    assert str(info.value)


def test_wrong_schema_version_names_the_version() -> None:
    with pytest.raises(CodecError, match=f"schema_version {SCHEMA_VERSION + 1}"):
        DEFAULT_CODEC.decode(BAD_INPUTS["wrong schema_version"])


def test_old_schema_version_says_it_is_from_an_older_rolloutpipe() -> None:
    assert SCHEMA_VERSION > 1
    with pytest.raises(CodecError, match=r"schema_version 1 .*older RolloutPipe"):
        DEFAULT_CODEC.decode(BAD_INPUTS["old schema_version"])
    with pytest.raises(CodecError) as info:  # a version from the future is not called older
        DEFAULT_CODEC.decode(BAD_INPUTS["wrong schema_version"])
    assert "older" not in str(info.value)


def test_packed_array_length_is_named() -> None:
    with pytest.raises(CodecError, match="not a multiple of 4"):
        DEFAULT_CODEC.decode(BAD_INPUTS["int32 array of 7 bytes"])


def test_unknown_kind_is_named() -> None:
    with pytest.raises(CodecError, match="teleport"):
        DEFAULT_CODEC.decode(BAD_INPUTS["unknown kind"])


def test_not_bytes_is_refused() -> None:
    for v in ("a string", None, 12, ["list"]):
        with pytest.raises(CodecError):
            DEFAULT_CODEC.decode(v)


_UNPICKLED: list[str] = []


def _record_unpickle(tag: str) -> str:
    _UNPICKLED.append(tag)
    return tag


class _Trap:
    """Unpickling this calls ``_record_unpickle``: proof that a payload was unpickled."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_record_unpickle, ("unpickled!",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payload_is_rejected_not_unpickled(protocol: int) -> None:
    _UNPICKLED.clear()
    for obj in (_Trap(), make_plan(), {"kind": "plan", "schema_version": SCHEMA_VERSION, "trap": _Trap()}):
        payload = pickle.dumps(obj, protocol=protocol)
        with pytest.raises(CodecError):
            DEFAULT_CODEC.decode(payload)
    assert _UNPICKLED == []
    # sanity: the trap really does fire when unpickled
    assert pickle.loads(pickle.dumps(_Trap(), protocol=protocol)) == "unpickled!"
    assert _UNPICKLED == ["unpickled!"]
    _UNPICKLED.clear()


# --- property: decode never does anything but return an event or raise CodecError -----------------

PROPERTY = settings(
    max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
SEEDS = [DEFAULT_CODEC.encode(make()) for make in ALL_EVENTS.values()]


def _decode_or_codec_error(data: bytes) -> None:
    try:
        ev = DEFAULT_CODEC.decode(data)
    except CodecError as e:
        assert str(e)
        return
    assert isinstance(ev, Event)
    assert ev.schema_version == SCHEMA_VERSION
    # what decoded is a valid event: it encodes again and decodes to the same thing
    assert_same(DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(ev)), ev)


@PROPERTY
@given(st.binary(max_size=512))
def test_property_random_bytes(data: bytes) -> None:
    _decode_or_codec_error(data)


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    buf = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "duplicate"]))
        if not buf:
            break
        i = draw(st.integers(0, len(buf) - 1))
        if op == "flip":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            buf[i] = draw(st.integers(0, 255))
        elif op == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del buf[i : i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del buf[i:]
        else:
            j = draw(st.integers(i, min(len(buf), i + 16)))
            buf[j:j] = buf[i:j]
    return bytes(buf)


@PROPERTY
@given(byte_mutations())
def test_property_byte_mutations(data: bytes) -> None:
    _decode_or_codec_error(data)


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=12)
)
_values = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12,
)


@st.composite
def structural_mutations(draw: st.DrawFn) -> bytes:
    """A valid event's map with fields replaced, dropped or added (possibly inside nested maps)."""
    obj = msgpack.unpackb(draw(st.sampled_from(SEEDS)), raw=False)
    for _ in range(draw(st.integers(1, 3))):
        target = obj
        samples, groups = obj.get("samples"), obj.get("groups")
        frontier, allocation = obj.get("frontier"), obj.get("allocation")
        if isinstance(samples, list) and samples and draw(st.booleans()):
            target = samples[draw(st.integers(0, len(samples) - 1))]
        elif isinstance(groups, list) and groups and draw(st.booleans()):
            target = groups[draw(st.integers(0, len(groups) - 1))]
        elif isinstance(frontier, dict) and frontier and draw(st.booleans()):
            target = frontier
        elif isinstance(allocation, dict) and allocation and draw(st.booleans()):
            target = allocation
        if not isinstance(target, dict) or not target:
            break
        op = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        key = draw(st.sampled_from(sorted(target)))
        if op == "replace":
            target[key] = draw(_values)
        elif op == "drop":
            del target[key]
        else:
            target[draw(st.text(max_size=6))] = draw(_values)
    return _pack(obj)


@PROPERTY
@given(structural_mutations())
def test_property_structural_mutations(data: bytes) -> None:
    _decode_or_codec_error(data)
