"""The offloading scheduler: the engine-facing hooks of docs/design.md "One engine step".
(One job, the Python face of the scheduler: its hooks; their argument checks are in
:mod:`kvoff.scheduler_checks`, the records they read and make in :mod:`kvoff.scheduler_records`,
re-exported here.)

:class:`OffloadingScheduler` wraps the C++ scheduler core (``kvoff._scheduler``). Per engine
step:

1. new request: :meth:`~OffloadingScheduler.get_num_new_matched_tokens` says how many tokens
   beyond the engine's own GPU prefix hit can be loaded from the CPU pool (``None``: retry
   later); after allocating GPU blocks the engine calls
   :meth:`~OffloadingScheduler.update_state_after_alloc`, which builds the load job;
2. end of scheduling: :meth:`~OffloadingScheduler.build_connector_meta` with a
   :class:`SchedulerStep` returns the load and store jobs for the worker and the in-flight
   jobs to flush first (fences);
3. the worker runs the jobs (:class:`kvoff.OffloadingWorker`), every rank reports each job;
4. :meth:`~OffloadingScheduler.update_connector_output` counts the reports; a job completes
   when all ``world_size`` ranks reported it.

Offload keys: offloaded block ``j`` of KV cache group ``g`` has the key
``hash_bytes(block_hashes[(j + 1) * H - 1]) + bytes([g])`` with
``H = offloaded_block_size // hash_block_size`` (an int hash is 8 little-endian bytes).

Which cached tokens a group needs to resume at token ``N``: full attention and MLA all
``N``; a sliding window of ``W`` tokens the last ``W - 1``; Mamba the state block holding
token ``N - 1``. With any sliding-window or Mamba group the last prompt token is always
recomputed (a hit never covers it), so the cached window or state ends where the engine
resumes. Engine contract for Mamba groups: the block at position ``p`` of the table holds the
state after the last token of block ``p`` once that block is full.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvoff._scheduler import COUNTER_NAMES, OffloadingEvent, _OffloadingScheduler
from kvoff.jobs import CPUBlockSpec, GPUBlockSpec, _trusted
from kvoff.scheduler_checks import (
    check_scheduler_args,
    job_report,
    key_bytes,
    not_a,
    token_count,
)
from kvoff.scheduler_records import (
    ConnectorMetadata,
    ConnectorOutput,
    FinishState,
    JobReport,
    Request,
    RequestLike,
    ScheduledRequest,
    SchedulerStep,
    TransferJob,
)
from kvoff.specs import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

if TYPE_CHECKING:
    import numpy as np

    from kvoff.config import OffloadingConfig
    from kvoff.node_pool import NodePoolClient
    from kvoff.offloading_spec import CPUOffloadingSpec
    from kvoff.specs import KVCacheConfig, KVCacheSpec
    from kvoff.tiers.base import SecondaryTier
    from kvoff.tiers.coordinator import TieredPool

__all__ = [
    "COUNTER_NAMES",
    "ConnectorMetadata",
    "ConnectorOutput",
    "JobReport",
    "OffloadingScheduler",
    "Request",
    "RequestLike",
    "ScheduledRequest",
    "SchedulerStep",
    "TransferJob",
    "group_kinds",
]

# Collections of request ids the core reads as they are (anything else, e.g. a generator, is
# copied first, since the ids are read twice); the set gives the usual case in one lookup.
_ID_COLLECTION_TYPES = (set, frozenset, list, tuple, str, dict)
_REQUEST_NEEDS = (
    "request_id, block_hashes, num_tokens and, with offload_prompt_only, num_prompt_tokens (a "
    "kvoff.scheduler.Request or vLLM's)"
)
_ID_COLLECTIONS = frozenset(_ID_COLLECTION_TYPES)


def _group_kind(spec: KVCacheSpec) -> tuple[str, int]:
    if isinstance(spec, FullAttentionSpec | MLAAttentionSpec):
        return ("full_attention", 0)
    if isinstance(spec, SlidingWindowSpec):
        return ("sliding_window", spec.sliding_window)
    if isinstance(spec, MambaSpec):
        return ("mamba", 0)
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {_group_kind(s) for s in spec.kv_cache_specs.values()}
        names = {k for k, _ in kinds}
        if len(names) != 1:
            raise ValueError(
                f"a UniformTypeKVCacheSpecs group mixes attention types {sorted(names)}; "
                "split its layers into one group per type"
            )
        # Several windows: keep the widest, so every layer's window is cached.
        return max(kinds, key=lambda k: k[1])
    raise ValueError(f"unsupported KV cache spec {type(spec).__name__}")


def group_kinds(spec: CPUOffloadingSpec) -> tuple[tuple[str, int], ...]:
    """Per KV cache group of ``spec``: ``(kind, sliding_window)`` with kind one of
    ``"full_attention"`` (also MLA), ``"sliding_window"`` (window in tokens) or ``"mamba"``.

    Raises:
        ValueError: a :class:`UniformTypeKVCacheSpecs` group mixing attention types.
    """
    return tuple(_group_kind(g.kv_cache_spec) for g in spec.kv_cache_config.kv_cache_groups)


class OffloadingScheduler:
    """The per-step offloading scheduler of one engine (one instance, on the scheduler side).

    Args:
        spec: the CPU plan (:class:`kvoff.CPUOffloadingSpec`): CPU slots, block size factor,
            GPU block size, hash block size, world size, eviction policy, KV cache groups and
            ``kv_cache_config.num_blocks`` GPU blocks.
        enable_events: record ``BlockStored`` / ``BlockRemoved`` events for :meth:`take_events`.
        store_batch_blocks: store batching, in offloaded blocks (1 to 2**20; default 1). A
            running request's full offloaded blocks are stored once at least this many wait
            (a prefill chunk usually completes that many at once, decode one block every
            ``offloaded_block_size`` tokens), so a decoding request makes one store job per
            ``store_batch_blocks`` blocks instead of one per block; the blocks still waiting
            when it finishes are stored by the next step (:meth:`request_finished`). While a
            request runs the engine holds its blocks, so no prefix hit is lost by the wait; a
            preemption drops the wait (the blocks are stored again after recompute). Models
            with a sliding-window or Mamba group always use 1 (their blocks leave the window,
            and are freed, while waiting). 1 stores every block in the step it fills.
        offload_prompt_only: store only the offloaded blocks that lie wholly inside each
            request's prompt (default off here; :class:`kvoff.OffloadingConfig` turns it on,
            as vLLM 0.32 does). The request objects then also need ``num_prompt_tokens``
            (:class:`RequestLike`; ``None``: not limited); a missing attribute raises
            ``TypeError``, a negative count ``ValueError``, and nothing changes. Once a
            request's prompt blocks are all full, those waiting for a store batch are stored
            in that step.
        store_threshold: store admission, in offers (0 to 2**20; default 0; vLLM's
            ``store_threshold``): with n >= 2 an offloaded block is stored only once requests
            offered it n times (each request that computed it and reached it in a step is one
            offer; :class:`kvoff.CPUOffloadingManager`). A skipped block is not copied and the
            request moves past it as past a held block; ``stats()["stores_skipped"]`` counts
            them. 0 or 1: every block is stored.
        max_tracker_size: keys whose offers are counted at most (1 to 2**31 - 1; default
            64000, about 104 bytes each; used only with ``store_threshold`` >= 2).
        node_pool: a connection to a node pool (:class:`kvoff.node_pool.NodePoolClient`,
            ``kvoff pool serve``) whose slots are this engine's CPU pool, shared with the
            other engines of the machine; ``spec.num_blocks`` must be its slot count. The
            pool's own eviction policy, events and admission apply (``eviction_policy``,
            ``store_threshold`` and ``max_tracker_size`` are not used), and
            :meth:`stats` leaves out the pool's counts (``kvoff pool status`` gives them).
            None (default): a pool of ``spec.num_blocks`` slots of this scheduler's own.

    Raises:
        ValueError: the spec has no CPU blocks (raise ``cpu_bytes_to_use``) or more than
            2**31 - 1, a group type the scheduler cannot offload, or an offloaded block of more
            than 2**31 tokens (``gpu_block_size × block_size_factor``); ``store_batch_blocks``,
            ``store_threshold`` or ``max_tracker_size`` out of range (naming it).
        TypeError: ``enable_events`` or ``offload_prompt_only`` not a bool (naming it; None or
            0 would silently pick a mode).
        MemoryError: the host cannot hold the CPU pool's index and eviction policy (about 110
            bytes per CPU block); the message names ``num_blocks``, the bytes needed and the
            fix (a smaller ``cpu_bytes_to_use``). Nothing stays allocated.

    Calling back from engine code: the step methods (``build_connector_meta*``) read new block
    hashes from the engine's request objects (``block_hashes``) while the step is under way.
    Code run there (a property) must not call this scheduler back: every method that changes it
    (the hooks, :meth:`update_connector_output`, :meth:`request_finished`,
    :meth:`take_events`, :meth:`reset_cache`) then raises ``RuntimeError`` naming itself and
    changes nothing, and if that error is not caught, the step raises it too, changing nothing
    but the hashes already read. Other schedulers may be called from there. A scheduler serves
    one thread: another thread's call that lands while a step reads hashes (the GIL may pass
    to it there) is refused the same way.
    """

    def __init__(
        self,
        spec: CPUOffloadingSpec,
        *,
        enable_events: bool = False,
        store_batch_blocks: int = 1,
        offload_prompt_only: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64000,
        node_pool: NodePoolClient | None = None,
    ) -> None:
        check_scheduler_args(
            spec.num_blocks,
            spec.kv_cache_config.num_blocks,
            enable_events=enable_events,
            store_batch_blocks=store_batch_blocks,
            offload_prompt_only=offload_prompt_only,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            node_pool=node_pool,
        )
        self.spec = spec
        self.node_pool = node_pool
        self._pool_manager = None
        if node_pool is not None:
            from kvoff.node_pool.block_manager import NodePoolBlockManager

            self._pool_manager = NodePoolBlockManager(node_pool)
            if enable_events:
                node_pool.enable_events()
        self._core = _OffloadingScheduler(
            num_cpu_blocks=spec.num_blocks,
            eviction_policy=spec.eviction_policy,
            enable_events=enable_events,
            gpu_block_size=spec.gpu_block_size[0],
            block_size_factor=spec.block_size_factor,
            hash_block_size=spec.hash_block_size or 0,
            world_size=spec.world_size,
            num_gpu_blocks=spec.kv_cache_config.num_blocks,
            groups=list(group_kinds(spec)),
            store_batch_blocks=store_batch_blocks,
            offload_prompt_only=offload_prompt_only,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            node_pool=self._pool_manager,
        )
        # The batch in effect (1 with a sliding-window or Mamba group)
        self._store_batch = self._core.store_batch_blocks
        # The per-step hooks as plain CPython methods of the same core: with the caches as the
        # engine's own work leaves them, pybind11's dispatcher costs ~10 us more per call (see
        # README, "Scheduler cost")
        self._hooks = self._core.fast_hooks()
        self._requests: dict[str, RequestLike] = {}  # the core reads their new hashes
        # Requests whose last lookup found nothing to load: the core has already settled them
        # as update_state_after_alloc(.., 0) would, so that call is skipped for them (most new
        # requests; the call costs about 1.6 us at 256 running).
        self._settled: dict[str, RequestLike] = {}
        self._tiers: TieredPool | None = None
        self._partial_groups = any(k != "full_attention" for k, _ in group_kinds(spec))

    @classmethod
    def from_config(
        cls, kv_cache_config: KVCacheConfig, config: OffloadingConfig
    ) -> OffloadingScheduler:
        """The scheduler for an engine plan and the library's configuration object: the CPU
        plan from :meth:`kvoff.CPUOffloadingSpec.from_config`, events from
        ``config.enable_events``, store batching from ``config.store_batch_blocks``, store
        admission from ``config.store_threshold`` and ``config.max_tracker_size``.

        Raises:
            ValueError: everything :meth:`kvoff.CPUOffloadingSpec.from_config` and the
                constructor raise.
        """
        from kvoff.offloading_spec import CPUOffloadingSpec

        spec = CPUOffloadingSpec.from_config(kv_cache_config, config)
        return cls(
            spec,
            enable_events=config.enable_events,
            store_batch_blocks=config.store_batch_blocks,
            offload_prompt_only=config.offload_prompt_only,
            store_threshold=config.store_threshold,
            max_tracker_size=config.max_tracker_size,
        )

    # ------------------------------------------------------------------ requests
    def get_num_new_matched_tokens(
        self, request: RequestLike, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens after ``num_computed_tokens`` can be loaded from the CPU pool.

        Args:
            request: the request (its ``block_hashes`` and ``num_tokens`` are read).
            num_computed_tokens: tokens the engine's own GPU prefix cache already has (a
                multiple of the GPU block size).

        Returns:
            ``(None, False)``: retry later (a block of the hit is still being stored, or being
            loaded for another request, or the secondary tiers of :meth:`attach_tiers` are
            being asked for a block the CPU pool misses); ``(0, False)``: nothing to load;
            ``(n, True)``: ``n`` more tokens can be loaded asynchronously (the request waits
            for its load).

        Raises:
            ValueError: ``num_computed_tokens`` not a multiple of the block size or above
                ``num_tokens``; ``num_tokens`` smaller than the hashes cover; an empty hash.
                Nothing is changed (a request seen for the first time is not registered).
            TypeError: a hash that is neither bytes nor int, ``num_computed_tokens`` that is
                not an int, a ``request`` without ``request_id``, ``block_hashes`` or
                ``num_tokens``.
        """
        if self._tiers is not None:  # finished promotions first: the L1 answer must hold
            self._tiers.poll()
        # one core call: the request's new hashes (read in place), then the lookup
        num_computed_tokens = token_count("num_computed_tokens", num_computed_tokens)
        try:
            n, load = self._hooks.sync_and_match(request, num_computed_tokens, self._requests)
        except AttributeError as e:
            raise not_a("request", _REQUEST_NEEDS, request, e) from None
        if self._tiers is not None and n is not None:
            n, load = self._ask_tiers(request, num_computed_tokens + n, n, load)
        if n == 0:  # the core answered 0 too (the tiers only add to a hit or ask to retry)
            self._settled[request.request_id] = request
        else:
            self._settled.pop(request.request_id, None)
        return n, load

    def _ask_tiers(
        self, request: RequestLike, hit_end: int, n: int, load: bool
    ) -> tuple[int | None, bool]:
        """After an L1 answer ending at token ``hit_end``: when L1 missed an offloaded block
        the request could still hit, the tiers are asked for it (and the blocks after it) in
        the background and the answer is "retry later"; a retry finds the promoted blocks in
        L1. Each group's keys from the first missed block on are one probe (a group's blocks
        are promoted as a run from there); the groups are answered together
        (:meth:`TieredPool.lookup_groups`)."""
        assert self._tiers is not None
        obs = self.spec.offloaded_block_size
        limit = request.num_tokens - (1 if self._partial_groups else 0)
        hpb = self._hashes_per_block
        n_max = min(len(request.block_hashes) // hpb, limit // obs)
        first = hit_end // obs
        if first >= n_max:
            return n, load
        groups = range(len(self.spec.kv_cache_config.kv_cache_groups))
        key_lists = [[self.offload_key(request, j, g) for j in range(first, n_max)] for g in groups]
        if self._tiers.lookup_groups(key_lists, poll=False) is None:
            return None, False
        return n, load

    # ------------------------------------------------------------------ secondary tiers
    def attach_tiers(
        self,
        tiers: Sequence[SecondaryTier],
        cpu_slot: Callable[[int], np.ndarray],
        *,
        write_queue_blocks: int | None = None,
    ) -> TieredPool:
        """Puts secondary tiers (disk, a shared store) below this scheduler's CPU pool. The
        tier I/O runs in this process and reads and writes the CPU pool's slots: the worker's
        pool when it shares this process, else the workers' pools mapped from shared memory
        (:class:`kvoff.pinned.SharedHostPool`).

        From then on: every store that completes is written through to every tier in the
        background (bounded queue; a full queue drops and counts, never blocks);
        :meth:`get_num_new_matched_tokens` asks the tiers for a block L1 misses and answers
        ``(None, False)`` ("retry later") while they are asked and read, so a retry finds
        the promoted blocks in L1 and loads them as usual. Finished tier work is applied at
        each :meth:`build_connector_meta` (and at lookups). See
        :mod:`kvoff.tiers.coordinator`.

        Args:
            tiers: fastest first; each one's ``fmt.payload_bytes`` must be the CPU slot size
                (``CPUOffloadingSpec.kv_bytes_per_block`` × ``block_size_factor`` bytes), summed
                over the ranks when ``world_size`` > 1.
            cpu_slot: CPU block id -> that slot's bytes, a writable ``(slot_bytes,)`` uint8
                array, e.g. ``worker.cpu_pool.numpy().__getitem__``; with ``world_size`` > 1 a
                tuple of one such array per rank (rank order), for tiers that take such tuples
                (:class:`kvoff.tiers.ranked.RankedTier`).
            write_queue_blocks: blocks pinned in L1 for write-through at most (default: a
                quarter of the pool, at most 1,024).

        Returns:
            The :class:`~kvoff.tiers.coordinator.TieredPool` (its ``stats()`` gives per-tier
            hits, bytes, promotions, dropped writes and rejected blocks).

        Raises:
            ValueError: tiers attached already, or a node pool (its tiers are the pool's);
                ``world_size`` > 1 and ``cpu_slot`` does not
                give one array per rank (each rank has its own CPU pool: tiers on rank 0's
                alone would store part of each block); a tier whose payload size is not the
                slot size; everything :class:`TieredPool` raises.
        """
        from kvoff.tiers.coordinator import TieredPool, default_write_queue_blocks

        if self._tiers is not None:
            raise ValueError("tiers are attached already; close() them first")
        if self.node_pool is not None:
            raise ValueError(
                "this scheduler's CPU pool is a node pool: its tiers are the pool's (kvoff pool "
                "serve --disk-path / --remote-url), not an engine's"
            )
        first = cpu_slot(0)
        world = self.spec.world_size
        if world != 1 and (not isinstance(first, (tuple, list)) or len(first) != world):
            raise ValueError(
                f"attach_tiers with world_size {world} needs cpu_slot to give one slot array per "
                f"rank (a tuple of {world}), got {type(first).__name__}: each rank keeps its own "
                "CPU pool, and a block is all ranks' parts"
            )
        # TieredPool checks the tiers' block size against a slot (its own _check_slot_size)
        if write_queue_blocks is None:
            write_queue_blocks = default_write_queue_blocks(self.spec.num_blocks)
        self._tiers = TieredPool(
            self._core.manager, cpu_slot, tiers, write_queue_blocks=write_queue_blocks
        )
        return self._tiers

    @property
    def tiers(self) -> TieredPool | None:
        """The secondary tiers from :meth:`attach_tiers`, or None."""
        return self._tiers

    def close(self) -> None:
        """Waits for the tiers' work in flight and closes them (no-op without tiers).
        Idempotent; the scheduler stays usable, without tiers."""
        if self._tiers is not None:
            self._tiers.close()
            self._tiers = None

    def update_state_after_alloc(
        self,
        request: RequestLike,
        block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
    ) -> None:
        """Builds the request's load job once the engine allocated its GPU blocks.

        Args:
            request: the request.
            block_ids: per KV cache group, the request's whole block table (GPU block ids in
                logical order; 0 for null blocks, which are never loaded). May be empty (no
                group at all) when ``num_external_tokens`` is 0: nothing is loaded.
            num_external_tokens: 0 (load nothing), or exactly the ``n`` returned by the last
                :meth:`get_num_new_matched_tokens` for this request.

        A call with 0 tokens and an empty table right after :meth:`get_num_new_matched_tokens`
        answered 0 for the same request object returns at once: that answer already left the
        request as this call would (the C++ core's contract), and most new requests load
        nothing.

        Raises:
            ValueError: a token count that does not match; a table with the wrong number of
                groups, too short for the load, or with ids outside ``[0, num_gpu_blocks)``.
                Nothing is changed.
            TypeError: ``num_external_tokens`` that is not an int, a ``request`` without
                ``request_id``, ``block_hashes`` or ``num_tokens``.
        """
        rid = getattr(request, "request_id", None)
        # the entry is taken whatever the call (a later call needs a new lookup to skip)
        settled = rid.__class__ is str and self._settled.pop(rid, None) is request
        if (
            settled
            and num_external_tokens.__class__ is int
            and num_external_tokens == 0
            and block_ids.__class__ in (tuple, list)
            and not block_ids
        ):
            return  # the lookup that answered 0 left the request as this call would
        num_external_tokens = token_count("num_external_tokens", num_external_tokens)
        try:
            self._hooks.sync_and_alloc(request, block_ids, num_external_tokens, self._requests)
        except AttributeError as e:
            raise not_a("request", _REQUEST_NEEDS, request, e) from None

    def build_connector_meta(self, step: SchedulerStep) -> ConnectorMetadata:
        """Ends a scheduling step: load jobs, store jobs and fences for the workers.

        Stores cover offloaded blocks that are full after the step, counting at most the
        tokens whose hashes are known (async scheduling); a store refused for lack of room is
        retried next step. Every scheduled request must have been passed to
        :meth:`get_num_new_matched_tokens` or :meth:`update_state_after_alloc` before.

        Raises:
            ValueError: an unknown or repeated request id, a wrong group count, out-of-range
                block ids or negative token counts (nothing is changed).
            TypeError: ``step`` is not a :class:`SchedulerStep` of :class:`ScheduledRequest`
                (a field missing), or a field of the wrong type (nothing is changed).
        """
        try:
            scheduled = step.scheduled
            columns = (
                [s.request_id for s in scheduled],
                [s.new_block_ids or None for s in scheduled],
                [s.num_computed_tokens for s in scheduled],
                [s.num_scheduled_tokens for s in scheduled],
                {s.request_id for s in scheduled if s.resumed_from_preemption},
                step.finished_request_ids,
                step.preempted_request_ids,
                step.rewritten_block_ids,
            )
        except AttributeError as e:
            raise not_a(
                "step", "the fields of a SchedulerStep of ScheduledRequests", step, e
            ) from None
        return self.build_connector_meta_columns(*columns)

    def build_connector_meta_columns(
        self,
        request_ids: Sequence[str],
        new_block_ids: Sequence[Sequence[Sequence[int]] | None],
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Mapping[str, int] | Sequence[int],
        resumed_request_ids: Collection[str] = (),
        finished_request_ids: Iterable[str] = (),
        preempted_request_ids: Iterable[str] = (),
        rewritten_block_ids: Sequence[int] = (),
    ) -> ConnectorMetadata:
        """:meth:`build_connector_meta` with the step in columns, as engines keep it (vLLM's
        ``CachedRequestData``): no per-request objects are made. The fast path for engine
        integrations; the same checks and results.

        Args:
            request_ids: the scheduled requests, one entry each.
            new_block_ids: per scheduled request, ``None`` (no new blocks) or per KV cache
                group the new GPU block ids (the whole table when first scheduled or resumed;
                see :attr:`ScheduledRequest.new_block_ids`).
            num_computed_tokens: per scheduled request, tokens computed before this step.
            num_scheduled_tokens: tokens computed in this step: a dict by request id (missing
                ids: 0) or a sequence aligned with ``request_ids``.
            resumed_request_ids: the scheduled requests resumed from preemption.
            finished_request_ids, preempted_request_ids, rewritten_block_ids: as in
                :class:`SchedulerStep`.

        Raises:
            ValueError: columns of different lengths, and everything
                :meth:`build_connector_meta` raises (nothing is changed; new block hashes of
                the scheduled requests may have been taken, as the next call would).
            TypeError: a request id that is not a str, a block id or count that is not an int.
        """
        loads, stores, flush = self.build_connector_meta_tuples(
            request_ids,
            new_block_ids,
            num_computed_tokens,
            num_scheduled_tokens,
            resumed_request_ids,
            finished_request_ids,
            preempted_request_ids,
            rewritten_block_ids,
        )
        job = self.job_from_tuple
        return ConnectorMetadata(tuple(map(job, loads)), tuple(map(job, stores)), tuple(flush))

    def build_connector_meta_tuples(
        self,
        request_ids: Sequence[str],
        new_block_ids: Sequence[Sequence[Sequence[int]] | None],
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Mapping[str, int] | Sequence[int],
        resumed_request_ids: Collection[str] = (),
        finished_request_ids: Iterable[str] = (),
        preempted_request_ids: Iterable[str] = (),
        rewritten_block_ids: Sequence[int] = (),
        *,
        with_keys: bool = True,
    ) -> tuple[list[tuple], list[tuple], list[int]]:
        """:meth:`build_connector_meta_columns` without making :class:`TransferJob` records:
        for integrations that ship the jobs to workers in other processes (the records are then
        made there, off the engine's scheduling path, with :meth:`job_from_tuple`).

        Returns:
            ``(load_jobs, store_jobs, jobs_to_flush)``; each job is a tuple ``(job_id,
            request_id, is_store, gpu_block_ids, group_sizes, block_indices, cpu_block_ids,
            keys)`` (lists of ints; keys are bytes). ``with_keys=False`` leaves the keys
            out (an empty list) for workers that only copy blocks (kvoff's vLLM connector):
            the scheduler keeps them.

        Raises:
            As :meth:`build_connector_meta_columns`.
        """
        columns = (request_ids, new_block_ids, num_computed_tokens, num_scheduled_tokens)
        return self._build_step(
            columns, resumed_request_ids, finished_request_ids, preempted_request_ids,
            rewritten_block_ids, with_keys=with_keys, packed=False,
        )  # fmt: skip

    def build_connector_meta_packed(
        self,
        request_ids: Sequence[str],
        new_block_ids: Sequence[Sequence[Sequence[int]] | None],
        num_computed_tokens: Sequence[int],
        num_scheduled_tokens: Mapping[str, int] | Sequence[int],
        resumed_request_ids: Collection[str] = (),
        finished_request_ids: Iterable[str] = (),
        preempted_request_ids: Iterable[str] = (),
        rewritten_block_ids: Sequence[int] = (),
        tail: tuple[Sequence[str], Sequence[Sequence[Sequence[int]] | None], Sequence[int]]
        | None = None,
    ) -> tuple[bytes, tuple[str, ...], list[int]]:
        """:meth:`build_connector_meta_columns` with the step's jobs packed into one ``bytes``
        object: the cheapest form to hand to workers in other processes (no per-job Python
        object on the engine's scheduling path). :meth:`jobs_from_packed` makes the
        :class:`TransferJob` records (without keys: the scheduler keeps them).

        ``tail``: more scheduled requests as three columns ``(request_ids, new_block_ids,
        num_computed_tokens)``, read after the first three as if appended to them (vLLM keeps
        its running and its new requests apart: no joined lists are made). The tail's
        requests are scheduled as new: their ``new_block_ids`` are their whole block tables,
        which replace the tables kept also for a request seen before (vLLM schedules a resumed
        streaming-input session as new, under its old id; its blocks kept in place are not
        new allocations). A ``num_scheduled_tokens`` sequence then covers both, in that order;
        indices in error messages count across both.

        Returns:
            ``(packed, request_ids, jobs_to_flush)``. ``packed`` holds native int64s:
            ``[num_jobs, num_load_jobs, num_groups]``, then per job (loads first) ``[job_id,
            is_store, n_gpu, n_cpu, group_sizes × num_groups, block_indices × num_groups,
            gpu_block_ids × n_gpu, cpu_block_ids × n_cpu]``; ``request_ids[i]`` is job i's.

        Raises:
            As :meth:`build_connector_meta_columns`; TypeError: ``tail`` is not None or a
            tuple of three sequences; ValueError: its columns differ in length.
        """
        # _build_step's body, inline: this is the engine's per-step call, and a Python frame
        # costs a few microseconds with the caches as the engine's own work leaves them (a
        # lockstep A/B at 256 running: calling _build_step instead is 1.04x the connector's time
        # per step; bench/results/scheduler/ab-inline-build-and-deferred-finish-2026-11-27.json)
        if finished_request_ids.__class__ not in _ID_COLLECTIONS and not isinstance(
            finished_request_ids, _ID_COLLECTION_TYPES
        ):
            finished_request_ids = tuple(finished_request_ids)  # read twice: not a one-shot
        if self._tiers is not None:
            self._tiers.poll()  # promotions read by now become L1 blocks
        out = self._hooks.build_connector_meta(
            request_ids, new_block_ids, num_computed_tokens, num_scheduled_tokens,
            resumed_request_ids, finished_request_ids, preempted_request_ids,
            rewritten_block_ids, self._requests, False, True, tail,
        )  # fmt: skip
        if finished_request_ids:
            requests, settled = self._requests, self._settled
            for rid in finished_request_ids:
                requests.pop(rid, None)
                settled.pop(rid, None)
        return out

    def _build_step(
        self,
        columns: tuple[Sequence, Sequence, Sequence, Mapping[str, int] | Sequence[int]],
        resumed_request_ids: Collection[str],
        finished_request_ids: Iterable[str],
        preempted_request_ids: Iterable[str],
        rewritten_block_ids: Sequence[int],
        *,
        with_keys: bool,
        packed: bool,
        tail: tuple | None = None,
    ) -> tuple:
        """The one core call behind the build_connector_meta_* methods (``packed``: jobs in one
        bytes object, else tuples), then the finished requests' objects are let go."""
        if finished_request_ids.__class__ not in _ID_COLLECTIONS and not isinstance(
            finished_request_ids, _ID_COLLECTION_TYPES
        ):
            finished_request_ids = tuple(finished_request_ids)  # read twice: not a one-shot
        if self._tiers is not None:
            self._tiers.poll()  # promotions read by now become L1 blocks
        out = self._hooks.build_connector_meta(
            *columns, resumed_request_ids, finished_request_ids, preempted_request_ids,
            rewritten_block_ids, self._requests, with_keys, packed, tail,
        )  # fmt: skip
        for rid in finished_request_ids:
            self._requests.pop(rid, None)
            self._settled.pop(rid, None)
        return out

    @staticmethod
    def jobs_from_packed(
        packed: bytes, request_ids: Sequence[str]
    ) -> tuple[tuple[TransferJob, ...], tuple[TransferJob, ...]]:
        """``(load_jobs, store_jobs)`` from :meth:`build_connector_meta_packed`'s ``packed``
        and ``request_ids`` (records without keys, made without re-checking: the core's jobs
        are valid by construction).

        Raises:
            ValueError: ``packed`` is not a whole number of int64s, or its counts do not match
                its length or ``request_ids``.
        """
        if len(packed) % 8 or len(packed) < 24:
            raise ValueError(f"packed jobs must be >= 3 int64s, got {len(packed)} bytes")
        w = memoryview(packed).cast("q").tolist()
        num_jobs, num_loads, groups = w[0], w[1], w[2]
        if num_jobs != len(request_ids) or not 0 <= num_loads <= num_jobs:
            raise ValueError(
                f"packed jobs count {num_jobs} jobs ({num_loads} loads) but {len(request_ids)} "
                "request ids were given; pass the pair build_connector_meta_packed returned"
            )
        jobs: list[TransferJob] = []
        at = 3
        for k in range(num_jobs):
            job_id, is_store, n_gpu, n_cpu = w[at : at + 4]
            at += 4
            sizes, indices = tuple(w[at : at + groups]), tuple(w[at + groups : at + 2 * groups])
            at += 2 * groups
            gpu_ids = tuple(w[at : at + n_gpu])
            cpu_ids = tuple(w[at + n_gpu : at + n_gpu + n_cpu])
            at += n_gpu + n_cpu
            jobs.append(
                _trusted(
                    TransferJob,
                    job_id=job_id,
                    request_id=request_ids[k],
                    direction="store" if is_store else "load",
                    gpu=_trusted(
                        GPUBlockSpec, block_ids=gpu_ids, group_sizes=sizes, block_indices=indices
                    ),
                    cpu=_trusted(CPUBlockSpec, block_ids=cpu_ids),
                    keys=(),
                )
            )
        if at != len(w):
            raise ValueError(f"packed jobs: {len(w) - at} int64s left over after {num_jobs} jobs")
        return tuple(jobs[:num_loads]), tuple(jobs[num_loads:])

    @staticmethod
    def job_from_tuple(t: tuple) -> TransferJob:
        """A :class:`TransferJob` from a job tuple of :meth:`build_connector_meta_tuples`. The
        core's jobs are valid by construction (invariant 1 holds, ids are in range): the
        records are made without re-checking them.

        Raises:
            ValueError: ``t`` does not have the 8 fields of a job tuple.
        """
        job_id, rid, is_store, gpu_ids, sizes, indices, cpu_ids, keys = t
        return _trusted(
            TransferJob,
            job_id=job_id,
            request_id=rid,
            direction="store" if is_store else "load",
            gpu=_trusted(
                GPUBlockSpec,
                block_ids=tuple(gpu_ids),
                group_sizes=tuple(sizes),
                block_indices=tuple(indices),
            ),
            cpu=_trusted(CPUBlockSpec, block_ids=tuple(cpu_ids)),
            keys=tuple(keys),
        )

    def update_connector_output(
        self, reports: Iterable[JobReport | tuple[int, bool] | Any]
    ) -> ConnectorOutput:
        """Counts job reports from the ranks and completes jobs reported by all of them.

        Args:
            reports: one entry per rank per job: :class:`JobReport`, a ``(job_id, success)``
                tuple, or any object with ``job_id`` and ``success`` (``kvoff.TransferResult``
                from ``OffloadingWorker.get_finished()`` and ``wait()``). Reports of one job
                may arrive over several calls.

        Returns:
            :class:`ConnectorOutput`. A completed store becomes a lookup hit only when every
            rank succeeded; a failed one frees its CPU blocks.

        Raises:
            ValueError: a job that is not in flight, or more reports than ``world_size``
                (nothing is changed).
            TypeError: a report that is not one of the above, a job id that is not an int or
                a success that is not a bool (nothing is changed).
        """
        loaded, failed, stored, done, bad = self._core.update_connector_output(
            [job_report(r) for r in reports]
        )
        return ConnectorOutput(tuple(loaded), tuple(failed), tuple(stored), tuple(done), tuple(bad))

    def update_connector_output_counts(self, counts: Mapping[int, Sequence[int]]) -> None:
        """:meth:`update_connector_output` with the reports already summed per job, as
        integrations aggregate them across ranks: ``{job_id: (ranks that succeeded, ranks that
        failed)}``. The fast path for engines that learn completions elsewhere (vLLM learns
        finished loads from the workers): nothing is returned.

        Raises:
            TypeError: ``counts`` is not a dict, or a count is not an int.
            ValueError: a negative job id or count, a pair that is not two counts, and
                everything :meth:`update_connector_output` raises (nothing is changed).
        """
        if counts:
            self._hooks.update_connector_output_counts(counts)

    def request_finished(self, request: RequestLike | str) -> bool:
        """The request finished or was aborted (queued or running).

        A load prepared but not yet handed to the workers is cancelled; in-flight jobs run to
        completion.

        With store batching (``store_batch_blocks`` > 1), its full blocks not stored yet are
        stored by the next :meth:`build_connector_meta`: up to the tokens of its last
        scheduled step, as far as its block hashes go (given a request object, its new hashes
        are read first).

        Returns:
            True when jobs of the request are still in flight or such a store is due: keep its
            GPU blocks until it appears in ``ConnectorOutput.finished_storing`` (freeing them
            earlier is safe: in-flight jobs are flushed when their blocks are reused, and a
            due block reused before the next step is not stored). Unknown ids return False.

        Raises:
            TypeError: ``request`` is neither a str id nor an object with ``request_id``.
            RuntimeError: called from inside this scheduler's own step (see the class notes);
                nothing is changed.
        """
        return self._finish(request) != 0

    def request_finished_state(self, request: RequestLike | str) -> FinishState:
        """:meth:`request_finished`, telling apart the two reasons to keep the request's GPU
        blocks: jobs of it in flight (which the fences protect if the engine frees the blocks
        anyway) and a store due at its finish (store batching; its blocks must stay until
        the next :meth:`build_connector_meta` has emitted that store, or it stores nothing
        the engine reused). Integrations that free blocks at once, as vLLM's connector does,
        keep them only in the second case.

        Raises:
            TypeError, RuntimeError: as :meth:`request_finished`.
        """
        # made once per finish code (an engine asks for every finished request)
        return self._FINISH_STATES[self._finish(request)]

    #: :meth:`request_finished_state`'s answer per finish code of the core (bit 0: jobs in
    #: flight, bit 1: a store is due).
    _FINISH_STATES: tuple[FinishState, ...] = tuple(
        FinishState(jobs_in_flight=bool(code & 1), store_due=bool(code & 2)) for code in range(4)
    )

    @property
    def store_batch_blocks(self) -> int:
        """The store batch in effect, in offloaded blocks: the constructor's
        ``store_batch_blocks``, or 1 for a model with a sliding-window or Mamba group."""
        return self._store_batch

    def _finish(self, request: RequestLike | str) -> int:
        """The core's finish_request: bit 0 jobs in flight, bit 1 a store is due."""
        if isinstance(request, str):
            rid = request
        else:
            rid = getattr(request, "request_id", None)
            if not isinstance(rid, str):
                raise TypeError(
                    f"request_finished takes a request or its str id, got {request!r} "
                    f"({type(request).__name__})"
                )
        # With store batching the core reads the request's last block hashes from it first
        req = None
        if self._store_batch > 1:
            req = self._requests.get(rid) if isinstance(request, str) else request
        code = self._hooks.request_finished(rid, req)  # first: a refused call changes nothing
        self._requests.pop(rid, None)
        self._settled.pop(rid, None)
        return code

    def take_events(self) -> list[OffloadingEvent]:
        """``BlockStored`` / ``BlockRemoved`` events (medium ``"CPU"``) since the last call;
        always empty unless ``enable_events``."""
        return self._hooks.take_events()

    def reset_cache(self) -> int:
        """Empties the CPU pool of every block no job uses (ready and not pinned by a load),
        e.g. for an engine's prefix-cache reset after a weight update; returns how many
        blocks were dropped (one ``BlockRemoved`` event lists them). Jobs in flight become
        stale: they complete as usual for the engine, but a stale store frees its slots instead
        of making its blocks hits (their KV was computed before the reset), and a stale load's
        blocks are discarded once it has read them. A block pinned by a load in flight stays a
        hit until that load completes. Blocks computed before the reset and not stored yet
        (waiting for a store batch, refused for lack of room, or due at a finish) are never
        stored: a request stores from the tokens of its last step on, and a store due at a
        finish is dropped (the request is listed in the next ``finished_storing``).

        With secondary tiers (:meth:`attach_tiers`) they are reset first
        (:meth:`TieredPool.reset <kvoff.tiers.coordinator.TieredPool.reset>`): no tier serves a
        block made before the reset, promotions in flight are dropped, and write-through of
        blocks stored before it stops. This waits for tier calls already running (each ends
        within its tier's timeout). Blocks being written through leave L1's index at once.
        The returned count is L1's."""
        if self._tiers is not None:
            self._tiers.reset()
        return int(self._core.reset_cache())

    # ------------------------------------------------------------------ inspection
    def stats(self) -> dict[str, int]:
        """Counters: lookups, lookup_retries, hit_tokens, load_jobs, store_jobs,
        blocks_loaded, blocks_stored (GPU blocks), store_refusals, blocks_evicted,
        blocks_discarded and stores_skipped (offloaded blocks; stores_skipped: not stored by
        the ``store_threshold`` filter), stale_blocks_skipped, jobs_flushed, failed_jobs, and
        the pool and request gauges (blocks: num_cpu_blocks, num_free_blocks,
        num_stored_blocks, num_pending_blocks, num_retired_blocks, num_evictable_blocks)."""
        return self._core.stats()

    def pool_usage(self) -> tuple[int, int, int]:
        """``(num_blocks, pinned, pending)``: the CPU pool's blocks, those transfers pin now
        (stores in flight, loads, write-through to the tiers) and the pending stores among
        them, in blocks. A cheap read for usage gauges (vLLM's
        ``vllm:kv_offload_cpu_cache_usage_perc`` is ``pinned / num_blocks``). On a node
        pool: the whole pool's, refreshed at most once a second; slots reserved for the
        engines' stores and not taken yet are not pinned (no transfer uses them)."""
        pool = self.node_pool
        if pool is not None:
            return pool.num_slots, pool.num_pinned_blocks, pool.num_pending_blocks
        return self._core.pool_usage()

    def counters(self) -> tuple[int, ...]:
        """The monotonic counters of :meth:`stats` as one tuple, in the order of
        :data:`COUNTER_NAMES` (cheap enough to read every engine step)."""
        return self._core.counters()

    def counters_delta(
        self, seen: tuple[int, ...] | None
    ) -> tuple[dict[str, int] | None, tuple[int, ...] | None]:
        """What moved since ``seen`` (an earlier :meth:`counters` tuple; ``None``: since the
        start), in one core call: ``({name: increase} for the counters that changed, or None
        when none did; the counters now, or ``seen`` unchanged when none moved)``.

        Raises:
            TypeError: ``seen`` is neither None nor a tuple of len(COUNTER_NAMES) ints.
            ValueError: a value of ``seen`` that is negative or above the counter now (not
                from this scheduler).
        """
        return self._hooks.counters_delta(seen)

    def offload_key(self, request: RequestLike, block: int, group: int = 0) -> bytes:
        """The offload key of offloaded block ``block`` of ``group`` for ``request``.

        Args:
            request: the engine's request (its ``block_hashes``).
            block: offloaded block index, >= 0.
            group: KV cache group index, in ``range(len(spec.groups))``.

        Raises:
            IndexError: the request has no hash for that block yet.
            ValueError: ``block`` is negative, or ``group`` is not a group of the spec.
            TypeError: ``request`` has no ``block_hashes``.
        """
        if not isinstance(block, int) or block < 0:
            raise ValueError(f"block={block!r} must be an offloaded block index >= 0")
        groups = len(self.spec.kv_cache_config.kv_cache_groups)
        if not isinstance(group, int) or not 0 <= group < groups:
            raise ValueError(f"group={group!r} is not a KV cache group; the spec has {groups}")
        try:
            h = request.block_hashes[(block + 1) * self._hashes_per_block - 1]
        except AttributeError as e:
            raise not_a("request", _REQUEST_NEEDS, request, e) from None
        hb = h if isinstance(h, bytes) else (int(h) % 2**64).to_bytes(8, "little")
        return hb + bytes([group])

    @property
    def _hashes_per_block(self) -> int:
        hash_bs = self.spec.hash_block_size or self.spec.gpu_block_size[0]
        return self.spec.offloaded_block_size // hash_bs

    def block_state(self, key: bytes | int) -> str:
        """``"missing"``, ``"pending"`` or ``"ready"`` for an offload key.

        On a node pool: the pool's answer (one round trip; "missing" while the pool is gone).

        Raises:
            TypeError, ValueError: ``key`` is not non-empty bytes or a 64-bit int.
        """
        if self._pool_manager is not None:
            return self._pool_manager.block_state(key_bytes(key))
        return self._core.block_state(key)

    def cpu_block_id(self, key: bytes | int) -> int | None:
        """The CPU block id holding ``key``, or None. On a node pool: the slot of a key this
        engine is storing or loading now, else None (the pool knows the others).

        Raises:
            TypeError, ValueError: ``key`` is not non-empty bytes or a 64-bit int.
        """
        if self._pool_manager is not None:
            return self._pool_manager.slot_in_flight(key_bytes(key))
        return self._core.block_id(key)

    def pin_count(self, key: bytes | int) -> int:
        """Loads in flight that pin ``key`` (on a node pool: this engine's).

        Raises:
            TypeError, ValueError: ``key`` is not non-empty bytes or a 64-bit int.
        """
        if self._pool_manager is not None:
            return self._pool_manager.load_pins(key_bytes(key))
        return self._core.pin_count(key)

    def next_store_block(self, request_id: str) -> int:
        """The next offloaded block index of the request to consider for storing (-1 if
        unknown)."""
        return self._core.next_store_block(request_id)
