"""``kvoff bench manager-calls``: the spec path's manager calls, recorded from a real vLLM engine
and replayed into vLLM's ``CPUOffloadingManager`` and kvoff's ``KvoffOffloadingManager`` in the
same run, so that the managers' hit counts are compared on one request stream (issue 53).

**Record** (:mod:`kvoff.tools.manager_calls_record`). One vLLM engine (vLLM-CPU or a GPU
build) runs in a child process with vLLM's
``OffloadingConnector`` over :class:`kvoff.integrations.vllm.KvoffOffloadingSpec`
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler runs in the child), a tiny random-weight
model (:mod:`kvoff.tools.tiny_models`) and the prompts of a bundled trace, as ``kvoff replay
--engine vllm`` makes them (:func:`kvoff.tools.replay_vllm.prompt_tokens`; a closed loop of
``concurrency`` requests). ``KvoffOffloadingManager``'s methods are wrapped (class-level) and
every call is written, in call order, as one JSON line (keys in hex, each with the token
position the request's ``ReqContext`` recorded for it)::

    {"ev": "header", "cpu_blocks", "tokens_per_chunk", "block_size", "policy", ...}
    {"ev": "new", "req"}                                         on_new_request
    {"ev": "lookup", "req", "key": [hex, pos], "result": "HIT"}  lookup (the engine's answer)
    {"ev": "round", "req", "computed", "result", "keys"}         one get_num_new_matched_tokens
    {"ev": "prepare_load", "req", "keys"}
    {"ev": "complete_load", "req", "keys"}
    {"ev": "prepare_store", "req", "keys", "stored", "evicted"}  stored None: no room
    {"ev": "complete_store", "req", "keys", "success"}
    {"ev": "touch", "req", "keys"}
    {"ev": "finish", "req"}                                      on_request_finished
    {"ev": "update"}                                             update_connector_output
    {"ev": "end", "wall_s", "requests", "metrics"}

``round`` comes from the connector scheduler's ``get_num_new_matched_tokens`` (after its
lookups): the GPU prefix cache's tokens (``computed``), the tokens it answered (``result``,
None: deferred) and every offload key of the request's prompt so far; ``update`` marks the
start of each ``update_connector_output`` (where jobs complete). Neither is a manager call;
both are what the replay needs to place the calls.

**Replay** (:func:`replay_log`). The log gives each request's keys with their positions and
the engine's interleaving of requests. Each manager under test is driven through it with a
fresh ``ReqContext`` per request (positions set from the log), interactively:

* at a request's **admission** (its last ``round`` before its first load, store or finish),
  its keys after the GPU prefix hit are looked up one by one until the first answer that is not
  ``HIT`` (the manager's own answers; a ``HIT_PENDING`` ends the run too and is counted), and
  the hit run is ``prepare_load``-ed; the load completes where the engine completed the
  request's load, else at the next ``update``;
* at each of the engine's ``prepare_store`` calls for the request, the manager is offered the
  request's keys from its own store frontier up to the engine's (vLLM's rule: after a load the
  frontier is the end of the hit run, else 0), so keys in its hit run are never offered and keys
  the engine loaded but this manager missed are; held keys are offered as the engine offers
  them (the managers record them as reuses and store nothing). A refusal (None) leaves the
  frontier where it was: the keys are offered again at the request's next store call, and at its
  finish (as vLLM's store pass for finished requests does); refused there too, they are dropped
  (counted). A store completes where the engine completed the matching job (same keys), with
  its ``success``, else at the next ``update``;
* ``on_request_finished`` where the engine called it; ``touch`` where the engine called it
  (vLLM 0.32 never does).

Counted per manager: lookup hits (blocks; tokens = blocks × tokens per offloaded block),
blocks stored, evictions, refusals, dropped keys; the recorded engine's own hits beside them.
The replay of the manager and policy the engine ran reproduces the engine's hits when the
replay is faithful (``reproduces_record``).

Needs vLLM (the ``vllm`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvoff._optional import require
from kvoff.tools.manager_calls_record import RecordConfig, record_manager_calls

__all__ = [
    "DEFAULT_MANAGERS",
    "ManagerResult",
    "RecordConfig",
    "RecordedLog",
    "add_manager_calls_parser",
    "compare_replays",
    "engine_counts",
    "format_manager_calls",
    "make_manager",
    "parse_managers",
    "read_log",
    "record_manager_calls",
    "replay_log",
    "run_manager_calls_cli",
    "run_replays",
]

DEFAULT_MANAGERS: tuple[tuple[str, str], ...] = (
    ("vllm", "lru"),
    ("vllm", "arc"),
    ("kvoff", "lru"),
    ("kvoff", "arc"),
    ("kvoff", "probation"),
)
"""(implementation, policy) pairs replayed by default: vLLM's ``CPUOffloadingManager`` with
``lru`` and ``arc``, kvoff's ``KvoffOffloadingManager`` with ``lru``, ``arc`` and ``probation``."""

