"""CPUOffloadingManager from Python: docs/design.md invariants 6, 7 and 8 (under the LRU, ARC and
probation eviction policies), keys and events. The hypothesis state machines that compare the
manager with a model of it are in test_manager_model.py."""

from __future__ import annotations

import pytest

from kvoff import CPUOffloadingManager, OffloadingEvent, PrepareStoreOutput


def store(m: CPUOffloadingManager, keys: list) -> PrepareStoreOutput:
    """prepare_store + complete_store(success=True); asserts the store was accepted."""
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.keys_to_store)
    return out


_fresh = iter(range(10**9, 2 * 10**9))


def drain(m: CPUOffloadingManager, n: int) -> list[bytes]:
    """Evicts n blocks one at a time (by storing fresh keys); returns the eviction order."""
    order = []
    for _ in range(n):
        key = next(_fresh)
        out = m.prepare_store([key])
        assert out is not None, "prepare_store refused while draining"
        assert len(out.evicted_keys) == 1
        order += out.evicted_keys
        m.complete_store([key])
    return order


def snapshot(m: CPUOffloadingManager, keys: list) -> tuple:
    """Everything observable about the pool and `keys`, to compare before/after a call."""
    return (
        m.num_free_blocks,
        m.num_stored_blocks,
        m.num_pending_blocks,
        len(m),
        [m.lookup([k]) for k in keys],
        [k in m for k in keys],
    )


# ---------------------------------------------------------------------------------- basics


def test_construction_and_properties():
    m = CPUOffloadingManager(8)
    assert (m.num_blocks, m.num_free_blocks, m.num_stored_blocks, m.num_pending_blocks) == (
        8,
        8,
        0,
        0,
    )
    assert m.eviction_policy == "lru"
    assert m.enable_events is False
    assert len(m) == 0
    assert "num_blocks=8" in repr(m)
    assert "lru" in repr(m)
    with pytest.raises(AttributeError):
        m.num_blocks = 3
    m2 = CPUOffloadingManager(num_blocks=3, eviction_policy="lru", enable_events=True)
    assert m2.enable_events is True


@pytest.mark.parametrize("bad", [0, -1, 2**31, 2**70])
def test_num_blocks_out_of_range_names_the_value(bad):
    # invariant 7: bad input is rejected with an error naming the value.
    with pytest.raises(ValueError, match=str(bad)):
        CPUOffloadingManager(bad)


def test_num_blocks_must_be_int():
    with pytest.raises(TypeError, match="float"):
        CPUOffloadingManager(4.0)


def test_unknown_policy_lists_choices():
    # invariant 7: an unknown policy names the value and the choices.
    with pytest.raises(ValueError, match=r"'arc-typo'.*'lru'"):
        CPUOffloadingManager(4, eviction_policy="arc-typo")


def test_eviction_policies_registry():
    from kvoff import _scheduler

    assert _scheduler.eviction_policies() == ["lru", "arc", "probation"]


def test_unknown_policy_lists_every_policy():
    # invariant 7: the core's error and the configuration's both list every registered policy.
    import pydantic

    from kvoff.config import EVICTION_POLICIES, OffloadingConfig

    assert EVICTION_POLICIES == ("lru", "arc", "probation")
    with pytest.raises(ValueError, match=r"'nope'; choose one of: 'lru', 'arc', 'probation'"):
        CPUOffloadingManager(4, eviction_policy="nope")
    with pytest.raises(pydantic.ValidationError, match=r"'nope'.*'lru', 'arc', 'probation'"):
        OffloadingConfig(num_cpu_blocks=4, eviction_policy="nope")
    for name in ("arc", "probation"):
        m = CPUOffloadingManager(4, eviction_policy=name)
        assert m.eviction_policy == name
        assert name in repr(m)


