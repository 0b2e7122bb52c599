"""KvoffConnector's scheduler role: :class:`KvoffConnectorScheduler`, kvoff's C++ scheduler
behind vLLM's scheduler-side connector hooks (lookups, the block table after allocation, one
step's jobs and fences, the ranks' job reports, finished requests, KV events, stats).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvoff.config import OffloadingConfig
from kvoff.integrations.vllm.metadata import KvoffConnectorMetadata, KvoffWorkerMetadata
from kvoff.integrations.vllm.metrics import TRANSFER_TOTALS, KvoffConnectorStats, tier_totals
from kvoff.integrations.vllm.tier_wiring import attach_tiers, tier_config
from kvoff.node_pool.client import NodePoolError
from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.scheduler import OffloadingScheduler

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvoff.node_pool import NodePoolClient

__all__ = ["KvoffConnectorScheduler"]

logger = logging.getLogger(__name__)


class KvoffConnectorScheduler:
    """:class:`KvoffConnector`'s scheduler role (one per engine): kvoff's C++
    :class:`kvoff.OffloadingScheduler` (:attr:`scheduler`) behind vLLM's scheduler-side hooks,
    with the secondary tiers under it when they are configured. It decides every load and
    store; the workers' job reports come back through :meth:`update_connector_output`.

    Args:
        vllm_config: the engine's configuration (KV events, ``kv_load_failure_policy``, and
            for the tiers where its workers run).
        config: kvoff's configuration (``kv_connector_extra_config``).
        spec: the engine's CPU offloading spec (:func:`.translate.cpu_spec`).
        engine_id: the engine's ``kv_transfer_config.engine_id`` (the tiers find the workers'
            CPU pools by it).
        node_pool: the connection to the node pool that is this engine's CPU pool
            (``node_pool`` in the config; closed by :meth:`shutdown`), or None.

    Attributes:
        scheduler: kvoff's scheduler (:class:`kvoff.OffloadingScheduler`).

    Raises:
        ValueError, RuntimeError, kvoff.pinned.SharedMemoryError: as :class:`KvoffConnector`
            (the scheduler, and the tiers on the workers' pools).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: OffloadingConfig,
        spec: CPUOffloadingSpec,
        engine_id: str,
        *,
        node_pool: NodePoolClient | None = None,
    ) -> None:
        self._config = config
        self._spec = spec
        self._groups = len(spec.kv_cache_config.kv_cache_groups)
        self._engine_id = engine_id
        self._tier_seen: dict[str, int] = {}  # tier counters at the last stats call
        self._tier_version: Any = None  # TieredPool.stats_version() when they were read
        # requests whose store is due at their finish, for the next step's metadata
        self._flushes_due: list[str] = []
        # requests whose load the node pool refused, for the next step's metadata
        self._refused_loads: list[str] = []
        # counters: the scheduler's (COUNTER_NAMES), then bytes and seconds moved by the
        # workers; the values at the last get_kv_connector_stats
        self._transfer_totals = [0, 0, 0.0, 0.0]  # TRANSFER_TOTALS
        self._totals_seen = [0, 0, 0.0, 0.0]  # their values at the last stats call
        self._totals_moved = False  # whether _transfer_totals moved since that call
        self._has_tiers = False  # whether tiers were attached (their counters are read then)
        self._counters_seen: tuple[int, ...] | None = None  # the scheduler's, likewise
        events = self._config.enable_events or bool(
            getattr(vllm_config, "kv_events_config", None)
            and vllm_config.kv_events_config.enable_kv_cache_events
        )
        self.scheduler = OffloadingScheduler(
            self._spec,
            enable_events=events,
            store_batch_blocks=self._config.store_batch_blocks,
            offload_prompt_only=self._config.offload_prompt_only,
            store_threshold=self._config.store_threshold,
            max_tracker_size=self._config.max_tracker_size,
            node_pool=node_pool,
        )
        if self._config.has_tiers:
            self._has_tiers = True
            attach_tiers(
                self._engine_id, self.scheduler, tier_config(vllm_config, self._config),
                vllm_config, self._spec,
            )  # fmt: skip
        if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning(
                "kvoff: kv_load_failure_policy=%r fails a request whose load fails; set "
                "kv_load_failure_policy='recompute' so that such tokens are recomputed",
                vllm_config.kv_transfer_config.kv_load_failure_policy,
            )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """As :meth:`KvoffConnector.get_num_new_matched_tokens`."""
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """As :meth:`KvoffConnector.update_state_after_alloc`."""
        table: Sequence[Sequence[int]] = ()  # nothing to load (the usual case): no table
        if num_external_tokens:
            table = blocks.get_block_ids(allow_none=True) or ((),) * self._groups
        try:
            self.scheduler.update_state_after_alloc(request, table, num_external_tokens)
        except NodePoolError as e:
            # The node pool went away between the look-up and this pin (nothing was changed):
            # the request loads nothing, and the workers report its load as failed, so that
            # vLLM recomputes it instead of waiting for a load that never comes.
            self.scheduler.update_state_after_alloc(request, (), 0)
            self._refused_loads.append(request.request_id)
            logger.warning("kvoff: the node pool refused the load of request %s (%s); it is "
                           "recomputed", request.request_id, e)  # fmt: skip

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvoffConnectorMetadata:
        """As :meth:`KvoffConnector.build_connector_meta`."""
        out = scheduler_output
        new = out.scheduled_new_reqs
        cached = out.scheduled_cached_reqs
        # Columns straight from vLLM's lists (no per-request objects): the running requests
        # first, in the order vLLM scheduled them (and filled num_scheduled_tokens), then the
        # new ones as the tail (not joined: a joined list would touch every running request's
        # objects once more); the core reads the dict's entries in that order without lookups.
        tail = None
        if new:
            tail = (
                [r.req_id for r in new],
                [r.block_ids for r in new],
                [r.num_computed_tokens for r in new],
            )
        copies = out.kv_cache_block_copies
        packed, request_ids, flush = self.scheduler.build_connector_meta_packed(
            cached.req_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            out.num_scheduled_tokens,
            # vLLM 0.34 dropped the field: it re-sends a resumed request in full among the new
            # ones (the tail, whose tables replace the kept ones)
            getattr(cached, "resumed_req_ids", ()),
            out.finished_req_ids,
            out.preempted_req_ids or (),
            [c.dst_block_id for c in copies] if copies else (),
            tail,
        )
        flushes: tuple[str, ...] = ()
        if self._flushes_due:  # stores due at requests' finish: emitted by this very step
            flushes, self._flushes_due = tuple(self._flushes_due), []
        refused: tuple[str, ...] = ()
        if self._refused_loads:
            refused, self._refused_loads = tuple(self._refused_loads), []
        return KvoffConnectorMetadata(packed, request_ids, tuple(flush), flushes, refused)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """As :meth:`KvoffConnector.update_connector_output`."""
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, KvoffWorkerMetadata):
            raise TypeError(f"expected KvoffWorkerMetadata, got {type(meta).__name__}")
        self.scheduler.update_connector_output_counts(meta.reports)
        if meta.load_bytes or meta.store_bytes or meta.load_seconds or meta.store_seconds:
            t = self._transfer_totals
            t[0] += meta.load_bytes
            t[1] += meta.store_bytes
            t[2] += meta.load_seconds
            t[3] += meta.store_seconds
            self._totals_moved = True

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """As :meth:`KvoffConnector.request_finished_all_groups`: ``(True, None)`` when a store
        of the request's last blocks is due (store batching; the next step's metadata names
        the request in ``finished_flushes``), else ``(False, None)``."""
        if self.scheduler.request_finished_state(request).store_due:
            self._flushes_due.append(request.request_id)
            return True, None
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """As :meth:`KvoffConnector.take_events`."""
        block_size = self._spec.offloaded_block_size
        for event in self.scheduler.take_events():
            by_group: dict[int, list[Any]] = {}
            for key in event.keys:
                by_group.setdefault(key[-1], []).append(maybe_convert_block_hash(key[:-1]))
            for group, hashes in sorted(by_group.items()):
                if event.kind == "BlockStored":
                    yield BlockStored(
                        block_hashes=hashes, parent_block_hash=None, token_ids=[],
                        block_size=block_size, lora_id=None, medium=event.medium,
                        lora_name=None, group_idx=group,
                    )  # fmt: skip
                else:
                    yield BlockRemoved(block_hashes=hashes, medium=event.medium, group_idx=group)

    def get_kv_connector_stats(self) -> KvoffConnectorStats | None:
        """As :meth:`KvoffConnector.get_kv_connector_stats`."""
        data, self._counters_seen = self.scheduler.counters_delta(self._counters_seen)
        if data is not None:
            # the pool's pins change only with jobs, which move the counters: gauges are read
            # only then (about 0.2 µs)
            n, pinned, pending = self.scheduler.pool_usage()
            data["cpu_cache_usage_perc"] = pinned / n
            data["cpu_cache_write_usage_perc"] = pending / n
            data["cpu_cache_read_usage_perc"] = (pinned - pending) / n
        if self._totals_moved:  # (the engine calls this every step: the usual case is cheap)
            self._totals_moved = False
            totals, seen = self._transfer_totals, self._totals_seen
            data = data if data is not None else {}
            for name, v, w in zip(TRANSFER_TOTALS, totals, seen, strict=True):
                if v != w:
                    data[name] = v - w
            self._totals_seen = list(totals)
        tiers = self.scheduler.tiers if self._has_tiers else None
        # the tiers' counters cost a few µs per tier and rank to read: only when they moved
        version = tiers.stats_version() if tiers is not None else None
        if tiers is not None and version != self._tier_version:
            self._tier_version = version
            now = tier_totals(tiers)
            seen = self._tier_seen
            moved = {k: v - seen.get(k, 0) for k, v in now.items() if v != seen.get(k, 0)}
            if moved:
                data = {**(data or {}), **moved}
                self._tier_seen = now
        return None if data is None else KvoffConnectorStats(data=data)

    def reset_cache(self) -> None:
        """As :meth:`KvoffConnector.reset_cache`."""
        dropped = self.scheduler.reset_cache()
        logger.info("kvoff: reset_cache dropped %d offloaded blocks", dropped)

    def shutdown(self) -> None:
        """Waits for the jobs in flight and closes kvoff's scheduler (its tiers too).
        Idempotent."""
        self.scheduler.close()
        if self.scheduler.node_pool is not None:
            self.scheduler.node_pool.close()
