"""Authenticated blocks (``shared_secret``, issue 56 item 5): with a secret every block written
to the disk and Redis tiers carries a keyed BLAKE3 hash (key derived from the secret with
BLAKE3's derive_key mode) over its header, key and payload, and a block without a valid MAC is a
miss, counted in ``unauthenticated_blocks``, never served (kvoff/tiers/block_format.py,
docs/tiers.md "Authenticated blocks"). Against the real disk tier in a temporary folder and the
real local Redis Cluster of tests/conftest.py. The MAC is recomputed here with the ``blake3``
package from the format's definition (known-answer tests), and blocks of format version 2
(HMAC-SHA256, kvoff before 2026-11-29) are built here with Python's hmac."""

from __future__ import annotations

import hmac
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np
import pytest

from kvoff.config import ConfigError, OffloadingConfig
from kvoff.tiers.block_format import (
    FORMAT_VERSION,
    FORMAT_VERSION_MAC,
    HEADER_BYTES,
    MAC_BYTES,
    MAC_OFFSET,
    BlockFormat,
    block_mac,
    check_block,
    decode_header,
    encode_header,
    layout_fingerprint,
)
from kvoff.tiers.coordinator import tiers_from_config
from kvoff.tiers.disk import SUPERBLOCK_BYTES, DiskTier, slot_bytes_for

if TYPE_CHECKING:  # redis is an extra: imported by the Redis tests themselves
    from kvoff.tiers.redis_cluster import LocalRedisCluster

SECRET = b"kvoff-test-secret-0123456789abcdef"
OTHER = b"another-secret-of-enough-bytes-42"
FP = layout_fingerprint(model="tiny", dtype="float16", world_size=1, rank=0, block_size=16)
PLAIN = BlockFormat(FP, 3 * 4096)
MAC = BlockFormat(FP, 3 * 4096, shared_secret=SECRET)
WRONG = BlockFormat(FP, 3 * 4096, shared_secret=OTHER)
KEY = bytes(range(32))


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def block(k: bytes, nbytes: int = PLAIN.payload_bytes) -> np.ndarray:
    seed = int.from_bytes(k[:8], "little") * 7
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def outs(n: int, nbytes: int = PLAIN.payload_bytes) -> list[np.ndarray]:
    return [np.zeros(nbytes, np.uint8) for _ in range(n)]


def flipped(data: bytes, offset: int) -> bytes:
    b = bytearray(data)
    b[offset] ^= 0x01
    return bytes(b)


# ----------------------------------------------------------------------------- the format


def test_a_block_round_trips_with_the_secret_and_says_its_mode() -> None:
    data = block(KEY)
    header = encode_header(MAC, KEY, data, stamp=7)
    assert len(header) == HEADER_BYTES
    assert check_block(MAC, KEY, header, data) is None
    info, reason = decode_header(header)
    assert reason is None and info is not None
    assert (info.mac, info.key, info.stamp, info.checksum) == (True, KEY, 7, 0)
    assert int.from_bytes(header[8:12], "little") == FORMAT_VERSION_MAC
    assert any(header[MAC_OFFSET : MAC_OFFSET + MAC_BYTES])
    plain = encode_header(PLAIN, KEY, data)
    assert int.from_bytes(plain[8:12], "little") == FORMAT_VERSION
    assert not any(plain[MAC_OFFSET : MAC_OFFSET + MAC_BYTES])


