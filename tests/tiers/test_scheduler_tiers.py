"""Secondary tiers under kvoff's C++ ``OffloadingScheduler`` (``attach_tiers``): a lookup that
misses L1 answers "retry later" while the tiers are asked, the retry loads the promoted blocks
into GPU blocks byte for byte (checked by the engine simulator of ``scheduler_harness``), across
a restart (disk) and across two OS processes (Redis Cluster); a block being written through is
still a hit; bad input changes nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from scheduler_harness import EngineSim  # noqa: E402

from kvoff.tiers.block_format import BlockFormat, layout_fingerprint  # noqa: E402
from kvoff.tiers.disk import DiskTier  # noqa: E402
from kvoff.tiers.redis_cluster import RedisClusterTier  # noqa: E402

PROMPT = list(range(13))  # 3 full blocks of 4 tokens, the 13th token is computed


def make_sim(**kw: object) -> EngineSim:
    return EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=16, **kw)  # type: ignore[arg-type]


def fmt_of(sim: EngineSim) -> BlockFormat:
    slot = sim.worker.slot_bytes
    return BlockFormat(layout_fingerprint(test="scheduler-tiers", payload=slot), slot)


def attach_disk(sim: EngineSim, path: Path) -> DiskTier:
    disk = DiskTier(path, 64 * (sim.worker.slot_bytes + 8192), fmt_of(sim))
    sim.sched.attach_tiers([disk], sim.worker.cpu_pool.numpy().__getitem__)
    return disk


def store_prompt(sim: EngineSim, rid: str = "a") -> None:
    """A prompt no tier holds: one "retry later" while the tiers are asked, then computed and
    stored (blocks 0..2)."""
    sim.add_request(rid, PROMPT)
    assert sim.step().lookups == {rid: (0, None)}
    assert sim.sched.tiers is not None
    sim.sched.tiers.wait_reads()
    rec = sim.step()
    assert rec.lookups == {rid: (0, 0)}
    assert rec.stored == {rid: {(0, 0), (0, 1), (0, 2)}}
    sim.drain()


def test_l1_miss_is_promoted_from_disk_after_a_restart(tmp_path: Path) -> None:
    """The first engine stores through the scheduler (written through to disk); a restarted
    engine (new scheduler, worker and CPU pool) gets "retry later", then a 12-token hit loaded
    from the blocks promoted from disk, byte-exact."""
    first = make_sim()
    attach_disk(first, tmp_path / "disk")
    store_prompt(first)
    first.sched.close()  # waits for the write-through
    assert first.sched.tiers is None

    second = make_sim()
    pool_disk = attach_disk(second, tmp_path / "disk")
    second.add_request("b", PROMPT)
    rec = second.step()
    assert rec.lookups == {"b": (0, None)}  # L1 missed: the disk is being asked
    assert second.sched.tiers is not None
    second.sched.tiers.wait_reads()
    rec = second.step()
    assert rec.lookups == {"b": (0, 12)}
    assert rec.loaded == {"b": {(0, 0), (0, 1), (0, 2)}}  # the harness checked the bytes
    second.drain()
    stats = second.sched.tiers.stats()
    assert stats["tiers"]["disk"]["promoted_blocks"] == 3
    assert pool_disk.stats()["corrupted_blocks"] == 0
    assert second.sched.stats()["hit_tokens"] == 12
    second.sched.close()


def test_a_block_no_tier_holds_is_asked_once_then_a_miss(tmp_path: Path) -> None:
    sim = make_sim()
    attach_disk(sim, tmp_path / "disk")
    store_prompt(sim)  # nothing anywhere: asked once, then computed and stored
    assert sim.sched.tiers is not None
    assert sim.sched.tiers.stats()["probes"] == 1
    sim.sched.close()


def test_l1_hits_need_no_tier_and_no_retry(tmp_path: Path) -> None:
    sim = make_sim()
    attach_disk(sim, tmp_path / "disk")
    store_prompt(sim)
    assert sim.sched.tiers is not None
    probes = sim.sched.tiers.stats()["probes"]
    sim.add_request("b", PROMPT)
    rec = sim.step()
    assert rec.lookups == {"b": (0, 12)}
    assert sim.sched.tiers.stats()["probes"] == probes
    sim.drain()
    sim.sched.close()


class GatedDisk(DiskTier):
    """A real disk tier whose writes wait for ``gate`` (to hold blocks in write-through)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, keys: Sequence[bytes], blocks: Sequence[np.ndarray]) -> list[bool]:
        self.entered.set()
        assert self.gate.wait(30)
        return super().put(keys, blocks)


