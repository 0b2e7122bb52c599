"""The node pool's key filter: which keys its index may hold, in shared memory, so that an
engine answers a miss without a round trip.

Most look-ups of a request's first block miss (a new prompt), and on a busy machine a round
trip to the pool costs 30 µs to 1 ms (the pool's thread must wake up). The pool keeps a counting
Bloom filter of its index's keys (:class:`kvoff._scheduler.KeyFilter`: 16 one-byte cells per
slot, 4 probes, 0.24 % false positives when full) in ``/dev/shm/<region>.keys``, and updates it
before it replies to the call that changed the index. An engine maps it read-only and asks it
first: "no" is a miss at once; "maybe" asks the pool as before. So the filter changes how fast
an engine hears a miss, never what it hears.

The pool publishes no filter when tiers sit below it: a key missing from its index may still be
a hit once a tier promotes it, which only the pool can ask. Each pool start makes a new file
(a new inode, and a random ``epoch`` in its header and in the pool's hello), so an engine never
reads a dead pool's filter as the new pool's.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from typing import Any

from kvoff._scheduler import KeyFilter

logger = logging.getLogger(__name__)

SUFFIX = ".keys"
"""The filter's file name: the pool's first region's name and this suffix, in ``/dev/shm``."""


class PoolKeyFilter:
    """The pool's side: a new filter file for ``capacity`` keys, written by the serving thread.

    Args:
        path: the file to create (an old one of that name, a dead pool's, is replaced).
        capacity: keys the index holds at most (the pool's slots).
        group: a group id that may read it too (mode 0640), else only this user (0600).

    Raises:
        OSError: the file cannot be created or its pages reserved (a full ``/dev/shm``: give
            it 16 bytes per slot more than the region).
    """

    def __init__(self, path: str, capacity: int, group: int | None = None) -> None:
        self.path = path
        size = KeyFilter.bytes_for(capacity)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a dead pool's filter: its readers are detached, they remap
        mode = 0o640 if group is not None else 0o600
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            if group is not None:
                os.fchown(fd, -1, group)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # pages reserved now: a full /dev/shm fails here,
            # not later with a SIGBUS in the pool's thread
            self.inode = os.fstat(fd).st_ino
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        self.epoch = int.from_bytes(os.urandom(8), "little")
        self.filter = KeyFilter.create(self._map, self.epoch)
        self.unknown_removals = 0  # keys removed that were never added: a bug, counted

    def add(self, keys: list[bytes]) -> None:
        """Counts keys the index took (being stored, or stored)."""
        if keys:
            self.filter.add(keys)

    def remove(self, keys: Any) -> None:
        """Counts out keys the index dropped (evicted, a failed store)."""
        keys = list(keys)
        if keys:
            unknown = self.filter.remove(keys)
            if unknown:
                self.unknown_removals += unknown
                logger.error("kvoff node pool: %d keys left its index that its key filter never "
                             "held (a bug; the filter stays correct)", unknown)  # fmt: skip

    def describe(self) -> dict[str, Any]:
        """What an engine needs to map it (in the pool's hello)."""
        return {"path": self.path, "inode": self.inode, "epoch": self.epoch,
                "bytes": len(self._map)}  # fmt: skip

    def status(self) -> dict[str, Any]:
        """Cells, the fraction set (a scan: for ``kvoff pool status``), unknown removals."""
        cells = self.filter.num_cells
        return {"cells": cells, "set_fraction": round(self.filter.nonzero_cells() / cells, 6),
                "unknown_removals": self.unknown_removals}  # fmt: skip

    def close(self) -> None:
        """Unmaps it and removes the file (if it is still this one's). Idempotent."""
        if self._map.closed:
            return
        self.filter.release()
        self._map.close()
        try:
            if os.stat(self.path).st_ino == self.inode:
                os.unlink(self.path)
        except OSError:
            pass


class EngineKeyFilter:
    """An engine's read-only view of the pool's filter (see the module docstring).

    Use :func:`attach_key_filter`, which answers None when it cannot be used.

    Attributes:
        view: the filter itself (``kvoff._scheduler.KeyFilter``), for C++ callers
            (``NodePoolStores.store_reserved``); released by :meth:`close`.
    """

    def __init__(self, view: KeyFilter, mapping: mmap.mmap) -> None:
        self.may_contain = view.may_contain
        self.may_contain_any = view.may_contain_any
        self.view, self._map = view, mapping

    def close(self) -> None:
        """Lets the mapping go. Idempotent."""
        if not self._map.closed:
            self.view.release()
            self._map.close()


def attach_key_filter(info: Any) -> EngineKeyFilter | None:
    """Maps the filter a pool's hello describes (``key_filter``), read-only; None (and a debug
    log) when the hello has none, the file is another one than the hello's (inode, epoch), or
    this kvoff cannot read its format: the engine then asks the pool for every look-up."""
    if not isinstance(info, dict):
        return None
    try:
        path, inode, epoch = str(info["path"]), int(info["inode"]), int(info["epoch"])
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if st.st_ino != inode:
                raise ValueError(f"{path} is inode {st.st_ino}, the pool's filter is {inode}")
            mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            view = KeyFilter.attach(mapping)
        except BaseException:
            mapping.close()
            raise
        if view.epoch != epoch:
            view.release()
            mapping.close()
            raise ValueError(f"{path} has epoch {view.epoch}, the pool's filter {epoch}")
    except (KeyError, TypeError, ValueError, OSError) as e:
        logger.debug("kvoff node pool: no key filter (%s); every look-up asks the pool", e)
        return None
    return EngineKeyFilter(view, mapping)
