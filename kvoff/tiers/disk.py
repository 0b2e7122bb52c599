"""The local disk tier: whole blocks in fixed-size slots of one preallocated file (one job:
this tier, its index, I/O threads and recovery; opening the file, with its superblock, lock,
O_DIRECT and preallocation, is :mod:`kvoff.tiers.slot_file`'s).

File layout (one file per tier, ``<path>/<file_name>``, default ``kvoff-blocks.slots``)::

    offset 0                 : superblock, SUPERBLOCK_BYTES (4096): magic b"KVOFFDSK", version,
                               HEADER_BYTES, slot_bytes, payload_bytes, xxh3_64 of those fields
    offset 4096 + i*slot_bytes: slot i = block header (HEADER_BYTES = 4096) + payload, the payload
                               zero-padded to a multiple of 4096 bytes

so every slot, header and payload is 4 KiB-aligned and the file is written and read with
``O_DIRECT`` (no page cache; aligned bounce buffers from ``mmap``) when the file system allows it
(tmpfs does not: then buffered I/O, reported as ``stats()["direct_io"] == 0``). A batch runs on a
thread pool of ``io_threads``; ``os.pwrite`` / ``os.preadv`` release the GIL.

Index and eviction: an in-memory ``OrderedDict`` key → slot in LRU order (``get`` and a ``put`` of
a held key refresh a block; ``contains`` does not). A ``put`` that finds no free slot evicts the
least recently used block that is neither being read nor part of the same ``put`` batch.

Restart: a new :class:`DiskTier` on the same file rebuilds its index by scanning the slot headers
(not the payloads: the payload checksum, or the MAC, is verified by every ``get``). A header of
another fingerprint is not indexed (counted in ``fingerprint_mismatches``) and its slot is
reused; so is a header whose mode differs from the tier's (a plain header under a
``shared_secret``, a MAC'd one without: counted in ``unauthenticated_blocks``); an invalid
header is a free slot. The rebuilt LRU order is the write order (header ``stamp``). A file
written with another payload size (its superblock's ``slot_bytes`` / ``payload_bytes`` differ) is
treated as foreign and **recreated empty** (``stats()["recreated_files"] == 1``): its blocks
could never be served under this layout anyway, just as blocks of another fingerprint are
overwritten. A file that is not a kvoff disk tier (no superblock magic, not all zeros) is refused
with ValueError.

Reset: :meth:`DiskTier.clear` (an engine's cache reset: new weights) zeroes every block's header,
so neither this process nor a restart serves a block written before it.

Crash safety: a block's header and payload are written by one system call (a run of blocks in
consecutive slots by one ``pwritev``); ``evict`` zeroes the header. A torn write leaves an old or
missing header, or a header whose payload checksum does not match: a miss at ``get``, counted in
``corrupted_blocks``, never served.

Authentication: with ``fmt.shared_secret`` set (another host may mount the folder, and anyone
who can write the file could plant blocks), every block carries a MAC over its header, key and
payload (:mod:`kvoff.tiers.block_format`); a block whose MAC does not verify at ``get`` is a
miss, counted in ``unauthenticated_blocks``, dropped from the index like a corrupt block and
never served.

Failures: an unwritable path (say its parent is a regular file), a full disk (ENOSPC), the file
size limit (EFBIG), I/O errors: ``put`` drops the blocks (``writes_dropped``, ``io_errors``),
``get`` misses; nothing raises. If the file cannot be created at all the tier stays
``unavailable`` (``stats()["unavailable"] == 1``, :attr:`DiskTier.error` says why). Note that a
process which does not ignore ``SIGXFSZ`` is killed by the kernel when it exceeds RLIMIT_FSIZE.
"""

from __future__ import annotations

import errno
import heapq
import logging
import numbers
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvoff.tiers.base import (
    CallGate,
    SecondaryTier,
    TierStats,
    byte_view,
    check_batch,
    check_int,
    run_all,
)
from kvoff.tiers.block_format import (
    HEADER_BYTES,
    BlockFormat,
    check_block,
    decode_header,
    encode_header,
)
from kvoff.tiers.slot_file import (
    ALIGN,
    SUPERBLOCK_BYTES,
    SlotFile,
    SlotFileRefused,
    aligned_buffer,
    pwrite_all,
    round_up,
)

log = logging.getLogger("kvoff.tiers.disk")

