"""Shared pytest setup: the CUDA marker skips itself without a CUDA build and a GPU; local Redis
Clusters (3 masters, no replicas, free ports) for the tier tests and the engine tests:
``redis_cluster`` is one cluster for the whole session, flushed before each test that asks for
``redis_url``; ``private_redis_cluster`` is a cluster of its own for a test that kills a node.
Both skip (with the reason) only when redis-server / redis-cli are not installed.
``run_tmp_path`` is a folder every xdist worker of one test run shares, for work done once per
run (a wheel, engine runs)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:  # imported in the fixtures: kvoff.tiers needs xxhash, which not every
    # environment running tests (the CUDA wheel test's venv) has
    from kvoff.tiers.redis_cluster import LocalRedisCluster


def cuda_skip_reason() -> str | None:
    """Why CUDA tests cannot run here, or None when they can."""
    import kvoff._build_info as info

    if not info.WITH_CUDA:
        return "kvoff was built without CUDA kernels (CPU torch or KVOFF_ENABLE_CUDA=OFF)"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def pytest_report_header(config: pytest.Config) -> str:
    """Which kvoff the tests import: the editable build, or an installed wheel (wheel-smoke)."""
    import kvoff

    return f"kvoff {kvoff.__version__} from {kvoff.__file__.rsplit('/', 1)[0]}"


#: Folders whose every test gets a marker, so the inner loop can leave them out by marker
#: (``-m "not build and not vllm ..."``) without naming paths.
_FOLDER_MARKERS = {"build": "build", "integrations": "vllm"}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        try:
            folder = Path(str(item.path)).resolve().relative_to(tests_dir).parts[0]
        except ValueError:
            continue
        marker = _FOLDER_MARKERS.get(folder)
        if marker is not None and item.get_closest_marker(marker) is None:
            item.add_marker(getattr(pytest.mark, marker))
    reason = cuda_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def run_tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder shared by every xdist worker of this test run (the parent of each worker's base
    temp folder holds it), or in this session's base temp folder without xdist. Work done in
    it once per run takes a file lock (filelock) so that one worker does it."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "shared"
    path.mkdir(exist_ok=True)
    return path


# ------------------------------------------------------------------------- Redis Clusters


def _start() -> LocalRedisCluster:
    from kvoff.tiers.redis_cluster import LocalRedisCluster, redis_server_skip_reason

    reason = redis_server_skip_reason()
    if reason:
        pytest.skip(reason)
    return LocalRedisCluster(masters=3, maxmemory="256mb").start()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalRedisCluster]:
    """A 3-master cluster shared by the session (do not kill its nodes)."""
    cluster = _start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_url(redis_cluster: LocalRedisCluster) -> str:
    """The shared cluster's URL, every master flushed first."""
    for i in range(redis_cluster.masters):
        redis_cluster.client(i).flushall()
    return redis_cluster.url


@pytest.fixture
def private_redis_cluster() -> Iterator[LocalRedisCluster]:
    """A fresh 3-master cluster for one test (which may kill its nodes)."""
    cluster = _start()
    yield cluster
    cluster.stop()
