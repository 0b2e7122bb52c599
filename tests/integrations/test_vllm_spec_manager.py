"""KvoffOffloadingManager as a drop-in for vLLM 0.32's CPUOffloadingManager (issue 53): recency
at ``on_request_finished`` in prefix order across KV cache groups, vLLM's CPU metrics, the
admission filter, a pool of 0 blocks. Side by side with vLLM's own manager where the two must
agree (tests/integrations/test_vllm_upstream.py runs vLLM's own tests on it besides)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm


def _key(i: int, group: int = 0) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(str(i).encode(), group)


def _ctx(name: str) -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(req_id=name)


def _managers(num_blocks: int, policy: str = "lru") -> tuple[Any, Any]:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvoff.integrations.vllm import KvoffOffloadingManager

    return (
        CPUOffloadingManager(num_chunks=num_blocks, cache_policy=policy),
        KvoffOffloadingManager(num_blocks, policy, False),
    )


def _serve(m: Any, name: str, keys: list[bytes]) -> int:
    """One request as vLLM's scheduler drives the manager: its leading hits are loaded, the rest
    stored, and it finishes; returns its hits."""
    from vllm.v1.kv_offload.base import LookupResult

    ctx = _ctx(name)
    for pos, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (pos + 1))
    hits = 0
    while hits < len(keys) and m.lookup(keys[hits], ctx) is LookupResult.HIT:
        hits += 1
    if hits:
        m.prepare_load(keys[:hits], ctx)
        m.complete_load(keys[:hits], ctx)
    out = m.prepare_store(keys[hits:], ctx) if hits < len(keys) else None
    if out is not None and out.keys_to_store:
        m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    return hits


def test_a_reused_block_becomes_recent_again() -> None:
    """The issue's reproduction: vLLM's scheduler never calls touch(), so recency reaches the
    manager only at on_request_finished. Fails if a reuse did not make block 1 recent (it would
    be evicted, FIFO, instead of block 2)."""
    for m in _managers(2):
        for i in (1, 2):
            _serve(m, f"s{i}", [_key(i)])
        assert _serve(m, "reuse", [_key(1)]) == 1
        out = m.prepare_store([_key(3)], _ctx("n"))
        assert out.evicted_keys == [_key(2)], type(m).__name__


def test_tails_of_every_group_go_before_any_head() -> None:
    """Hybrid models: a request's keys are ordered by token position across KV cache groups
    (vLLM's test_request_key_positions_order_tails_across_kv_groups, kvoff's invariant 8).
    Fails if the keys kept their group-by-group order (group 1's head would go first)."""
    from vllm.v1.kv_offload.base import make_offload_key

    g0h, g0t, g1h, g1t = (make_offload_key(n, g) for n, g in
                          ((b"h", 0), (b"t", 0), (b"h", 1), (b"t", 1)))  # fmt: skip
    for m in _managers(4):
        ctx = _ctx("hybrid")
        for k, pos in ((g0h, 16), (g1h, 16), (g0t, 32), (g1t, 32)):
            ctx.set_offload_key_position(k, pos)
        m.prepare_store([g0h, g0t, g1h, g1t], ctx)
        m.complete_store([g0h, g0t, g1h, g1t], ctx)
        m.on_request_finished(ctx)
        out = m.prepare_store([_key(10), _key(11)], _ctx("evict"))
        assert set(out.evicted_keys) == {g0t, g1t}, type(m).__name__


def test_only_blocks_a_request_reused_count_as_a_reuse() -> None:
    """A request's own stores are ordered at its finish, not counted as a reuse; blocks another
    request stored, which it loaded, are: under ARC, which evicts blocks seen once (T1) before
    reused ones (T2), the reused block outlives the others. Fails if the finish touched its own
    stores as reuses (block 2 would be in T2 too and outlive block 3's eviction order) or
    counted no reuse at all (block 1 would go first)."""
    from kvoff.integrations.vllm import KvoffOffloadingManager

    m = KvoffOffloadingManager(3, "arc", False)
    _serve(m, "seed", [_key(1)])  # "seen": stored by seed
    _serve(m, "user", [_key(1), _key(2)])  # loads 1 (a reuse), stores 2 (its own)
    _serve(m, "filler", [_key(3)])
    for i in (4, 5):  # two more blocks: the once-seen ones go first
        _serve(m, f"n{i}", [_key(i)])
    lookups = {i: m.manager.lookup([_key(i)]) for i in (1, 2, 3)}
    assert lookups == {1: 1, 2: 0, 3: 0}, lookups


def test_a_reset_drops_the_records_of_requests_before_it() -> None:
    """A request's accesses recorded before reset_cache are not applied after it (its blocks
    are gone; the keys it had may be stored again by others)."""
    from kvoff.integrations.vllm import KvoffOffloadingManager

    m = KvoffOffloadingManager(2, "lru", False)
    old = _ctx("old")
    m.prepare_store([_key(1)], old)
    m.complete_store([_key(1)], old)
    m.reset_cache()
    _serve(m, "a", [_key(1)])  # stored again after the reset
    _serve(m, "b", [_key(2)])
    m.on_request_finished(old)  # must not make key 1 recent again
    assert m.prepare_store([_key(3)], _ctx("c")).evicted_keys == [_key(1)]


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 8),
    requests=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=5, unique=True),
                      min_size=1, max_size=30),
)  # fmt: skip
def test_hits_and_evictions_match_vllms_lru_request_by_request(
    num_blocks: int, requests: list[list[int]]
) -> None:
    """Requests served one after another (each finishes before the next starts), as vLLM's
    scheduler calls the managers: kvoff's LRU finds the same hits and keeps the same blocks as
    vLLM's LRU. (Which CPU slot a block gets, and the order inside one unfinished request, are
    where the two differ: docs/vllm.md.)"""
    vllm_m, kvoff_m = _managers(num_blocks)
    for n, ids in enumerate(requests):
        keys = [_key(i) for i in ids]
        assert _serve(vllm_m, f"r{n}", keys) == _serve(kvoff_m, f"r{n}", keys), n
        held_v = {i for i in range(12) if vllm_m.lookup(_key(i), _ctx("q")).name == "HIT"}
        held_k = {i for i in range(12) if kvoff_m.lookup(_key(i), _ctx("q")).name == "HIT"}
        assert held_v == held_k, n


