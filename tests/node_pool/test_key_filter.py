"""The node pool's key filter (kvoff/node_pool/key_filter.py): engines hear a miss without a
round trip, and a key the pool's index holds is never filtered out, whatever the pool did."""

from __future__ import annotations

import mmap
import os
import signal
import struct
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvoff._scheduler import KeyFilter
from node_pool_harness import Served, send_raw, start_pool_process

from kvoff.node_pool import NodePoolClient
from kvoff.node_pool import protocol as p
from kvoff.node_pool.key_filter import SUFFIX, attach_key_filter

FP = b"model=tiny;layout=layer_major;rank=0"


def _keys(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


def _in_index(served: Served, prefixed: bytes) -> bool:
    """Whether the pool's index holds the key (stored or being stored)."""
    return served.call(lambda s: s.manager.lookup([prefixed]) != 0)


def test_a_miss_needs_no_round_trip_and_a_stored_key_is_asked(served) -> None:
    a = NodePoolClient(served.socket, FP, name="a")
    b = NodePoolClient(served.socket, FP, name="b", lookahead_s=0.0)  # no kept answers
    before = b.round_trips
    assert b.lookup(_keys(1)) == 0 and b.lookup(_keys(2, 3)) == 0  # one key, and a chain
    assert b.round_trips == before and b.answered_by_filter == 2
    out = a.prepare_store(_keys(1))
    assert out is not None
    assert b.lookup(_keys(1)) is None and b.round_trips == before + 1  # being stored: asked
    a.complete_store(_keys(1))
    a.sync()
    assert b.lookup(_keys(1)) == 1 and b.round_trips == before + 2
    # another layout's engine never sees it: its keys have another prefix
    c = NodePoolClient(served.socket, b"another model", name="c")
    n = c.round_trips
    assert c.lookup(_keys(1)) == 0 and c.round_trips == n and c.answered_by_filter == 1
    # the pool counts the filter's answers in its hit rates (reported at the step's end)
    b.take_events()
    eng = {e["name"]: e for e in a.status()["engines"]}["b"]
    assert (eng["looked_up_blocks"], eng["hit_blocks"]) == (4, 1)


def test_a_key_the_index_drops_is_filtered_out_again(served) -> None:
    a = NodePoolClient(served.socket, FP, name="a")
    b = NodePoolClient(served.socket, FP, name="b", lookahead_s=0.0)
    out = a.prepare_store(_keys(1, 2))
    assert out is not None
    a.complete_store(_keys(1), success=False)  # a failed store leaves the index
    a.sync()
    n = b.round_trips
    assert b.lookup(_keys(1)) == 0 and b.round_trips == n
    a.close()  # the engine dies mid-store: its stores leave the index
    deadline = time.monotonic() + 5
    while _in_index(served, b.prefix + _keys(2)[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.lookup(_keys(2)) == 0 and b.round_trips == n
    # evictions: 16 slots, 40 keys stored; every evicted key is a miss without a round trip
    for i in range(10, 50):
        out = b.prepare_store(_keys(i))
        assert out is not None
        b.complete_store(_keys(i))
    b.sync()
    n = b.round_trips
    assert [b.lookup(_keys(i)) for i in range(10, 34)] == [0] * 24
    assert b.round_trips - n <= 1  # a false positive at most (0.24 % when full)
    assert b.lookup(_keys(49)) == 1
    status = b.status()["key_filter_status"]
    assert status["unknown_removals"] == 0 and 0 < status["set_fraction"] < 1


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.sampled_from(["store", "fail", "complete", "drop"]), st.integers(0, 40)),
        max_size=60,
    )
)
def test_a_key_in_the_index_is_never_filtered_out(served, steps) -> None:
    """Random stores, failed and completed stores, evictions (16 slots) and engines that die:
    after each step, every key the index holds is "maybe" in an engine's view of the filter."""
    view = attach_key_filter(served.call(lambda s: s.describe())["key_filter"])
    assert view is not None
    # engines that store into reserved slots where they can (the filter is their guide)
    engines = [NodePoolClient(served.socket, FP, name=f"e{i}", reserve=True) for i in range(2)]
    storing: list[list[bytes]] = [[], []]
    try:
        for i, (what, k) in enumerate(steps):
            e = i % 2
            eng = engines[e]
            if what == "store":
                out = eng.prepare_store(_keys(k))
                if out is not None:
                    storing[e] += out.keys_to_store
            elif what in ("fail", "complete") and storing[e]:
                eng.complete_store(storing[e], success=what == "complete")
                storing[e] = []
            elif what == "drop":
                eng.close()
                engines[e] = NodePoolClient(served.socket, FP, name=f"e{e}-{i}", reserve=True)
                storing[e] = []
            for eng in engines:
                eng.sync()
            held = served.call(
                lambda s: [
                    key for key in (engines[0].prefix + x for x in _keys(*range(41)))
                    if s.manager.lookup([key]) != 0
                ]
            )  # fmt: skip
            assert all(view.may_contain(key) for key in held)
    finally:
        view.close()
        for eng in engines:
            eng.close()


