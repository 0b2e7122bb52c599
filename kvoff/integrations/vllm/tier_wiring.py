"""Secondary tiers for both ways into vLLM, from vLLM's configuration: where the engine runs
its workers (:func:`worker_in_engine_core`, :func:`check_tier_topology`), each rank and
data-parallel rank, the layout fingerprint a way in stamps on its blocks
(:func:`tier_fingerprint`, :func:`spec_fingerprint`), and the tiers put under
``KvoffConnector``'s scheduler (:func:`attach_tiers`) or ``KvoffOffloadingSpec``'s manager
(:func:`attach_spec_tiers`). The engine-independent part (shared pools, the in-process
registry, one tier per rank) is :mod:`kvoff.tiers.engine_tiers`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvoff.config import OffloadingConfig
from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.tiers.block_format import layout_fingerprint
from kvoff.tiers.engine_tiers import (
    attach_or_close,
    data_parallel_config,
    register_tiered,
    registered_worker,
    shared_pool_views,
    tiers_on_pools,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvoff.scheduler import OffloadingScheduler

__all__ = [
    "attach_spec_tiers",
    "attach_tiers",
    "check_tier_topology",
    "spec_fingerprint",
    "tier_config",
    "tier_fingerprint",
    "worker_in_engine_core",
    "worker_rank",
]

logger = logging.getLogger(__name__)


def worker_in_engine_core(vllm_config: VllmConfig) -> bool:
    """Whether vLLM runs the engine's one worker inside the engine-core process."""
    par = vllm_config.parallel_config
    return par.world_size == 1 and par.distributed_executor_backend in (None, "uni")


def check_tier_topology(vllm_config: VllmConfig, config: OffloadingConfig) -> None:
    """Tiers need every rank's worker on the engine core's machine, in the engine-core process
    ("uni" executor) or in local processes ("mp" executor, any number of ranks on one node).

    Raises:
        ValueError: naming the tier keys and the engine setting that rules them out (Ray, an
            external launcher, several nodes).
    """
    if not config.has_tiers:
        return
    par = vllm_config.parallel_config
    backend = par.distributed_executor_backend
    nnodes = int(getattr(par, "nnodes", 1) or 1)
    if backend not in (None, "uni", "mp") or nnodes > 1:
        raise ValueError(
            "kvoff's secondary tiers (disk_path / remote_url in kv_connector_extra_config) "
            "need every rank's worker on the engine core's machine, with the 'uni' or 'mp' "
            f"executor; this engine has distributed_executor_backend={backend!r}, "
            f"nnodes={nnodes}. Remove the tier keys, or run the engine on one node with "
            "distributed_executor_backend='mp'"
        )


