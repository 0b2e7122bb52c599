"""A node pool served in a thread of the test process, on a socket in the test's tmp folder and
a region of its own in /dev/shm (removed at the end)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from node_pool_harness import SIM_SLOTS, Served


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    region = f"kvoff-test-np-{os.getpid()}-{tmp_path.name}"[:200]
    s = Served(tmp_path / "pool.sock", region, reserve_blocks=4)
    yield s
    s.stop()
    path = Path("/dev/shm") / region
    if path.exists():
        path.unlink()


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Served]:
    """A pool of :data:`SIM_SLOTS` slots of the simulated engines' block size
    (``node_pool_harness.sim_engine``)."""
    from scheduler_harness import EngineSim

    probe = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=SIM_SLOTS)
    region = f"kvoff-test-sched-{os.getpid()}-{tmp_path.name}"[:200]
    s = Served(tmp_path / "pool.sock", region, SIM_SLOTS, probe.worker.slot_bytes,
               reserve_blocks=4)  # fmt: skip
    yield s
    s.stop()
    path = Path("/dev/shm") / region
    if path.exists():
        path.unlink()