def test_a_block_being_written_through_is_still_a_hit(tmp_path: Path) -> None:
    """Write-through pins a block in L1 (not evicted while tiers read it); the scheduler
    counts only loads' pins as busy, so a second request loads it at once (no retry)."""
    sim = make_sim()
    disk = GatedDisk(tmp_path / "disk", 64 * (sim.worker.slot_bytes + 8192), fmt_of(sim))
    pool = sim.sched.attach_tiers([disk], sim.worker.cpu_pool.numpy().__getitem__)
    store_prompt(sim)
    assert disk.entered.wait(30)
    keys = [sim.key_of("a", j) for j in range(3)]
    assert pool.stats()["write_queue_blocks"] == 3
    assert all(sim.sched.pin_count(k) == 1 for k in keys)  # the write-through pins
    sim.add_request("b", PROMPT)
    rec = sim.step()
    assert rec.lookups == {"b": (0, 12)}
    assert rec.loaded == {"b": {(0, 0), (0, 1), (0, 2)}}
    sim.drain()
    disk.gate.set()
    pool.wait()
    assert all(sim.sched.pin_count(k) == 0 for k in keys)
    assert pool.stats()["tiers"]["disk"]["written_blocks"] == 3
    sim.sched.close()


def test_a_reset_serves_no_block_from_before_it(tmp_path: Path) -> None:
    """reset_cache (new weights) with write-through in flight: the disk write already running
    is waited for and then cleared, the blocks queued behind it are never written, the blocks
    pinned in L1 for write-through stop being hits, and a request for the same prompt after
    the reset finds nothing in any tier (without the reset's tier part, the disk promotes the
    old blocks: a 12-token hit of KV made with the old weights)."""
    sim = make_sim()
    disk = GatedDisk(tmp_path / "disk", 64 * (sim.worker.slot_bytes + 8192), fmt_of(sim))
    pool = sim.sched.attach_tiers(
        [disk], sim.worker.cpu_pool.numpy().__getitem__, write_queue_blocks=8
    )
    store_prompt(sim, "a")
    assert disk.entered.wait(30)  # a's blocks are being written: the writer waits in put
    sim.add_request("c", [t + 100 for t in PROMPT])  # queued behind a's write
    assert sim.step().lookups == {"c": (0, None)}
    pool.wait_reads()
    assert sim.step().stored == {"c": {(0, 0), (0, 1), (0, 2)}}
    sim.drain()
    assert pool.stats()["write_queue_blocks"] == 6
    done = threading.Event()

    def reset() -> None:
        sim.reset_cache()
        done.set()

    t = threading.Thread(target=reset)
    t.start()
    assert not done.wait(0.3)  # waits for the put that is running
    disk.gate.set()
    t.join(30)
    assert done.is_set()
    st = pool.stats()
    assert st["resets"] == 1
    disk_st = st["tiers"]["disk"]
    # a's blocks were written before the reset took the writer's lock; c's may have been too
    # (the writer can take its lock back first), else they were dropped unwritten; whatever
    # was written before the reset was cleared by it
    assert disk_st["written_blocks"] in (3, 6)
    dropped = st["writes_cancelled_reset"] + disk_st["writes_dropped_reset"]
    assert disk_st["written_blocks"] + dropped == 6
    assert disk_st["blocks_cleared"] == disk_st["written_blocks"]
    assert disk.held_keys() == []
    assert sim.sched.stats()["num_stored_blocks"] == 0  # a's and c's L1 blocks are gone too
    for rid in ("b", "d"):
        sim.add_request(rid, PROMPT if rid == "b" else [t + 100 for t in PROMPT])
        assert sim.step().lookups == {rid: (0, None)}  # L1 misses: the tiers are asked
        pool.wait_reads()
        rec = sim.step()
        assert rec.lookups == {rid: (0, 0)}  # and hold nothing from before the reset
        assert rec.stored == {rid: {(0, 0), (0, 1), (0, 2)}}
        sim.drain()
    pool.wait()
    assert pool.stats()["write_queue_blocks"] == 0
    assert sorted(disk.held_keys()) == sorted(
        sim.key_of(rid, j) for rid in ("b", "d") for j in range(3)
    )
    assert sim.sched.stats()["num_stored_blocks"] == 6
    assert sim.sched.stats()["num_free_blocks"] == 16 - 6  # every retired slot came back
    sim.sched.close()


