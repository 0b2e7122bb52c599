"""Opening the disk tier's slot file (kvoff.tiers.slot_file.SlotFile, through DiskTier): a file
of another layout recreated, foreign or cut-short files refused and left as they were, O_DIRECT
probed at the first I/O, the free space checked before anything is allocated, and no descriptor
or lock kept by a refusal."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from disk_tier_util import (
    FMT,
    ODD_FMT,
    block,
    capacity,
    key,
    open_fds,
    outs,
    supports_o_direct,
)

from kvoff.tiers.disk import SUPERBLOCK_BYTES, DiskTier


def refuse_o_direct_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make reads and writes on an O_DIRECT descriptor fail with EINVAL, as on a file system
    that takes O_DIRECT at open() and refuses it at I/O."""

    def refusing(real: Callable[..., object]) -> Callable[..., object]:
        def call(fd: int, *args: object) -> object:
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument (O_DIRECT refused)")
            return real(fd, *args)

        return call

    for name in ("preadv", "pwrite", "pwritev"):
        monkeypatch.setattr(os, name, refusing(getattr(os, name)))


def test_other_payload_size_recreates_the_file(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)
    tier.put([key(1)], [block(key(1))])
    tier.close()
    tier = DiskTier(tmp_path, capacity(ODD_FMT, 4), ODD_FMT)
    assert tier.stats()["recreated_files"] == 1
    assert tier.contains([key(1)]) == [False]
    assert tier.put([key(2)], [block(key(2), ODD_FMT)]) == [True]
    tier.close()
    tier = DiskTier(tmp_path, capacity(ODD_FMT, 4), ODD_FMT)
    assert tier.contains([key(2)]) == [True] and tier.stats()["recreated_files"] == 0
    tier.close()


def test_a_kvoff_file_cut_short_in_its_superblock_is_refused_as_truncated(tmp_path: Path) -> None:
    """A slot file that starts with the superblock magic but ends inside the superblock (a crash
    while it was created) was refused as having "no b'KVOFFDSK' header", which is false."""
    DiskTier(tmp_path, capacity(FMT, 4), FMT).close()
    slots = tmp_path / "kvoff-blocks.slots"
    head = slots.read_bytes()[:100]
    assert head.startswith(b"KVOFFDSK")
    slots.write_bytes(head)
    with pytest.raises(ValueError, match=r"cut short: 100 bytes.*truncated header") as info:
        DiskTier(tmp_path, capacity(FMT, 4), FMT)
    assert "no b'KVOFFDSK' header" not in str(info.value)
    assert "delete that file" in str(info.value)
    assert slots.read_bytes() == head  # refused: left as it was


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd (Linux)")
def test_a_refused_open_keeps_no_descriptor_and_no_lock(tmp_path: Path) -> None:
    """A refusal (file locked by another tier, or not a kvoff file) closes what it opened: no
    descriptor is leaked, and once the cause is gone the same path opens in the same process."""
    holder = DiskTier(tmp_path / "held", capacity(FMT, 4), FMT)
    before = open_fds()
    for _ in range(20):
        with pytest.raises(ValueError, match="in use by another DiskTier"):
            DiskTier(tmp_path / "held", capacity(FMT, 4), FMT)
    assert open_fds() == before
    holder.close()
    DiskTier(tmp_path / "held", capacity(FMT, 4), FMT).close()  # the lock went with the holder

    (tmp_path / "foreign").mkdir()
    slots = tmp_path / "foreign" / "kvoff-blocks.slots"
    slots.write_bytes(b"not ours" * 1000)
    before = open_fds()
    with pytest.raises(ValueError, match="not a kvoff disk tier file"):
        DiskTier(tmp_path / "foreign", capacity(FMT, 4), FMT)
    assert open_fds() == before
    with open(slots, "r+b") as f:  # the operator empties the file in place
        f.truncate(0)
    tier = DiskTier(tmp_path / "foreign", capacity(FMT, 4), FMT)  # not "in use by another"
    assert tier.put([key(1)], [block(key(1))]) == [True]
    tier.close()


def test_slot_accounting_sanity(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity(FMT, 5) + 100, FMT)
    assert tier.num_slots == 5
    assert os.path.getsize(tier.file) == capacity(FMT, 5)
    tier.close()


@pytest.mark.parametrize("existing", [False, True])
def test_o_direct_refused_at_the_first_io_falls_back_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    """Some file systems take O_DIRECT at open() and refuse the reads and writes (EINVAL). The
    tier turns O_DIRECT off on its own descriptor and keeps its lock: a second descriptor
    conflicted with the tier's own flock, and the tier went unavailable."""
    if not supports_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT at open()")
    if existing:  # a file made earlier: the superblock read is the first O_DIRECT I/O
        DiskTier(tmp_path, capacity(FMT, 4), FMT, direct=False).close()

    refuse_o_direct_io(monkeypatch)
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)
    stats = tier.stats()
    assert (stats["unavailable"], stats["direct_io"], tier.error) == (0, 0, None)
    keys = [key(i) for i in range(2)]
    assert tier.put(keys, [block(k) for k in keys]) == [True, True]
    bufs = outs(2)
    assert tier.get(keys, bufs) == [True, True]
    np.testing.assert_array_equal(bufs[1], block(keys[1]))
    with pytest.raises(ValueError, match="in use by another DiskTier"):  # the lock is still held
        DiskTier(tmp_path, capacity(FMT, 4), FMT, direct=False)
    tier.close()