def test_docstrings_give_signatures():
    assert CPUOffloadingManager.lookup.__doc__.startswith(
        "lookup(self, keys: Sequence[bytes | int]) -> int | None"
    )
    assert "PrepareStoreOutput | None" in CPUOffloadingManager.prepare_store.__doc__
    assert "ValueError" in CPUOffloadingManager.prepare_load.__doc__
    assert "num_blocks (int)" in CPUOffloadingManager.__doc__


def test_lookup_counts_leading_ready_keys():
    m = CPUOffloadingManager(8)
    store(m, [b"a", b"b", b"c"])
    assert m.lookup([b"a", b"b", b"c"]) == 3
    assert m.lookup([b"a", b"x", b"c"]) == 1  # stops at the first missing key
    assert m.lookup([b"x", b"a"]) == 0
    assert m.lookup([]) == 0


def test_lookup_of_pending_key_is_retry_later():
    m = CPUOffloadingManager(8)
    store(m, [b"a"])
    assert m.prepare_store([b"b"]) is not None
    assert m.lookup([b"a", b"b"]) is None
    assert m.lookup([b"a", b"x", b"b"]) == 1  # the pending key lies after the first miss


def test_block_ids_and_prepare_load():
    m = CPUOffloadingManager(4)
    out = m.prepare_store([b"a", b"b", b"c", b"d"])
    assert out == PrepareStoreOutput([b"a", b"b", b"c", b"d"], [0, 1, 2, 3], [])
    key = b"e" * 40
    assert m.prepare_store([key, b"a"]) is None  # pool full of pending blocks
    m.complete_store(out.keys_to_store[2:])
    assert m.prepare_store([b"a", key]).keys_to_store[0] is key  # the caller's bytes object
    assert "keys_to_store=" in repr(out)
    m.complete_store([*out.keys_to_store[:2], key])
    assert m.prepare_load([b"b", b"a"]) == [1, 0]
    m.complete_load([b"a", b"b"])


# ---------------------------------------------------------------------------------- invariant 6


def test_hit_only_after_successful_complete_store():
    # invariant 6: a block is a lookup hit only after complete_store(success=True). Fails if
    # prepare_store made blocks ready, or complete_store(success=False) did.
    m = CPUOffloadingManager(4)
    m.prepare_store([b"a", b"b"])
    assert m.lookup([b"a"]) is None
    assert b"a" in m
    with pytest.raises(ValueError, match="pending"):
        m.prepare_load([b"a"])
    m.complete_store([b"a"])
    assert m.lookup([b"a", b"b"]) is None
    m.complete_store([b"b"], success=False)
    assert m.lookup([b"a", b"b"]) == 1
    assert m.num_stored_blocks == 1


def test_failed_store_frees_its_slots():
    # invariant 6: a failed store frees its slots (fails if the slots leaked or stayed pending).
    m = CPUOffloadingManager(2, enable_events=True)
    m.prepare_store([b"a", b"b"])
    assert m.num_free_blocks == 0
    m.complete_store([b"a", b"b"], success=False)
    assert m.num_free_blocks == 2
    assert m.num_pending_blocks == 0
    assert b"a" not in m
    assert m.lookup([b"a"]) == 0
    assert m.take_events() == []  # never announced
    out = m.prepare_store([b"c", b"d"])
    assert out is not None
    assert out.evicted_keys == []


def test_prepare_store_is_all_or_nothing():
    # invariant 6: None changes no state: free count, lookups, events and recency order. Fails
    # if prepare_store evicted what it could before finding it could not fit everything.
    m = CPUOffloadingManager(4, enable_events=True)
    for k in [b"d", b"c", b"b", b"a"]:
        store(m, [k])  # eviction order: d c b a
    m.prepare_load([b"a"])  # pinned
    m.take_events()
    keys = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"]
    before = snapshot(m, keys)
    # Needs 4 slots; 0 free and only 3 evictable (a is pinned).
    assert m.prepare_store([b"e", b"f", b"g", b"h"]) is None
    assert snapshot(m, keys) == before
    assert m.take_events() == []
    assert drain(m, 3) == [b"d", b"c", b"b"]  # order unchanged


