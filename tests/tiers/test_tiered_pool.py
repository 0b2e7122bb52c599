"""kvoff.tiers.coordinator.TieredPool: promotion from a real disk tier into L1 on an L1 miss,
bounded write-through, corrupted blocks never served, and the replay over L1 + disk."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from kvoff import _scheduler
from kvoff.tiers.block_format import BlockFormat, layout_fingerprint
from kvoff.tiers.coordinator import TieredPool
from kvoff.tiers.disk import DiskTier
from kvoff.tools.replay import ReplayConfig, run_replay

PAYLOAD = 8192
FMT = BlockFormat(layout_fingerprint(test="tiered-pool", payload=PAYLOAD), PAYLOAD)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"kvoff-key"


def pattern(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAYLOAD, dtype=np.uint8)


class L1:
    """A manager and its slots (as the worker's CPU pool: one row per CPU block)."""

    def __init__(self, blocks: int) -> None:
        self.manager = _scheduler.CPUOffloadingManager(blocks, "lru")
        self.slots = np.zeros((blocks, PAYLOAD), dtype=np.uint8)

    def store(self, keys: list[bytes], values: list[np.ndarray]) -> None:
        out = self.manager.prepare_store(keys)
        assert out is not None
        index = {k: i for i, k in enumerate(keys)}
        for k, b in zip(out.keys_to_store, out.block_ids, strict=True):
            self.slots[b] = values[index[k]]
        self.manager.complete_store(list(out.keys_to_store), True)


def make_pool(tmp_path: Path, blocks: int = 8, **kw: object) -> tuple[L1, TieredPool, DiskTier]:
    l1 = L1(blocks)
    disk = DiskTier(tmp_path / "disk", 64 * (PAYLOAD + 8192), FMT)
    return l1, TieredPool(l1.manager, l1.slots.__getitem__, [disk], **kw), disk


def test_l1_miss_is_promoted_from_disk_byte_exact(tmp_path: Path) -> None:
    l1, pool, disk = make_pool(tmp_path, blocks=4)
    keys = [key(i) for i in range(6)]
    values = [pattern(i) for i in range(6)]
    for i in range(0, 6, 2):  # 6 blocks through an L1 of 4: the first ones are evicted
        l1.store(keys[i : i + 2], values[i : i + 2])  # complete_store queues the write-through
        pool.wait()
    assert disk.stats()["blocks_written"] == 6 and pool.stats()["writes_queued"] == 6
    assert l1.manager.lookup(keys) == 0  # L1 lost the head
    assert pool.lookup(keys[:3]) is None  # the tiers are asked: retry later
    assert pool.lookup(keys[:3]) is None  # still in flight (or being read into L1)
    pool.wait_reads()
    assert pool.lookup(keys[:3]) == 3  # promoted into L1
    ids = l1.manager.prepare_load(keys[:3])
    for i, b in enumerate(ids):
        np.testing.assert_array_equal(l1.slots[b], values[i])
    l1.manager.complete_load(keys[:3])
    st = pool.stats()["tiers"]["disk"]
    assert st["promoted_blocks"] == 2 and st["promotion_failures"] == 0  # key 2 stayed in L1
    pool.wait()
    assert pool.stats()["writes_queued"] == 6  # promoted blocks are not written through again
    assert [pool.take_source(k) for k in keys[:3]] == ["disk", "disk", "L1"]
    pool.close()


def test_stats_version_moves_with_every_stats_change_and_only_then(tmp_path: Path) -> None:
    """The connector reads the tiers' counters only when stats_version() moved: a write, a
    probe, a promotion and a dropped write each move it; nothing happening leaves it."""
    l1, pool, _ = make_pool(tmp_path, blocks=4, write_queue_blocks=2)
    seen = [pool.stats_version()]
    snap = [pool.stats()]

    def moved() -> bool:
        now, stats = pool.stats_version(), pool.stats()
        changed = now != seen[-1]
        assert changed or stats == snap[-1]  # an unchanged version means unchanged stats
        seen.append(now)
        snap.append(stats)
        return changed

    assert not moved()
    l1.store([key(0), key(1)], [pattern(0), pattern(1)])
    pool.wait()
    assert moved()  # written through
    assert not moved()
    l1.store([key(i) for i in range(2, 6)], [pattern(i) for i in range(2, 6)])  # 2 dropped
    pool.wait()
    assert moved() and pool.stats()["writes_dropped_queue_full"] >= 1
    assert pool.lookup([key(0)]) is None  # evicted from L1: the disk is asked
    pool.wait_reads()
    assert pool.lookup([key(0)]) == 1
    assert moved()  # probed and promoted
    assert not moved()
    pool.close()


def test_a_key_no_tier_holds_is_answered_once_then_a_miss(tmp_path: Path) -> None:
    l1, pool, _ = make_pool(tmp_path)
    keys = [key(100), key(101)]
    assert pool.lookup(keys) is None
    pool.wait_reads()
    assert pool.lookup(keys) == 0  # answered: no tier has it; no second probe
    assert pool.stats()["probes"] == 1
    assert l1.manager.lookup(keys) == 0
    pool.close()


def test_corrupted_block_on_disk_is_never_promoted(tmp_path: Path) -> None:
    l1, pool, disk = make_pool(tmp_path, blocks=2)
    keys = [key(i) for i in range(4)]
    for i in range(0, 4, 2):
        l1.store(keys[i : i + 2], [pattern(i), pattern(i + 1)])
        pool.wait()
    # flip one payload byte of every block in the file: each read must fail its checksum
    path = next((tmp_path / "disk").iterdir())
    data = bytearray(path.read_bytes())
    for value in (pattern(0), pattern(1)):
        at = bytes(data).find(value[:64].tobytes())
        assert at > 0
        data[at + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    assert pool.lookup(keys[:2]) is None
    pool.wait_reads()
    assert pool.lookup(keys[:2]) == 0  # never served
    assert l1.manager.lookup(keys[:2]) == 0
    st = pool.stats()["tiers"]["disk"]
    assert st["promotion_failures"] >= 1 and st["promoted_blocks"] == 0
    assert disk.stats()["corrupted_blocks"] >= 1
    pool.close()


class GatedDisk(DiskTier):
    """The real disk tier whose writes wait for a gate (a slow device)."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def put(self, keys, payloads):  # type: ignore[no-untyped-def]
        self.gate.wait(30)
        return super().put(keys, payloads)


def test_full_write_queue_drops_and_never_blocks(tmp_path: Path) -> None:
    l1 = L1(16)
    disk = GatedDisk(tmp_path / "disk", 64 * (PAYLOAD + 8192), FMT)
    pool = TieredPool(l1.manager, l1.slots.__getitem__, [disk], write_queue_blocks=4)
    keys = [key(i) for i in range(8)]
    assert pool.wait_for_write_room(4)
    l1.store(keys[:4], [pattern(i) for i in range(4)])  # queued, pinned while the disk is stuck
    assert not pool.wait_for_write_room(1)  # answers at once: an engine never waits
    l1.store(keys[4:], [pattern(i) for i in range(4, 8)])  # no room: dropped at once, counted
    assert pool.stats()["writes_dropped_queue_full"] == 4
    assert pool.stats()["write_queue_blocks"] == 4
    # the queued blocks are pinned: L1 cannot evict them for new stores
    new = [key(100 + i) for i in range(16)]
    out = l1.manager.prepare_store(new)
    assert out is None or not set(out.evicted_keys) & set(keys[:4])
    if out is not None:
        l1.manager.complete_store(list(out.keys_to_store), False)
    disk.gate.set()
    pool.wait()
    assert pool.stats()["write_queue_blocks"] == 0
    assert pool.stats()["tiers"]["disk"]["written_blocks"] == 4
    assert disk.contains(keys) == [True] * 4 + [False] * 4
    pool.close()


def test_bad_configuration_is_refused(tmp_path: Path) -> None:
    l1 = L1(4)
    disk = DiskTier(tmp_path / "d", 8 * (PAYLOAD + 8192), FMT)
    with pytest.raises(ValueError, match="write_queue_blocks"):
        TieredPool(l1.manager, l1.slots.__getitem__, [disk], write_queue_blocks=0)
    other = DiskTier(
        tmp_path / "e", 8 * (2 * PAYLOAD + 8192), BlockFormat(FMT.fingerprint, 2 * PAYLOAD)
    )
    other.name = "disk2"
    with pytest.raises(ValueError, match="block size"):
        TieredPool(l1.manager, l1.slots.__getitem__, [disk, other])
    disk.close()
    other.close()


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (float("nan"), TypeError, "write_queue_blocks=nan must be an int in 1..4294967295, not a"),
        (2.5, TypeError, "write_queue_blocks=2.5 must be an int"),
        (True, TypeError, "write_queue_blocks=True must be an int .*not a bool"),
        ("4", TypeError, "write_queue_blocks='4' must be an int"),
        (None, TypeError, "write_queue_blocks=None must be an int"),
        (0, ValueError, "write_queue_blocks=0 must be an int in 1..4294967295"),
        (2**32, ValueError, "write_queue_blocks=4294967296 must be an int in 1..4294967295"),
        (10**20, ValueError, "write_queue_blocks=100000000000000000000 must be an int in"),
    ],
    ids=repr,
)
def test_a_bad_write_queue_bound_is_refused_and_starts_nothing(
    tmp_path: Path, value: object, error: type[Exception], message: str
) -> None:
    """Before, nan, 2.5 and 10**20 passed the ``< 1`` check and failed later in the binding
    with pybind's raw error, "4" and None gave a raw comparison TypeError and True was taken
    as 1. The manager keeps the bound in 32 bits."""
    l1 = L1(4)
    disk = DiskTier(tmp_path / "d", 8 * (PAYLOAD + 8192), FMT)
    before = threading.active_count()
    with pytest.raises(error, match=message):
        TieredPool(l1.manager, l1.slots.__getitem__, [disk], write_queue_blocks=value)  # type: ignore[arg-type]
    assert threading.active_count() == before and l1.manager.write_through_capacity == 0
    for good in (np.int64(3), 2**32 - 1):  # a NumPy integer and the largest bound are taken
        pool = TieredPool(l1.manager, l1.slots.__getitem__, [disk], write_queue_blocks=good)  # type: ignore[arg-type]
        assert l1.manager.write_through_capacity == good
        pool.close()


def test_tiers_of_another_block_size_than_an_l1_slot_are_refused(tmp_path: Path) -> None:
    """Before, a tier whose blocks are not the L1 slot size was taken, and every write-through
    and promotion then failed silently (written_blocks 0, write_failures counted). Refused at
    construction, with nothing left running: no thread, write-through off, the tier open and
    unattached (attached to a pool of the right slot size afterwards)."""
    manager = _scheduler.CPUOffloadingManager(4, "lru")
    slots = np.zeros((4, 2 * PAYLOAD), np.uint8)  # L1 slots twice the tier's block size
    disk = DiskTier(tmp_path / "d", 8 * (PAYLOAD + 8192), FMT)
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(
        ValueError,
        match=r"tier 'disk' stores 8192-byte blocks but an L1 slot \(slot\(0\)\) has 16384 "
        r"bytes; build the tier's BlockFormat with payload_bytes=16384",
    ):
        TieredPool(manager, slots.__getitem__, [disk])
    assert {t.name for t in threading.enumerate()} == before
    assert manager.write_through_capacity == 0
    out = manager.prepare_store([key(1)])  # a store is not queued for write-through
    assert out is not None
    manager.complete_store(list(out.keys_to_store), True)
    assert manager.write_through_queued == 0
    # per rank (a RankedTier's slot): the parts' sizes summed; a slot that fails is named
    with pytest.raises(ValueError, match=r"an L1 slot \(slot\(0\)\) has 24576 bytes"):
        TieredPool(manager, lambda b: (slots[b], slots[b, :PAYLOAD]), [disk])

    def no_slot(block_id: int) -> np.ndarray:
        raise IndexError("no slot")

    with pytest.raises(ValueError, match=r"slot\(0\) failed \(IndexError: no slot\)"):
        TieredPool(manager, no_slot, [disk])
    assert manager.write_through_capacity == 0
    assert disk.put([key(2)], [pattern(2)]) == [True]  # still open, still the caller's
    l1 = L1(4)
    pool = TieredPool(l1.manager, l1.slots.__getitem__, [disk])
    l1.store([key(3)], [pattern(3)])
    pool.wait()
    assert pool.stats()["tiers"]["disk"]["written_blocks"] == 1
    pool.close()


def test_after_close_lookup_answers_from_l1_and_probe_changes_nothing(tmp_path: Path) -> None:
    """Before, lookup() and probe() after close() raised RuntimeError (the probe thread was
    shut down) and left the key in _reading and probes counted, so the key answered "retry
    later" for ever."""
    l1, pool, disk = make_pool(tmp_path, blocks=4)
    l1.store([key(1)], [pattern(1)])
    pool.wait()
    assert disk.put([key(2)], [pattern(2)]) == [True]  # on the tier only
    pool.close()
    assert pool.lookup([key(1), key(2)]) == 1  # L1 only: the tier is not asked
    assert pool.lookup([key(2)]) == 0
    assert pool.lookup_groups([[key(2)], [key(1)]]) == [0, 1]
    assert pool.probe([key(2)]) is False
    assert not pool.is_reading(key(2)) and pool.probes == 0
    assert pool.stats()["lookup_retries"] == 0
    pool.poll()
    pool.close()  # idempotent


def test_a_run_longer_than_l1_promotes_its_leading_part(tmp_path: Path) -> None:
    """A tier holds 6 blocks of a request, L1 has 4 slots: the leading part that L1 can take
    is promoted and served byte-exact (before, ``prepare_store`` of all 6 was refused and the
    request got nothing, however often it asked)."""
    l1, pool, disk = make_pool(tmp_path, blocks=4)
    keys = [key(i) for i in range(6)]
    assert disk.put(keys, [pattern(i) for i in range(6)]) == [True] * 6
    assert pool.lookup(keys) is None
    pool.wait_reads()
    hits = pool.lookup(keys)
    assert hits is not None and 2 <= hits <= 4
    ids = l1.manager.prepare_load(keys[:hits])
    for i, b in enumerate(ids):
        np.testing.assert_array_equal(l1.slots[b], pattern(i))
    l1.manager.complete_load(keys[:hits])
    assert pool.stats()["tiers"]["disk"]["promoted_blocks"] == hits
    pool.close()


def test_a_promotion_keeps_the_request_s_own_l1_hits(tmp_path: Path) -> None:
    """L1 (4 slots) holds a request's first two blocks as its oldest, two other blocks as its
    newest; a tier holds the request's next two. Promoting them must evict the other blocks,
    not the request's own hits: before, the promotion evicted k0 and k1 (LRU), and the
    request's next lookup found nothing at all and asked the tiers for k0 (no tier has it)."""
    l1, pool, disk = make_pool(tmp_path, blocks=4)
    keys = [key(i) for i in range(4)]
    l1.store(keys[:2], [pattern(0), pattern(1)])  # the request's hits, least recent
    l1.store([key(8), key(9)], [pattern(8), pattern(9)])
    pool.wait()  # written through: the four are evictable again
    assert disk.put(keys[2:], [pattern(2), pattern(3)]) == [True, True]
    assert pool.lookup(keys) is None  # k2 missed: the tiers are asked
    pool.wait_reads()
    assert pool.lookup(keys) == 4  # the request's whole run, its own hits kept
    ids = l1.manager.prepare_load(keys)
    for i, b in enumerate(ids):
        np.testing.assert_array_equal(l1.slots[b], pattern(i))
    l1.manager.complete_load(keys)
    assert l1.manager.lookup([key(8)]) == 0 and l1.manager.lookup([key(9)]) == 0  # evicted
    assert pool.stats()["tiers"]["disk"]["promoted_blocks"] == 2
    pool.close()


def test_a_promotion_whose_kept_hits_left_l1_stores_only_its_own_blocks(
    tmp_path: Path,
) -> None:
    """The request's hits named to a promotion may leave L1 before it applies (evicted by a
    store meanwhile): they are not stored again from nowhere; the promoted run still is."""
    l1, pool, disk = make_pool(tmp_path, blocks=4)
    keys = [key(i) for i in range(4)]
    l1.store(keys[:2], [pattern(0), pattern(1)])
    pool.wait()
    assert disk.put(keys[2:], [pattern(2), pattern(3)]) == [True, True]
    assert pool.lookup(keys) is None
    assert l1.manager.discard([keys[0]]) == 1  # k0 leaves L1 before the promotion applies
    pool.wait_reads()
    st = pool.stats()["tiers"]["disk"]
    assert st["promoted_blocks"] == 2 and st["promotion_failures"] == 0
    assert l1.manager.lookup(keys[2:]) == 2
    assert l1.manager.num_pending_blocks == 0
    pool.close()


def test_a_slot_callback_that_raises_releases_the_promoted_slots(tmp_path: Path) -> None:
    """An error between reserving the L1 slots and starting the read (here the slot callback)
    stays inside ``poll``: the slots go back and the keys are asked again later, instead of
    answering "retry later" for ever."""
    l1, _, disk = make_pool(tmp_path, blocks=4)
    failures = [0]

    def slot(block_id: int) -> np.ndarray:
        if failures[0]:
            failures[0] -= 1
            raise IndexError("no such slot (once)")
        return l1.slots[block_id]

    pool = TieredPool(l1.manager, slot, [disk])  # which calls slot(0) for its size
    failures[0] = 1  # the next call fails: the promotion's
    keys = [key(i) for i in range(2)]
    assert disk.put(keys, [pattern(i) for i in range(2)]) == [True, True]
    assert pool.lookup(keys) is None
    pool.wait_reads()  # the error is logged, not raised on the engine thread
    assert pool.promoting_keys() == set() and not pool.is_reading(keys[0])
    assert pool.lookup(keys) == 0  # answered: a miss this time
    assert pool.lookup(keys) is None  # asked again
    pool.wait_reads()
    assert pool.lookup(keys) == 2
    pool.close()


@pytest.mark.slow
def test_replay_small_l1_plus_disk_matches_a_huge_l1(tmp_path: Path) -> None:
    """Issue 14: L1 = 2,000 blocks plus disk reaches the hit rate of L1 = 200,000 (within
    0.1 %) on the conversation trace (its first 1,500 requests here; the full trace is the
    committed measurement), byte-exact (every loaded block verified)."""
    limit = 1500
    big = run_replay(ReplayConfig(limit=limit, cpu_blocks=200_000))
    small = run_replay(ReplayConfig(limit=limit, cpu_blocks=2000))
    tiered = run_replay(
        ReplayConfig(limit=limit, cpu_blocks=2000, disk_path=str(tmp_path), disk_bytes=2**30)
    )
    assert small.hit_rate < big.hit_rate - 0.01  # L1 alone is too small: the disk matters
    assert tiered.hit_rate >= big.hit_rate - 0.001
    assert tiered.tier_hit_tokens["disk"] > 0
    assert tiered.corrupted_blocks == 0 and tiered.tier_corrupted_blocks == 0
    assert tiered.blocks_verified > 0 and tiered.failed_transfers == 0


def test_a_process_exits_cleanly_with_a_pool_never_closed(tmp_path: Path) -> None:
    """A dispatcher thread waiting in take_write_through (GIL released) when the interpreter
    exits must not abort the process (it did: a GIL re-take during finalization unwound a
    noexcept destructor). Both guards are checked: without the pool's atexit hook too."""
    script = f"""
import atexit
import numpy as np
from kvoff import _scheduler
from kvoff.tiers import coordinator
from kvoff.tiers.block_format import BlockFormat, layout_fingerprint
from kvoff.tiers.coordinator import TieredPool
from kvoff.tiers.disk import DiskTier

if UNHOOK:
    atexit.unregister(coordinator._stop_dispatchers)
fmt = BlockFormat(layout_fingerprint(test="exit"), 4096)
m = _scheduler.CPUOffloadingManager(16)
slots = np.zeros((16, 4096), dtype=np.uint8)
pool = TieredPool(m, slots.__getitem__, [DiskTier({str(tmp_path)!r} + "/d" + str(UNHOOK),
                                                  1 << 22, fmt)])
out = m.prepare_store([1, 2])
m.complete_store(out.keys_to_store)
print("stored")
"""
    for unhook in (False, True):
        run = subprocess.run(
            [sys.executable, "-c", f"UNHOOK = {unhook}\n" + script],
            check=False, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 0, (unhook, run.returncode, run.stderr[-2000:])
        assert run.stdout.strip() == "stored"


def test_groups_are_answered_together(tmp_path: Path) -> None:
    """``lookup_groups``: an answer of one list is not used up while another list's probe
    runs (else two lists would ask again in turn forever)."""
    _l1, pool, _disk = make_pool(tmp_path)
    a, b = [key(1)], [key(2)]
    assert pool.lookup_groups([a]) is None  # a probed
    pool.wait_reads()
    assert pool.lookup_groups([a, b]) is None  # b probed; a's answer is kept
    pool.wait_reads()
    assert pool.lookup_groups([a, b]) == [0, 0]  # both answered at once
    assert pool.stats()["probes"] == 2
    assert pool.lookup_groups([a, b]) is None  # answers used up: asked again
    pool.close()


class StuckDisk(DiskTier):
    """The real disk tier whose reads hang until released (a failing drive retrying)."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)
        self.release = threading.Event()
        self.reading = threading.Event()

    def get(self, keys, outs):  # type: ignore[no-untyped-def]
        self.reading.set()
        self.release.wait(30)
        return super().get(keys, outs)


def test_a_probe_does_not_wait_behind_another_requests_read(tmp_path: Path) -> None:
    """Request A's promotion hangs in the tier's get; request B, whose block no tier holds,
    is answered (a miss) without waiting for A's read to end."""
    l1 = L1(8)
    disk = StuckDisk(tmp_path / "disk", 64 * (PAYLOAD + 8192), FMT)
    pool = TieredPool(l1.manager, l1.slots.__getitem__, [disk])
    a, b = [key(1)], [key(2)]
    assert disk.put(a, [pattern(1)]) == [True]
    assert pool.lookup(a) is None  # a probe; once it is back, poll() starts a read that hangs
    for _ in range(200):
        pool.poll()
        if disk.reading.wait(0.05):
            break
    assert disk.reading.is_set()
    answers = []
    for _ in range(200):  # 10 s at most; answered within a few polls
        answers.append(pool.lookup(b))
        if answers[-1] is not None:
            break
        threading.Event().wait(0.05)
    assert answers[-1] == 0 and not disk.release.is_set()  # answered while A's read hangs
    assert pool.lookup(a) is None  # A still waits for its own read
    disk.release.set()
    pool.wait_reads()
    assert pool.lookup(a) == 1  # and is promoted once the read ends
    l1.manager.prepare_load(a)
    l1.manager.complete_load(a)
    pool.close()


class MiscountingContains(DiskTier):
    """A broken tier: ``contains`` answers one result too few."""

    def contains(self, keys):  # type: ignore[no-untyped-def]
        return super().contains(keys)[:-1]


class MiscountingGet(DiskTier):
    """A broken tier: ``get`` answers one result too few (after reading every block)."""

    def get(self, keys, outs):  # type: ignore[no-untyped-def]
        return super().get(keys, outs)[:-1]


@pytest.mark.parametrize("cls", [MiscountingContains, MiscountingGet])
def test_a_tier_that_miscounts_gives_misses_and_poll_keeps_working(
    tmp_path: Path, cls: type[DiskTier]
) -> None:
    l1 = L1(8)
    disk = cls(tmp_path / "disk", 64 * (PAYLOAD + 8192), FMT)
    keys = [key(i) for i in range(3)]
    assert disk.put(keys, [pattern(i) for i in range(3)]) == [True] * 3
    pool = TieredPool(l1.manager, l1.slots.__getitem__, [disk])
    assert pool.lookup(keys) is None
    pool.wait_reads()  # raised from poll() for ever before
    assert pool.lookup(keys) == 0  # misses, never half-served
    assert l1.manager.lookup(keys) == 0 and pool.promoting_keys() == set()
    if cls is MiscountingGet:  # the read ran, and its slots were dropped, not served
        assert pool.stats()["tiers"]["disk"]["promotion_failures"] == 3
    pool.close()


def test_make_tiers_closes_the_disk_tier_when_the_remote_tier_is_refused(tmp_path: Path) -> None:
    from kvoff.tiers.coordinator import make_tiers

    kw = {"disk_path": tmp_path / "disk", "disk_bytes": 64 * (PAYLOAD + 8192)}
    with pytest.raises(ValueError, match="namespace"):
        make_tiers(FMT, **kw, remote_url="redis://127.0.0.1:1", remote_namespace="bad:ns")
    tiers = make_tiers(FMT, **kw)  # the file is not left locked by the first attempt
    assert [t.name for t in tiers] == ["disk"]
    for t in tiers:
        t.close()


@pytest.mark.parametrize(
    ("keys", "held", "message"),
    [
        ([key(0)], [b""], r"held\[0\]=b'' is not an offload key"),
        ([key(0)], [key(1), 7], r"held\[1\]=7 is not an offload key"),
        ([key(0)], key(1), r"held=b'.*' is one bytes, not a sequence of keys"),
        ([key(0), b"x" * 65], [], r"keys\[1\]=b'x+' is not an offload key.*1\.\.64"),
        (["k0"], [], r"keys\[0\]='k0' is not an offload key"),
    ],
    ids=["empty-held", "int-held", "bytes-held", "long-key", "str-key"],
)
def test_a_bad_probe_is_refused_up_front_and_changes_nothing(
    tmp_path: Path, keys: list[bytes], held: list[bytes], message: str
) -> None:
    """Before, probe([k], held=[b""]) was accepted; the error came out of poll() (the
    promotion's prepare_store) with the read still in the pool, so every later poll, lookup
    and close raised it again and the threads were never stopped. Refused now, naming the
    bad entry, with nothing started: the pool then promotes and closes as usual."""
    l1, pool, disk = make_pool(tmp_path, blocks=4)
    assert disk.put([key(0)], [pattern(0)]) == [True]
    with pytest.raises(ValueError, match=message):
        pool.probe(keys, held=held)
    assert pool.probes == 0 and not pool.is_reading(key(0)) and not pool._reads
    # lookup_groups checks every list's keys before it starts any list's probe
    with pytest.raises(ValueError, match=r"keys\[0\]=b'x+' is not an offload key"):
        pool.lookup_groups([[key(0)], [b"x" * 65]])
    assert pool.probes == 0 and not pool.is_reading(key(0)) and not pool._reads
    pool.poll()
    assert pool.lookup([key(0)]) is None  # a good probe works
    pool.wait_reads()
    assert pool.lookup([key(0)]) == 1 and l1.manager.num_pending_blocks == 0
    assert pool._dispatcher.is_alive()
    pool.close()  # raised the probe's error before, and left the threads running
    assert pool._closed and not pool._dispatcher.is_alive()
    assert not any(th.is_alive() for th in pool._writers)


@pytest.mark.parametrize("phase", ["_probe", "_read"])
def test_a_promotion_that_fails_to_apply_is_a_miss_and_the_pool_keeps_working(
    tmp_path: Path, phase: str
) -> None:
    """A finished probe (phase 1) or read into L1 slots (phase 2) whose result raises when
    applied (injected: the internal method raises) was left in the pool: every later poll(),
    lookup() and close() raised it again, its slots stayed pending and its keys "being read"
    for ever. It is a miss now: slots released, keys answered, asked again later."""
    l1, pool, disk = make_pool(tmp_path, blocks=4)
    keys = [key(i) for i in range(2)]
    assert disk.put(keys, [pattern(i) for i in range(2)]) == [True, True]
    real = getattr(pool, phase)

    def broken(*a: object) -> object:
        real(*a)  # a read really fills the slots; then the thread fails
        raise RuntimeError(f"injected failure in {phase}")

    setattr(pool, phase, broken)
    assert pool.lookup(keys) is None
    pool.wait_reads()  # raised from poll() before, and for ever
    assert not pool._reads and pool.promoting_keys() == set()
    assert not pool.is_reading(keys[0]) and l1.manager.num_pending_blocks == 0
    failures = pool.stats()["tiers"]["disk"]["promotion_failures"]
    assert failures == (2 if phase == "_read" else 0)
    assert pool.lookup(keys) == 0  # answered: a miss, never served
    assert l1.manager.lookup(keys) == 0
    setattr(pool, phase, real)
    assert pool.lookup(keys) is None  # asked again
    pool.wait_reads()
    assert pool.lookup(keys) == 2
    ids = l1.manager.prepare_load(keys)
    for i, b in enumerate(ids):
        np.testing.assert_array_equal(l1.slots[b], pattern(i))
    l1.manager.complete_load(keys)
    pool.close()
    assert pool._closed and not pool._dispatcher.is_alive()


def test_ranked_tier_parts_are_checked_rank_by_rank(tmp_path: Path) -> None:
    """Before, only the sum of a RankedTier's parts was compared with the slot: ranks of
    8192 + 4096 bytes behind slots of 4096 + 8192 bytes were taken, and then every
    write-through failed (ValueError inside put, swallowed: written_blocks 0). Refused now,
    naming the rank, with nothing started; the ranks in the right order work."""
    from kvoff.tiers.disk import SUPERBLOCK_BYTES, slot_bytes_for
    from kvoff.tiers.ranked import RankedTier

    fmts = [
        BlockFormat(layout_fingerprint(test="ranked-slots", rank=r), s)
        for r, s in enumerate([8192, 4096])
    ]
    tier = RankedTier([
        DiskTier(tmp_path / f"r{r}", SUPERBLOCK_BYTES + 16 * slot_bytes_for(f), f)
        for r, f in enumerate(fmts)
    ])  # fmt: skip
    manager = _scheduler.CPUOffloadingManager(4, "lru")
    swapped = [np.zeros((4, 4096), np.uint8), np.zeros((4, 8192), np.uint8)]
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(
        ValueError,
        match=r"tier 'disk': rank 0 stores 8192-byte parts but rank 0's L1 slot "
        r"\(slot\(0\)\[0\]\) has 4096 bytes .*payload_bytes=4096",
    ):
        TieredPool(manager, lambda b: (swapped[0][b], swapped[1][b]), [tier])
    with pytest.raises(ValueError, match=r"has 2 ranks but slot\(0\) gives 3 array\(s\)"):
        TieredPool(manager, lambda b: (swapped[0][b], swapped[0][b], swapped[0][b]), [tier])
    assert {t.name for t in threading.enumerate()} == before
    assert manager.write_through_capacity == 0
    views = [np.zeros((4, 8192), np.uint8), np.zeros((4, 4096), np.uint8)]
    pool = TieredPool(manager, lambda b: (views[0][b], views[1][b]), [tier])
    out = manager.prepare_store([key(1), key(2)])
    assert out is not None
    manager.complete_store(list(out.keys_to_store), True)
    pool.wait()
    st = pool.stats()["tiers"]["disk"]
    assert st["written_blocks"] == 2 and st["write_failures"] == 0
    pool.close()


def test_a_write_through_put_that_raises_is_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tier's put that raises (injected on the real disk tier) fails its blocks; before, the
    exception was swallowed without a trace, so a misconfigured tier failed silently."""
    l1, pool, disk = make_pool(tmp_path, blocks=4)
    real = disk.put

    def broken(keys, payloads):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected put failure")

    disk.put = broken  # type: ignore[method-assign]
    with caplog.at_level("ERROR", logger="kvoff.tiers"):
        l1.store([key(1), key(2)], [pattern(1), pattern(2)])
        pool.wait()
    st = pool.stats()["tiers"]["disk"]
    assert st["written_blocks"] == 0 and st["write_failures"] == 2
    logged = [r for r in caplog.records if "put of 2 written-through blocks failed" in r.message]
    assert logged and logged[0].exc_info is not None
    assert "injected put failure" in str(logged[0].exc_info[1])
    disk.put = real  # type: ignore[method-assign]
    pool.close()
