"""An engine's side of the node pool: the manager's calls, batched, over the pool's socket.

:class:`NodePoolClient` has the calls of kvoff's manager that an engine's pool side makes
(``lookup``, ``prepare_load``, ``complete_load``, ``prepare_store``, ``complete_store``,
``touch``), so the request loop uses it where it would use a private manager. Keys are
prefixed with 8 bytes of the engine's layout fingerprint (BLAKE2b of it), so engines of
another model, dtype, layout or rank never share a block; keys the pool returns (evictions of
other engines' blocks) keep their prefix.

**Round trips.** vLLM's offloading scheduler looks keys up one at a time, and a round trip
costs about 30 in-process calls. A one-key :meth:`NodePoolClient.lookup` asks the pool for the
key and the chain stored after it (``LOOKUP_AHEAD``); the answers are kept for
``lookahead_s`` seconds or until this client changes the pool, and the next keys of the
request are answered from them. ``prepare_store`` brings back every given key's state too.
Completions and touches are queued and sent with the next call that waits for a reply (or at
:meth:`NodePoolClient.flush`). A kept answer is at most ``lookahead_s`` old. The ready keys a
look-up answers are leased to this connection (pinned by the pool for its ``lease_s``), so
another engine's store cannot evict them before this engine's ``prepare_load``, which then
needs no reply and goes on even when the pool has just gone away (a lease older than
``lease_s / 2`` waits for the pool's reply, and still loads if the pool is gone and the lease
was held when it died). Multi-key look-ups, and one-key look-ups with ``lookahead`` 0, lease
their ready keys too. A ``prepare_load`` of keys not leased (a lease that lapsed) waits for the
pool and raises :class:`NodePoolError` when a key has gone meanwhile or the pool is gone. A
look-up whose first key the pool's key filter rules out (:mod:`kvoff.node_pool.key_filter`) is
a miss with no round trip.

**A pool that is gone is a miss, never an error.** When the socket fails (the pool was stopped
or crashed), every call answers as an empty pool would: ``lookup`` 0, ``prepare_store`` None
(nothing stored), completions dropped; the client tries to reconnect at most every
``retry_s`` seconds. A pool restarted on the same region adopts it (after a crash or a clean
stop alike), and the client attaches again. A reconnected pool that serves another region (a
new shared-memory file: another ``--region`` or size, or the old region was let go by every
process) cannot be used with this engine's mapping: the client stays detached (misses) and
says so once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoff._scheduler import KeyFilter, NodePoolLoads, NodePoolStores
from kvoff.checks import check_flag
from kvoff.node_pool import protocol as p
from kvoff.node_pool.answers import KeptAnswers, Leases
from kvoff.node_pool.key_filter import EngineKeyFilter, attach_key_filter
from kvoff.node_pool.keys import as_bytes, checked_key, checked_keys, reused_flags
from kvoff.node_pool.transport import PoolSocket

__all__ = ["NodePoolClient", "NodePoolError", "NodePoolEvent", "StoreSlots", "wait_for_pool"]

logger = logging.getLogger(__name__)


class NodePoolError(RuntimeError):
    """The node pool refused a call (the message is the pool's) or could not be reached at
    attach time."""


@dataclass(frozen=True)
class NodePoolEvent:
    """A KV event of the node pool for this engine's layout: ``kind`` ``"BlockStored"`` (the
    keys became hits) or ``"BlockRemoved"`` (evicted), ``keys`` this engine's (unprefixed),
    ``by`` the name of the engine whose call made it (the engine that stored the keys, or whose
    store evicted them; this engine's own name for its own; ``""`` for blocks the pool
    promoted from its tiers)."""

    kind: str
    keys: list[bytes]
    by: str = ""

    @property
    def removed(self) -> bool:
        """Whether the keys were evicted."""
        return self.kind == "BlockRemoved"


@dataclass(frozen=True)
class StoreSlots:
    """``prepare_store``'s answer: the keys to store (this engine's, unprefixed), their slots
    (CPU block ids in the region), and the keys evicted to make room (prefixed keys of any
    engine)."""

    keys_to_store: list[bytes]
    block_ids: list[int]
    evicted_keys: list[bytes]
    store_indices: list[int] = field(default_factory=list)
    """Where each of ``keys_to_store`` is in the call's keys (its first occurrence)."""