def test_prepare_store_refuses_when_only_protected_or_pending_blocks_remain():
    # invariant 6: pending blocks and keys of the call are not eviction candidates.
    m = CPUOffloadingManager(3)
    store(m, [b"a", b"b"])
    m.prepare_store([b"p"])
    keys = [b"a", b"b", b"p", b"x"]
    before = snapshot(m, keys)
    assert m.prepare_store([b"a", b"b", b"x"]) is None
    assert m.prepare_store([b"x", b"y", b"z"]) is None
    assert snapshot(m, keys) == before


def test_keys_of_one_call_are_not_evicted_for_each_other():
    # invariant 6: fails if the LRU block `a` is evicted although it is a key of the call.
    m = CPUOffloadingManager(3)
    for k in [b"a", b"b", b"c"]:
        store(m, [k])  # eviction order: a b c
    out = m.prepare_store([b"a", b"d"])
    assert out.keys_to_store == [b"d"]
    assert out.evicted_keys == [b"b"]
    assert m.lookup([b"a"]) == 1


def test_blocks_being_loaded_are_not_evicted_until_complete_load():
    # invariant 6: fails if a pinned block can be evicted.
    m = CPUOffloadingManager(2)
    store(m, [b"a"])
    store(m, [b"b"])  # eviction order: a b
    assert m.prepare_load([b"a"]) == [0]
    assert m.prepare_store([b"c"]).evicted_keys == [b"b"]
    assert m.prepare_store([b"d"]) is None  # a pinned, c pending
    m.complete_store([b"c"])
    m.complete_load([b"a"])
    assert m.prepare_store([b"d"]).evicted_keys == [b"a"]


def test_duplicate_keys_need_one_slot():
    m = CPUOffloadingManager(2)
    out = m.prepare_store([b"a", 7, b"a", 7])  # would need 4 slots without deduplication
    assert out.keys_to_store == [b"a", (7).to_bytes(8, "little")]
    m.complete_store([b"a", 7, 7])
    assert m.num_stored_blocks == 2


# ---------------------------------------------------------------------------------- invariant 8


def test_touch_last_to_first_evicts_tail_first():
    # invariant 8: after touch([a, b, c]) with equal prior recency, eviction goes c, b, a. Fails
    # if touch processes keys first to last (then a would be evicted first).
    m = CPUOffloadingManager(3)
    store(m, [b"c", b"b", b"a"])  # eviction order before touch: a b c
    m.touch([b"a", b"b", b"c"])
    assert drain(m, 3) == [b"c", b"b", b"a"]


def test_prepare_store_makes_first_key_most_recent():
    # invariant 8: a stored prefix is evicted tail first.
    m = CPUOffloadingManager(3)
    store(m, [b"a", b"b", b"c"])
    assert drain(m, 3) == [b"c", b"b", b"a"]


def test_touch_ignores_unknown_keys():
    m = CPUOffloadingManager(3)
    for k in [b"a", b"b", b"c"]:
        store(m, [k])
    m.touch([b"zz", b"a", b"yy"])
    assert drain(m, 3) == [b"b", b"c", b"a"]


# ---------------------------------------------------------------------------------- ARC
# Invariants 6 and 8 under eviction_policy="arc". ARC keeps blocks seen once (T1) apart from
# blocks seen at least twice (T2) and evicts from T1 while |T1| exceeds its adaptive target p
# (0 until a ghost hit). Eviction order is read from one prepare_store of several fresh keys:
# drain() would put fresh keys into T1 between evictions.


def arc(num_blocks: int, enable_events: bool = False) -> CPUOffloadingManager:
    return CPUOffloadingManager(num_blocks, eviction_policy="arc", enable_events=enable_events)


