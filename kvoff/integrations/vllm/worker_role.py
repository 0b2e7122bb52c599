"""KvoffConnector's worker role: :class:`KvoffConnectorWorker`, kvoff's
:class:`kvoff.OffloadingWorker` behind vLLM's worker-side connector hooks (one per rank: the CPU
pool, each step's loads before the forward pass and stores after it, fences, and this rank's
job reports).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
)

from kvoff.config import OffloadingConfig
from kvoff.integrations.vllm.metadata import KvoffConnectorMetadata, KvoffWorkerMetadata
from kvoff.integrations.vllm.tier_wiring import worker_in_engine_core, worker_rank
from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.tiers.engine_tiers import pool_shm_name, register_worker, unregister_worker
from kvoff.worker import OffloadingWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

__all__ = ["KvoffConnectorWorker"]

logger = logging.getLogger(__name__)


class KvoffConnectorWorker:
    """:class:`KvoffConnector`'s worker role (one per rank): kvoff's
    :class:`kvoff.OffloadingWorker` (:attr:`worker`, made by :meth:`register_kv_caches`) runs
    the jobs of each step's :class:`KvoffConnectorMetadata` and reports every finished one in
    :class:`KvoffWorkerMetadata`.

    Args:
        vllm_config: the engine's configuration (this worker's rank, where it runs).
        config: kvoff's configuration (``kv_connector_extra_config``).
        spec: the engine's CPU offloading spec (:func:`.translate.cpu_spec`).
        engine_id: the engine's ``kv_transfer_config.engine_id`` (the name of the shared CPU
            pool with tiers).
        block_level_load_errors: report a failed load by its GPU blocks
            (:meth:`get_block_ids_with_load_errors`) rather than by its request
            (``failed_recving``).
        node_pool_region: this rank's region of the node pool that is the engine's CPU pool
            (``/dev/shm/<region>``, mapped and pinned here), or None.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: OffloadingConfig,
        spec: CPUOffloadingSpec,
        engine_id: str,
        *,
        block_level_load_errors: bool,
        node_pool_region: str | None = None,
    ) -> None:
        self._vllm_config = vllm_config
        self._config = config
        self._spec = spec
        self._engine_id = engine_id
        self._block_level_load_errors = block_level_load_errors
        self._node_pool_region = node_pool_region
        self._worker: OffloadingWorker | None = None
        self._job_requests: dict[int, str] = {}  # load job -> request
        self._job_gpu_blocks: dict[int, tuple[int, ...]] = {}  # load job -> blocks
        self._pending_meta = KvoffWorkerMetadata()
        self.fences = 0  # in-flight jobs the compute stream was ordered after (stream waits)
        self._load_errors: set[int] = set()

    @property
    def worker(self) -> OffloadingWorker:
        """kvoff's worker (after :meth:`register_kv_caches`).

        Raises:
            RuntimeError: before registration.
        """
        if self._worker is None:
            raise RuntimeError("KvoffConnector.worker exists in the worker role after "
                               "register_kv_caches")  # fmt: skip
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """As :meth:`KvoffConnector.register_kv_caches`."""
        layers = {
            name for g in self._spec.kv_cache_config.kv_cache_groups for name in g.layer_names
        }
        # With tiers, the scheduler role reads and writes this pool: found in this process, or
        # mapped from shared memory when this worker runs in a process of its own.
        tiers = self._config.has_tiers
        shared = tiers and not worker_in_engine_core(self._vllm_config)
        name = pool_shm_name(self._engine_id, worker_rank(self._vllm_config)) if shared else None
        attach = self._node_pool_region is not None
        if attach:  # this rank's slots of the node pool
            name = self._node_pool_region
        worker = OffloadingWorker.from_spec(
            self._spec, config=self._config, shared_memory_name=name,
            attach_shared_memory=attach,
        )  # fmt: skip
        worker.register_kv_caches({k: v for k, v in kv_caches.items() if k in layers})
        self._worker = worker
        if tiers and not shared:
            register_worker(self._engine_id, worker)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """As :meth:`KvoffConnector.handle_preemptions`."""
        if not isinstance(kv_connector_metadata, KvoffConnectorMetadata):
            return
        pending = self.worker.pending_jobs()
        flush = [j for j in kv_connector_metadata.jobs_to_flush if j in pending]
        if flush:  # a stream-ordered wait: the host goes on launching the forward pass
            self.fences += self.worker.fence(flush)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Submits the loads of ``meta`` (this step's metadata), as
        :meth:`KvoffConnector.start_load_kv`."""
        assert isinstance(meta, KvoffConnectorMetadata)
        jobs = meta.load_jobs
        for job in jobs:
            self._job_requests[job.job_id] = job.request_id
            self._job_gpu_blocks[job.job_id] = job.gpu.block_ids
        if jobs:  # together: one copy per group for all of them (per-job results)
            self.worker.transfer_many_async([(j.job_id, j.src, j.dst) for j in jobs])

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Submits the stores of ``meta`` (this step's metadata), as
        :meth:`KvoffConnector.wait_for_save`."""
        assert isinstance(meta, KvoffConnectorMetadata)
        jobs = meta.store_jobs
        if jobs:  # a step's stores together: one copy per group (per-job results)
            self.worker.transfer_many_async([(j.job_id, j.src, j.dst) for j in jobs])

    def get_transfer_results(self, step: KVConnectorMetadata | None) -> KVConnectorTransferResults:
        """As :meth:`KvoffConnector.get_transfer_results`; ``step``: this step's metadata, None
        once vLLM cleared it."""
        results = KVConnectorTransferResults()
        if isinstance(step, KvoffConnectorMetadata) and step.finished_flushes:
            # their stores are this step's jobs: vLLM may free their blocks now
            results.finished_sending.update(step.finished_flushes)
        if isinstance(step, KvoffConnectorMetadata) and step.refused_loads:
            # loads the node pool refused: failed, recomputed by vLLM
            results.finished_recving.update(step.refused_loads)
            results.failed_recving.update(step.refused_loads)
        finished = self.worker.get_finished()
        meta = self._pending_meta
        for r in finished:
            counts = meta.reports.setdefault(r.job_id, [0, 0])
            counts[0 if r.success else 1] += 1
            if r.success and r.direction == "load":
                meta.load_bytes += r.num_bytes
                meta.load_seconds += r.seconds
            elif r.success:
                meta.store_bytes += r.num_bytes
                meta.store_seconds += r.seconds
            rid = self._job_requests.pop(r.job_id, None)
            blocks = self._job_gpu_blocks.pop(r.job_id, ())
            if rid is None:
                continue  # a store
            results.finished_recving.add(rid)
            if not r.success:
                logger.warning("kvoff: load job %d of request %s failed (%s); its tokens are "
                               "recomputed", r.job_id, rid, r.error)  # fmt: skip
                if self._block_level_load_errors:
                    self._load_errors.update(b for b in blocks if b != 0)
                else:
                    results.failed_recving.add(rid)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        """As :meth:`KvoffConnector.get_block_ids_with_load_errors`."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KvoffWorkerMetadata | None:
        """As :meth:`KvoffConnector.build_connector_worker_meta`."""
        meta = self._pending_meta
        if not meta.reports:
            return None
        self._pending_meta = KvoffWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        """Waits for the jobs in flight and releases the pinned pool (and forgets it as the
        engine's pool for the tiers). Idempotent."""
        if self._worker is not None:
            self._worker.close()
            unregister_worker(self._engine_id, self._worker)
