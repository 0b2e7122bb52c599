"""RankedTier: the per-rank tiers of a tensor-parallel engine as one tier (a block is every
rank's part), on real disk tiers, and the scheduler's promotion through it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvoff.tiers.block_format import BlockFormat, layout_fingerprint
from kvoff.tiers.disk import SUPERBLOCK_BYTES, DiskTier, slot_bytes_for
from kvoff.tiers.ranked import RankedTier

PART = 4096  # bytes of one rank's part of a block


def fmt(rank: int) -> BlockFormat:
    fp = layout_fingerprint(model="tiny", dtype="float16", world_size=2, rank=rank, block_size=16)
    return BlockFormat(fp, PART)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 2


def part(k: bytes, rank: int) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(k[:4], "little") * 7 + rank)
    return rng.integers(0, 256, PART, dtype=np.uint8)


def ranked(tmp_path: Path, blocks: int = 16) -> RankedTier:
    return RankedTier([
        DiskTier(tmp_path / f"rank{r}", SUPERBLOCK_BYTES + blocks * slot_bytes_for(fmt(r)), fmt(r))
        for r in range(2)
    ])  # fmt: skip


def test_round_trip_of_every_ranks_part(tmp_path: Path) -> None:
    tier = ranked(tmp_path)
    keys = [key(i) for i in range(5)]
    assert tier.put(keys, [(part(k, 0), part(k, 1)) for k in keys]) == [True] * 5
    assert tier.contains([*keys, key(99)]) == [True] * 5 + [False]
    outs = [(np.zeros(PART, np.uint8), np.zeros(PART, np.uint8)) for _ in keys]
    assert tier.get(keys, outs) == [True] * 5
    for k, (a, b) in zip(keys, outs, strict=True):
        assert np.array_equal(a, part(k, 0)) and np.array_equal(b, part(k, 1))
    st = tier.stats()
    assert st["blocks_written"] == 10 and st["hits"] == 10  # the ranks' counters summed
    assert tier.name == "disk" and tier.fmt.payload_bytes == 2 * PART
    tier.close()


def test_clear_drops_every_ranks_part(tmp_path: Path) -> None:
    tier = ranked(tmp_path)
    keys = [key(i) for i in range(4)]
    tier.put(keys, [(part(k, 0), part(k, 1)) for k in keys])
    assert tier.clear() == 4
    assert [t.stats()["blocks"] for t in tier.ranks] == [0, 0]
    assert tier.contains(keys) == [False] * 4
    assert tier.put(keys[:1], [(part(keys[0], 0), part(keys[0], 1))]) == [True]
    assert tier.contains(keys) == [True, False, False, False]
    tier.close()
    assert tier.clear() == 0  # closed: nothing to drop, no error


def test_a_part_missing_or_corrupt_on_one_rank_is_a_miss(tmp_path: Path) -> None:
    """Without the all-ranks rule, rank 0's part would be served next to garbage on rank 1."""
    tier = ranked(tmp_path)
    keys = [key(i) for i in range(3)]
    tier.put(keys, [(part(k, 0), part(k, 1)) for k in keys])
    tier.ranks[1].evict([keys[1]])  # rank 1 lost its part of block 1
    assert tier.contains(keys) == [True, False, True]
    outs = [(np.zeros(PART, np.uint8), np.zeros(PART, np.uint8)) for _ in keys]
    assert tier.get(keys, outs) == [True, False, True]
    # a rank that cannot store its part: the block is not stored (as a whole)
    tier.ranks[1].close()
    assert tier.put([key(7)], [(part(key(7), 0), part(key(7), 1))]) == [False]
    tier.close()


def test_a_closed_ranked_tier_answers_misses_as_a_closed_tier_does(tmp_path: Path) -> None:
    """Before, every call after close() raised RuntimeError (the rank threads were shut down);
    a closed tier answers misses (a single DiskTier: False / False / False / 0), counted by the
    ranks as theirs, and still refuses bad arguments."""
    tier = ranked(tmp_path)
    keys = [key(i) for i in range(3)]
    assert tier.put(keys, [(part(k, 0), part(k, 1)) for k in keys]) == [True] * 3
    tier.close()
    outs = [(np.zeros(PART, np.uint8), np.zeros(PART, np.uint8)) for _ in keys]
    assert tier.contains(keys) == [False] * 3
    assert tier.get(keys, outs) == [False] * 3
    assert tier.put(keys, [(part(k, 0), part(k, 1)) for k in keys]) == [False] * 3
    assert tier.evict(keys) == 0
    st = tier.stats()
    assert st["misses"] == 2 * 3 and st["writes_dropped"] == 2 * 3  # each rank's, summed
    with pytest.raises(ValueError, match="tuple of 2 arrays"):
        tier.put([keys[0]], [part(keys[0], 0)])
    with pytest.raises(ValueError, match=r"offload keys must be bytes of 1\.\.64"):
        tier.contains(["not bytes"])  # type: ignore[list-item]
    tier.close()  # idempotent
    again = ranked(tmp_path)  # the ranks' files were closed and unlocked: they reopen
    assert again.contains(keys) == [True] * 3
    again.close()