_VLLM_POLICIES = ("lru", "arc")


# ------------------------------------------------------------------------------ the log


@dataclass
class RecordedLog:
    """A parsed manager-call log.

    Attributes:
        header: the ``header`` event (pool slots, tokens per offloaded block, policy, settings).
        events: the events between header and end, in call order, keys as bytes.
        end: the ``end`` event (wall time, vLLM's metrics), or {} when the log has none.
    """

    header: dict[str, Any]
    events: list[dict[str, Any]]
    end: dict[str, Any] = field(default_factory=dict)


def _decode(ev: dict[str, Any]) -> dict[str, Any]:
    """Keys from hex to bytes: ``keys``/``key`` as (bytes, position), stored/evicted as bytes."""
    ev = dict(ev)
    if "keys" in ev:
        ev["keys"] = [(bytes.fromhex(h), p) for h, p in ev["keys"]]
    if "key" in ev:
        h, p = ev["key"]
        ev["key"] = (bytes.fromhex(h), p)
    for name in ("stored", "evicted"):
        if ev.get(name) is not None:
            ev[name] = [bytes.fromhex(h) for h in ev[name]]
    return ev


def read_log(lines: Iterable[str] | Path) -> RecordedLog:
    """Parses a manager-call log (a path or its lines).

    Raises:
        ValueError: no header line first, an unknown event, or a line that is not JSON (the
            message names the line number).
        FileNotFoundError: a path that does not exist.
    """
    if isinstance(lines, Path):
        lines = lines.read_text().splitlines()
    header: dict[str, Any] | None = None
    end: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    known = {"new", "lookup", "round", "prepare_load", "complete_load", "prepare_store",
             "complete_store", "touch", "finish", "update"}  # fmt: skip
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"manager-call log line {n} is not JSON: {exc}") from None
        kind = ev.get("ev")
        if header is None:
            if kind != "header":
                raise ValueError(f"manager-call log line {n}: expected the header, got {kind!r}")
            header = ev
        elif kind == "end":
            end = ev
        elif kind in known:
            events.append(_decode(ev))
        else:
            raise ValueError(f"manager-call log line {n}: unknown event {kind!r}")
    if header is None:
        raise ValueError("the manager-call log is empty (no header line)")
    return RecordedLog(header=header, events=events, end=end)


# ------------------------------------------------------------------------------ replay


def make_manager(kind: str, policy: str, num_blocks: int) -> Any:
    """A fresh manager under test: ``vllm`` (``vllm.v1.kv_offload.cpu.manager.
    CPUOffloadingManager``, policies lru and arc) or ``kvoff`` (``KvoffOffloadingManager``),
    ``num_blocks`` slots, no events.

    Raises:
        ValueError: an unknown kind or policy (naming the choices).
    """
    if kind == "vllm":
        if policy not in _VLLM_POLICIES:
            raise ValueError(f"vLLM's manager has policies {list(_VLLM_POLICIES)}, not {policy!r}")
        require("vllm", "replaying manager calls on vLLM's manager (kvoff bench manager-calls)")
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        return CPUOffloadingManager(num_chunks=num_blocks, cache_policy=policy, enable_events=False)
    if kind == "kvoff":
        from kvoff.integrations.vllm import KvoffOffloadingManager

        return KvoffOffloadingManager(num_blocks, policy, False)
    raise ValueError(f"unknown manager {kind!r}: use 'vllm' or 'kvoff'")