def test_every_unauthenticated_block_is_auth_never_valid() -> None:
    data = block(KEY)
    header = encode_header(MAC, KEY, data)
    # written without a secret, read with one; written with one, read without; another secret
    assert check_block(MAC, KEY, encode_header(PLAIN, KEY, data), data) == "auth"
    assert check_block(PLAIN, KEY, header, data) == "auth"
    assert check_block(WRONG, KEY, header, data) == "auth"
    assert check_block(MAC, KEY, encode_header(WRONG, KEY, data), data) == "auth"
    # one byte changed anywhere in the header: fields, header checksum, MAC, zero padding
    for offset in (0, 8, 12, 16, 40, 48, 56, 58, 121, 122, 129, MAC_OFFSET, MAC_OFFSET + 31,
                   MAC_OFFSET + MAC_BYTES, 2000, HEADER_BYTES - 1):  # fmt: skip
        assert check_block(MAC, KEY, flipped(header, offset), data) == "auth", offset
    # one byte of the payload, anywhere
    for offset in (0, 4321, data.nbytes - 1):
        bad = data.copy()
        bad[offset] ^= 0x80
        assert check_block(MAC, KEY, header, bad) == "auth", offset
    # a valid block under another key (replayed), a truncated header or payload
    assert check_block(MAC, flipped(KEY, 31), header, data) == "auth"
    assert check_block(MAC, KEY[:16], header, data) == "auth"
    assert check_block(MAC, KEY, header[:100], data) == "auth"
    assert check_block(MAC, KEY, header, data[:-1]) == "auth"
    # a zeroed header (an empty disk slot) is no block either
    assert check_block(MAC, KEY, bytes(HEADER_BYTES), data) == "auth"
    # a block of another model signed with the same secret is a foreign block, as without MAC
    other = BlockFormat(layout_fingerprint(model="other"), MAC.payload_bytes, shared_secret=SECRET)
    assert check_block(other, KEY, header, data) == "fingerprint"


# the format's definition, spelled out here rather than imported (block_format.py's docstring)
KEY_CONTEXT = "kvoff 2026-11-29 block MAC key (shared_secret)"
DOMAIN_V3 = b"kvoff-block-mac-v3\x00"


def expected_mac(secret: bytes, header: bytes, k: bytes, payload: bytes) -> bytes:
    """Keyed BLAKE3 of the block, computed from its definition with the blake3 package."""
    mac_key = blake3.blake3(secret, derive_key_context=KEY_CONTEXT).digest()
    mac_input = (DOMAIN_V3 + header[:130] + header[162:] + len(k).to_bytes(2, "little") + k
                 + payload)  # fmt: skip
    return blake3.blake3(mac_input, key=mac_key).digest()


def test_the_blake3_package_is_blake3() -> None:
    # the official test vectors (BLAKE3-team/BLAKE3, test_vectors/test_vectors.json, input_len 0)
    assert blake3.blake3(b"").hexdigest() == (
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )
    assert blake3.blake3(b"", key=b"whats the Elvish word for friend").hexdigest() == (
        "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26"
    )
    context = "BLAKE3 2019-12-27 16:29:52 test vectors context"
    assert blake3.blake3(b"", derive_key_context=context).hexdigest() == (
        "2cc39783c223154fea8dfb7c1b1660f2ac2dcbd1c1de8277b0b0dd39b7e50d7d"
    )


@pytest.mark.parametrize("secret", [SECRET, OTHER, b"s" * 16, bytes(range(256)) * 4])
def test_the_mac_is_keyed_blake3_with_a_derived_key(secret: bytes) -> None:
    assert (MAC_OFFSET, MAC_BYTES, FORMAT_VERSION_MAC) == (130, 32, 3)
    fmt = BlockFormat(FP, 3 * 4096, shared_secret=secret)
    data = block(KEY)
    header = encode_header(fmt, KEY, data, stamp=123)
    mac = expected_mac(secret, header, KEY, data.tobytes())
    assert header[MAC_OFFSET : MAC_OFFSET + MAC_BYTES] == mac
    assert block_mac(secret, header, KEY, data) == mac
    # the MAC field's own content is not part of the input; the key is
    assert block_mac(secret, flipped(header, MAC_OFFSET), KEY, data) == mac
    assert block_mac(secret, header, KEY[:20], data) != mac
    # not HMAC-SHA256 (format version 2), not BLAKE3 keyed by the raw secret
    assert mac != hmac.digest(secret, header + KEY + data.tobytes(), "sha256")
    if len(secret) == 32:
        assert mac != blake3.blake3(DOMAIN_V3 + header[:130], key=secret).digest()


