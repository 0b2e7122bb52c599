"""The node pool's calls: what each frame an engine sends does to the pool's index.

:class:`PoolCalls` is the half of :class:`kvoff.node_pool.server.NodePoolServer` that answers
frames (look-ups with their chains and leases, loads, stores into granted or reserved slots,
completions, touches, KV events), checking each against what the connection holds; the server
half owns the sockets, the regions and the lifetimes, and calls :meth:`PoolCalls._handle` for
every whole frame it reads. :class:`AttachedEngine` is what the pool knows of one connection.
The module docstring of :mod:`kvoff.node_pool.server` gives the design (round trips, leases,
KV events, tiers).
"""

from __future__ import annotations

import selectors
import socket
import struct
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from kvoff.node_pool import protocol as p
from kvoff.node_pool.key_filter import PoolKeyFilter
from kvoff.node_pool.successors import SuccessorMap

__all__ = ["MAX_PROBE_BLOCKS", "AttachedEngine", "PoolCalls"]

MAX_PROBE_BLOCKS = 64
"""Keys of a chain the tiers are asked for at once (a look-up that misses the slots)."""


@dataclass
class AttachedEngine:
    """What the pool knows of one connection: an engine (or a tool) attached to it, what it
    holds (pins, leases, stores in flight, reserved slots), its KV events and its counts."""

    sock: socket.socket
    pid: int
    uid: int
    name: str = ""
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)
    pins: Counter[bytes] = field(default_factory=Counter)  # key -> loads in flight
    leases: dict[bytes, tuple[float, int]] = field(default_factory=dict)  # key -> (until, slot)
    storing: set[bytes] = field(default_factory=set)  # keys it is storing
    reserved: deque[int] = field(default_factory=deque)  # slots reserved for it, in grant order
    # keys it stores into a reserved slot that another engine had stored already: the slot,
    # freed at the key's completion
    duplicates: dict[bytes, int] = field(default_factory=dict)
    calls: int = 0
    lookups: int = 0
    looked_up_keys: int = 0
    hit_keys: int = 0
    stored_keys: int = 0
    loaded_keys: int = 0
    errors: int = 0
    answered_ahead: int = 0  # look-ups the engine answered itself (look-ahead, key filter)
    prefix: bytes | None = None  # its layout's key prefix, once it takes KV events
    # (removed, keys, the name of the engine whose call made the event: "" the pool's own)
    events: deque[tuple[bool, list[bytes], str]] = field(default_factory=deque)
    event_keys: int = 0  # keys in events
    events_dropped: int = 0
    since: float = field(default_factory=time.time)
    mask: int = selectors.EVENT_READ


