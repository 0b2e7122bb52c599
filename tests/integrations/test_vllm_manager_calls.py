"""``kvoff bench manager-calls``: the replay of a recorded manager-call log into vLLM's
``CPUOffloadingManager`` and kvoff's ``KvoffOffloadingManager`` (hand-written logs whose
outcome depends on the rules: interactive lookups, recency applied at on_request_finished,
refusals retried at the finish), and one short record + replay through a real vLLM engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvoff.tools.bench_manager_calls import (
    make_manager,
    read_log,
    replay_log,
    run_replays,
)
from kvoff.tools.cli import main

# Without vLLM every test here skips with the reason (tests/integrations/conftest.py).
pytestmark = pytest.mark.vllm

CHUNK = 32
LRU = (("vllm", "lru"), ("kvoff", "lru"))


def _key(name: str) -> str:
    """A 36-byte vLLM offload key (32-byte hash, group 0) named ``name``, in hex."""
    return (name.encode().ljust(32, b".") + bytes(4)).hex()


def _keys(*items: tuple[str, int]) -> list[list[Any]]:
    return [[_key(n), p] for n, p in items]


def _log(cpu_blocks: int, events: list[dict[str, Any]]) -> list[str]:
    header = {"ev": "header", "version": 1, "cpu_blocks": cpu_blocks, "tokens_per_chunk": CHUNK,
              "block_size": CHUNK, "policy": "lru", "manager": "kvoff"}  # fmt: skip
    return [json.dumps(e) for e in [header, *events, {"ev": "end", "requests": 0}]]


def _store_and_finish(req: str, *keys: tuple[str, int]) -> list[dict[str, Any]]:
    """A request that misses, stores ``keys`` (completed at the next update) and finishes."""
    return [
        {"ev": "new", "req": req},
        {"ev": "lookup", "req": req, "key": _keys(keys[0])[0], "result": "MISS"},
        {"ev": "round", "req": req, "computed": 0, "result": 0, "keys": _keys(*keys)},
        {"ev": "prepare_store", "req": req, "keys": _keys(*keys),
         "stored": [_key(n) for n, _ in keys], "evicted": []},
        {"ev": "update"},
        {"ev": "complete_store", "req": req, "keys": _keys(*keys), "success": True},
        {"ev": "finish", "req": req},
    ]  # fmt: skip


def _recency_log() -> list[str]:
    """Two slots. A stores k1, B stores m1 (newer). C hits k1 and finishes: only its finish
    makes k1 recent, so D's store evicts m1 (without it: k1). E hits k1 (the engine recorded a
    miss: the answers must be the manager's own) and computes e2; F's recorded hit on m1 is a
    miss for the managers (m1 is gone): no load, and F's key is stored at its finish."""
    events = [
        *_store_and_finish("A", ("k1", 32)),
        *_store_and_finish("B", ("m1", 32)),
        {"ev": "new", "req": "C"},
        {"ev": "lookup", "req": "C", "key": _keys(("k1", 32))[0], "result": "HIT"},
        {"ev": "round", "req": "C", "computed": 0, "result": 32, "keys": _keys(("k1", 32))},
        {"ev": "prepare_load", "req": "C", "keys": _keys(("k1", 32))},
        {"ev": "update"},
        {"ev": "complete_load", "req": "C", "keys": _keys(("k1", 32))},
        {"ev": "finish", "req": "C"},
        *_store_and_finish("D", ("n1", 32)),
        {"ev": "new", "req": "E"},
        {"ev": "lookup", "req": "E", "key": _keys(("k1", 32))[0], "result": "MISS"},
        {"ev": "round", "req": "E", "computed": 0, "result": 0,
         "keys": _keys(("k1", 32), ("e2", 64))},
        {"ev": "prepare_store", "req": "E", "keys": _keys(("k1", 32), ("e2", 64)),
         "stored": [_key("k1"), _key("e2")], "evicted": [_key("n1"), _key("m1")]},
        {"ev": "update"},
        {"ev": "complete_store", "req": "E", "keys": _keys(("k1", 32), ("e2", 64)),
         "success": True},
        {"ev": "finish", "req": "E"},
        {"ev": "new", "req": "F"},
        {"ev": "lookup", "req": "F", "key": _keys(("m1", 32))[0], "result": "HIT"},
        {"ev": "round", "req": "F", "computed": 0, "result": 32, "keys": _keys(("m1", 32))},
        {"ev": "prepare_load", "req": "F", "keys": _keys(("m1", 32))},
        {"ev": "update"},
        {"ev": "complete_load", "req": "F", "keys": _keys(("m1", 32))},
        {"ev": "finish", "req": "F"},
        {"ev": "update"},
    ]  # fmt: skip
    return _log(2, events)


@pytest.mark.parametrize(("kind", "policy"), LRU)
def test_replay_is_interactive_and_applies_recency_at_finish(kind: str, policy: str) -> None:
    log = read_log(_recency_log())
    res = replay_log(log, make_manager(kind, policy, 2), (kind, policy))
    # C's hit made k1 recent only at C's finish: without on_request_finished D evicts k1 and E
    # misses; with the recorded answers E misses and F hits (a load of an evicted block)
    assert res.hits_by_request == {"A": 0, "B": 0, "C": 1, "D": 0, "E": 1, "F": 0}
    assert res.lookup_hit_blocks == 2 and res.lookup_hit_tokens == 2 * CHUNK
    # A, B, D, E's e2 and F's m1 (stored at F's finish: the engine loaded it); k1 is E's hit
    # run and is not offered again
    assert res.blocks_stored == 5
    assert res.finish_stores == 1 and res.refusals == 0 and res.dropped_keys == 0
    # D evicts m1, E's e2 evicts n1 (k1 is pinned by E's load), F's m1 evicts k1 or e2
    assert res.evictions == 3
    assert res.evicted_by_call[_event_index(log, "prepare_store", "D")] == [
        bytes.fromhex(_key("m1"))
    ]


