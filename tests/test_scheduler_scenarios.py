"""Scenarios for the offloading scheduler, driven by the engine simulator of
``scheduler_harness``: exact ``(group, logical block position)`` sets per step, with real bytes
moved through an OffloadingWorker and checked after every load (docs/design.md invariants 1, 4,
6-8).
"""

from __future__ import annotations

import pytest
from scheduler_harness import EngineSim, GroupDesc, HarnessViolation, snapshot

FULL = GroupDesc("full")


def _positions(group: int, *positions: int) -> set[tuple[int, int]]:
    return {(group, p) for p in positions}


# ---------------------------------------------------------------------- single group
def test_miss_store_then_full_and_partial_hits() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=16)
    prompt = list(range(13))
    sim.add_request("a", prompt)
    rec = sim.step()
    assert rec.lookups == {"a": (0, 0)}
    assert rec.stored == {"a": _positions(0, 0, 1, 2)}
    assert rec.loaded == {}
    (store,) = rec.meta.store_jobs
    assert store.keys == tuple(sim.key_of("a", j) for j in range(3))
    assert all(sim.sched.block_state(k) == "ready" for k in store.keys)

    sim.add_request("b", prompt)
    rec = sim.step()
    assert rec.lookups == {"b": (0, 12)}
    assert rec.loaded == {"b": _positions(0, 0, 1, 2)}
    (load,) = rec.meta.load_jobs
    assert load.gpu.block_ids == tuple(sim.requests["b"].table[0][:3])
    assert load.gpu.group_sizes == (3,) and load.gpu.block_indices == (0,)
    assert load.cpu.block_ids == store.cpu.block_ids
    assert rec.outputs[-1].finished_loading == ("b",)
    rec = sim.step()  # b runs from token 12 on; nothing new to store (block 3 not full)
    assert rec.scheduled[0].num_computed_tokens == 12
    assert sim.requests["b"].status == "done"

    # partial prefix hit: the first 8 tokens are shared, then the prompt differs
    sim.add_request("c", [*prompt[:8], 900, 901, 902, 903, 904])
    rec = sim.step()
    assert rec.lookups == {"c": (0, 8)}
    assert rec.loaded == {"c": _positions(0, 0, 1)}
    rec = sim.step()
    assert rec.stored == {"c": _positions(0, 2)}  # stores resume after the loaded blocks
    assert sim.sched.stats()["hit_tokens"] == 20


def test_retry_later_while_pending_or_loading_elsewhere() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=16, auto_complete=False)
    prompt = list(range(9))
    sim.add_request("a", prompt)
    rec = sim.step()
    (store,) = rec.meta.store_jobs
    assert sim.sched.block_state(store.keys[0]) == "pending"
    sim.add_request("b", prompt)
    rec = sim.step()
    assert rec.lookups == {"b": (0, None)}  # still being stored: retry later
    assert sim.requests["b"].status == "waiting"
    sim.complete()
    rec = sim.step()
    assert rec.lookups == {"b": (0, 8)} and rec.loaded == {"b": _positions(0, 0, 1)}
    sim.add_request("c", prompt)
    rec = sim.step()
    assert rec.lookups == {"c": (0, None)}  # being loaded for b: retry later
    sim.complete()
    rec = sim.step()
    assert rec.lookups == {"c": (0, 8)}
    sim.complete()
    sim.drain()


# ---------------------------------------------------------------------- factor > 1
def test_factor_two_partial_first_offloaded_block() -> None:
    """The engine's own hit ends inside offloaded block 1: only GPU block 3 is loaded, at
    block_indices 3 (offset 3 % 2 = 1 inside its offloaded block)."""
    sim = EngineSim(
        block_size=4, block_size_factor=2, num_gpu_blocks=32, num_cpu_blocks=8,
        gpu_prefix_cache=True,
    )  # fmt: skip
    prompt = list(range(17))
    sim.add_request("a", prompt)
    rec = sim.step()
    assert rec.stored == {"a": _positions(0, 0, 1, 2, 3)}
    a_table = [sim.requests["a"].history[(0, p)][0] for p in range(5)]
    # a is done, its blocks are free but still in the GPU prefix cache; another request takes
    # the two most recently freed ones (positions 4 and 3), so the GPU hit is positions 0..2.
    sim.add_request("d", [500 + i for i in range(7)])
    rec = sim.step()
    assert [sim.requests["d"].history[(0, p)][0] for p in (0, 1)] == [a_table[4], a_table[3]]
    sim.add_request("b", prompt)
    rec = sim.step()
    assert rec.lookups["b"] == (12, 4)
    assert rec.loaded == {"b": _positions(0, 3)}
    (load,) = rec.meta.load_jobs
    assert load.gpu.block_indices == (3,) and load.gpu.group_sizes == (1,)
    assert load.keys == (sim.key_of("b", 1),)
    assert sim.requests["b"].table[0][:3] == a_table[:3]  # the engine's own hit


