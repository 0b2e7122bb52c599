"""A node pool served in a thread of the test process, on a socket in the test's tmp folder and
a region of its own in /dev/shm (removed at the end)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from node_pool_harness import Served


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    region = f"kvoff-test-np-{os.getpid()}-{tmp_path.name}"[:200]
    s = Served(tmp_path / "pool.sock", region)
    yield s
    s.stop()
    path = Path("/dev/shm") / region
    if path.exists():
        path.unlink()
