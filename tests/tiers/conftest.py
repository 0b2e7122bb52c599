"""Fixtures of the tier tests: local Redis Clusters (3 masters, no replicas) on free ports.

``redis_cluster`` is one cluster for the whole session, flushed before each test that asks for
``redis_url``; ``private_redis_cluster`` is a cluster of its own for a test that kills a node.
Both skip (with the reason) only when redis-server / redis-cli are not installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvoff.tiers.redis_cluster import LocalRedisCluster, redis_server_skip_reason


def _start() -> LocalRedisCluster:
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