def evict_order(m: CPUOffloadingManager, n: int) -> list[bytes]:
    """Stores n fresh keys in one call, which must evict exactly n blocks; returns them."""
    keys = [next(_fresh) for _ in range(n)]
    out = m.prepare_store(keys)
    assert out is not None
    assert len(out.evicted_keys) == n
    m.complete_store(keys)
    return out.evicted_keys


def test_arc_prepare_store_is_all_or_nothing():
    # invariant 6: a refused prepare_store changes nothing, neither the pool nor ARC's lists and
    # ghosts. Fails if it evicted c and d before finding that it could not fit four keys: then
    # the later call would evict different blocks (and c, d would be ghosts).
    m = arc(4, enable_events=True)
    for k in [b"d", b"c", b"b", b"a"]:
        store(m, [k])  # T1 (least recent first): d c b a
    m.touch([b"b"])  # T2: b
    m.prepare_load([b"a"])  # pinned
    m.take_events()
    keys = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"]
    before = snapshot(m, keys)
    assert m.prepare_store([b"e", b"f", b"g", b"h"]) is None  # 3 evictable < 4
    assert snapshot(m, keys) == before
    assert m.take_events() == []
    # |T1| = 3 > p = 0: d, c; then a (T1) is pinned, so T2's b.
    assert evict_order(m, 3) == [b"d", b"c", b"b"]


def test_arc_keys_of_one_call_are_not_evicted_for_each_other():
    # invariant 6: fails if T1's least recent block a is evicted although it is a key of the
    # call, or if the T2 block is taken while T1 still has an evictable block.
    m = arc(3)
    for k in [b"a", b"b", b"c"]:
        store(m, [k])  # T1: a b c
    m.touch([b"c"])  # T2: c
    out = m.prepare_store([b"a", b"d"])
    assert out.keys_to_store == [b"d"]
    assert out.evicted_keys == [b"b"]
    assert m.lookup([b"a", b"c"]) == 2


def test_arc_pinned_and_pending_blocks_are_not_evicted():
    # invariant 6: fails if a pinned (being loaded) or pending block can be evicted under ARC:
    # in each case the block that must survive is the least recent of T1.
    m = arc(3)
    store(m, [b"a"])
    store(m, [b"b"])  # T1: a b
    assert m.prepare_store([b"p"]) is not None  # pending; T1: a b p
    assert m.prepare_load([b"a"]) == [0]
    assert m.prepare_store([b"x"]).evicted_keys == [b"b"]  # a is least recent but pinned
    assert m.prepare_store([b"y"]) is None  # a pinned; p and x pending
    assert m.lookup([b"a"]) == 1
    m.complete_load([b"a"])
    assert m.prepare_store([b"y"]).evicted_keys == [b"a"]
    m.complete_store([b"p"], success=False)  # frees p's slot, leaves no ghost
    assert m.prepare_store([b"z"]).evicted_keys == []

    m = arc(2)
    assert m.prepare_store([b"p"]) is not None  # pending; T1: p
    store(m, [b"a"])  # T1: p a
    assert m.prepare_store([b"x"]).evicted_keys == [b"a"]  # p is least recent but pending
    assert b"p" in m
    assert m.lookup([b"p"]) is None  # still pending


def test_arc_pending_touch_is_no_reuse():
    # A request stores its new blocks and touches them at once (KvoffConnector's scheduler does
    # after every prepare_store): seen once, they stay in T1, the most recent of it. Fails if
    # touch() of a pending key promoted it to T2: then a, seen once, would go first.
    m = arc(3)
    store(m, [b"a"])  # T1: a
    out = m.prepare_store([b"p", b"q"])
    m.touch([b"p", b"q"])  # pending: ordered in T1 (q before p), not promoted
    m.complete_store(out.keys_to_store)
    assert evict_order(m, 3) == [b"a", b"q", b"p"]