def test_bad_attachments_are_refused_and_change_nothing(tmp_path: Path) -> None:
    sim = make_sim()
    slot = sim.worker.slot_bytes
    wrong = DiskTier(tmp_path / "w", 64 * (slot + 8192),
                     BlockFormat(layout_fingerprint(test="wrong"), slot + 16))  # fmt: skip
    with pytest.raises(ValueError, match=rf"{slot + 16}-byte blocks.*payload_bytes={slot}"):
        sim.sched.attach_tiers([wrong], sim.worker.cpu_pool.numpy().__getitem__)
    assert sim.sched.tiers is None
    wrong.close()
    attach_disk(sim, tmp_path / "disk")
    with pytest.raises(ValueError, match="attached already"):
        attach_disk(sim, tmp_path / "disk2")
    store_prompt(sim)  # still works, with its one tier
    sim.sched.close()
    sim.sched.close()  # idempotent


def test_two_ranks_promote_every_ranks_part(tmp_path: Path) -> None:
    """world_size 2: cpu_slot gives one slot per rank and each rank has its own disk tier
    (RankedTier). The harness's worker is rank 0 (its loads are checked byte for byte); rank
    1's pool is an array standing in for the other process's: its parts, random bytes, must
    come back into the restarted engine's rank-1 pool in the promoted slots."""
    from kvoff.tiers.ranked import RankedTier

    def engine(rank1: np.ndarray) -> tuple[EngineSim, RankedTier]:
        sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=16, world_size=2)
        slot = sim.worker.slot_bytes
        tiers = RankedTier([
            DiskTier(tmp_path / f"rank{r}", 64 * (slot + 8192),
                     BlockFormat(layout_fingerprint(test="two-ranks", rank=r), slot))
            for r in range(2)
        ])  # fmt: skip
        views = (sim.worker.cpu_pool.numpy(), rank1)
        with pytest.raises(ValueError, match="one slot array per rank"):
            sim.sched.attach_tiers([tiers], views[0].__getitem__)
        assert sim.sched.tiers is None  # refused: nothing attached
        sim.sched.attach_tiers([tiers], lambda b: (views[0][b], views[1][b]))
        return sim, tiers

    slot_bytes = make_sim().worker.slot_bytes
    first_rank1 = np.random.default_rng(5).integers(0, 256, (16, slot_bytes), dtype=np.uint8)
    first, _ = engine(first_rank1)
    store_prompt(first)
    first_rank0 = first.worker.cpu_pool.numpy().copy()
    first.sched.close()  # waits for the write-through

    second_rank1 = np.zeros_like(first_rank1)
    second, _ = engine(second_rank1)
    second.add_request("b", PROMPT)
    assert second.step().lookups == {"b": (0, None)}
    assert second.sched.tiers is not None
    second.sched.tiers.wait_reads()
    rec = second.step()
    assert rec.lookups == {"b": (0, 12)}
    assert rec.loaded == {"b": {(0, 0), (0, 1), (0, 2)}}  # rank 0's bytes checked by the harness
    assert second.sched.tiers.stats()["tiers"]["disk"]["promoted_blocks"] == 3
    # each promoted slot holds, on rank 1, the part stored with the same block on rank 0
    second_rank0 = second.worker.cpu_pool.numpy()
    promoted = [i for i in range(16) if second_rank1[i].any()]
    assert len(promoted) == 3
    # (a slot the first engine never used may hold a stale copy of a block: torch.empty)
    for i in promoted:
        same = [j for j in range(16) if np.array_equal(first_rank0[j], second_rank0[i])]
        assert same and any(np.array_equal(second_rank1[i], first_rank1[j]) for j in same)
    second.drain()
    second.sched.close()


