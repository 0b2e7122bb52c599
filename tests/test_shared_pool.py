"""Shared CPU pools (kvoff.pinned.HostPool(shared_name=...) and SharedHostPool): the memory a
worker process allocates and the engine-core process maps, for the secondary tiers."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from kvoff.pinned import SHM_DIR, HostPool, SharedHostPool, SharedMemoryError
from kvoff.worker import OffloadingWorker

pytestmark = pytest.mark.skipif(
    not os.path.isdir(SHM_DIR), reason=f"no {SHM_DIR} (POSIX shared memory) on this system"
)


def fresh_name() -> str:
    return f"kvoff-test-{uuid.uuid4().hex[:12]}"


def test_another_process_maps_the_same_bytes_and_the_name_goes_away() -> None:
    name = fresh_name()
    pool = HostPool([(4, 8192), (3, 100)], pin=False, shared_name=name)
    pool.tensors[0][2].fill_(7)
    code = textwrap.dedent(f"""
        from kvoff.pinned import SharedHostPool
        p = SharedHostPool({name!r})
        a, b = p.tensors
        assert a.shape == (4, 8192) and b.shape == (3, 100), (a.shape, b.shape)
        assert int(a[2].sum()) == 7 * 8192 and int(a[1].sum()) == 0
        b[1].fill_(9)
        print(p.creator_pid)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout) == os.getpid()
    assert int(pool.tensors[1][1].sum()) == 9 * 100  # the other process's write, seen here
    assert not os.path.exists(os.path.join(SHM_DIR, name))  # unlinked once mapped
    pool.close()  # nothing left to remove: fine


def test_close_removes_the_name_and_a_stale_file_is_replaced() -> None:
    name = fresh_name()
    path = os.path.join(SHM_DIR, name)
    # a dead process's pool of the same name: its creator (a finished process) is gone
    done = subprocess.run(
        [sys.executable, "-c", "from kvoff.pinned import HostPool; import os; "
         f"p = HostPool([(1, 4096)], pin=False, shared_name={name!r}); os._exit(0)"],
        check=True,
    )  # fmt: skip
    assert done.returncode == 0 and os.path.exists(path)  # os._exit: no clean-up ran
    pool = HostPool([(2, 4096)], pin=False, shared_name=name)
    assert os.path.getsize(path) == 4096 + 2 * 4096
    attached = SharedHostPool(name, unlink=False)
    assert attached.tensors[0].shape == (2, 4096)
    pool.close()
    assert not os.path.exists(path)


def test_a_name_held_by_a_running_process_is_refused_and_left_alone() -> None:
    """Two engines given one engine id: the second worker must not take the first's pool."""
    name = fresh_name()
    path = os.path.join(SHM_DIR, name)
    first = HostPool([(2, 4096)], pin=False, shared_name=name)
    first.tensors[0].fill_(5)
    with pytest.raises(SharedMemoryError, match=rf"in use by process {os.getpid()}.*engine_id"):
        HostPool([(2, 4096)], pin=False, shared_name=name)
    assert int(SharedHostPool(name).tensors[0].sum()) == 5 * 2 * 4096  # untouched, still there
    assert not os.path.exists(path)
    # an old file without a kvoff header is stale; a new one may be a pool being created
    with open(path, "wb") as fh:
        fh.write(b"x")
    with pytest.raises(SharedMemoryError, match="in use by a process creating it now"):
        HostPool([(1, 4096)], pin=False, shared_name=name)
    os.utime(path, (0, 0))
    HostPool([(1, 4096)], pin=False, shared_name=name).close()
    assert not os.path.exists(path)
    first.close()


def test_no_room_in_dev_shm_is_a_clear_error_and_leaves_nothing(monkeypatch) -> None:
    name = fresh_name()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(SharedMemoryError, match=r"has no room for the CPU pool.*--shm-size"):
        HostPool([(1024, 4096)], pin=False, shared_name=name)
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_bad_names_and_missing_or_foreign_pools() -> None:
    for bad in ("", "../etc/passwd", "a/b", "-x", "a" * 300):
        with pytest.raises(ValueError, match="not a file name"):
            HostPool([(1, 4096)], pin=False, shared_name=bad)
    with pytest.raises(SharedMemoryError, match=r"no shared pool .* has not allocated it"):
        SharedHostPool(fresh_name())
    name = fresh_name()
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as fh:
        fh.write(b"x" * 8192)
    try:
        with pytest.raises(SharedMemoryError, match="not a kvoff shared pool"):
            SharedHostPool(name)
    finally:
        os.unlink(path)


