"""kvoff's CPU pool as vLLM's ``OffloadingManager``: :class:`KvoffOffloadingManager` on
kvoff's C++ :class:`kvoff.CPUOffloadingManager`, with kvoff's secondary tiers below it when
they are configured, for :class:`~kvoff.integrations.vllm.KvoffOffloadingSpec` (vLLM's Python
scheduler decides the jobs; this manager answers its lookups, slots and recency).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoff import CPUOffloadingManager
from kvoff.integrations.vllm.metrics import tier_totals

__all__ = ["SETTLED_STEPS", "KvoffCPUBlocks", "KvoffOffloadingManager"]


class KvoffCPUBlocks(CPULoadStoreSpec):
    """The CPU side of a vLLM offloading job: kvoff CPU block ids (slots), one per offloaded
    block (chunk), in the order of the job's keys: ``block_ids`` (and vLLM's alias
    ``chunk_ids``), an int32 array. A ``CPULoadStoreSpec``, as vLLM's CPU manager returns."""


@dataclass(slots=True)
class _RequestAccess:
    """The offload keys one request used, kept in its vLLM ``ReqContext`` until it finishes,
    when :meth:`KvoffOffloadingManager.on_request_finished` makes them recent in prefix order
    (vLLM 0.32's managers apply a request's recency there: its scheduler never calls
    ``touch``)."""

    owner: object  # the manager that recorded it
    generation: int  # the manager's cache generation (a reset starts a new one)
    groups: dict[int, list[OffloadKey]] = field(default_factory=dict)  # first-seen order
    seen: set[OffloadKey] = field(default_factory=set)
    inserted: set[OffloadKey] = field(default_factory=set)  # stored by this request
    reused: set[OffloadKey] = field(default_factory=set)  # ready blocks it used, not its own
    finished: bool = False


def _group_of(key: OffloadKey) -> int:
    """The KV cache group of a vLLM offload key (its last 4 bytes, big-endian:
    ``vllm.v1.kv_offload.base.make_offload_key``)."""
    return int.from_bytes(key[-4:], "big")


def _prefix_order(access: _RequestAccess, req_context: ReqContext) -> list[OffloadKey]:
    """A request's keys head to tail: by the token position vLLM's scheduler recorded for each
    (``ReqContext.get_offload_key_position``) across all KV cache groups when every key has
    one, so that one group's tail never outranks another group's head; else group by group
    (group order), each by position when all of its keys have one, else in the order the
    request used them. The same order as vLLM's ``order_request_keys``."""
    position = req_context.get_offload_key_position
    keys: list[OffloadKey] = []
    for g in sorted(access.groups):
        group = access.groups[g]
        pos = [position(k) for k in group]
        if None not in pos:
            group = [k for _, _, k in sorted(zip(pos, range(len(group)), group, strict=True))]
        keys.extend(group)
    pos = [position(k) for k in keys]
    if None not in pos:
        keys = [k for _, _, k in sorted(zip(pos, range(len(keys)), keys, strict=True))]
    return keys


class _NoPool:
    """The CPU manager of a pool of 0 blocks (vLLM sizes the pool at 0 when the workers' KV
    bytes per block are 0): every key misses and nothing can be stored."""

    num_blocks = num_free_blocks = num_stored_blocks = num_pending_blocks = 0
    num_evictable_blocks = num_retired_blocks = num_reserved_blocks = num_pinned_blocks = 0
    stores_skipped = 0

    def lookup(self, keys: Sequence[bytes]) -> int:
        return 0

    def prepare_store(self, keys: Sequence[bytes]) -> Any:
        return None if keys else _EMPTY_STORE

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        if keys:
            raise ValueError(
                f"key {bytes(keys[0]).hex()} is not in the CPU pool, which has 0 blocks; load "
                "only keys that lookup() reports as hits"
            )
        return []

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.prepare_load(keys)

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        self.prepare_load(keys)

    def touch(self, keys: Sequence[bytes], reused: Sequence[bool] | None = None) -> None:
        return None

    def take_events(self) -> list[Any]:
        return []

    def clear(self, include_in_flight: bool = False) -> int:
        return 0


@dataclass(frozen=True)
class _EmptyStore:
    keys_to_store: tuple[bytes, ...] = ()
    block_ids: tuple[int, ...] = ()
    evicted_keys: tuple[bytes, ...] = ()


_EMPTY_STORE = _EmptyStore()


