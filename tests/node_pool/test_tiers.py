"""A disk tier below the node pool (a real file system): every stored block is written
through, a look-up that misses the slots promotes the key's chain from the disk, and a pool
started again on the same disk serves the blocks its predecessor stored."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from node_pool_harness import Served

from kvoff.node_pool import NodePoolClient
from kvoff.node_pool.pool_tiers import pool_tiers
from kvoff.node_pool.server import tier_format
from kvoff.pinned import HostPool
from kvoff.tiers.coordinator import make_tiers

FP = b"model=tiny;layout=layer_major;rank=0"
SLOT = 4096


def _keys(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


def _pool(tmp_path: Path, name: str) -> Served:
    tiers = make_tiers(tier_format(SLOT), disk_path=tmp_path / "disk", disk_bytes=1 << 20)
    return Served(tmp_path / f"{name}.sock", f"kvoff-test-np-tier-{os.getpid()}-{name}",
                  tiers=tiers, write_queue_blocks=16)  # fmt: skip


def _slots(served: Served) -> HostPool:
    return HostPool([(16, SLOT)], pin=False, shared_name=served.region, attach=True)


def _until(fn, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while (out := fn()) is None or out is False:
        assert time.monotonic() < deadline, what
        time.sleep(0.01)
    return out


def test_blocks_on_the_disk_below_a_node_pool_outlive_the_pool(tmp_path: Path) -> None:
    chain = _keys(1, 2, 3, 4)
    data = np.random.default_rng(0).integers(0, 256, (4, SLOT), dtype=np.uint8)
    first = _pool(tmp_path, "first")
    try:
        a = NodePoolClient(first.socket, FP, name="a")
        out = a.prepare_store(chain)
        slots = _slots(first)
        for i, slot in enumerate(out.block_ids):  # the engine's copies into the slots
            slots.tensors[0][slot].numpy()[:] = data[i]
        a.complete_store(chain)
        a.sync()
        first.call(lambda s: s.tiered.wait())  # written through to the disk
        stats = first.call(lambda s: s.status()["tiers"])
        assert stats["tiers"]["disk"]["written_blocks"] == 4
        slots.close()
        a.close()
    finally:
        first.stop()  # a clean stop: the region is gone, the disk stays
    second = _pool(tmp_path, "second")
    try:
        b = NodePoolClient(second.socket, FP, name="b")
        b.enable_events()
        # not in the slots: the disk is asked, retry later (vLLM asks on past a pending key;
        # this pool has not seen the chain stored, so each key is asked for on its own)
        assert [b.lookup([k]) for k in chain] == [None] * 4
        _until(lambda: [b.lookup([k]) for k in chain] == [1] * 4, "not promoted from the disk")
        evs = b.take_events()  # promotions are stores the pool made, by no engine
        assert sorted(k for e in evs for k in e.keys) == chain
        assert {(e.kind, e.by) for e in evs} == {("BlockStored", "")}
        got = b.prepare_load(chain)
        slots = _slots(second)
        assert all(np.array_equal(slots.tensors[0][s].numpy(), data[i])
                   for i, s in enumerate(got))  # fmt: skip
        b.complete_load(chain)
        slots.close()
        # a key no tier has is a miss once the tiers have answered
        assert b.lookup(_keys(9)) is None
        _until(lambda: b.lookup(_keys(9)) == 0, "the tiers never answered the miss")
        tiers = second.call(lambda s: s.status()["tiers"])
        assert tiers["tiers"]["disk"]["promoted_blocks"] == 4
        # a chain this pool saw stored comes up whole from one look-up: evict it from the
        # slots (16 of them) with other blocks, then ask for its head only
        b.close()  # its leases go with it
        c = NodePoolClient(second.socket, FP, name="c")
        for first_id in range(20, 52, 8):
            fill = _keys(*range(first_id, first_id + 8))
            out = c.prepare_store(fill)
            assert out is not None
            c.complete_store(out.keys_to_store)
            c.sync()
            second.call(lambda s: s.tiered.wait())  # written through: evictable again
        d = NodePoolClient(second.socket, FP, name="d")
        assert d.lookup(_keys(20)) is None  # evicted: the disk is asked for 20..35's chain
        _until(lambda: d.lookup(_keys(20)) == 1, "not promoted")
        n = d.round_trips
        assert [d.lookup([k]) for k in _keys(*range(20, 28))] == [1] * 8
        assert d.round_trips == n  # the promoted chain answered ahead
    finally:
        second.stop()


def test_a_pool_started_again_on_the_disk_promotes_whole_chains_from_the_saved_map(
    tmp_path: Path, caplog
) -> None:
    """The successor map is saved next to the disk tier at a clean stop and read back at the
    start: the next pool promotes a chain from its first key, and answers the rest ahead,
    where without the map it promotes a key at a time. A corrupt map is ignored."""
    chain = _keys(1, 2, 3, 4)
    saved = tmp_path / "disk" / "successors.kvoff"

    def pool(name: str) -> Served:
        tiers = make_tiers(tier_format(SLOT), disk_path=tmp_path / "disk", disk_bytes=1 << 20)
        return Served(tmp_path / f"{name}.sock", f"kvoff-test-np-succ-{os.getpid()}-{name}",
                      tiers=tiers, write_queue_blocks=16, successors_path=saved)  # fmt: skip

    first = pool("first")
    try:
        a = NodePoolClient(first.socket, FP, name="a")
        out = a.prepare_store(chain)
        a.complete_store(out.keys_to_store)
        a.sync()
        first.call(lambda s: s.tiered.wait())
        a.close()
    finally:
        first.stop()
    assert saved.exists()
    second = pool("second")
    try:
        assert second.call(lambda s: len(s.successors)) == 3  # 1->2->3->4
        b = NodePoolClient(second.socket, FP, name="b")
        assert b.lookup(chain[:1]) is None  # the tiers are asked for the whole run
        _until(lambda: b.lookup(chain[:1]) == 1, "not promoted")
        n = b.round_trips
        assert [b.lookup([k]) for k in chain[1:]] == [1] * 3  # promoted with the head
        assert b.round_trips == n  # and answered ahead
        b.close()
    finally:
        second.stop()
    saved.write_bytes(b"KVOFFSUC" + b"\x00" * 40)  # torn or corrupt: a hint, ignored
    with caplog.at_level("WARNING", logger="kvoff.node_pool.successors"):
        third = pool("third")
    try:
        assert third.call(lambda s: len(s.successors)) == 0
        assert "successor map" in caplog.text and "is ignored" in caplog.text
    finally:
        third.stop()


def test_a_pool_of_two_ranks_keeps_each_ranks_parts_in_its_own_tier(tmp_path: Path) -> None:
    """A tensor-parallel engine's pool (``--ranks 2``): each rank's part of a block is written
    through to its own disk folder, a pool started again promotes both parts into both regions,
    and a block one rank's tier lost is a miss (never half a block)."""
    with pytest.raises(ValueError, match=r"disk_bytes=8192 is split over 2 ranks"):
        pool_tiers(SLOT, 2, disk_path=tmp_path / "small", disk_bytes=8192)
    assert not (tmp_path / "small").exists()  # refused before any tier was made
    chain = _keys(1, 2, 3)
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, (2, 3, SLOT), dtype=np.uint8)  # rank, block, bytes

    def pool(name: str) -> Served:
        tiers = pool_tiers(SLOT, 2, disk_path=tmp_path / "disk", disk_bytes=1 << 20)
        return Served(tmp_path / f"{name}.sock", f"kvoff-test-np-tier2-{os.getpid()}-{name}",
                      tiers=tiers, write_queue_blocks=16, ranks=2)  # fmt: skip

    def regions(served: Served) -> list[HostPool]:
        return [HostPool([(16, SLOT)], pin=False, shared_name=f"{served.region}-rank{r}",
                         attach=True) for r in range(2)]  # fmt: skip

    first = pool("first")
    try:
        a = NodePoolClient(first.socket, FP, name="a")
        out = a.prepare_store(chain)
        maps = regions(first)
        for r in range(2):  # each rank's worker copies its part into its region
            for i, slot in enumerate(out.block_ids):
                maps[r].tensors[0][slot].numpy()[:] = data[r, i]
        a.complete_store(chain)
        a.sync()
        first.call(lambda s: s.tiered.wait())
        stats = first.call(lambda s: s.status()["tiers"])
        assert stats["tiers"]["disk"]["written_blocks"] == 3
        for m in maps:
            m.close()
        a.close()
    finally:
        first.stop()
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["rank0", "rank1"]
    second = pool("second")
    try:
        b = NodePoolClient(second.socket, FP, name="b")
        assert [b.lookup([k]) for k in chain] == [None] * 3  # asked of both ranks' tiers
        _until(lambda: [b.lookup([k]) for k in chain] == [1] * 3, "not promoted")
        got = b.prepare_load(chain)
        maps = regions(second)
        for r in range(2):
            for i, slot in enumerate(got):
                assert np.array_equal(maps[r].tensors[0][slot].numpy(), data[r, i]), (r, i)
        b.complete_load(chain)
        for m in maps:
            m.close()
        b.close()
    finally:
        second.stop()
    shutil.rmtree(tmp_path / "disk" / "rank1")  # rank 1's tier lost its parts
    third = pool("third")
    try:
        c = NodePoolClient(third.socket, FP, name="c")
        assert c.lookup(chain[:1]) is None
        _until(lambda: c.lookup(chain[:1]) == 0, "half a block was served")
        c.close()
    finally:
        third.stop()


def test_an_engine_on_a_node_pool_names_no_tiers_of_its_own(tmp_path: Path) -> None:
    from kvoff import OffloadingConfig

    with pytest.raises(ValueError, match="tiers are the node pool's"):
        OffloadingConfig(node_pool="/tmp/pool.sock", disk_path="/tmp/d", disk_bytes=1 << 20)
    assert OffloadingConfig(node_pool="/tmp/pool.sock", world_size=2).world_size == 2  # --ranks
    assert OffloadingConfig(node_pool="/tmp/pool.sock").node_pool == "/tmp/pool.sock"
    # the pool's tiers are named to the pool; half a disk tier is refused before it starts
    proc = subprocess.run(
        [sys.executable, "-m", "kvoff", "pool", "serve", "--slots", "4", "--slot-bytes", "4096",
         "--socket", str(tmp_path / "p.sock"), "--disk-path", str(tmp_path / "disk")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "--disk-path and --disk-bytes go together" in proc.stderr
    assert not (tmp_path / "p.sock").exists()