def test_a_capacity_beyond_the_free_space_is_refused_and_takes_nothing(tmp_path: Path) -> None:
    """disk_bytes larger than the file system's free space: fallocate took the whole disk
    (75 GB in an audit run) before failing, and every other writer on the machine failed."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(ValueError, match=r"has \d+ bytes free; lower disk_bytes"):
        DiskTier(tmp_path, free + 2**40, FMT)
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) <= SUPERBLOCK_BYTES
    after = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert after > free - 2**30  # nothing close to the capacity was allocated
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)  # a capacity that fits still opens
    assert tier.put([key(1)], [block(key(1))]) == [True]
    tier.close()


def test_direct_true_refused_without_o_direct() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or supports_o_direct(shm):
        pytest.skip("needs a file system without O_DIRECT at /dev/shm (older tmpfs)")
    d = Path(tempfile.mkdtemp(dir=shm))
    try:
        with pytest.raises(ValueError, match="does not support O_DIRECT"):
            DiskTier(d, capacity(FMT, 4), FMT, direct=True)
        tier = DiskTier(d, capacity(FMT, 4), FMT)
        assert tier.stats()["direct_io"] == 0
        tier.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_refused_open_leaves_a_file_of_another_layout_as_it_was(tmp_path: Path) -> None:
    """A file of another payload size with a capacity beyond the free space: the file was
    truncated and recreated before the free-space check refused the open, so the ValueError
    came after its blocks were gone."""
    keys = [key(i) for i in range(3)]
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)
    assert tier.put(keys, [block(k) for k in keys]) == [True] * 3
    tier.close()
    before = tier.file.read_bytes()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(ValueError, match=r"has \d+ bytes free; lower disk_bytes"):
        DiskTier(tmp_path, free + 2**40, ODD_FMT)
    assert tier.file.read_bytes() == before
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)
    s = tier.stats()
    assert (s["recovered_blocks"], s["recreated_files"]) == (3, 0)
    bufs = outs(3)
    assert tier.get(keys, bufs) == [True] * 3
    np.testing.assert_array_equal(bufs[2], block(keys[2]))
    tier.close()


@pytest.mark.parametrize(
    "layout",
    ["zero-first-page", "sparse-data-far-in"],
)
def test_a_file_that_is_not_all_zeros_is_refused_and_kept(tmp_path: Path, layout: str) -> None:
    """A foreign file whose first 4 KiB are zero was truncated as if it were a tier file cut
    short while being created; only an all-zero file is one."""
    slots = tmp_path / "kvoff-blocks.slots"
    with open(slots, "wb") as f:
        if layout == "zero-first-page":
            f.write(bytes(SUPERBLOCK_BYTES) + b"IMPORTANT USER DATA" * 100)
        else:  # a hole of 1 MiB, then a few bytes
            f.truncate(1 << 20)
            f.seek((1 << 20) - 10)
            f.write(b"user data!")
    before = slots.read_bytes()
    with pytest.raises(ValueError, match=r"kvoff-blocks.slots exists and is not a kvoff .*zeros"):
        DiskTier(tmp_path, capacity(FMT, 2), FMT)
    assert slots.read_bytes() == before


@pytest.mark.parametrize("layout", ["dense", "sparse", "short"])
def test_an_all_zero_file_is_taken_as_one_crashed_while_created(
    tmp_path: Path, layout: str
) -> None:
    slots = tmp_path / "kvoff-blocks.slots"
    with open(slots, "wb") as f:
        if layout == "dense":
            f.write(bytes(5 * SUPERBLOCK_BYTES + 7))
        elif layout == "sparse":
            f.truncate(1 << 20)
        else:
            f.write(bytes(100))
    tier = DiskTier(tmp_path, capacity(FMT, 2), FMT)
    assert tier.put([key(1)], [block(key(1))]) == [True]
    assert os.path.getsize(slots) == capacity(FMT, 2)
    tier.close()


@pytest.mark.parametrize("existing", [False, True])
def test_direct_true_is_refused_when_o_direct_fails_at_the_first_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    """direct=True requires O_DIRECT: a file system that takes it at open() and refuses it at
    I/O (EINVAL) got buffered I/O (a new file) or an unavailable tier (an existing one) instead
    of the documented ValueError. The refusal changes nothing and keeps no lock."""
    if not supports_o_direct(tmp_path):
        pytest.skip(f"{tmp_path} does not accept O_DIRECT at open()")
    if existing:
        tier = DiskTier(tmp_path, capacity(FMT, 4), FMT, direct=False)
        assert tier.put([key(1)], [block(key(1))]) == [True]
        tier.close()
    before = tier.file.read_bytes() if existing else b""

    refuse_o_direct_io(monkeypatch)
    with pytest.raises(ValueError, match=r"does not support O_DIRECT I/O.*pass direct=None"):
        DiskTier(tmp_path, capacity(FMT, 4), FMT, direct=True)
    slots = tmp_path / "kvoff-blocks.slots"
    assert slots.read_bytes() == before
    tier = DiskTier(tmp_path, capacity(FMT, 4), FMT)  # direct=None falls back; no lock left
    assert tier.stats()["direct_io"] == 0 and tier.error is None
    assert tier.contains([key(1)]) == [existing]
    tier.close()
