"""The disk tier's slot file, opened: the file-level half of :mod:`kvoff.tiers.disk`.

:class:`SlotFile` opens ``<path>/<file_name>`` for a :class:`kvoff.tiers.disk.DiskTier` and
decides what the file is before anything in it changes:

- ``O_DIRECT`` where the file system takes it (at ``open()`` and at the first read or write;
  some take it at ``open()`` and refuse the I/O with EINVAL: then O_DIRECT is turned off on the
  same descriptor, which keeps its lock), buffered I/O otherwise, or a refusal when O_DIRECT is
  required;
- an exclusive ``flock`` (one tier per file);
- the superblock (``SUPERBLOCK_BYTES`` at offset 0: magic, version, header bytes, slot bytes,
  payload bytes, and an xxh3_64 of those fields): a file of this block size is reopened with its
  slots; one written for another block size is recreated empty; a file cut short inside its
  superblock, or one that is not a kvoff disk tier file (no magic, not all zeros), is refused;
- the free space (the file must be able to grow to its capacity without filling the disk), then
  the preallocation (``posix_fallocate``; a sparse file where it is refused).

Every check that can refuse is made before the file is changed, so a refused open leaves an
existing file (and its blocks) as it was. Reading the slots' headers back (the tier's index) is
the tier's job.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
from pathlib import Path

import numpy as np
import xxhash

from kvoff.tiers.block_format import HEADER_BYTES

__all__ = [
    "ALIGN",
    "SUPERBLOCK_BYTES",
    "SUPER_MAGIC",
    "SUPER_VERSION",
    "SlotFile",
    "SlotFileRefused",
    "aligned_buffer",
    "pwrite_all",
    "round_up",
]

log = logging.getLogger("kvoff.tiers.disk")

ALIGN = 4096
"""Alignment of offsets, lengths and buffers for O_DIRECT (covers 512 B and 4 KiB devices)."""
SUPERBLOCK_BYTES = 4096
"""Bytes before the first slot (the file header)."""
SUPER_MAGIC = b"KVOFFDSK"
"""First 8 bytes of a disk tier file."""
SUPER_VERSION = 1
"""Version of the superblock's fields."""
_SUPER = struct.Struct("<8sIIQQ")


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned writable buffer of ``nbytes`` bytes (anonymous mmap), as O_DIRECT needs."""
    return memoryview(mmap.mmap(-1, round_up(nbytes)))[:nbytes]


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    """Write all of ``buf`` to ``fd`` at byte ``offset``, resuming after short writes.

    Raises:
        OSError: from ``os.pwrite``, or ENOSPC when a write makes no progress (returns 0).
    """
    done = 0
    while done < buf.nbytes:
        n = os.pwrite(fd, buf[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, "short write")
        done += n


class SlotFileRefused(Exception):
    """The file cannot be opened as a tier file for a reason the caller must fix (the message
    says which and how; the tier raises it as ValueError). Nothing was changed."""


class SlotFile:
    """An open, locked slot file with a superblock for ``slot_bytes`` slots, sized for
    ``num_slots`` of them (module docstring).

    Args:
        file: the file (its directory is created if missing).
        slot_bytes: bytes of one slot (block header + payload rounded up to :data:`ALIGN`).
        payload_bytes: bytes of one block's payload (recorded in the superblock).
        num_slots: slots the file holds at capacity.
        capacity_bytes: the tier's ``disk_bytes`` (named in the messages).
        direct: True = require O_DIRECT, False = buffered I/O, None = O_DIRECT where the file
            system allows it.

    Attributes:
        fd: the descriptor (exclusively ``flock``-ed; the caller closes it: :meth:`close`).
        direct: whether ``fd`` does O_DIRECT I/O.
        existing_bytes: the size in bytes of a tier file of this block size that was there
            (its slots may hold blocks: the caller scans them); 0 for a new or recreated file.
        recreated: the file had been written for another block size and was recreated empty.
        preallocated: ``posix_fallocate`` reserved the whole file (else it is sparse).

    Raises:
        SlotFileRefused: the path exists and is not a directory; ``direct=True`` on a file
            system without O_DIRECT; the file is locked by another tier; the file is cut short
            inside its superblock, or is not a kvoff disk tier file; the file system has less
            free space than the file still needs. The file is as it was; no descriptor is left.
        OSError: the file cannot be created or read (the tier is then unavailable); no
            descriptor is left.
    """

    def __init__(
        self,
        file: Path,
        *,
        slot_bytes: int,
        payload_bytes: int,
        num_slots: int,
        capacity_bytes: int,
        direct: bool | None,
    ) -> None:
        self.file = file
        self.slot_bytes, self.payload_bytes = slot_bytes, payload_bytes
        self.num_slots, self.capacity_bytes = num_slots, capacity_bytes
        self.fd = -1
        self.direct = False
        self.existing_bytes = 0
        self.recreated = False
        self.preallocated = False
        try:
            self._open(direct)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Closes the descriptor (which drops the lock); idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def target_bytes(self) -> int:
        """The file's size at capacity: superblock and every slot."""
        return SUPERBLOCK_BYTES + self.num_slots * self.slot_bytes

    def _open(self, direct: bool | None) -> None:
        folder = self.file.parent
        if folder.exists() and not folder.is_dir():
            raise SlotFileRefused(
                f"disk_path {folder} exists and is not a directory; pass a directory (the tier "
                f"creates {self.file.name} inside it)"
            )
        folder.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        if direct is not False and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(self.file, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        if self.fd < 0:
            if direct is True:
                raise SlotFileRefused(
                    f"the file system of {folder} does not support O_DIRECT (tmpfs, some network "
                    f"file systems); pass direct=None to fall back to buffered I/O or use another "
                    f"disk_path"
                )
            self.fd = os.open(self.file, flags, 0o644)
            self.direct = False
        fd = self.fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SlotFileRefused(
                f"{self.file} is in use by another DiskTier (flock); give every engine process and "
                f"rank its own disk_path or file_name, or close the other tier first"
            ) from None
        st = os.fstat(fd)
        size = st.st_size
        sb = aligned_buffer(SUPERBLOCK_BYTES)
        n = 0
        if size > 0:
            try:
                n = os.preadv(fd, [sb], 0)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                if direct is True:
                    raise SlotFileRefused(self._direct_refused_message(e)) from None
                self._reopen_buffered()  # O_DIRECT accepted at open(), refused at read
                n = os.preadv(fd, [sb], 0)
        existing = size > 0 and n == SUPERBLOCK_BYTES and bytes(sb[:8]) == SUPER_MAGIC
        recreate = existing and not self._superblock_matches(sb)
        if recreate:
            existing = False
        elif (
            not existing and n >= len(SUPER_MAGIC) and bytes(sb[: len(SUPER_MAGIC)]) == SUPER_MAGIC
        ):
            raise SlotFileRefused(
                f"{self.file} is a kvoff disk tier file cut short: {size} bytes, shorter than its "
                f"{SUPERBLOCK_BYTES}-byte superblock (truncated header; it holds no blocks); "
                f"delete that file, or choose another disk_path or file_name"
            )
        elif size > 0 and not existing and (any(bytes(sb[:n])) or not self._only_zeros(n, size)):
            raise SlotFileRefused(
                f"{self.file} exists and is not a kvoff disk tier file (no {SUPER_MAGIC!r} "
                f"header, and not all zeros: {size} bytes); choose another disk_path or "
                f"file_name, or delete that file"
            )
        # Every check that can refuse is done before the file is changed: a refused open leaves
        # an existing file (and its blocks) as it was. Recreating gives back what the file holds.
        self._check_space(size if existing else 0, reclaim=0 if existing else st.st_blocks * 512)
        if not existing:
            if recreate:
                log.warning(
                    "%s was written for another block size; recreating it empty (its blocks "
                    "cannot be served with payload_bytes=%d)",
                    self.file,
                    self.payload_bytes,
                )
                self.recreated = True
            os.ftruncate(fd, 0)  # new, zero-filled (crashed while created) or foreign
            self._write_superblock(direct)
        self._size_file()
        self.existing_bytes = size if existing else 0

    def _direct_refused_message(self, e: OSError) -> str:
        return (
            f"the file system of {self.file.parent} does not support O_DIRECT I/O (it accepted "
            f"O_DIRECT at open() but refused a read or write of {self.file}: {e}); pass "
            f"direct=None to fall back to buffered I/O or use another disk_path"
        )

    def _only_zeros(self, start: int, end: int) -> bool:
        """Whether bytes ``start..end`` of the file are all zero (a file that was being created
        when the process died), reading only its data (``SEEK_DATA``: holes and preallocated
        extents are skipped); stops at the first non-zero byte."""
        buf = aligned_buffer(1 << 20)
        seek_data = getattr(os, "SEEK_DATA", None)
        seek_hole = getattr(os, "SEEK_HOLE", None)
        off = start
        while off < end:
            data, hole = off, end
            if seek_data is not None and seek_hole is not None:
                try:
                    data = os.lseek(self.fd, off, seek_data)
                    hole = os.lseek(self.fd, data, seek_hole)
                except OSError as e:
                    if e.errno == errno.ENXIO:  # no data after ``off``
                        return True
                    data, hole = off, end  # SEEK_DATA unsupported: read it all
            pos = data - data % ALIGN  # O_DIRECT reads at aligned offsets
            stop = min(hole, end)
            while pos < stop:
                got = os.preadv(self.fd, [buf[: min(buf.nbytes, round_up(stop - pos))]], pos)
                if got <= 0:
                    return True  # end of file
                if np.frombuffer(buf[:got], dtype=np.uint8).any():
                    return False
                pos += got
            off = max(pos, off + 1)
        return True

    def _reopen_buffered(self) -> None:
        """Turns O_DIRECT off on the file's own descriptor: a file system that took O_DIRECT at
        ``open()`` refused it at the first read or write. ``F_SETFL`` keeps the descriptor and
        so its ``flock``; a second descriptor would conflict with that lock (flock locks belong
        to the open file description)."""
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~getattr(os, "O_DIRECT", 0))
        self.direct = False

    def _superblock_fields(self) -> bytes:
        return _SUPER.pack(
            SUPER_MAGIC, SUPER_VERSION, HEADER_BYTES, self.slot_bytes, self.payload_bytes
        )

    def _superblock_matches(self, sb: memoryview) -> bool:
        fields = self._superblock_fields()
        (stored_sum,) = struct.unpack_from("<Q", sb, _SUPER.size)
        return bytes(sb[: _SUPER.size]) == fields and stored_sum == xxhash.xxh3_64_intdigest(fields)

    def _write_superblock(self, direct: bool | None) -> None:
        sb = aligned_buffer(SUPERBLOCK_BYTES)
        fields = self._superblock_fields()
        sb[:] = bytes(SUPERBLOCK_BYTES)
        sb[: _SUPER.size] = fields
        struct.pack_into("<Q", sb, _SUPER.size, xxhash.xxh3_64_intdigest(fields))
        try:
            pwrite_all(self.fd, sb, 0)
        except OSError as e:
            if not (self.direct and e.errno == errno.EINVAL):
                raise
            if direct is True:  # O_DIRECT required: no fallback
                raise SlotFileRefused(self._direct_refused_message(e)) from None
            self._reopen_buffered()
            pwrite_all(self.fd, sb, 0)

    def _check_space(self, size: int, reclaim: int = 0) -> None:
        """Refuse when the file, ``size`` bytes long, needs more bytes to reach its capacity than
        its file system has free (plus ``reclaim``, what emptying the file gives back):
        fallocate would take the whole disk (and leave what it got: the engine's and everyone
        else's writes would then fail); a sparse file would fill it later."""
        target = self.target_bytes
        if size >= target:
            return
        st = os.fstatvfs(self.fd)
        free = st.f_bavail * st.f_frsize + reclaim
        if target - size > free:
            raise SlotFileRefused(
                f"the disk tier's file {self.file} needs {target - size} more bytes "
                f"(disk_bytes={self.capacity_bytes}), but its file system has {free} bytes "
                "free; lower disk_bytes or free space there"
            )

    def _size_file(self) -> None:
        """Preallocate the file to its capacity (fallocate), or leave it sparse if refused."""
        target = self.target_bytes
        size = os.fstat(self.fd).st_size
        if size > target:
            os.ftruncate(self.fd, target)
            size = target
        self.preallocated = True
        if size < target:
            self._check_space(size)  # checked before the file changed; a guard against races
            try:
                os.posix_fallocate(self.fd, size, target - size)
            except OSError as e:
                self.preallocated = False
                os.ftruncate(self.fd, size)  # give back what a failed fallocate took
                log.info("%s: not preallocated (%s); slots are allocated as written", self.file, e)