def _event_index(log: Any, kind: str, req: str) -> int:
    return next(i for i, e in enumerate(log.events) if e["ev"] == kind and e.get("req") == req)


def test_run_replays_compares_managers_and_checks_the_record() -> None:
    log = read_log(_recency_log())
    out = run_replays(log, [*LRU, ("vllm", "arc"), ("kvoff", "arc"), ("kvoff", "probation")])
    rows = {(r["manager"], r["policy"]): r for r in out["managers"]}
    assert rows["vllm", "lru"]["ratio_to_vllm_lru"] == 1.0
    assert rows["kvoff", "lru"]["lookup_hit_blocks"] == rows["vllm", "lru"]["lookup_hit_blocks"]
    for r in rows.values():
        assert 0 <= r["lookup_hit_blocks"] <= 2
    # the engine's own answers: C and F hit (2 blocks), as kvoff lru's replay (C and E)
    assert out["engine"]["lookup_hit_blocks"] == 2 and out["engine"]["blocks_loaded"] == 2
    assert out["reproduces_record"] is True
    assert out["divergence"]["requests_with_different_hits"] == 0


@pytest.mark.parametrize(("kind", "policy"), LRU)
def test_a_refused_store_is_offered_again_at_the_finish(kind: str, policy: str) -> None:
    """One slot: B loads k1 and offers b2 while the load pins the slot (refused, no room);
    after the load completes, B's finish offers b2 again and it evicts k1."""
    events = [
        *_store_and_finish("A", ("k1", 32)),
        {"ev": "new", "req": "B"},
        {"ev": "lookup", "req": "B", "key": _keys(("k1", 32))[0], "result": "HIT"},
        {"ev": "round", "req": "B", "computed": 0, "result": 32,
         "keys": _keys(("k1", 32), ("b2", 64))},
        {"ev": "prepare_load", "req": "B", "keys": _keys(("k1", 32))},
        {"ev": "prepare_store", "req": "B", "keys": _keys(("b2", 64)), "stored": None,
         "evicted": []},
        {"ev": "update"},
        {"ev": "complete_load", "req": "B", "keys": _keys(("k1", 32))},
        {"ev": "finish", "req": "B"},
        {"ev": "update"},
    ]  # fmt: skip
    res = replay_log(read_log(_log(1, events)), make_manager(kind, policy, 1), (kind, policy))
    assert res.hits_by_request["B"] == 1
    assert res.refusals == 1 and res.finish_stores == 1 and res.dropped_keys == 0
    assert res.blocks_stored == 2 and res.evictions == 1


def _session_trace(path: Path) -> Path:
    """A Mooncake-format trace of 4 chat sessions taking turns, 6 turns each: turn t of a
    session re-sends its first 4 + 2t hash ids (one 32-token block each at 32 tokens per hash
    id), the last one partly."""
    lines = []
    for turn in range(6):
        for session in range(4):
            ids = [1000 * session + j for j in range(4 + 2 * turn)]
            lines.append(json.dumps({"timestamp": len(lines), "input_length": len(ids) * 512 - 100,
                                     "output_length": 4, "hash_ids": ids}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def test_record_and_replay_through_a_real_engine(tmp_path: Path, capsys) -> None:
    """A short run of the CLI on a small session trace (24 requests, 4 tokens each; a pool of
    24 slots and a GPU cache too small to keep a session between its turns): the replay of the
    recorded manager (kvoff lru) reproduces the engine's hits and evictions."""
    out, calls = tmp_path / "bench.json", tmp_path / "calls.jsonl"
    trace = _session_trace(tmp_path / "sessions.jsonl")
    argv = ["bench", "manager-calls", "--trace", str(trace), "--limit", "24", "--cpu-blocks",
            "24", "--max-tokens", "4", "--concurrency", "2", "--gpu-blocks", "32",
            "--keep-log", str(calls), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "vllm lru" in printed and "kvoff probation" in printed
    doc = json.loads(out.read_text())
    assert doc["run"]["command"] == "kvoff " + " ".join(argv)
    assert {"cpu_model", "cores"} <= set(doc["run"]["machine"])
    rec = doc["record"]
    assert rec["requests"] == 24 and rec["cpu_blocks"] == 24 and rec["tokens_per_chunk"] == 32
    replay = doc["replay"]
    engine = replay["engine"]
    assert engine["requests"] == 24 and engine["readmissions"] == 0
    assert engine["lookup_hit_blocks"] > 0 and engine["evictions"] > 0
    assert engine["blocks_loaded"] == engine["lookup_hit_blocks"]
    names = [(r["manager"], r["policy"]) for r in replay["managers"]]
    assert names == [("vllm", "lru"), ("vllm", "arc"), ("kvoff", "lru"), ("kvoff", "arc"),
                     ("kvoff", "probation")]  # fmt: skip
    kv = next(r for r in replay["managers"] if r["policy"] == "lru" and r["manager"] == "kvoff")
    assert replay["reproduces_record"] is True
    assert kv["lookup_hit_blocks"] == engine["lookup_hit_blocks"]
    assert kv["evictions"] == engine["evictions"] and kv["blocks_stored"] == engine["blocks_stored"]
    # the log replays again on its own, to the same counts
    again = tmp_path / "again.json"
    assert main(["bench", "manager-calls", "--from-log", str(calls), "--json", str(again)]) == 0
    untimed = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert untimed(json.loads(again.read_text())["replay"]["managers"]) == untimed(
        replay["managers"]
    )
