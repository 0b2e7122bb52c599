"""The on-disk / in-store format of one offloaded block: a fixed-size header, then the payload.

A secondary tier (:mod:`kvoff.tiers.disk`, :mod:`kvoff.tiers.redis_cluster`) stores one CPU
pool slot (one offloaded block of one rank, ``payload_bytes`` bytes) as one object::

    [ header: HEADER_BYTES (4096) bytes ][ payload: payload_bytes bytes ]

The header is ``HEADER_BYTES`` long so that on disk the payload starts 4 KiB-aligned (O_DIRECT
needs the file offset, the length and the buffer aligned to the device's logical block size,
512 B or 4 KiB; see open(2), "O_DIRECT"). Its fields, little-endian (``struct`` format
:data:`_FIELDS`), at offset 0:

=========  =====  ===============================================================
field      bytes  meaning
=========  =====  ===============================================================
magic      8      :data:`MAGIC` (``b"KVOFFBLK"``)
version    4      :data:`FORMAT_VERSION`
hdr_bytes  4      :data:`HEADER_BYTES` (the header's own length)
fprint     16     :attr:`BlockFormat.fingerprint` (model / layout / rank)
length     8      payload length in bytes
checksum   8      xxh3_64 of the payload (xxHash, https://github.com/Cyan4973/xxHash)
stamp      8      write stamp (nanoseconds since the epoch, monotonic per writer)
key_len    2      offload key length, 1..:data:`MAX_KEY_BYTES`
key        64     the offload key, zero-padded
hdr_sum    8      xxh3_64 of all the bytes above (detects a corrupted header)
=========  =====  ===============================================================

The rest of the header is zeros. A block is valid for a reader only when every field matches
what the reader expects (:func:`check_block`); anything else is a miss and is never served.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, NamedTuple

import numpy as np
import xxhash

MAGIC = b"KVOFFBLK"
"""First 8 bytes of every block header."""
FORMAT_VERSION = 1
"""Header format version; a reader rejects other versions (reason ``"version"``)."""
HEADER_BYTES = 4096
"""Fixed header size in bytes (one 4 KiB page, keeps the payload O_DIRECT-aligned on disk)."""
FINGERPRINT_BYTES = 16
"""Length of a layout fingerprint (xxh3_128 digest)."""
MAX_KEY_BYTES = 64
"""Longest offload key a header holds (kvoff's keys are 16..64 bytes)."""

# magic, version, header bytes, fingerprint, payload length, payload checksum, stamp, key length,
# key (padded); then an xxh3_64 of these bytes.
_FIELDS = struct.Struct(f"<8sII{FINGERPRINT_BYTES}sQQQH{MAX_KEY_BYTES}s")
_HDR_SUM = struct.Struct("<Q")
HEADER_USED_BYTES = _FIELDS.size + _HDR_SUM.size
"""Bytes of the header that carry fields (the rest is zero padding)."""

REJECT_REASONS = ("magic", "version", "header", "fingerprint", "key", "length", "checksum")
"""Every reason :func:`check_block` can return, in the order it checks them."""


@dataclass(frozen=True)
class BlockFormat:
    """What a reader expects of every block of one tier: its layout and its size.

    Attributes:
        fingerprint: 16 bytes from :func:`layout_fingerprint` (model, KV cache config, dtype,
            world size, rank, block size...). Blocks of another fingerprint are misses.
        payload_bytes: bytes of one block object (one CPU pool slot of one rank), > 0.

    Raises:
        ValueError: fingerprint not 16 bytes, or payload_bytes not a positive int.
    """

    fingerprint: bytes
    payload_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, bytes) or len(self.fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(
                f"BlockFormat.fingerprint must be {FINGERPRINT_BYTES} bytes, got "
                f"{self.fingerprint!r}; compute it with kvoff.tiers.layout_fingerprint(...)"
            )
        if (
            not isinstance(self.payload_bytes, int)
            or isinstance(self.payload_bytes, bool)
            or self.payload_bytes <= 0
        ):
            raise ValueError(
                f"BlockFormat.payload_bytes must be a positive int (bytes of one CPU pool slot), "
                f"got {self.payload_bytes!r}"
            )

    @property
    def object_bytes(self) -> int:
        """Bytes of one stored object: header + payload."""
        return HEADER_BYTES + self.payload_bytes


def _canonical(value: Any, path: str) -> Any:
    """A JSON-able, deterministic form of ``value`` (no object addresses, sorted sets)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # exact, and NaN/inf stay valid JSON strings
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, np.generic):
        return _canonical(value.item(), path)
    if isinstance(value, (np.dtype, PurePath)) or type(value).__name__ == "dtype":
        return str(value)  # numpy and torch dtypes print their names: "float16", "torch.bfloat16"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, "fields": _canonical(fields, path)}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"layout_fingerprint: key {k!r} in {path} is not a str")
            out[k] = _canonical(v, f"{path}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        items = [_canonical(v, path) for v in value]
        return sorted(items, key=lambda x: json.dumps(x, sort_keys=True))
    raise TypeError(
        f"layout_fingerprint: {path} is a {type(value).__name__} ({value!r}), which has no "
        f"canonical form; pass str/int/float/bool/None, bytes, dtypes, enums, dataclasses, or "
        f"dicts/lists/tuples of those"
    )


def layout_fingerprint(**fields: object) -> bytes:
    """16-byte fingerprint of a model / KV layout: what must match for a stored block to be usable.

    Callers pass everything that changes the meaning of a block's bytes: a description of the
    model and its KV cache config (specs, page sizes), dtype, world_size, rank, block_size,
    block_size_factor, ... The fields are turned into canonical JSON (keys sorted, compact
    separators, floats by ``repr``, dataclasses as ``{"type", "fields"}``, sets sorted, numpy /
    torch dtypes by name) prefixed by ``"kvoff-layout-v1\\n"`` and hashed with xxh3_128
    (xxHash's 128-bit digest, big-endian canonical bytes).

    Returns:
        16 bytes. Equal field values give equal fingerprints in any process and on any machine.

    Raises:
        TypeError: a value has no canonical form (say, an arbitrary object whose repr would
            carry a memory address); the message names the field.
    """
    doc = _canonical(dict(fields), "fields")
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return xxhash.xxh3_128_digest(b"kvoff-layout-v1\n" + text.encode())


def _byte_view(buf: Any, what: str) -> memoryview:
    """A flat ``uint8`` memoryview of a bytes-like object or a C-contiguous numpy array."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{what} must be a C-contiguous array, got strides {buf.strides}")
        buf = buf.reshape(-1).view(np.uint8) if buf.dtype != np.uint8 else buf.reshape(-1)
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def payload_checksum(payload: Any) -> int:
    """xxh3_64 of a payload (bytes-like or C-contiguous numpy array), as an unsigned int."""
    return xxhash.xxh3_64_intdigest(_byte_view(payload, "payload"))


def encode_header(fmt: BlockFormat, key: bytes, payload: Any, *, stamp: int = 0) -> bytes:
    """The ``HEADER_BYTES``-byte header of one block (layout in the module docstring).

    Args:
        fmt: the tier's block format (fingerprint, payload size).
        key: the offload key, 1..:data:`MAX_KEY_BYTES` bytes.
        payload: the block's bytes, ``fmt.payload_bytes`` long (bytes-like or a C-contiguous
            numpy array of any dtype; its raw bytes are hashed).
        stamp: write stamp stored in the header (nanoseconds; tiers use it to order blocks
            by write time when they rebuild their index). Extra to the tier interface.

    Returns:
        ``HEADER_BYTES`` bytes.

    Raises:
        ValueError: key length out of range, or payload not ``fmt.payload_bytes`` bytes.
    """
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"offload key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)} bytes")
    view = _byte_view(payload, "payload")
    if view.nbytes != fmt.payload_bytes:
        raise ValueError(
            f"payload is {view.nbytes} bytes but the tier's BlockFormat.payload_bytes is "
            f"{fmt.payload_bytes}"
        )
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        fmt.fingerprint,
        view.nbytes,
        xxhash.xxh3_64_intdigest(view),
        stamp,
        len(key),
        key,
    )
    head = fields + _HDR_SUM.pack(xxhash.xxh3_64_intdigest(fields))
    return head + bytes(HEADER_BYTES - len(head))