DEFAULT_FILE_NAME = "kvoff-blocks.slots"
#: Most bytes one ``get`` reads in a single ``preadv`` (one ``put`` writes in a single
#: ``pwritev``) when the blocks of a batch sit in consecutive slots (headers and payloads of a
#: run in one system call: small blocks stop paying a call and a thread hand-off each; 2 MiB
#: keeps a batch spread over the I/O threads).
RUN_BYTES = 2 << 20
#: The kernel's limit on buffers per ``preadv`` (IOV_MAX on Linux), two per block.
_IOV_MAX = 1024
_ZERO_HEADER = bytes(HEADER_BYTES)
#: The counter of a read's rejection reason (:func:`~kvoff.tiers.block_format.check_block`, or
#: ``"io"``); every other reason is ``corrupted_blocks``.
_REASON_COUNTERS = {
    "fingerprint": "fingerprint_mismatches",
    "auth": "unauthenticated_blocks",
    "io": "io_errors",
}

T = TypeVar("T")
J = TypeVar("J", bound=tuple)


def slot_bytes_for(fmt: BlockFormat) -> int:
    """Bytes of one disk slot: header + payload rounded up to 4096."""
    return HEADER_BYTES + round_up(fmt.payload_bytes)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


class DiskTier(SecondaryTier):
    """Blocks in fixed-size slots of one preallocated file, O_DIRECT, LRU, restart-safe.

    Args:
        path: directory of the tier (created if missing). Every engine process / rank needs its
            own ``path`` or ``file_name``; the file is locked (``flock``) while open.
        capacity_bytes: bytes the file may take (``disk_bytes``), superblock included; the tier
            holds ``(capacity_bytes - 4096) // slot_bytes`` blocks. An int (Python or NumPy);
            a size such as ``"100GiB"`` is parsed by :func:`kvoff.config.parse_byte_size`.
        fmt: block format (fingerprint, payload bytes).
        io_threads: threads doing the I/O of one batch in parallel (>= 1).
        direct: True = require O_DIRECT, False = buffered I/O, None = O_DIRECT if the file system
            supports it, else buffered. Nothing else (not 0, 1 or a string).
        file_name: name of the slot file inside ``path`` (extra to the tier interface).

    Raises:
        TypeError: ``capacity_bytes`` or ``io_threads`` not an int (a bool, float, str...), or
            ``direct`` not True, False or None.
        ValueError: capacity smaller than one slot, io_threads < 1, a ``file_name`` that is
            not one file name (empty, ``.``, ``..``, with a ``/``), ``path`` exists and is not a
            directory, ``direct=True`` on a file system without O_DIRECT (refused at ``open()``,
            or with EINVAL at the first read or write), the file is locked by another DiskTier,
            the file exists and is not a kvoff disk tier file (no superblock magic and not all
            zeros, or one cut short inside its superblock), or the file system has less free
            space than the file still needs (preallocating it would fill the disk). Every
            refusal is decided before the file is changed: an existing file is left as it was.
    """

    name = "disk"

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        fmt: BlockFormat,
        *,
        io_threads: int = 4,
        direct: bool | None = None,
        file_name: str = DEFAULT_FILE_NAME,
    ) -> None:
        if not isinstance(fmt, BlockFormat):
            raise ValueError(f"fmt must be a kvoff.tiers.BlockFormat, got {fmt!r}")
        self.fmt = fmt
        self.slot_bytes = slot_bytes_for(fmt)
        need = SUPERBLOCK_BYTES + self.slot_bytes
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, numbers.Integral):
            raise TypeError(
                f"disk_bytes={capacity_bytes!r} must be an int number of bytes, not a "
                f"{type(capacity_bytes).__name__} (e.g. 100 << 30); parse a size such as "
                f"'100GiB' with kvoff.config.parse_byte_size"
            )
        capacity_bytes = int(capacity_bytes)  # a NumPy integer too
        if capacity_bytes < need:
            raise ValueError(
                f"disk_bytes={capacity_bytes!r} is smaller than one block: the disk tier needs "
                f"{need} bytes for one slot ({SUPERBLOCK_BYTES} file header + {HEADER_BYTES} block "
                f"header + payload {fmt.payload_bytes} rounded up to {ALIGN}); raise disk_bytes "
                f"to at least {need} (a useful tier holds many blocks)"
            )
        io_threads = check_int(io_threads, "io_threads", minimum=1, hint="e.g. 4")
        if direct is not None and direct is not True and direct is not False:
            raise TypeError(
                f"direct={direct!r} must be True (require O_DIRECT), False (buffered I/O) or None "
                f"(O_DIRECT where the file system allows it)"
            )
        if (
            not isinstance(file_name, str)
            or file_name in ("", ".", "..")
            or "/" in file_name
            or "\0" in file_name
        ):
            raise ValueError(
                f"file_name={file_name!r} must name a file inside path (no '/', not '', '.' or "
                f"'..'), e.g. {DEFAULT_FILE_NAME!r}"
            )
        self.num_slots = (capacity_bytes - SUPERBLOCK_BYTES) // self.slot_bytes
        self.capacity_bytes = capacity_bytes
        self.dir = Path(path)
        self.file = self.dir / file_name
        self.error: str | None = None
        self._stats = TierStats(
            extra=(
                "blocks",
                "capacity_blocks",
                "direct_io",
                "preallocated",
                "unavailable",
                "recreated_files",
                "scanned_slots",
                "recovered_blocks",
            )
        )
        self._stats.set(capacity_blocks=self.num_slots, slot_bytes=self.slot_bytes)
        self._lock = threading.Lock()
        self._gate = CallGate(self._lock)  # operations in flight (close waits for them)
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._free: list[int] = []  # heap: lowest slot first keeps a sparse file compact
        self._readers: dict[int, int] = {}
        self._doomed: set[int] = set()  # dropped from the index while being read
        self._pending: set[int] = set()  # being written (not yet indexed)
        self._releasing: set[int] = set()  # header being zeroed before the slot is freed
        self._stamp = 0
        self._generation = 0  # clear() count: a put that straddles a clear() indexes nothing
        self._tls = threading.local()
        self._fd = -1
        self._fd_closer: weakref.finalize | None = None  # closes the file if never closed
        self.direct = False
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvoff-disk")
        try:
            self._open(direct)
        except SlotFileRefused as e:
            self._pool.shutdown(wait=False)
            self._close_fd()  # a refused tier keeps no descriptor and no lock on the file
            raise ValueError(str(e)) from None
        except OSError as e:
            self._close_fd()
            self.error = f"disk tier at {self.file} is unavailable: {e}; its writes are dropped"
            log.warning("%s", self.error)
            self._stats.set(unavailable=1, direct_io=0)
            self._free = []

    # ------------------------------------------------------------------ opening and scanning

    def _close_fd(self) -> None:
        if self._fd >= 0:
            if self._fd_closer is not None:
                self._fd_closer()  # os.close, once: also drops the flock (per open description)
            self._fd = -1

    def _open(self, direct: bool | None) -> None:
        """Opens the slot file (:class:`kvoff.tiers.slot_file.SlotFile`: O_DIRECT, lock,
        superblock, space, preallocation) and rebuilds the index from its slots' headers."""
        f = SlotFile(
            self.file,
            slot_bytes=self.slot_bytes,
            payload_bytes=self.fmt.payload_bytes,
            num_slots=self.num_slots,
            capacity_bytes=self.capacity_bytes,
            direct=direct,
        )
        self._fd, self.direct = f.fd, f.direct  # the tier owns the descriptor from here
        # a tier dropped without close() still closes (and unlocks) its file when collected
        self._fd_closer = weakref.finalize(self, os.close, f.fd)
        if f.recreated:
            self._stats.set(recreated_files=1)
        self._stats.set(direct_io=int(f.direct), preallocated=int(f.preallocated))
        scanned = 0
        if f.existing_bytes:
            scanned = min(
                self.num_slots, max(0, (f.existing_bytes - SUPERBLOCK_BYTES) // self.slot_bytes)
            )
            self._scan(scanned)
        used = set(self._index.values())
        self._free = [s for s in range(self.num_slots) if s not in used]
        heapq.heapify(self._free)
        self._stats.set(blocks=len(self._index))

    def _scan(self, count: int) -> None:
        """Rebuild the index from the headers of slots ``0..count-1``."""
        found: dict[bytes, tuple[int, int]] = {}
        stale: list[int] = []
        corrupt = foreign = unauthenticated = 0

        def read_header(slot: int) -> bytes | None:
            buf = self._bounce()[:HEADER_BYTES]
            try:
                n = os.preadv(self._fd, [buf], self._offset(slot))
            except OSError:
                return None
            return bytes(buf) if n == HEADER_BYTES else None

        headers = self._pool.map(read_header, range(count), chunksize=64)
        for slot, header in enumerate(headers):
            if header is None or not any(header[:8]):
                continue
            info, reason = decode_header(header)
            if info is None:
                corrupt += reason != "magic"
                continue
            if info.fingerprint != self.fmt.fingerprint:
                foreign += 1
                continue
            if info.mac != self.fmt.authenticated:  # verified (MAC) by every get
                unauthenticated += 1
                continue
            if info.payload_bytes != self.fmt.payload_bytes:
                corrupt += 1
                continue
            prev = found.get(info.key)
            if prev is not None:  # a duplicate (concurrent puts of one key, or a crash): newest
                stale.append(prev[1] if prev[0] <= info.stamp else slot)
                if prev[0] > info.stamp:
                    continue
            found[info.key] = (info.stamp, slot)
        order = sorted(found.items(), key=lambda kv: kv[1])
        self._index = OrderedDict((key, slot) for key, (_, slot) in order)
        self._stamp = max((stamp for stamp, _ in found.values()), default=0)
        for slot in stale:
            self._zero_header(slot)
        self._stats.add(
            corrupted_blocks=corrupt,
            fingerprint_mismatches=foreign,
            unauthenticated_blocks=unauthenticated,
        )
        self._stats.set(scanned_slots=count, recovered_blocks=len(self._index))

    # ------------------------------------------------------------------ I/O helpers

    def _offset(self, slot: int) -> int:
        return SUPERBLOCK_BYTES + slot * self.slot_bytes

    def _bounce(self) -> memoryview:
        """This thread's slot-sized aligned bounce buffer."""
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = aligned_buffer(self.slot_bytes)
        return buf

    def _aligned(self, view: memoryview) -> bool:
        """Whether ``view`` can be used for I/O as is (O_DIRECT needs 4 KiB alignment)."""
        if not self.direct:
            return True
        return view.nbytes % ALIGN == 0 and _address(view) % ALIGN == 0

    def _zero_header(self, slot: int) -> bool:
        try:
            buf = self._bounce()[:HEADER_BYTES]
            buf[:] = _ZERO_HEADER
            pwrite_all(self._fd, buf, self._offset(slot))
            return True
        except OSError:
            return False

    def _write_block(self, slot: int, key: bytes, payload: memoryview, stamp: int) -> str | None:
        """Write one block's header and payload with one system call (the payload straight
        from the caller's buffer when it is aligned, else through the bounce buffer). Returns
        None, or the OSError text."""
        try:
            header = encode_header(self.fmt, key, payload, stamp=stamp)
            off = self._offset(slot)
            pb = self.fmt.payload_bytes
            if self._aligned(payload) and self.slot_bytes == HEADER_BYTES + pb:
                hbuf = self._run_headers(1)[:HEADER_BYTES]
                hbuf[:] = header
                self._pwritev_all([hbuf, payload], off)
            else:
                buf = self._bounce()
                buf[:HEADER_BYTES] = header
                buf[HEADER_BYTES : HEADER_BYTES + pb] = payload
                buf[HEADER_BYTES + pb :] = bytes(self.slot_bytes - HEADER_BYTES - pb)
                pwrite_all(self._fd, buf, off)
            return None
        except OSError as e:
            return f"{type(e).__name__}: {e}"

    def _write_run(self, run: list[tuple[int, bytes, memoryview, int]]) -> list[str | None]:
        """Write a run of blocks into consecutive slots (:meth:`_runs`) with one ``pwritev``
        (every header, then its payload, in slot order). Per block: None, or the OSError
        text (a failed call fails the whole run)."""
        if len(run) == 1:
            return [self._write_block(*run[0])]
        iov: list[memoryview] = []
        try:
            headers = self._run_headers(len(run))
            for i, (_, key, payload, stamp) in enumerate(run):
                h = headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]
                h[:] = encode_header(self.fmt, key, payload, stamp=stamp)
                iov += [h, payload]
            self._pwritev_all(iov, self._offset(run[0][0]))
        except OSError as e:
            return [f"{type(e).__name__}: {e}"] * len(run)
        return [None] * len(run)

    def _pwritev_all(self, iov: list[memoryview], offset: int) -> None:
        """``pwritev`` of every buffer of ``iov`` at ``offset``; a short write (a full disk, the
        file size limit) is an OSError."""
        total = sum(v.nbytes for v in iov)
        n = os.pwritev(self._fd, iov, offset)
        if n != total:
            raise OSError(errno.ENOSPC, f"short write: {n} of {total} bytes")

    def _read_block(self, slot: int, key: bytes, out: memoryview) -> str | None:
        """Read and verify one block into ``out``. Returns None if served, else the reason
        (a :func:`check_block` reason, or ``"io"``)."""
        pb = self.fmt.payload_bytes
        try:
            buf = self._bounce()  # an mmap that fails (ENOMEM) is an I/O condition too
            if self._aligned(out):  # straight into the caller's buffer
                header, payload = buf[:HEADER_BYTES], out
                n = os.preadv(self._fd, [header, out], self._offset(slot))
            else:
                header, payload = buf[:HEADER_BYTES], buf[HEADER_BYTES : HEADER_BYTES + pb]
                n = os.preadv(self._fd, [buf], self._offset(slot))
        except OSError:
            return "io"
        if n < HEADER_BYTES + pb:
            return "length"
        reason = check_block(self.fmt, key, header, payload)
        if reason is None and payload is not out:
            out[:] = payload
        return reason

    def _runs(self, jobs: list[J]) -> list[list[J]]:
        """``jobs`` (slot, key, buffer, ...) cut into runs moved with one ``preadv`` /
        ``pwritev`` each: consecutive slots, in order, whose buffers can be used directly
        (aligned, and slots without padding), at most :data:`RUN_BYTES` and :data:`_IOV_MAX`
        buffers per run; any other job is a run of one. The runs, joined, are ``jobs``."""
        pb = self.fmt.payload_bytes
        cap = max(1, min(RUN_BYTES // self.slot_bytes, _IOV_MAX // 2))
        fits = cap > 1 and self.slot_bytes == HEADER_BYTES + pb
        runs: list[list[J]] = []
        for job in jobs:
            ok = fits and self._aligned(job[2])
            if ok and runs and runs[-1][-1][0] + 1 == job[0] and len(runs[-1]) < cap:
                last = runs[-1]
                if len(last) > 1 or self._aligned(last[0][2]):
                    last.append(job)
                    continue
            runs.append([job])
        return runs

    def _read_run(self, run: list[tuple[int, bytes, memoryview]]) -> list[str | None]:
        """Read and verify a run of blocks in consecutive slots (:meth:`_runs`) with one
        ``preadv``: per block, None if served, else the reason (as :meth:`_read_block`)."""
        if len(run) == 1:
            return [self._read_block(*run[0])]
        pb = self.fmt.payload_bytes
        try:
            headers = self._run_headers(len(run))
            iov: list[memoryview] = []
            for i, (_, _, out) in enumerate(run):
                iov += [headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES], out]
            n = os.preadv(self._fd, iov, self._offset(run[0][0]))
        except OSError:
            return ["io"] * len(run)
        return [
            "length"
            if n < (i + 1) * (HEADER_BYTES + pb)
            else check_block(self.fmt, key, headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES], out)
            for i, (_, key, out) in enumerate(run)
        ]

    def _run_headers(self, count: int) -> memoryview:
        """This thread's aligned buffer for ``count`` block headers (grown when needed)."""
        buf = getattr(self._tls, "headers", None)
        if buf is None or buf.nbytes < count * HEADER_BYTES:
            buf = self._tls.headers = aligned_buffer(count * HEADER_BYTES)
        return buf

    def _run(self, fn: Callable[..., T], jobs: list[tuple[Any, ...]]) -> list[T]:
        """``fn(*job)`` for every job on the I/O threads (in the caller when there is one);
        every job has finished before an error is raised (:func:`~kvoff.tiers.base.run_all`)."""
        if len(jobs) == 1:
            return [fn(*jobs[0])]
        return run_all(self._pool, fn, jobs)

    def _enter(self) -> bool:
        """Count an operation in flight (close waits for it); False once closed/unavailable
        (the descriptor is gone only when open failed, or after the gate closed)."""
        return self._fd >= 0 and self._gate.enter()

    def _exit(self) -> None:
        self._gate.exit()

    # ------------------------------------------------------------------ slot bookkeeping

    def _take_slot(self, protected: set[bytes]) -> int | None:
        """A free slot, else the LRU victim's (not being read, not in ``protected``); lock held."""
        if self._free:
            return heapq.heappop(self._free)
        for key, slot in self._index.items():
            if key not in protected and not self._readers.get(slot):
                del self._index[key]
                self._stats.add(evictions=1)
                return slot
        return None

    def _drop(self, slot: int, release: list[int]) -> None:
        """A slot just taken out of the index: freed when its reads end if it is being read,
        else added to ``release`` (for :meth:`_release`); lock held."""
        if self._readers.get(slot):
            self._doomed.add(slot)
        else:
            self._releasing.add(slot)
            release.append(slot)

    def _release(self, slots: list[int]) -> None:
        """Zero the headers of ``slots`` (outside the lock), then free them."""
        if not slots:
            return
        for slot in slots:
            self._zero_header(slot)
        with self._lock:
            for slot in slots:
                self._releasing.discard(slot)
                heapq.heappush(self._free, slot)

    # ------------------------------------------------------------------ the tier interface

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is in the index (its bytes are verified by :meth:`get`); all False
        once the tier is closed.

        Raises:
            ValueError: a key that is not bytes of 1..64 (nothing is looked up).
            TypeError: ``keys`` is not a list or tuple (a single key, None).
        """
        check_batch(keys)
        with self._lock:
            if self._gate.closed:
                return [False] * len(keys)
            found = [bytes(k) in self._index for k in keys]
        self._stats.add(lookups=len(found), lookup_hits=sum(found))
        return found

    def get(self, keys: Sequence[bytes], outs: Sequence[np.ndarray]) -> list[bool]:
        """Read and verify blocks into ``outs`` (see :meth:`SecondaryTier.get`). A block that a
        :meth:`clear` dropped while it was being read is a miss. I/O conditions are misses; an
        exception other than an OSError met while reading (a bug) propagates once every read has
        ended, with nothing served, every key counted as a miss and every slot given back.

        Raises:
            ValueError: a key that is not bytes of 1..64, an ``outs`` entry that is not a
                writable C-contiguous buffer of ``fmt.payload_bytes`` bytes, or len(outs) !=
                len(keys) (nothing is read).
            TypeError: ``keys`` or ``outs`` is not a list or tuple, or an entry of ``outs``
                is not a buffer.
        """
        check_batch(keys, outs, "outs")
        views = [byte_view(o, self.fmt.payload_bytes, "outs[i]", writable=True) for o in outs]
        results = [False] * len(keys)
        if not self._enter():
            self._stats.add(misses=len(keys))
            return results
        t0 = time.perf_counter()
        try:
            jobs: list[tuple[int, bytes, memoryview]] = []
            where: list[int] = []
            with self._lock:
                generation = self._generation
                for i, k in enumerate(keys):
                    slot = self._index.get(bytes(k))
                    if slot is not None:
                        self._index.move_to_end(bytes(k))
                        self._readers[slot] = self._readers.get(slot, 0) + 1
                        jobs.append((slot, bytes(k), views[i]))
                        where.append(i)
            reasons: list[str | None] | None = None  # stays None if the reads raise
            try:
                runs = self._runs(jobs)
                reasons = [r for rs in self._run(self._read_run, [(r,) for r in runs]) for r in rs]
            finally:  # the reader counts are undone whatever happened
                self._end_reads(generation, where, jobs, reasons, results, len(keys), t0)
            return results
        finally:
            self._exit()

    def _end_reads(
        self,
        generation: int,
        where: list[int],
        jobs: list[tuple[int, bytes, memoryview]],
        reasons: list[str | None] | None,
        results: list[bool],
        count: int,
        t0: float,
    ) -> None:
        """The end of a :meth:`get` of ``count`` keys: uncount the readers of ``jobs`` (at
        ``where`` in the batch), set ``results`` from ``reasons`` (None: the reads raised, nothing
        is served and the blocks stay held), drop bad blocks, free slots whose last reader this
        was, count. A block is not served when a :meth:`clear` ran since ``generation``."""
        release: list[int] = []
        counts = dict.fromkeys(
            ("corrupted_blocks", "fingerprint_mismatches", "unauthenticated_blocks", "io_errors"),
            0,
        )
        with self._lock:
            cleared = generation != self._generation  # the blocks read predate a clear()
            for n, (i, (slot, key, _)) in enumerate(zip(where, jobs, strict=True)):
                self._readers[slot] -= 1
                reason = "raised" if reasons is None else reasons[n]
                if reason is None:
                    results[i] = not cleared
                elif reasons is not None:
                    counts[_REASON_COUNTERS.get(reason, "corrupted_blocks")] += 1
                    if self._index.get(key) == slot:
                        del self._index[key]
                        self._doomed.add(slot)
                if not self._readers[slot]:
                    del self._readers[slot]
                    if slot in self._doomed:
                        self._doomed.discard(slot)
                        self._releasing.add(slot)
                        release.append(slot)
            self._stats.set(blocks=len(self._index))
        self._release(release)
        hits = sum(results)
        read = len(jobs) if reasons is not None else 0
        self._stats.add(
            hits=hits,
            misses=count - hits,
            blocks_read=read,
            bytes_read=read * (HEADER_BYTES + self.fmt.payload_bytes),
            read_seconds=time.perf_counter() - t0,
            **counts,
        )

    def put(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray]) -> list[bool]:
        """Store blocks, evicting LRU blocks when full (see :meth:`SecondaryTier.put`). A key
        already held is refreshed, not rewritten. A put that a :meth:`clear` overlaps (one that
        began before ``clear`` returned) stores nothing: its blocks predate the reset. I/O
        conditions drop blocks; an exception other than an OSError met while writing (a bug)
        propagates once every write has ended, with the slots it took given back.

        Raises:
            ValueError: a key that is not bytes of 1..64, a payload that is not a C-contiguous
                buffer of ``fmt.payload_bytes`` bytes, or len(payloads) != len(keys) (nothing
                is written or evicted).
            TypeError: ``keys`` or ``payloads`` is not a list or tuple, or an entry of ``payloads``
                is not a buffer.
        """
        generation = self._generation  # first thing: the blocks were made before this call
        check_batch(keys, payloads, "payloads")
        views = [byte_view(p, self.fmt.payload_bytes, "payloads[i]") for p in payloads]
        results = [False] * len(keys)
        if not self._enter():
            self._stats.add(writes_dropped=len(keys))
            return results
        t0 = time.perf_counter()
        try:
            jobs: list[tuple[int, bytes, memoryview, int]] = []
            where: list[int] = []
            same_as: dict[int, int] = {}  # a repeated key in the batch answers like its first
            with self._lock:
                if generation == self._generation:  # else a clear() ran: store nothing
                    protected = {bytes(k) for k in keys if bytes(k) in self._index}
                    first: dict[bytes, int] = {}
                    for i, k in enumerate(keys):
                        key = bytes(k)
                        if key in protected:
                            self._index.move_to_end(key)
                            results[i] = True
                            continue
                        if key in first:
                            same_as[i] = first[key]
                            continue
                        first[key] = i
                        slot = self._take_slot(protected)
                        if slot is None:
                            continue
                        self._pending.add(slot)
                        self._stamp = max(time.time_ns(), self._stamp + 1)
                        jobs.append((slot, key, views[i], self._stamp))
                        where.append(i)
            errors: list[str | None] | None = None  # stays None if the writes raise
            try:
                runs = self._runs(jobs)
                errors = [
                    e for run in self._run(self._write_run, [(r,) for r in runs]) for e in run
                ]
            finally:  # the slots taken are indexed or given back whatever happened
                self._end_writes(generation, where, jobs, errors, same_as, results, t0)
            if errors and any(errors):
                log.debug("disk tier %s: %s", self.file, next(e for e in errors if e))
            return results
        finally:
            self._exit()

    def _end_writes(
        self,
        generation: int,
        where: list[int],
        jobs: list[tuple[int, bytes, memoryview, int]],
        errors: list[str | None] | None,
        same_as: dict[int, int],
        results: list[bool],
        t0: float,
    ) -> None:
        """The end of a :meth:`put`: index each block of ``jobs`` (at ``where`` in the batch)
        written without error (``errors``; None: the writes raised, nothing is indexed), unless
        a :meth:`clear` ran since ``generation`` or a concurrent put of the key won; give every
        other slot back; set ``results``; count (written: only the blocks answered True)."""
        release: list[int] = []
        written = 0
        with self._lock:
            cleared = generation != self._generation
            for n, (i, (slot, key, _, _)) in enumerate(zip(where, jobs, strict=True)):
                self._pending.discard(slot)
                err = "raised" if errors is None else errors[n]
                if err is None and key not in self._index and not cleared:
                    self._index[key] = slot
                    results[i] = True
                else:  # failed (header may be stale), a concurrent put won, or a clear() ran
                    # meanwhile (the block is older than it): free it
                    results[i] = err is None and not cleared  # True: held (the other put's)
                    self._releasing.add(slot)
                    release.append(slot)
                written += results[i]
            for i, j in same_as.items():
                results[i] = results[j]
            self._stats.set(blocks=len(self._index))
        self._release(release)
        failed = 0 if errors is None else sum(e is not None for e in errors)
        self._stats.add(
            blocks_written=written,
            bytes_written=written * (HEADER_BYTES + self.fmt.payload_bytes),
            writes_dropped=len(results) - sum(results),
            io_errors=failed,
            write_seconds=time.perf_counter() - t0,
        )

    def evict(self, keys: Sequence[bytes]) -> int:
        """Remove blocks (header zeroed on disk so a restart does not bring them back); returns
        how many were present (0 once the tier is closed).

        Raises:
            ValueError: a key that is not bytes of 1..64 (nothing is evicted).
            TypeError: ``keys`` is not a list or tuple (a single key, None).
        """
        check_batch(keys)
        if not self._enter():
            return 0
        try:
            release: list[int] = []
            present = 0
            with self._lock:
                for k in keys:
                    slot = self._index.pop(bytes(k), None)
                    if slot is None:
                        continue
                    present += 1
                    self._drop(slot, release)
                self._stats.set(blocks=len(self._index))
            self._release(release)
            self._stats.add(evictions=present)
            return present
        finally:
            self._exit()

    def clear(self) -> int:
        """Drops every block (see :meth:`SecondaryTier.clear`): each header is zeroed on disk,
        so a restart does not bring them back either; a ``put`` still writing when this runs
        indexes nothing. Returns how many blocks were held (0 once the tier is closed). Slots
        being read are freed when their reads end."""
        if not self._enter():
            return 0
        try:
            release: list[int] = []
            with self._lock:
                self._generation += 1
                present = len(self._index)
                for slot in self._index.values():
                    self._drop(slot, release)
                self._index.clear()
                self._stats.set(blocks=0)
            self._release(release)
            self._stats.add(evictions=present)
            return present
        finally:
            self._exit()

    def stats(self) -> dict[str, int | float]:
        """Counters of :data:`kvoff.tiers.base.STAT_KEYS` plus ``blocks`` (held),
        ``capacity_blocks``, ``slot_bytes``, ``direct_io`` (1 = O_DIRECT), ``preallocated``
        (1 = fallocate succeeded), ``unavailable`` (1 = the file could not be opened),
        ``recreated_files``, ``scanned_slots``, ``recovered_blocks`` (index rebuilt at open)."""
        return self._stats.snapshot()

    def close(self) -> None:
        """Wait for operations in flight, stop the I/O threads, close (and unlock) the file."""
        if not self._gate.close():
            return
        self._pool.shutdown(wait=True)
        self._close_fd()

    # ------------------------------------------------------------------ introspection (tests)

    def held_keys(self) -> list[bytes]:
        """Held keys, least recently used first."""
        with self._lock:
            return list(self._index)

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding ``key``, or None."""
        with self._lock:
            return self._index.get(bytes(key))

    def slot_offset(self, slot: int) -> int:
        """File offset (bytes) of slot ``slot``'s header; its payload follows at +HEADER_BYTES."""
        return self._offset(slot)

    def check_consistency(self) -> None:
        """Raise AssertionError unless every slot is in exactly one state (indexed, free, being
        written, being read after removal, being released) and each indexed slot's header on
        disk names its key under this tier's fingerprint. Call it while the tier is idle."""
        with self._lock:
            indexed = list(self._index.values())
            states = [
                indexed,
                list(self._free),
                list(self._pending),
                list(self._doomed),
                list(self._releasing),
            ]
            every = [s for group in states for s in group]
            assert len(every) == len(set(every)), f"a slot is in two states: {states}"
            if self._fd >= 0:
                assert set(every) == set(range(self.num_slots)), "a slot is lost"
            items = list(self._index.items())
        buf = self._bounce()[:HEADER_BYTES]
        for key, slot in items:
            assert os.preadv(self._fd, [buf], self._offset(slot)) == HEADER_BYTES
            info, reason = decode_header(buf)
            assert info is not None, f"slot {slot} of {key.hex()} has a bad header: {reason}"
            assert info.key == key, f"slot {slot} holds {info.key.hex()}, indexed as {key.hex()}"
            assert info.fingerprint == self.fmt.fingerprint