def test_touch_with_reuse_flags_counts_only_flagged_uses():
    # A finished request's accesses (vLLM's on_request_finished): its own stores are ordered,
    # blocks it reused count as a reuse. Under ARC, a reuse moves a block to T2, which T1's
    # blocks leave before. Fails if the flags were ignored (both reused, or neither).
    for reused, survivor in (([True, False], b"a"), ([False, True], b"b")):
        m = arc(3)
        for k in (b"a", b"b", b"c"):
            store(m, [k])
        m.touch([b"a", b"b"], reused=reused)
        for k in (b"d", b"e"):
            store(m, [k])
        assert m.lookup([survivor]) == 1, reused
    m = arc(2)
    store(m, [b"a"])
    with pytest.raises(ValueError, match="1 reuse flags for 2 keys"):
        m.touch([b"a", b"x"], reused=[True])
    with pytest.raises(TypeError, match="bools"):
        m.touch([b"a"], reused=[1])


def test_arc_touch_last_to_first_evicts_tail_first():
    # invariant 8: touch([a, b, c]) moves c, then b, then a to T2's most recent end, so
    # eviction goes c, b, a. Fails if touch processes keys first to last.
    m = arc(3)
    store(m, [b"c", b"b", b"a"])  # T1: a b c
    m.touch([b"a", b"b", b"c"])
    assert evict_order(m, 3) == [b"c", b"b", b"a"]


def test_arc_prepare_store_makes_first_key_most_recent():
    # invariant 8: new keys enter T1 last to first. Fails if prepare_store inserted them in
    # call order.
    m = arc(3)
    store(m, [b"a", b"b", b"c"])
    assert evict_order(m, 3) == [b"c", b"b", b"a"]


def test_arc_ghost_hits_enter_t2_in_prefix_order():
    # invariant 8 for keys coming back from the ghost list B1: they enter T2, still tail first.
    m = arc(3)
    store(m, [b"a", b"b", b"c"])
    assert evict_order(m, 3) == [b"c", b"b", b"a"]  # ghosts in B1
    out = m.prepare_store([b"a", b"b", b"c"])
    assert len(out.evicted_keys) == 3
    m.complete_store(out.keys_to_store)
    # T1 is empty, T2 holds c b a (a most recent): T2 goes tail first.
    assert evict_order(m, 3) == [b"c", b"b", b"a"]


def test_arc_scan_does_not_flush_blocks_used_twice():
    # ARC, not LRU, is in use: a scan of one-time keys evicts only T1 blocks.
    for policy, kept in [("lru", 0), ("arc", 2)]:
        m = CPUOffloadingManager(4, eviction_policy=policy)
        store(m, [b"a", b"b"])
        m.touch([b"a", b"b"])
        for i in range(10):
            store(m, [b"scan%d" % i])
        assert m.lookup([b"a", b"b"]) == kept, policy


# ---------------------------------------------------------------------------- probation
# Invariants 6 and 8 under eviction_policy="probation". Blocks not reused since they were stored
# are on probation; while probation holds more than the budget b (the pool size until a ghost
# hit moves it) they leave first, otherwise the order is LRU over both lists. With 4 slots one
# protected ghost hit of age 0 takes b from 4 to 0 (the window is 1 eviction, the step 4).


def probation(num_blocks: int, enable_events: bool = False) -> CPUOffloadingManager:
    return CPUOffloadingManager(num_blocks, "probation", enable_events)


def _budget_to_zero(m: CPUOffloadingManager, key: bytes) -> None:
    """On an empty 4-slot probation pool: store `key` and reuse it (protected), evict it by a
    store of four keys, fail that store (its slots are freed, no ghosts), and store `key` again
    at once: a protected ghost of age 0 takes b from 4 to 0, and `key` is protected again."""
    assert len(m) == 0 and m.num_blocks == 4
    store(m, [key])
    m.touch([key])
    fillers = [b"filler%d" % i for i in range(4)]
    out = m.prepare_store(fillers)
    assert out.evicted_keys == [key]
    m.complete_store(out.keys_to_store, success=False)
    store(m, [key])