# block_mac hashes the payload's start with the head, up to stream offset 16 KiB (19 + 4,064 + 2
# + len(key) bytes of head ahead of it): payloads that end before, at and after that point, and
# keys of both ends of their length range, give the MAC of the definition
@pytest.mark.parametrize("k", [KEY, b"k", bytes(range(64))])
@pytest.mark.parametrize("nbytes", [1, 12_266, 12_267, 12_268, 12_300, 65_536 + 7])
def test_the_mac_of_payloads_around_its_first_piece(k: bytes, nbytes: int) -> None:
    fmt = BlockFormat(FP, nbytes, shared_secret=SECRET)
    data = block(k * 2, nbytes)
    header = encode_header(fmt, k, data)
    assert header[MAC_OFFSET : MAC_OFFSET + MAC_BYTES] == expected_mac(
        SECRET, header, k, data.tobytes()
    )
    assert check_block(fmt, k, header, data) is None
    bad = data.copy()
    bad[-1] ^= 1
    assert check_block(fmt, k, header, bad) == "auth"


def version2_block(secret: bytes | None, k: bytes, payload: np.ndarray) -> bytes:
    """A header of format version 2 as kvoff wrote it before 2026-11-29: the version field 2,
    the header checksum over the fields, and an HMAC-SHA256 (domain "kvoff-block-mac-v1")."""
    import xxhash

    header = bytearray(encode_header(MAC, k, payload))
    header[8:12] = (2).to_bytes(4, "little")
    header[122:130] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(header[:122])))
    h = hmac.new(secret or SECRET, b"kvoff-block-mac-v1\x00", "sha256")
    for part in (header[:130], header[162:], len(k).to_bytes(2, "little"), k, payload.tobytes()):
        h.update(part)
    header[130:162] = h.digest()
    return bytes(header)


def test_blocks_of_format_version_2_hmac_are_counted_misses() -> None:
    data = block(KEY)
    old = version2_block(SECRET, KEY, data)
    info, reason = decode_header(old)
    assert (info, reason) == (None, "version")  # the disk tier's restart scan: not indexed
    assert check_block(MAC, KEY, old, data) == "auth"  # the MAC check comes first, and fails
    assert check_block(PLAIN, KEY, old, data) == "version"


def test_no_secret_on_either_side_is_unchanged() -> None:
    data = block(KEY)
    header = encode_header(PLAIN, KEY, data)
    assert check_block(PLAIN, KEY, header, data) is None
    bad = data.copy()
    bad[5] ^= 1
    assert check_block(PLAIN, KEY, header, bad) == "checksum"
    assert check_block(PLAIN, KEY, flipped(header, 8), data) == "version"
    assert check_block(PLAIN, KEY, flipped(header, 2000), data) is None  # padding, as before


def test_the_secret_is_never_shown_and_is_checked() -> None:
    assert SECRET.decode() not in repr(MAC) and SECRET.decode() not in str(MAC)
    assert repr(MAC) == repr(PLAIN) and MAC != PLAIN and MAC.authenticated
    with pytest.raises(ValueError, match="at least 16") as info:
        BlockFormat(FP, 100, shared_secret=b"fifteen bytes!!")
    assert "fifteen" not in str(info.value)
    with pytest.raises(ValueError, match="at least 16"):
        BlockFormat(FP, 100, shared_secret="a str, not bytes: refused")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the config

TEXT = "config-secret-0123456789-abcdef"


def test_config_reads_the_secret_from_the_environment_and_never_shows_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVOFF_CONFIG_FILE", raising=False)
    monkeypatch.setenv("KVOFF_SHARED_SECRET", TEXT)
    config = OffloadingConfig.load(num_cpu_blocks=10)
    assert config.shared_secret is not None
    assert config.shared_secret.get_secret_value() == TEXT
    for text in (repr(config), str(config), config.model_dump_json()):
        assert TEXT not in text and "**********" in text
    assert OffloadingConfig(num_cpu_blocks=10).shared_secret is None
    monkeypatch.setenv("KVOFF_SHARED_SECRET", "")
    assert OffloadingConfig.load(num_cpu_blocks=10).shared_secret is None  # empty: unset
    # errors name the key and where it came from, never its value: a short secret, and an
    # error of another key whose pydantic text would show every input
    monkeypatch.setenv("KVOFF_SHARED_SECRET", "short-secret")
    with pytest.raises(ConfigError, match="KVOFF_SHARED_SECRET") as info:
        OffloadingConfig.load(num_cpu_blocks=10)
    assert "short-secret" not in str(info.value)
    for bad in ({"shared_secret": "short-secret"}, {"shared_secret": TEXT, "cpu_bytes_to_use": 5}):
        with pytest.raises(ValueError, match=r"shared_secret|size the CPU pool") as info2:
            OffloadingConfig.from_dict({"num_cpu_blocks": 10, **bad})
        shown = str(info2.value) + repr(info2.value.errors())  # type: ignore[attr-defined]
        assert "short-secret" not in shown and TEXT not in shown
        assert info2.value.__context__ is None or TEXT not in str(info2.value.__context__)