def test_a_worker_with_a_shared_name_puts_its_cpu_pool_there() -> None:
    name = fresh_name()
    worker = OffloadingWorker(8, 4, shared_memory_name=name, pin_memory=False)
    worker.register_kv_caches({"layer.0": torch.zeros(8, 2, 16, dtype=torch.float16)})
    worker.cpu_pool[1].fill_(3)
    (seen,) = SharedHostPool(name).tensors
    assert seen.shape == worker.cpu_pool.shape
    assert torch.equal(seen, worker.cpu_pool)
    worker.close()
    assert int(seen[1].sum()) == 3 * seen.shape[1]  # the mapping outlives the worker's close


def test_a_pool_that_outlives_its_creator_goes_with_the_last_process_that_maps_it() -> None:
    """A node pool's region (docs/design.md invariant 11): every mapping holds a shared lock on
    the file. Closing removes the name only when no other process maps it, however the others
    died (the kernel drops the lock of a killed process); a creator's own pool (the default)
    goes at its close."""
    name = fresh_name()
    path = os.path.join(SHM_DIR, name)
    shape = [(2, 4096)]
    creator = HostPool(shape, pin=False, shared_name=name, outlive_creator=True)
    creator.tensors[0][1].fill_(3)
    engine = HostPool(shape, pin=False, shared_name=name, attach=True)
    creator.close()  # the engine still maps it: kept, for the next owner to adopt
    assert os.path.exists(path)
    adopter = HostPool(shape, pin=False, shared_name=name, attach=True)
    assert int(adopter.tensors[0][1].sum()) == 3 * 4096  # the same memory
    engine.close()
    assert os.path.exists(path)  # the adopter maps it
    # a process that maps it and is killed holds nothing after death
    code = textwrap.dedent(f"""
        import os, signal, sys
        from kvoff.pinned import HostPool
        p = HostPool({shape!r}, pin=False, shared_name={name!r}, attach=True)
        sys.stdout.write("mapped\\n"); sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)  # fmt: skip
    assert killed.stdout == "mapped\n" and killed.returncode == -9, killed.stderr[-2000:]
    adopter.close()  # the last one: the name goes
    assert not os.path.exists(path)
    # the creator's own pool (default): its close removes the name even while others map it
    own = HostPool(shape, pin=False, shared_name=name)
    other = HostPool(shape, pin=False, shared_name=name, attach=True)
    own.close()
    assert not os.path.exists(path)
    other.close()  # nothing left to remove, and a newer file of the name is not touched
    assert not os.path.exists(path)


def test_a_pool_removed_while_it_is_being_attached_is_not_adopted(monkeypatch) -> None:
    """An attach that races the last holder's removal must not hold a file that no longer has
    the name (a node pool would then serve memory no engine can find)."""
    name = fresh_name()
    path = os.path.join(SHM_DIR, name)
    creator = HostPool([(1, 4096)], pin=False, shared_name=name, outlive_creator=True)
    real_flock = fcntl.flock

    def remove_first(fd: int, op: int) -> None:
        if op == fcntl.LOCK_SH and os.path.exists(path):
            os.unlink(path)  # what the last holder's close does in between
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", remove_first)
    with pytest.raises(SharedMemoryError, match="was removed while it was mapped"):
        HostPool([(1, 4096)], pin=False, shared_name=name, attach=True)
    monkeypatch.undo()
    creator.close()
    assert not os.path.exists(path)


def test_a_forked_child_that_exits_leaves_its_parents_hold_and_name() -> None:
    """A child forked from a process that maps a pool shares that process's lock; its exit
    (which runs the pool's finalizer) must not drop the parent's hold or remove the name
    (invariant 11)."""
    name = fresh_name()
    path = os.path.join(SHM_DIR, name)
    for kw in ({"outlive_creator": True}, {}):
        engine = HostPool([(1, 4096)], pin=False, shared_name=name, **kw)
        pid = os.fork()
        if pid == 0:  # the child: its clean-up at exit, then out without pytest's
            try:
                engine.close()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert os.path.exists(path), kw  # the child removed nothing
        if kw:  # and the parent still holds it: another process's close keeps it
            other = HostPool([(1, 4096)], pin=False, shared_name=name, attach=True)
            other.close()
            assert os.path.exists(path)
        engine.close()
        assert not os.path.exists(path)