def worker_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the engine's ``world_size`` workers (vLLM sets
    ``parallel_config.rank`` in each worker process)."""
    par = vllm_config.parallel_config
    return int(par.rank) % max(1, int(par.world_size))


def tier_config(vllm_config: VllmConfig, config: OffloadingConfig) -> OffloadingConfig:
    """``config`` with the disk tier in ``disk_path/dp<rank>`` for a data-parallel engine: each
    data-parallel rank is an engine of its own, and a disk tier's file serves one process
    (:func:`kvoff.tiers.engine_tiers.data_parallel_config`)."""
    par = vllm_config.parallel_config
    if config.disk_path is None:
        return config
    size = getattr(par, "data_parallel_size", 1)
    return data_parallel_config(config, size, int(getattr(par, "data_parallel_rank", 0) or 0))


def tier_fingerprint(vllm_config: VllmConfig, spec: CPUOffloadingSpec, rank: int = 0) -> bytes:
    """What must match for a stored block to be usable by this engine: the model (name or path
    and revision), dtypes, the KV cache groups (specs and layers; not the GPU block count),
    block sizes and the rank (:func:`kvoff.tiers.layout_fingerprint`)."""
    mc = vllm_config.model_config
    return layout_fingerprint(
        engine="vllm",
        model=str(mc.model),
        revision=str(mc.revision),
        dtype=str(mc.dtype),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        kv_cache_groups=spec.kv_cache_config.kv_cache_groups,
        block_size=spec.block_size,
        offloaded_block_size=spec.offloaded_block_size,
        world_size=spec.world_size,
        rank=rank,
    )


def attach_tiers(
    engine_id: str,
    scheduler: OffloadingScheduler,
    config: OffloadingConfig,
    vllm_config: VllmConfig,
    spec: CPUOffloadingSpec,
) -> None:
    """Puts the configured tiers under ``scheduler``, on the CPU pools of the engine's workers:
    the worker of this process (one rank, "uni" executor), else every rank's pool mapped from
    shared memory (:func:`kvoff.tiers.engine_tiers.pool_shm_name`); see
    :func:`kvoff.tiers.engine_tiers.tiers_on_pools`.

    Raises:
        RuntimeError: the engine's workers run in this process but none registered its KV
            caches here.
        kvoff.pinned.SharedMemoryError: a rank's shared pool is missing (a worker on another
            machine) or unreadable.
    """
    if worker_in_engine_core(vllm_config):
        worker = registered_worker(engine_id)
        if worker is None:
            raise RuntimeError(
                f"kvoff's secondary tiers: no kvoff worker of engine {engine_id!r} registered "
                "its KV caches in this process, where vLLM's 'uni' executor runs it"
            )
        views = [worker.cpu_pool.numpy()]
        where = "in this process"
    else:
        world = int(vllm_config.parallel_config.world_size)
        views = shared_pool_views(engine_id, world, spec.num_blocks)
        where = f"shared with {world} worker process(es)"
    tiers, slot = tiers_on_pools(
        config, views, lambda r: tier_fingerprint(vllm_config, spec, rank=r)
    )
    attach_or_close(scheduler.attach_tiers, tiers, slot, config)
    register_tiered(engine_id, scheduler)
    logger.info("kvoff: tiers %s below the CPU pool of engine %s (%s)",
                [t.name for t in tiers], engine_id, where)  # fmt: skip


def spec_fingerprint(config: Any, rank: int) -> bytes:
    """What must match for a block stored through :class:`KvoffOffloadingSpec` to be usable by
    this engine (:func:`kvoff.tiers.layout_fingerprint` of vLLM's ``OffloadingConfig``): the
    model and KV dtype, the offloaded groups (tokens per block, layers), tokens per hash,
    blocks per chunk, bytes per block, the KV cache layout, the parallel sizes and the rank.
    vLLM's ``OffloadingConfig`` has no model revision: a model name (or path) whose weights
    change must not share a disk path or Redis namespace with the old weights' blocks."""
    par = config.parallel
    return layout_fingerprint(
        engine="vllm-offloading-connector",
        model=str(config.model.name),
        dtype=str(config.model.dtype),
        groups=[[g.group_id, g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        tokens_per_hash=int(config.cache.tokens_per_hash),
        blocks_per_chunk=int(config.cache.blocks_per_chunk),
        worker_kv_bytes_per_block=int(config.worker_kv_bytes_per_block),
        kv_cache_layout=str(config.kv_cache_layout),
        canonical_layout=bool(config.canonical_layout),
        world_size=int(par.world_size),
        tp_size=int(par.tp_size),
        pp_size=int(par.pp_size),
        rank=rank,
    )


def attach_spec_tiers(
    manager: Any, offloading_config: Any, config: OffloadingConfig, num_blocks: int
) -> None:
    """Puts the configured tiers under ``KvoffOffloadingSpec``'s manager, on every rank's CPU
    pool mapped from shared memory (whatever the executor), each rank's blocks stamped with
    :func:`spec_fingerprint`.

    Args:
        manager: the ``KvoffOffloadingManager`` (its ``attach_tiers``).
        offloading_config: vLLM's ``OffloadingConfig`` of the spec (engine id, parallel sizes).
        config: kvoff's configuration (the tier keys).
        num_blocks: the CPU pool's slots (offloaded blocks) per rank.

    Raises:
        kvoff.pinned.SharedMemoryError, RuntimeError: a rank's pool cannot be mapped (see
            :func:`kvoff.tiers.engine_tiers.shared_pool_views`).
        ValueError, OSError: what the tiers' constructors raise (nothing is left open).
    """
    par = offloading_config.parallel
    world = int(par.world_size)
    views = shared_pool_views(str(offloading_config.engine_id), world, num_blocks)
    # each data-parallel rank is an engine of its own; a disk tier serves one process
    config = data_parallel_config(config, int(par.data_parallel_size), int(par.data_parallel_index))
    tiers, slot = tiers_on_pools(config, views, lambda r: spec_fingerprint(offloading_config, r))
    attach_or_close(manager.attach_tiers, tiers, slot, config)
    logger.info("kvoff: tiers %s below the CPU pool of engine %s (OffloadingConnector, %d "
                "rank(s))", [t.name for t in tiers], offloading_config.engine_id,
                world)  # fmt: skip
