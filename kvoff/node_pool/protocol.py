"""The node pool's wire format: length-prefixed binary frames over a Unix socket.

A frame is a 16-byte header ``magic "KVNP", version u16, op u16, request id u32, payload
length u32`` (little-endian) and the payload. A key list is ``count u32, width u16`` and the
keys back to back (all of ``width`` bytes), or with width 0, per key ``length u16`` and its
bytes. Replies carry the request's id and op ``op | REPLY``, or ``ERROR`` with a UTF-8
message. An op with the :data:`NO_REPLY` bit (completions, touches and loads of leased keys:
the engine has their answer) gets no reply when it succeeds, so an engine sends it without
waiting; when it fails, an ``ERROR`` frame with its request id comes back ahead of the next
reply. A frame that cannot be parsed (another magic or version, a payload over
:data:`MAX_PAYLOAD_BYTES`, a truncated key list) is a :class:`ProtocolError`: the server
answers it with an error and, when the framing itself is lost, closes that connection only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

__all__ = [
    "COMPLETE_LOAD",
    "COMPLETE_STORE",
    "ERROR",
    "HEADER",
    "HELLO",
    "LOOKUP",
    "LOOKUP_AHEAD",
    "MAX_KEY_BYTES",
    "MAX_PAYLOAD_BYTES",
    "NO_REPLY",
    "NO_REPLY_OPS",
    "OPS",
    "PREPARE_LOAD",
    "PREPARE_STORE",
    "REPLY",
    "REPORT_LOOKUPS",
    "RESERVE",
    "STATE_MISSING",
    "STATE_PENDING",
    "STATE_READY",
    "STATUS",
    "STATUS_COUNTS",
    "STORE_RESERVED",
    "TAKE_EVENTS",
    "TOUCH",
    "VERSION",
    "ProtocolError",
    "decode_json",
    "decode_keys",
    "decode_slots",
    "decode_states",
    "encode_json",
    "encode_keys",
    "encode_prefixed_keys",
    "encode_slots",
    "encode_states",
    "frame",
    "parse_header",
]

MAGIC = b"KVNP"
VERSION = 6
HEADER = struct.Struct("<4sHHII")
MAX_PAYLOAD_BYTES = 64 << 20
"""Largest payload accepted (64 MiB: about two million 16-byte keys)."""
MAX_KEY_BYTES = 1024
"""Longest key accepted (kvoff's keys are 16 bytes, vLLM's block hashes 32, plus a prefix)."""

HELLO, LOOKUP, PREPARE_LOAD, COMPLETE_LOAD, PREPARE_STORE, COMPLETE_STORE, TOUCH, STATUS = range(
    1, 9
)
LOOKUP_AHEAD = 9
"""Keys' states, and those of the keys that followed the last one when they were stored (its
chain), up to a count: ``ahead u16, answered u32, answered_hits u32`` and a key list (one key,
or an engine's chain of several, head to tail); the reply is a key list (the given keys, each
once, then the chain after them, up to the first missing key), one state byte per key and a
slot list (the slot of each ready key, which the pool leases to the engine
for ``lease_s``; -1 for the others). ``answered`` / ``answered_hits``: look-ups the engine
answered from earlier replies since its last report, and how many were hits (for the pool's
hit rates)."""
TAKE_EVENTS = 10
"""The engine's KV events since its last call: ``prefix`` (8 bytes: the engine's layout, whose
events it gets; the first call subscribes the connection). Reply: ``dropped u64`` (events
lost to a full queue), ``count u32`` and per event ``removed u8``, ``by``: the name of the engine
whose call made it (``length u8`` and UTF-8 bytes; empty: the pool's own, a promotion from its
tiers), and a key list."""
REPORT_LOOKUPS = 11
"""``answered u32, answered_hits u32``: look-ups the engine answered without the pool (from
look-ahead replies and the pool's key filter) since its last report, for the pool's hit rates.
Sent without a reply at the end of an engine step."""
RESERVE = 12
"""``count u32``: free slots for this engine's later stores (:data:`STORE_RESERVED`), evicting
as ``PREPARE_STORE`` does. Reply: ``granted u8`` (0: too few slots can be freed now), then a
slot list (the slots reserved) and a key list (the keys evicted for them). The engine sends it
ahead of need and reads the reply when it comes, so it never waits for it."""
STATUS_COUNTS = b"counts"
"""``STATUS``'s payload for the pool's block counts only (``stored_blocks``, ``free_blocks``,
``pending_blocks``, ``reserved_blocks``, ``evictable_blocks``, and ``pinned_blocks``: the
slots transfers of any engine use now): what an engine's usage gauges read once a second.
An empty payload asks for the whole status, whose key filter scan costs the pool's thread
about a millisecond per 100,000 slots, while every engine's calls wait."""
STORE_RESERVED = 13
"""A key list: the keys are being stored into the engine's first reserved slots, one each, in
the order the ``RESERVE`` replies granted them (so no slot id is sent, and an engine cannot
name a slot that is not its own). Sent without a reply. A key the pool holds already
(another engine stored it first) is not stored: its slot stays the engine's until the
engine's ``COMPLETE_STORE`` of the key, which then frees it."""
OPS = {
    HELLO: "hello",
    LOOKUP: "lookup",
    PREPARE_LOAD: "prepare_load",
    COMPLETE_LOAD: "complete_load",
    PREPARE_STORE: "prepare_store",
    COMPLETE_STORE: "complete_store",
    TOUCH: "touch",
    STATUS: "status",
    LOOKUP_AHEAD: "lookup_ahead",
    TAKE_EVENTS: "take_events",
    REPORT_LOOKUPS: "report_lookups",
    RESERVE: "reserve",
    STORE_RESERVED: "store_reserved",
}
REPLY = 0x100
ERROR = 0xFFFF
NO_REPLY = 0x4000
"""Op bit: no reply on success (only with :data:`NO_REPLY_OPS`)."""
NO_REPLY_OPS = frozenset(
    {PREPARE_LOAD, COMPLETE_LOAD, COMPLETE_STORE, TOUCH, REPORT_LOOKUPS, STORE_RESERVED}
)
"""The ops that may be sent with :data:`NO_REPLY`: those whose reply carries nothing, and
``PREPARE_LOAD`` of keys the engine holds leases on, ``STORE_RESERVED`` into slots it holds (it
knows their slots)."""
STATE_MISSING, STATE_READY, STATE_PENDING = 0, 1, 2
"""A key's state byte: not held, ready (a hit), being stored (retry later)."""


class ProtocolError(ValueError):
    """A frame or payload that does not follow this format; the message says what is wrong."""


def frame(op: int, request_id: int, payload: bytes = b"") -> bytes:
    """One frame: header and payload."""
    return HEADER.pack(MAGIC, VERSION, op, request_id & 0xFFFFFFFF, len(payload)) + payload


def parse_header(head: bytes) -> tuple[int, int, int]:
    """``(op, request_id, payload_length)`` of a 16-byte header.

    Raises:
        ProtocolError: another magic or version, or a payload over the limit.
    """
    magic, version, op, request_id, length = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"not a node pool frame (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(
            f"protocol version {version}, this pool speaks {VERSION}: use the same kvoff "
            "version for the pool and the engines"
        )
    if length > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {length} bytes is over the {MAX_PAYLOAD_BYTES} limit")
    return op, request_id, length


