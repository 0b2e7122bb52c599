"""The node pool's server: one CPU pool in shared memory and one index for every engine on a
machine (``kvoff pool serve``).

Why a server process owns the index, rather than an index in shared memory: the index is
kvoff's C++ manager (:class:`kvoff._scheduler.CPUOffloadingManager`, every eviction policy and
the admission filter) used as it is, and an engine that dies at any moment cannot leave it half
updated, because only this process changes it. The server knows what each engine holds by its
connection: when an engine's connection closes, for whatever reason (SIGKILL included, the
kernel closes the socket), its pins are released and its stores in flight are completed as
failed, so they never become hits and no slot is leaked. The bytes never pass through the
socket: the slots live in ``/dev/shm/<region>``, which every engine maps (and pins) once, and
the socket carries only batched key lists and slot ids. This module holds the sockets, the
regions and the lifetimes; what each call does to the index is :mod:`kvoff.node_pool.calls`.

Trust: the socket file is created with mode 0600 (0660 with ``group``), and every connection's
peer credentials (``SO_PEERCRED``) must be this process's user, or ``group`` when given; others
are refused at once. A message that does not parse gets an error reply; a frame whose header is
wrong closes that connection only. Every call is checked against what the connection holds: an
engine can complete only its own loads and stores.

One thread serves every connection in turn (``selectors``), so the manager needs no lock and
calls are atomic. With ``ranks`` > 1 (tensor-parallel engines) the slots are one region per
rank, and a slot id names a block's part in each.

**Round trips**, not the manager, are an engine's cost here (15–100 µs each on the 2-core
box, against 3 µs for a call in-process), and vLLM's offloading scheduler looks keys up one at
a time. So the pool remembers which key followed which when an engine stored or touched them
(a request's chain, head to tail): one look-up (``LOOKUP_AHEAD``) answers a key and its chain
up to the first missing key, which the engine keeps for its next look-ups of that step;
``PREPARE_STORE`` answers the state of every key it was given; completions and touches are
sent without waiting for a reply (``NO_REPLY``). The successor map is a hint: a wrong guess
costs one more round trip, never a wrong answer. Without tiers, the pool keeps a key filter of
its index in shared memory (:mod:`kvoff.node_pool.key_filter`), updated before each reply, so
that engines answer most misses without asking.

**KV events.** A block any engine stores is a hit for every engine of its layout, and an
eviction takes it from all of them, so every engine that asks for events (``TAKE_EVENTS``)
gets the ``BlockStored`` / ``BlockRemoved`` events of its layout, whoever caused them, each
with the name of the engine whose call made it (its store, or the store whose room evicted the
blocks; none for blocks promoted from the tiers); how much each engine stored and loaded is in
the status and the metrics (per engine). An engine's queue holds
:data:`EVENT_KEYS_PER_SLOT` keys per slot at most; beyond, the oldest events are dropped and
counted.

**Leases.** Another engine's store may evict a block between this engine's look-up and its
load (vLLM makes them a few milliseconds apart, in one ``schedule()``). So the ready keys a
``LOOKUP_AHEAD`` answers are pinned for that engine for ``lease_s`` (with their slot ids in
the reply): its ``PREPARE_LOAD`` of them turns the lease into the load's pin, which cannot
fail, so the engine sends it without waiting. Leases that are not loaded lapse after
``lease_s`` (the blocks become evictable again); a look-up of a leased key renews it.

**Tiers.** With secondary tiers (a disk, a Redis Cluster: ``kvoff pool serve --disk-path
... --remote-url ...``), every block an engine stores is written through to them (kvoff's
:class:`~kvoff.tiers.coordinator.TieredPool`, run by this server for all its engines), and a
look-up that misses the slots asks the tiers for the key and the chain stored after it: the
engine is told to retry (``STATE_PENDING``) until the run is promoted into the slots. Blocks on
a disk outlive the pool: a pool started again on the same disk serves them.

A restarted server adopts the region of the server before it (same name and layout, owner
gone), whether that one died or stopped cleanly while engines mapped the region (a clean stop
keeps a region that is still mapped: :mod:`kvoff.pinned`, "Pools that outlive their creator"):
engines that still map it keep working and hit again as they store; the index starts empty.
It listens only :data:`ADOPT_GRACE_S` after adopting the region, so that no slot is handed to a
writer while an engine still copies to or from it for the pool before.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import signal
import socket
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvoff import _scheduler
from kvoff.node_pool import protocol as p
from kvoff.node_pool.calls import AttachedEngine, PoolCalls
from kvoff.node_pool.key_filter import SUFFIX as KEY_FILTER_SUFFIX
from kvoff.node_pool.key_filter import PoolKeyFilter
from kvoff.node_pool.pool_tiers import tier_format
from kvoff.node_pool.successors import SuccessorMap
from kvoff.pinned import HostPool, SharedMemoryError, _shm_path

__all__ = ["DEFAULT_REGION", "NodePoolServer", "tier_format"]

DEFAULT_REGION = "kvoff-node-pool"
"""The default shared-memory name of the pool (``/dev/shm/kvoff-node-pool``)."""
DEFAULT_LEASE_S = 0.5
"""Seconds a look-up's ready keys stay pinned for the engine that asked (module docstring):
far above the milliseconds between vLLM's look-up and load of a request, short enough that
the blocks of requests that never load return to the eviction order soon."""
DEFAULT_SPIN_S = 0.0005
"""Seconds the server polls without sleeping after a call: an engine's calls of a step come
in bursts microseconds apart, and a sleeping thread takes tens of microseconds to wake (on
the 2-core EPYC box an empty round trip took 36 µs without, 16 µs with). It costs a core
only while engines call."""
SUCCESSORS_PER_SLOT = 2
"""Successor-map entries kept per slot at most (a chain per held block, and room for keys
touched that are not held); beyond, the oldest are dropped."""
MAX_RANKS = 64
"""Tensor-parallel ranks a node pool serves at most (a region each)."""
EVENT_KEYS_PER_SLOT = 4
"""Keys of KV events queued per engine and slot at most (module docstring)."""
ADOPT_GRACE_S = 1.0
"""Seconds a server that adopted a region waits before it listens (and so before it hands out
any slot): the copies engines began under the pool before it may still be running. An engine
loads leased blocks for :data:`~kvoff.node_pool.client.LOSS_LOAD_MAX_S` (0.5 s) after its pool
died, and its stores in flight at the death end with their job; the other 0.5 s is room for
those copies (a step's job moves well under 1 GiB, tens of milliseconds over PCIe)."""
RESERVE_SHARE = 16
"""By default an engine may hold at most 1/RESERVE_SHARE of the slots reserved (``RESERVE``):
enough for a few steps of stores, never enough for a few engines to starve the index."""


class NodePoolServer(PoolCalls):
    """The pool and its index, served on a Unix socket.

    Args:
        socket_path: where to listen (a file that exists is replaced if no server answers on
            it; one that answers is an error).
        num_slots: CPU blocks in the pool (offloaded blocks; >= 1).
        slot_bytes: bytes of one CPU block (>= 1); every engine that attaches must use it.
        policy: eviction policy of the index (``lru``, ``arc``, ... as the manager takes).
        region: the shared-memory name of the slots (``/dev/shm/<region>``).
        group: a group id whose members may attach too (default: only this user).
        store_threshold: the manager's store admission (offers before a block is stored).
        lease_s: seconds a look-up's ready keys stay pinned for the engine that asked
            (:data:`DEFAULT_LEASE_S`; module docstring).
        spin_s: seconds the serving thread polls without sleeping after a call
            (:data:`DEFAULT_SPIN_S`; 0: it always sleeps until a socket is ready).
        tiers: secondary tiers below the slots (:func:`kvoff.node_pool.pool_tiers.pool_tiers`
            makes them, on :func:`tier_format`; with several ranks, ranked tiers whose rank
            ``r`` holds region ``r``'s parts); the server closes them.
        write_queue_blocks: blocks pinned for write-through at most (default: a quarter of
            the slots, :func:`kvoff.tiers.coordinator.default_write_queue_blocks`).
        ranks: the engines' tensor-parallel size: one region of ``num_slots`` slots of
            ``slot_bytes`` (one rank's bytes of a block) per rank, ``<region>-rank<r>``
            (``<region>`` itself with one rank); a slot id names a block in every region.
        reserve_blocks: slots one engine may hold reserved for stores that do not wait for a
            reply (``RESERVE``; default ``num_slots // RESERVE_SHARE``; 0: none). Always 0
            with tiers or ``store_threshold`` >= 2.
        successors_path: with tiers, the file the successor map is read from at start and
            written to at a clean stop (:mod:`kvoff.node_pool.successors`; ``kvoff pool serve``
            puts it in the disk tier's folder), so a pool started again on the same disk
            promotes whole chains at once; None: the map starts empty.

    A server that adopts a region (module docstring) returns from its constructor, listening,
    :data:`ADOPT_GRACE_S` after the adoption at the soonest.

    Raises:
        ValueError: a bad size, policy or name, or another server answering on
            ``socket_path``.
        SharedMemoryError: ``/dev/shm`` too small, or a live server already owns ``region``.
    """

    def __init__(
        self,
        socket_path: str,
        num_slots: int,
        slot_bytes: int,
        *,
        policy: str = "lru",
        region: str = DEFAULT_REGION,
        group: int | None = None,
        store_threshold: int = 0,
        lease_s: float = DEFAULT_LEASE_S,
        spin_s: float = DEFAULT_SPIN_S,
        tiers: Sequence[Any] = (),
        write_queue_blocks: int | None = None,
        ranks: int = 1,
        reserve_blocks: int | None = None,
        successors_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0 seconds, got {lease_s}")
        if reserve_blocks is not None and not 0 <= reserve_blocks <= num_slots:
            raise ValueError(
                f"reserve_blocks must be 0..num_slots ({num_slots}) slots per engine, got "
                f"{reserve_blocks}"
            )
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(
                f"a node pool needs num_slots >= 1 and slot_bytes >= 1, got {num_slots} and "
                f"{slot_bytes}; give --bytes (or --slots) and the engines' slot size"
            )
        self.socket_path = os.path.abspath(socket_path)
        self.num_slots, self.slot_bytes = int(num_slots), int(slot_bytes)
        self.group = group
        self.manager = _scheduler.CPUOffloadingManager(
            self.num_slots, policy, True, store_threshold=store_threshold
        )
        self.policy = policy
        if not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"ranks must be 1..{MAX_RANKS} (the engines' tensor-parallel size)")
        self.region = region
        # one region per tensor-parallel rank: slot i of every region is one block's parts
        self.regions = [region] if ranks == 1 else [f"{region}-rank{r}" for r in range(ranks)]
        self.adopted = False
        self.adopted_at = 0.0  # time.monotonic() of the first region adopted
        self.regions_kept: list[str] = []  # at close: the regions engines still mapped
        self.successors_save_error: str | None = None  # at close: why the map was not saved
        self.pools: list[HostPool] = []
        try:
            for name in self.regions:
                self.pools.append(self._region(name))
        except BaseException:
            for pool in self.pools:
                pool.close()
            raise
        self.pool = self.pools[0]
        self.tiered: Any = None  # kvoff.tiers.coordinator.TieredPool, with tiers
        if tiers:
            from kvoff.tiers.coordinator import TieredPool, default_write_queue_blocks
            from kvoff.tiers.engine_tiers import rank_slots

            # a block is every rank's part (kvoff.node_pool.pool_tiers)
            slot = rank_slots([pool.tensors[0].numpy() for pool in self.pools])
            cap = write_queue_blocks or default_write_queue_blocks(self.num_slots)
            try:
                self.tiered = TieredPool(self.manager, slot, list(tiers),
                                         write_queue_blocks=cap)  # fmt: skip
            except BaseException:
                for pool in self.pools:
                    pool.close()
                raise
        # which keys the index may hold, for the engines' look-ups (none with tiers: a key
        # missing here may be a tier's hit; kvoff.node_pool.key_filter says why)
        self.key_filter: PoolKeyFilter | None = None
        if self.tiered is None:
            try:
                self.key_filter = PoolKeyFilter(_shm_path(region) + KEY_FILTER_SUFFIX,
                                                self.num_slots, group)  # fmt: skip
            except BaseException:
                for pool in self.pools:
                    pool.close()
                raise
        # slots an engine may hold reserved: none with tiers (their promotions need the
        # manager's prepare_store) or an admission filter (which reserved stores would skip)
        share = self.num_slots // RESERVE_SHARE if reserve_blocks is None else reserve_blocks
        self.reserve_max = share if self.tiered is None and store_threshold < 2 else 0
        self.engines: dict[int, AttachedEngine] = {}  # by fd
        # key -> the key stored or touched after it (a request's chain), for LOOKUP_AHEAD;
        # with tiers, read back from successors_path (a disk tier's blocks outlive the pool)
        self.successors = SuccessorMap(SUCCESSORS_PER_SLOT * self.num_slots)
        self.successors_path = (
            None if successors_path is None or self.tiered is None else Path(successors_path)
        )
        if self.successors_path is not None:
            self.successors.load(self.successors_path)
        self.lease_s = float(lease_s)
        self.spin_s = max(0.0, float(spin_s))
        self.leases_lapsed = 0
        self._next_lapse = 0.0
        self.evictions = 0
        self.reserved_stores = 0  # keys stored into reserved slots (STORE_RESERVED)
        self.engines_seen = 0
        self.refused = 0
        self.started = time.time()
        self._stop = False
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        if self.adopted:  # engines' copies of the pool before may still run (ADOPT_GRACE_S)
            time.sleep(max(0.0, self.adopted_at + ADOPT_GRACE_S - time.monotonic()))
        try:
            self._listener = self._listen()
            self.listening_since = time.monotonic()
        except BaseException:  # (another pool answers there): leave no region or filter behind
            self._release_memory()
            raise
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)

    # ------------------------------------------------------------------ setup
    def _region(self, name: str) -> HostPool:
        shape = [(self.num_slots, self.slot_bytes)]
        desc = f"the node pool ({self.num_slots} slots of {self.slot_bytes} bytes)"
        try:  # a server that died left its region: adopt it, engines still map it
            pool = HostPool(shape, pin=False, shared_name=name, attach=True, description=desc)
        except SharedMemoryError:  # (kept while engines map it: see _release_memory)
            return HostPool(
                shape, pin=False, shared_name=name, description=desc, outlive_creator=True
            )
        from kvoff.pinned import (
            SHM_HEADER_BYTES,
            _pack_header,
            _parse_header,
            _pool_owner,
        )

        owner = _pool_owner(_shm_path(name))
        if owner is not None and owner != os.getpid():
            pool.close()
            raise SharedMemoryError(
                f"/dev/shm/{name} belongs to process {owner}, which still runs: another node "
                "pool serves it; stop it first or give another --region"
            )
        head = pool._storage[:SHM_HEADER_BYTES]
        meta = _parse_header(bytes(head.numpy()))
        assert meta is not None  # attach checked it
        meta["pid"] = os.getpid()  # this server owns it now
        packed = _pack_header(meta)
        head[: len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        if not self.adopted:
            self.adopted_at = time.monotonic()
        self.adopted = True
        return pool

    def _listen(self) -> socket.socket:
        path = self.socket_path
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # a dead server's socket
            else:
                probe.close()
                raise ValueError(
                    f"a node pool already serves {path}; stop it (kvoff pool stop) or give "
                    "another --socket"
                )
        old = os.umask(0o117 if self.group is not None else 0o177)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        try:
            if self.group is not None:
                os.chown(path, -1, self.group)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:  # (a group this user may not give the socket to)
            sock.close()
            os.unlink(path)
            raise
        return sock

    # ------------------------------------------------------------------ loop
    def serve_forever(self, poll_s: float = 0.5) -> None:
        """Serves until :meth:`stop` (or SIGTERM / SIGINT, when called in the main thread)."""
        with contextlib.suppress(ValueError):  # not the main thread: no signal handlers
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        poll_s = min(poll_s, self.lease_s / 4)  # leases lapse on time when nothing happens
        busy_until = 0.0
        clock = time.perf_counter
        while not self._stop:
            # right after a call, poll without sleeping for spin_s: an engine's next call
            # usually follows within microseconds, and waking a sleeping thread costs more
            spinning = clock() < busy_until
            wait_s = 0.0 if spinning else 0.002 if self._tiers_busy() else poll_s
            if self.serve_once(wait_s):
                busy_until = clock() + self.spin_s
        self.close()

    def serve_once(self, timeout: float = 0.0) -> int:
        """Handles what is ready now (waiting at most ``timeout`` seconds); returns the number
        of sockets that had something."""
        ready = self._selector.select(timeout)
        for key, events in ready:
            if key.data is None:
                self._accept()
                continue
            eng: AttachedEngine = key.data
            if events & selectors.EVENT_READ:
                self._read(eng)
            if events & selectors.EVENT_WRITE and eng.sock.fileno() in self.engines:
                self._flush(eng)
        if self.tiered is not None:  # promotions into the slots, written blocks unpinned
            self.tiered.poll()
            self._publish("")  # the pool's own: blocks promoted from the tiers
        now = time.monotonic()
        if now >= self._next_lapse:
            self._next_lapse = now + min(0.05, self.lease_s / 4)
            self._lapse(now)
        while not self._calls.empty():
            self._calls.get()()
        return len(ready)

    def _tiers_busy(self) -> bool:
        """Whether the tiers have work this thread must finish soon (promotions to apply,
        written blocks to unpin)."""
        t = self.tiered
        return t is not None and (t.reading or self.manager.write_through_in_flight > 0)

    def _lapse(self, now: float) -> None:
        """Unpins the leases that ran out (their engines did not load them)."""
        for eng in self.engines.values():
            if not eng.leases:
                continue
            gone = [k for k, (until, _) in eng.leases.items() if until <= now]
            for k in gone:
                del eng.leases[k]
            if gone:
                self.manager.complete_load(gone)
                self.leases_lapsed += len(gone)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Runs ``fn()`` in the serving thread after its current round (thread-safe): how
        another thread of this process reads or changes the pool without racing it."""
        self._calls.put(fn)

    def stop(self) -> None:
        """Ends :meth:`serve_forever` after the current round."""
        self._stop = True

    def close(self) -> None:
        """Drops every connection (their pins and stores released), removes the socket and
        the region's name (engines keep their mappings). Idempotent."""
        for eng in list(self.engines.values()):
            self._drop(eng)
        if self.successors_path is not None:  # for the next pool on this disk
            try:
                self.successors.save(self.successors_path)
            except OSError as e:
                self.successors_save_error = str(e)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self._release_memory()

    def _release_memory(self) -> None:
        """Closes the tiers, removes the key filter's name and lets go of the regions: a region
        no engine maps is removed; one that engines still map keeps its name, so that the next
        pool started on it adopts it and the engines hit again without a restart (the last
        engine to let it go removes it; :mod:`kvoff.pinned`, "Pools that outlive their
        creator")."""
        if self.tiered is not None:
            self.tiered.close()  # the writes in flight finish first
        if self.key_filter is not None:
            self.key_filter.close()
        for name, pool in zip(self.regions, self.pools, strict=True):
            pool.close()
            with contextlib.suppress(OSError):
                if os.stat(_shm_path(name)).st_ino == pool.inode:
                    self.regions_kept.append(name)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        allowed = uid == os.getuid() or (self.group is not None and gid == self.group)
        if not allowed:  # another user: refused before reading a byte
            self.refused += 1
            sock.close()
            return
        sock.setblocking(False)
        eng = AttachedEngine(sock, pid, uid)
        self.engines[sock.fileno()] = eng
        self.engines_seen += 1
        self._selector.register(sock, selectors.EVENT_READ, eng)

    def _read(self, eng: AttachedEngine) -> None:
        try:
            data = eng.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(eng)
            return
        eng.inbox += data
        while len(eng.inbox) >= p.HEADER.size:
            try:
                op, rid, length = p.parse_header(bytes(eng.inbox[: p.HEADER.size]))
            except p.ProtocolError as e:  # framing lost: answer, then close this one
                eng.errors += 1
                self._send(eng, p.frame(p.ERROR, 0, str(e).encode()))
                self._flush(eng)
                self._drop(eng)
                return
            end = p.HEADER.size + length
            if len(eng.inbox) < end:
                return
            payload = bytes(eng.inbox[p.HEADER.size : end])
            del eng.inbox[:end]
            self._send(eng, self._handle(eng, op, rid, payload))
            self._publish(eng.name)
        self._flush(eng)

    def _send(self, eng: AttachedEngine, data: bytes) -> None:
        eng.outbox += data

    def _flush(self, eng: AttachedEngine) -> None:
        if eng.sock.fileno() not in self.engines:
            return
        try:
            while eng.outbox:
                n = eng.sock.send(eng.outbox)
                del eng.outbox[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(eng)
            return
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if eng.outbox else 0)
        if mask != eng.mask:  # an epoll_ctl only when it changes
            self._selector.modify(eng.sock, mask, eng)
            eng.mask = mask

    def _publish(self, by: str) -> None:
        """Hands the index's new KV events to the engines of their layout that take events;
        ``by`` is the name of the engine whose call made them ("": the pool's own, such as
        promotions from the tiers)."""
        events = self.manager.take_events()
        if not events:
            return
        takers = [e for e in self.engines.values() if e.prefix is not None]
        if not takers:
            return
        cap = EVENT_KEYS_PER_SLOT * self.num_slots
        for ev in events:
            by_prefix: dict[bytes, list[bytes]] = {}
            for k in ev.keys:
                by_prefix.setdefault(k[:8], []).append(k)
            removed = ev.kind == "BlockRemoved"
            for eng in takers:
                keys = by_prefix.get(eng.prefix or b"")
                if not keys:
                    continue
                eng.events.append((removed, keys, by))
                eng.event_keys += len(keys)
                while eng.event_keys > cap:  # an engine that does not drain: oldest go
                    _, old, _ = eng.events.popleft()
                    eng.event_keys -= len(old)
                    eng.events_dropped += 1

    def _drop(self, eng: AttachedEngine) -> None:
        """An engine is gone: its loads are unpinned, its stores completed as failed."""
        fd = eng.sock.fileno()
        if self.engines.pop(fd, None) is None:
            return
        pins = [*eng.pins.elements(), *eng.leases]
        if pins:
            self.manager.complete_load(pins)
        if eng.storing:
            self.manager.complete_store(list(eng.storing), False)
            self.successors.forget(eng.storing)
            if self.key_filter is not None:
                self.key_filter.remove(eng.storing)
        spare = [*eng.reserved, *eng.duplicates.values()]
        if spare:
            self.manager.release_reserved(spare)
        self._publish(eng.name)
        eng.pins.clear()
        eng.leases.clear()
        eng.storing.clear()
        eng.reserved.clear()
        eng.duplicates.clear()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(eng.sock)
        eng.sock.close()

    # ------------------------------------------------------------------ status
    def describe(self) -> dict[str, Any]:
        """What an engine needs to attach: the region, its inode and layout, the policy."""
        return {
            "version": p.VERSION,
            "region": self.regions[0],
            "regions": self.regions,
            "ranks": len(self.regions),
            "inode": getattr(self.pool, "inode", None),
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "policy": self.policy,
            "lease_s": self.lease_s,
            "reserve_max": self.reserve_max,
            "pid": os.getpid(),
            "key_filter": None if self.key_filter is None else self.key_filter.describe(),
        }

    def counts(self) -> dict[str, int]:
        """The block counts alone (``protocol.STATUS_COUNTS``: engines' usage gauges), in
        blocks; no scan."""
        m = self.manager
        return {
            "stored_blocks": m.num_stored_blocks,
            "free_blocks": m.num_free_blocks,
            "pending_blocks": m.num_pending_blocks,
            "reserved_blocks": m.num_reserved_blocks,
            "evictable_blocks": m.num_evictable_blocks,
            "pinned_blocks": m.num_pinned_blocks,
        }

    def status(self, scan_key_filter: bool = True) -> dict[str, Any]:
        """Blocks, engines attached, hit rates, evictions (``kvoff pool status``);
        ``scan_key_filter=False`` leaves out the key filter's scan (``key_filter_status``
        None: the metrics' scrapes, which must not stall the engines' calls)."""
        looked = sum(e.looked_up_keys for e in self.engines.values())
        hits = sum(e.hit_keys for e in self.engines.values())
        return {
            **self.describe(),
            "uptime_s": round(time.time() - self.started, 3),
            **self.counts(),
            "evictions": self.evictions,
            "reserved_stores": self.reserved_stores,
            "leases_lapsed": self.leases_lapsed,
            "tiers": None if self.tiered is None else self.tiered.stats(),
            "key_filter_status": (
                self.key_filter.status()
                if self.key_filter is not None and scan_key_filter
                else None
            ),
            "engines_attached": len(self.engines),
            "engines_seen": self.engines_seen,
            "connections_refused": self.refused,
            "hit_rate": hits / looked if looked else 0.0,
            "engines": [
                {
                    "name": e.name,
                    "pid": e.pid,
                    "uid": e.uid,
                    "calls": e.calls,
                    "lookups": e.lookups,
                    "looked_up_blocks": e.looked_up_keys,
                    "hit_blocks": e.hit_keys,
                    "hit_rate": e.hit_keys / e.looked_up_keys if e.looked_up_keys else 0.0,
                    "stored_blocks": e.stored_keys,
                    "loaded_blocks": e.loaded_keys,
                    "pinned_blocks": sum(e.pins.values()),
                    "leased_blocks": len(e.leases),
                    "takes_events": e.prefix is not None,
                    "storing_blocks": len(e.storing),
                    "reserved_blocks": len(e.reserved),
                    "errors": e.errors,
                }
                for e in self.engines.values()
            ],
        }
