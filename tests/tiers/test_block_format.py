"""The block header (kvoff.tiers.block_format): a round trip; every field mismatch is detected."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvoff.tiers.block_format import (
    FINGERPRINT_BYTES,
    HEADER_BYTES,
    BlockFormat,
    check_block,
    decode_header,
    encode_header,
    layout_fingerprint,
)

FP = layout_fingerprint(model="tiny-llama", dtype="bfloat16", world_size=2, rank=0, block_size=16)
FMT = BlockFormat(FP, 8192)
KEY = bytes(range(32))


def payload(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, FMT.payload_bytes, dtype=np.uint8)


def test_round_trip() -> None:
    data = payload()
    header = encode_header(FMT, KEY, data, stamp=123)
    assert len(header) == HEADER_BYTES
    assert check_block(FMT, KEY, header, data) is None
    assert check_block(FMT, KEY, memoryview(header), data.tobytes()) is None
    info, reason = decode_header(header)
    assert reason is None and info is not None
    assert (info.key, info.fingerprint, info.payload_bytes, info.stamp) == (KEY, FP, 8192, 123)


def test_fingerprint_is_canonical_and_sensitive() -> None:
    assert len(FP) == FINGERPRINT_BYTES
    # keyword order does not matter; every value does
    same = layout_fingerprint(
        block_size=16, rank=0, world_size=2, dtype="bfloat16", model="tiny-llama"
    )
    assert same == FP
    assert (
        layout_fingerprint(
            model="tiny-llama", dtype="bfloat16", world_size=2, rank=1, block_size=16
        )
        != FP
    )
    assert (
        layout_fingerprint(model="tiny-llama", dtype="float16", world_size=2, rank=0, block_size=16)
        != FP
    )

    @dataclasses.dataclass
    class Spec:
        heads: int
        dtype: np.dtype

    a = layout_fingerprint(spec=Spec(8, np.dtype(np.float16)), sizes=(1, 2.5), tags={"b", "a"})
    b = layout_fingerprint(spec=Spec(8, np.dtype(np.float16)), sizes=[1, 2.5], tags={"a", "b"})
    assert a == b
    assert a != layout_fingerprint(
        spec=Spec(4, np.dtype(np.float16)), sizes=(1, 2.5), tags={"a", "b"}
    )
    with pytest.raises(TypeError, match=r"fields\.thing"):
        layout_fingerprint(thing=object())


def _flip(header: bytes, offset: int) -> bytes:
    b = bytearray(header)
    b[offset] ^= 0x01
    return bytes(b)


def test_each_mismatch_is_detected() -> None:
    data = payload()
    header = encode_header(FMT, KEY, data)
    other_fp = BlockFormat(layout_fingerprint(model="other"), FMT.payload_bytes)
    assert check_block(other_fp, KEY, header, data) == "fingerprint"
    assert check_block(FMT, KEY[:-1] + b"\xff", header, data) == "key"
    assert check_block(FMT, KEY[:16], header, data) == "key"
    bigger = BlockFormat(FP, FMT.payload_bytes + 1)
    assert check_block(bigger, KEY, header, np.zeros(FMT.payload_bytes + 1, np.uint8)) == "length"
    assert check_block(FMT, KEY, header, data[:-1]) == "length"
    corrupt = data.copy()
    corrupt[4321] ^= 0x80
    assert check_block(FMT, KEY, header, corrupt) == "checksum"
    assert check_block(FMT, KEY, _flip(header, 0), data) == "magic"
    assert check_block(FMT, KEY, bytes(HEADER_BYTES), data) == "magic"
    # the version field is at bytes 8..11; the header checksum comes after the version check
    assert check_block(FMT, KEY, _flip(header, 8), data) == "version"
    # any other flipped header field byte is caught by the header's own checksum
    for offset in (12, 16, 31, 32, 40, 48, 56, 58, 121, 122, 129):
        assert check_block(FMT, KEY, _flip(header, offset), data) == "header", offset
    # the zero padding after the fields is not part of the block's meaning
    assert check_block(FMT, KEY, _flip(header, 2000), data) is None
    assert check_block(FMT, KEY, header[:100], data) == "header"


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        BlockFormat(b"short", 10)
    with pytest.raises(ValueError, match="positive int"):
        BlockFormat(FP, 0)
    with pytest.raises(ValueError, match="payload_bytes is 8192"):
        encode_header(FMT, KEY, np.zeros(100, np.uint8))
    with pytest.raises(ValueError, match=r"1\.\.64"):
        encode_header(FMT, b"k" * 65, payload())