def test_probation_pending_touch_is_no_reuse():
    # A request stores its new blocks and touches them at once (the scheduler and the replay do):
    # they stay on probation. Fails if touch() of a pending key promoted it: p and q would be
    # protected and k, the least recent block, would go first.
    m = probation(4)
    _budget_to_zero(m, b"k")
    store(m, [b"a"])
    m.touch([b"a"])  # ready: a reuse, protected
    out = m.prepare_store([b"p", b"q"])
    m.touch([b"a", b"p", b"q"])  # p, q pending: ordered (q before p), not promoted
    m.complete_store(out.keys_to_store)
    assert evict_order(m, 2) == [b"q", b"p"]
    assert m.lookup([b"k"]) == 1 and m.lookup([b"a"]) == 1


def test_probation_prepare_store_is_all_or_nothing():
    # invariant 6: a refused prepare_store changes nothing: neither the pool nor the lists or the
    # ghosts. Fails if it evicted d and c before finding that it could not fit four keys (the
    # later call would then find other victims).
    m = probation(4, enable_events=True)
    for k in [b"d", b"c", b"b", b"a"]:
        store(m, [k])  # probation (least recent first): d c b a
    m.touch([b"b"])  # protected: b
    m.prepare_load([b"a"])  # pinned
    m.take_events()
    keys = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"]
    before = snapshot(m, keys)
    assert m.prepare_store([b"e", b"f", b"g", b"h"]) is None  # 3 evictable < 4
    assert snapshot(m, keys) == before
    assert m.take_events() == []
    # b = 4, LRU order over both lists: d, c (a is pinned), then b.
    assert evict_order(m, 3) == [b"d", b"c", b"b"]


def test_probation_keys_of_one_call_are_not_evicted_for_each_other():
    # invariant 6: fails if the least recent block a is evicted although it is a key of the call.
    m = probation(3)
    for k in [b"a", b"b", b"c"]:
        store(m, [k])  # probation: a b c
    m.touch([b"c"])  # protected: c
    out = m.prepare_store([b"a", b"d"])
    assert out.keys_to_store == [b"d"]
    assert out.evicted_keys == [b"b"]
    assert m.lookup([b"a", b"c"]) == 2


def test_probation_pinned_and_pending_blocks_are_not_evicted():
    # invariant 6: fails if a pinned (being loaded) or pending block can be evicted: each time
    # the block that must survive is the least recent probation block, beyond the budget.
    m = probation(4)
    _budget_to_zero(m, b"k")  # b = 0: probation leaves first; k protected
    store(m, [b"x"])
    assert m.prepare_store([b"p"]) is not None  # pending, probation
    store(m, [b"y"])
    m.prepare_load([b"x"])  # x: the least recent probation block, pinned
    assert m.prepare_store([b"z"]).evicted_keys == [b"y"]  # not x (pinned), not p (pending)
    assert b"x" in m and b"p" in m and b"k" in m
    m.complete_load([b"x"])
    assert m.prepare_store([b"w"]).evicted_keys == [b"x"]
    assert m.lookup([b"p"]) is None  # still pending


def test_probation_over_budget_evicts_unproven_blocks_first():
    # The policy's point: once b is 0, blocks that were never reused leave before older reused
    # ones. Fails under LRU (r, the least recent, would go first).
    m = probation(4)
    _budget_to_zero(m, b"k")
    store(m, [b"r"])
    m.touch([b"r"])  # reused: protected
    store(m, [b"n1"])
    store(m, [b"n2"])  # probation: n1 n2; protected: k r
    assert evict_order(m, 2) == [b"n1", b"n2"]
    assert m.lookup([b"r"]) == 1 and m.lookup([b"k"]) == 1