def test_a_pool_with_tiers_publishes_no_filter(tmp_path: Path) -> None:
    from kvoff.node_pool.server import tier_format
    from kvoff.tiers.coordinator import make_tiers

    region = f"kvoff-test-kf-tiers-{os.getpid()}"
    tiers = make_tiers(tier_format(4096), disk_path=tmp_path / "disk", disk_bytes=1 << 20)
    s = Served(tmp_path / "pool.sock", region, tiers=tiers, write_queue_blocks=16)
    try:
        c = NodePoolClient(s.socket, FP)
        assert c.status()["key_filter"] is None and c._filter is None
        assert not Path("/dev/shm", region + SUFFIX).exists()
        c.close()
    finally:
        s.stop()
        Path("/dev/shm", region).unlink(missing_ok=True)


def test_a_restarted_pool_has_a_new_filter_and_engines_map_it(tmp_path: Path) -> None:
    sock = str(tmp_path / "pool.sock")
    region = f"kvoff-test-kf-restart-{os.getpid()}"
    server = start_pool_process(sock, region, 16)
    try:
        c = NodePoolClient(sock, FP, retry_s=0.05)
        old = c.status()["key_filter"]
        out = c.prepare_store(_keys(1))
        assert out is not None
        c.complete_store(_keys(1))
        assert c.lookup(_keys(1)) == 1
        server.send_signal(signal.SIGKILL)
        server.wait()
        assert c.lookup(_keys(1)) == 0 and c._filter is None  # gone: the old filter let go
        server = start_pool_process(sock, region, 16)  # adopts the region, empty index
        time.sleep(0.1)
        n = c.round_trips
        assert c.lookup(_keys(1)) == 0 and c.attached  # it reconnects (hello, then asks)
        assert c.round_trips == n + 2
        new = c.status()["key_filter"]
        assert (new["inode"], new["epoch"]) != (old["inode"], old["epoch"])
        n = c.round_trips
        assert c.lookup(_keys(1)) == 0 and c.round_trips == n  # the new pool's filter
        out = c.prepare_store(_keys(1))
        assert out is not None
        c.complete_store(_keys(1))
        assert c.lookup(_keys(1)) == 1
    finally:
        server.terminate()
        server.wait()
    assert not Path("/dev/shm", region + SUFFIX).exists()  # a clean stop removes it


def test_a_filter_that_is_not_the_pools_is_not_used(served, tmp_path: Path) -> None:
    info = served.call(lambda s: s.describe())["key_filter"]
    assert attach_key_filter(None) is None
    assert attach_key_filter({**info, "epoch": info["epoch"] ^ 1}) is None
    assert attach_key_filter({**info, "inode": info["inode"] + 1}) is None
    assert attach_key_filter({**info, "path": str(tmp_path / "missing")}) is None
    junk = tmp_path / "junk.keys"
    junk.write_bytes(os.urandom(KeyFilter.bytes_for(4)))
    assert attach_key_filter({**info, "path": str(junk), "inode": junk.stat().st_ino}) is None
    good = attach_key_filter(info)
    assert good is not None
    good.close()
    good.close()  # idempotent


def test_a_reader_cannot_write_and_a_released_filter_refuses_calls() -> None:
    m = mmap.mmap(-1, KeyFilter.bytes_for(8))
    w = KeyFilter.create(m, 3)
    r = KeyFilter.attach(memoryview(m).toreadonly())
    w.add([b"k"])
    assert r.may_contain(b"k") and not r.may_contain(b"j") and r.epoch == 3
    try:
        r.add([b"j"])
    except ValueError as e:
        assert "read-only" in str(e)
    else:
        raise AssertionError("a reader added a key")
    assert w.remove([b"j", b"k"]) == 1 and not r.may_contain(b"k")
    w.release()
    r.release()
    try:
        w.may_contain(b"k")
    except ValueError as e:
        assert "released" in str(e)
    else:
        raise AssertionError("a released filter answered")
    m.close()  # no export left


def test_bad_lookup_reports_get_errors_and_change_nothing(served) -> None:
    bad = [
        p.frame(p.REPORT_LOOKUPS, 1, b"\x00" * 7),
        p.frame(p.REPORT_LOOKUPS, 2, struct.pack("<II", 1, 2)),  # more hits than look-ups
    ]
    for frame in bad:
        assert p.parse_header(send_raw(served.socket, frame)[: p.HEADER.size])[0] == p.ERROR
    c = NodePoolClient(served.socket, FP)
    assert c.status()["hit_rate"] == 0.0 and c.lookup(_keys(1)) == 0