def test_offloaded_block_straddling_the_sliding_window_edge() -> None:
    """factor 2, full + sliding window of 10 tokens: resuming at 24 tokens the window needs
    tokens 15..23, so offloaded block 1 (GPU blocks 2, 3) straddles the edge: block 2 is null,
    block 3 is loaded and block_indices[1] is 3."""
    sim = EngineSim(
        (FULL, GroupDesc("sliding_window", 10)), block_size=4, block_size_factor=2,
        num_gpu_blocks=40, num_cpu_blocks=12,
    )  # fmt: skip
    prompt = list(range(26))
    sim.add_request("a", prompt)
    rec = sim.step()
    assert rec.stored == {"a": _positions(0, 0, 1, 2, 3, 4, 5) | _positions(1, 0, 1, 2, 3, 4, 5)}
    sim.add_request("b", prompt)
    rec = sim.step()
    assert rec.lookups["b"] == (0, 24)  # the last prompt token is always recomputed
    assert rec.loaded == {"b": _positions(0, 0, 1, 2, 3, 4, 5) | _positions(1, 3, 4, 5)}
    (load,) = rec.meta.load_jobs
    assert sum(load.gpu.group_sizes) == len(load.gpu.block_ids) == 9
    assert load.gpu.group_sizes == (6, 3) and load.gpu.block_indices == (0, 3)
    assert sim.requests["b"].table[1][:3] == [0, 0, 0]
    assert load.keys == (
        *(sim.key_of("b", j, 0) for j in range(3)),
        sim.key_of("b", 1, 1),
        sim.key_of("b", 2, 1),
    )
    sim.drain()


# ---------------------------------------------------------------------- invariant 4
def test_stale_sliding_window_block_is_never_copied() -> None:
    """A sliding-window block whose store was refused (pool full of pending blocks) leaves the
    window, is freed and reallocated to the same request; the retried store copies only the
    live blocks, never the old id under the old key."""
    sim = EngineSim(
        (GroupDesc("sliding_window", 4),), block_size=2, num_gpu_blocks=32, num_cpu_blocks=3,
        auto_complete=False,
    )  # fmt: skip
    sim.add_request("x", [700 + i for i in range(7)])
    rec = sim.step()
    assert rec.stored == {"x": _positions(0, 0, 1, 2)}  # the pool is now full of pending blocks
    sim.add_request("r", list(range(12)), chunk=2)
    for _ in range(3):
        rec = sim.step()
        assert rec.stored == {}
    assert sim.sched.stats()["store_refusals"] == 3
    r = sim.requests["r"]
    old = r.table[0][0]
    sim.begin_step()  # computed 6: position 0 leaves the window and is reused at position 3
    assert r.table[0][0] == 0 and r.table[0][3] == old
    sim.complete()  # x's stores finish: now there is room (x's blocks are evictable)
    rec = sim.end_step()
    assert rec.stored == {"r": _positions(0, 1, 2, 3)}
    (store,) = rec.meta.store_jobs
    assert store.gpu.block_indices == (1,)
    assert store.gpu.block_ids == tuple(r.table[0][1:4]) and store.gpu.block_ids[-1] == old
    assert sim.sched.stats()["stale_blocks_skipped"] >= 1
    assert sim.sched.block_state(sim.key_of("r", 0)) == "missing"
    sim.complete()
    sim.drain()