_UNPACK_KEYS_MAX = 4096
"""Key lists up to this many keys of one width are cut by one ``struct`` format (its string
grows with the count)."""


def encode_keys(keys: Sequence[bytes]) -> bytes:
    """A key list (each key 1..:data:`MAX_KEY_BYTES` bytes): ``count u32, width u16`` then,
    when every key has ``width`` bytes (the usual case), the keys back to back; with width 0,
    each key as ``length u16`` and its bytes.

    Raises:
        ProtocolError: an empty or too long key.
    """
    same = _encode_one_width(b"", keys)
    if same is not None:
        return same
    parts = [struct.pack("<IH", len(keys), 0)]
    for k in keys:
        if not 0 < len(k) <= MAX_KEY_BYTES:
            raise ProtocolError(f"a key of {len(k)} bytes; keys are 1..{MAX_KEY_BYTES} bytes")
        parts.append(struct.pack("<H", len(k)))
        parts.append(bytes(k))
    return b"".join(parts)


def encode_prefixed_keys(prefix: bytes, keys: Sequence[bytes]) -> bytes:
    """:func:`encode_keys` of ``[prefix + k for k in keys]``, without making those keys: keys
    of one width are joined with the prefix in one call (4x faster for 200 keys, the keys an
    engine stores in a step).

    Raises:
        ProtocolError: an empty or too long key.
    """
    same = _encode_one_width(prefix, keys)
    if same is not None:
        return same
    if not all(map(len, keys)):  # the prefix would make an empty key look like one
        raise ProtocolError(f"an empty key; keys are 1..{MAX_KEY_BYTES - len(prefix)} bytes")
    return encode_keys([prefix + bytes(k) for k in keys])


