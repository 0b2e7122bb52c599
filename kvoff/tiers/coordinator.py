"""The CPU pool (L1) and the secondary tiers below it: asynchronous promotion on L1 misses and
bounded write-through of stored blocks.

:class:`TieredPool` wraps kvoff's :class:`~kvoff.CPUOffloadingManager` (L1: it owns the slots and
every decision about them) and a list of :class:`~kvoff.tiers.base.SecondaryTier` (disk, then a
shared store). The engine thread calls it; tier I/O runs on background threads and never blocks
the engine's step:

* **Lookup** (:meth:`TieredPool.lookup`): the manager answers from L1. When L1 misses a block of
  the asked keys, the tiers are probed in the background (``contains``, first tier first) and the
  call returns ``None`` ("retry later", as for a block still being stored). Probes run on a
  thread of their own, so they never wait behind another request's promotion. When the probe is
  back, the leading run of keys some tier holds gets L1 slots (``prepare_store``, which may evict)
  and is read into them (``get``); ``complete_store`` makes them L1 blocks (**promotion**). The
  retry then finds them in L1 and loads them to the GPU as usual. A block a tier cannot serve
  (absent, corrupt, wrong fingerprint, timeout) is a miss: ``complete_store(..., False)`` drops
  its slot, so wrong bytes are never served.
* **Write-through**, in the C++ manager (``set_write_through``): when a store to L1 completes
  (``complete_store``), the manager pins its blocks (not evicted while tiers read them) and queues
  them; a dispatcher thread takes them (``take_write_through``) and one writer thread per tier
  writes them; when every tier is done they are handed back (``write_through_done``) and the
  manager unpins them during its next call. The engine thread pays one pin per block and no Python
  at all: a store through the scheduler or the bare manager is written through alike. The queue is
  bounded in blocks: blocks that do not fit are dropped and counted
  (``writes_dropped_queue_full``), never waited for. Write-back (write to a tier only on L1
  eviction) would need the manager to hand evicted slots over before reusing them (an eviction
  callback that defers the slot's reuse until the write is done); kvoff's manager reuses an
  evicted slot at once, so write-through is the policy for every tier.

Finished promotions are applied on the engine thread in :meth:`TieredPool.poll` (called by
``lookup`` while a promotion is in flight, and by the engine once per step), so the manager's
state is only ever changed from one thread; the writer threads use only its thread-safe
write-through calls.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvoff.checks import check_flag
from kvoff.tiers.base import SecondaryTier, check_int
from kvoff.tiers.block_format import MAX_KEY_BYTES

if TYPE_CHECKING:
    from kvoff.config import OffloadingConfig
    from kvoff.tiers.block_format import BlockFormat

log = logging.getLogger("kvoff.tiers")

__all__ = [
    "DEFAULT_WRITE_QUEUE_BLOCKS",
    "MAX_PROBE_BLOCKS",
    "TieredPool",
    "default_write_queue_blocks",
    "make_tiers",
    "tiers_from_config",
]

DEFAULT_WRITE_QUEUE_BLOCKS = 1024
"""Blocks waiting for write-through at most (pinned in L1 meanwhile); more are dropped."""
MAX_WRITE_QUEUE_BLOCKS = 2**32 - 1
"""Largest ``write_queue_blocks``: the manager keeps the bound as a 32-bit count
(``CPUOffloadingManager.set_write_through(std::uint32_t)``)."""


def default_write_queue_blocks(num_cpu_blocks: int) -> int:
    """The write-through bound for an L1 of ``num_cpu_blocks`` blocks: a quarter of the pool
    (so write-through never pins most of L1), at most :data:`DEFAULT_WRITE_QUEUE_BLOCKS`, at
    least 1. In blocks."""
    return max(1, min(DEFAULT_WRITE_QUEUE_BLOCKS, num_cpu_blocks // 4))


def make_tiers(
    fmt: BlockFormat,
    *,
    disk_path: str | os.PathLike[str] | None = None,
    disk_bytes: int | None = None,
    remote_url: str | None = None,
    remote_namespace: str = "kvoff",
    remote_ttl_s: float | None = None,
    remote_timeout_s: float = 0.25,
    shared_secret: bytes | None = None,
) -> list[SecondaryTier]:
    """Secondary tiers, fastest first: a :class:`~kvoff.tiers.DiskTier` of ``disk_bytes`` bytes
    in ``disk_path``, then a :class:`~kvoff.tiers.redis_cluster.RedisClusterTier` on
    ``remote_url`` (key prefix ``remote_namespace``, TTL ``remote_ttl_s`` seconds, per-node
    timeout ``remote_timeout_s`` seconds). Empty when neither path nor URL is given.

    Args:
        fmt: the block format (layout fingerprint, payload bytes = the CPU slot size).
        shared_secret: when given, the key of the MAC every block of these tiers carries
            (bytes, at least 16; it replaces ``fmt.shared_secret``): blocks without a valid
            MAC are misses, counted in ``unauthenticated_blocks``
            (:mod:`kvoff.tiers.block_format`). ``None``: ``fmt`` as it is.

    Raises:
        ValueError / OSError: what the tiers' constructors raise (a disk path that cannot be
            created or sized, a bad URL or namespace), or a ``shared_secret`` shorter than 16
            bytes; the tiers already made are closed first. An unreachable Redis Cluster is
            not an error: its blocks are misses until it answers.
    """
    if shared_secret is not None:
        fmt = dataclasses.replace(fmt, shared_secret=shared_secret)
    tiers: list[SecondaryTier] = []
    try:
        if disk_path is not None:
            from kvoff.tiers.disk import DiskTier

            tiers.append(DiskTier(str(disk_path), int(disk_bytes or 0), fmt))
        if remote_url is not None:
            from kvoff.tiers.redis_cluster import RedisClusterTier

            tiers.append(
                RedisClusterTier(
                    remote_url,
                    fmt,
                    namespace=remote_namespace,
                    ttl_s=remote_ttl_s,
                    timeout_s=remote_timeout_s,
                )
            )
    except BaseException:
        for t in tiers:  # a tier already open would keep its file locked for the retry
            t.close()
        raise
    return tiers


def tiers_from_config(config: OffloadingConfig, fmt: BlockFormat) -> list[SecondaryTier]:
    """:func:`make_tiers` with the tier keys of an :class:`~kvoff.OffloadingConfig`
    (``disk_path``, ``disk_bytes``, ``remote_url``, ``remote_namespace``, ``remote_ttl_s``,
    ``remote_timeout_s``) and its ``shared_secret`` (UTF-8 bytes of the text; unset: ``fmt``'s
    own, usually none).

    Raises:
        As :func:`make_tiers`.
    """
    secret = config.shared_secret
    return make_tiers(
        fmt,
        disk_path=config.disk_path,
        disk_bytes=config.disk_bytes,
        remote_url=config.remote_url,
        remote_namespace=config.remote_namespace,
        remote_ttl_s=config.remote_ttl_s,
        remote_timeout_s=config.remote_timeout_s,
        shared_secret=None if secret is None else secret.get_secret_value().encode(),
    )


MAX_PROBE_BLOCKS = 4096
"""Keys probed per L1 miss at most (a longer request promotes the rest on a later miss)."""
_ANSWERED_CAP = 65536


@dataclass
class _Read:
    """One promotion: phase 1 probes (``contains``), phase 2 reads into L1 slots (``get``)."""

    keys: list[bytes]
    future: Future
    t0: float
    generation: int  # TieredPool.reset() count when it started: an older one is stale
    phase: int = 1
    keys_to_store: list[bytes] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    # the request's L1 hits before `keys`: the promotion's prepare_store names them too, so
    # that making room for the run never evicts the blocks it continues
    held: list[bytes] = field(default_factory=list)


@dataclass
class _Write:
    """One write-through: the keys pinned in L1, their slots, and the tiers still writing."""

    keys: list[bytes]
    block_ids: list[int]
    remaining: int
    generation: int  # TieredPool.reset() count when it was dispatched: older ones are dropped


_STOP = object()
_OPEN_POOLS: weakref.WeakSet[TieredPool] = weakref.WeakSet()


@atexit.register
def _stop_dispatchers() -> None:
    """At interpreter exit, stops the dispatcher threads of pools never closed: a daemon thread
    that came back from ``take_write_through`` (GIL released) during finalization would be
    unwound through C++ frames and abort the process."""
    for pool in list(_OPEN_POOLS):
        pool._stop_dispatcher()


def _check_slot_size(slot: Callable[[int], Any], tiers: Sequence[SecondaryTier]) -> None:
    """Raise ValueError unless the tiers' blocks are the size of L1 slot 0 (``slot(0)``: an
    array, or one per rank for a :class:`~kvoff.tiers.ranked.RankedTier`): a tier of another
    block size would fail every write-through and promotion, silently. A ``RankedTier`` is
    checked rank by rank (``slot(0)[r]`` against ``ranks[r].fmt.payload_bytes``: equal totals
    of parts in another order fail every ``put`` as well); any other tier against the total."""
    from kvoff.tiers.ranked import RankedTier

    try:
        first = slot(0)
        parts = first if isinstance(first, (tuple, list)) else (first,)
        sizes = [int(p.nbytes) for p in parts]
    except Exception as e:
        raise ValueError(
            f"slot(0) failed ({type(e).__name__}: {e}); slot must map a CPU block id to that "
            "slot's bytes (a uint8 array, e.g. worker.cpu_pool.numpy().__getitem__)"
        ) from e
    slot_bytes = sum(sizes)
    for t in tiers:
        if t.fmt.payload_bytes != slot_bytes:
            raise ValueError(
                f"tier {t.name!r} stores {t.fmt.payload_bytes}-byte blocks but an L1 slot "
                f"(slot(0)) has {slot_bytes} bytes; build the tier's BlockFormat with "
                f"payload_bytes={slot_bytes}"
            )
        if not isinstance(t, RankedTier):
            continue
        want = [r.fmt.payload_bytes for r in t.ranks]
        if len(sizes) != len(want):
            raise ValueError(
                f"tier {t.name!r} has {len(want)} ranks but slot(0) gives {len(sizes)} "
                f"array(s); slot must give a tuple of one array per rank, rank order"
            )
        for r, (have, need) in enumerate(zip(sizes, want, strict=True)):
            if have != need:
                raise ValueError(
                    f"tier {t.name!r}: rank {r} stores {need}-byte parts but rank {r}'s L1 "
                    f"slot (slot(0)[{r}]) has {have} bytes (parts {sizes}, ranks {want}); "
                    f"give slot(b)[r] rank r's slot and build rank {r}'s BlockFormat with "
                    f"payload_bytes={have}"
                )


def _check_keys(keys: Sequence[bytes], name: str) -> None:
    """Raise ValueError unless ``keys`` is a sequence of offload keys as the tiers store them:
    ``bytes`` of 1..:data:`~kvoff.tiers.block_format.MAX_KEY_BYTES` (checked before a probe
    starts, so that a bad key changes nothing instead of failing a later :meth:`poll`)."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise ValueError(
            f"{name}={keys!r} is one {type(keys).__name__}, not a sequence of keys; pass a list "
            f"of offload keys (bytes), e.g. {name}=[key]"
        )
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or not 1 <= len(k) <= MAX_KEY_BYTES:
            raise ValueError(
                f"{name}[{i}]={k!r} is not an offload key: the tiers store keys of bytes of "
                f"1..{MAX_KEY_BYTES}; pass the request's offload keys (bytes)"
            )


