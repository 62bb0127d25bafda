"""msgpack codec for events.  No pickle: untrusted bytes are only ever msgpack-decoded."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import msgpack
from pydantic import TypeAdapter, ValidationError

from rolloutpipe.broker.events import SCHEMA_VERSION, AnyEvent, Event, Group
from rolloutpipe.errors import CodecError

E = TypeVar("E", bound=Event)

_ADAPTER: TypeAdapter[Any] = TypeAdapter(AnyEvent)
MAX_EVENT_BYTES = 64 * 1024 * 1024


class MsgpackCodec:
    """Events as msgpack maps; packed arrays travel as msgpack ``bin``."""

    def encode(self, event: Event) -> bytes:
        out: bytes = msgpack.packb(event.model_dump(mode="python"), use_bin_type=True)
        return out

    def encode_group(self, group: Group, raw_samples: Sequence[bytes | None]) -> bytes:
        """``encode(group)``, with each sample's map spliced in from the bytes it arrived as.

        A group re-embeds its samples, and re-encoding them was most of the aggregator's CPU (the
        token and logprob arrays of G samples, serialized again).  A sample's bytes were decoded and
        validated on the way in, and a map is a map whatever its field order, so splicing them gives
        an event that decodes to the same group.  ``None`` (no bytes kept) encodes that sample anew.
        """
        if len(raw_samples) != len(group.samples):
            raise ValueError(f"{len(raw_samples)} raw samples for a group of {len(group.samples)}")
        head = group.model_dump(mode="python", exclude={"samples"})
        pk = msgpack.Packer(use_bin_type=True)
        out = [pk.pack_map_header(len(head) + 1)]
        for k, v in head.items():
            out += [pk.pack(k), pk.pack(v)]
        out += [pk.pack("samples"), pk.pack_array_header(len(raw_samples))]
        for raw, sample in zip(raw_samples, group.samples, strict=True):
            out.append(raw if raw is not None else pk.pack(sample.model_dump(mode="python")))
        return b"".join(out)

    def decode(self, data: object) -> Event:
        if not isinstance(data, bytes | bytearray):
            raise CodecError(f"expected bytes, got {type(data).__name__}")
        if len(data) > MAX_EVENT_BYTES:
            raise CodecError(f"event of {len(data)} bytes exceeds {MAX_EVENT_BYTES}")
        data = bytes(data)
        try:
            obj = msgpack.unpackb(
                data, raw=False, strict_map_key=True, max_bin_len=MAX_EVENT_BYTES, max_str_len=1 << 20
            )
        except Exception as e:  # msgpack raises a zoo of exception types on garbage
            raise CodecError(f"not msgpack: {type(e).__name__}: {e}") from e
        if not isinstance(obj, dict):
            raise CodecError(f"expected a map, got {type(obj).__name__}")
        kind = obj.get("kind")
        version = obj.get("schema_version")
        if version != SCHEMA_VERSION:
            if isinstance(version, int) and 0 < version < SCHEMA_VERSION:
                raise CodecError(
                    f"schema_version {version} (kind {kind!r}) is from an older RolloutPipe; this one "
                    f"speaks {SCHEMA_VERSION}: run every role of a run at one version (start a new run)"
                )
            raise CodecError(f"unsupported schema_version {version!r} (kind {kind!r})")
        try:
            event: Event = _ADAPTER.validate_python(obj)
        except ValidationError as e:
            raise CodecError(f"invalid {kind!r} event: {e.error_count()} errors: {_short(e)}") from e
        return event

    def decode_as(self, data: object, cls: type[E]) -> E:
        event = self.decode(data)
        if not isinstance(event, cls):
            raise CodecError(f"expected a {cls.__name__}, got kind {event.kind!r}")
        return event


def iter_events(data: bytes) -> Iterator[Event]:
    """Events from a file of concatenated msgpack events (the trainer's consumed-group log)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=MAX_EVENT_BYTES * 4)
    unpacker.feed(data)
    for obj in unpacker:
        try:
            event: Event = _ADAPTER.validate_python(obj)
        except ValidationError as e:
            raise CodecError(f"invalid event in log: {_short(e)}") from e
        yield event


def _short(e: ValidationError) -> str:
    errs = e.errors()[:3]
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in errs)


DEFAULT_CODEC = MsgpackCodec()
