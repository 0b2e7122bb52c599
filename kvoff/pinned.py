"""The CPU pool's memory: one exact-size allocation, page-locked by one call.

``torch.empty(..., pin_memory=True)`` goes through torch's pinned caching allocator, which
rounds every request up to a power of two: a 300 GiB pool would lock 512 GiB, or fail
(docs/design.md "Moving bytes"). kvoff instead allocates exactly the bytes the pool needs (ordinary
host memory from torch's CPU allocator) and page-locks them with one ``cudaHostRegister``
call; a failure names the pool size and what to lower. The memory is registered portable and
mapped, so copy calls and the SM kernel (through the device pointer; with unified addressing
it is the host pointer) can both use it.

One registration, not several: copy calls refuse a host range that spans two registrations.
On an H200 (CUDA 13.0, driver 580.159.04, 2026-11-24) a copy of one row straddling the
boundary of two ``cudaHostRegister`` ranges failed with ``cudaErrorInvalidValue`` through
``cudaMemcpyAsync`` and ``cudaMemcpyBatchAsync`` (only the SM kernel, through mapped addresses,
copied it), and so did the ``memcpy`` mechanism's copy of a run of adjacent rows across the
boundary (``bench/results/gpu/h200-2026-11-24``). A pool pinned in 1 GiB chunks therefore
failed every job whose block, or run of adjacent blocks, crossed a cut (``kvoff bench transfer``:
DeepSeek-V3 MLA's 4.3 MiB blocks).

**Shared pools.** With ``shared_name`` the pool lives in a POSIX shared-memory file
(``/dev/shm/<name>``) instead, so that another process of the same engine can map the same
bytes (:class:`SharedHostPool`): vLLM's multiprocess executor runs each rank's worker, which owns
the pool, outside the engine-core process, where kvoff's scheduler drives the secondary tiers
that read and write the pool. The file starts with one page of header (magic, format version,
the tensors' offsets and shapes, the creating process's id) followed by the tensors, each on a
4 KiB boundary. Its pages are reserved up front (``posix_fallocate``): on a full ``/dev/shm`` the
constructor fails with a :class:`SharedMemoryError` that says so, instead of the process dying
of ``SIGBUS`` on first touch. A file of the same name whose creator still runs (two engines
given one engine id) is an error; one whose creator is gone is replaced. The name is removed
when the pool is closed or collected, or at process exit; mappings stay valid until the last
view goes away.

**Pools that outlive their creator** (a node pool's regions, ``kvoff pool serve``). Every process
that maps such a pool holds a shared ``flock(2)`` lock on its file for as long as it maps it
(the kernel drops it when the process dies, however it dies). Closing the pool drops the lock and
removes the name only when an exclusive lock can then be taken: when no other process maps it.
So a node pool stopped cleanly under running engines leaves its region for the next pool to
adopt (the engines' mappings stay its memory), and the last engine to let it go removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import re
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvoff.checks import check_flag

__all__ = [
    "SHM_DIR",
    "SHM_HEADER_BYTES",
    "HostPool",
    "PinningError",
    "SharedHostPool",
    "SharedMemoryError",
]

_ALIGN = 4096  # every tensor of the pool starts on its own page
_CUDA_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable (cuda_runtime_api.h)
_CUDA_HOST_REGISTER_MAPPED = 0x02  # cudaHostRegisterMapped


class PinningError(RuntimeError):
    """Page-locking the CPU pool failed; the message says how much was asked and what to lower."""


class SharedMemoryError(RuntimeError):
    """A shared pool could not be created or attached; the message names the file and the fix."""


SHM_DIR = "/dev/shm"
"""Where shared pools live (Linux's POSIX shared-memory tmpfs)."""
_SHM_MAGIC = b"kvoff-host-pool\x00"  # 16 bytes
_SHM_VERSION = 1
SHM_HEADER_BYTES = 4096
"""Bytes before a shared pool's first tensor: one page of header (then the tensors, aligned)."""
_SHM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


def _shm_path(name: str) -> str:
    if not isinstance(name, str) or not _SHM_NAME.fullmatch(name):
        raise ValueError(
            f"shared pool name {name!r} is not a file name of 1..201 characters from "
            "[A-Za-z0-9._-] (starting with a letter or digit)"
        )
    return os.path.join(SHM_DIR, name)


def _unlink_if_same(path: str, ino: int, owner_pid: int | None = None) -> None:
    """Removes ``path`` if it is still the file of inode ``ino`` (not a newer pool's); with
    ``owner_pid``, only in that process (a child forked from it that exits runs its finalizers
    too, and must not remove its parent's pool)."""
    if owner_pid is not None and os.getpid() != owner_pid:
        return
    try:
        if os.stat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass


def _unlink_if_last(fd: int, path: str, ino: int, owner_pid: int) -> None:
    """Lets go of this process's hold on a shared pool (the shared lock on ``fd``, then ``fd``)
    and removes ``path`` when no other process holds the file (an exclusive lock is free) and
    the name is still the file of inode ``ino``. Two processes letting go at once: the one
    that takes the exclusive lock second sees it free (the first closed its descriptor), or
    the first one removed the name. In a child forked from ``owner_pid``, which shares the
    lock with its parent, only the child's descriptor is closed (the parent's hold stays)."""
    if os.getpid() != owner_pid:
        with contextlib.suppress(OSError):
            os.close(fd)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another process maps it: it stays for them (and for the next owner)
        _unlink_if_same(path, ino)
    except OSError:
        pass
    finally:
        os.close(fd)


def _hold(fd: int, path: str) -> int:
    """A descriptor of ``fd``'s file holding a shared lock on it (for :func:`_unlink_if_last`),
    checked to be the file ``path`` names still (a process that let the last hold go may have
    removed the name between our open and our lock).

    Raises:
        SharedMemoryError: the name was removed or replaced meanwhile.
    """
    held = os.dup(fd)
    try:
        fcntl.flock(held, fcntl.LOCK_SH)
        if os.stat(path).st_ino != os.fstat(held).st_ino:
            raise FileNotFoundError(path)
    except OSError as e:
        os.close(held)
        raise SharedMemoryError(f"the shared pool {path} was removed while it was mapped") from e
    return held


def _shm_free() -> str:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return "unknown"
    return f"{st.f_bavail * st.f_frsize / 2**30:.2f} GiB"


def _pack_header(meta: dict[str, Any]) -> bytes:
    """A shared pool's header: magic, format version, length, then ``meta`` as JSON."""
    data = json.dumps(meta).encode()
    return _SHM_MAGIC + struct.pack("<II", _SHM_VERSION, len(data)) + data


def _parse_header(head: bytes) -> dict[str, Any] | None:
    """``meta`` of a header written by :func:`_pack_header`; None for anything else (another
    file, another format version, a header not written yet)."""
    try:
        version, n = struct.unpack_from("<II", head, len(_SHM_MAGIC))
        meta = json.loads(head[len(_SHM_MAGIC) + 8 : len(_SHM_MAGIC) + 8 + n])
    except (struct.error, ValueError):
        return None
    if not head.startswith(_SHM_MAGIC) or version != _SHM_VERSION or not isinstance(meta, dict):
        return None
    return meta


def _pool_owner(path: str) -> int | None:
    """The pid that created the kvoff pool at ``path`` if that process still runs (or the file
    is being created right now: no header yet, younger than 10 s), else None (a stale file)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(SHM_HEADER_BYTES)
            age = time.time() - os.fstat(fh.fileno()).st_mtime
    except OSError:
        return None
    meta = _parse_header(head)
    if meta is None or not isinstance(meta.get("pid"), int):
        return -1 if age < 10 else None
    pid = meta["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return pid


def _create_shared(name: str, total: int, layout: list[list[int]], description: str):
    """Creates ``/dev/shm/<name>`` of header + ``total`` bytes with its pages reserved; returns
    (mmap, inode, a descriptor holding a shared lock on it). The header (with this process's
    id) is written first, so that a file of the same name is known to be live (its creator
    runs: an error) or stale (replaced)."""
    path = _shm_path(name)
    size = SHM_HEADER_BYTES + total
    header = _pack_header({"tensors": layout, "pid": os.getpid(), "bytes": total})
    if len(header) > SHM_HEADER_BYTES:
        raise ValueError(f"too many tensors for one shared pool ({len(layout)})")
    for attempt in range(2):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            break
        except FileExistsError:
            owner = _pool_owner(path)
            if owner is not None or attempt:
                who = "a process creating it now" if owner in (None, -1) else f"process {owner}"
                raise SharedMemoryError(
                    f"the shared pool {path} for {description} is in use by {who}: another "
                    "engine with the same engine id runs on this machine. Give each engine its "
                    "own kv_transfer_config.engine_id (vLLM makes a fresh one when it is unset)"
                ) from None
            os.unlink(path)  # its creator is gone: a stale pool
        except OSError as e:
            raise SharedMemoryError(
                f"cannot create the shared pool {path} for {description}: {e}. kvoff needs a "
                f"writable {SHM_DIR} (POSIX shared memory) when the engine's workers run in "
                "processes of their own"
            ) from e
    try:
        ino = os.fstat(fd).st_ino
        held = _hold(fd, path)
        try:
            try:
                os.pwrite(fd, header, 0)
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.unlink(path)
                raise SharedMemoryError(
                    f"{SHM_DIR} has no room for {description}: {size} bytes "
                    f"({size / 2**30:.2f} GiB) asked for, {_shm_free()} free ({e.strerror}). "
                    "Give the container more shared memory (docker run --ipc=host, or "
                    "--shm-size larger than the pool) or lower the pool size (cpu_bytes_to_use)"
                ) from e
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(held)
            raise
    finally:
        os.close(fd)
    return mm, ino, held


def _attach_shared(
    name: str, total: int, layout: list[list[int]], description: str
) -> tuple[mmap.mmap, int, int]:
    """Maps the existing shared pool ``name``, which must hold exactly ``layout`` (``total``
    bytes after the header); returns the mapping, the file's inode and a descriptor holding a
    shared lock on the file (see the module docstring).

    Raises:
        SharedMemoryError: no such file (or it was removed while being mapped), not a kvoff
            pool of this format, or another layout.
    """
    path = _shm_path(name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as e:
        raise SharedMemoryError(
            f"no shared pool {path} to attach {description} to: start its owner first (for a "
            "node pool: kvoff pool serve)"
        ) from e
    try:
        st = os.fstat(fd)
        if st.st_size < SHM_HEADER_BYTES:
            raise SharedMemoryError(f"{path} is {st.st_size} bytes, too short for a kvoff pool")
        held = _hold(fd, path)
        try:
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(held)
            raise
    finally:
        os.close(fd)
    meta = _parse_header(bytes(mm[:SHM_HEADER_BYTES]))
    if meta is None or meta.get("tensors") != layout or st.st_size < SHM_HEADER_BYTES + total:
        have = None if meta is None else meta.get("tensors")
        mm.close()
        os.close(held)  # (the name is another pool's: never removed here)
        raise SharedMemoryError(
            f"{path} holds tensors {have} ([offset, rows, row bytes]), but {description} needs "
            f"{layout}: the pool was made for another layout or size"
        )
    return mm, st.st_ino, held


def _memlock_limit() -> str:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return "unknown"
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**30:.2f} GiB"


@dataclass(frozen=True)
class _Registrar:
    """The two CUDA runtime calls pinning needs (injectable for tests)."""

    register: Callable[[int, int, int], int]  # (address, bytes, flags) -> cudaError_t
    unregister: Callable[[int], int]  # (address) -> cudaError_t
    error_string: Callable[[int], str]


def _cuda_registrar() -> _Registrar:
    if not torch.cuda.is_available():
        raise PinningError(
            "pin_memory=True needs CUDA, but torch.cuda.is_available() is False (a CPU build of "
            "torch, or no GPU visible); use pin_memory=False"
        )
    cudart = torch.cuda.cudart()

    def error_string(code: int) -> str:
        try:
            return str(cudart.cudaGetErrorString(code))
        except (AttributeError, RuntimeError, TypeError):
            return f"cudaError {int(code)}"

    return _Registrar(
        lambda ptr, size, flags: int(cudart.cudaHostRegister(ptr, size, flags)),
        lambda ptr: int(cudart.cudaHostUnregister(ptr)),
        error_string,
    )


def _unregister_all(registrar: _Registrar, addresses: list[int], _keep: torch.Tensor) -> None:
    # `_keep` holds the memory until it is unregistered (freeing registered memory is an error).
    for address in reversed(addresses):
        registrar.unregister(address)
    addresses.clear()


class HostPool:
    """One host allocation holding several 2-D uint8 tensors back to back, optionally pinned.

    Args:
        shapes: ``(rows, row_bytes)`` of each tensor, in order; each starts on a 4 KiB boundary
            (of the address space, not only of the pool).
        pin: page-lock the memory: one ``cudaHostRegister`` call for the whole allocation (the
            pool, the alignment before it or a shared pool's header page), so that
            ``Tensor.is_pinned()``, which looks at a tensor's storage, is true for every tensor.
        description: what the pool is for, used in error messages (e.g. "4096 CPU blocks of
            2.0 MiB").
        shared_name: put the pool in ``/dev/shm/<shared_name>`` (see the module docstring) so
            that :class:`SharedHostPool` can map it from another process; ``None`` (default):
            private memory from torch's CPU allocator.
        attach: with ``shared_name``, map the existing pool of that name instead of creating
            it (a node pool that ``kvoff pool serve`` owns); it must hold exactly ``shapes``.
            Closing it removes the name only when no other process maps the pool any more
            (module docstring, "Pools that outlive their creator"). Pinning pins this
            process's mapping.
        outlive_creator: with ``shared_name`` and not ``attach``: closing this pool removes
            the name only when no other process maps it, as for an attached one (a node pool's
            regions); by default the creator's close removes it.

    Attributes:
        tensors: the ``(rows, row_bytes)`` uint8 tensors, in ``shapes`` order.
        num_bytes: bytes of the pool: the sum of ``rows × row_bytes`` plus at most 4 KiB of
            alignment per tensor (no power-of-two rounding); private memory allocates one page
            more, to start on a page boundary.
        pinned: whether the memory is page-locked.
        shared_name: the shared-memory name, or ``None``.

    Raises:
        ValueError: for a negative shape, a pool of 2**63 bytes or more, or a ``shared_name``
            that is not a plain file name.
        SharedMemoryError: the shared file cannot be created, its name is held by a running
            process (two engines with one engine id), or ``/dev/shm`` has no room for the pool
            (nothing is left behind then).
        PinningError: when page-locking fails (nothing stays registered then): the message
            gives the bytes asked for, the CUDA error and the
            locked-memory limit, and says to lower the pool size or raise the limit; also when
            ``pin`` is asked for without CUDA.
        RuntimeError: when the host allocation itself fails (torch's out-of-memory error).
        TypeError: ``pin``, ``attach`` or ``outlive_creator`` not a bool (naming it).
    """

    def __init__(
        self,
        shapes: Sequence[tuple[int, int]],
        *,
        pin: bool,
        description: str = "the CPU pool",
        shared_name: str | None = None,
        attach: bool = False,
        outlive_creator: bool = False,
        _registrar: _Registrar | None = None,
    ) -> None:
        for name, flag in (("pin", pin), ("attach", attach), ("outlive_creator", outlive_creator)):
            check_flag(name, flag)
        offsets = []
        total = 0
        for rows, row_bytes in shapes:
            if rows < 0 or row_bytes < 0:
                raise ValueError(f"tensor shapes must be non-negative, got {(rows, row_bytes)}")
            total = -(-total // _ALIGN) * _ALIGN
            offsets.append(total)
            total += rows * row_bytes
        if total >= 2**63:
            raise ValueError(
                f"{description} would take {total} bytes, more than any allocation can hold "
                "(2**63); check the number of blocks and the bytes per block"
            )
        self.num_bytes = total
        registrar = (_registrar or _cuda_registrar()) if pin and total > 0 else None
        self.shared_name = shared_name
        if shared_name is None:
            # torch's CPU allocator aligns to 64 bytes only: one page more, and the pool starts
            # on the first page boundary, so that every tensor (and every slot whose size is a
            # multiple of 4 KiB) is page-aligned as documented; the disk tier then reads and
            # writes the slots with O_DIRECT in place, without a bounce buffer and a copy
            raw = torch.empty(total + _ALIGN, dtype=torch.uint8)
            shift = -raw.data_ptr() % _ALIGN
            self._storage = raw
            self._base = raw[shift : shift + total]
        else:
            layout = [[off, rows, rb] for off, (rows, rb) in zip(offsets, shapes, strict=True)]
            path = _shm_path(shared_name)
            if attach:  # another process made it (a node pool): map it
                mm, self.inode, held = _attach_shared(shared_name, total, layout, description)
            else:
                mm, self.inode, held = _create_shared(shared_name, total, layout, description)
            if attach or outlive_creator:  # removed by the last process to let it go
                self._unlinker = weakref.finalize(
                    self, _unlink_if_last, held, path, self.inode, os.getpid()
                )
            else:
                os.close(held)  # the creator's pool: its close removes the name
                self._unlinker = weakref.finalize(
                    self, _unlink_if_same, path, self.inode, os.getpid()
                )
            whole = torch.frombuffer(mm, dtype=torch.uint8)
            self._storage = whole
            self._base = whole[SHM_HEADER_BYTES:]
        self.tensors = [
            self._base[off : off + rows * row_bytes].view(rows, row_bytes)
            for off, (rows, row_bytes) in zip(offsets, shapes, strict=True)
        ]
        self._addresses: list[int] = []
        self.pinned = False
        if registrar is not None:
            self._register(registrar, description)
            self.pinned = True
            self._finalizer = weakref.finalize(
                self, _unregister_all, registrar, self._addresses, self._storage
            )

    def _register(self, registrar: _Registrar, description: str) -> None:
        # the whole allocation, from its first byte: torch's Tensor.is_pinned() (which
        # kvoff.copy_blocks and torch's own non_blocking copies consult) asks CUDA about the
        # tensor's *storage* pointer, not its data pointer. Registering only the aligned pool
        # inside it (the page of alignment before it, or a shared pool's header page, left out)
        # made every tensor of a pinned pool read as unpinned, and every GPU copy was refused
        # (seen on an H200, 2026-11-26)
        base = self._storage.data_ptr()
        size = self._storage.numel()
        flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
        err = registrar.register(base, size, flags)
        if err != 0:
            gib = size / 2**30
            raise PinningError(
                f"pinning {description} failed: {size} bytes ({gib:.2f} GiB) asked "
                f"for were refused: {registrar.error_string(err)}. Lower the pool size "
                f"(num_cpu_blocks, or cpu_bytes_to_use in the config) or raise the locked-memory "
                f"limit (ulimit -l; now {_memlock_limit()}); pin_memory=False avoids pinning at "
                f"the cost of slower, synchronous copies."
            )
        self._addresses.append(base)

    def close(self) -> None:
        """Unregister the memory now (it is freed when the last tensor view goes away) and
        remove a shared pool's name (an attached or ``outlive_creator`` pool's only when no
        other process maps it). Idempotent; the pool's tensors must not be used for GPU copies
        afterwards."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        unlinker = getattr(self, "_unlinker", None)
        if unlinker is not None:
            unlinker()
        self.pinned = False


class SharedHostPool:
    """The tensors of a shared :class:`HostPool` of another process, mapped into this one.

    The bytes are the same memory as the creator's: writes on either side are seen by the
    other. Ordering between the two processes is the caller's (kvoff orders every access through
    job completions, which cross processes through the engine's messages).

    Args:
        name: the pool's ``shared_name``.
        unlink: remove the name once mapped (default True): both processes keep their mappings,
            and no file is left behind when either dies.

    Attributes:
        tensors: the ``(rows, row_bytes)`` uint8 tensors, in the creator's order.
        creator_pid: the process id that created the pool.

    Raises:
        ValueError: ``name`` is not a plain file name.
        SharedMemoryError: no such pool in ``/dev/shm`` (its creator runs on another machine,
            has not created it yet, or is gone), or the file is not a kvoff pool of this format.
    """

    def __init__(self, name: str, *, unlink: bool = True) -> None:
        path = _shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as e:
            raise SharedMemoryError(
                f"no shared pool {path}: the process that owns it (the engine's worker) has not "
                "allocated it, has exited, or runs on another machine"
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size < SHM_HEADER_BYTES:
                raise SharedMemoryError(f"{path} is {size} bytes, too short for a kvoff pool")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        meta = _parse_header(bytes(mm[:SHM_HEADER_BYTES]))
        if meta is None:
            raise SharedMemoryError(f"{path} is not a kvoff shared pool of format {_SHM_VERSION}")
        if SHM_HEADER_BYTES + int(meta["bytes"]) > size:
            raise SharedMemoryError(f"{path} is shorter than its header says")
        base = torch.frombuffer(mm, dtype=torch.uint8)[SHM_HEADER_BYTES:]
        self.tensors = [
            base[off : off + rows * rb].view(rows, rb) for off, rows, rb in meta["tensors"]
        ]
        self.creator_pid = int(meta["pid"])
        self.name = name
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