class NodePoolClient:
    """A connection to ``kvoff pool serve`` at ``socket_path``.

    Args:
        socket_path: the pool's socket.
        fingerprint: this engine's layout fingerprint (model, dtype, layout, rank, block
            sizes: :func:`kvoff.tiers.block_format.layout_fingerprint`).
        name: how ``kvoff pool status`` names this engine.
        timeout_s: seconds a call may take before the pool counts as gone.
        retry_s: seconds between reconnection attempts.
        lookahead: keys of a chain asked for with a one-key look-up (0: ask one key per call).
        lookahead_s: seconds the look-ahead's answers are used (until this client changes
            the pool, at most).
        spin_s: seconds a call spins for its reply before it sleeps on the socket (a
            round trip takes tens of microseconds; waking a sleeping thread as long again).
        key_filter: use the pool's key filter for misses (False: ask the pool for every
            look-up, e.g. to measure the filter; the answers are the same).
        reserve: store without waiting for the pool where it can (:meth:`prepare_store`):
            the pool grants this connection free slots ahead of its stores, up to twice the
            keys of its largest recent step (between two :meth:`take_events`; of its largest
            store for a client that takes no events) and at most the pool's ``reserve_max``
            (1/16 of its slots by default).
            Those slots hold no block meanwhile: an engine's store saves a round trip, the
            pool's index gives up that many slots of capacity; engines set it, tools do not.

    Attributes:
        region, num_slots, slot_bytes, inode: the pool's shared memory, from its hello.
        regions: the shared-memory name of each tensor-parallel rank's slots (``regions[r]``
            holds rank ``r``'s bytes of every block; ``[region]`` with one rank).
        stores_skipped: blocks the manager's admission filter skipped (0: the filter runs in
            the pool; kept for the manager's interface).
        misses_while_detached: calls answered as misses because the pool was gone.
        round_trips: calls that waited for the pool's reply.
        answered_ahead: one-key look-ups answered from a look-ahead reply (no round trip).
        answered_by_filter: look-ups answered as misses by the pool's key filter (no round
            trip; :mod:`kvoff.node_pool.key_filter`).
        loads_on_lease: ``prepare_load`` calls answered from the look-up's leases (no round
            trip).
        stores_on_reservation: ``prepare_store`` calls answered from this connection's
            reserved slots (no round trip; ``reserve``).
        loads_after_loss: ``prepare_load`` calls of leased keys made while the pool went away
            (the load goes on from the leased slots; :meth:`prepare_load`).
        lease_s: seconds the pool leases a look-up's ready keys to this engine.
        events_dropped: KV events the pool dropped because this engine did not take them in
            time (its queue holds 4 keys per slot).
        async_errors: completions or touches sent without a reply that the pool refused
            (logged; they mean a bug, not a bad block).

    Raises:
        NodePoolError: nothing answers at ``socket_path`` (start ``kvoff pool serve``).
        TypeError: ``key_filter`` or ``reserve`` not a bool (naming it).
    """

    def __init__(
        self,
        socket_path: str,
        fingerprint: bytes,
        *,
        name: str = "",
        timeout_s: float = 5.0,
        retry_s: float = 1.0,
        lookahead: int = 256,
        lookahead_s: float = 0.005,
        spin_s: float = 0.0002,
        key_filter: bool = True,
        reserve: bool = False,
    ) -> None:
        check_flag("key_filter", key_filter)
        check_flag("reserve", reserve)
        if not 0 <= lookahead <= 0xFFFF or lookahead_s < 0 or spin_s < 0:
            raise ValueError(
                f"lookahead must be 0..65535 keys, lookahead_s and spin_s >= 0 s, got "
                f"{lookahead}, {lookahead_s} and {spin_s}"
            )
        self.socket_path = socket_path
        self.prefix = hashlib.blake2b(fingerprint, digest_size=8).digest()
        self.name = name or f"pid-{os.getpid()}"
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.lookahead, self.lookahead_s, self.spin_s = lookahead, lookahead_s, spin_s
        self.stores_skipped = 0
        self.misses_while_detached = 0
        self.round_trips = 0
        self.answered_ahead = 0
        self.answered_by_filter = 0
        self.use_key_filter = key_filter
        self._filter: EngineKeyFilter | None = None  # the pool's key filter, mapped
        self.async_errors = 0
        self._known = KeptAnswers(self.prefix, lookahead_s)  # the look-ahead's answers
        self._unreported = [0, 0]  # look-ups answered from _known (and hits) not yet reported
        self._leases = Leases(self.prefix)  # the leases the pool gave this connection
        # the last prepare_store's answer, for key_states: (unprefixed keys, a state byte each)
        self._store_answer: tuple[list[bytes], bytes] | None = None
        self.loads_on_lease = 0
        self.loads_after_loss = 0
        # reserved slots (reserve): the refill asked for and not yet answered (its request
        # id); the grant and the keys evicted for it are in self._stores
        self.reserve = reserve
        self.stores_refused_in_flight = 0
        self._refill_rid: int | None = None
        # the largest store of a call and of a step (keys between two take_events, which an
        # engine calls once a step), both decaying slowly: the reservation's aim
        self._call_peak = 0
        self._step_peak = 0
        self._step_stores = 0
        self._events_on = False
        self.events_dropped = 0
        self._sock: PoolSocket | None = None
        self._next_try = 0.0
        self._region_lost = False
        # the loads in flight (slot and key, this engine's and this connection's pins), in
        # C++: a pool that went away released its connection's pins, so only those are
        # completed on the wire, and the C++ scheduler's node pool manager completes a step's
        # loads (a few hundred keys) through this object without Python
        self._loads = NodePoolLoads(self.prefix)
        # the reservation, the stores in flight (slot and key), their payloads, and the
        # outbox (calls queued without a reply, see _send) with the request ids, in C++: an
        # engine stores ~200 keys a step, and the C++ scheduler's node pool manager
        # (cpp/bindings/node_pool_manager.cpp) stores, completes and touches through this
        # object without Python
        self._stores = NodePoolStores(self.prefix, p.VERSION)
        self._warned_clear = False
        self._counts_at = -1e9
        self._counts_cache: dict[str, Any] = {}
        try:
            hello = self._connect()
        except OSError as e:
            raise NodePoolError(
                f"no node pool answers at {socket_path} ({e}); start one with kvoff pool serve "
                "--socket ... or drop node_pool"
            ) from e
        self.region: str = hello["region"]
        self.regions: list[str] = list(hello.get("regions") or [self.region])
        self.inode: int | None = hello["inode"]
        self.num_slots: int = int(hello["num_slots"])
        try:
            self._stores.set_num_slots(self.num_slots)
            self._loads.set_num_slots(self.num_slots)
        except (ValueError, TypeError, OverflowError) as e:
            self.close()
            raise NodePoolError(f"the node pool at {socket_path} cannot be used: {e}") from e
        self.slot_bytes: int = int(hello["slot_bytes"])
        self.lease_s: float = float(hello.get("lease_s", 0.0))
        self.reserve_max = int(hello.get("reserve_max", 0))

    # ------------------------------------------------------------------ transport
    def _connect(self) -> dict[str, Any]:
        sock = PoolSocket(self.socket_path, self.timeout_s, self.spin_s)
        try:
            self._sock = sock
            self._stores.set_attached(True)
            hello = p.decode_json(self._roundtrip(p.HELLO, p.encode_json({"name": self.name})))
        except BaseException:
            self._sock = None
            self._stores.set_attached(False)
            sock.close()
            raise
        if self._filter is not None:
            self._filter.close()
        self._filter = attach_key_filter(hello.get("key_filter")) if self.use_key_filter else None
        return hello

    def _roundtrip(self, op: int, payload: bytes) -> bytes:
        sock = self._sock
        assert sock is not None
        stores = self._stores
        want = stores.next_request_id()
        # the queued calls go first, in order
        sock.sendall(stores.take_outbox() + p.frame(op, want, payload))
        self.round_trips += 1
        while True:
            rop, rid, body = sock.recv_frame()
            if rid != want and self._take_unawaited(rop, rid, body):
                continue
            if rop == p.ERROR:
                raise NodePoolError(body.decode(errors="replace"))
            if rid != want or rop != op | p.REPLY:
                raise ConnectionError(f"reply {rop}/{rid} to request {op}/{want}")
            return body

    def _take_unawaited(self, rop: int, rid: int, body: bytes) -> bool:
        """Handles a frame no call waits for: the error of a call sent without a reply, or
        the reply to a refill of the reservation. False: not one of them."""
        if rid == self._refill_rid:
            self._refill_rid = None
            if rop == p.RESERVE | p.REPLY and body[:1] == b"\x01":
                slots, off = p.decode_slots(body, 1)
                evicted = p.decode_keys(body, off)[0]
                try:
                    self._stores.add_reserved(slots)
                except ValueError as e:  # a slot the pool does not have
                    raise p.ProtocolError(f"reservation: {e}") from None
                self._stores.add_evicted(evicted)
            elif rop == p.ERROR:
                logger.warning("kvoff node pool refused a reservation: %s",
                               body.decode(errors="replace"))  # fmt: skip
            return True
        if rop == p.ERROR:  # a call sent without a reply failed
            self.async_errors += 1
            logger.error("kvoff node pool refused a call: %s", body.decode(errors="replace"))
            return True
        return False

    def _collect(self) -> None:
        """Takes the frames that came without a call waiting (a refill's reply, errors),
        without waiting for any."""
        sock = self._sock
        if sock is None or (self._refill_rid is None and not sock.buffered):
            return
        try:
            sock.read_ready()
            while (frame := sock.take_frame()) is not None:
                if not self._take_unawaited(*frame):
                    raise ConnectionError(f"reply {frame[0]}/{frame[1]} to no call")
        except (OSError, ConnectionError, p.ProtocolError) as e:
            self._lost(e)

    def _lost(self, e: BaseException) -> None:
        logger.warning("kvoff node pool at %s is gone (%s): misses until it is back",
                       self.socket_path, e)  # fmt: skip
        self._close_socket()

    def _send(self, op: int, payload: bytes, *, now: bool = False) -> None:
        """Queues a call of :data:`protocol.NO_REPLY_OPS`, which the pool answers only when
        it refuses it (an error frame ahead of a later reply). Queued calls go with the next
        call that waits for a reply, at :meth:`flush`, or at once with ``now``; dropped when
        the pool is gone."""
        if op not in _READ_ONLY_OPS:
            self._drop_answers()
        if self._sock is None and not self._reconnect():
            return
        self._stores.queue(op | p.NO_REPLY, payload, False)
        if now or self._stores.outbox_bytes >= _OUTBOX_BYTES:
            self.flush()

    def _drop_answers(self) -> None:
        """Forgets the pool's kept answers (look-ahead, the last prepare_store's states): this
        client is changing the pool, or has lost it."""
        self._known.clear()
        self._store_answer = None

    def _check_answers(self) -> None:
        """Forgets the kept answers when the C++ scheduler queued a call that changes the pool
        (a completion or touch it queues itself) since they were kept."""
        if self._stores.take_changed():
            self._drop_answers()

    def flush(self) -> None:
        """Sends the queued completions, touches and loads of leased keys (one write). The
        engine calls it at the end of every step (:meth:`take_events`), so what it stored is a
        hit for the other engines from then on."""
        if self._sock is None or not self._stores.outbox_bytes:
            return
        data = self._stores.take_outbox()
        try:
            self._sock.sendall(data)
        except OSError as e:
            self._lost(e)

    def _call(self, op: int, payload: bytes) -> bytes | None:
        """The reply's payload, or None when the pool is gone (the caller answers a miss)."""
        if op not in _READ_ONLY_OPS:
            self._drop_answers()
        if self._sock is None and not self._reconnect():
            self.misses_while_detached += 1
            return None
        try:
            return self._roundtrip(op, payload)
        except (OSError, ConnectionError, p.ProtocolError) as e:
            self._lost(e)
            self.misses_while_detached += 1
            return None

    def _reconnect(self) -> bool:
        if self._region_lost or time.monotonic() < self._next_try:
            return False
        self._next_try = time.monotonic() + self.retry_s
        try:
            hello = self._connect()
        except (OSError, ConnectionError, p.ProtocolError, NodePoolError):
            return False
        same = (hello.get("region"), hello.get("inode"), hello.get("slot_bytes")) == (
            self.region, self.inode, self.slot_bytes,
        )  # fmt: skip
        if not same:
            logger.warning(
                "kvoff node pool at %s serves another region now (%s); this engine maps the "
                "old one and stays detached (misses) until it restarts",
                self.socket_path,
                hello,
            )
            self._region_lost = True
            self._close_socket()
            return False
        self.reserve_max = int(hello.get("reserve_max", 0))
        logger.info("kvoff node pool at %s is back", self.socket_path)
        return True

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._filter is not None:  # the next pool makes a new one
            self._filter.close()
            self._filter = None
        self._loads.lose()  # the pool released this connection's pins
        # the pool released the reservation and stores with the connection; the queued calls
        # go too
        self._stores.lose()
        self._stores.set_attached(False)
        self._leases.clear()
        self._refill_rid = None
        self._drop_answers()

    def close(self) -> None:
        """Sends what is queued and leaves the pool (its pins and stores in flight are released
        by the pool)."""
        self.flush()
        self._close_socket()
        self._region_lost = True

    @property
    def attached(self) -> bool:
        """Whether the last call reached the pool."""
        return self._sock is not None

    # ------------------------------------------------------------------ keys
    def _keys(self, keys: Sequence[bytes]) -> bytes:
        try:
            return p.encode_prefixed_keys(self.prefix, keys)
        except (TypeError, ValueError, OverflowError):  # ProtocolError is a ValueError
            return p.encode_prefixed_keys(self.prefix, checked_keys(keys))

    # ------------------------------------------------------------------ manager calls
    def lookup(self, keys: Sequence[bytes]) -> int | None:
        """Leading keys ready in the pool; None: retry later (one is being stored); 0 when
        the pool is gone. One key: answered from the look-ahead when it is known, else asked
        with its chain (module docstring). Several keys (or ``lookahead`` 0): asked as they
        are, one round trip. Either way the ready keys the pool answers are leased to this
        connection, so their :meth:`prepare_load` survives the pool's going away."""
        if keys.__class__ is not list and keys.__class__ is not tuple:
            keys = checked_keys(keys)  # refuses a single key, None...
        if len(keys) == 1 and self.lookahead:
            return self._lookup_one(checked_key(keys[0], "keys[0]"))
        if not keys:
            return 0
        own = as_bytes(keys)
        if self._filtered_out(own[0]):
            return 0
        answer = self._ask_ahead(own, 0)
        if answer is None:
            return 0
        chain, states = answer
        if p.STATE_PENDING in states:
            return None
        pre = self.prefix
        ready = {k[8:] for k, st in zip(chain, states, strict=True)
                 if st == p.STATE_READY and k[:8] == pre}  # fmt: skip
        return next((i for i, k in enumerate(own) if k not in ready), len(own))

    def lookup_states(self, keys: Sequence[bytes]) -> bytes:
        """Each key's state byte (``protocol.STATE_*``) as one-key :meth:`lookup` calls of
        the keys in turn answer them, up to and including the first missing key: the first
        key not known from a look-ahead is asked with its chain, the rest of a chain the pool
        holds is answered from that reply (one round trip per request, not per key)."""
        out = bytearray()
        if keys.__class__ is not list and keys.__class__ is not tuple:
            keys = checked_keys(keys)  # refuses a single key, None...
        if not self.lookahead:
            for k in keys:
                out.append(_STATE_OF_LOOKUP[self.lookup((k,))])
                if out[-1] == p.STATE_MISSING:
                    break
            return bytes(out)
        self._check_answers()
        known = self._known.current()
        ahead = hits = 0
        for given in keys:
            k = given if given.__class__ is bytes else checked_key(given, "a key")
            st = known.get(k)
            if st is None:
                st = _STATE_OF_LOOKUP[self._lookup_one(k)]
            else:
                ahead += 1
                hits += st == p.STATE_READY
            out.append(st)
            if st == p.STATE_MISSING:
                break
        self.answered_ahead += ahead
        self._unreported[0] += ahead
        self._unreported[1] += hits
        return bytes(out)

    def _lookup_one(self, key: bytes) -> int | None:
        self._check_answers()
        state = self._known.current().get(key)
        if state is not None:
            self.answered_ahead += 1
            self._unreported[0] += 1
            self._unreported[1] += state == p.STATE_READY
        elif self._filtered_out(key):
            return 0
        else:
            answer = self._ask_ahead([key], self.lookahead)
            if answer is None:
                return 0
            chain, states = answer
            self._known.remember(chain, states)
            state = states[0]
        return _LOOKUP_OF_STATE[state]

    def _ask_ahead(self, keys: list[bytes], ahead: int) -> tuple[list[bytes], bytes] | None:
        """One ``LOOKUP_AHEAD`` of ``keys`` and up to ``ahead`` keys after them, carrying the
        unreported look-up counts; its ready keys are leased here. The reply's prefixed keys
        and state bytes, or None when the pool is gone."""
        answered, hits = self._unreported
        head = struct.pack("<HII", ahead, answered, hits)
        reply = self._call(p.LOOKUP_AHEAD, head + self._keys(keys))
        if reply is None:
            return None
        self._unreported = [0, 0]
        chain, off = p.decode_keys(reply)
        states, off = p.decode_states(reply, off, len(chain))
        slots, _ = p.decode_slots(reply, off)
        self._leases.add(chain, states, slots, self.lease_s)
        return chain, states

    def _filtered_out(self, key: bytes) -> bool:
        """Whether the pool's key filter says ``key`` is not in the pool (a miss, counted and
        reported to the pool like a look-ahead answer)."""
        f = self._filter
        if f is None or f.may_contain(self.prefix + key):
            return False
        self.answered_by_filter += 1
        self._unreported[0] += 1
        return True

    def _queue_report(self) -> None:
        """Queues the count of look-ups answered here since the last report, for the pool's
        hit rates."""
        answered, hits = self._unreported
        if answered and self._sock is not None:
            self._unreported = [0, 0]
            body = struct.pack("<II", min(answered, 0xFFFFFFFF), min(hits, 0xFFFFFFFF))
            self._send(p.REPORT_LOOKUPS, body)

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pins the keys (looked up as ready) and returns their slots. Keys a look-up
        leased less than ``lease_s / 2`` ago need no reply. When the pool is gone, keys
        leased more recently than :meth:`_load_after_loss` allows load from their leased slots
        all the same (it says why that is safe).

        Raises:
            NodePoolError: a key not leased and not ready any more, or the pool is gone before
                a load of keys not leased or leased too long ago (the load cannot happen: the
                caller counts it as a failed load). Nothing is pinned.
        """
        keys = checked_keys(keys)
        leases = self._leases
        fresh_after = time.monotonic() - self.lease_s / 2  # a margin to the pool's clock
        # (taken before any call: losing the pool drops the leases)
        leased = leases.snapshot(keys)
        fresh = leases.take_fresh(keys, fresh_after) if self._sock is not None else None
        if fresh is not None:
            # every key is leased to this connection: the pool cannot refuse, no reply needed
            self._send(p.PREPARE_LOAD, self._keys(keys), now=True)  # the lease is running
            if self._sock is not None:
                self.loads_on_lease += 1
                return self._pin(keys, fresh, True)
        else:
            reply = self._call(p.PREPARE_LOAD, self._keys(keys))
            if reply is not None:
                leases.discard(keys)  # the pool used this connection's leases of them
                return self._pin(keys, p.decode_slots(reply)[0], True)
        slots = self._load_after_loss(leased)  # the pool is gone
        if slots is None:
            raise NodePoolError("the node pool is gone: the load cannot be made")
        return self._pin(keys, slots, False)

    def _load_after_loss(self, leased: list[tuple[int, float] | None]) -> list[int] | None:
        """The slots of a load asked for after the pool went away, from its keys' leases
        (``(slot, time leased)`` each, None for a key not leased, as they were before the
        call that found the pool gone); None when one was not leased, or leased
        ``min(LEASE_HELD_SHARE * lease_s, LOSS_LOAD_MAX_S)`` seconds ago or more.

        Why this is safe: the pool pinned each key for ``lease_s`` from its look-up, and it
        answered before this client stamped the lease, so a lease younger than
        ``LEASE_HELD_SHARE * lease_s`` now was still held when the pool died: the key was not
        evicted and its bytes are in this engine's mapping of the region. Only a new pool
        started on the region could hand the slot to a writer, and one that adopts a region
        listens only ``ADOPT_GRACE_S`` (1 s) after it, past ``LOSS_LOAD_MAX_S`` and the load's
        copy (:data:`kvoff.node_pool.server.ADOPT_GRACE_S`). Refusing the load instead would
        leave vLLM's OffloadingConnector without an answer: it has no path for a failed
        load."""
        held_after = time.monotonic() - min(LEASE_HELD_SHARE * self.lease_s, LOSS_LOAD_MAX_S)
        slots = Leases.held_after(leased, held_after)
        if slots is not None:
            self._count_load_after_loss(len(slots))
        return slots

    def _count_load_after_loss(self, n: int) -> None:
        self.loads_after_loss += 1
        logger.warning("kvoff node pool at %s went away after leasing %d keys; they load "
                       "from its slots", self.socket_path, n)  # fmt: skip

    def _pin(self, keys: list[bytes], slots: list[int], connection: bool) -> list[int]:
        """Records the load of ``keys[i]`` from ``slots[i]`` (``connection``: pinned by this
        connection's pool); ``slots``.

        Raises:
            NodePoolError: the pool gave a slot it does not have, or not one slot per key; this
                client leaves it (the pool releases the pins), nothing is recorded.
        """
        try:
            self._loads.pin(keys, slots, connection)
        except ValueError as e:
            if connection:
                self._lost(p.ProtocolError(f"prepare_load: {e}"))
            raise NodePoolError(f"the node pool's load cannot be made: {e}") from None
        return slots

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Ends one load of each key (:meth:`prepare_load`'s keys); keys not being loaded are
        skipped, and the loads a connection since lost pinned end here only (the pool released
        them)."""
        payload = self._loads.complete_keys(as_bytes(keys))
        if payload:
            self._send(p.COMPLETE_LOAD, payload)

    def complete_load_slots(self, slots: Sequence[int]) -> None:
        """:meth:`complete_load` by the slots :meth:`prepare_load` gave: one load from each
        (what :class:`kvoff.node_pool.block_manager.NodePoolBlockManager` and the C++
        scheduler complete)."""
        payload = self._loads.complete_slots(slots)
        if payload:
            self._send(p.COMPLETE_LOAD, payload)

    def load_pins(self, key: bytes) -> int:
        """This engine's loads of ``key`` in flight (of any connection)."""
        return self._loads.pins(checked_key(key))

    def loading_slot(self, key: bytes) -> int | None:
        """A slot this engine is loading ``key`` from, else None."""
        return self._loads.slot_of(checked_key(key))

    def loading_mask(self, keys: Sequence[bytes]) -> bytes:
        """Per key, 1 when this engine is loading it, else 0."""
        return self._loads.loading_mask(keys)

    @property
    def num_loads(self) -> int:
        """This engine's loads in flight (of any connection; a key loaded twice counts
        twice)."""
        return self._loads.num_loads

    def prepare_store(self, keys: Sequence[bytes]) -> StoreSlots | None:
        """Slots for the keys not held yet; None when the pool cannot make room or is gone.

        With ``reserve``, keys that are all new (the pool's key filter rules each out, and
        this engine is not storing it) go into reserved slots with no round trip: the
        pool learns of them with the next flush. Should another engine store one first, the
        pool keeps its copy and frees this one's slot at the completion, so the answer is
        the one the pool would give, but for a wasted copy. Other calls ask the pool (one
        round trip, :meth:`ask_store`), and so does a call the reservation cannot cover; the
        reservation is refilled ahead of need, its reply taken when it comes.

        Raises:
            ValueError: an empty key, or one over ``protocol.MAX_KEY_BYTES`` with the prefix
                (nothing changed).
        """
        own = as_bytes(keys)
        view = self._reservation_filter(len(own))
        if view is not None:
            got = self._stores.store_reserved(own, view)
            if got is not None:
                slots, payload = got
                # a pool lost before this reaches it never hears of the store: the copy and
                # its completion go on (the completion then sends nothing)
                self._send(p.STORE_RESERVED, payload)
                self._top_up()
                return StoreSlots(own, slots, self._stores.take_evicted(), list(range(len(own))))
            self._reservation_missed(len(own))
        return self.ask_store(own)

    def ask_store(self, keys: Sequence[bytes]) -> StoreSlots | None:
        """:meth:`prepare_store` asked of the pool (one round trip), not from the reservation.
        None also when the pool's reply is malformed (a slot it does not have: the pool is
        left, as if gone), and when the pool, restarted on the same region, gave a slot or key
        this engine is still storing for the old pool (the store is refused, counted in
        ``stores_refused_in_flight``; the caller retries later)."""
        own = as_bytes(keys)
        reply = self._call(p.PREPARE_STORE, self._keys(own))
        if reply is None:  # gone
            return None
        if reply[:1] != b"\x01":  # no room: the keys' states follow
            self._store_answer = (own, p.decode_states(reply, 1, len(own))[0])
            return None
        index, off = p.decode_slots(reply, 1)  # the stored keys' places in the call
        slots, off = p.decode_slots(reply, off)
        evicted, off = p.decode_keys(reply, off)
        # kept as given: key_states makes a dict of it only when asked (once a refused store)
        self._store_answer = (own, p.decode_states(reply, off, len(own))[0])
        if len(index) != len(slots) or (index and not 0 <= min(index) <= max(index) < len(own)):
            self._lost(p.ProtocolError(f"a store reply of {len(index)} keys, {len(slots)} slots"))
            return None  # a pool that answers so is broken: as if gone (misses)
        mine = own if len(index) == len(own) else [own[i] for i in index]
        try:
            begun = self._stores.begin(mine, slots)
        except ValueError as e:  # a slot the pool does not have, or one given twice
            self._lost(p.ProtocolError(f"a store reply: {e}"))
            return None
        if not begun:
            # A pool restarted on the same region (after a crash) handed out a slot this
            # engine is still writing for the old pool: refused, so that a slot never stands
            # for two keys here (the old store's completion must not end the new one).
            self._send(p.COMPLETE_STORE, b"\x00" + self._keys(mine))
            self.stores_refused_in_flight += 1
            return None
        return StoreSlots(mine, slots, evicted, list(index))

    def _reservation_filter(self, n: int) -> KeyFilter | None:
        """Counts a store of ``n`` keys for the reservation's aim; the pool's key filter when
        the store may go into reserved slots (``reserve``, attached, enough reserved), else
        None (a refill is queued when the reservation is short). The C++ scheduler's node pool
        manager calls it before each store, then queues a reserved store itself or calls
        :meth:`_reservation_missed` and :meth:`ask_store`."""
        self._step_stores += n
        if not (self.reserve and self.reserve_max and n):
            return None
        if self._stores.num_reserved < n:  # a refill may have come (read only when needed: a
            self._collect()  # recv costs 3-30 µs on a busy 2-core VM)
        self._call_peak = max(n, self._call_peak - self._call_peak // 64)
        f = self._filter
        if f is None or self._sock is None or self._stores.num_reserved < n:
            self._reservation_missed(n)
            return None
        return f.view

    def _reservation_goal(self) -> int:
        # twice the largest recent step's stores (or call's, for a client that takes no
        # events), refilled below half: the refill goes with the step's flush and is back
        # long before the next step's stores (a reserved slot holds no block, so the
        # reservation is kept as small as that allows)
        need = max(self._call_peak, self._step_peak)
        return min(self.reserve_max, max(_MIN_RESERVE, 2 * need))

    def _reservation_missed(self, n: int) -> None:
        """A store of ``n`` keys that goes to the pool: refills a reservation too short for it."""
        if self._stores.num_reserved < n:
            self._refill(max(self._reservation_goal(), n))

    def _top_up(self) -> None:
        """Refills the reservation when it is below half its aim: after a reserved store, and
        at the end of a step (:meth:`take_events`), so the refill goes with the step's flush
        and is back long before the next step's stores."""
        stored = self._call_peak or self._step_peak  # an engine that never stored reserves none
        if self.reserve and self.reserve_max and stored and self._sock is not None:
            goal = self._reservation_goal()
            if self._stores.num_reserved < goal // 2:
                self._refill(goal)

    @property
    def stores_on_reservation(self) -> int:
        """``prepare_store`` calls answered from this connection's reserved slots (no round
        trip; ``reserve``), by this client or the C++ scheduler over it."""
        return self._stores.num_reserved_stores

    def _refill(self, goal: int) -> None:
        """Asks the pool for slots up to ``goal`` reserved, unless a refill is on its way;
        sent with the next call or flush, its reply taken when it comes."""
        count = min(goal, self.reserve_max) - self._stores.num_reserved
        if self._refill_rid is not None or count <= 0 or self._sock is None:
            return
        self._drop_answers()  # the pool evicts for it
        self._refill_rid = self._stores.queue(p.RESERVE, struct.pack("<I", count), False)

    def key_states(self, keys: Sequence[bytes]) -> list[int | None]:
        """Each key's state as a one-key :meth:`lookup` answers it (1 ready, 0 missing, None
        being stored), without leasing anything: from the last :meth:`prepare_store`'s answer
        when it was about these keys and nothing changed since, else asked (one round trip
        per key)."""
        self._check_answers()
        known = dict(zip(*self._store_answer, strict=True)) if self._store_answer else {}
        out: list[int | None] = []
        for k in checked_keys(keys):
            st = known.get(k)
            if st is None:
                reply = self._call(p.LOOKUP, self._keys([k]))
                n = -1 if reply is None else struct.unpack("<q", reply)[0]
                out.append(None if n < 0 and reply is not None else max(n, 0))
            else:
                out.append(_LOOKUP_OF_STATE[st])
        return out

    def key_state(self, key: bytes) -> int:
        """``key``'s state byte now (``STATE_MISSING`` 0, ``STATE_READY`` 1,
        ``STATE_PENDING`` 2): asked (one round trip, after the queued calls), without leasing;
        missing while the pool is gone."""
        reply = self._call(p.LOOKUP, self._keys([checked_key(key)]))
        if reply is None:
            return p.STATE_MISSING
        (n,) = struct.unpack("<q", reply)
        return p.STATE_PENDING if n < 0 else p.STATE_READY if n else p.STATE_MISSING

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Ends a store: the keys become hits (``success``) or are dropped (those of a
        connection since lost are dropped: the pool completed them as failed)."""
        payload = self._stores.complete_keys(as_bytes(keys), success)
        if payload:
            self._send(p.COMPLETE_STORE, payload)

    def complete_store_slots(self, slots: Sequence[int], success: bool = True) -> None:
        """:meth:`complete_store` by the slots :meth:`prepare_store` gave (slots not in
        flight are skipped)."""
        payload = self._stores.complete_slots(slots, success)
        if payload:
            self._send(p.COMPLETE_STORE, payload)

    def storing_slot(self, key: bytes) -> int | None:
        """The slot this engine is storing ``key`` into, else None."""
        return self._stores.slot_of(checked_key(key))

    @property
    def num_storing(self) -> int:
        """This engine's stores in flight (of any connection)."""
        return self._stores.num_storing

    def touch(self, keys: Sequence[bytes], reused: Sequence[bool] | bytes | None = None) -> None:
        """Makes the keys the most recent, ``keys[0]`` first; ``reused``: per key, whether it
        was a reuse (as :meth:`kvoff.CPUOffloadingManager.touch`; bytes: one byte per key,
        nonzero for a reuse).

        Raises:
            TypeError, ValueError: a key or ``reused`` that is refused (``checked_keys``,
                ``reused_flags`` of :mod:`kvoff.node_pool.keys`); nothing is sent.
        """
        payload = self._keys(keys)
        flags = reused_flags(reused, len(keys))
        self._send(p.TOUCH, payload + flags)

    def sync(self) -> None:
        """Returns once the pool has handled every call this client sent (completions and
        touches go without waiting): one round trip, which the pool answers after them. Call it
        before telling another engine that a block is stored. Nothing happens when the pool
        is gone."""
        self._call(p.LOOKUP, p.encode_keys([]))

    # ------------------------------------------------------------------ the manager's rest
    def enable_events(self) -> None:
        """Takes KV events from now on (:meth:`take_events`): the pool queues this engine's
        layout's ``BlockStored`` / ``BlockRemoved`` events for it, whichever engine caused
        them (a block any engine stores is a hit for this one too)."""
        self._events_on = True
        self.take_events()  # subscribes; the events before it are not this engine's to know

    def take_events(self) -> list[Any]:
        """The KV events since the last call, oldest first, with this engine's keys
        (:class:`NodePoolEvent`; ``kind`` and ``keys`` as the manager's events); [] unless
        :meth:`enable_events` was called, or while the pool is gone. Sends the queued calls
        (:meth:`flush`): vLLM takes the events once per engine step, after the step's
        completions, so what this engine stored is a hit for the others from then on."""
        self._queue_report()
        # a step ends here: its stores size the reservation (_reservation_goal)
        self._step_peak = max(self._step_stores, self._step_peak - self._step_peak // 64)
        self._step_stores = 0
        self._top_up()
        if not self._events_on:
            self.flush()
            return []
        reply = self._call(p.TAKE_EVENTS, self.prefix)
        if reply is None:
            return []
        dropped, count = struct.unpack_from("<QI", reply)
        self.events_dropped += dropped
        events, off = [], 12
        for _ in range(count):
            removed = reply[off] == 1
            n = reply[off + 1]
            by = bytes(reply[off + 2 : off + 2 + n]).decode(errors="replace")
            keys, off = p.decode_keys(reply, off + 2 + n)
            kind = "BlockRemoved" if removed else "BlockStored"
            events.append(NodePoolEvent(kind, [k[8:] for k in keys], by))
        return events

    def clear(self, include_in_flight: bool = False) -> int:
        """Drops nothing and returns 0: the pool is shared by other engines, so one engine's
        cache reset must not empty it (``kvoff pool stop`` does)."""
        if not self._warned_clear:
            logger.warning(
                "kvoff: a cache reset does not clear the node pool at %s (other engines use "
                "it); kvoff pool stop empties it",
                self.socket_path,
            )
            self._warned_clear = True
        return 0

    def _counts(self) -> dict[str, Any]:
        """The pool's block counts, asked at most once a second (metrics read them each
        step; the counts alone, not the status with its key filter scan); zeros while the pool
        is gone."""
        now = time.monotonic()
        if now - self._counts_at > 1.0:
            reply = self._call(p.STATUS, p.STATUS_COUNTS)
            self._counts_cache = {} if reply is None else p.decode_json(reply)
            self._counts_at = now
        return self._counts_cache

    @property
    def num_free_blocks(self) -> int:
        """Free slots in the pool (refreshed at most once a second)."""
        return int(self._counts().get("free_blocks", 0))

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks the pool may evict (refreshed at most once a second)."""
        return int(self._counts().get("evictable_blocks", 0))

    @property
    def num_pending_blocks(self) -> int:
        """Blocks being stored by any engine (refreshed at most once a second)."""
        return int(self._counts().get("pending_blocks", 0))

    @property
    def num_stored_blocks(self) -> int:
        """Blocks held (refreshed at most once a second)."""
        return int(self._counts().get("stored_blocks", 0))

    @property
    def num_reserved_blocks(self) -> int:
        """Slots reserved for the engines' stores that need no reply, not taken yet: in use
        by no transfer, and in neither the index nor the eviction order (refreshed at most
        once a second)."""
        return int(self._counts().get("reserved_blocks", 0))

    @property
    def num_pinned_blocks(self) -> int:
        """Slots some transfer of any engine uses now (the pool's
        ``CPUOffloadingManager.num_pinned_blocks``; refreshed at most once a second)."""
        return int(self._counts().get("pinned_blocks", 0))

    def status(self) -> dict[str, Any]:
        """The pool's status (``kvoff pool status``).

        Raises:
            NodePoolError: the pool is gone.
        """
        reply = self._call(p.STATUS, b"")
        if reply is None:
            raise NodePoolError(f"no node pool answers at {self.socket_path}")
        return p.decode_json(reply)


# A lease counts as held by a pool that has since died when it is younger than this share of
# lease_s: the rest is a margin for the time between the pool's lease and this client's stamp.
LEASE_HELD_SHARE = 0.9
# Seconds after a look-up within which its leased keys may load once the pool is gone: below
# the time a new pool on the region waits before it serves (server.ADOPT_GRACE_S), with room
# for the load's copy (NodePoolClient._load_after_loss).
LOSS_LOAD_MAX_S = 0.5

_MIN_RESERVE = 16
"""Slots a reservation aims at, at least (``reserve``)."""
_OUTBOX_BYTES = 1 << 16
"""Queued calls beyond this many bytes are sent at once."""
_READ_ONLY_OPS = frozenset({p.LOOKUP, p.LOOKUP_AHEAD, p.STATUS, p.REPORT_LOOKUPS})
"""Calls that change nothing in the pool: the answers this client keeps stay valid."""
_LOOKUP_OF_STATE = {p.STATE_MISSING: 0, p.STATE_READY: 1, p.STATE_PENDING: None}
_STATE_OF_LOOKUP = {0: p.STATE_MISSING, 1: p.STATE_READY, None: p.STATE_PENDING}


def wait_for_pool(socket_path: str, process: Any = None, timeout_s: float = 60.0) -> None:
    """Returns once a pool answers at ``socket_path`` (a killed pool's socket file may still
    be there, so a connection is what counts).

    Args:
        socket_path: the pool's socket.
        process: the pool's ``subprocess.Popen``, if this process started it: its exit ends
            the wait.
        timeout_s: seconds to wait at most.

    Raises:
        NodePoolError: the pool exited, or did not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(socket_path)
            return
        except OSError:
            if process is not None and process.poll() is not None:
                raise NodePoolError(
                    f"the node pool for {socket_path} exited with code {process.returncode}"
                ) from None
            if time.monotonic() > deadline:
                raise NodePoolError(
                    f"no node pool answered at {socket_path} within {timeout_s:g} s"
                ) from None
            time.sleep(0.05)
        finally:
            probe.close()