def test_bad_arguments_raise_and_change_nothing(tmp_path: Path) -> None:
    tier = ranked(tmp_path)
    k = key(1)
    with pytest.raises(ValueError, match="tuple of 2 arrays"):
        tier.put([k], [part(k, 0)])  # one array, not one per rank
    with pytest.raises(ValueError, match="tuple of 2 arrays"):
        tier.get([k], [(np.zeros(PART, np.uint8),)])
    # a part of the wrong size on rank 1: refused before rank 0 writes anything
    with pytest.raises(ValueError, match="rank 1's part is 100 bytes"):
        tier.put([k], [(part(k, 0), np.zeros(100, np.uint8))])
    with pytest.raises(ValueError, match="rank 0's part is read-only"):
        ro = part(k, 0)
        ro.flags.writeable = False
        tier.get([k], [(ro, np.zeros(PART, np.uint8))])
    assert tier.contains([k]) == [False] and tier.stats()["blocks_written"] == 0
    with pytest.raises(ValueError, match="at least one rank"):
        RankedTier([])
    with pytest.raises(ValueError, match="of one kind"):

        class Other(DiskTier):
            name = "remote"

        RankedTier([tier.ranks[0], Other(tmp_path / "o", SUPERBLOCK_BYTES + 4 * 8192, fmt(1))])
    tier.close()


def test_ranks_share_one_redis_cluster_under_their_own_fingerprints(redis_url: str) -> None:
    """Two ranks' tiers on one Redis Cluster: each rank's part lives under its own fingerprint
    (so a rank never reads another's part), and a part deleted on one rank is a miss."""
    from kvoff.tiers.redis_cluster import RedisClusterTier

    tier = RankedTier([RedisClusterTier(redis_url, fmt(r), timeout_s=2.0) for r in range(2)])
    keys = [key(i) for i in range(4)]
    assert tier.put(keys, [(part(k, 0), part(k, 1)) for k in keys]) == [True] * 4
    outs = [(np.zeros(PART, np.uint8), np.zeros(PART, np.uint8)) for _ in keys]
    assert tier.get(keys, outs) == [True] * 4
    for k, (a, b) in zip(keys, outs, strict=True):
        assert np.array_equal(a, part(k, 0)) and np.array_equal(b, part(k, 1))
    assert not np.array_equal(outs[0][0], outs[0][1])  # the ranks' parts are distinct objects
    tier.ranks[0].evict([keys[2]])
    assert tier.contains(keys) == [True, True, False, True]
    assert tier.get(keys[2:3], outs[2:3]) == [False]
    assert tier.stats()["corrupted_blocks"] == 0
    tier.close()


def test_ranks_of_one_fingerprint_or_one_tier_object_are_refused(
    tmp_path: Path, redis_url: str
) -> None:
    """Before, ranks sharing a fingerprint were accepted: on one Redis Cluster both ranks store
    their parts under one key, rank 1's part overwrites rank 0's and get() serves rank 1's
    bytes as rank 0's part (wrong KV). The same tier object twice did the same on disk. Both
    are refused, naming the fingerprint / ranks and the fix; the tiers are left open, unused."""
    from kvoff.tiers.redis_cluster import RedisClusterTier

    shared = BlockFormat(layout_fingerprint(model="tiny", world_size=2), PART)  # no rank in it
    remote = [RedisClusterTier(redis_url, shared, timeout_s=2.0) for _ in range(2)]
    fp = shared.fingerprint.hex()
    refused = rf"ranks 0 and 1 share the fingerprint {fp}.*layout_fingerprint\(\.\.\., rank=r\)"
    with pytest.raises(ValueError, match=refused):
        RankedTier(remote)
    # refused before anything ran: each tier is still open and keeps its own part
    k = key(3)
    assert remote[0].put([k], [part(k, 0)]) == [True]
    out = np.zeros(PART, np.uint8)
    assert remote[1].get([k], [out]) == [True] and np.array_equal(out, part(k, 0))
    for t in remote:
        t.close()

    disk = DiskTier(tmp_path / "r0", SUPERBLOCK_BYTES + 4 * slot_bytes_for(fmt(0)), fmt(0))
    with pytest.raises(ValueError, match=r"ranks 0 and 1 are the same tier object.*rank=1"):
        RankedTier([disk, disk])
    assert disk.put([k], [part(k, 0)]) == [True]  # still open
    disk.close()