class TieredPool:
    """kvoff's CPU pool (L1) with secondary tiers below it (see the module docstring).

    Args:
        manager: the L1 manager (:class:`kvoff.CPUOffloadingManager`); only this object calls it
            while the pool is open.
        slot: CPU block id -> that slot's bytes, a writable ``(payload_bytes,)`` uint8 array
            (a view into the CPU pool, e.g. ``worker.cpu_pool.numpy()[i]``); for a
            :class:`~kvoff.tiers.ranked.RankedTier`, a tuple of one such array per rank.
        tiers: the secondary tiers, fastest first (disk, then remote); every tier's
            ``fmt.payload_bytes`` must equal the slot size in bytes (checked on ``slot(0)``;
            rank by rank for a ``RankedTier``).
        write_queue_blocks: blocks in write-through at most (each pinned in L1 until every
            tier wrote it), an int in 1..2**32 - 1; blocks beyond it are dropped and counted.
            The pool sets it on the manager (``set_write_through``) and turns it off at
            :meth:`close`.
        wait_when_full: replays only (a replay has no compute between requests, so it would
            outrun any tier; an engine never waits): :meth:`wait_for_write_room` then waits
            for room instead of returning at once.

    A refusal starts nothing: no thread runs, the manager's write-through stays off and the
    tiers stay open, not attached (the caller's to close or to attach again).

    Raises:
        TypeError: ``write_queue_blocks`` is not an int (a bool, float, str, None...), or
            ``wait_when_full`` not a bool.
        ValueError: ``write_queue_blocks`` outside 1..2**32 - 1; tiers with the same name;
            tiers whose ``fmt.payload_bytes`` differ from each other or from the size of an
            L1 slot (``slot(0)``); for a :class:`~kvoff.tiers.ranked.RankedTier`, a
            ``slot(0)`` that is not one array per rank or whose array ``r`` is not rank
            ``r``'s ``fmt.payload_bytes`` (the message names the rank); a ``slot`` that fails
            for block 0.
    """

    def __init__(
        self,
        manager: Any,
        slot: Callable[[int], np.ndarray],
        tiers: Sequence[SecondaryTier],
        *,
        write_queue_blocks: int = DEFAULT_WRITE_QUEUE_BLOCKS,
        wait_when_full: bool = False,
    ) -> None:
        check_flag("wait_when_full", wait_when_full)
        cap = check_int(
            write_queue_blocks,
            "write_queue_blocks",
            minimum=1,
            maximum=MAX_WRITE_QUEUE_BLOCKS,
            hint="blocks pinned in L1 for write-through at most, e.g. "
            f"{DEFAULT_WRITE_QUEUE_BLOCKS}; the manager counts them in 32 bits",
        )
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must differ, got {names}")
        sizes = {t.fmt.payload_bytes for t in tiers}
        if len(sizes) > 1:
            raise ValueError(f"tiers disagree on the block size: {sorted(sizes)} bytes")
        if tiers:
            _check_slot_size(slot, tiers)
        self.manager = manager
        self.tiers = list(tiers)
        self._slot = slot
        self._cap = cap
        self._wait_when_full = wait_when_full
        self._reads: list[_Read] = []
        self._reading: set[bytes] = set()
        self._answered: OrderedDict[bytes, None] = OrderedDict()
        self._sources: OrderedDict[bytes, str] = OrderedDict()
        # Probes (contains: an index or EXISTS) and reads (get: whole blocks) on threads of
        # their own, so that one request's long promotion does not hold up every other
        # request's "is it on a tier?" answer.
        self._prober = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvoff-tier-probe")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvoff-tier-read")
        # The manager queues stored blocks; a dispatcher thread takes them and feeds one writer
        # thread per tier; the last tier done hands the blocks back to the manager.
        self._closing = False
        self._generation = 0  # reset() count
        self.resets = 0
        # reset() holds these: the dispatcher's (so no batch is between the manager's queue and
        # the writers' queues) and each writer's (held while its tier.put runs)
        self._dispatch_lock = threading.Lock()
        self._writer_locks = [threading.Lock() for _ in self.tiers]
        self._write_lock = threading.Lock()  # counters and _Write.remaining (writer threads)
        self._write_qs: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in self.tiers]
        self._writers = [
            threading.Thread(target=self._writer, args=(i,), name=f"kvoff-tier-write-{t.name}",
                             daemon=True)
            for i, t in enumerate(self.tiers)
        ]  # fmt: skip
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="kvoff-tier-dispatch", daemon=True
        )
        self.counters: dict[str, dict[str, float]] = {
            t.name: {
                "promoted_blocks": 0, "promoted_bytes": 0, "promotion_seconds": 0.0,
                "promotion_failures": 0, "written_blocks": 0, "write_failures": 0,
                "writes_dropped_reset": 0, "blocks_cleared": 0,
            }
            for t in self.tiers
        }  # fmt: skip
        self.probes = 0
        self.lookup_retries = 0
        # stats_version(): a fresh tick after every tier call and counter update (unique values,
        # so a reader that saw one value sees a different one after any later update)
        self._ticks = itertools.count(1)
        self._stats_tick = 0
        self._closed = False
        if self.tiers:
            manager.set_write_through(cap)
            for th in self._writers:
                th.start()
            self._dispatcher.start()
            _OPEN_POOLS.add(self)

    # ------------------------------------------------------------------ engine thread

    def lookup(self, keys: Sequence[bytes]) -> int | None:
        """How many leading ``keys`` L1 holds now, or ``None``: retry later (a block is being
        stored, or the tiers are being asked for the first missing one and may promote it).

        Args:
            keys: offload keys of one request, in order (bytes).

        Returns:
            Leading keys ready in L1 (blocks), or ``None``.

        Raises:
            TypeError, ValueError: as :meth:`kvoff.CPUOffloadingManager.lookup`.
        """
        hits = self.lookup_groups((keys,))
        return None if hits is None else hits[0]

    def lookup_groups(
        self, key_lists: Sequence[Sequence[bytes]], *, poll: bool = True
    ) -> list[int] | None:
        """:meth:`lookup` of several key lists at once (one per KV cache group of one
        request), answered together: ``None`` while any list waits for a block being stored
        or for the tiers, else the leading L1 hits of each list.

        A list whose first L1 miss the tiers have not been asked about starts a probe. The
        tiers' answers ("no tier has it", or the end of a promoted run) are used up only when
        every list is answered in the same call; using one list's answer while another list
        starts a probe would make the two lists ask again in turn forever.

        ``poll=False`` leaves finished promotions for later: a caller that has just answered
        from L1 (kvoff's scheduler, which polls before its own lookup) must not have L1
        change under that answer, since applying a probe allocates slots and may evict the
        very blocks it counted as hits.

        Raises:
            TypeError, ValueError: as :meth:`kvoff.CPUOffloadingManager.lookup`; with tiers
                also ValueError for a key the tiers cannot store (not ``bytes`` of
                1..:data:`~kvoff.tiers.block_format.MAX_KEY_BYTES`), before any probe starts.
        """
        if poll and self._reads:
            self.poll()
        hits: list[int] = []
        answered: list[bytes] = []
        probes: list[list[bytes]] = []
        busy = reading = False
        for keys in key_lists:
            h = self.manager.lookup(keys)
            if h is None:  # a block still being stored
                busy = True
                continue
            hits.append(h)
            if h >= len(keys) or not self.tiers or self._closed:
                continue  # closed: answered from L1 only
            first = keys[h]
            if first in self._reading:
                busy = reading = True
            elif first in self._answered:
                answered.append(first)
            else:
                probes.append((list(keys[h : h + MAX_PROBE_BLOCKS]), keys[:h]))
        for probe, held in probes:  # checked before any probe starts: a refusal starts none
            _check_keys(probe, "keys")
            _check_keys(held, "held")
        for probe, held in probes:  # two lists with the same first miss: one probe
            self.probe(probe, held=held)
        if busy or probes:
            self.lookup_retries += reading
            return None
        for first in answered:  # the tiers were asked since the last lookup: used up now
            self._answered.pop(first, None)
        return hits

    def probe(
        self,
        keys: Sequence[bytes],
        tiers: Collection[int] | None = None,
        held: Sequence[bytes] = (),
    ) -> bool:
        """Asks the tiers, in the background, for ``keys`` (a request's L1 misses, in the order
        its blocks are used): the leading run some tier holds is promoted into L1 by later
        :meth:`poll` calls. For callers that look keys up one at a time (vLLM's
        ``OffloadingManager`` interface) and so cannot use :meth:`lookup_groups`. Engine thread.

        Args:
            keys: offload keys (bytes); at most :data:`MAX_PROBE_BLOCKS` are asked.
            tiers: indices into :attr:`tiers` of those to ask (a request's tier filter);
                ``None``: all.
            held: the request's keys before ``keys`` that L1 holds (its hits). Making room for
                the promoted run evicts other blocks than these (they are named in the same
                ``prepare_store``, whose keys never evict each other), so that the request
                finds its hits and the run together; one that has left L1 by then is not
                stored again.

        Returns:
            Whether a probe started: not when ``keys`` is empty, there are no tiers, the pool
            is closed (nothing is changed then), or its first key is being read already.

        Raises:
            ValueError: ``keys`` or ``held`` is not a sequence of offload keys (``bytes`` of
                1..:data:`~kvoff.tiers.block_format.MAX_KEY_BYTES`); the message names the
                first bad entry (``keys[i]`` / ``held[i]``). Nothing is started or changed.
        """
        _check_keys(keys, "keys")
        _check_keys(held, "held")
        if self._closed or not keys or not self.tiers or keys[0] in self._reading:
            return False
        probe = list(keys[:MAX_PROBE_BLOCKS])
        self.probes += 1
        self._reading.update(probe)
        asked = None if tiers is None else frozenset(tiers)
        self._reads.append(
            _Read(probe, self._prober.submit(self._probe, probe, asked), time.perf_counter(),
                  self._generation, held=list(held))
        )  # fmt: skip
        return True

    @property
    def reading(self) -> bool:
        """Whether a probe or promotion is in flight (:meth:`poll` has work coming)."""
        return bool(self._reads)

    def is_reading(self, key: bytes) -> bool:
        """Whether ``key`` is in a probe or promotion in flight (asked, not yet answered)."""
        return key in self._reading

    def note_retry(self) -> None:
        """Counts one lookup told to retry while the tiers read (``lookup_retries``), for
        callers of :meth:`probe`."""
        self.lookup_retries += 1

    def wait_for_write_room(self, num_blocks: int) -> bool:
        """Whether the write-through queue has room for ``num_blocks`` more blocks; with
        ``wait_when_full`` (replays) it first waits until it has, or until nothing is in flight.
        Stores need not call it: the manager queues or drops on its own. Engine thread.

        Args:
            num_blocks: blocks about to be stored.

        Raises:
            ValueError: ``num_blocks`` is negative.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        m = self.manager
        while self._wait_when_full and 0 < m.write_through_in_flight > self._cap - num_blocks:
            m.wait_write_through(0.05)
        return m.write_through_in_flight + num_blocks <= self._cap

    def poll(self) -> None:
        """Applies finished background work to L1: probes become reads into L1 slots, reads
        become L1 blocks (or drop their slots), written blocks are unpinned. Never waits."""
        if self._reads:
            still = []
            for r in self._reads:
                if not r.future.done() or not self._finish_read(r):
                    still.append(r)
            self._reads = still
        if self.tiers:
            self.manager.poll_write_through()

    def wait_reads(self) -> None:
        """Blocks until no promotion is in flight (for replays and tests; an engine polls)."""
        while self._reads:
            wait([r.future for r in self._reads])
            self.poll()

    def wait(self) -> None:
        """Blocks until no promotion and no write-through is in flight."""
        self.wait_reads()
        while self.manager.write_through_in_flight:
            self.manager.wait_write_through(0.05)
        self.poll()

    def promoting_keys(self) -> set[bytes]:
        """Keys whose L1 slots are reserved (pending) for a tier read in flight."""
        return {k for r in self._reads if r.phase == 2 for k in r.keys_to_store}

    def take_source(self, key: bytes) -> str:
        """Where the L1 block ``key`` came from: the name of the tier that promoted it (once:
        the record is taken), else ``"L1"``."""
        return self._sources.pop(key, "L1")

    def stats_version(self) -> tuple[int, int, int, int]:
        """Changes whenever :meth:`stats` may have changed (a cheap check before reading them,
        e.g. once per engine step): after every tier call, counter update, probe, retry and
        dropped write. A tier's counters that move without a call from this pool (a Redis
        tier's background refresh) show up with the next call."""
        return (self._stats_tick, self.probes, self.lookup_retries,
                self.manager.write_through_dropped)  # fmt: skip

    def stats(self) -> dict[str, Any]:
        """Counters: ``probes``, ``lookup_retries``, ``writes_queued``,
        ``writes_dropped_queue_full``, ``writes_cancelled_reset`` (queued blocks a
        :meth:`reset` handed back unwritten), ``write_queue_blocks`` (in flight now),
        ``resets``, and per tier (``tiers[name]``) the pool's ``promoted_blocks`` /
        ``promoted_bytes`` / ``promotion_seconds`` / ``promotion_gbps`` /
        ``promotion_failures`` / ``written_blocks`` / ``write_failures`` /
        ``writes_dropped_reset`` (dispatched before a :meth:`reset`, not written) /
        ``blocks_cleared`` (by :meth:`reset`) merged with the tier's own
        :meth:`SecondaryTier.stats`."""
        tiers = {}
        for t in self.tiers:
            c = dict(self.counters[t.name])
            sec = c["promotion_seconds"]
            c["promotion_gbps"] = c["promoted_bytes"] / sec / 1e9 if sec else 0.0
            tiers[t.name] = {**t.stats(), **c}
        m = self.manager
        return {
            "probes": self.probes,
            "lookup_retries": self.lookup_retries,
            "writes_queued": m.write_through_queued,
            "writes_dropped_queue_full": m.write_through_dropped,
            "writes_cancelled_reset": m.write_through_cancelled,
            "write_queue_blocks": m.write_through_in_flight,
            "resets": self.resets,
            "tiers": tiers,
        }

    def reset(self) -> int:
        """Forgets every block made before the call, in every tier, for an engine's cache reset
        (new weights: the blocks are wrong KV now). Engine thread; call it right before
        clearing L1 (:meth:`kvoff.OffloadingScheduler.reset_cache` and the vLLM integrations do
        both). After it returns no tier serves a block written before it, and nothing written
        through from L1 before it is written afterwards:

        * promotions in flight become stale: a read into L1 slots is waited for (each tier call
          ends within the tier's timeout) and its slots are released, never made hits; a probe
          still running is dropped when it ends;
        * write-through batches not yet dispatched go back to L1 unwritten
          (``CPUOffloadingManager.cancel_write_through``), dispatched ones are dropped by their
          writers (``writes_dropped_reset``), and a ``put`` already running is waited for;
        * then each tier's :meth:`~kvoff.tiers.base.SecondaryTier.clear` runs (the disk tier
          zeroes its headers; a shared Redis tier moves to a key space of its own).

        It returns once the writers have handed every block back, so L1 holds no block pinned
        for write-through when the caller clears it (a bare ``clear`` meanwhile would take such
        blocks out of its index and free their slots when the writers hand them back).

        Returns:
            The blocks the tiers dropped, as they count them (``blocks_cleared`` per tier).
            0 without tiers or once closed.
        """
        if self._closed or not self.tiers:
            return 0
        cleared = 0
        with self._dispatch_lock:
            for lock in self._writer_locks:
                lock.acquire()
            try:
                # every read and write-through started so far is stale from here on: the
                # dispatcher and the writers read the generation under the locks held now
                self._generation += 1
                self.resets += 1
                self.manager.cancel_write_through()
                for t in self.tiers:
                    try:
                        n = int(t.clear())
                    except Exception as e:  # a tier must not raise; it would keep its blocks
                        log.error("tier %s: clear failed, it is closed (its blocks are not "
                                  "served again): %s", t.name, e)  # fmt: skip
                        t.close()
                        n = 0
                    self.counters[t.name]["blocks_cleared"] += n
                    cleared += n
            finally:
                for lock in self._writer_locks:
                    lock.release()
        self._answered.clear()
        self._sources.clear()
        # reads into L1 slots end now, so that their pending slots are released before L1 is
        # cleared (a clear that drops pending blocks would free slots still being written)
        reading = [r.future for r in self._reads if r.phase == 2]
        if reading:
            wait(reading)
        self.poll()  # stale reads that ended: slots released, probes dropped; unpins
        # what is still in write-through is stale: its writers drop it without I/O, so L1 has
        # every block back (unpinned) before the caller clears it
        while self.manager.write_through_in_flight:
            self.manager.wait_write_through(0.05)
        self._stats_tick = next(self._ticks)
        return cleared

    def close(self) -> None:
        """Waits for the work in flight, stops the threads and closes the tiers. Idempotent."""
        if self._closed:
            return
        self.wait()
        self._prober.shutdown()
        self._reader.shutdown()
        if self.tiers:
            self.manager.set_write_through(0)  # later stores are not queued
            self._stop_dispatcher()
            for q in self._write_qs:
                q.put(_STOP)
            for th in self._writers:
                th.join()
        for t in self.tiers:
            t.close()
        self._closed = True

    # ------------------------------------------------------------------ internals

    def _answer(self, key: bytes) -> None:
        self._answered[key] = None
        if len(self._answered) > _ANSWERED_CAP:
            self._answered.popitem(last=False)

    def _finish_read(self, r: _Read) -> bool:
        """Applies a finished phase; ``True`` when the promotion is over. A phase that fails
        to apply (the tier thread or the manager raised) ends the promotion as a miss: its
        pending L1 slots are released and its keys are no longer being read, so that the pool
        keeps working (a read left in ``_reads`` would raise again on every poll)."""
        try:
            return self._apply_read(r)
        except Exception:
            log.exception(
                "kvoff tiers: a finished promotion of %d keys could not be applied; its blocks "
                "are misses, their L1 slots are released",
                len(r.keys),
            )
            self._abandon_read(r)
            return True

    def _abandon_read(self, r: _Read) -> None:
        """Ends promotion ``r`` as a miss after a failure: its keys still pending in L1 are
        dropped (``complete_store(..., False)``, one at a time: the ones already finished are
        refused and skipped) and, for a read into L1 slots, counted in ``promotion_failures``;
        its keys are answered and no longer being read."""
        released: set[bytes] = set()
        for k in r.keys_to_store:
            try:
                self.manager.complete_store([k], False)
            except ValueError:  # not pending (finished before the failure): nothing to drop
                continue
            released.add(k)
        if r.phase == 2 and r.generation == self._generation:
            for k, s in zip(r.keys_to_store, r.sources, strict=True):
                if k in released:
                    self.counters[self.tiers[s].name]["promotion_failures"] += 1
        self._reading.difference_update(r.keys)
        self._answer(r.keys[0])
        self._stats_tick = next(self._ticks)

    def _apply_read(self, r: _Read) -> bool:
        """:meth:`_finish_read` without the failure handling."""
        self._stats_tick = next(self._ticks)  # this thread reads the stats: order is kept
        if r.generation != self._generation:  # started before a reset(): its blocks are stale
            if r.phase == 2:
                r.future.result()  # the reader is done with the slots
                self.manager.complete_store(r.keys_to_store, False)
            self._reading.difference_update(r.keys)
            return True
        if r.phase == 1:
            sources: list[int] = r.future.result()
            n = len(sources)
            held = r.held  # the request's hits: named too, so never evicted for the run
            # a promotion is no offer: the store_threshold filter neither counts nor skips it
            # (the blocks passed it when they were first stored)
            promote = functools.partial(self.manager.prepare_store, apply_threshold=False)
            out = promote(held + r.keys[:n]) if n else None
            while out is None and n > 1:
                # L1 cannot take the whole run at once (too few free or evictable slots): the
                # leading part that fits is promoted, the rest comes on a later miss
                n //= 2
                out = promote(held + r.keys[:n])
            src = dict(zip(r.keys[:n], sources[:n], strict=True))
            keys_to_store: list[bytes] = []
            block_ids: list[int] = []
            if out is not None:
                r.keys_to_store = list(out.keys_to_store)  # pending now: released on a failure
                # a hit that left L1 since the lookup is not stored from nowhere: released
                gone = [k for k in out.keys_to_store if k not in src]
                if gone:
                    self.manager.complete_store(gone, False)
                    keys_to_store = [k for k in out.keys_to_store if k in src]
                    block_ids = [b for k, b in zip(out.keys_to_store, out.block_ids,
                                                   strict=True) if k in src]  # fmt: skip
                else:
                    keys_to_store, block_ids = list(out.keys_to_store), list(out.block_ids)
            if out is None or not keys_to_store:
                self._reading.difference_update(r.keys)
                self._answer(r.keys[n] if n < len(r.keys) and out is not None else r.keys[0])
                return True
            try:
                outs = [self._slot(b) for b in block_ids]
                future = self._reader.submit(
                    self._read, keys_to_store, [src[k] for k in keys_to_store], outs
                )
            except Exception:  # the slots go back: no key may stay pending forever
                log.exception("kvoff tiers: could not start the read of %d promoted blocks; "
                              "their L1 slots are released", len(keys_to_store))  # fmt: skip
                self.manager.complete_store(keys_to_store, False)
                self._reading.difference_update(r.keys)
                self._answer(r.keys[0])
                return True
            r.keys_to_store = keys_to_store
            r.sources = [src[k] for k in keys_to_store]
            r.phase = 2
            r.future = future
            r.t0 = time.perf_counter()
            return False
        ok: list[bool] = r.future.result()
        good = [k for k, g in zip(r.keys_to_store, ok, strict=True) if g]
        bad = [k for k, g in zip(r.keys_to_store, ok, strict=True) if not g]
        if good:  # a tier has them already: not written through again
            self.manager.complete_store(good, True, write_through=False)
        if bad:
            self.manager.complete_store(bad, False)
        seconds = time.perf_counter() - r.t0
        size = self.tiers[0].fmt.payload_bytes
        for k, s, g in zip(r.keys_to_store, r.sources, ok, strict=True):
            c = self.counters[self.tiers[s].name]
            if g:
                c["promoted_blocks"] += 1
                c["promoted_bytes"] += size
                self._sources[k] = self.tiers[s].name
                if len(self._sources) > _ANSWERED_CAP:
                    self._sources.popitem(last=False)
            else:
                c["promotion_failures"] += 1
        for s in set(r.sources):
            self.counters[self.tiers[s].name]["promotion_seconds"] += seconds
        self._reading.difference_update(r.keys)
        failed = next((k for k, g in zip(r.keys_to_store, ok, strict=True) if not g), None)
        if failed is not None:
            self._answer(failed)
        else:  # the first key after the promoted run (the retry's first L1 miss)
            stop = r.keys.index(r.keys_to_store[-1]) + 1
            if stop < len(r.keys):
                self._answer(r.keys[stop])
        return True

    def _stop_dispatcher(self) -> None:
        self._closing = True
        self.manager.close_write_through()
        if self._dispatcher.is_alive():
            self._dispatcher.join()
        _OPEN_POOLS.discard(self)

    def _dispatch(self) -> None:
        """Dispatcher thread: takes the manager's write-through batches and gives each to every
        tier's writer."""
        while not self._closing:
            with self._dispatch_lock:  # reset() waits for a batch taken here to be queued
                for keys, block_ids in self.manager.take_write_through(0.05):
                    job = _Write(keys, block_ids, len(self.tiers), self._generation)
                    for q in self._write_qs:
                        q.put(job)

    def _writer(self, index: int) -> None:
        """Writer thread of tier ``index``: writes queued blocks from their L1 slots; the last
        tier done with a batch hands its blocks back to the manager (unpinned there)."""
        tier, q = self.tiers[index], self._write_qs[index]
        c = self.counters[tier.name]
        while True:
            job = q.get()
            if job is _STOP:
                return
            result: list[bool] | None = None
            with self._writer_locks[index]:  # reset() waits for a put running here
                stale = job.generation != self._generation  # taken before a reset(): dropped
                if not stale:
                    try:
                        result = tier.put(job.keys, [self._slot(b) for b in job.block_ids])
                    except Exception:  # a tier must not raise; if it does, the blocks failed
                        log.exception("tier %s: put of %d written-through blocks failed; they "
                                      "are counted in write_failures", tier.name,
                                      len(job.keys))  # fmt: skip
                        result = None
            good = sum(1 for d in result if d) if result is not None else 0
            with self._write_lock:
                if stale:
                    c["writes_dropped_reset"] += len(job.keys)
                else:
                    c["written_blocks"] += good
                    c["write_failures"] += len(job.keys) - good
                job.remaining -= 1
                last = job.remaining == 0
            self._stats_tick = next(self._ticks)
            if last:
                self.manager.write_through_done(job.block_ids)

    def _probe(self, keys: list[bytes], asked: frozenset[int] | None = None) -> list[int]:
        """Tier index of each key of the leading run some tier holds (first tier first; only
        the tiers in ``asked``, when given)."""
        found: list[int | None] = [None] * len(keys)
        for i, tier in enumerate(self.tiers):
            if asked is not None and i not in asked:
                continue
            rest = [j for j, f in enumerate(found) if f is None]
            if not rest:
                break
            try:
                present = list(tier.contains([keys[j] for j in rest]))
                if len(present) != len(rest):
                    raise ValueError(f"{len(present)} answers for {len(rest)} keys")
            except Exception as e:  # a tier must not raise (or miscount); treat as absent
                log.warning("tier %s: contains failed, its blocks are misses: %s", tier.name, e)
                continue
            for j, p in zip(rest, present, strict=True):
                if p:
                    found[j] = i
        run: list[int] = []
        for f in found:
            if f is None:
                break
            run.append(f)
        self._stats_tick = next(self._ticks)  # after the tiers' counters moved
        return run

    def _read(self, keys: list[bytes], sources: list[int], outs: list[np.ndarray]) -> list[bool]:
        """Reads each key from its tier into its L1 slot; ``False`` where the tier could not."""
        ok = [False] * len(keys)
        for s in sorted(set(sources)):
            idx = [i for i, src in enumerate(sources) if src == s]
            try:
                got = list(self.tiers[s].get([keys[i] for i in idx], [outs[i] for i in idx]))
                if len(got) != len(idx):
                    raise ValueError(f"{len(got)} answers for {len(idx)} keys")
            except Exception as e:  # as above: misses (the slots are dropped, never served)
                log.warning("tier %s: get failed, its blocks are misses: %s", self.tiers[s].name, e)
                continue
            for i, g in zip(idx, got, strict=True):
                ok[i] = bool(g)
        self._stats_tick = next(self._ticks)  # after the tiers' counters moved
        return ok
