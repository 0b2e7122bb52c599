"""kvoff.tiers.engine_tiers without an engine: the in-process registry where a worker's CPU pool
and the scheduler that drives its tiers meet by engine id, the data-parallel disk folder, and
one tier per rank on the ranks' pools (engine-level cases are in tests/integrations)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvoff.config import OffloadingConfig
from kvoff.tiers.engine_tiers import (
    close_tiers,
    data_parallel_config,
    register_tiered,
    register_worker,
    registered_worker,
    tiers_on_pools,
    unregister_worker,
)


class _Closing:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_the_registry_meets_by_engine_id_and_forgets_only_its_own_worker() -> None:
    first, second = object(), object()
    assert registered_worker("engine-t1") is None
    register_worker("engine-t1", first)
    assert registered_worker("engine-t1") is first and registered_worker("other") is None
    register_worker("engine-t1", second)  # a newer worker of the same engine id wins
    unregister_worker("engine-t1", first)  # the older one's shutdown leaves the newer one
    assert registered_worker("engine-t1") is second
    unregister_worker("engine-t1", second)
    assert registered_worker("engine-t1") is None
    unregister_worker("engine-t1", second)  # idempotent


def test_close_tiers_closes_what_drives_them_once() -> None:
    owner = _Closing()
    register_tiered("engine-t2", owner)
    close_tiers("engine-t2")
    close_tiers("engine-t2")  # a second shutdown: nothing registered any more
    close_tiers("never-registered")
    assert owner.closed == 1


def test_a_data_parallel_rank_gets_a_disk_folder_of_its_own() -> None:
    disk = OffloadingConfig(num_cpu_blocks=8, disk_path="/data/kv", disk_bytes="1GiB")
    remote = OffloadingConfig(num_cpu_blocks=8, remote_url="redis://127.0.0.1:7000")
    assert str(data_parallel_config(disk, 2, 1).disk_path) == "/data/kv/dp1"
    assert data_parallel_config(disk, 1, 0) is disk  # no data parallelism: unchanged
    assert data_parallel_config(remote, 4, 3) is remote  # no disk tier: unchanged


def test_one_tier_per_rank_splits_the_disk_and_reads_every_rank_s_slot(tmp_path: Path) -> None:
    views = [np.full((4, 512), r, dtype=np.uint8) for r in range(2)]
    config = OffloadingConfig(num_cpu_blocks=4, disk_path=tmp_path, disk_bytes="8MiB")
    tiers, slot = tiers_on_pools(config, views, lambda r: bytes([r + 1]) * 16)
    try:
        assert [t.name for t in tiers] == ["disk"]
        parts = slot(3)
        assert len(parts) == 2 and [int(p[0]) for p in parts] == [0, 1]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    finally:
        for t in tiers:
            t.close()
    one, one_slot = tiers_on_pools(config, views[:1], lambda r: b"f" * 16)
    try:
        assert one_slot(2) is not None and int(one_slot(2)[0]) == 0  # one rank: its own slot
    finally:
        for t in one:
            t.close()