@dataclass
class ManagerResult:
    """One manager's replay.

    Attributes:
        manager: ``vllm`` or ``kvoff``.
        policy: its eviction policy.
        lookup_hit_blocks: blocks its lookups hit at the requests' admissions (and loaded).
        lookup_hit_tokens: ``lookup_hit_blocks`` × tokens per offloaded block.
        lookups: keys looked up.
        pending_stops: hit runs ended by ``HIT_PENDING`` (a block still being stored).
        blocks_stored: blocks whose store completed successfully.
        evictions: blocks evicted by its ``prepare_store`` calls.
        refusals: ``prepare_store`` calls answered None (no room).
        dropped_keys: keys refused at their request's finish too (never stored).
        finish_stores: stores made at a request's finish (keys the engine had no store call
            for: it loaded them, or this manager's earlier offer was refused).
        hits_by_request: request id -> blocks hit.
        evicted_by_call: engine event index -> keys this manager evicted there.
        seconds: wall time of the replay.
    """

    manager: str
    policy: str
    lookup_hit_blocks: int = 0
    lookup_hit_tokens: int = 0
    lookups: int = 0
    pending_stops: int = 0
    blocks_stored: int = 0
    evictions: int = 0
    refusals: int = 0
    dropped_keys: int = 0
    finish_stores: int = 0
    hits_by_request: dict[str, int] = field(default_factory=dict)
    evicted_by_call: dict[int, list[bytes]] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def name(self) -> str:
        """``manager policy``, e.g. ``kvoff lru``."""
        return f"{self.manager} {self.policy}"

    def to_dict(self) -> dict[str, Any]:
        """The counts (without the per-request and per-call detail)."""
        return {
            k: v for k, v in asdict(self).items() if k not in ("hits_by_request", "evicted_by_call")
        }


@dataclass
class _Req:
    """A request's replay state in one manager."""

    ctx: Any
    keys: list[tuple[int, bytes]]  # (position, key), by position
    cursor: int = 0  # store frontier (token position): keys at or below are not offered
    load: list[bytes] | None = None  # keys loaded, until complete_load
    batches: dict[int, list[bytes]] = field(default_factory=dict)  # engine event -> pending


@dataclass
class _Stream:
    """The request stream reconstructed from a log."""

    positions: dict[str, dict[bytes, int]]  # request -> key -> position
    admission: dict[str, int]  # request -> index of its admission round
    engine_loads: set[str]  # requests the engine loaded for
    job_of: dict[int, int]  # engine complete_store event -> its prepare_store event
    has_job: set[int]  # engine prepare_store events whose job completed
    readmissions: int  # rounds after a request's admission (preemptions)


_ACTIONS = frozenset(("prepare_load", "complete_load", "prepare_store", "complete_store",
                      "touch", "finish"))  # fmt: skip


def _stream(log: RecordedLog) -> _Stream:
    positions: dict[str, dict[bytes, int]] = {}
    first_action: dict[str, int] = {}
    for i, ev in enumerate(log.events):
        req = ev.get("req")
        if req is None:
            continue
        known = positions.setdefault(req, {})
        items = ev.get("keys") or ([ev["key"]] if "key" in ev else [])
        for k, p in items:
            if p is not None:
                known.setdefault(k, p)
        if ev["ev"] in _ACTIONS:
            first_action.setdefault(req, i)
    admission: dict[str, int] = {}
    readmissions = 0
    for i, ev in enumerate(log.events):
        if ev["ev"] == "round":
            if i < first_action.get(ev["req"], len(log.events)):
                admission[ev["req"]] = i
            else:
                readmissions += 1
    engine_loads = {ev["req"] for ev in log.events if ev["ev"] == "prepare_load"}
    open_jobs: dict[tuple[str, frozenset[bytes]], list[int]] = {}
    job_of: dict[int, int] = {}
    for i, ev in enumerate(log.events):
        if ev["ev"] == "prepare_store" and ev["stored"]:
            open_jobs.setdefault((ev["req"], frozenset(ev["stored"])), []).append(i)
        elif ev["ev"] == "complete_store":
            waiting = open_jobs.get((ev["req"], frozenset(k for k, _ in ev["keys"])))
            if waiting:
                job_of[i] = waiting.pop(0)
    return _Stream(positions, admission, engine_loads, job_of, set(job_of.values()), readmissions)