def test_vllms_cpu_metrics_are_reported_every_step() -> None:
    """get_stats: vLLM's usage gauges (pinned by transfers, stores' and loads' shares) and the
    allocation-size histogram, by vLLM's names; the same figures vLLM's manager gives."""
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M

    for m in _managers(4):
        ctx = _ctx("a")
        m.prepare_store([_key(1), _key(2)], ctx)
        data = m.get_stats().reduce()
        assert data[M.CPU_CACHE_USAGE_PERC] == data[M.CPU_CACHE_WRITE_USAGE_PERC] == 0.5
        assert data[f"{M.CPU_ALLOCATION_SIZE}_count"] == 1
        assert data[f"{M.CPU_ALLOCATION_SIZE}_sum"] == 2
        m.complete_store([_key(1), _key(2)], ctx)
        m.prepare_load([_key(1)], ctx)
        data = m.get_stats().reduce()
        assert data[M.CPU_CACHE_USAGE_PERC] == data[M.CPU_CACHE_READ_USAGE_PERC] == 0.25
        assert data[M.CPU_CACHE_WRITE_USAGE_PERC] == 0.0
        assert f"{M.CPU_ALLOCATION_SIZE}_count" not in data  # taken by the last call


def test_store_threshold_holds_back_blocks_offered_once() -> None:
    """vLLM's admission filter, from its CPU-spec keys: a block is stored on its second offer;
    skipped stores reach vLLM's counter."""
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M

    from kvoff.integrations.vllm import KvoffOffloadingManager

    m = KvoffOffloadingManager(4, "lru", False, store_threshold=2, max_tracker_size=10)
    assert m.prepare_store([_key(1), _key(2)], _ctx("a")).keys_to_store == []
    assert m.prepare_store([_key(1), _key(2)], _ctx("b")).keys_to_store == [_key(1), _key(2)]
    assert m.get_stats().reduce()[M.STORES_SKIPPED] == 2


def test_a_pool_of_no_blocks_holds_nothing_and_reports_zero_usage() -> None:
    """vLLM sizes the pool at 0 blocks when the workers' KV bytes per block are 0: the manager
    answers misses, refuses stores, and reports a usage of 0."""
    from vllm.v1.kv_offload.base import LookupResult, Medium
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M

    from kvoff.integrations.vllm import KvoffOffloadingManager

    m = KvoffOffloadingManager(0, "lru", False)
    assert m.medium == Medium.CPU
    assert m.lookup(_key(1), _ctx("a")) is LookupResult.MISS
    assert m.prepare_store([_key(1)], _ctx("a")) is None
    assert m.prepare_store([], _ctx("a")).keys_to_store == []
    assert m.get_stats().reduce()[M.CPU_CACHE_USAGE_PERC] == 0.0
    with pytest.raises(ValueError, match="0 blocks"):
        m.prepare_load([_key(1)], _ctx("a"))
    with pytest.raises(ValueError, match="-1 offloaded blocks"):
        KvoffOffloadingManager(-1, "lru", False)


def test_cpu_side_of_a_job_is_vllms_cpu_spec_type() -> None:
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvoff.integrations.vllm import KvoffOffloadingManager

    m = KvoffOffloadingManager(4, "lru", False)
    spec = m.prepare_store([_key(1), _key(2)], _ctx("a")).store_spec
    assert isinstance(spec, CPULoadStoreSpec)
    assert list(spec.chunk_ids) == list(spec.block_ids) and len(spec.block_ids) == 2
