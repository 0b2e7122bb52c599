"""What keeps an engine's step cheap on a node pool (kvoff/node_pool/server.py, "Round trips"
and "Leases"): a one-key look-up brings its chain, completions and touches are queued without a
reply, a look-up leases its ready blocks so that their load cannot fail and needs no reply."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest
from node_pool_harness import Served, send_raw

from kvoff.node_pool import NodePoolClient, NodePoolError
from kvoff.node_pool import protocol as p

FP = b"model=tiny;layout=layer_major;rank=0"


def _keys(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


def _stored(c: NodePoolClient, keys: list[bytes]) -> list[int]:
    out = c.prepare_store(keys)
    assert out is not None and out.keys_to_store == keys
    c.complete_store(keys)
    c.sync()
    return list(out.block_ids)


def test_a_one_key_lookup_answers_its_chain_in_one_round_trip(served) -> None:
    a = NodePoolClient(served.socket, FP, name="a")
    b = NodePoolClient(served.socket, FP, name="b")
    chain = _keys(1, 2, 3, 4, 5, 6)
    _stored(a, chain)
    before = b.round_trips
    assert [b.lookup([k]) for k in chain] == [1] * 6  # as vLLM asks: one key at a time
    assert b.round_trips == before + 1 and b.answered_ahead == 5
    assert b.lookup(_keys(7)) == 0 and b.round_trips == before + 1  # the pool's key filter
    assert b.answered_by_filter == 1
    # the pool's hit rates count the look-ups answered here (reported at the step's end)
    b.take_events()
    eng = {e["name"]: e for e in a.status()["engines"]}["b"]
    assert (eng["looked_up_blocks"], eng["hit_blocks"]) == (7, 6)
    # a pending key is "retry later", from the chain too
    assert a.prepare_store(_keys(8)) is not None
    b2 = NodePoolClient(served.socket, FP, name="b2", lookahead=0)
    assert b2.lookup(_keys(8)) is None and b2.round_trips == 1 + 1  # hello + the look-up


def test_the_look_ahead_is_dropped_after_lookahead_s_and_by_this_engines_changes(served) -> None:
    a = NodePoolClient(served.socket, FP)
    chain = _keys(1, 2, 3)
    _stored(a, chain)
    b = NodePoolClient(served.socket, FP, lookahead_s=0.05)
    assert b.lookup(chain[:1]) == 1
    n = b.round_trips
    time.sleep(0.1)
    assert b.lookup(chain[1:2]) == 1 and b.round_trips == n + 1  # too old: asked again
    b.touch(chain)  # b changed the pool: what it knew is dropped
    assert b.lookup(chain[2:3]) == 1 and b.round_trips == n + 2
    # another engine's change within lookahead_s is not seen (an answer that old is allowed)
    c = NodePoolClient(served.socket, FP, lookahead_s=10.0)
    assert c.lookup(chain[:1]) == 1


def test_a_leased_block_outlives_another_engines_evictions_until_it_is_loaded(served) -> None:
    """Without the lease, the other engine's stores evict the looked-up blocks (LRU) before the
    load, and the load fails; with it, the load gets the blocks, without a round trip. A
    multi-key look-up and one without look-ahead lease their hits too."""
    a = NodePoolClient(served.socket, FP, name="a")
    chain = _keys(1, 2, 3, 4)
    slots = _stored(a, chain)
    other = NodePoolClient(served.socket, FP + b";other-engine-same-pool", name="other")

    def flood(base: int) -> None:  # 12 new blocks, then 12 more: all 16 slots are wanted
        for first in (base, base + 20):
            out = other.prepare_store(_keys(*range(first, first + 12)))
            if out is not None:
                other.complete_store(out.keys_to_store)
        other.sync()

    b = NodePoolClient(served.socket, FP, name="b")
    assert [b.lookup([k]) for k in chain] == [1] * 4
    flood(60)
    n = b.round_trips
    assert b.prepare_load(chain) == slots and b.round_trips == n and b.loads_on_lease == 1
    b.complete_load(chain)
    b.sync()
    m = served.server.manager
    assert served.call(lambda s: (m.num_stored_blocks + m.num_free_blocks, len(s.engines))) == (
        16, 3,
    )  # fmt: skip
    # the same without a lease (key_states leases nothing): evicted, the load is refused,
    # nothing is pinned
    no_lease = NodePoolClient(served.socket, FP, name="no-lease")
    _stored(a, _keys(9, 10))
    assert no_lease.key_states(_keys(9, 10)) == [1, 1]
    flood(100)
    with pytest.raises(NodePoolError, match="is missing"):
        no_lease.prepare_load(_keys(9, 10))
    assert served.call(lambda s: sum(sum(e.pins.values()) for e in s.engines.values())) == 0
    # a multi-key look-up, and a one-key one without look-ahead, lease what they answer
    multi = NodePoolClient(served.socket, FP, name="multi", lookahead=0)
    kept = _stored(a, _keys(11, 12, 13))
    assert multi.lookup(_keys(11, 12, 14, 13)) == 2 and multi.lookup(_keys(13)) == 1
    assert multi.lookup(_keys(11, 12, 11)) == 3  # as the manager counts a repeated key
    flood(140)
    n = multi.round_trips
    assert multi.prepare_load(_keys(11, 12, 13)) == kept and multi.round_trips == n
    assert multi.loads_on_lease == 1
    multi.complete_load(_keys(11, 12, 13))
    multi.sync()
    assert served.call(lambda s: sum(sum(e.pins.values()) for e in s.engines.values())) == 0
    # the pool counts a multi-key look-up as one-key look-ups of its keys in turn would: up to
    # the first missing key (11, 12, 14, 13: 3 looked up, 2 hits; 13: 1, 1; 11, 12, 11: 3, 3)
    eng = {e["name"]: e for e in multi.status()["engines"]}["multi"]
    assert (eng["looked_up_blocks"], eng["hit_blocks"]) == (7, 6)


def test_leases_lapse_after_lease_s_and_a_dead_engines_leases_are_released(
    tmp_path: Path,
) -> None:
    region = f"kvoff-test-np-lease-{os.getpid()}"
    served = Served(tmp_path / "pool.sock", region, lease_s=0.2)
    try:
        a = NodePoolClient(served.socket, FP)
        slots = _stored(a, _keys(1, 2, 3))
        m = served.server.manager
        b = NodePoolClient(served.socket, FP)
        assert b.lookup(_keys(1)) == 1
        assert served.call(lambda s: m.num_evictable_blocks) == 0  # leased: pinned
        deadline = time.monotonic() + 5
        while served.call(lambda s: m.num_evictable_blocks) != 3:
            assert time.monotonic() < deadline, "the leases did not lapse"
            time.sleep(0.02)
        assert served.call(lambda s: s.leases_lapsed) == 3
        # a lapsed lease is not used: the load is asked (a round trip), pinned as still ready
        n = b.round_trips
        assert b.prepare_load(_keys(1)) == slots[:1] and b.round_trips == n + 1
        b.complete_load(_keys(1))
        c = NodePoolClient(served.socket, FP)
        assert c.lookup(_keys(3)) == 1
        c._sock.close()  # the engine dies: its leases go with its connection
        deadline = time.monotonic() + 5
        while served.call(lambda s: len(s.engines)) != 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert served.call(lambda s: sum(len(e.leases) for e in s.engines.values())) == 0
    finally:
        served.stop()
        path = Path("/dev/shm") / region
        if path.exists():
            path.unlink()


def test_queued_calls_go_with_the_next_reply_a_flush_or_the_steps_events(served) -> None:
    a = NodePoolClient(served.socket, FP, name="a")
    b = NodePoolClient(served.socket, FP, name="b", lookahead=0)
    keys = _keys(1, 2)
    assert a.prepare_store(keys) is not None
    a.complete_store(keys)  # queued: the pool has not seen it yet
    time.sleep(0.05)
    assert b.lookup(keys) is None
    assert a.take_events() == []  # vLLM takes events once a step: the queue goes then
    deadline = time.monotonic() + 5
    while b.lookup(keys) != 2:
        assert time.monotonic() < deadline, "the queued completion never reached the pool"
        time.sleep(0.01)
    # a refused queued call comes back as an error ahead of the next reply: counted, and the
    # connection goes on
    assert a._stores.begin(_keys(3), [15])  # a key and slot the pool never gave a
    a.complete_store(_keys(3))
    assert a.lookup(keys) == 2 and a.async_errors == 1 and a.attached


def test_prepare_store_answers_every_keys_state_so_key_states_needs_no_round_trip(
    served,
) -> None:
    a = NodePoolClient(served.socket, FP)
    _stored(a, _keys(1))
    assert a.prepare_store(_keys(2)) is not None  # pending
    n = a.round_trips
    out = a.prepare_store(_keys(1, 2, 3))
    assert out is not None and out.keys_to_store == _keys(3)
    assert a.key_states(_keys(1, 2, 3)) == [1, None, None] and a.round_trips == n + 1
    a.complete_store(_keys(2, 3))  # a change: the answer is dropped, key_states asks
    assert a.key_states(_keys(1, 2)) == [1, 1] and a.round_trips == n + 3


def test_bad_look_aheads_and_no_reply_calls_get_errors_and_change_nothing(served) -> None:
    good = NodePoolClient(served.socket, FP)
    _stored(good, _keys(1))
    key = p.encode_keys(_keys(1))
    cases = {
        "always has a reply": p.frame(p.LOOKUP | p.NO_REPLY, 1, key),
        "needs ahead": p.frame(p.LOOKUP_AHEAD, 2, b"\x01"),
        "at least one key": p.frame(p.LOOKUP_AHEAD, 3, struct.pack("<HII", 4, 0, 0)
                                    + p.encode_keys([])),
        "hits <= answered": p.frame(p.LOOKUP_AHEAD, 4, struct.pack("<HII", 4, 1, 2) + key),
        "counted as hits": p.frame(p.PREPARE_LOAD | p.NO_REPLY, 5, p.encode_keys(_keys(9))),
    }  # fmt: skip
    for what, data in cases.items():
        reply = send_raw(served.socket, data)
        op, _, _ = p.parse_header(reply[:16])
        assert op == p.ERROR and what.encode() in reply, (what, reply)
    m = served.server.manager
    state = served.call(lambda s: (m.num_stored_blocks, m.num_evictable_blocks, len(s.engines)))
    assert state == (1, 1, 1) and good.lookup(_keys(1)) == 1


def test_the_successor_map_keeps_the_newest_chains_within_its_bound(tmp_path: Path) -> None:
    """The map LOOKUP_AHEAD walks holds at most SUCCESSORS_PER_SLOT x slots keys; beyond that
    the oldest go first, so the newest chains are still answered whole."""
    from kvoff.node_pool.server import SUCCESSORS_PER_SLOT, NodePoolServer

    server = NodePoolServer(str(tmp_path / "pool.sock"), 16, 64,
                            region=f"kvoff-test-np-succ-{os.getpid()}")  # fmt: skip
    try:
        cap = SUCCESSORS_PER_SLOT * 16
        chains = [[b"chain-%03d-%d" % (c, i) for i in range(4)] for c in range(40)]
        for chain in chains:
            server.successors.record(chain)
            assert len(server.successors) <= cap
        assert server.successors.walk(chains[-1][0], 8) == chains[-1]  # the newest: whole
        assert server.successors.walk(chains[0][0], 8) == chains[0][:1]  # the oldest: dropped
    finally:
        server.close()


@pytest.mark.parametrize(
    "keys",
    [[], [b"a" * 32] * 3, [b"a", b"bc", b"d"], [bytearray(b"x" * 16), memoryview(b"y" * 16)]],
)
def test_prefixed_keys_encode_as_the_keys_with_their_prefix(keys) -> None:
    pre = b"P" * 8
    assert p.encode_prefixed_keys(pre, keys) == p.encode_keys([pre + bytes(k) for k in keys])
    assert p.decode_keys(p.encode_prefixed_keys(pre, keys))[0] == [pre + bytes(k) for k in keys]


def test_a_prefixed_key_too_long_or_empty_is_refused() -> None:
    # the limits are the caller's, without the prefix (1,024 bytes with it)
    with pytest.raises(p.ProtocolError, match=r"a key of 1017 bytes; keys are 1\.\.1016 bytes"):
        p.encode_prefixed_keys(b"P" * 8, [b"k" * 1017])
    assert p.encode_prefixed_keys(b"P" * 8, [b"k" * 1016])
    # an empty key would be the prefix alone, a key of 8 bytes: refused, at one width or mixed
    for keys in ([b""], [b"", b""], [b"k", b""]):
        with pytest.raises(p.ProtocolError, match=r"(a key of 0 bytes|an empty key); keys are 1"):
            p.encode_prefixed_keys(b"P" * 8, keys)


def test_usage_gauges_ask_for_the_counts_alone(served) -> None:
    """An engine's usage gauges (read every step, asked once a second) get the block counts
    alone: the whole status scans the key filter on the pool's one thread."""
    a = NodePoolClient(served.socket, FP, name="a")
    _stored(a, _keys(1, 2))
    a.prepare_store(_keys(3))  # pending
    trips = a.round_trips
    gauges = (a.num_stored_blocks, a.num_free_blocks, a.num_pending_blocks)
    assert a.num_evictable_blocks == 2 and a.round_trips == trips + 1  # one ask a second
    full = a.status()
    assert gauges == (full["stored_blocks"], full["free_blocks"], full["pending_blocks"])
    assert (gauges[0], gauges[2]) == (2, 1)
    counts = p.decode_json(a._call(p.STATUS, p.STATUS_COUNTS))
    assert counts == {k: full[k] for k in counts}
    assert set(counts) == {"stored_blocks", "free_blocks", "pending_blocks",
                           "reserved_blocks", "evictable_blocks", "pinned_blocks"}  # fmt: skip
    assert a.num_pinned_blocks == 1  # the pending store; the two stored blocks are evictable
