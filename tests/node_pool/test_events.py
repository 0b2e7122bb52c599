"""KV events of a node pool: every engine of a layout that takes events gets its layout's
BlockStored / BlockRemoved, whoever caused them (each names the engine whose call made it);
other layouts get none; a queue that is not
drained drops its oldest events and says how many."""

from __future__ import annotations

import os
from pathlib import Path

from node_pool_harness import Served

from kvoff.node_pool import NodePoolClient

FP = b"model=tiny;layout=layer_major;rank=0"


def _keys(*ids: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in ids]


def _events(c: NodePoolClient) -> list[tuple[str, list[bytes]]]:
    return [(e.kind, e.keys) for e in c.take_events()]


def test_every_engine_of_the_layout_gets_the_pools_events(served) -> None:
    a = NodePoolClient(served.socket, FP, name="a")
    b = NodePoolClient(served.socket, FP, name="b")
    other = NodePoolClient(served.socket, FP + b";dtype=fp8", name="other")
    quiet = NodePoolClient(served.socket, FP, name="quiet")  # never asked for events
    for c in (a, b, other):
        c.enable_events()
    keys = _keys(1, 2)
    out = a.prepare_store(keys)
    assert out is not None
    a.complete_store(keys)
    stored = [("BlockStored", keys)]
    evs = a.take_events()  # take_events sends the queued completion first
    assert [(e.kind, e.keys, e.by) for e in evs] == [("BlockStored", keys, "a")]  # a stored
    assert _events(b) == stored and _events(b) == []  # once
    assert _events(other) == [] and _events(quiet) == []
    # b's stores evict a's blocks (LRU, 16 slots): both hear of it, and of b's stores
    fill = _keys(*range(10, 26))
    out = b.prepare_store(fill)
    assert out is not None and sorted(out.evicted_keys) == sorted(a.prefix + k for k in keys)
    b.complete_store(fill)
    b.sync()
    for c in (a, b):
        evs = c.take_events()
        flat = [(e.kind, sorted(e.keys), e.by) for e in evs]
        # which engine made each: b stored the fill, and its store evicted a's blocks
        assert ("BlockRemoved", keys, "b") in flat
        assert ("BlockStored", fill, "b") in flat
        assert {e.by for e in evs} == {"b"}
    assert a.events_dropped == 0
    st = {e["name"]: e for e in a.status()["engines"]}
    assert st["a"]["takes_events"] and not st["quiet"]["takes_events"]


def test_an_engine_that_does_not_take_its_events_loses_the_oldest(tmp_path: Path) -> None:
    region = f"kvoff-test-np-events-{os.getpid()}"
    served = Served(tmp_path / "pool.sock", region, num_slots=4)  # 16 keys queued at most
    try:
        a = NodePoolClient(served.socket, FP)
        b = NodePoolClient(served.socket, FP)
        b.enable_events()
        for first in range(0, 40, 4):  # 10 stores of 4, each evicting the one before
            keys = _keys(*range(first, first + 4))
            assert a.prepare_store(keys) is not None
            a.complete_store(keys)
        a.sync()
        evs = b.take_events()
        assert b.events_dropped > 0
        assert sum(len(e.keys) for e in evs) <= 16
        assert evs[-1].kind == "BlockStored" and evs[-1].keys == _keys(36, 37, 38, 39)  # newest
    finally:
        served.stop()
        path = Path("/dev/shm") / region
        if path.exists():
            path.unlink()