def test_probation_touch_last_to_first_evicts_tail_first():
    # invariant 8: touch([a, b, c]) makes c, then b, then a the most recent, so eviction goes c,
    # b, a, in probation and in protected. Fails if touch processes keys first to last.
    m = probation(3)
    store(m, [b"c", b"b", b"a"])
    m.touch([b"a", b"b", b"c"])
    assert evict_order(m, 3) == [b"c", b"b", b"a"]
    m = probation(4)
    _budget_to_zero(m, b"k")
    out = m.prepare_store([b"a", b"b", b"c"])  # evicts nothing: 3 free slots after k
    m.touch([b"a", b"b", b"c"])  # pending: ordered within probation
    m.complete_store(out.keys_to_store)
    assert evict_order(m, 3) == [b"c", b"b", b"a"]


def test_probation_prepare_store_makes_first_key_most_recent():
    # invariant 8: new keys enter probation last to first. Fails if prepare_store inserted them
    # in call order.
    m = probation(3)
    store(m, [b"a", b"b", b"c"])
    assert evict_order(m, 3) == [b"c", b"b", b"a"]


def test_probation_second_sight_enters_protected_in_prefix_order():
    # invariant 8 for keys coming back from the ghosts: they are protected, still tail first.
    m = probation(3)
    store(m, [b"a", b"b", b"c"])
    assert evict_order(m, 3) == [b"c", b"b", b"a"]  # probation ghosts
    out = m.prepare_store([b"a", b"b", b"c"])
    assert len(out.evicted_keys) == 3
    m.complete_store(out.keys_to_store)
    assert evict_order(m, 3) == [b"c", b"b", b"a"]


def test_probation_scan_does_not_flush_reused_blocks():
    # After a protected ghost hit takes the budget to 0, a scan of one-time keys evicts only
    # probation blocks; under LRU it flushes everything.
    for policy, kept in [("lru", 0), ("probation", 2)]:
        m = CPUOffloadingManager(4, eviction_policy=policy)
        _budget_to_zero(m, b"k")
        store(m, [b"a"])
        m.touch([b"a"])
        for i in range(10):
            store(m, [b"scan%d" % i])
        assert (m.lookup([b"a"]) or 0) + (m.lookup([b"k"]) or 0) == kept, policy


# ---------------------------------------------------------------------------------- events


def test_events():
    m = CPUOffloadingManager(2, enable_events=True)
    store(m, [b"a", b"b"])
    store(m, [b"c"])  # evicts b
    m.prepare_store([b"d"])  # evicts a
    m.complete_store([b"d"], success=False)
    events = m.take_events()
    assert events == [
        OffloadingEvent([b"a", b"b"], "CPU", False),
        OffloadingEvent([b"b"], "CPU", True),
        OffloadingEvent([b"c"]),
        OffloadingEvent([b"a"], medium="CPU", removed=True),
    ]
    assert [e.kind for e in events] == [
        "BlockStored",
        "BlockRemoved",
        "BlockStored",
        "BlockRemoved",
    ]
    assert events[1].medium == "CPU"
    assert events[1].keys == [b"b"]
    assert events[1].removed is True
    assert "removed=True" in repr(events[1])
    assert m.take_events() == []


def test_events_disabled_records_nothing():
    m = CPUOffloadingManager(1)
    store(m, [b"a"])
    store(m, [b"b"])
    assert m.take_events() == []


# ---------------------------------------------------------------------------------- keys


def test_int_keys_are_8_little_endian_bytes():
    m = CPUOffloadingManager(8)
    out = m.prepare_store([1, -1, 2**63, -(2**63), 2**64 - 1])
    # -1 and 2**64-1 are the same 8 bytes (two's complement); 2**63 and -2**63 too.
    assert out.keys_to_store == [
        (1).to_bytes(8, "little"),
        b"\xff" * 8,
        (2**63).to_bytes(8, "little"),
    ]
    m.complete_store(out.keys_to_store)
    assert m.lookup([(1).to_bytes(8, "little"), 2**64 - 1, -(2**63)]) == 3
    assert 1 in m
    assert b"\x01" not in m  # a different (1-byte) key