def test_two_engine_processes_share_a_redis_cluster(redis_url: str) -> None:
    """Two OS processes, each an OffloadingScheduler + OffloadingWorker pair: the blocks the
    first one stores are hits for the second, loaded from Redis into its CPU pool, then into
    its GPU blocks, byte-exact (the simulator checks every loaded GPU block)."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_scheduler_tiers import fmt_of, make_sim, store_prompt
        from kvoff.tiers.redis_cluster import RedisClusterTier
        sim = make_sim()
        tier = RedisClusterTier({redis_url!r}, fmt_of(sim), namespace="two-engines")
        sim.sched.attach_tiers([tier], sim.worker.cpu_pool.numpy().__getitem__)
        store_prompt(sim)
        pool = sim.sched.tiers
        sim.sched.close()
        assert pool.stats()["tiers"]["remote"]["written_blocks"] == 3, pool.stats()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]

    sim = make_sim()
    tier = RedisClusterTier(redis_url, fmt_of(sim), namespace="two-engines")
    pool = sim.sched.attach_tiers([tier], sim.worker.cpu_pool.numpy().__getitem__)
    sim.add_request("b", PROMPT)
    assert sim.step().lookups == {"b": (0, None)}
    pool.wait_reads()
    rec = sim.step()
    assert rec.lookups == {"b": (0, 12)}
    assert rec.loaded == {"b": {(0, 0), (0, 1), (0, 2)}}
    sim.drain()
    remote = pool.stats()["tiers"]["remote"]
    assert remote["promoted_blocks"] == 3 and remote["corrupted_blocks"] == 0
    sim.sched.close()


def test_a_hybrid_model_is_promoted_without_a_livelock(tmp_path: Path) -> None:
    """Full attention + a sliding window: each group's missing blocks are asked for, and the
    answers of all groups are taken together, so the retries end (one group's answer is not
    used up while another group's probe runs) and the hit is loaded byte-exact."""
    from scheduler_harness import GroupDesc

    def sim_() -> EngineSim:
        return EngineSim([GroupDesc("full"), GroupDesc("sliding_window", 6)], block_size=4,
                         num_gpu_blocks=64, num_cpu_blocks=32)  # fmt: skip

    first = sim_()
    attach_disk(first, tmp_path / "disk")
    first.add_request("a", PROMPT)
    for _ in range(20):
        first.step()
        assert first.sched.tiers is not None
        first.sched.tiers.wait_reads()
        if first.requests["a"].status == "done":
            break
    first.drain()
    first.sched.close()

    second = sim_()
    attach_disk(second, tmp_path / "disk")
    second.add_request("b", PROMPT)
    answers = []
    for _ in range(6):
        rec = second.step()
        answers.append(rec.lookups.get("b"))
        if rec.loaded:
            break
        assert second.sched.tiers is not None
        second.sched.tiers.wait_reads()
    assert answers[0] == (0, None) and answers[-1] == (0, 12), answers
    assert len(answers) <= 3, answers
    assert rec.loaded["b"] >= {(0, 0), (0, 1), (0, 2)}
    second.drain()
    second.sched.close()


def test_a_promotion_never_evicts_the_blocks_of_a_hit_just_answered(tmp_path: Path) -> None:
    """Applying a finished probe allocates L1 slots and may evict. It happens before the
    scheduler's L1 lookup, never between that answer and the request's load: every block a
    hit counts is ready when ``update_state_after_alloc`` pins it (found by the state machine
    with a disk tier: ``prepare_load`` of an evicted key)."""
    from concurrent.futures import wait

    from kvoff.scheduler import Request

    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=3)
    pool = sim.sched.attach_tiers(
        [DiskTier(tmp_path / "disk", 64 * (sim.worker.slot_bytes + 8192), fmt_of(sim))],
        sim.worker.cpu_pool.numpy().__getitem__,
    )
    for rid, prompt in (("q", [500 + t for t in range(13)]), ("p", PROMPT)):
        sim.add_request(rid, prompt)  # computed and stored; p's blocks evict q's from L1
        for _ in range(10):
            sim.step()
            pool.wait()
        sim.drain()
        pool.wait()
    p_hashes, q_hashes = sim.requests["p"].hashes, sim.requests["q"].hashes
    assert all(sim.sched.block_state(sim.key_of("p", j)) == "ready" for j in range(3))
    assert all(sim.sched.block_state(sim.key_of("q", j)) == "missing" for j in range(3))

    a = Request("A", [*p_hashes[:3], b"a fourth block no one has"], 17)
    assert sim.sched.get_num_new_matched_tokens(a, 0) == (None, False)  # block 3 asked for
    pool.wait_reads()
    x = Request("X", list(q_hashes[:3]), 13)
    assert sim.sched.get_num_new_matched_tokens(x, 0) == (None, False)  # q on disk only
    wait([r.future for r in pool._reads])  # the probe is back, not applied yet
    n, load = sim.sched.get_num_new_matched_tokens(a, 0)
    hit_blocks = (n or 0) // 4
    assert all(sim.sched.block_state(sim.key_of("p", j)) == "ready" for j in range(hit_blocks))
    if load:
        sim.sched.update_state_after_alloc(a, [[1, 2, 3, 4, 5]], n)  # pins them: no error
    sim.sched.request_finished(a)
    sim.sched.request_finished(x)
    sim.sched.close()
