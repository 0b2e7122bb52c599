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
version    4      :data:`FORMAT_VERSION` (plain) or :data:`FORMAT_VERSION_MAC` (keyed MAC)
hdr_bytes  4      :data:`HEADER_BYTES` (the header's own length)
fprint     16     :attr:`BlockFormat.fingerprint` (model / layout / rank)
length     8      payload length in bytes
checksum   8      xxh3_64 of the payload (xxHash, https://github.com/Cyan4973/xxHash);
                  0 in a MAC'd block (the MAC covers the payload)
stamp      8      write stamp (nanoseconds since the epoch, monotonic per writer)
key_len    2      offload key length, 1..:data:`MAX_KEY_BYTES`
key        64     the offload key, zero-padded
hdr_sum    8      xxh3_64 of all the bytes above (detects a corrupted header)
mac        32     only in a MAC'd block (version :data:`FORMAT_VERSION_MAC`), at
                  :data:`MAC_OFFSET`: BLAKE3 in keyed-hash mode, with a key derived from
                  the shared secret, see :func:`block_mac`; zeros in a plain block
=========  =====  ===============================================================

The rest of the header is zeros. A block is valid for a reader only when every field matches
what the reader expects (:func:`check_block`); anything else is a miss and is never served.

**Authenticated blocks** (``BlockFormat(..., shared_secret=...)``). The xxh3 checksums prove
integrity, not origin: anyone who can write a tier's store (a Redis namespace, a disk file
another host mounts) can plant a well-formed block under a key. With a shared secret, a block is
written as version :data:`FORMAT_VERSION_MAC` and carries a 32-byte keyed BLAKE3 hash over
:data:`MAC_DOMAIN`, the whole header except the MAC field (padding included), the offload key
(length-prefixed, so a valid block replayed under another key fails) and the payload. A reader
with a secret verifies the MAC first (constant-time compare) and trusts no other field of a block
that fails it; a reader without a secret rejects a MAC'd block. Either way the reason is
``"auth"`` (counted in a tier's ``unauthenticated_blocks``) and the block is never served: a
plain block read with a secret, a MAC'd block read without one or with another secret, and a
block with any byte of its header, payload or key changed. The MAC replaces the payload's xxh3
checksum (its field is 0): it detects every corruption the checksum does, so hashing the payload
twice would only cost time. The header keeps its own xxh3 (``hdr_sum``) so that the disk tier's
restart scan, which reads headers only, still tells a torn header from a block; the MAC is
checked on every read.

**The MAC algorithm** is BLAKE3 (the BLAKE3 specification, J. O'Connor, J.-P. Aumasson,
S. Neves, Z. Wilcox-O'Hearn, https://github.com/BLAKE3-team/BLAKE3-specs) through the
``blake3`` package (the official Rust implementation's Python bindings): its ``keyed_hash`` mode,
a PRF and MAC with a 32-byte key, 32-byte output. The key is derived from the shared secret with
BLAKE3's ``derive_key`` mode under the context string :data:`MAC_KEY_CONTEXT` (so a secret of any
length, 16 bytes or more, gives a uniform 32-byte key, and that key is used for nothing else).
``blake3`` is a dependency of kvoff, imported only when a shared secret is set; where it is
missing, making a :class:`BlockFormat` with a secret raises
:class:`kvoff._optional.MissingExtraError` naming ``pip install "blake3>=1"``.
Format version 2 (kvoff before 2026-11-29) carried HMAC-SHA256 (RFC 2104) instead: such a block
is a counted miss now (``"auth"`` for a reader with a secret, whose MAC check fails first;
``"version"`` for a reader without one and for the disk tier's restart scan), as a version-3
block is for an older reader. Why BLAKE3: on the 2-core AMD EPYC box (AVX-512, SHA extensions,
OpenSSL 3.0), on 512 KiB blocks, single-threaded, keyed BLAKE3 costs 0.25 s per GB (4.05 GB/s),
HMAC-SHA256 0.57 s (1.76 GB/s) and keyed BLAKE2b-256 1.09 s (0.92 GB/s); BLAKE3's multithreaded
mode (``max_threads=AUTO``) was slower there (0.31 s per GB), as the tiers' own threads already
hash blocks in parallel (``kvoff bench tiers`` measures them side by side,
bench/results/tiers/bench-tiers-mac-blake3-2026-11-29.json). Redis gets of 512 KiB blocks with
the MAC ran at 0.86 of those without on that box (HMAC-SHA256: 0.66): its three servers and the
client keep both cores busy, so the MAC's CPU time comes off the gets. AES-256-GMAC through
``cryptography`` (OpenSSL) hashed 2.6x faster than BLAKE3 on one thread of an AVX2 EPYC box but
holds the GIL, so the tiers' threads cannot hash in parallel with it; Redis gets there ran at
0.70-0.78 of plain with it against 0.62-0.64 with BLAKE3, and it would need a per-block key or
nonce (bench/results/tiers/ab-mac-gmac-2026-12-02.json).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hmac
import json
import struct
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, NamedTuple

import numpy as np
import xxhash

MAGIC = b"KVOFFBLK"
"""First 8 bytes of every block header."""
FORMAT_VERSION = 1
"""Header format version of a plain block (xxh3 checksums only)."""
FORMAT_VERSION_MAC = 3
"""Header format version of a block that carries a keyed MAC (written with a shared secret):
keyed BLAKE3 (module docstring). A reader rejects versions other than these two (reason
``"version"``); a reader whose mode differs from the block's rejects it as ``"auth"``. Version 2
was HMAC-SHA256 (kvoff before 2026-11-29): a counted miss now, ``"auth"`` for a reader with a
secret and ``"version"`` for one without. Readers older than this version reject a version-3
block as ``"version"`` (plain readers) or ``"auth"`` (their HMAC check fails): a miss too."""
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
"""Bytes of the header that carry fields (the rest is zero padding, or the MAC then padding)."""
MAC_BYTES = 32
"""Length of a block's MAC in bytes (BLAKE3's default output length)."""
MAC_OFFSET = HEADER_USED_BYTES
"""Offset of the MAC in the header of a MAC'd block (right after ``hdr_sum``)."""
MAC_DOMAIN = b"kvoff-block-mac-v3\x00"
"""Prefix of every MAC's input: names the format version whose MAC it is (the key derivation,
:data:`MAC_KEY_CONTEXT`, already keeps the key apart from any other use of the secret)."""
MAC_KEY_CONTEXT = "kvoff 2026-11-29 block MAC key (shared_secret)"
"""BLAKE3 ``derive_key`` context string of the MAC key: hardcoded, globally unique and
application-specific, as the BLAKE3 specification asks of ``derive_key`` contexts, so that a
secret also used elsewhere gives a key that no other application derives."""
MIN_SECRET_BYTES = 16
"""Shortest shared secret accepted, in bytes (128 bits)."""
_KEY_LEN = struct.Struct("<H")

REJECT_REASONS = (
    "auth", "magic", "version", "header", "fingerprint", "key", "length", "checksum"
)  # fmt: skip
"""Every reason :func:`check_block` can return. ``"auth"`` comes first for a reader with a
shared secret (the MAC is checked before any other field); a reader without one checks the
others in this order and returns ``"auth"`` for a MAC'd block right after ``"header"``."""


@dataclass(frozen=True)
class BlockFormat:
    """What a reader expects of every block of one tier: its layout and its size.

    Attributes:
        fingerprint: 16 bytes from :func:`layout_fingerprint` (model, KV cache config, dtype,
            world size, rank, block size...). Blocks of another fingerprint are misses.
        payload_bytes: bytes of one block object (one CPU pool slot of one rank), > 0.
        shared_secret: the key of the blocks' MAC (bytes, at least :data:`MIN_SECRET_BYTES`),
            the same for every engine that shares the tier; ``None`` (default): plain blocks,
            no MAC (see the module docstring, "Authenticated blocks"). Never shown by
            ``repr``; the configuration key is ``shared_secret`` (``KVOFF_SHARED_SECRET``).

    Raises:
        ValueError: fingerprint not 16 bytes, payload_bytes not a positive int, or a
            shared_secret that is not bytes of at least :data:`MIN_SECRET_BYTES` (the message
            never shows the secret).
        kvoff._optional.MissingExtraError: a shared_secret is set and the ``blake3`` package
            (the MAC, module docstring) is not installed.
    """

    fingerprint: bytes
    payload_bytes: int
    shared_secret: bytes | None = field(default=None, repr=False)

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
        secret = self.shared_secret
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
            what = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
            raise ValueError(
                f"BlockFormat.shared_secret must be bytes of at least {MIN_SECRET_BYTES} (got "
                f"{what}); generate one with `openssl rand -hex 32`, or pass None for no MAC"
            )
        if secret is not None:
            mac_key(secret)  # blake3 is needed: a missing package fails here, not at a read

    @property
    def authenticated(self) -> bool:
        """Whether blocks of this format carry a MAC (a shared secret is set)."""
        return self.shared_secret is not None

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
        ``HEADER_BYTES`` bytes: version :data:`FORMAT_VERSION` with the payload's xxh3_64, or,
        when ``fmt`` has a shared secret, version :data:`FORMAT_VERSION_MAC` with its MAC at
        :data:`MAC_OFFSET` (:func:`block_mac`).

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
    mac = fmt.shared_secret is not None
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION_MAC if mac else FORMAT_VERSION,
        HEADER_BYTES,
        fmt.fingerprint,
        view.nbytes,
        0 if mac else xxhash.xxh3_64_intdigest(view),
        stamp,
        len(key),
        key,
    )
    head = fields + _HDR_SUM.pack(xxhash.xxh3_64_intdigest(fields))
    header = bytearray(HEADER_BYTES)
    header[: len(head)] = head
    if mac:
        assert fmt.shared_secret is not None
        header[MAC_OFFSET : MAC_OFFSET + MAC_BYTES] = block_mac(
            fmt.shared_secret, header, key, view
        )
    return bytes(header)


@functools.cache
def _blake3() -> Any:
    """The ``blake3`` module (imported on first use, then kept: only a shared secret needs it).

    Raises:
        kvoff._optional.MissingExtraError: ``blake3`` is not installed.
    """
    from kvoff._optional import require

    return require("blake3", "the block MAC of the disk and Redis tiers (shared_secret)")


@functools.lru_cache(maxsize=16)
def mac_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key of :func:`block_mac` for ``secret``: BLAKE3 ``derive_key`` with the
    context :data:`MAC_KEY_CONTEXT` and ``secret`` as the key material (the BLAKE3
    specification's key derivation mode; cached: derived once per secret, not per block).

    Raises:
        kvoff._optional.MissingExtraError: the ``blake3`` package is not installed.
    """
    return bytes(_blake3().blake3(secret, derive_key_context=MAC_KEY_CONTEXT).digest())


def block_mac(secret: bytes, header: Any, key: bytes, payload: Any) -> bytes:
    """The 32-byte MAC of one block: BLAKE3 in keyed-hash mode (the BLAKE3 specification,
    https://github.com/BLAKE3-team/BLAKE3-specs; the ``blake3`` package), keyed by the 32 bytes
    BLAKE3 ``derive_key`` makes of ``secret`` under :data:`MAC_KEY_CONTEXT`, over
    :data:`MAC_DOMAIN`, ``header`` without its MAC field (bytes ``0..MAC_OFFSET`` and
    ``MAC_OFFSET + MAC_BYTES..HEADER_BYTES``), the key's length (2 bytes, little-endian) and the
    key, then ``payload``. Single-threaded (about 0.25 s per GB on the 2-core AMD EPYC box);
    the hashing of large inputs releases the GIL, so the tiers' threads verify blocks in
    parallel.

    Args:
        secret: the shared secret (bytes of any length; :class:`BlockFormat` asks for at least
            :data:`MIN_SECRET_BYTES`).
        header: the ``HEADER_BYTES``-byte header (bytes-like or uint8 array); its MAC field's
            content does not matter.
        key: the offload key the block is stored (or asked for) under.
        payload: the payload (bytes-like or C-contiguous array).

    Raises:
        ValueError: ``header`` not ``HEADER_BYTES`` bytes.
        kvoff._optional.MissingExtraError: the ``blake3`` package is not installed.
    """
    head = mac_message_head(MAC_DOMAIN, header, key)
    body = _byte_view(payload, "payload")
    # BLAKE3 hashes its 1 KiB chunks in SIMD-wide subtrees only from chunk counters aligned to
    # the subtree's size: an update that starts after the ~4 KiB head would first go through
    # narrow subtrees (about 3 us a block). The first piece takes the payload's start up to
    # stream offset _MAC_FIRST_PIECE (a copy of about 12 KiB), the rest starts aligned.
    split = min(body.nbytes, max(0, _MAC_FIRST_PIECE - len(head)))
    h = _blake3().blake3(b"".join((head, body[:split])), key=mac_key(secret))
    h.update(body[split:])
    return bytes(h.digest())


_MAC_FIRST_PIECE = 16 << 10
"""Bytes of the MAC's input hashed in :func:`block_mac`'s first call: 16 chunks of 1 KiB, one
subtree of the BLAKE3 implementation's widest SIMD degree (AVX-512). Against hashing the head in
five calls and then the payload, the MAC of a block is 1.52x faster at 16 KiB, 1.27x at 64 KiB,
1.05x at 512 KiB, 1.01x at 2 MiB (about 5 us a block; 2-core Intel Xeon, 2026-12-02,
bench/results/tiers/ab-mac-message-head-2026-12-02.json)."""


def mac_message_head(domain: bytes, header: Any, key: bytes) -> bytes:
    """What a block's MAC covers ahead of the payload, in one piece: ``domain``, ``header``
    without its MAC field (bytes ``0..MAC_OFFSET`` and ``MAC_OFFSET + MAC_BYTES..HEADER_BYTES``),
    the key's length (2 bytes, little-endian) and the key; about 4 KiB, made into one piece
    because every call into the ``blake3`` package has a cost of its own (:data:`_MAC_FIRST_PIECE`).

    Raises:
        ValueError: ``header`` not ``HEADER_BYTES`` bytes.
    """
    head = _byte_view(header, "header")
    if head.nbytes != HEADER_BYTES:
        raise ValueError(f"header is {head.nbytes} bytes, expected {HEADER_BYTES}")
    return b"".join(
        (domain, head[:MAC_OFFSET], head[MAC_OFFSET + MAC_BYTES :], _KEY_LEN.pack(len(key)), key)
    )


class HeaderInfo(NamedTuple):
    """The fields of a header that passed its own checks (magic, version, header checksum).
    ``mac``: the block says it carries a MAC (version :data:`FORMAT_VERSION_MAC`); not yet
    verified (:func:`check_block` does that)."""

    fingerprint: bytes
    key: bytes
    payload_bytes: int
    checksum: int
    stamp: int
    mac: bool = False


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
    if version not in (FORMAT_VERSION, FORMAT_VERSION_MAC):
        return None, "version"
    (hdr_sum,) = _HDR_SUM.unpack(view[_FIELDS.size : HEADER_USED_BYTES])
    if hdr_sum != xxhash.xxh3_64_intdigest(fields) or hdr_bytes != HEADER_BYTES:
        return None, "header"
    if not 1 <= key_len <= MAX_KEY_BYTES:
        return None, "header"
    mac = version == FORMAT_VERSION_MAC
    return HeaderInfo(fprint, key[:key_len], length, checksum, stamp, mac), None


def check_block(fmt: BlockFormat, key: bytes, header: Any, payload: Any) -> str | None:
    """Whether a stored block may be served as ``key``'s block under ``fmt``.

    Args:
        fmt: what the reader expects (fingerprint, payload size, shared secret).
        key: the offload key the reader asked for.
        header: the ``HEADER_BYTES`` bytes read back (bytes-like or uint8 array).
        payload: the payload read back (bytes-like or C-contiguous array).

    Returns:
        None if valid, else a reason of :data:`REJECT_REASONS`. With a shared secret in
        ``fmt`` the MAC is checked first: ``"auth"`` when the header is not
        ``HEADER_BYTES`` long, the payload not ``fmt.payload_bytes``, or the MAC (over the
        header, ``key`` and the payload, :func:`block_mac`) does not match (a plain block,
        another secret, any byte changed, another key); a block that passes is then checked
        as below, minus the payload checksum (the MAC covered it). Without a secret: ``"magic"``
        (not a kvoff block), ``"version"`` (another format version), ``"header"`` (header
        corrupted: its own xxh3_64 does not match), ``"auth"`` (a MAC'd block: this reader
        cannot verify it), ``"fingerprint"`` (another model / layout / rank), ``"key"``
        (another key), ``"length"`` (payload length differs from the header or from ``fmt``),
        ``"checksum"`` (payload xxh3_64 differs: corrupted or torn write). ``"fingerprint"`` is
        a legitimate foreign block; ``"auth"`` an unauthenticated one; every other reason is
        corruption.
    """
    view = _byte_view(payload, "payload")
    secret = fmt.shared_secret
    if secret is not None:
        head = _byte_view(header, "header")
        if head.nbytes != HEADER_BYTES or view.nbytes != fmt.payload_bytes:
            return "auth"
        stored = head[MAC_OFFSET : MAC_OFFSET + MAC_BYTES]
        if not hmac.compare_digest(block_mac(secret, head, key, view), stored):
            return "auth"
    info, reason = decode_header(header)
    if info is None:
        return reason
    if info.mac != (secret is not None):
        return "auth"
    if info.fingerprint != fmt.fingerprint:
        return "fingerprint"
    if info.key != key:
        return "key"
    if info.payload_bytes != fmt.payload_bytes or view.nbytes != info.payload_bytes:
        return "length"
    if secret is None and xxhash.xxh3_64_intdigest(view) != info.checksum:
        return "checksum"
    return None