class HeaderInfo(NamedTuple):
    """The fields of a header that passed its own checks (magic, version, header checksum)."""

    fingerprint: bytes
    key: bytes
    payload_bytes: int
    checksum: int
    stamp: int


def decode_header(header: Any) -> tuple[HeaderInfo | None, str | None]:
    """Parse a header. Returns ``(info, None)``, or ``(None, reason)`` with reason ``"magic"``,
    ``"version"`` or ``"header"`` (too short, bad key length or header checksum mismatch)."""
    view = _byte_view(header, "header")
    if view.nbytes < HEADER_USED_BYTES:
        return None, "header"
    if view[: len(MAGIC)] != MAGIC:
        return None, "magic"
    fields = view[: _FIELDS.size]
    magic, version, hdr_bytes, fprint, length, checksum, stamp, key_len, key = _FIELDS.unpack(
        fields
    )
    del magic
    if version != FORMAT_VERSION:
        return None, "version"
    (hdr_sum,) = _HDR_SUM.unpack(view[_FIELDS.size : HEADER_USED_BYTES])
    if hdr_sum != xxhash.xxh3_64_intdigest(fields) or hdr_bytes != HEADER_BYTES:
        return None, "header"
    if not 1 <= key_len <= MAX_KEY_BYTES:
        return None, "header"
    return HeaderInfo(fprint, key[:key_len], length, checksum, stamp), None


def check_block(fmt: BlockFormat, key: bytes, header: Any, payload: Any) -> str | None:
    """Whether a stored block may be served as ``key``'s block under ``fmt``.

    Args:
        fmt: what the reader expects (fingerprint, payload size).
        key: the offload key the reader asked for.
        header: the ``HEADER_BYTES`` bytes read back (bytes-like or uint8 array).
        payload: the payload read back (bytes-like or C-contiguous array).

    Returns:
        None if valid, else the first failing check of :data:`REJECT_REASONS`: ``"magic"``
        (not a kvoff block), ``"version"`` (another format version), ``"header"`` (header
        corrupted: its own xxh3_64 does not match), ``"fingerprint"`` (another model / layout /
        rank), ``"key"`` (another key), ``"length"`` (payload length differs from the header or
        from ``fmt``), ``"checksum"`` (payload xxh3_64 differs: corrupted or torn write).
        ``"fingerprint"`` is a legitimate foreign block; every other reason is corruption.
    """
    info, reason = decode_header(header)
    if info is None:
        return reason
    if info.fingerprint != fmt.fingerprint:
        return "fingerprint"
    if info.key != key:
        return "key"
    view = _byte_view(payload, "payload")
    if info.payload_bytes != fmt.payload_bytes or view.nbytes != info.payload_bytes:
        return "length"
    if xxhash.xxh3_64_intdigest(view) != info.checksum:
        return "checksum"
    return None
