"""kvoff as a spec of vLLM's ``OffloadingConnector``: :class:`KvoffOffloadingSpec` (what vLLM
loads by ``spec_name`` / ``spec_module_path``) and :class:`KvoffOffloadingWorker`, vLLM's
``OffloadingWorker`` interface on :class:`kvoff.OffloadingWorker`. Its manager is
:class:`~kvoff.integrations.vllm.spec_manager.KvoffOffloadingManager`.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingSpec,
    TransferResult,
)
from vllm.v1.kv_offload.base import OffloadingWorker as VllmOffloadingWorker

from kvoff.config import OffloadingConfig
from kvoff.integrations.vllm.metrics import configured_tier_counters
from kvoff.integrations.vllm.spec_manager import KvoffOffloadingManager
from kvoff.integrations.vllm.tier_wiring import attach_spec_tiers, spec_fingerprint
from kvoff.integrations.vllm.translate import offloading_config, require_bytes
from kvoff.integrations.vllm.versions import check_offloading_worker_interface, warn_if_untested
from kvoff.jobs import CPUBlockSpec, GPUBlockSpec
from kvoff.sizing import compute_num_cpu_blocks
from kvoff.tiers.engine_tiers import pool_shm_name
from kvoff.worker import OffloadingWorker

__all__ = ["KvoffOffloadingSpec", "KvoffOffloadingWorker"]


class KvoffOffloadingWorker(VllmOffloadingWorker):
    """vLLM's ``OffloadingWorker`` interface on :class:`kvoff.OffloadingWorker` (slot-major
    pool, staged or copy-engine transfers on a GPU, parallel memcpy on the CPU).

    Args:
        kv_caches: vLLM's canonical KV caches: per offloaded group, references to
            ``(num_blocks, page)`` int8 tensors.
        num_cpu_blocks: CPU slots.
        blocks_per_chunk: GPU blocks per offloaded block.
        config: kvoff's transfer options (mechanism, budget, staging, pinning).
        shared_memory_name: put the CPU pool in ``/dev/shm/<name>`` (for the scheduler's
            secondary tiers); ``None``: private memory.
        attach_shared_memory: map the existing ``/dev/shm/<name>`` instead (a node pool's
            region).

    Raises:
        ValueError: what :meth:`kvoff.OffloadingWorker.register_kv_caches` raises.
        kvoff.pinned.SharedMemoryError: the shared pool cannot be allocated (or, attaching,
            is missing or of another layout).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        num_cpu_blocks: int,
        blocks_per_chunk: int,
        config: OffloadingConfig,
        *,
        shared_memory_name: str | None = None,
        attach_shared_memory: bool = False,
    ) -> None:
        num_gpu_blocks = kv_caches.tensors[0].tensor.shape[0]
        options = config.worker_options()
        self.worker = OffloadingWorker(
            num_gpu_blocks, num_cpu_blocks, blocks_per_chunk, **options,
            shared_memory_name=shared_memory_name, attach_shared_memory=attach_shared_memory,
        )  # fmt: skip
        layers: dict[str, torch.Tensor] = {}
        groups: dict[str, int] = {}
        for g, refs in enumerate(kv_caches.group_data_refs):
            for i, ref in enumerate(refs):
                name = f"group{g}.ref{i}"
                layers[name] = kv_caches.tensors[ref.tensor_idx].tensor[:, : ref.page_size_bytes]
                groups[name] = g
        self.worker.register_kv_caches(layers, groups)
        self._done: list[TransferResult] = []

    @staticmethod
    def _gpu(spec: GPULoadStoreSpec) -> GPUBlockSpec:
        return GPUBlockSpec(tuple(spec.block_ids.tolist()), tuple(spec.group_sizes),
                            tuple(spec.block_indices))  # fmt: skip

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """GPU → CPU (asynchronous on a GPU)."""
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        self.worker.transfer_async(
            job_id, self._gpu(src_spec), CPUBlockSpec(tuple(dst_spec.block_ids.tolist()))
        )
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """CPU → GPU (asynchronous on a GPU)."""
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        self.worker.transfer_async(
            job_id, CPUBlockSpec(tuple(src_spec.block_ids.tolist())), self._gpu(dst_spec)
        )
        return True

    @staticmethod
    def _result(r: Any) -> TransferResult:
        return TransferResult(r.job_id, r.success, r.num_bytes or None, r.seconds or None)

    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call (without blocking)."""
        done, self._done = self._done, []
        return done + [self._result(r) for r in self.worker.get_finished()]

    def wait(self, job_ids: set[int]) -> None:
        """Orders the compute stream after the jobs (vLLM calls this for the stores whose GPU
        blocks the next forward pass rewrites): on a GPU a stream-ordered wait, the host is not
        blocked (:meth:`kvoff.OffloadingWorker.fence`); on the CPU the jobs are already done.
        Their results still come from :meth:`get_finished`."""
        pending = self.worker.pending_jobs()
        ids = [j for j in job_ids if j in pending]
        if ids:
            self.worker.fence(ids)

    def shutdown(self) -> None:
        """Waits for the jobs in flight and releases the pinned pool."""
        self.worker.close()


class KvoffOffloadingSpec(OffloadingSpec):
    """kvoff as a spec of vLLM's ``OffloadingConnector``: ``kv_connector_extra_config =
    {"spec_name": "KvoffOffloadingSpec", "spec_module_path": "kvoff.integrations.vllm",
    "cpu_bytes_to_use": ..., ...}`` (the other keys as for :class:`KvoffConnector`, plus vLLM's
    own :data:`VLLM_SPEC_KEYS`, e.g. ``block_size`` for the offloaded block size).

    The CPU slot count is docs/design.md invariant 3 on vLLM's ``worker_kv_bytes_per_block`` (the
    shared allocation's size over ``num_blocks``): ``cpu_bytes_to_use // (bytes per block ×
    world_size × blocks_per_chunk)``.

    Secondary tiers (``disk_path`` + ``disk_bytes``, ``remote_url``): every rank's worker puts
    its CPU pool in shared memory (``/dev/shm``, named after the engine id and the rank, whatever
    the executor), and the scheduler's manager maps them and drives the tiers on them
    (:meth:`KvoffOffloadingManager.attach_tiers`,
    :func:`kvoff.tiers.engine_tiers.tiers_on_pools`). The blocks carry a fingerprint of this
    path's layout (:func:`kvoff.integrations.vllm.tier_wiring.spec_fingerprint`), distinct from
    :class:`KvoffConnector`'s: the two ways in lay a CPU slot out differently and never serve
    each other's blocks. The tiers' counters are Prometheus counters ``vllm:kvoff_<name>``
    (:meth:`build_metric_definitions`).

    Raises:
        kvoff.config.ConfigError, ValueError: as :class:`KvoffConnector`.
        RuntimeError: vLLM's ``OffloadingWorker`` interface is not the one this spec implements
            (vLLM 0.34.0 hands workers device pointers;
            :func:`kvoff.integrations.vllm.versions.check_offloading_worker_interface`).
        kvoff.pinned.SharedMemoryError: with tiers, when a rank's pool cannot be put in
            ``/dev/shm`` (too small: the message gives the sizes) or the scheduler cannot map
            it (the worker runs on another machine: tiers need every rank on the engine core's
            machine).
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """vLLM's CPU offloading metrics, as vLLM's ``CPUOffloadingSpec`` defines them (its own
        definitions: same names, documentation and buckets; ``vllm:kv_offload_stores_skipped``
        with ``store_threshold`` >= 2), and the Prometheus counters ``vllm:kvoff_<name>`` of
        the tiers ``extra_config`` configures
        (:func:`kvoff.integrations.vllm.metrics.configured_tier_counters`).
        :meth:`KvoffOffloadingManager.get_stats` reports them."""
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VllmCPUOffloadingSpec

        return VllmCPUOffloadingSpec.build_metric_definitions(extra_config) | {
            f"vllm:kvoff_{name}": OffloadingCounterMetadata(documentation=doc)
            for name, doc in configured_tier_counters(extra_config)
        }

    def __init__(self, config: Any) -> None:
        check_offloading_worker_interface()
        warn_if_untested("KvoffOffloadingSpec")
        super().__init__(config)
        self.kvoff_config = offloading_config(self.extra_config, spec_path=True)
        self.node_pool: Any = None
        if self.kvoff_config.node_pool is not None:
            self.node_pool = _attach_node_pool(self.kvoff_config.node_pool, config,
                                               self.blocks_per_chunk)  # fmt: skip
            self.num_cpu_blocks = self.node_pool.num_slots
        else:
            self.num_cpu_blocks = compute_num_cpu_blocks(
                require_bytes(self.kvoff_config),
                config.worker_kv_bytes_per_block,
                self.blocks_per_chunk,
                config.parallel.world_size,
            )
        self._manager: KvoffOffloadingManager | None = None
        self._worker: KvoffOffloadingWorker | None = None

    @property
    def num_chunks(self) -> int:
        """vLLM's name for :attr:`num_cpu_blocks` (offloaded blocks in the CPU pool)."""
        return self.num_cpu_blocks

    def get_manager(self) -> KvoffOffloadingManager:
        """The scheduler side's manager (made once), with the tiers on the ranks' shared pools
        when tiers are configured.

        Raises:
            kvoff.pinned.SharedMemoryError, RuntimeError: a rank's pool cannot be mapped (see
                the class).
        """
        if self._manager is None:
            config = self.kvoff_config
            manager = KvoffOffloadingManager(
                self.num_cpu_blocks,
                config.eviction_policy,
                self.kv_events_config.enable_kv_cache_events or config.enable_events,
                store_threshold=config.store_threshold,
                max_tracker_size=config.max_tracker_size,
                manager=self.node_pool,
            )
            if config.has_tiers and self.num_cpu_blocks > 0:
                attach_spec_tiers(manager, self.config, config, self.num_cpu_blocks)
            self._manager = manager
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvoffOffloadingWorker:
        """The worker side (made once): kvoff's worker on vLLM's canonical KV caches; with
        tiers, its CPU pool is in shared memory for the scheduler's tiers.

        Raises:
            kvoff.pinned.SharedMemoryError: ``/dev/shm`` cannot hold the pool (with tiers).
        """
        if self._worker is None:
            name = (
                pool_shm_name(str(self.config.engine_id), int(self.config.parallel.rank))
                if self.kvoff_config.has_tiers
                else None
            )
            attach = self.node_pool is not None
            if attach:  # this rank's slots of the node pool, mapped (and pinned on a GPU)
                name = self.node_pool.regions[int(self.config.parallel.rank)]
            self._worker = KvoffOffloadingWorker(
                kv_caches, self.num_cpu_blocks, self.blocks_per_chunk, self.kvoff_config,
                shared_memory_name=name, attach_shared_memory=attach,
            )  # fmt: skip
        return self._worker


def _attach_node_pool(socket_path: str, config: Any, blocks_per_chunk: int) -> Any:
    """A client of the node pool at ``socket_path`` for this engine's layout.

    Raises:
        kvoff.node_pool.NodePoolError: no pool answers there.
        ValueError: the pool's slots are not this engine's bytes per offloaded block (one
            rank's), or it serves another number of tensor-parallel ranks.
    """
    from kvoff.integrations.vllm.node_pool_wiring import check_fits
    from kvoff.node_pool import NodePoolClient

    rank = int(config.parallel.rank)
    client = NodePoolClient(  # an engine: its stores go into reserved slots where they can
        socket_path,
        spec_fingerprint(config, rank),
        name=f"{config.engine_id}-rank{rank}",
        reserve=True,
    )
    need = int(config.worker_kv_bytes_per_block) * blocks_per_chunk
    detail = (f"{config.worker_kv_bytes_per_block} bytes per block x {blocks_per_chunk} blocks "
              "per chunk")  # fmt: skip
    check_fits(client, int(config.parallel.world_size), need, detail)
    return client