def test_tiers_from_config_carry_the_secret(tmp_path: Path) -> None:
    config = OffloadingConfig(
        num_cpu_blocks=10,
        disk_path=tmp_path / "d",
        disk_bytes=SUPERBLOCK_BYTES + 4 * slot_bytes_for(PLAIN),
        shared_secret=TEXT,
    )
    (tier,) = tiers_from_config(config, PLAIN)
    try:
        assert tier.fmt.shared_secret == TEXT.encode()
        assert tier.fmt.fingerprint == FP and tier.fmt.payload_bytes == PLAIN.payload_bytes
    finally:
        tier.close()
    (plain,) = tiers_from_config(config.model_copy(update={"shared_secret": None}), PLAIN)
    try:
        assert plain.fmt.shared_secret is None
        assert plain.stats()["unauthenticated_blocks"] == 4 * 0  # an empty file: nothing seen
    finally:
        plain.close()


# ----------------------------------------------------------------------------- the disk tier


def disk(path: Path, fmt: BlockFormat, blocks: int = 8) -> DiskTier:
    return DiskTier(str(path), SUPERBLOCK_BYTES + blocks * slot_bytes_for(fmt), fmt)


def patch_file(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_file(path: Path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def test_disk_round_trip_with_the_secret_and_across_a_restart(tmp_path: Path) -> None:
    keys = [key(i) for i in range(5)]
    with disk(tmp_path, MAC) as tier:
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 5
        bufs = outs(5)
        assert tier.get(keys, bufs) == [True] * 5
        for k, b in zip(keys, bufs, strict=True):
            np.testing.assert_array_equal(b, block(k))
        s = tier.stats()
        assert (s["hits"], s["unauthenticated_blocks"], s["corrupted_blocks"]) == (5, 0, 0)
    with disk(tmp_path, MAC) as tier:  # the index is rebuilt from the MAC'd headers
        bufs = outs(5)
        assert tier.get(keys, bufs) == [True] * 5
        assert all(np.array_equal(b, block(k)) for k, b in zip(keys, bufs, strict=True))
        assert tier.stats()["unauthenticated_blocks"] == 0


@pytest.mark.parametrize(
    ("writer", "reader"), [(PLAIN, MAC), (MAC, PLAIN)], ids=["plain-then-mac", "mac-then-plain"]
)
def test_disk_blocks_of_the_other_mode_are_not_indexed_after_a_restart(
    tmp_path: Path, writer: BlockFormat, reader: BlockFormat
) -> None:
    keys = [key(i) for i in range(3)]
    with disk(tmp_path, writer) as tier:
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 3
    with disk(tmp_path, reader) as tier:
        s = tier.stats()
        assert (s["unauthenticated_blocks"], s["corrupted_blocks"], s["blocks"]) == (3, 0, 0)
        assert tier.contains(keys) == [False] * 3
        assert tier.get(keys, outs(3)) == [False] * 3
        assert tier.stats()["misses"] == 3 and tier.stats()["unauthenticated_blocks"] == 3
        # their slots are free for this tier's own blocks
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 3
        assert tier.get(keys, outs(3)) == [True] * 3


def test_disk_blocks_of_another_secret_are_counted_misses_and_dropped(tmp_path: Path) -> None:
    keys = [key(i) for i in range(4)]
    with disk(tmp_path, WRONG) as tier:
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 4
    with disk(tmp_path, MAC) as tier:  # same mode: indexed, then refused by every get
        assert tier.contains(keys) == [True] * 4
        bufs = outs(4)
        assert tier.get(keys, bufs) == [False] * 4
        s = tier.stats()
        assert (s["unauthenticated_blocks"], s["corrupted_blocks"], s["hits"]) == (4, 0, 0)
        assert tier.contains(keys) == [False] * 4  # dropped from the index
        tier.check_consistency()


@pytest.mark.parametrize(
    "where", ["magic", "version", "stamp", "key", "mac", "padding", "payload-0", "payload-end"]
)
def test_disk_one_byte_changed_is_a_counted_miss_never_served(tmp_path: Path, where: str) -> None:
    offsets = {"magic": 0, "version": 8, "stamp": 50, "key": 60, "mac": MAC_OFFSET + 5,
               "padding": 3000, "payload-0": HEADER_BYTES,
               "payload-end": HEADER_BYTES + MAC.payload_bytes - 1}  # fmt: skip
    keys = [key(i) for i in range(3)]
    with disk(tmp_path, MAC) as tier:
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 3
        slot = tier.slot_of(keys[1])
        assert slot is not None
        at = tier.slot_offset(slot) + offsets[where]
        patch_file(tier.file, at, bytes([read_file(tier.file, at, 1)[0] ^ 0x01]))
        bufs = outs(3)
        assert tier.get(keys, bufs) == [True, False, True]
        np.testing.assert_array_equal(bufs[0], block(keys[0]))
        s = tier.stats()
        assert (s["unauthenticated_blocks"], s["corrupted_blocks"], s["hits"]) == (1, 0, 2)
        assert tier.contains(keys) == [True, False, True]
        assert tier.get(keys[1:2], outs(1)) == [False]  # gone: a plain miss, not counted again
        assert tier.stats()["unauthenticated_blocks"] == 1
        tier.check_consistency()


def test_disk_blocks_planted_without_the_secret_are_never_served(tmp_path: Path) -> None:
    """An attacker who can write the file but lacks the secret: a plain block, a MAC'd block
    signed with a guessed secret, and a valid block of another key copied over, each under a
    key the tier holds; then a MAC'd-looking block planted in a free slot before a restart."""
    keys = [key(i) for i in range(4)]
    with disk(tmp_path, MAC) as tier:
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 4
        slots = [tier.slot_of(k) for k in keys]
        assert None not in slots
        evil = np.full(MAC.payload_bytes, 0x41, np.uint8)
        plain = encode_header(PLAIN, keys[0], evil)
        guessed = encode_header(WRONG, keys[1], evil)
        patch_file(tier.file, tier.slot_offset(slots[0]), plain + evil.tobytes())  # type: ignore[arg-type]
        patch_file(tier.file, tier.slot_offset(slots[1]), guessed + evil.tobytes())  # type: ignore[arg-type]
        # key 3's valid block, replayed as key 2's
        valid3 = read_file(tier.file, tier.slot_offset(slots[3]), slot_bytes_for(MAC))  # type: ignore[arg-type]
        patch_file(tier.file, tier.slot_offset(slots[2]), valid3)  # type: ignore[arg-type]
        bufs = outs(4)
        assert tier.get(keys, bufs) == [False, False, False, True]
        assert tier.stats()["unauthenticated_blocks"] == 3
        np.testing.assert_array_equal(bufs[3], block(keys[3]))
    # a planted MAC'd-looking header in a free slot is indexed by the restart scan, refused by get
    with disk(tmp_path, MAC) as tier:
        held = set(tier.held_keys())
        assert held == {keys[3]}
        free = next(s for s in range(tier.num_slots) if s != tier.slot_of(keys[3]))
        planted = encode_header(WRONG, key(99), evil)
        patch_file(tier.file, tier.slot_offset(free), planted + evil.tobytes())
    with disk(tmp_path, MAC) as tier:
        assert tier.contains([key(99)]) == [True]
        assert tier.get([key(99)], outs(1)) == [False]
        s = tier.stats()
        assert (s["unauthenticated_blocks"], s["hits"], s["misses"]) == (1, 0, 1)
        tier.check_consistency()


def test_disk_without_a_secret_anywhere_is_unchanged(tmp_path: Path) -> None:
    keys = [key(i) for i in range(3)]
    with disk(tmp_path, PLAIN) as tier:
        assert tier.put(keys, [block(k) for k in keys]) == [True] * 3
        slot = tier.slot_of(keys[0])
        assert slot is not None
        at = tier.slot_offset(slot) + HEADER_BYTES + 17
        patch_file(tier.file, at, bytes([read_file(tier.file, at, 1)[0] ^ 0x01]))
        assert tier.get(keys, outs(3)) == [False, True, True]
        s = tier.stats()
        assert (s["corrupted_blocks"], s["unauthenticated_blocks"], s["hits"]) == (1, 0, 2)


# ----------------------------------------------------------------------------- the Redis tier

RFMT_PLAIN = BlockFormat(FP, 20000)
RFMT_MAC = BlockFormat(FP, 20000, shared_secret=SECRET)
RFMT_WRONG = BlockFormat(FP, 20000, shared_secret=OTHER)


def _node_client(cluster: LocalRedisCluster, tier: Any, k: bytes) -> Any:
    name = tier.node_of(k)
    assert name is not None
    return cluster.client(cluster.index_of(name))


def test_redis_round_trip_with_the_secret(redis_url: str) -> None:
    from kvoff.tiers.redis_cluster import RedisClusterTier

    keys = [key(i) for i in range(30)]
    with RedisClusterTier(redis_url, RFMT_MAC) as tier:
        assert tier.put(keys, [block(k, 20000) for k in keys]) == [True] * 30
        bufs = outs(30, 20000)
        assert tier.get(keys, bufs) == [True] * 30
        for k, b in zip(keys, bufs, strict=True):
            np.testing.assert_array_equal(b, block(k, 20000))
        s = tier.stats()
        assert (s["hits"], s["unauthenticated_blocks"], s["corrupted_blocks"]) == (30, 0, 0)


@pytest.mark.parametrize(
    ("writer", "reader"),
    [(RFMT_PLAIN, RFMT_MAC), (RFMT_MAC, RFMT_PLAIN), (RFMT_WRONG, RFMT_MAC)],
    ids=["plain-then-mac", "mac-then-plain", "other-secret"],
)
def test_redis_blocks_of_another_mode_or_secret_are_counted_misses_and_deleted(
    redis_url: str, writer: BlockFormat, reader: BlockFormat
) -> None:
    from kvoff.tiers.redis_cluster import RedisClusterTier

    keys = [key(i) for i in range(6)]
    with RedisClusterTier(redis_url, writer) as w:
        assert w.put(keys, [block(k, 20000) for k in keys]) == [True] * 6
    with RedisClusterTier(redis_url, reader) as tier:
        assert tier.contains(keys) == [True] * 6  # same namespace and fingerprint: same keys
        bufs = outs(6, 20000)
        assert tier.get(keys, bufs) == [False] * 6
        s = tier.stats()
        assert (s["unauthenticated_blocks"], s["corrupted_blocks"], s["hits"], s["misses"]) == (
            6, 0, 0, 6,
        )  # fmt: skip
        assert tier.contains(keys) == [False] * 6  # deleted, as a corrupt block is


REDIS_OFFSETS = [0, 8, 50, MAC_OFFSET + 1, 3000, HEADER_BYTES, HEADER_BYTES + 19999]


@pytest.mark.parametrize("offset", REDIS_OFFSETS)
def test_redis_one_byte_changed_is_a_counted_miss_never_served(
    redis_url: str, redis_cluster: LocalRedisCluster, offset: int
) -> None:
    from kvoff.tiers.redis_cluster import RedisClusterTier

    keys = [key(i) for i in range(3)]
    with RedisClusterTier(redis_url, RFMT_MAC) as tier:
        assert tier.put(keys, [block(k, 20000) for k in keys]) == [True] * 3
        client = _node_client(redis_cluster, tier, keys[1])
        rkey = tier._rkey(keys[1])
        value = client.get(rkey)
        assert value is not None and len(value) == RFMT_MAC.object_bytes
        client.set(rkey, flipped(value, offset))
        bufs = outs(3, 20000)
        assert tier.get(keys, bufs) == [True, False, True]
        s = tier.stats()
        assert (s["unauthenticated_blocks"], s["corrupted_blocks"], s["hits"]) == (1, 0, 2)
        assert client.exists(rkey) == 0


def test_redis_blocks_planted_without_the_secret_are_never_served(
    redis_url: str, redis_cluster: LocalRedisCluster
) -> None:
    """Someone who can write the namespace but lacks the secret plants, under keys the engines
    ask for: a plain block, a block signed with a guessed secret, a valid block of another key,
    and bytes that are no block at all."""
    from kvoff.tiers.redis_cluster import RedisClusterTier

    keys = [key(i) for i in range(5)]
    evil = np.full(20000, 0x41, np.uint8)
    with RedisClusterTier(redis_url, RFMT_MAC) as tier:
        assert tier.put(keys[4:], [block(keys[4], 20000)]) == [True]
        valid4 = _node_client(redis_cluster, tier, keys[4]).get(tier._rkey(keys[4]))
        planted = [
            encode_header(RFMT_PLAIN, keys[0], evil) + evil.tobytes(),
            encode_header(RFMT_WRONG, keys[1], evil) + evil.tobytes(),
            valid4,
            b"not a block",
        ]
        for k, value in zip(keys, planted, strict=False):
            _node_client(redis_cluster, tier, k).set(tier._rkey(k), value)
        bufs = outs(5, 20000)
        assert tier.get(keys, bufs) == [False, False, False, False, True]
        assert not any(b.any() for b in bufs[:4])  # nothing planted reached a buffer
        s = tier.stats()
        assert (s["unauthenticated_blocks"], s["corrupted_blocks"], s["hits"]) == (4, 0, 1)


def test_redis_without_a_secret_anywhere_is_unchanged(
    redis_url: str, redis_cluster: LocalRedisCluster
) -> None:
    from kvoff.tiers.redis_cluster import RedisClusterTier

    keys = [key(i) for i in range(3)]
    with RedisClusterTier(redis_url, RFMT_PLAIN) as tier:
        assert tier.put(keys, [block(k, 20000) for k in keys]) == [True] * 3
        client = _node_client(redis_cluster, tier, keys[0])
        value = client.get(tier._rkey(keys[0]))
        client.set(tier._rkey(keys[0]), flipped(value, HEADER_BYTES + 5))
        assert tier.get(keys, outs(3, 20000)) == [False, True, True]
        s = tier.stats()
        assert (s["corrupted_blocks"], s["unauthenticated_blocks"], s["hits"]) == (1, 0, 2)


# ----------------------------------------------------------------------------- the benchmark


def test_bench_mac_reports_the_cost_per_gb_next_to_the_alternatives() -> None:
    from kvoff.tools.bench_tiers import (
        MAC_ALGORITHM,
        _blake3_threads_mac,
        _hmac_sha256_mac,
        bench_mac,
        format_bench_tiers,
    )

    r = bench_mac(total_bytes=4 << 20, block_size=512 << 10, rounds=3)
    assert (r["blocks"], r["payload_bytes"], r["rounds"], len(r["per_round"])) == (8, 4 << 20, 3, 3)
    methods = {"mac", "hmac_sha256", "blake3_threads", "blake2b", "checksum", "memcpy"}
    assert set(r["gbps"]) == set(r["s_per_gb"]) == set(r["over_mac"]) == methods
    assert all(v > 0 for v in r["gbps"].values())
    assert r["s_per_gb"]["mac"] == pytest.approx(1 / r["gbps"]["mac"])
    assert r["mac_over_checksum"] > 0 and r["mac_over_memcpy"] > 0
    assert r["over_mac"]["mac"] == 1.0 and r["blake2b_over_mac"] == r["over_mac"]["blake2b"]
    assert r["mac_algorithm"] == MAC_ALGORITHM and "BLAKE3" in MAC_ALGORITHM
    text = format_bench_tiers({"mac": r})
    assert "BLAKE3 keyed_hash" in text and "HMAC-SHA256 (format version 2)" in text
    # the alternatives hash what they say: version 2's HMAC, the MAC with threads
    data = block(KEY)
    old = version2_block(SECRET, KEY, data)
    assert _hmac_sha256_mac(SECRET, old, KEY, data) == old[130:162]
    header = encode_header(MAC, KEY, data)
    derived = blake3.blake3(SECRET, derive_key_context=KEY_CONTEXT).digest()
    assert _blake3_threads_mac(derived, header, KEY, data) == block_mac(SECRET, header, KEY, data)
    with pytest.raises(ValueError, match="rounds >= 1"):
        bench_mac(rounds=0)