def _encode_one_width(prefix: bytes, keys: Sequence[bytes]) -> bytes | None:
    """The key list of ``prefix + k`` for each key when all keys have one width (joined in one
    call), else None.

    Raises:
        ProtocolError: an empty or too long key.
    """
    widths = set(map(len, keys))
    if len(widths) != 1:
        return None
    own, limit = widths.pop(), MAX_KEY_BYTES - len(prefix)
    if not 0 < own <= limit:
        raise ProtocolError(f"a key of {own} bytes; keys are 1..{limit} bytes")
    w = own + len(prefix)
    return struct.pack("<IH", len(keys), w) + prefix + prefix.join(keys)


def decode_keys(buf: bytes | memoryview, offset: int = 0) -> tuple[list[bytes], int]:
    """``(keys, offset after them)`` of a key list at ``offset``.

    Raises:
        ProtocolError: a truncated list, an empty or too long key.
    """
    data = bytes(buf)
    try:
        count, width = struct.unpack_from("<IH", data, offset)
    except struct.error as e:
        raise ProtocolError(f"truncated key list: {e}") from None
    offset += 6
    if width:
        if width > MAX_KEY_BYTES:
            raise ProtocolError(f"keys of {width} bytes; keys are 1..{MAX_KEY_BYTES} bytes")
        end = offset + count * width
        if end > len(data):
            raise ProtocolError(
                f"key list of {count} keys of {width} bytes in {len(data) - offset} bytes"
            )
        if count <= _UNPACK_KEYS_MAX:  # one C call (struct caches the format): 4x a loop
            return list(struct.unpack_from(f"{width}s" * count, data, offset)), end
        return [data[i : i + width] for i in range(offset, end, width)], end
    if count > len(data) - offset:  # each key takes at least 3 bytes
        raise ProtocolError(f"key list of {count} keys in {len(data) - offset} bytes")
    keys = []
    try:
        for _ in range(count):
            (n,) = struct.unpack_from("<H", data, offset)
            offset += 2
            if not 0 < n <= MAX_KEY_BYTES or offset + n > len(data):
                raise ProtocolError(f"a key of {n} bytes at offset {offset} (truncated or bad)")
            keys.append(data[offset : offset + n])
            offset += n
    except struct.error as e:
        raise ProtocolError(f"truncated key list: {e}") from None
    return keys, offset


def encode_slots(slots: Sequence[int]) -> bytes:
    """A list of slot ids (int64)."""
    return struct.pack(f"<I{len(slots)}q", len(slots), *slots)


def decode_slots(buf: bytes | memoryview, offset: int = 0) -> tuple[list[int], int]:
    """``(slot ids, offset after them)``.

    Raises:
        ProtocolError: a truncated list.
    """
    try:
        (count,) = struct.unpack_from("<I", buf, offset)
        slots = list(struct.unpack_from(f"<{count}q", buf, offset + 4))
    except struct.error as e:
        raise ProtocolError(f"truncated slot list: {e}") from None
    return slots, offset + 4 + 8 * count


def encode_states(states: Sequence[int]) -> bytes:
    """One state byte per key (:data:`STATE_MISSING`, :data:`STATE_READY`,
    :data:`STATE_PENDING`)."""
    return bytes(states)


def decode_states(buf: bytes | memoryview, offset: int, count: int) -> tuple[bytes, int]:
    """``(count state bytes, offset after them)``.

    Raises:
        ProtocolError: fewer than ``count`` bytes, or a byte that is not a state.
    """
    states = bytes(buf[offset : offset + count])
    if len(states) != count:
        raise ProtocolError(f"{len(states)} state bytes for {count} keys")
    if states and max(states) > STATE_PENDING:
        raise ProtocolError(f"state byte {max(states)} is not a key state (0, 1 or 2)")
    return states, offset + count


def encode_json(obj: Any) -> bytes:
    """A JSON payload."""
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(buf: bytes | memoryview) -> Any:
    """A JSON payload.

    Raises:
        ProtocolError: not UTF-8 JSON.
    """
    try:
        return json.loads(bytes(buf).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ProtocolError(f"payload is not JSON: {e}") from None