def replay_log(
    log: RecordedLog,
    manager: Any,
    name: tuple[str, str],
    *,
    stream: _Stream | None = None,
) -> ManagerResult:
    """Drives ``manager`` (a fresh vLLM ``OffloadingManager``) through the request stream of
    ``log``, interactively, by the rules of the module docstring; returns its counts.

    Args:
        log: the recorded log (:func:`read_log`).
        manager: the manager under test (:func:`make_manager`), empty.
        name: (implementation, policy) for the result.
        stream: the log's reconstructed stream (made here when None; pass one to share it
            between managers).

    Raises:
        KeyError: a log whose events do not fit together (a completion for a request the log
            never started).
        ValueError, AssertionError: what kvoff's (ValueError) or vLLM's (AssertionError)
            manager raises on a call the log makes impossible (a load of a block it does not
            hold cannot happen: loads follow this manager's own lookups).
    """
    require("vllm", "replaying manager calls (kvoff bench manager-calls)")
    from vllm.v1.kv_offload.base import ReqContext

    s = stream or _stream(log)
    chunk = int(log.header["tokens_per_chunk"])
    res = ManagerResult(manager=name[0], policy=name[1])
    reqs: dict[str, _Req] = {}
    at_update: list[tuple[str, str, list[bytes]]] = []  # (kind, request, keys)
    start = time.perf_counter()

    def req_of(rid: str) -> _Req:
        r = reqs.get(rid)
        if r is None:  # a request the log has no on_new_request for: start it here
            r = reqs[rid] = _new(rid)
        return r

    def _new(rid: str) -> _Req:
        ctx = ReqContext(req_id=rid)
        pos = s.positions.get(rid, {})
        for k, p in pos.items():
            ctx.set_offload_key_position(k, p)
        manager.on_new_request(ctx)
        return _Req(ctx=ctx, keys=sorted((p, k) for k, p in pos.items()))

    def offer(r: _Req, frontier: int) -> tuple[list[bytes], Any] | None:
        keys = [k for p, k in r.keys if r.cursor < p <= frontier]
        if not keys:
            return None
        out = manager.prepare_store(keys, r.ctx)
        if out is None:
            res.refusals += 1
            return keys, None
        r.cursor = frontier
        res.evictions += len(out.evicted_keys)
        return keys, out

    def complete(kind: str, r: _Req, keys: list[bytes], success: bool = True) -> None:
        if kind == "load":
            manager.complete_load(keys, r.ctx)
        else:
            manager.complete_store(keys, r.ctx, success)
            if success:
                res.blocks_stored += len(keys)

    for i, ev in enumerate(log.events):
        kind = ev["ev"]
        rid = ev.get("req")
        if kind == "update":
            todo, at_update[:] = list(at_update), []
            for what, req_id, keys in todo:
                r = reqs[req_id]
                complete(what, r, keys)
                if what == "load":
                    r.load = None
        elif kind == "new":
            if rid not in reqs:
                reqs[rid] = _new(rid)
        elif kind == "round" and s.admission.get(rid) == i:
            r = req_of(rid)
            run: list[bytes] = []
            for p, k in r.keys:
                if p <= ev["computed"] or p > max((q for _, q in ev["keys"]), default=0):
                    continue
                res.lookups += 1
                answer = manager.lookup(k, r.ctx).name
                if answer != "HIT":
                    res.pending_stops += answer in ("HIT_PENDING", "RETRY")
                    break
                run.append(k)
            res.hits_by_request[rid] = len(run)
            if run:
                manager.prepare_load(run, r.ctx)
                r.load = run
                r.cursor = r.ctx.get_offload_key_position(run[-1])
                res.lookup_hit_blocks += len(run)
                if rid not in s.engine_loads:
                    at_update.append(("load", rid, run))
        elif kind == "complete_load":
            r = req_of(rid)
            if r.load is not None and ("load", rid, r.load) not in at_update:
                complete("load", r, r.load)
                r.load = None
        elif kind == "prepare_store":
            r = req_of(rid)
            frontier = max((p for _, p in ev["keys"] if p is not None), default=0)
            made = offer(r, frontier)
            if made is not None and made[1] is not None:
                out = made[1]
                if out.evicted_keys:
                    res.evicted_by_call[i] = [bytes(k) for k in out.evicted_keys]
                stored = list(out.keys_to_store)
                if stored:
                    if i in s.has_job:
                        r.batches[i] = stored
                    else:
                        at_update.append(("store", rid, stored))
        elif kind == "complete_store":
            j = s.job_of.get(i)
            r = req_of(rid)
            if j is not None and j in r.batches:
                complete("store", r, r.batches.pop(j), bool(ev.get("success", True)))
        elif kind == "touch":
            manager.touch([k for k, _ in ev["keys"]], req_of(rid).ctx)
        elif kind == "finish":
            r = req_of(rid)
            if r.keys and r.cursor < r.keys[-1][0]:
                made = offer(r, r.keys[-1][0])
                if made is not None:
                    keys, out = made
                    if out is None:
                        res.dropped_keys += len(keys)
                    else:
                        res.finish_stores += 1
                        if out.evicted_keys:
                            res.evicted_by_call[i] = [bytes(k) for k in out.evicted_keys]
                        if out.keys_to_store:
                            at_update.append(("store", rid, list(out.keys_to_store)))
            manager.on_request_finished(r.ctx)
    for what, req_id, keys in at_update:  # after the last update: complete what is left
        complete(what, reqs[req_id], keys)
    for r in reqs.values():
        for keys in r.batches.values():
            complete("store", r, keys)
    res.lookup_hit_tokens = res.lookup_hit_blocks * chunk
    res.seconds = time.perf_counter() - start
    return res


