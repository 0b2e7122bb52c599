"""The replay over L1 + a shared Redis Cluster tier (issue 14): the hit rate of a huge L1 with a
small one, blocks shared between engine processes byte-exact, a master killed mid-replay."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoff.tiers.redis_cluster import LocalRedisCluster, redis_server_skip_reason
from kvoff.tools.replay import ReplayConfig, run_replay

LIMIT = 1000


@pytest.fixture(scope="module")
def big_cluster() -> Iterator[LocalRedisCluster]:
    """A 3-master cluster with room for every block of the replays (no Redis eviction)."""
    reason = redis_server_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = LocalRedisCluster(masters=3, maxmemory="2gb").start()
    yield cluster
    cluster.stop()


def _flush(cluster: LocalRedisCluster) -> str:
    for i in range(cluster.masters):
        cluster.client(i).flushall()
    return cluster.url


@pytest.mark.slow
def test_small_l1_plus_redis_matches_a_huge_l1(big_cluster: LocalRedisCluster) -> None:
    url = _flush(big_cluster)
    big = run_replay(ReplayConfig(limit=LIMIT, cpu_blocks=200_000))
    # a generous timeout: on a loaded 2-core CI machine a slow reply must not turn into a miss
    tiered = run_replay(
        ReplayConfig(limit=LIMIT, cpu_blocks=2000, remote_url=url, remote_timeout_s=5.0)
    )
    assert tiered.hit_rate >= big.hit_rate - 0.001
    assert tiered.tier_hit_tokens["remote"] > 0
    assert tiered.corrupted_blocks == 0 and tiered.tier_corrupted_blocks == 0
    remote = tiered.tiers["tiers"]["remote"]
    assert remote["promoted_blocks"] > 0 and remote["written_blocks"] > 0


@pytest.mark.slow
def test_engines_share_the_remote_tier(big_cluster: LocalRedisCluster) -> None:
    """Two engines, requests round-robin: with a shared tier each finds what the other
    computed; without it each sees only its own half of the reuse."""
    alone = run_replay(ReplayConfig(limit=LIMIT, cpu_blocks=200_000, engines=2))
    url = _flush(big_cluster)
    shared = run_replay(
        ReplayConfig(
            limit=LIMIT, cpu_blocks=200_000, engines=2, remote_url=url, remote_timeout_s=5.0
        )
    )
    assert shared.hit_rate > alone.hit_rate + 0.01
    assert shared.tier_hit_tokens["remote"] > 0
    assert shared.corrupted_blocks == 0 and shared.tier_corrupted_blocks == 0


@pytest.mark.slow
def test_a_second_process_loads_the_first_ones_blocks(
    big_cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    """Two OS processes (each its own scheduler, worker and CPU pool): the second replay of the
    same requests gets remote hits for what the first stored, loaded to its GPU blocks and
    verified byte for byte (corrupted 0)."""
    url = _flush(big_cluster)
    results = []
    for run in ("first", "second"):
        out = tmp_path / f"{run}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "kvoff", "replay", "--limit", "300", "--cpu-blocks", "2000",
             "--remote-url", url, "--remote-namespace", "two-processes", "--remote-timeout", "5",
             "--no-progress",
             "--json", str(out)],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        results.append(json.loads(out.read_text())["result"])
    first, second = results
    assert first["tier_hit_tokens"].get("remote", 0) < second["tier_hit_tokens"]["remote"]
    assert second["hit_rate"] > first["hit_rate"]
    assert second["corrupted_blocks"] == 0 and second["tier_corrupted_blocks"] == 0
    assert second["blocks_verified"] > first["blocks_verified"]


@pytest.mark.slow
def test_a_master_killed_mid_replay_gives_misses_not_errors() -> None:
    reason = redis_server_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = LocalRedisCluster(masters=3, maxmemory="1gb").start()
    try:
        killed = []

        def progress(done: int) -> None:
            if done == 300 and not killed:
                cluster.kill(0)
                killed.append(done)

        cfg = ReplayConfig(limit=600, cpu_blocks=2000, remote_url=cluster.url,
                           remote_timeout_s=0.2)  # fmt: skip
        res = run_replay(cfg, progress=progress)
    finally:
        cluster.stop()
    assert killed
    assert res.requests == 600
    assert (
        res.corrupted_blocks == 0 and res.tier_corrupted_blocks == 0 and res.failed_transfers == 0
    )
    remote = res.tiers["tiers"]["remote"]
    assert remote["io_errors"] + remote["timeouts"] + remote["writes_dropped"] > 0