class PoolCalls:
    """The frames' meaning, on the server's state (a base of
    :class:`~kvoff.node_pool.server.NodePoolServer`, which sets the attributes below and
    answers ``HELLO`` and ``STATUS`` with its ``describe()``, ``counts()`` and ``status()``).

    Attributes:
        manager: the index, kvoff's C++ manager (:class:`kvoff._scheduler.CPUOffloadingManager`).
        successors: which key followed which (``LOOKUP_AHEAD``'s chains).
        key_filter: the index's keys in shared memory for the engines' look-ups (None with
            tiers).
        tiered: the tiers below the slots (:class:`kvoff.tiers.coordinator.TieredPool`), or
            None.
        lease_s: seconds a look-up's ready keys stay pinned for the engine that asked.
        reserve_max: slots one engine may hold reserved (0: ``RESERVE`` is refused).
        evictions: blocks evicted for the engines' stores and reservations.
        reserved_stores: keys stored into reserved slots.
    """

    manager: Any
    successors: SuccessorMap
    key_filter: PoolKeyFilter | None
    tiered: Any
    lease_s: float
    reserve_max: int
    evictions: int
    reserved_stores: int

    def _handle(self, eng: AttachedEngine, op: int, rid: int, payload: bytes) -> bytes:
        eng.calls += 1
        base = op & ~p.NO_REPLY
        try:
            if op & p.NO_REPLY and base not in p.NO_REPLY_OPS:
                raise p.ProtocolError(f"op {base} always has a reply; send it without NO_REPLY")
            reply = self._call(eng, base, payload)
        except (p.ProtocolError, ValueError, TypeError, KeyError) as e:
            eng.errors += 1
            return p.frame(p.ERROR, rid, f"{p.OPS.get(base, base)}: {e}".encode())
        return b"" if op & p.NO_REPLY else p.frame(base | p.REPLY, rid, reply)

    def _call(self, eng: AttachedEngine, op: int, payload: bytes) -> bytes:
        m = self.manager
        if op == p.HELLO:
            hello = p.decode_json(payload)
            if not isinstance(hello, dict):
                raise p.ProtocolError("hello payload must be a JSON object")
            eng.name = str(hello.get("name", ""))[:200]
            return p.encode_json(self.describe())
        if op == p.STATUS:
            return p.encode_json(self.counts() if payload == p.STATUS_COUNTS else self.status())
        if op == p.COMPLETE_STORE:
            if len(payload) < 1:
                raise p.ProtocolError("complete_store needs a success byte and keys")
            keys, end = p.decode_keys(payload, 1)
            self._check_end(payload, end)
            return self._complete_store(eng, keys, bool(payload[0]))
        if op == p.RESERVE:
            return self._reserve(eng, payload)
        if op == p.STORE_RESERVED:
            return self._store_reserved(eng, payload)
        if op == p.LOOKUP_AHEAD:
            return self._lookup_ahead(eng, payload)
        if op == p.REPORT_LOOKUPS:
            if len(payload) != 8:
                raise p.ProtocolError(f"report_lookups needs 8 bytes, got {len(payload)}")
            answered, answered_hits = struct.unpack("<II", payload)
            if answered_hits > answered:
                raise p.ProtocolError(f"{answered_hits} hits of {answered} look-ups reported")
            self._count_answered(eng, answered, answered_hits)
            return b""
        if op == p.TAKE_EVENTS:
            if len(payload) != 8:
                raise p.ProtocolError(
                    f"take_events needs the 8-byte key prefix, got {len(payload)}"
                )
            eng.prefix = payload
            out, size = [], 0
            while eng.events and size < p.MAX_PAYLOAD_BYTES // 4:  # the rest: next call
                removed, keys, by = eng.events.popleft()
                eng.event_keys -= len(keys)
                name = by.encode()[:255]
                out.append(
                    (b"\x01" if removed else b"\x00") + bytes([len(name)]) + name
                    + p.encode_keys(keys)
                )  # fmt: skip
                size += len(out[-1])
            head = struct.pack("<QI", eng.events_dropped, len(out))
            eng.events_dropped = 0
            return head + b"".join(out)
        keys, end = p.decode_keys(payload)
        if op == p.TOUCH:  # keys, then optionally one byte per key: reused (1) or not (0)
            rest = payload[end:]
            if rest and len(rest) != len(keys):
                raise p.ProtocolError(f"touch of {len(keys)} keys with {len(rest)} reused flags")
            if rest:
                m.touch(keys, [b != 0 for b in rest])
            else:
                m.touch(keys)
            self.successors.record(keys)
            return b""
        self._check_end(payload, end)
        if op == p.LOOKUP:
            n = m.lookup(keys) if self.tiered is None or not keys else self.tiered.lookup(keys)
            if not keys:  # a client's sync(): nothing to count
                return struct.pack("<q", 0)
            eng.lookups += 1
            eng.looked_up_keys += len(keys)
            eng.hit_keys += n or 0
            return struct.pack("<q", -1 if n is None else n)
        if op == p.PREPARE_LOAD:  # a leased key's pin becomes the load's: it cannot fail
            leases = eng.leases
            taken: set[bytes] = set()  # leased keys this call takes (each once)
            plan: list[int | None] = []  # per key: its leased slot, or None: pin it now
            for k in keys:
                if k in leases and k not in taken:
                    taken.add(k)
                    plan.append(leases[k][1])
                else:
                    plan.append(None)
            fresh = [k for k, slot in zip(keys, plan, strict=True) if slot is None]
            got = iter(m.prepare_load(fresh) if fresh else ())  # raises: nothing changed
            slots = [next(got) if slot is None else slot for slot in plan]
            for k in taken:
                del leases[k]
            eng.pins.update(keys)
            eng.loaded_keys += len(keys)
            return p.encode_slots(slots)
        if op == p.COMPLETE_LOAD:
            need = Counter(keys)
            short = [k.hex() for k, c in need.items() if eng.pins[k] < c]
            if short:
                raise ValueError(
                    f"keys {short[:4]} are not being loaded by this engine (as often as given); "
                    "complete only the keys prepare_load pinned for it"
                )
            m.complete_load(keys)
            pins = eng.pins
            for k, c in need.items():  # the zero counts go (a rebuilt Counter costs O(pins))
                if pins[k] == c:
                    del pins[k]
                else:
                    pins[k] -= c
            return b""
        if op == p.PREPARE_STORE:  # reply: 0 (no room) and every key's state, or 1, the
            out = m.prepare_store(keys)  # stored keys' indices, their slots, evicted, states
            if out is None:
                return b"\x00" + p.encode_states(self._states(keys))
            self.evictions += len(out.evicted_keys)
            if self.tiered is None:  # with tiers the evicted keys' chains stay for probes
                self.successors.forget(out.evicted_keys)
            to_store = list(out.keys_to_store)  # in the call's order: a subsequence of keys
            eng.storing.update(to_store)
            if self.key_filter is not None:  # before the reply: then no engine misses them
                self.key_filter.remove(out.evicted_keys)
                self.key_filter.add(to_store)
            self.successors.record(keys)
            states = [p.STATE_PENDING] * len(keys)
            others: list[int] = []
            if len(to_store) == len(keys):  # the usual case: every key is new
                index = list(range(len(keys)))
            else:
                index, j = [], 0
                for i, k in enumerate(keys):
                    if j < len(to_store) and k == to_store[j]:
                        index.append(i)
                        j += 1
                    else:
                        others.append(i)
            if others:
                for i, st in zip(others, self._states([keys[i] for i in others]), strict=True):
                    states[i] = st
            return (
                b"\x01"
                + p.encode_slots(index)
                + p.encode_slots(list(out.block_ids))
                + p.encode_keys(list(out.evicted_keys))
                + p.encode_states(states)
            )
        raise p.ProtocolError(f"unknown op {op}")

    def _complete_store(self, eng: AttachedEngine, keys: list[bytes], success: bool) -> bytes:
        """Ends the engine's stores of ``keys``; a key it stored into a reserved slot while
        another engine's copy was held frees that slot."""
        given = set(keys)
        dups = eng.duplicates
        if len(given) != len(keys) or not given <= (eng.storing | dups.keys()):
            unknown = [k.hex() for k in keys if k not in eng.storing and k not in dups]
            raise ValueError(
                f"keys {unknown[:4]} are not being stored by this engine (or repeat); "
                "complete only the keys prepare_store or store_reserved gave it, once"
            )
        mine = keys if not dups else [k for k in keys if k not in dups]
        if len(mine) != len(keys):
            self.manager.release_reserved([dups.pop(k) for k in keys if k in dups])
        if mine:
            self.manager.complete_store(mine, success)
            eng.storing.difference_update(mine)
        if success:
            eng.stored_keys += len(mine)
        else:
            self.successors.forget(mine)
            if self.key_filter is not None:
                self.key_filter.remove(mine)
        return b""

    def _reserve(self, eng: AttachedEngine, payload: bytes) -> bytes:
        """``RESERVE``: up to the engine's share of free slots (:data:`RESERVE_SHARE`)."""
        if len(payload) != 4:
            raise p.ProtocolError(f"reserve needs count u32, got {len(payload)} bytes")
        (count,) = struct.unpack("<I", payload)
        if self.reserve_max == 0:
            raise ValueError(
                "this pool reserves no slots (it has tiers, an admission filter or "
                "--reserve-blocks 0); store with prepare_store"
            )
        room = self.reserve_max - len(eng.reserved) - len(eng.duplicates)
        got = self.manager.reserve_blocks(min(count, room)) if count and room > 0 else None
        if got is None:
            return b"\x00"
        slots, evicted = got
        eng.reserved.extend(slots)
        if evicted:
            self.evictions += len(evicted)
            self.successors.forget(evicted)
            if self.key_filter is not None:
                self.key_filter.remove(evicted)
        return b"\x01" + p.encode_slots(slots) + p.encode_keys(evicted)

    def _store_reserved(self, eng: AttachedEngine, payload: bytes) -> bytes:
        """``STORE_RESERVED``: the keys become pending in the engine's first reserved slots,
        in grant order (the engine took them in that order); a key held already keeps its
        slot reserved until the engine completes the key."""
        keys, end = p.decode_keys(payload)
        self._check_end(payload, end)
        n, reserved, dups = len(keys), eng.reserved, eng.duplicates
        if n > len(reserved):
            raise p.ProtocolError(
                f"store_reserved of {n} keys with {len(reserved)} slots reserved; store only "
                "into slots a reserve reply gave"
            )
        if not eng.storing.isdisjoint(keys) or (dups and not dups.keys().isdisjoint(keys)):
            raise ValueError("a key this engine is storing already is given again; complete "
                             "its store first")  # fmt: skip
        slots = [reserved[i] for i in range(n)]
        stored = self.manager.store_reserved(keys, slots)  # raises: nothing changed
        for _ in range(n):
            reserved.popleft()
        if len(stored) == n:
            new = keys
        else:
            taken = set(stored)
            new = [keys[i] for i in stored]
            new_keys, spare = set(new), []
            for i, (k, slot) in enumerate(zip(keys, slots, strict=True)):
                if i in taken:
                    continue
                if k in new_keys or k in dups:  # a repeat within the call: free it now
                    spare.append(slot)
                else:
                    dups[k] = slot
            if spare:
                self.manager.release_reserved(spare)
        eng.storing.update(new)
        self.reserved_stores += len(new)
        if self.key_filter is not None:  # before the engine's next call: no engine misses them
            self.key_filter.add(new)
        self.successors.record(keys)
        return b""

    def _states(self, keys: list[bytes]) -> list[int]:
        """Each key's state byte: batched look-ups while they stop at a missing key (a few),
        then one look-up per key (a pending key ends a batched one without saying where)."""
        m = self.manager
        out: list[int] = []
        i = 0
        for _ in range(4):
            n = m.lookup(keys[i:]) if i < len(keys) else None
            if n is None:
                break
            out += [p.STATE_READY] * n
            i += n
            if i < len(keys):  # keys[i] is missing
                out.append(p.STATE_MISSING)
                i += 1
        for k in keys[i:]:
            r = m.lookup([k])
            out.append(p.STATE_PENDING if r is None else p.STATE_READY if r else p.STATE_MISSING)
        return out

    def _states_until_missing(self, chain: list[bytes]) -> list[int]:
        """The state bytes of ``chain``'s keys up to and including its first missing key (one
        batched look-up when none of the leading keys is pending)."""
        n = self.manager.lookup(chain)
        if n is not None:
            return [p.STATE_READY] * n + ([p.STATE_MISSING] if n < len(chain) else [])
        out: list[int] = []
        for st in self._states(chain):  # a pending key among the leading ones: per key
            out.append(st)
            if st == p.STATE_MISSING:
                break
        return out

    def _lookup_ahead(self, eng: AttachedEngine, payload: bytes) -> bytes:
        if len(payload) < 10:
            raise p.ProtocolError("lookup_ahead needs ahead u16, answered u32, hits u32, keys")
        ahead, answered, answered_hits = struct.unpack_from("<HII", payload)
        keys, end = p.decode_keys(payload, 10)
        self._check_end(payload, end)
        if not keys or answered_hits > answered:
            raise p.ProtocolError(
                f"lookup_ahead of {len(keys)} keys with {answered_hits} of {answered} answered "
                "hits; send at least one key and hits <= answered"
            )
        if len(keys) == 1:
            chain = self.successors.walk(keys[0], ahead + 1)
            given_n = 1
        else:  # the engine's chain (each key once), then what followed its last key
            chain = list(dict.fromkeys(keys))
            given_n = len(chain)
            if ahead:
                given = set(chain)
                chain += [k for k in self.successors.walk(chain[-1], ahead + 1)[1:]
                          if k not in given]  # fmt: skip
        states = self._states_until_missing(chain)
        if self.tiered is not None and len(states) <= given_n and states[-1] == p.STATE_MISSING:
            # a given key missing from the slots: ask the tiers for it and what followed it
            # (the map outlives evictions with tiers): "retry later" until the run is
            # promoted, or a miss once answered
            run = self.successors.walk(keys[0], MAX_PROBE_BLOCKS) if len(keys) == 1 else chain
            if self.tiered.lookup_groups([run], poll=False) is None:
                states = [*states[:-1], p.STATE_PENDING]
        chain = chain[: len(states)]
        # lease the ready keys (module docstring): pinned now, renewed when leased already
        leases, until = eng.leases, time.monotonic() + self.lease_s
        ready = [k for k, st in zip(chain, states, strict=True) if st == p.STATE_READY]
        new = [k for k in ready if k not in leases]
        for k, slot in zip(new, self.manager.prepare_load(new) if new else (), strict=True):
            leases[k] = (until, slot)
        for k in ready:
            leases[k] = (until, leases[k][1])
        slots = [leases[k][1] if st == p.STATE_READY else -1
                 for k, st in zip(chain, states, strict=True)]  # fmt: skip
        eng.lookups += 1
        if len(keys) == 1:
            eng.looked_up_keys += 1
            eng.hit_keys += states[0] == p.STATE_READY
        else:  # as one-key look-ups of the given keys in turn: up to the first missing one
            state_of = dict(zip(chain, states, strict=True))
            for k in keys:
                st = state_of.get(k, p.STATE_MISSING)
                eng.looked_up_keys += 1
                eng.hit_keys += st == p.STATE_READY
                if st == p.STATE_MISSING:
                    break
        self._count_answered(eng, answered, answered_hits)
        return p.encode_keys(chain) + p.encode_states(states) + p.encode_slots(slots)

    @staticmethod
    def _count_answered(eng: AttachedEngine, answered: int, hits: int) -> None:
        """Counts look-ups the engine answered itself (look-ahead, key filter)."""
        eng.looked_up_keys += answered
        eng.hit_keys += hits
        eng.answered_ahead += answered

    @staticmethod
    def _check_end(payload: bytes, end: int) -> None:
        if end != len(payload):
            raise p.ProtocolError(f"{len(payload) - end} bytes after the key list")
