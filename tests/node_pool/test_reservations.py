"""Slots reserved for an engine's stores (``RESERVE`` / ``STORE_RESERVED``): a store of keys
the pool's key filter rules out needs no round trip, every slot stays accounted for (free,
held, pending or reserved), a key another engine holds is never stored twice, and an engine
that goes away gives its reservation back (docs/design.md invariant 10)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from node_pool_harness import Served, send_raw

from kvoff.node_pool import NodePoolClient
from kvoff.node_pool import protocol as p

FP = b"model=tiny;layout=layer_major;rank=0"


def _keys(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


def _slots(served: Served) -> dict[str, int]:
    """The index's slot counts and what the engines hold reserved, read in the serving
    thread."""

    def read(s):
        m = s.manager
        return {
            "stored": m.num_stored_blocks,
            "free": m.num_free_blocks,
            "pending": m.num_pending_blocks,
            "reserved": m.num_reserved_blocks,
            "engines_reserved": sum(
                len(e.reserved) + len(e.duplicates) for e in s.engines.values()
            ),
            "storing": sum(len(e.storing) for e in s.engines.values()),
        }

    got = served.call(read)
    assert got["stored"] + got["free"] + got["pending"] + got["reserved"] == 16  # none leaked
    assert got["reserved"] == got["engines_reserved"]  # every reserved slot is an engine's
    assert got["pending"] == got["storing"]
    return got


def _with_reservation(served: Served, name: str = "a") -> NodePoolClient:
    """A client whose first store asked for a reservation (one round trip), taken."""
    c = NodePoolClient(served.socket, FP, name=name, reserve=True)
    out = c.prepare_store(_keys(200))
    assert out is not None
    c.complete_store(out.keys_to_store)
    c.sync()
    assert c._stores.num_reserved, "the first store's round trip brought the reservation"
    return c


def test_stores_into_reserved_slots_need_no_round_trip_and_are_hits_for_all(served) -> None:
    a = _with_reservation(served)
    b = NodePoolClient(served.socket, FP, name="b")
    assert a.reserve_max == 4  # the fixture's pool: 4 slots per engine
    trips = a.round_trips
    out = a.prepare_store(_keys(1, 2))
    assert out is not None and out.store_indices == [0, 1] and out.keys_to_store == _keys(1, 2)
    assert a.round_trips == trips and a.stores_on_reservation == 1
    a.sync()
    assert b.lookup(_keys(1, 2)) is None  # pending in the pool: a's slots, not yet written
    assert not any(served.call(lambda s: [s.manager.is_reserved(x) for x in out.block_ids]))
    assert _slots(served)["pending"] == 2
    a.complete_store(out.keys_to_store)
    a.sync()
    # the slots a wrote are the ones the pool serves
    assert b.lookup(_keys(1, 2)) == 2 and b.prepare_load(_keys(1, 2)) == out.block_ids
    b.complete_load(_keys(1, 2))
    st = a.status()
    mine = {e["name"]: e for e in st["engines"]}["a"]
    assert mine["reserved_blocks"] == st["reserved_blocks"] and st["reserve_max"] == 4
    _slots(served)


def test_a_store_the_reservation_cannot_cover_asks_the_pool_and_refills(served) -> None:
    a = _with_reservation(served)
    held = a._stores.num_reserved
    trips = a.round_trips
    out = a.prepare_store(_keys(*range(10, 10 + held + 1)))  # one more key than reserved
    assert out is not None and len(out.block_ids) == held + 1
    assert a.round_trips == trips + 1 and a.stores_on_reservation == 0
    a.complete_store(out.keys_to_store)
    a.sync()
    assert a._stores.num_reserved  # the refill went with the round trip
    _slots(served)


def test_a_key_the_pool_holds_is_asked_for_and_never_stored_twice(served) -> None:
    a = _with_reservation(served)
    b = NodePoolClient(served.socket, FP, name="b")
    out = b.prepare_store(_keys(5))
    b.complete_store(out.keys_to_store)
    b.sync()
    trips = a.round_trips
    got = a.prepare_store(_keys(5, 6))  # the filter says 5 may be held: the pool answers
    assert got is not None and got.keys_to_store == _keys(6) and got.store_indices == [1]
    assert a.round_trips == trips + 1
    a.complete_store(got.keys_to_store)
    a.sync()
    _slots(served)


def test_a_key_another_engine_stored_first_keeps_its_copy_and_frees_the_slot(served) -> None:
    """The race the key filter cannot rule out: a checks the filter, b's store lands, then
    a's store into its reserved slot reaches the pool. b's copy stays; a's slot is freed when
    a completes the key, and nothing errs."""
    a = _with_reservation(served)
    b = NodePoolClient(served.socket, FP, name="b")
    got = a._stores.store_reserved(_keys(7), a._filter.view)  # the filter rules 7 out
    assert got is not None
    (slot,), payload = got
    out = b.prepare_store(_keys(7))  # b's store lands first
    b.sync()
    a._send(p.STORE_RESERVED, payload, now=True)  # then a's
    a.sync()
    assert served.call(lambda s: s.manager.is_reserved(slot))  # a's, until a completes
    a.complete_store(_keys(7))
    a.sync()
    assert not served.call(lambda s: s.manager.is_reserved(slot))
    assert a.async_errors == 0
    b.complete_store(_keys(7))
    b.sync()
    assert a.lookup(_keys(7)) == 1 and b.prepare_load(_keys(7)) == out.block_ids
    b.complete_load(_keys(7))
    _slots(served)


def test_an_engine_gone_gives_back_its_reservation_and_its_stores(served) -> None:
    a = _with_reservation(served)
    out = a.prepare_store(_keys(3))
    assert out is not None and a.stores_on_reservation == 1
    a.sync()
    before = _slots(served)
    assert before["reserved"] > 0 and before["pending"] == 1
    a._sock.close()  # gone without a word (a SIGKILL closes the socket the same way)
    checker = NodePoolClient(served.socket, FP, name="checker")
    checker.sync()
    after = _slots(served)
    assert after["reserved"] == 0 and after["pending"] == 0
    assert checker.lookup(_keys(3)) == 0  # its store in flight never becomes a hit


def test_bad_reservation_calls_get_errors_and_change_nothing(served) -> None:
    before = _slots(served)
    # a store into a reservation this connection does not have
    reply = send_raw(served.socket, p.frame(p.STORE_RESERVED, 1, p.encode_keys(_keys(1))))
    assert p.parse_header(reply[:16])[0] == p.ERROR and b"0 slots reserved" in reply
    reply = send_raw(served.socket, p.frame(p.RESERVE, 2, b"\x01\x00"))
    assert b"reserve needs count u32" in reply
    # a reservation is capped at the pool's share per engine, and released with the engine
    reply = send_raw(served.socket, p.frame(p.RESERVE, 3, struct.pack("<I", 1000)))
    op, rid, _ = p.parse_header(reply[:16])
    assert (op, rid, reply[16]) == (p.RESERVE | p.REPLY, 3, 1)
    assert len(p.decode_slots(reply[17:])[0]) == 4
    assert _slots(served) == before


def test_a_pool_that_reserves_nothing_is_asked_for_every_store(tmp_path) -> None:
    served = Served(tmp_path / "pool.sock", f"kvoff-test-np-noreserve-{tmp_path.name}"[:200],
                    reserve_blocks=0)  # fmt: skip
    try:
        a = NodePoolClient(served.socket, FP, name="a", reserve=True)
        assert a.reserve_max == 0
        for i in range(3):
            out = a.prepare_store(_keys(i))
            assert out is not None
            a.complete_store(out.keys_to_store)
        assert a.stores_on_reservation == 0 and a.round_trips >= 3 and a.async_errors == 0
        reply = send_raw(served.socket, p.frame(p.RESERVE, 4, struct.pack("<I", 2)))
        assert b"reserves no slots" in reply
    finally:
        served.stop()
        region = Path("/dev/shm") / served.region
        if region.exists():
            region.unlink()


def test_the_engine_side_ledger_refuses_bad_calls_and_changes_nothing() -> None:
    """NodePoolStores (the C++ ledger the client and the C++ scheduler share): bad input is a
    clear error and leaves the reservation and the stores in flight as they were."""
    import mmap

    from kvoff._scheduler import KeyFilter, NodePoolStores

    s = NodePoolStores(b"PREFIX08", p.VERSION)
    s.add_reserved([5, 6])
    assert s.begin([b"k1"], [9])
    mem = mmap.mmap(-1, KeyFilter.bytes_for(16))
    f = KeyFilter.create(mem, 1)
    with pytest.raises(TypeError, match=r"expected a kvoff\._scheduler\.KeyFilter"):
        s.store_reserved([b"k2"], object())
    with pytest.raises(ValueError, match=r"keys\[1\] is b'' \(empty\)"):
        s.store_reserved([b"k2", b""], f)
    with pytest.raises(ValueError, match="a node pool key of 1020 bytes"):
        s.store_reserved([b"k2", b"x" * 1020], f)
    with pytest.raises(ValueError, match="-1 is not a slot"):
        s.begin([b"k3"], [-1])
    with pytest.raises(ValueError, match="1 keys but 2 slots"):
        s.begin([b"k3"], [1, 2])
    with pytest.raises(ValueError, match="one slot to two keys"):
        s.begin([b"k3", b"k4"], [1, 1])
    assert (s.num_reserved, s.num_storing, s.slot_of(b"k1")) == (2, 1, 9)
    assert s.store_reserved([b"k1"], f) is None  # in flight already: the pool decides
    slots, payload = s.store_reserved([b"k2"], f)
    assert slots == [5] and p.decode_keys(payload)[0] == [b"PREFIX08k2"]
    assert s.complete_slots([9, 9, 77], True) == b"\x01" + p.encode_keys([b"PREFIX08k1"])
    f.release()
    with pytest.raises(ValueError, match="released"):
        s.store_reserved([b"k5"], f)
    assert (s.num_reserved, s.num_storing) == (1, 1)