def test_harness_data_check_catches_a_stale_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Self-test: a store that copies the reallocated block under the old key is caught by the
    byte check alone (table checks off)."""
    sim = EngineSim(
        (GroupDesc("sliding_window", 4),), block_size=2, num_gpu_blocks=32, num_cpu_blocks=8
    )
    sim.check_tables = False
    sim.add_request("r", list(range(12)), chunk=2)
    sim.step()
    r = sim.requests["r"]
    real = sim.sched.build_connector_meta

    def tampered(step):
        meta = real(step)
        if meta.store_jobs and r.table[0][0] == 0:
            from dataclasses import replace

            job = meta.store_jobs[0]
            old = r.history[(0, 0)][0]
            ids = (old, *job.gpu.block_ids[1:])
            return replace(meta, store_jobs=(replace(job, gpu=replace(job.gpu, block_ids=ids)),))
        return meta

    monkeypatch.setattr(sim.sched, "build_connector_meta", tampered)
    with pytest.raises(HarnessViolation, match="wrong copy"):
        for _ in range(4):
            sim.step()


# ---------------------------------------------------------------------- fences
def test_reallocated_store_source_is_flushed() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8, auto_complete=False,
                    free_early=True)  # fmt: skip
    sim.add_request("a", list(range(9)))
    rec = sim.step()
    (store,) = rec.meta.store_jobs
    assert sim.requests["a"].status == "done"  # freed early, its store still in flight
    sim.add_request("b", [300 + i for i in range(9)])
    rec = sim.step()
    assert {b for b, _ in sim.requests["b"].history.values()} & set(store.gpu.block_ids)
    assert rec.flushed == (store.job_id,)
    assert sim.sched.stats()["jobs_flushed"] == 1
    sim.complete()
    sim.drain()


def test_load_into_block_under_in_flight_store_is_flushed() -> None:
    """A block whose store is in flight is freed (preemption) and reallocated as the
    destination of another request's load: the load writes it, so the store must be flushed
    first (invariant 4)."""
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, auto_complete=False)
    sim.add_request("x", list(range(9)))
    sim.step()
    sim.complete()
    sim.add_request("a", [100 + i for i in range(9)], max_tokens=5)
    rec = sim.step()
    (store,) = rec.meta.store_jobs
    sim.preempt("a")
    sim.add_request("c", list(range(9)))
    sim.begin_step()
    assert set(sim.requests["c"].table[0]) & set(store.gpu.block_ids)
    rec = sim.end_step()  # the harness raises on a missing fence
    assert rec.loaded == {"c": _positions(0, 0, 1)}
    assert store.job_id in rec.flushed


# ---------------------------------------------------------------------- preemption
def test_preemption_mid_store_and_resume() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, auto_complete=False)
    sim.add_request("a", list(range(9)), max_tokens=4)
    rec = sim.step()
    (store,) = rec.meta.store_jobs
    assert rec.stored == {"a": _positions(0, 0, 1)}
    sim.preempt("a")
    sim.add_request("b", [400 + i for i in range(9)])
    rec = sim.step()
    assert rec.lookups["a"] == (0, None)  # its own blocks are still pending
    assert store.job_id in rec.flushed  # b got a's freed blocks
    sim.complete()
    rec = sim.step()
    assert rec.lookups["a"] == (0, 8) and rec.loaded == {"a": _positions(0, 0, 1)}
    sim.complete()
    rec = sim.step()
    (sched_a,) = [s for s in rec.scheduled if s.request_id == "a"]
    assert sched_a.resumed_from_preemption
    assert sched_a.new_block_ids == (tuple(sim.requests["a"].table[0]),)
    assert sched_a.num_computed_tokens == 8
    sim.complete()
    sim.drain()


# ---------------------------------------------------------------------- world size
def test_world_size_two_completion_and_failure() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, world_size=2,
                    auto_complete=False)  # fmt: skip
    sim.add_request("a", list(range(9)))
    rec = sim.step()
    (store,) = rec.meta.store_jobs
    out = sim.complete([store.job_id], ranks=[0])
    assert out.completed_jobs == ()
    assert sim.sched.block_state(store.keys[0]) == "pending"
    out = sim.complete([store.job_id], ranks=[1])
    assert out.completed_jobs == (store.job_id,) and out.finished_storing == ("a",)
    assert sim.sched.block_state(store.keys[0]) == "ready"

    free_before = sim.sched.stats()["num_free_blocks"]
    sim.add_request("b", [600 + i for i in range(9)])
    rec = sim.step()
    (store_b,) = rec.meta.store_jobs
    assert sim.sched.stats()["num_free_blocks"] == free_before - 2
    out = sim.complete([store_b.job_id], fail_ranks=[1])
    assert out.failed_jobs == (store_b.job_id,)
    assert all(sim.sched.block_state(k) == "missing" for k in store_b.keys)
    assert sim.sched.stats()["num_free_blocks"] == free_before
    sim.add_request("c", [600 + i for i in range(9)])
    rec = sim.step()
    assert rec.lookups["c"] == (0, 0)  # a failed store is never a hit
    sim.complete()
    sim.drain()


def test_summed_reports_complete_like_single_ones_and_bad_counts_change_nothing() -> None:
    """update_connector_output_counts (vLLM's connector: reports summed over ranks) completes
    a job only when every rank reported, fails it when one rank failed, and refuses bad counts
    without changing anything; counters() is stats() in COUNTER_NAMES order. (The simulator is
    bypassed: no step follows.)"""
    from kvoff.scheduler import COUNTER_NAMES

    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, world_size=2,
                    auto_complete=False)  # fmt: skip
    s = sim.sched
    sim.add_request("a", list(range(9)))
    (store,) = sim.step().meta.store_jobs
    keys = list(store.keys)
    before = snapshot(s, keys, ["a"])
    for bad, exc, match in (
        ({12345: (1, 0)}, ValueError, "job 12345"),
        ({store.job_id: (2, 1)}, ValueError, "more ranks than world_size = 2"),
        ({store.job_id: (1,)}, ValueError, "succeeded, failed"),
        ({store.job_id: (-1, 0)}, ValueError, "succeeded, failed"),
        ([(store.job_id, True)], TypeError, "dict"),
    ):
        with pytest.raises(exc, match=match):
            s.update_connector_output_counts(bad)
        assert snapshot(s, keys, ["a"]) == before
    s.update_connector_output_counts({store.job_id: (1, 0)})
    assert s.block_state(keys[0]) == "pending"  # one rank of two
    s.update_connector_output_counts({store.job_id: [0, 1]})  # the other rank failed
    assert all(s.block_state(k) == "missing" for k in keys)  # a failed store is no hit
    stats = s.stats()
    assert s.counters() == tuple(stats[n] for n in COUNTER_NAMES)
    assert stats["failed_jobs"] == 1 and stats["store_jobs"] == 1


# ---------------------------------------------------------------------- hybrid
def test_hybrid_full_sliding_window_mamba() -> None:
    groups = (FULL, GroupDesc("sliding_window", 6), GroupDesc("mamba"))
    sim = EngineSim(groups, block_size=4, block_size_factor=2, num_gpu_blocks=48,
                    num_cpu_blocks=16)  # fmt: skip
    prompt = list(range(26))
    sim.add_request("a", prompt)
    rec = sim.step()
    six = (0, 1, 2, 3, 4, 5)
    assert rec.stored == {"a": _positions(0, *six) | _positions(1, *six) | _positions(2, 1, 3, 5)}
    sim.add_request("b", prompt)
    rec = sim.step()
    assert rec.lookups["b"] == (0, 24)
    assert rec.loaded == {"b": _positions(0, *six) | _positions(1, 4, 5) | _positions(2, 5)}
    (load,) = rec.meta.load_jobs
    assert load.gpu.group_sizes == (6, 2, 1) and load.gpu.block_indices == (0, 4, 5)
    b = sim.requests["b"]
    assert b.table[1][:4] == [0, 0, 0, 0] and b.table[2][:5] == [0] * 5
    sim.drain()


# ---------------------------------------------------------------------- aborts
def test_abort_queued_request_after_alloc_cancels_its_load() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8)
    prompt = list(range(9))
    sim.add_request("a", prompt)
    sim.step()
    sim.add_request("b", prompt)
    rec = sim.begin_step()
    assert rec.lookups["b"] == (0, 8)
    keys = [sim.key_of("b", j) for j in range(2)]
    assert [sim.sched.pin_count(k) for k in keys] == [1, 1]
    assert sim.abort("b") is False  # the load was never handed out: nothing in flight
    assert [sim.sched.pin_count(k) for k in keys] == [0, 0]
    rec = sim.end_step()
    assert rec.meta.load_jobs == () and rec.loaded == {}
    assert sim.sched.stats()["num_requests"] == 0


def test_abort_running_request_with_store_in_flight() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, auto_complete=False)
    sim.add_request("a", list(range(9)), max_tokens=5)
    rec = sim.step()
    (store,) = rec.meta.store_jobs
    assert sim.abort("a") is True
    assert sim.requests["a"].status == "kept"
    out = sim.complete()
    assert out.finished_storing == ("a",) and sim.requests["a"].status == "done"
    assert sim.sched.block_state(store.keys[0]) == "ready"


def test_abort_request_with_load_in_flight_releases_it() -> None:
    """request_finished returns True while a load is in flight: the engine keeps the blocks
    until the request appears in finished_storing, so it must appear there."""
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, auto_complete=False)
    sim.add_request("x", list(range(9)))
    sim.step()
    sim.complete()
    sim.add_request("b", list(range(9)))
    rec = sim.step()
    assert rec.loaded == {"b": _positions(0, 0, 1)}
    in_flight = sim.abort("b")
    out = sim.complete()  # the harness fails if b's blocks are never released
    assert not in_flight or "b" in out.finished_storing


# ---------------------------------------------------------------------- async scheduling
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_scheduling_stores_only_hashed_tokens(async_scheduling: bool) -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8,
                    async_scheduling=async_scheduling)  # fmt: skip
    sim.add_request("a", list(range(6)), max_tokens=4)
    stored = [sim.step().stored for _ in range(4)]
    late = {"a": _positions(0, 1)}
    assert stored[0] == {"a": _positions(0, 0)}
    if async_scheduling:  # block 1 is full after step 3, its hash is known in step 4
        assert stored[1:] == [{}, {}, late]
    else:
        assert stored[1:] == [{}, late, {}]


# ---------------------------------------------------------------------- bad input
def test_bad_input_names_the_value_and_changes_nothing() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, auto_complete=False)
    prompt = list(range(9))
    sim.add_request("a", prompt)
    rec = sim.step()
    (store,) = rec.meta.store_jobs
    sim.add_request("b", [50 + i for i in range(9)], max_tokens=20)
    sim.step()
    s = sim.sched
    keys = [*store.keys, *(sim.key_of("b", j) for j in range(2))]
    rids = ["a", "b"]

    from kvoff.scheduler import Request, ScheduledRequest, SchedulerStep

    def unchanged(fn, match: str) -> None:
        before = snapshot(s, keys, rids)
        with pytest.raises(ValueError, match=match):
            fn()
        assert snapshot(s, keys, rids) == before

    unchanged(
        lambda: s.build_connector_meta(SchedulerStep((ScheduledRequest("ghost"),))), "'ghost'"
    )
    c = sim.requests["b"].req
    unchanged(lambda: s.update_state_after_alloc(c, [[1], [2]], 0), "2 KV cache groups")
    unchanged(lambda: s.update_state_after_alloc(c, [[999]], 0), "block id 999")
    unchanged(lambda: s.update_state_after_alloc(c, [[-3]], 0), "block id -3")
    sim.complete()
    d = Request("d", list(sim.requests["a"].req.block_hashes), 9)
    assert s.get_num_new_matched_tokens(d, 0) == (8, True)
    unchanged(lambda: s.update_state_after_alloc(d, [[5, 6, 7]], 4), "num_external_tokens 4")
    unchanged(lambda: s.update_state_after_alloc(d, [[5]], 8), "group 0 has 1 block ids")
    unchanged(lambda: s.update_connector_output([(12345, True)]), "job 12345")
    rec = sim.step()
    (store_c,) = rec.meta.store_jobs or (None,)
    if store_c is not None:
        jid = store_c.job_id
        unchanged(lambda: s.update_connector_output([(jid, True), (jid, True)]), "2 times")
    unchanged(lambda: s.get_num_new_matched_tokens(d, 3), "num_computed_tokens 3")
    # The hooks read a request's new hashes in place, in the same call: a bad new hash (or a
    # missing attribute) raises before the request is known, and a known one keeps its hashes.
    e = Request("e", [*sim.requests["a"].req.block_hashes[:1], b""], 9)
    unchanged(lambda: s.get_num_new_matched_tokens(e, 0), "empty")
    assert s._core.num_hashes("e") == 0 and "e" not in s._requests
    known = s._core.num_hashes("d")
    d_bad = Request("d", [*d.block_hashes, b""], 13)
    unchanged(lambda: s.update_state_after_alloc(d_bad, [], 0), "empty")
    assert s._core.num_hashes("d") == known

    class NoHashes:
        request_id = "f"
        num_tokens = 4

    with pytest.raises(TypeError, match=r"request must have .*no attribute .block_hashes"):
        s.get_num_new_matched_tokens(NoHashes(), 0)  # type: ignore[arg-type]
    assert s._core.num_hashes("f") == 0 and "f" not in s._requests
    unchanged(
        lambda: s.build_connector_meta(SchedulerStep((ScheduledRequest("b", ((1,), (2,))),))),
        "2 KV cache groups",
    )


# ---------------------------------------------------------------------- events
def test_events_block_stored_and_removed() -> None:
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=2, enable_events=True)
    sim.add_request("a", list(range(9)))
    rec = sim.step()
    stored = [e for e in rec.events if not e.removed]
    assert [list(e.keys) for e in stored] == [[sim.key_of("a", 0), sim.key_of("a", 1)]]
    assert all(e.medium == "CPU" for e in rec.events)
    sim.add_request("b", [70 + i for i in range(5)])
    rec = sim.step()
    removed = [k for e in rec.events if e.removed for k in e.keys]
    added = [k for e in rec.events if not e.removed for k in e.keys]
    assert added == [sim.key_of("b", 0)]
    assert removed == [sim.key_of("a", 1)]  # the tail of a's prefix is evicted first
    assert sim.sched.block_state(sim.key_of("a", 0)) == "ready"


# ---------------------------------------------------------------------- packed jobs
def test_packed_jobs_equal_the_tuple_jobs_and_counters_delta() -> None:
    """build_connector_meta_packed (what KvoffConnector ships to its workers) gives, after
    jobs_from_packed, exactly the jobs of build_connector_meta_tuples (keys aside) on the same
    hybrid steps: loads first, every group's sizes and indices, request ids; a bad packing is
    refused. counters_delta reports what moved since the tuple it was given."""
    from kvoff.scheduler import OffloadingScheduler, Request

    groups = (FULL, GroupDesc("sliding_window", 6), GroupDesc("mamba"))
    sims = [EngineSim(groups, block_size=4, block_size_factor=2, num_gpu_blocks=64,
                      num_cpu_blocks=16) for _ in range(2)]  # fmt: skip
    a, b = sims[0].sched, sims[1].sched
    seen = None
    delta, seen = b.counters_delta(seen)
    assert delta is None and seen is None  # nothing moved yet

    def hashes(tag: str, n: int) -> list[bytes]:
        return [f"{tag}{i}".encode() for i in range(n)]

    def both(*args: object) -> tuple:
        tuples = a.build_connector_meta_tuples(*args, with_keys=False)
        packed, ids, flush = b.build_connector_meta_packed(*args)
        loads, stores = OffloadingScheduler.jobs_from_packed(packed, ids)
        assert flush == tuples[2]
        job = OffloadingScheduler.job_from_tuple
        assert loads == tuple(map(job, tuples[0]))
        assert stores == tuple(map(job, tuples[1]))
        return loads, stores

    table = [list(range(1, 8)), list(range(11, 18)), list(range(21, 28))]
    for s in (a, b):
        s.get_num_new_matched_tokens(Request("x", hashes("x", 6), 26), 0)
        s.update_state_after_alloc(Request("x", hashes("x", 6), 26), table, 0)
    _, stores = both(["x"], [table], [0], {"x": 26})
    assert stores and all(j.request_id == "x" and j.direction == "store" for j in stores)
    assert sum(len(j.gpu.block_ids) for j in stores) > 0
    for s in (a, b):  # x finishes; y shares its first 24 tokens: a load of every group
        s.request_finished("x")
        s.update_connector_output([(j.job_id, True) for j in stores])
        y = Request("y", hashes("x", 6), 27)
        assert s.get_num_new_matched_tokens(y, 0) == (24, True)
        s.update_state_after_alloc(y, [list(range(31, 38)), list(range(41, 48)),
                                       list(range(51, 58))], 24)  # fmt: skip
    loads, stores = both([], [], [], {})
    assert len(loads) >= 1 and not stores
    assert loads[0].request_id == "y" and loads[0].gpu.group_sizes[2] == 1
    delta, seen = b.counters_delta(seen)
    assert delta is not None and delta["load_jobs"] == len(loads) and delta["lookups"] == 2
    assert seen == b.counters()
    assert b.counters_delta(seen) == (None, seen)
    with pytest.raises(TypeError, match="counters"):
        b.counters_delta((1, 2))
    packed, _, _ = b.build_connector_meta_packed([], [], [], {})
    with pytest.raises(ValueError, match="request ids"):
        OffloadingScheduler.jobs_from_packed(packed, ("extra",))
    with pytest.raises(ValueError, match="int64"):
        OffloadingScheduler.jobs_from_packed(b"\0" * 12, ())


def test_scheduled_token_counts_are_read_by_request_whatever_the_dict_order() -> None:
    """The binding reads ``num_scheduled_tokens`` in the dict's own order (vLLM's scheduling
    order), comparing keys by identity, and looks a request up where that order differs. The
    same step gives the same jobs with the dict in the ids' order, reversed, shuffled with
    holes and other requests' entries, keyed by equal but distinct str objects, or without a
    request's entry (0 tokens: nothing stored for it); each request's count shows in its
    stores, so a count read for the wrong request changes the jobs."""
    import random

    from kvoff.scheduler import OffloadingScheduler, Request

    ids = [f"req-{i}" for i in range(6)]
    counts = [4, 8, 12, 16, 20, 24]  # offloaded blocks full after the step: 1..6

    def step(
        scheduled: dict[str, int] | list[int],
        order: list[str],
        split: int | None = None,
        bad_tail: object = None,
    ) -> tuple:
        """The step's (request, stored blocks) pairs; ``split``: the requests from that
        position on go in ``tail`` (as vLLM's new requests do); ``bad_tail``: a call with it
        must be refused first, changing nothing."""
        sim = EngineSim((FULL,), block_size=4, num_gpu_blocks=64, num_cpu_blocks=64)
        s = sim.sched
        tables = {}
        for k, rid in enumerate(order):
            req = Request(rid, [f"{rid}/{j}".encode() for j in range(6)], 24)
            assert s.get_num_new_matched_tokens(req, 0) == (0, False)
            tables[rid] = [list(range(1 + 6 * k, 7 + 6 * k))]
            s.update_state_after_alloc(req, tables[rid], 0)
        columns = (list(order), [tables[r] for r in order], [0] * len(order))
        if bad_tail is not None:
            with pytest.raises((TypeError, ValueError), match="tail"):
                s.build_connector_meta_packed(*columns, scheduled, tail=bad_tail)
        tail = None
        if split is not None:
            tail = tuple(c[split:] for c in columns)
            columns = tuple(c[:split] for c in columns)
        packed, job_ids, _ = s.build_connector_meta_packed(*columns, scheduled, tail=tail)
        _, stores = OffloadingScheduler.jobs_from_packed(packed, job_ids)
        return tuple(sorted((j.request_id, len(j.gpu.block_ids)) for j in stores))

    expected = step(dict(zip(ids, counts, strict=True)), ids)
    assert expected == tuple((rid, n // 4) for rid, n in zip(ids, counts, strict=True))
    assert step(dict(reversed(list(zip(ids, counts, strict=True)))), ids) == expected
    rng = random.Random(7)
    shuffled = [*zip(ids, counts, strict=True), ("other-a", 4), ("other-b", 8)]
    rng.shuffle(shuffled)
    holed = dict([("gone", 1), *shuffled])
    del holed["gone"]  # a deleted entry the in-order walk must step over
    assert step(holed, ids) == expected
    copies = {"".join(list(rid)): n for rid, n in zip(ids, counts, strict=True)}
    assert all(a is not b for a, b in zip(copies, ids, strict=True))  # distinct objects
    assert step(copies, ids) == expected
    missing = dict(zip(ids, counts, strict=True))
    del missing["req-3"]
    assert step(missing, ids) == tuple(x for x in expected if x[0] != "req-3")
    # the requests split into columns and a tail (vLLM's running and new requests) read as
    # one: the same jobs at every split, with the counts as a dict or as one sequence
    for split in range(len(ids) + 1):
        assert step(dict(zip(ids, counts, strict=True)), ids, split) == expected
        assert step(list(counts), ids, split) == expected
    # a bad tail is refused, naming it, and changes nothing (the next call stores as usual)
    for bad in ([ids[3:], [None] * 3, [0] * 3], (ids[3:], [None] * 3), (ids[3:], [None], [0])):
        assert step(dict(zip(ids, counts, strict=True)), ids, 3, bad_tail=bad) == expected


def test_an_alloc_of_nothing_after_a_no_hit_lookup_is_skipped_and_changes_nothing() -> None:
    """After get_num_new_matched_tokens answered 0, update_state_after_alloc(request, (), 0)
    returns without a core call; the steps that follow (fences of the engine's own cached
    blocks included) are those of a scheduler that made the call."""
    from kvoff.scheduler import Request

    skipped = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8).sched
    called = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8).sched
    metas = []
    for s in (skipped, called):
        a = Request("A", [b"a0", b"a1"], 8)
        assert s.get_num_new_matched_tokens(a, 0) == (0, False)
        s.update_state_after_alloc(a, (), 0)
        s.build_connector_meta_columns(["A"], [[[5, 6]]], [0], [8])  # A's store in flight
        # C has A's two blocks from the engine's own prefix cache: they must not be fenced
        c = Request("C", [b"a0", b"a1", b"c2"], 13)
        assert s.get_num_new_matched_tokens(c, 8) == (0, False)
        if s is skipped:
            assert s._settled.get("C") is c
            s.update_state_after_alloc(c, (), 0)
            assert "C" not in s._settled  # taken by the skipped call
        else:
            s._core.sync_and_alloc(c, (), 0, s._requests)  # what the call did before
        m = s.build_connector_meta_columns(["A", "C"], [None, [[5, 6, 8]]], [8, 8], [1, 5])
        metas.append((m.jobs_to_flush, [(j.request_id, j.gpu.block_ids) for j in m.store_jobs]))
        assert m.jobs_to_flush == ()
    assert metas[0] == metas[1]
    assert snapshot(skipped, [], ["A", "C"]) == snapshot(called, [], ["A", "C"])
    # another object under a settled id is not skipped: the call syncs its hashes
    s = skipped
    d = Request("D", [b"d0"], 5)
    assert s.get_num_new_matched_tokens(d, 0) == (0, False)
    d2 = Request("D", [b"d0", b"d1"], 9)
    s.update_state_after_alloc(d2, (), 0)
    assert s._core.num_hashes("D") == 2
    assert "D" not in s._settled
    assert s.get_num_new_matched_tokens(d2, 0) == (0, False)
    with pytest.raises(TypeError, match="num_external_tokens must be an int"):
        s.update_state_after_alloc(d2, (), 0.0)  # type: ignore[arg-type]
    s.request_finished(d)
    assert "D" not in s._settled


# ---------------------------------------------------------------------- store batching
def _stores_of(sim: EngineSim, rid: str, until_done: bool = True) -> list[set[tuple[int, int]]]:
    """Steps until ``rid`` is done; the positions each of its store jobs covered, in order."""
    stores = []
    for _ in range(100):
        rec = sim.step()
        stores += [set(rec.stored[rid])] if rid in rec.stored else []
        if sim.requests[rid].status == "done":
            return stores
    raise AssertionError(f"{rid} did not finish")


def test_store_batching_stores_decode_in_batches_and_the_rest_after_finish() -> None:
    """3-block batches: the prompt's 2 blocks wait for decode to fill a third, the next 2
    blocks are stored after the request finished (its blocks kept until then), and a request
    with the same tokens loads all 5, byte for byte."""
    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=32, store_batch_blocks=3)
    assert sim.sched.store_batch_blocks == 3
    output = [500 + i for i in range(12)]
    sim.add_request("a", list(range(9)), max_tokens=12, output=output)  # 20 tokens computed
    assert _stores_of(sim, "a") == [_positions(0, 0, 1, 2), _positions(0, 3, 4)]
    stats = sim.sched.stats()
    assert stats["store_jobs"] == 2 and stats["blocks_stored"] == 5
    assert stats["stale_blocks_skipped"] == 0 and stats["num_requests"] == 0
    # the same 20 tokens and one more: all 5 blocks come from the pool (the harness checks the
    # loaded bytes against the pattern of each position)
    sim.add_request("b", [*range(9), *output[:11], 7])
    rec = sim.step()
    assert rec.lookups["b"] == (0, 20)
    assert rec.loaded == {"b": _positions(0, 0, 1, 2, 3, 4)}
    sim.drain()


def test_store_batching_does_not_copy_blocks_reused_before_the_store_at_finish() -> None:
    """The engine frees a finished request's blocks at once (``free_early``, as vLLM does when
    a connector does not ask to keep them) and a new request takes every free block in the
    next step: the store due at the finish finds its blocks reallocated and copies none of
    them (the harness fails on a copy of overwritten bytes)."""
    sim = EngineSim(block_size=4, num_gpu_blocks=7, num_cpu_blocks=32, store_batch_blocks=4,
                    free_early=True)  # fmt: skip
    sim.add_request("a", list(range(9)), max_tokens=4)  # 12 tokens computed: 3 blocks wait
    assert _stores_of(sim, "a") == []
    sim.add_request("c", [900 + i for i in range(24)])  # needs all 6 usable GPU blocks
    rec = sim.step()
    assert "a" not in rec.stored
    stats = sim.sched.stats()
    assert stats["stale_blocks_skipped"] >= 3
    assert all(sim.sched.block_state(sim.key_of("a", j)) == "missing" for j in range(3))
    sim.drain()


def test_store_batching_is_off_for_models_with_a_sliding_window_group() -> None:
    """A sliding-window block can leave the window, and be freed, while it waits: such models
    store every block in the step it fills, whatever store_batch_blocks says."""
    sim = EngineSim((FULL, GroupDesc("sliding_window", 6)), block_size=4, num_gpu_blocks=32,
                    num_cpu_blocks=32, store_batch_blocks=4)  # fmt: skip
    assert sim.sched.store_batch_blocks == 1
    sim.add_request("a", list(range(9)), max_tokens=4)
    rec = sim.step()
    assert rec.stored == {"a": _positions(0, 0, 1) | _positions(1, 0, 1)}
    sim.drain()


def test_store_batching_with_preemption_and_async_scheduling() -> None:
    """Requests decode in 2-block batches, one is preempted with a block waiting and resumes;
    every request's blocks end up stored once and a second round of the same prompts loads
    them all, byte for byte."""
    sim = EngineSim(block_size=4, num_gpu_blocks=24, num_cpu_blocks=64, store_batch_blocks=2,
                    async_scheduling=True)  # fmt: skip
    prompts = {rid: [100 * k + i for i in range(10)] for k, rid in enumerate("abc", start=1)}
    outputs = {rid: [1000 * k + i for i in range(9)] for k, rid in enumerate("abc", start=1)}
    for rid in "abc":
        sim.add_request(rid, prompts[rid], max_tokens=9, output=outputs[rid])
    sim.step()
    sim.step()
    sim.preempt("b")
    sim.drain()
    assert sim.sched.stats()["num_requests"] == 0
    for rid in "abc":  # 18 tokens computed: blocks 0..3 full
        for j in range(4):
            assert sim.sched.block_state(sim.key_of(rid, j)) == "ready", (rid, j)
    for rid in "abc":
        sim.add_request(rid + "2", [*prompts[rid], *outputs[rid][:8], 5])
    rec = sim.step()
    assert {rid: rec.lookups[rid + "2"] for rid in "abc"} == dict.fromkeys("abc", (0, 16))
    sim.drain()


def test_store_batching_bad_values_and_a_finish_whose_hashes_cannot_be_read() -> None:
    """store_batch_blocks out of range or not an int is refused naming it; a finishing request
    whose block_hashes cannot be read still finishes, storing the blocks whose hashes are known,
    and the scheduler stays usable."""
    from kvoff import FinishState, OffloadingScheduler

    sim = EngineSim(block_size=4, num_gpu_blocks=32, num_cpu_blocks=32, store_batch_blocks=4)
    for bad in (0, -2, (1 << 20) + 1, True, 2.0, "4"):
        with pytest.raises(ValueError, match=rf"store_batch_blocks={bad!r}"):
            OffloadingScheduler(sim.spec, store_batch_blocks=bad)
    sim.add_request("a", list(range(9)), max_tokens=8)  # 2 prompt blocks wait (fewer than 4)
    sim.step()
    assert sim.sched.stats()["store_jobs"] == 0
    req = sim.requests["a"].req
    good = list(req.block_hashes)
    req.block_hashes = [*good, "not bytes"]  # a hash the binding refuses
    state = sim.sched.request_finished_state(req)
    assert state == FinishState(jobs_in_flight=False, store_due=True)
    meta = sim.sched.build_connector_meta(_step_finishing_a())
    (job,) = meta.store_jobs
    assert job.keys == (sim.key_of("a", 0), sim.key_of("a", 1))
    assert sim.sched.request_finished_state("a") == FinishState(True, False)  # its store runs
    out = sim.sched.update_connector_output([(job.job_id, True)])
    assert out.finished_storing == ("a",)
    assert sim.sched.request_finished_state("a") == FinishState(False, False)  # forgotten
    assert sim.sched.block_state(sim.key_of("a", 1)) == "ready"


def _step_finishing_a():  # an engine step with nothing scheduled, "a" listed as finished
    from kvoff import SchedulerStep

    return SchedulerStep(scheduled=[], finished_request_ids=["a"], preempted_request_ids=[])