def test_any_sequence_of_keys():
    m = CPUOffloadingManager(8)
    store(m, (b"a", 2))
    assert m.lookup((b"a", 2)) == 2
    assert m.lookup(range(2, 3)) == 1
    assert m.lookup(k for k in [b"a"]) == 1
    assert m.lookup([b"a", bytearray(b"x")][:1]) == 1


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        (b"", ValueError, "empty"),
        (2**64, ValueError, "18446744073709551616"),
        (-(2**63) - 1, ValueError, "-9223372036854775809"),
        ("abc", TypeError, "str"),
        (1.5, TypeError, "float"),
        (True, TypeError, "bool"),
        (None, TypeError, "NoneType"),
        (bytearray(b"a"), TypeError, "bytearray"),
    ],
)
def test_bad_keys_raise_and_change_nothing(bad, exc, match):
    # invariant 7: a batch with a bad key raises, naming it, before changing anything.
    m = CPUOffloadingManager(2, enable_events=True)
    store(m, [b"a"])
    m.take_events()
    before = snapshot(m, [b"a", b"b"])
    for op in (m.prepare_store, m.lookup, m.touch, m.prepare_load, m.complete_load):
        with pytest.raises(exc, match=match):
            op([b"b", bad])
    with pytest.raises(exc, match=match):
        m.complete_store([b"b", bad], success=False)
    assert snapshot(m, [b"a", b"b"]) == before
    assert m.take_events() == []


@pytest.mark.parametrize("bad", [b"ab", "ab", 5, {b"a"}, None])
def test_keys_argument_must_be_an_ordered_sequence(bad):
    m = CPUOffloadingManager(2)
    with pytest.raises(TypeError, match="keys"):
        m.lookup(bad)


def test_contains_rejects_bad_key():
    m = CPUOffloadingManager(2)
    with pytest.raises(TypeError, match="str"):
        _ = "a" in m


def test_bad_state_errors_name_key_and_change_nothing():
    # invariant 7: the error names the key (hex) and its state; nothing changes.
    m = CPUOffloadingManager(4, enable_events=True)
    store(m, [b"a", b"b"])
    m.prepare_store([b"p"])
    m.take_events()
    keys = [b"a", b"b", b"p", b"x"]
    before = snapshot(m, keys)
    with pytest.raises(ValueError, match=r"keys\[2\] = 78 \(hex\) is missing"):
        m.prepare_load([b"a", b"b", b"x"])
    with pytest.raises(ValueError, match="pending"):
        m.prepare_load([b"a", b"p"])
    with pytest.raises(ValueError, match="not being loaded"):
        m.complete_load([b"a"])
    with pytest.raises(ValueError, match=r"keys\[1\] = 61 \(hex\) is already ready"):
        m.complete_store([b"p", b"a"])
    with pytest.raises(ValueError, match="missing"):
        m.complete_store([b"p", b"x"], success=False)
    with pytest.raises(ValueError, match=r"int 7 as 8 little-endian bytes"):
        m.prepare_load([7])
    assert snapshot(m, keys) == before
    # a and b were not pinned by the failed prepare_load: both can still be evicted.
    m.complete_store([b"p"])
    assert sorted(m.prepare_store([b"x", b"y", b"z"]).evicted_keys) == [b"a", b"b"]
    assert m.take_events()[0].kind == "BlockStored"


def test_complete_load_with_more_occurrences_than_pins_changes_nothing():
    m = CPUOffloadingManager(2)
    store(m, [b"a", b"b"])
    m.prepare_load([b"a", b"b"])
    with pytest.raises(ValueError, match="as many times"):
        m.complete_load([b"a", b"b", b"a"])
    # Still pinned once each: nothing can be evicted.
    assert m.prepare_store([b"c"]) is None
    m.complete_load([b"a", b"b"])
    assert m.prepare_store([b"c"]) is not None