#: Engine steps for which a key the tiers were asked about and did not promote stays a miss
#: (:class:`KvoffOffloadingManager` with tiers): long enough for a waiting request to be looked
#: up again in one of the next steps, short enough that a block another engine writes to a
#: shared tier later is found.
SETTLED_STEPS = 8

_TIER_SOURCES = {"disk": CacheHitSource.DISK, "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}


class KvoffOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` interface on kvoff's C++ :class:`kvoff.CPUOffloadingManager`
    (the CPU pool, eviction and invariants 6 and 8 are kvoff's), optionally with kvoff's
    secondary tiers below the pool (:meth:`attach_tiers`).

    With tiers, vLLM's scheduler asks one key at a time and keeps asking after a ``RETRY``
    until a ``MISS``. A key the CPU pool misses is collected during the step; at the step's end
    (:meth:`on_schedule_end`) each request's collected keys go to the tiers as one background
    probe (:meth:`kvoff.tiers.coordinator.TieredPool.probe`), whose leading run some tier holds
    is read into CPU slots (promotion). Until then the keys answer ``RETRY`` (``HIT_PENDING``
    while their slots are being filled); afterwards a promoted key is a ``HIT`` and any other
    asked key a ``MISS`` for :data:`SETTLED_STEPS` steps. Promotions are applied only at the
    step's end, never between a request's lookup and its ``prepare_load``, so a block counted
    as a hit is not evicted under the request. Completed stores are written through to the
    tiers in the background (see :mod:`kvoff.tiers.coordinator`).

    Recency, as vLLM 0.32's ``CPUOffloadingManager`` keeps it: vLLM's scheduler never calls
    :meth:`touch`; a request's keys (those it loaded, stored or offered while held) are
    recorded in its ``ReqContext`` and made recent when it finishes
    (:meth:`on_request_finished`), head most recent, ordered by token position across KV
    cache groups (invariant 8 over the whole request). Blocks it loaded, or offered while
    another request had stored them, count as a reuse (ARC promotes them, probation protects
    them); blocks it stored itself are only ordered. New blocks enter the policy at
    :meth:`prepare_store` as the most recent, the call's first key the most recent of them.

    Args:
        num_blocks: CPU slots (offloaded blocks); 0 makes a pool that holds nothing (vLLM sizes
            the pool at 0 when the workers' KV bytes per block are 0).
        eviction_policy: a kvoff eviction policy name.
        enable_events: record ``BlockStored`` / ``BlockRemoved`` events.
        store_threshold: store a block only once ``prepare_store`` was offered it this many
            times (vLLM's admission filter; < 2: every block); see
            :class:`kvoff.CPUOffloadingManager`.
        max_tracker_size: keys the admission filter counts at most.
        manager: the manager to use instead of a private one: a node pool's
            :class:`kvoff.node_pool.NodePoolClient` (its policy and admission are the pool's;
            ``num_blocks`` is its size).

    Raises:
        ValueError: a negative ``num_blocks``, an unknown policy, or a bad ``store_threshold``
            / ``max_tracker_size``.
        MemoryError: the host cannot hold the pool's index and policy (about 110 bytes per
            block); the message names ``num_blocks``, the bytes needed and the fix (a smaller
            ``cpu_bytes_to_use``).
    """

    def __init__(
        self,
        num_blocks: int,
        eviction_policy: str,
        enable_events: bool,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        manager: Any = None,
    ) -> None:
        if num_blocks < 0:
            raise ValueError(
                f"the CPU pool has {num_blocks} offloaded blocks; raise cpu_bytes_to_use in "
                "kv_connector_extra_config so that at least one offloaded block fits"
            )
        self.medium = Medium.CPU
        self.num_blocks = num_blocks
        self.store_threshold = store_threshold
        self.manager: Any = _NoPool()
        if manager is not None:  # a node pool's client (kvoff.node_pool.NodePoolClient)
            self.manager = manager
            if enable_events:
                manager.enable_events()
        elif num_blocks > 0:
            self.manager = CPUOffloadingManager(
                num_blocks,
                eviction_policy,
                enable_events,
                store_threshold=store_threshold,
                max_tracker_size=max_tracker_size,
            )
        self._generation = 0  # cache resets so far: older request records are dropped
        self._allocation_sizes: list[int] = []  # keys to store per prepare_store, for get_stats
        self._skipped_seen = 0
        self.tiers: Any = None  # kvoff.tiers.coordinator.TieredPool, after attach_tiers
        self._step = 0
        # request -> (keys to probe at the step's end, the tiers its filter allows)
        self._asks: dict[str, tuple[list[OffloadKey], tuple[int, ...]]] = {}
        self._asking: set[OffloadKey] = set()  # the keys in _asks
        self._asked: dict[OffloadKey, None] = {}  # keys of probes in flight
        self._retried: set[str] = set()  # requests told to retry this step while tiers read
        # with tiers: request -> its keys that hit L1 this step, named to its probe so that
        # the promotion's room is never made by evicting them
        self._held: dict[str, list[OffloadKey]] = {}
        # asked, answered, not promoted -> step, oldest first. An OrderedDict drops its
        # oldest in O(1); a dict's next(iter()) walks the slots its deletions left, which cost
        # 3.9 ms a step at 1,024 keys settled per step (0.17 ms now)
        self._settled: OrderedDict[OffloadKey, int] = OrderedDict()
        self._tier_seen: dict[str, int] = {}
        self._tier_version: Any = None

    def attach_tiers(
        self,
        tiers: Sequence[Any],
        slot: Callable[[int], Any],
        *,
        write_queue_blocks: int | None = None,
    ) -> Any:
        """Puts secondary tiers (:class:`kvoff.tiers.base.SecondaryTier`, fastest first) below
        the CPU pool.

        Args:
            tiers: the tiers; each one's ``fmt.payload_bytes`` is the CPU slot size in bytes.
            slot: CPU block id -> that slot's bytes (a writable uint8 array, or one per rank
                for :class:`kvoff.tiers.ranked.RankedTier`).
            write_queue_blocks: blocks pinned for write-through at most; ``None``: a quarter
                of the pool, at most 1024 (:func:`kvoff.tiers.coordinator.
                default_write_queue_blocks`).

        Returns:
            The :class:`kvoff.tiers.coordinator.TieredPool`.

        Raises:
            ValueError: tiers attached already, or what ``TieredPool`` raises.
        """
        from kvoff.tiers.coordinator import TieredPool, default_write_queue_blocks

        if self.tiers is not None:
            raise ValueError("tiers are attached already; shutdown() the manager first")
        cap = write_queue_blocks or default_write_queue_blocks(self.num_blocks)
        self.tiers = TieredPool(self.manager, slot, tiers, write_queue_blocks=cap)
        return self.tiers

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT (ready), HIT_PENDING (being stored or promoted), MISS, or with tiers RETRY (the
        tiers are being asked for it)."""
        hits = self.manager.lookup([key])
        if hits is None:
            return LookupResult.HIT_PENDING
        if hits:
            if self.tiers is not None:
                held = self._held.get(req_context.req_id)
                if held is None:
                    self._held[req_context.req_id] = held = []
                held.append(key)
            return LookupResult.HIT
        tiers = self.tiers
        if tiers is None or key in self._settled:
            return LookupResult.MISS
        if tiers.is_reading(key):
            if req_context.req_id not in self._retried:  # counted once per request and step
                self._retried.add(req_context.req_id)
                tiers.note_retry()
            return LookupResult.RETRY
        if key not in self._asking:
            allowed = _allowed_tiers(req_context, tiers.tiers)
            if not allowed:
                return LookupResult.MISS
            self._asking.add(key)
            ask = self._asks.get(req_context.req_id)
            if ask is None:
                self._asks[req_context.req_id] = ask = ([], allowed)
            ask[0].append(key)
        return LookupResult.RETRY

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """``DISK`` for the first load of a block promoted from the disk tier,
        ``EXTERNAL_UNSPECIFIED`` from the remote tier (vLLM has no name for a shared store),
        else ``HOST`` (kvoff's CPU pool)."""
        if self.tiers is None:
            return CacheHitSource.HOST
        return _TIER_SOURCES.get(self.tiers.take_source(bytes(key)), CacheHitSource.HOST)

    def on_schedule_end(self, context: Any) -> None:
        """With tiers: applies the promotions read by now, settles the keys whose probe is
        over, and sends this step's collected keys to the tiers (one probe per request)."""
        tiers = self.tiers
        if tiers is None:
            return
        tiers.poll()
        self._step += 1
        step, settled = self._step, self._settled
        if self._asked:
            done = [k for k in self._asked if not tiers.is_reading(k)]
            for k in done:
                del self._asked[k]
                settled.pop(k, None)  # re-inserted last: the dict stays in step order
                settled[k] = step
        while settled:
            first = next(iter(settled))
            if settled[first] > step - SETTLED_STEPS:
                break
            settled.popitem(last=False)
        for req_id, (keys, allowed) in self._asks.items():
            tiers.probe(
                keys,
                None if len(allowed) == len(tiers.tiers) else allowed,
                held=self._held.get(req_id, ()),
            )
            self._asked.update(dict.fromkeys(keys))
        self._asks.clear()
        self._held.clear()
        self._asking.clear()
        self._retried.clear()

    def has_pending_work(self) -> bool:
        """Whether keys wait for the tiers (vLLM then keeps stepping)."""
        return bool(self._asks or self._asked)

    def _open_access(self, req_context: ReqContext) -> _RequestAccess | None:
        """The request's access record while it applies: made by this manager since its last
        cache reset and not applied yet; else None."""
        access = req_context.get_state(_RequestAccess)
        if (
            access is None
            or access.owner is not self
            or access.generation != self._generation
            or access.finished
        ):
            return None
        return access

    def _access(self, req_context: ReqContext) -> _RequestAccess:
        """The request's access record (a new one after a cache reset, for another manager, or
        once the request's last one was applied)."""
        access = self._open_access(req_context)
        if access is None:
            access = _RequestAccess(owner=self, generation=self._generation)
            req_context.set_state(access)
        return access

    @staticmethod
    def _record(
        access: _RequestAccess,
        keys: Iterable[OffloadKey],
        inserted: Iterable[OffloadKey] = (),
        reused: Iterable[OffloadKey] = (),
    ) -> None:
        seen, groups = access.seen, access.groups
        for key in keys:
            if key not in seen:
                seen.add(key)
                groups.setdefault(_group_of(key), []).append(key)
        access.inserted.update(inserted)
        # reading back a block this request stored (a tier's cascade) is not a reuse
        access.reused.update(k for k in reused if k not in access.inserted)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> KvoffCPUBlocks:
        """Pins the keys' blocks until :meth:`complete_load`; their CPU block ids. The keys
        are a reuse of the request's, made recent when it finishes.

        Raises:
            ValueError: a key that is not ready in the pool (missing or still being stored),
                named with its state; nothing is pinned.
        """
        keys = list(keys)
        spec = KvoffCPUBlocks(self.manager.prepare_load(keys))
        self._record(self._access(req_context), keys, reused=keys)
        return spec

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Marks the keys used, the first most recently (invariant 8).

        Raises:
            TypeError, ValueError: a key that is not a non-empty bytes object.
        """
        self.manager.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpins the keys' blocks.

        Raises:
            ValueError: a key that is not being loaded (no :meth:`prepare_load`); nothing is
                unpinned.
        """
        self.manager.complete_load(list(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Slots for the keys not held (all or nothing: None changes no block, invariant 6),
        in the call's order; with ``store_threshold`` only for those offered often enough.
        The request's keys are recorded for its recency at :meth:`on_request_finished`:
        those stored now as its own, those another request had stored (ready) as a reuse,
        also when the call returns None."""
        keys = list(keys)
        manager = self.manager
        out = manager.prepare_store(keys)
        stored = [] if out is None else list(out.keys_to_store)
        new = set(stored)
        # held keys: ready ones are a reuse; pending ones (another request is storing them),
        # missing ones (no room, or held back by the admission filter) are not recorded
        held = [k for k in keys if k not in new]
        key_states = getattr(manager, "key_states", None)  # a node pool's: no round trips
        if key_states is not None:
            state = dict(zip(held, key_states(held), strict=True))  # 1, 0 or None
        else:
            state = {k: manager.lookup([k]) for k in held}
        ready = [k for k, st in state.items() if st == 1]
        # vLLM's allocation-size histogram: the keys that needed a slot, refused calls too
        attempted = len(stored) if out is not None else sum(st == 0 for st in state.values())
        if attempted > 0:
            self._allocation_sizes.append(attempted)
        access = self._access(req_context)
        keep = new.union(ready)
        self._record(access, (k for k in keys if k in keep), inserted=stored, reused=ready)
        if out is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=stored,
            store_spec=KvoffCPUBlocks(list(out.block_ids)),
            evicted_keys=list(out.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Makes the pending keys hits (or, when ``success`` is False, frees their slots);
        with tiers, queues them for write-through. As vLLM's ``OffloadingManager`` contract
        says, keys that are not pending (stored already, or dropped by a reset) are left as
        they are.

        Raises:
            ValueError, TypeError: a key that is not a valid key (not bytes of 1..64 or an
                int); nothing is completed.
        """
        keys = list(keys)
        try:
            self.manager.complete_store(keys, success)  # all pending: the usual case
        except ValueError:
            m = self.manager
            pending = [k for k in keys if m.lookup([k]) is None]  # None: pending; raises if bad
            if len(pending) == len(keys):
                raise
            m.complete_store(pending, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Starts the request's access record; every request offloads per block (vLLM's
        default policy)."""
        self._access(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Makes the request's keys recent in prefix order: head most recent, a tail evicted
        before its head across every KV cache group (:func:`_prefix_order`); blocks it reused
        count as a reuse, those it stored only as ordered
        (:meth:`kvoff.CPUOffloadingManager.touch` with ``reused``). Keys no longer held are
        passed by. Once per record: a second call does nothing."""
        access = self._open_access(req_context)
        if access is None:
            return
        access.finished = True
        if access.seen:
            keys = _prefix_order(access, req_context)
            reused = access.reused
            self.manager.touch(keys, [k in reused for k in keys])

    def take_events(self) -> Iterable[OffloadingEvent]:
        """kvoff's events as vLLM's ``OffloadingEvent`` (medium CPU; promotions are stores)."""
        for e in self.manager.take_events():
            yield OffloadingEvent(
                keys=[OffloadKey(k) for k in e.keys], medium=Medium.CPU,
                removed=e.kind == "BlockRemoved",
            )  # fmt: skip

    def get_stats(self) -> Any:
        """vLLM's CPU offloading metrics (``vllm.v1.kv_offload.cpu.common.
        CPUOffloadingMetrics``, same names and meaning as its ``CPUOffloadingManager``), as an
        ``OffloadingConnectorStats``, every call:

        * ``vllm:kv_offload_cpu_cache_usage_perc``: the fraction of the pool's blocks that
          transfers pin now (stores in flight, blocks being loaded or written through to the
          tiers; not a node pool's slots reserved for stores and not taken yet; 0.0 with 0
          blocks), ``..._write_usage_perc`` the stores' share,
          ``..._read_usage_perc`` the rest (blocks being read);
        * ``vllm:kv_offload_cpu_allocation_size``: one histogram sample per
          :meth:`prepare_store` since the last call that needed slots (keys needing one);
        * with ``store_threshold`` >= 2, ``vllm:kv_offload_stores_skipped``: blocks the
          admission filter held back since the last call;
        * with tiers, the tiers' counters that moved, as ``vllm:kvoff_<name>``
          (:data:`_TIER_COUNTERS`).

        The metric definitions come from :meth:`KvoffOffloadingSpec.build_metric_definitions`.
        """
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        m, n = self.manager, self.num_blocks
        stats = OffloadingConnectorStats()
        usage = m.num_pinned_blocks / n if n > 0 else 0.0
        write = m.num_pending_blocks / n if n > 0 else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(usage - write, 0.0))
        for size in self._allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocation_sizes.clear()
        if self.store_threshold >= 2:
            skipped, self._skipped_seen = m.stores_skipped - self._skipped_seen, m.stores_skipped
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, skipped)
        tiers = self.tiers
        if tiers is not None and tiers.stats_version() != self._tier_version:
            self._tier_version = tiers.stats_version()
            now, seen = tier_totals(tiers), self._tier_seen
            for name, value in now.items():
                if value != seen.get(name, 0):
                    stats.increase_counter(f"vllm:kvoff_{name}", value - seen.get(name, 0))
            self._tier_seen = now
        return stats

    def reset_cache(self) -> None:
        """Drops every block, those of jobs in flight included: vLLM's
        OffloadingConnectorScheduler forgets its jobs in flight at a reset and never completes
        them, so their blocks would stay pending (every request reading them deferred for
        ever) or pinned (pre-reset KV served as hits). The tiers are reset first
        (:meth:`kvoff.tiers.coordinator.TieredPool.reset`): none of their blocks made before
        the reset is served after it."""
        if self.tiers is not None:
            self.tiers.reset()
        self.manager.clear(include_in_flight=True)
        self._generation += 1  # requests' records of blocks before the reset are dropped

    def shutdown(self) -> None:
        """Waits for the tiers' reads and writes and closes them. Idempotent."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None


def _allowed_tiers(req_context: ReqContext, tiers: Sequence[Any]) -> tuple[int, ...]:
    """The indices of the tiers the request's ``load_tier_filter`` (vLLM's ``kv_load_tiers``)
    lets it load from: the disk tier is local storage, the remote tier remote storage."""
    from vllm.v1.kv_offload.base import Locality

    allowed = req_context.load_tier_filter
    return tuple(
        i for i, t in enumerate(tiers)
        if allowed.allows(Medium.STORAGE, Locality.LOCAL if t.name == "disk" else Locality.REMOTE)
    )  # fmt: skip
