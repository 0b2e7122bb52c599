"""``KvoffConnector``: vLLM's KV connector API (``KVConnectorBase_V1``) for kvoff, a thin
facade that hands each hook to the instance's role: :class:`KvoffConnectorScheduler`
(:mod:`.scheduler_role`) in the engine core, :class:`KvoffConnectorWorker` (:mod:`.worker_role`)
on each rank. vLLM loads it by ``kv_connector="KvoffConnector"`` and
``kv_connector_module_path="kvoff.integrations.vllm"``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoff.integrations.vllm.metadata import KvoffConnectorMetadata, KvoffWorkerMetadata
from kvoff.integrations.vllm.metrics import KvoffConnectorStats, KvoffPromMetrics
from kvoff.integrations.vllm.node_pool_wiring import connector_node_pool
from kvoff.integrations.vllm.scheduler_role import KvoffConnectorScheduler
from kvoff.integrations.vllm.tier_wiring import check_tier_topology, worker_rank
from kvoff.integrations.vllm.translate import cpu_spec, offloading_config
from kvoff.integrations.vllm.versions import warn_if_untested
from kvoff.integrations.vllm.worker_role import KvoffConnectorWorker
from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.scheduler import OffloadingScheduler, group_kinds
from kvoff.tiers.engine_tiers import close_tiers
from kvoff.worker import OffloadingWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvoffConnector"]


class KvoffConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for kvoff (see :mod:`kvoff.integrations.vllm`): a facade over its
    scheduler role (:class:`KvoffConnectorScheduler`) and its worker role
    (:class:`KvoffConnectorWorker`); each instance has one of them.

    Args:
        vllm_config: the engine's configuration; ``kv_transfer_config.kv_connector_extra_config``
            is the :class:`kvoff.OffloadingConfig` mapping.
        role: ``SCHEDULER`` (one per engine: kvoff's scheduler) or ``WORKER`` (one per rank:
            kvoff's worker).
        kv_cache_config: vLLM's KV cache plan (``num_blocks`` is authoritative).

    Raises:
        kvoff.config.ConfigError: an unknown key in ``kv_connector_extra_config``.
        ValueError: a bad value, no ``cpu_bytes_to_use``, a KV cache group kvoff cannot
            offload, a pool too small for one offloaded block, or a tier key (``disk_path``,
            ``remote_url``) on an engine whose workers are not all on the engine core's
            machine (Ray, an external launcher, several nodes).
        RuntimeError: tiers configured but no kvoff worker of this engine registered its KV
            caches in this process ("uni" executor; scheduler role).
        kvoff.pinned.SharedMemoryError: tiers with workers in processes of their own, and a
            rank's CPU pool cannot be put in or mapped from ``/dev/shm`` (too small: the
            message gives the sizes).
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: VllmKVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        warn_if_untested("KvoffConnector")
        self._config = offloading_config(
            self._kv_transfer_config.kv_connector_extra_config, spec_path=False
        )
        self._engine_id = str(self._kv_transfer_config.engine_id)
        node_pool = None
        if self._config.node_pool is not None:  # the plan is the node pool's slots
            rank = 0 if role == KVConnectorRole.SCHEDULER else worker_rank(vllm_config)
            self._spec, node_pool = connector_node_pool(
                vllm_config, kv_cache_config, self._config, f"{self._engine_id}-rank{rank}"
            )
        else:
            self._spec = cpu_spec(vllm_config, kv_cache_config, self._config)
        groups = len(kv_cache_config.kv_cache_groups)
        # A failed load is reported by its GPU blocks (vLLM recomputes from the first one) only
        # for one full-attention group: there every block before it holds valid KV. A window
        # or a Mamba state has null blocks before the loaded ones, so recomputing from there
        # would attend over them: the request is reported as failed instead (recomputed whole).
        block_level_load_errors = groups == 1 and group_kinds(self._spec)[0][0] == (
            "full_attention"
        )
        check_tier_topology(vllm_config, self._config)
        self._scheduler_role: KvoffConnectorScheduler | None = None
        self._worker_role: KvoffConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler_role = KvoffConnectorScheduler(
                vllm_config, self._config, self._spec, self._engine_id, node_pool=node_pool
            )
        else:
            region = None
            if node_pool is not None:  # the worker maps its rank's region of the pool
                region = node_pool.regions[worker_rank(vllm_config)]
                node_pool.close()
            self._worker_role = KvoffConnectorWorker(
                vllm_config, self._config, self._spec, self._engine_id,
                block_level_load_errors=block_level_load_errors, node_pool_region=region,
            )  # fmt: skip

    # ------------------------------------------------------------------ properties
    @property
    def _scheduler_side(self) -> KvoffConnectorScheduler:
        """The scheduler role.

        Raises:
            RuntimeError: in the worker role.
        """
        if self._scheduler_role is None:
            raise RuntimeError("KvoffConnector.scheduler exists in the scheduler role only")
        return self._scheduler_role

    @property
    def _worker_side(self) -> KvoffConnectorWorker:
        """The worker role.

        Raises:
            RuntimeError: in the scheduler role.
        """
        if self._worker_role is None:
            raise RuntimeError("KvoffConnector.worker exists in the worker role after "
                               "register_kv_caches")  # fmt: skip
        return self._worker_role

    @property
    def requires_kv_delivery(self) -> bool:
        """kvoff is a cache: a dropped store is a future miss, never lost data."""
        return False

    @property
    def scheduler(self) -> OffloadingScheduler:
        """kvoff's scheduler (scheduler role only).

        Raises:
            RuntimeError: in the worker role.
        """
        return self._scheduler_side.scheduler

    @property
    def worker(self) -> OffloadingWorker:
        """kvoff's worker (worker role, after register_kv_caches).

        Raises:
            RuntimeError: in the scheduler role or before registration.
        """
        return self._worker_side.worker

    @property
    def spec(self) -> CPUOffloadingSpec:
        """kvoff's CPU offloading spec of this engine (both roles): the pool's offloaded
        blocks, tokens per block and bytes per GPU block (:func:`.translate.cpu_spec`)."""
        return self._spec

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """``"BLHNC"`` (all layers of a block in one region: whole blocks move on copy engines)
        on GPUs, where vLLM adopts it when the attention backends support it and otherwise
        drops it with a warning; ``None`` on the CPU, whose attention backend reads ``LBHNC``
        only (kvoff then copies per layer)."""
        from vllm.platforms import current_platform

        return None if current_platform.is_cpu() else "BLHNC"

    # ------------------------------------------------------------------ scheduler role
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` kvoff can load (``None``: retry later).

        Raises:
            TypeError, ValueError: as :meth:`kvoff.OffloadingScheduler.get_num_new_matched_tokens`
                (a token count out of range, a request whose block hashes do not fit).
        """
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Builds the request's load job (``blocks``: the request's whole block table).

        Raises:
            ValueError: as :meth:`kvoff.OffloadingScheduler.update_state_after_alloc`
                (``num_external_tokens`` that is not what kvoff offered, block ids out of
                range).
        """
        self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvoffConnectorMetadata:
        """One step's loads, stores and fences (:class:`KvoffConnectorMetadata`)."""
        return self._scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Counts the ranks' job reports; jobs reported by every rank complete.

        Raises:
            TypeError: ``kv_connector_worker_meta`` that is not a :class:`KvoffWorkerMetadata`.
            ValueError: as :meth:`kvoff.OffloadingScheduler.update_connector_output_counts`
                (an unknown job, more reports than ranks); nothing is counted.
        """
        self._scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished. vLLM may free its blocks now (jobs in flight that still use
        them are flushed when the blocks are reused), unless a store of its last blocks is
        due (store batching): then ``(True, None)``, and the workers report it in
        ``finished_sending`` in the step that submits that store."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` for every model (vLLM calls this one for connectors that
        support the hybrid memory allocator, as this one does)."""
        return self._scheduler_side.request_finished(request)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvoff's ``BlockStored`` / ``BlockRemoved`` events as vLLM's, medium ``"CPU"``, one
        per KV cache group: ``block_hashes`` are the engine's hashes of the last hash block of
        each offloaded block."""
        return self._scheduler_side.take_events()

    def get_kv_connector_stats(self) -> KvoffConnectorStats | None:
        """The counters (:data:`_COUNTERS`) since the last call and the pool's usage gauges
        (:data:`_GAUGES`); ``None`` when no counter moved (the gauges did not either)."""
        role = self._scheduler_role
        return None if role is None else role.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KvoffConnectorStats | None:
        """Rebuilds stats from their dict (vLLM ships them between processes)."""
        return KvoffConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvoffPromMetrics:
        """kvoff's Prometheus counters (:class:`KvoffPromMetrics`)."""
        return KvoffPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool | None:
        """Empties kvoff's CPU pool of every block no job uses (``reset_prefix_cache(
        reset_connector=True)``); returns True."""
        if self._scheduler_role is not None:
            self._scheduler_role.reset_cache()
        return True

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers the layers of kvoff's groups and allocates the CPU pool (pinned on a GPU)
        and, for a layer-major GPU cache, the staging buffer."""
        self._worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Orders the forward pass after the jobs whose GPU blocks this step rewrites (fences):
        on a GPU the compute stream waits on their end events and the host is not blocked; on
        the CPU they are already done. Their results are reported as usual."""
        self._worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Submits this step's loads (asynchronous on a GPU; done on return on the CPU)."""
        self._worker_side.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: loads finish before their request is scheduled (asynchronous loads)."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing: stores are whole-block jobs submitted in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        """Submits this step's stores after the forward pass (on a GPU they wait on the compute
        stream and run in the background)."""
        self._worker_side.wait_for_save(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished jobs: loads become ``finished_recving`` (failed ones also
        ``failed_recving`` unless the model is one full-attention group, whose failed GPU blocks
        go to :meth:`get_block_ids_with_load_errors`); every job goes into the worker
        metadata."""
        step = getattr(self, "_connector_metadata", None)  # this step's (bound until cleared)
        return self._worker_side.get_transfer_results(step)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks of loads that failed since the last call (a model of one full-attention
        KV cache group; other models report the request in ``failed_recving``)."""
        role = self._worker_role
        return set() if role is None else role.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KvoffWorkerMetadata | None:
        """This rank's job reports since the last call (``None`` when there are none)."""
        role = self._worker_role
        return None if role is None else role.build_connector_worker_meta()

    def shutdown(self) -> None:
        """Waits for the jobs in flight (and the secondary tiers' reads and writes) and
        releases the pinned pool. Idempotent."""
        if self._config.has_tiers:
            close_tiers(self._engine_id)  # the tiers read the pool: they stop first
        if self._scheduler_role is not None:
            self._scheduler_role.shutdown()
        if self._worker_role is not None:
            self._worker_role.shutdown()