def engine_counts(log: RecordedLog) -> dict[str, Any]:
    """The recorded engine's own counts: hit blocks and tokens at admissions (its answers),
    blocks loaded, stored (completed successfully) and evicted, refusals, requests."""
    s = _stream(log)
    chunk = int(log.header["tokens_per_chunk"])
    hit_tokens = sum(int(log.events[i]["result"] or 0) for i in s.admission.values())
    loaded = sum(len(e["keys"]) for e in log.events if e["ev"] == "prepare_load")
    stored = sum(len(e["keys"]) for e in log.events
                 if e["ev"] == "complete_store" and e.get("success", True))  # fmt: skip
    stores = [e for e in log.events if e["ev"] == "prepare_store"]
    return {
        "requests": sum(1 for e in log.events if e["ev"] == "new"),
        "lookup_hit_blocks": hit_tokens // chunk,
        "lookup_hit_tokens": hit_tokens,
        "blocks_loaded": loaded,
        "blocks_stored": stored,
        "evictions": sum(len(e["evicted"]) for e in stores),
        "refusals": sum(1 for e in stores if e["stored"] is None),
        "readmissions": s.readmissions,
    }


def _request_order(rid: str) -> tuple[int, str]:
    """Sorts ``req-12`` after ``req-9``."""
    tail = rid.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else -1, rid)


def compare_replays(log: RecordedLog, a: ManagerResult, b: ManagerResult) -> dict[str, Any]:
    """Where two replays part: requests whose hits differ, the engine's store calls at which
    they evicted different keys (the first few, with each key's request and position, and
    which of the two still held it at the first differing admission after), and totals.
    """
    owner: dict[bytes, tuple[str, int]] = {}
    for ev in log.events:
        if ev["ev"] == "prepare_store" and ev["stored"]:
            pos = dict(ev["keys"])
            for k in ev["stored"]:
                owner.setdefault(k, (ev["req"], pos.get(k)))

    def who(k: bytes) -> dict[str, Any]:
        req, pos = owner.get(k, (None, None))
        return {"key": k.hex()[:16], "stored_by": req, "position": pos}

    diff_reqs = [
        {"req": rid, a.name: a.hits_by_request.get(rid, 0), b.name: b.hits_by_request.get(rid, 0)}
        for rid in a.hits_by_request.keys() | b.hits_by_request.keys()
        if a.hits_by_request.get(rid, 0) != b.hits_by_request.get(rid, 0)
    ]
    diff_reqs.sort(key=lambda d: _request_order(str(d["req"])))
    calls = sorted(a.evicted_by_call.keys() | b.evicted_by_call.keys())
    differing = []
    only_a_total = only_b_total = 0
    for i in calls:
        ea, eb = set(a.evicted_by_call.get(i, ())), set(b.evicted_by_call.get(i, ()))
        if ea != eb:
            only_a_total += len(ea - eb)
            only_b_total += len(eb - ea)
            if len(differing) < 5:
                differing.append({
                    "event": i, "req": log.events[i].get("req"),
                    f"only {a.name} evicted": [who(k) for k in sorted(ea - eb)][:8],
                    f"only {b.name} evicted": [who(k) for k in sorted(eb - ea)][:8],
                })  # fmt: skip
    return {
        "a": a.name,
        "b": b.name,
        "hit_blocks": {a.name: a.lookup_hit_blocks, b.name: b.lookup_hit_blocks},
        "requests_with_different_hits": len(diff_reqs),
        "first_requests_with_different_hits": diff_reqs[:10],
        "requests_more_hits": {
            a.name: sum(1 for d in diff_reqs if d[a.name] > d[b.name]),
            b.name: sum(1 for d in diff_reqs if d[b.name] > d[a.name]),
        },
        "store_calls_with_different_evictions": sum(
            1
            for i in calls
            if set(a.evicted_by_call.get(i, ())) != set(b.evicted_by_call.get(i, ()))
        ),
        "keys_only_evicted_by": {a.name: only_a_total, b.name: only_b_total},
        "first_differing_store_calls": differing,
    }


