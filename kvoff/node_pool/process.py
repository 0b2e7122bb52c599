"""A node pool in a child process, for tools and tests that need one for a while: the same
``kvoff pool serve`` an operator runs, started, waited for and stopped."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from kvoff.node_pool.client import NodePoolError, wait_for_pool

__all__ = ["pool_process"]


@contextlib.contextmanager
def pool_process(
    socket_path: str,
    slots: int,
    slot_bytes: int,
    *,
    region: str,
    policy: str | None = None,
    ranks: int = 1,
    timeout_s: float = 60.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Runs ``kvoff pool serve`` in a child process while the ``with`` block runs; yields its
    ``Popen`` once the pool answers. The pool is stopped with SIGTERM at the end (its socket
    and ``/dev/shm/<region>`` are removed by its clean shutdown); a pool that does not stop
    within 30 s is killed.

    Args:
        socket_path: the pool's Unix socket.
        slots: CPU blocks in the pool.
        slot_bytes: bytes per CPU block (the engines' bytes per offloaded block).
        region: the shared-memory name of the slots (``/dev/shm/<region>``).
        policy: the eviction policy; None: the pool's default (lru).
        ranks: the engines' tensor-parallel size (a region per rank).
        timeout_s: seconds to wait for the pool to answer.

    Raises:
        RuntimeError: the pool exited or did not answer within ``timeout_s`` (its stderr is
            quoted: a bad size, a full ``/dev/shm``, a socket in use).
    """
    cmd = [
        sys.executable, "-m", "kvoff", "pool", "serve", "--socket", socket_path,
        "--slots", str(slots), "--slot-bytes", str(slot_bytes), "--region", region,
        "--ranks", str(ranks), *(["--policy", policy] if policy else []),
    ]  # fmt: skip
    # stderr to a file, not a pipe: a pool that logs for hours must never block on it
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            try:
                wait_for_pool(socket_path, proc, timeout_s)
            except NodePoolError as e:
                proc.kill()
                proc.wait()
                log.seek(0)
                err = log.read()[-4000:].decode(errors="replace").strip()
                raise RuntimeError(f"the node pool did not start: {e}; {err}") from None
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
