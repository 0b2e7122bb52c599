"""Helpers shared by the disk tier's tests (tests/tiers/test_disk.py, test_slot_file.py): one
layout's block formats, deterministic keys and payloads, output buffers, O_DIRECT probing."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from kvoff.tiers.block_format import BlockFormat, layout_fingerprint
from kvoff.tiers.disk import SUPERBLOCK_BYTES, slot_bytes_for

FP = layout_fingerprint(model="tiny", dtype="float16", world_size=1, rank=0, block_size=16)
FMT = BlockFormat(FP, 3 * 4096)
ODD_FMT = BlockFormat(FP, 5000)  # not a multiple of 4096: always through the bounce buffer
FORMATS = {"4k-multiple": FMT, "odd-size": ODD_FMT}


def capacity(fmt: BlockFormat, blocks: int) -> int:
    return SUPERBLOCK_BYTES + blocks * slot_bytes_for(fmt)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def block(k: bytes, fmt: BlockFormat = FMT, version: int = 0) -> np.ndarray:
    seed = int.from_bytes(k[:8], "little") * 7 + version
    return np.random.default_rng(seed).integers(0, 256, fmt.payload_bytes, dtype=np.uint8)


def aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 array (what a page-aligned CPU pool slot looks like)."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def outs(n: int, fmt: BlockFormat = FMT, *, page_aligned: bool = False) -> list[np.ndarray]:
    if page_aligned:
        return [aligned(fmt.payload_bytes) for _ in range(n)]
    # offset by one byte: an unaligned view into a larger buffer, like a CPU pool slot may be
    return [np.zeros(fmt.payload_bytes + 1, np.uint8)[1:] for _ in range(n)]


def supports_o_direct(directory: Path) -> bool:
    """Whether the file system of ``directory`` accepts O_DIRECT (ext4, xfs: yes; tmpfs: no)."""
    probe = directory / "o_direct_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


def flip_file_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def open_fds() -> int:
    """The number of file descriptors this process holds (Linux: /proc/self/fd)."""
    return len(os.listdir("/proc/self/fd"))