def parse_managers(text: str) -> tuple[tuple[str, str], ...]:
    """``vllm:lru,kvoff:probation,...`` -> ((kind, policy), ...).

    Raises:
        ValueError: an entry that is not ``kind:policy`` with a known kind and policy.
    """
    from kvoff.config import EVICTION_POLICIES

    out = []
    for item in (t.strip() for t in text.split(",")):
        kind, _, policy = item.partition(":")
        ok = (kind == "vllm" and policy in _VLLM_POLICIES) or (
            kind == "kvoff" and policy in EVICTION_POLICIES
        )
        if not ok:
            raise ValueError(
                f"manager {item!r}: use vllm:{{{','.join(_VLLM_POLICIES)}}} or "
                f"kvoff:{{{','.join(EVICTION_POLICIES)}}}, comma-separated"
            )
        out.append((kind, policy))
    return tuple(dict.fromkeys(out))


def run_replays(
    log: RecordedLog, managers: Sequence[tuple[str, str]] = DEFAULT_MANAGERS
) -> dict[str, Any]:
    """Replays ``log`` into each of ``managers`` (fresh, with the recorded pool's slots) and
    puts the results together: ``{"engine", "managers": [...], "reproduces_record",
    "divergence"}`` (each manager's counts with ``ratio_to_vllm_lru``; the divergence of kvoff
    lru from vLLM lru when both ran, see :func:`compare_replays`).

    Raises:
        ValueError: as :func:`replay_log` and :func:`make_manager`.
    """
    n = int(log.header["cpu_blocks"])
    stream = _stream(log)
    results = [replay_log(log, make_manager(k, p, n), (k, p), stream=stream) for k, p in managers]
    base = next((r for r in results if r.name == "vllm lru"), None)
    engine = engine_counts(log)
    rows = []
    for r in results:
        row = r.to_dict()
        row["ratio_to_vllm_lru"] = (
            r.lookup_hit_blocks / base.lookup_hit_blocks
            if base and base.lookup_hit_blocks
            else None
        )
        rows.append(row)
    recorded = (log.header.get("manager", "kvoff"), log.header.get("policy"))
    same = next((r for r in results if (r.manager, r.policy) == recorded), None)
    out: dict[str, Any] = {
        "engine": engine,
        "managers": rows,
        "reproduces_record": None
        if same is None
        else same.lookup_hit_blocks == engine["lookup_hit_blocks"],
    }
    kv = next((r for r in results if r.name == "kvoff lru"), None)
    if base is not None and kv is not None:
        out["divergence"] = compare_replays(log, kv, base)
    return out


