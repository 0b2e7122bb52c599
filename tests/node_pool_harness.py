"""A node pool served in a thread of the test process (tests/node_pool)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

from kvoff.node_pool import NodePoolClient, NodePoolServer

SIM_SLOTS = 16
"""Slots of the pools that simulated engines share (:func:`sim_engine`)."""


class Served:
    """A :class:`NodePoolServer` running in a thread; ``stop()`` ends it (idempotent)."""

    def __init__(
        self, path: Path, region: str, num_slots: int = 16, slot_bytes: int = 4096, **kwargs
    ):
        self.socket = str(path)
        self.region = region
        self.server = NodePoolServer(self.socket, num_slots, slot_bytes, region=region, **kwargs)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_s": 0.02}, daemon=True
        )
        self.thread.start()

    def call(self, fn):
        """Runs ``fn(server)`` between two rounds of the serving thread (the tests' view of
        the index must not race the thread that changes it)."""
        done = threading.Event()
        out = {}

        def run() -> None:
            out["v"] = fn(self.server)
            done.set()

        self.server.call_soon(run)
        assert done.wait(10), "the pool did not run the call"
        return out["v"]

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.stop()
            self.thread.join(10)


def send_raw(path: str, data: bytes) -> bytes:
    """Sends ``data`` on a new connection to the pool at ``path``, closes the writing side and
    returns all the pool answered before it closed the connection."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    out = b""
    while chunk := s.recv(1 << 16):
        out += chunk
    s.close()
    return out


def sim_engine(pool: Served, name: str, **kwargs):
    """A simulated engine (tests/scheduler_harness.py, 4-token blocks) whose CPU pool is the
    node pool ``pool`` (served with :data:`SIM_SLOTS` slots of its block size); ``kwargs`` go
    to ``EngineSim``. Look-ups are asked each time (no kept answers); stores go into reserved
    slots where they can, as an engine's do."""
    from scheduler_harness import EngineSim

    client = NodePoolClient(pool.socket, b"sim-layout", name=name, lookahead_s=0.0,
                            reserve=True)  # fmt: skip
    return EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=SIM_SLOTS,
                     node_pool=client, **kwargs)  # fmt: skip


def start_pool_process(
    socket_path: str, region: str, slots: int, slot_bytes: int = 4096
) -> subprocess.Popen[bytes]:
    """``kvoff pool serve`` in a child process, once it answers: a pool the tests can SIGKILL
    and start again on the same region (it then adopts the region). A killed pool leaves its
    socket file, so this waits for one that answers."""
    from kvoff.node_pool import wait_for_pool

    cmd = [sys.executable, "-m", "kvoff", "pool", "serve", "--socket", socket_path,
           "--slots", str(slots), "--slot-bytes", str(slot_bytes), "--region", region]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    wait_for_pool(socket_path, proc)
    return proc


def age_leases(client: NodePoolClient, share: float) -> None:
    """Makes every lease ``client`` holds ``share * lease_s`` seconds old (as if its engine
    had stalled that long since the look-up)."""
    client._leases.age_all(share * client.lease_s)