def format_manager_calls(doc: dict[str, Any]) -> str:
    """The text table of a result (:func:`run_replays` plus ``settings`` and ``record``)."""
    st, rec, eng = doc["settings"], doc["record"], doc["replay"]["engine"]
    lines = [
        f"manager calls: {rec['requests']} requests of {st['trace']!r} through vLLM "
        f"(OffloadingConnector + KvoffOffloadingSpec, kvoff {rec['policy']}), "
        f"{rec['cpu_blocks']} CPU slots of {rec['tokens_per_chunk']} tokens; recorded in "
        f"{rec['wall_s']:.1f} s, {rec['calls']:,} calls",
        f"{'manager':<18} {'hit blocks':>10} {'hit tokens':>11} {'vs vLLM lru':>11} "
        f"{'stored':>8} {'evictions':>9} {'refused':>8} {'dropped':>8} {'pend.stop':>9}",
        f"{'engine (recorded)':<18} {eng['lookup_hit_blocks']:>10,} "
        f"{eng['lookup_hit_tokens']:>11,} {'':>11} {eng['blocks_stored']:>8,} "
        f"{eng['evictions']:>9,} {eng['refusals']:>8,} {'':>8} {'':>9}",
    ]
    for r in doc["replay"]["managers"]:
        ratio = r["ratio_to_vllm_lru"]
        lines.append(
            f"{r['manager'] + ' ' + r['policy']:<18} {r['lookup_hit_blocks']:>10,} "
            f"{r['lookup_hit_tokens']:>11,} {('-' if ratio is None else f'{ratio:.3f}x'):>11} "
            f"{r['blocks_stored']:>8,} {r['evictions']:>9,} {r['refusals']:>8,} "
            f"{r['dropped_keys']:>8,} {r['pending_stops']:>9,}"
        )
    rep = doc["replay"]["reproduces_record"]
    if rep is not None:
        lines.append(f"replay of the recorded manager reproduces the engine's hits: {rep}")
    d = doc["replay"].get("divergence")
    if d:
        lines.append(
            f"{d['a']} vs {d['b']}: {d['requests_with_different_hits']} requests hit "
            f"differently ({d['requests_more_hits']}); "
            f"{d['store_calls_with_different_evictions']} store calls evicted differently"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the CLI


def add_manager_calls_parser(bench_sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff bench manager-calls`` on the ``bench`` subparsers."""
    p = bench_sub.add_parser(
        "manager-calls",
        help="the spec path's manager calls recorded from a real vLLM engine, replayed into "
        "vLLM's CPUOffloadingManager and kvoff's: lookup hits per manager and policy",
        description=(
            "Record every OffloadingManager call of a real vLLM engine (vLLM's "
            "OffloadingConnector over KvoffOffloadingSpec, a tiny random model, a bundled "
            "trace), then replay the request stream interactively into vLLM's "
            "CPUOffloadingManager (lru, arc) and kvoff's KvoffOffloadingManager (lru, arc, "
            "probation) with the same number of slots: lookup hits, blocks stored, evictions. "
            "See kvoff/tools/bench_manager_calls.py."
        ),
    )
    pos = _positive
    p.add_argument("--trace", default="conversation", help="bundled trace or JSONL path "
                   "(default: conversation)")  # fmt: skip
    p.add_argument("--limit", type=pos, default=500, help="requests (default: 500)")
    p.add_argument("--cpu-blocks", type=pos, default=4096,
                   help="CPU pool slots, one offloaded block each (default: 4096)")  # fmt: skip
    p.add_argument("--managers", type=_managers_arg, default=DEFAULT_MANAGERS,
                   metavar="KIND:POLICY,...", help="managers replayed (default: "
                   + ",".join(f"{k}:{q}" for k, q in DEFAULT_MANAGERS) + ")")  # fmt: skip
    p.add_argument("--record-policy", default="lru",
                   help="kvoff's policy in the recorded engine (default: lru)")  # fmt: skip
    p.add_argument("--max-tokens", type=pos, default=16, help="tokens generated per request "
                   "(default: 16)")  # fmt: skip
    p.add_argument("--tokens-per-hash", type=pos, default=32,
                   help="prompt tokens per trace hash id (default: 32)")  # fmt: skip
    p.add_argument("--trace-block-size", type=pos, default=512,
                   help="tokens per hash id in the trace (default: 512)")  # fmt: skip
    p.add_argument("--concurrency", type=pos, default=8, help="requests in flight (default: 8)")
    p.add_argument("--gpu-blocks", type=pos, default=None, help="vLLM's num_gpu_blocks_override "
                   "(default: room for --concurrency of the longest requests)")  # fmt: skip
    p.add_argument("--block-size", type=pos, default=32, help="tokens per block (default: 32)")
    p.add_argument("--engine-model", default="llama", help="tiny model kind or model folder "
                   "(one KV cache group; default: llama)")  # fmt: skip
    p.add_argument("--dtype", default="float32", help="the engine's dtype (default: float32)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--record-only", type=Path, default=None, metavar="FILE",
                       help="record the log into FILE and stop")  # fmt: skip
    split.add_argument("--from-log", type=Path, default=None, metavar="FILE",
                       help="replay the log in FILE (no engine run)")  # fmt: skip
    p.add_argument("--keep-log", type=Path, default=None, metavar="FILE",
                   help="also keep the recorded log in FILE")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="write the results as JSON to FILE")  # fmt: skip


def _managers_arg(text: str) -> tuple[tuple[str, str], ...]:
    """An argparse type: :func:`parse_managers`, its error as argparse's."""
    try:
        return parse_managers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def run_manager_calls_cli(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """``kvoff bench manager-calls``: record (unless ``--from-log``), replay (unless
    ``--record-only``), print the table, write ``--json``. Returns the exit code (0).

    Raises:
        ValueError: bad settings (a policy kvoff does not have, ...).
        FileNotFoundError: a ``--from-log`` file that does not exist.
        RuntimeError: the engine run failed.
    """
    from kvoff.config import EVICTION_POLICIES
    from kvoff.tools.bench import run_info

    if args.from_log is not None and args.keep_log is not None:
        raise ValueError("--keep-log keeps a recorded log; with --from-log nothing is recorded")
    if args.record_policy not in EVICTION_POLICIES:
        raise ValueError(
            f"--record-policy {args.record_policy!r}: choose one of {list(EVICTION_POLICIES)}"
        )
    log_msg = lambda m: print(f"  {m}", file=sys.stderr, flush=True)  # noqa: E731
    settings = {
        "trace": args.trace, "limit": args.limit, "cpu_blocks": args.cpu_blocks,
        "record_policy": args.record_policy, "max_tokens": args.max_tokens,
        "tokens_per_hash": args.tokens_per_hash, "trace_block_size": args.trace_block_size,
        "concurrency": args.concurrency, "gpu_blocks": args.gpu_blocks,
        "block_size": args.block_size, "engine_model": args.engine_model, "dtype": args.dtype,
        "managers": [f"{k}:{q}" for k, q in args.managers],
    }  # fmt: skip
    record_wall = None
    with tempfile.TemporaryDirectory(prefix="kvoff-manager-calls-") as tmp:
        if args.from_log is not None:
            if not args.from_log.is_file():
                raise FileNotFoundError(f"--from-log {args.from_log}: no such file")
            log_path = args.from_log
        else:
            log_path = args.record_only or args.keep_log or Path(tmp) / "calls.jsonl"
            config = RecordConfig(
                trace=args.trace, limit=args.limit, trace_block_size=args.trace_block_size,
                tokens_per_hash=args.tokens_per_hash, max_tokens=args.max_tokens,
                concurrency=args.concurrency, block_size=args.block_size,
                num_gpu_blocks=args.gpu_blocks, cpu_blocks=args.cpu_blocks,
                eviction_policy=args.record_policy, model=args.engine_model, dtype=args.dtype,
            )  # fmt: skip
            record_wall = record_manager_calls(config, log_path, log=log_msg)
            log_msg(f"recorded in {record_wall:.1f} s into {log_path}")
            if args.record_only is not None:
                print(f"manager-call log written to {log_path}")
                return 0
        log = read_log(log_path)
        if args.from_log is not None:  # the recorded settings, not this command's defaults
            recorded = log.header.get("config", {})
            settings.update({k: recorded[k] for k in settings if k in recorded})
            settings.update(gpu_blocks=recorded.get("num_gpu_blocks"),
                            engine_model=recorded.get("model"),
                            record_policy=log.header.get("policy"))  # fmt: skip
            settings["from_log"] = str(args.from_log)
        log_msg(f"replaying {len(log.events):,} calls into {len(args.managers)} managers")
        replay = run_replays(log, args.managers)
    h = log.header
    record = {
        "requests": int(log.end.get("requests", replay["engine"]["requests"])),
        "policy": h.get("policy"),
        "cpu_blocks": int(h["cpu_blocks"]),
        "cpu_bytes_to_use": h.get("cpu_bytes_to_use"),
        "tokens_per_chunk": int(h["tokens_per_chunk"]),
        "block_size": h.get("block_size"),
        "model": h.get("model"),
        "engine": h.get("engine"),
        "wall_s": log.end.get("wall_s", 0.0),
        "child_wall_s": record_wall,
        "input_tokens": log.end.get("input_tokens"),
        "calls": len(log.events),
        "vllm_metrics": log.end.get("metrics"),
    }
    doc = {"run": run_info(argv), "settings": settings, "record": record, "replay": replay}
    print(format_manager_calls(doc))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"  JSON written to {args.json}")
    return 0
