"""kvoff inside vLLM: a KV connector on kvoff's C++ scheduler, and an offloading spec for
vLLM's own ``OffloadingConnector``. Tested with vLLM 0.32.0 (:data:`VLLM_TESTED_VERSIONS`).

Two ways in:

* :class:`KvoffConnector` (``kv_connector="KvoffConnector"``,
  ``kv_connector_module_path="kvoff.integrations.vllm"``): the scheduler role is kvoff's C++
  :class:`kvoff.OffloadingScheduler`, which decides every load and store (lookups, eviction,
  stale sliding-window blocks, fences); the worker role is :class:`kvoff.OffloadingWorker`
  (parallel CPU copies on vLLM-CPU, its CUDA streams on a GPU).
* :class:`KvoffOffloadingSpec` for vLLM's ``OffloadingConnector``
  (``kv_connector_extra_config={"spec_name": "KvoffOffloadingSpec", "spec_module_path":
  "kvoff.integrations.vllm", ...}``): vLLM's Python scheduler with kvoff's C++ manager and
  kvoff's worker underneath. A second way in, and a like-for-like comparison.

Configuration: ``kv_connector_extra_config`` is a :class:`kvoff.OffloadingConfig` mapping
(``cpu_bytes_to_use`` required; ``offloaded_block_size``, ``eviction_policy``, ``enable_events``,
``transfer_mechanism``, ``compute_slowdown_budget``, ``staging_bytes``, ...); an unknown key is an
error that names it and the closest valid key. vLLM fills ``world_size`` (the ranks of one
engine) and ``hash_block_size``; the spec path also accepts vLLM's own spec keys
(:data:`VLLM_SPEC_KEYS`).

How vLLM's types map to kvoff's (no per-token data is copied per step): a vLLM ``Request`` is
passed as it is (kvoff reads ``request_id``, ``block_hashes`` and ``num_tokens`` and forwards
only the hashes it has not seen); ``KVCacheBlocks.get_block_ids()`` is the block table per
group; ``SchedulerOutput``'s columns go to
:meth:`kvoff.OffloadingScheduler.build_connector_meta_columns` as they are (new requests' whole
tables, running requests' new blocks, resumed requests, finished and preempted ids, and
copy-on-write destinations as ``rewritten_block_ids``; no per-request object is made); each
rank reports every job in
:class:`KvoffWorkerMetadata`, which vLLM sums over ranks (``aggregate``) before
``update_connector_output``: a job completes when every rank reported it.

Secondary tiers: with ``disk_path`` + ``disk_bytes`` and/or ``remote_url`` in
``kv_connector_extra_config``, kvoff's disk and Redis Cluster tiers sit below its CPU pool:
completed stores are written through in the background, and a CPU pool miss answers "retry
later" while the tiers are read into the pool (promotion). Both ways in have them:
:class:`KvoffConnector` through :meth:`kvoff.OffloadingScheduler.attach_tiers`, and
:class:`KvoffOffloadingSpec` through :meth:`KvoffOffloadingManager.attach_tiers`. The tier
threads run in the engine core and read and write the workers' CPU pools: the worker's own pool
when it runs in the engine core (``KvoffConnector`` with the "uni" executor), else every rank's
pool in shared memory (``/dev/shm``). So every rank must run on the engine core's machine (the
"uni" or "mp" executor); Ray, an external launcher and several nodes are refused.

A failed load is never served: the worker reports its GPU blocks through
``get_block_ids_with_load_errors`` (one full-attention KV cache group) or the request through
``failed_recving`` (sliding-window, Mamba and hybrid models, whose blocks before a failed one
may be null), and the engine recomputes them. Set
``kv_load_failure_policy="recompute"`` in the ``KVTransferConfig`` (vLLM's default, ``"fail"``,
fails such requests instead).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.base import OffloadingWorker as VllmOffloadingWorker
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoff import specs as kspecs
from kvoff._scheduler import CPUOffloadingManager
from kvoff.config import EVICTION_POLICIES, ConfigError, OffloadingConfig
from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.scheduler import (
    OffloadingScheduler,
    TransferJob,
    group_kinds,
)
from kvoff.sizing import compute_num_cpu_blocks
from kvoff.worker import CPUBlockSpec, GPUBlockSpec, OffloadingWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "VLLM_TESTED_VERSIONS",
    "KvoffConnector",
    "KvoffConnectorMetadata",
    "KvoffConnectorStats",
    "KvoffOffloadingSpec",
    "KvoffWorkerMetadata",
    "kvoff_kv_cache_config",
]

logger = logging.getLogger(__name__)

VLLM_TESTED_VERSIONS: tuple[str, ...] = ("0.32.0",)
"""vLLM releases whose tests (``tests/integrations/test_vllm.py``) pass against this kvoff."""

VLLM_SPEC_KEYS: frozenset[str] = frozenset(
    {"spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
     "self_describing_kv_events", "canonical_layout", "kv_load_tiers"}
)  # fmt: skip
"""``kv_connector_extra_config`` keys that vLLM's ``OffloadingConnector`` reads itself; the
spec path passes them by and validates the rest as a :class:`kvoff.OffloadingConfig`."""


# ----------------------------------------------------------------------------------- config


def _kvoff_spec(spec: object, layer: str | None = None) -> kspecs.KVCacheSpec:
    """kvoff's spec for one vLLM KV cache spec.

    Raises:
        ValueError: for a spec kvoff cannot offload (naming it).
    """
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return kspecs.UniformTypeKVCacheSpecs(
            spec.block_size,
            {name: _kvoff_spec(s, name) for name, s in spec.kv_cache_specs.items()},
        )
    if isinstance(spec, MambaSpec):
        return kspecs.MambaSpec(
            spec.block_size, tuple(map(tuple, spec.shapes)), tuple(spec.dtypes),
            spec.page_size_padded,
        )  # fmt: skip
    if isinstance(spec, MLAAttentionSpec):
        return kspecs.MLAAttentionSpec(
            spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype
        )
    if isinstance(spec, SlidingWindowSpec):
        return kspecs.SlidingWindowSpec(
            spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype, spec.sliding_window
        )
    if isinstance(spec, FullAttentionSpec) and not isinstance(spec, ChunkedLocalAttentionSpec):
        if spec.head_size_v != spec.head_size:
            raise ValueError(
                f"layer {layer!r}: K and V head sizes differ ({spec.head_size} vs "
                f"{spec.head_size_v}); kvoff offloads attention KV with equal K and V sizes"
            )
        if spec.sliding_window is not None:  # a full-attention group that records a window
            return kspecs.SlidingWindowSpec(
                spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype,
                spec.sliding_window,
            )  # fmt: skip
        return kspecs.FullAttentionSpec(
            spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype
        )
    raise ValueError(
        f"layer {layer!r}: kvoff cannot offload a {type(spec).__name__} KV cache group; it "
        "offloads full attention, sliding window, MLA and Mamba groups"
    )


def kvoff_kv_cache_config(config: VllmKVCacheConfig) -> kspecs.KVCacheConfig:
    """kvoff's :class:`kvoff.KVCacheConfig` for vLLM's.

    ``num_blocks`` is vLLM's (authoritative, docs/design.md invariant 2). In vLLM 0.32 every
    ``KVCacheTensor`` places its layers in ONE backing allocation of ``size`` bytes (groups
    overlay each other), so the translation has one tensor of that size shared by every layer:
    bytes per GPU block = ``size // num_blocks`` (docs/design.md invariant 3), not the sum over the
    entries, each of which states the whole allocation's size.

    Raises:
        ValueError: for a group kvoff cannot offload, or tensors of different backing sizes.
    """
    groups = tuple(
        kspecs.KVCacheGroupSpec(tuple(g.layer_names), _kvoff_spec(g.kv_cache_spec))
        for g in config.kv_cache_groups
    )
    sizes = {t.size for t in config.kv_cache_tensors}
    if len(sizes) > 1:
        raise ValueError(
            f"vLLM's KV cache tensors state backing sizes {sorted(sizes)}; kvoff expects the one "
            "shared allocation of vLLM 0.32 (KVCacheTensor.size)"
        )
    layers = tuple(name for g in groups for name in g.layer_names)
    tensors = (kspecs.KVCacheTensor(sizes.pop(), layers),) if sizes else ()
    return kspecs.KVCacheConfig(config.num_blocks, tensors, groups)


def _offloading_config(extra: Mapping[str, Any], *, spec_path: bool) -> OffloadingConfig:
    """The :class:`kvoff.OffloadingConfig` in ``kv_connector_extra_config``.

    vLLM's CPU offloading keys carry over: ``eviction_policy``, ``store_threshold`` and
    ``max_tracker_size`` are kvoff keys of the same meaning, and ``cache_policy_module_path``
    is accepted when empty.

    Raises:
        kvoff.config.ConfigError: for an unknown key (naming it and the closest valid key), a
            missing ``cpu_bytes_to_use`` (vLLM's message: "cpu_bytes_to_use must be
            specified"), a ``cache_policy_module_path`` (a Python policy cannot run in kvoff's
            C++ manager), or on the spec path a key vLLM's OffloadingConnector decides itself
            (``offloaded_block_size``, ``hash_block_size``, ``world_size``,
            ``store_batch_blocks``, ``offload_prompt_only`` is vLLM's own key there).
        pydantic.ValidationError: for a bad value (naming it).
    """
    data = {k: v for k, v in dict(extra).items() if not (spec_path and k in VLLM_SPEC_KEYS)}
    module = data.pop("cache_policy_module_path", None)
    if module:
        raise ConfigError(
            f"kv_connector_extra_config cache_policy_module_path={module!r}: kvoff's eviction "
            "policies run inside its C++ manager, which cannot call a Python CachePolicy; "
            f"choose eviction_policy from {list(EVICTION_POLICIES)} and remove the key, or use "
            "vLLM's own CPUOffloadingSpec for a Python policy"
        )
    if not data.get("cpu_bytes_to_use") and "num_cpu_blocks" not in data:
        # an unknown key first (a misspelt cpu_bytes_to_use is named with the fix)
        OffloadingConfig.from_dict({**data, "cpu_bytes_to_use": 1})
        raise ConfigError(
            "cpu_bytes_to_use must be specified in kv_connector_extra_config: the CPU pool's "
            'bytes over all ranks, e.g. "cpu_bytes_to_use": "40GiB"'
        )
    ignored = {
        "offloaded_block_size": "block_size (vLLM's key: tokens per offloaded block)",
        "hash_block_size": "nothing (vLLM hashes with its own block size)",
        "world_size": "nothing (vLLM sets the ranks)",
        "store_batch_blocks": "KvoffConnector (vLLM's scheduler stores every block as it fills)",
    }
    unused = sorted(ignored.keys() & data.keys()) if spec_path else []
    if unused:
        key = unused[0]
        raise ConfigError(
            f"kv_connector_extra_config key {key!r} is not used by KvoffOffloadingSpec (vLLM's "
            f"OffloadingConnector decides it itself); use {ignored[key]}"
        )
    if spec_path and "block_size" in extra and "offloaded_block_size" not in data:
        data["offloaded_block_size"] = int(extra["block_size"])
    return OffloadingConfig.from_dict(data)


def _cpu_spec(
    vllm_config: VllmConfig, kv_cache_config: VllmKVCacheConfig, config: OffloadingConfig
) -> CPUOffloadingSpec:
    kvoff_config = kvoff_kv_cache_config(kv_cache_config)
    world = vllm_config.parallel_config.world_size
    if config.world_size not in (1, world):
        raise ValueError(
            f"kv_connector_extra_config world_size={config.world_size} disagrees with the "
            f"engine's {world} ranks; leave world_size out (vLLM sets it)"
        )
    hash_bs = kv_cache_config.hash_block_size or vllm_config.cache_config.block_size
    if config.hash_block_size not in (None, hash_bs):
        raise ValueError(
            f"kv_connector_extra_config hash_block_size={config.hash_block_size} disagrees with "
            f"the engine, which hashes every {hash_bs} tokens; leave hash_block_size out (vLLM "
            "sets it)"
        )
    return CPUOffloadingSpec(
        kvoff_config,
        cpu_bytes_to_use=_require_bytes(config),
        block_size=config.offloaded_block_size,
        hash_block_size=hash_bs,
        world_size=world,
        eviction_policy=config.eviction_policy,
    )


def _require_bytes(config: OffloadingConfig) -> int:
    if config.cpu_bytes_to_use is None:
        raise ValueError(
            "kv_connector_extra_config needs cpu_bytes_to_use (bytes over all ranks, e.g. "
            '"40GiB"); num_cpu_blocks cannot size a pool whose block bytes vLLM decides'
        )
    return config.cpu_bytes_to_use


# ------------------------------------------------------------------------ secondary tiers

# The secondary tiers read and write the CPU pool, which the worker role allocates; the
# scheduler role drives them. Two ways for the scheduler to reach the pool:
# - in one process (one rank, vLLM's "uni" executor: the worker runs inside the engine core),
#   the roles meet here, by the engine's kv_transfer_config.engine_id (guarded by _TIER_LOCK);
# - with workers in processes of their own (the "mp" executor, one or more ranks), each rank's
#   worker puts its pool in POSIX shared memory under a name made of the engine id and the rank
#   (_pool_shm_name), and the scheduler maps every rank's pool (kvoff.pinned.SharedHostPool).
_TIER_LOCK = threading.Lock()
_TIER_WORKERS: dict[str, OffloadingWorker] = {}  # engine id -> its worker (the CPU pool)
_TIER_SCHEDULERS: dict[str, OffloadingScheduler] = {}  # engine id -> the scheduler with tiers


def _worker_in_engine_core(vllm_config: VllmConfig) -> bool:
    """Whether vLLM runs the engine's one worker inside the engine-core process."""
    par = vllm_config.parallel_config
    return par.world_size == 1 and par.distributed_executor_backend in (None, "uni")


def _check_tier_topology(vllm_config: VllmConfig, config: OffloadingConfig) -> None:
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


def _pool_shm_name(engine_id: str, rank: int) -> str:
    """The shared-memory name of rank ``rank``'s CPU pool of engine ``engine_id`` (a file in
    /dev/shm; vLLM's engine ids are UUIDs, with ``_dp<rank>`` for data-parallel engines)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine_id)
    if len(safe) > 120:  # keep the name a file name; the hash keeps long ids apart
        safe = safe[:100] + "-" + hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return f"kvoff-pool-{safe}-r{rank}"


def _worker_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the engine's ``world_size`` workers (vLLM sets
    ``parallel_config.rank`` in each worker process)."""
    par = vllm_config.parallel_config
    return int(par.rank) % max(1, int(par.world_size))


def _tier_config(vllm_config: VllmConfig, config: OffloadingConfig) -> OffloadingConfig:
    """``config`` with the disk tier in ``disk_path/dp<rank>`` for a data-parallel engine: each
    data-parallel rank is an engine of its own, and a disk tier's file serves one process."""
    par = vllm_config.parallel_config
    if config.disk_path is None or getattr(par, "data_parallel_size", 1) <= 1:
        return config
    rank = int(getattr(par, "data_parallel_rank", 0) or 0)
    return config.model_copy(update={"disk_path": config.disk_path / f"dp{rank}"})


def _tier_fingerprint(vllm_config: VllmConfig, spec: CPUOffloadingSpec, rank: int = 0) -> bytes:
    """What must match for a stored block to be usable by this engine: the model (name or path
    and revision), dtypes, the KV cache groups (specs and layers; not the GPU block count),
    block sizes and the rank (:func:`kvoff.tiers.layout_fingerprint`)."""
    from kvoff.tiers.block_format import layout_fingerprint

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


def _tiers_on_pools(
    config: OffloadingConfig,
    views: Sequence[Any],
    fingerprint: Callable[[int], bytes],
) -> tuple[list[Any], Callable[[int], Any]]:
    """The configured tiers on the CPU pools ``views`` (rank ``r``'s pool at position ``r``,
    each a ``(num_blocks, slot_bytes)`` uint8 array), and the slot function for
    :class:`kvoff.tiers.coordinator.TieredPool`. One rank: the tiers themselves. Several: each
    rank's part of a block goes to its own tier (disk folder ``disk_path/rank<r>`` with
    ``disk_bytes / world_size`` bytes; Redis keys under the rank's fingerprint), and a block is a
    hit only when every rank's part is (:class:`kvoff.tiers.ranked.RankedTier`).

    Args:
        config: the tier keys (``disk_path``, ``disk_bytes``, ``remote_*``).
        views: the ranks' CPU pools.
        fingerprint: rank -> the 16-byte layout fingerprint its blocks carry.

    Raises:
        ValueError / OSError: what the tiers' constructors raise (nothing is left open).
    """
    from kvoff.tiers.block_format import BlockFormat
    from kvoff.tiers.coordinator import tiers_from_config
    from kvoff.tiers.disk import SUPERBLOCK_BYTES, slot_bytes_for

    if len(views) == 1:
        fmt = BlockFormat(fingerprint(0), int(views[0].shape[1]))
        return tiers_from_config(config, fmt), views[0].__getitem__
    from kvoff.tiers.ranked import RankedTier

    world = len(views)
    per_rank: list[list[Any]] = []
    try:
        for r, v in enumerate(views):
            update: dict[str, Any] = {}
            rank_fmt = BlockFormat(fingerprint(r), int(v.shape[1]))
            if config.disk_path is not None:
                share = max(1, (config.disk_bytes or 0) // world)
                need = SUPERBLOCK_BYTES + slot_bytes_for(rank_fmt)
                if share < need:
                    raise ValueError(
                        f"disk_bytes={config.disk_bytes} is split over {world} ranks ({share} "
                        f"bytes each), less than one block of rank {r} ({need} bytes with the "
                        f"file header); raise disk_bytes to at least {need * world} (a useful "
                        f"tier holds many blocks)"
                    )
                update = {"disk_path": config.disk_path / f"rank{r}", "disk_bytes": share}
            per_rank.append(tiers_from_config(config.model_copy(update=update), rank_fmt))
    except BaseException:
        for ts in per_rank:
            for t in ts:
                t.close()
        raise
    tiers = [RankedTier([ts[i] for ts in per_rank]) for i in range(len(per_rank[0]))]

    def slot(block_id: int) -> tuple[Any, ...]:
        return tuple(v[block_id] for v in views)

    return tiers, slot


def _attach_or_close(
    attach: Callable[..., Any], tiers: list[Any], slot: Callable[[int], Any], config: Any
) -> None:
    """``attach(tiers, slot, write_queue_blocks=...)``; the tiers are closed if it raises."""
    try:
        attach(tiers, slot, write_queue_blocks=config.tier_write_queue_blocks)
    except BaseException:
        for t in tiers:
            t.close()
        raise


def _shared_pool_views(engine_id: str, world: int, num_blocks: int) -> list[Any]:
    """Every rank's CPU pool of engine ``engine_id``, mapped from shared memory
    (:func:`_pool_shm_name`), as ``(num_blocks, slot_bytes)`` uint8 arrays.

    Raises:
        kvoff.pinned.SharedMemoryError: a rank's pool is missing (a worker on another machine)
            or unreadable.
        RuntimeError: a rank's pool has another block count than ``num_blocks``.
    """
    from kvoff.pinned import SharedHostPool

    pools = [SharedHostPool(_pool_shm_name(engine_id, r)).tensors[0] for r in range(world)]
    for r, pool in enumerate(pools):
        if pool.shape[0] != num_blocks:
            raise RuntimeError(
                f"rank {r}'s shared CPU pool has {pool.shape[0]} blocks, the scheduler "
                f"plans {num_blocks}; the ranks must use one kvoff configuration"
            )
    return [p.numpy() for p in pools]


def _attach_tiers(
    engine_id: str,
    scheduler: OffloadingScheduler,
    config: OffloadingConfig,
    vllm_config: VllmConfig,
    spec: CPUOffloadingSpec,
) -> None:
    """Puts the configured tiers under ``scheduler``, on the CPU pools of the engine's workers:
    the worker of this process (one rank, "uni" executor), else every rank's pool mapped from
    shared memory (:func:`_pool_shm_name`); see :func:`_tiers_on_pools`.

    Raises:
        RuntimeError: the engine's workers run in this process but none registered its KV
            caches here.
        kvoff.pinned.SharedMemoryError: a rank's shared pool is missing (a worker on another
            machine) or unreadable.
    """
    if _worker_in_engine_core(vllm_config):
        with _TIER_LOCK:
            worker = _TIER_WORKERS.get(engine_id)
        if worker is None:
            raise RuntimeError(
                f"kvoff's secondary tiers: no kvoff worker of engine {engine_id!r} registered "
                "its KV caches in this process, where vLLM's 'uni' executor runs it"
            )
        views = [worker.cpu_pool.numpy()]
        where = "in this process"
    else:
        world = int(vllm_config.parallel_config.world_size)
        views = _shared_pool_views(engine_id, world, spec.num_blocks)
        where = f"shared with {world} worker process(es)"
    tiers, slot = _tiers_on_pools(
        config, views, lambda r: _tier_fingerprint(vllm_config, spec, rank=r)
    )
    _attach_or_close(scheduler.attach_tiers, tiers, slot, config)
    with _TIER_LOCK:
        _TIER_SCHEDULERS[engine_id] = scheduler
    logger.info("kvoff: tiers %s below the CPU pool of engine %s (%s)",
                [t.name for t in tiers], engine_id, where)  # fmt: skip


def _close_tiers(engine_id: str) -> None:
    """Waits for the engine's tier work and closes its tiers (before its CPU pool goes)."""
    with _TIER_LOCK:
        scheduler = _TIER_SCHEDULERS.pop(engine_id, None)
    if scheduler is not None:
        scheduler.close()


def _tier_totals(tiers: Any) -> dict[str, int]:
    """The flat tier counters of :data:`_TIER_COUNTERS` from ``TieredPool.stats()``."""
    st = tiers.stats()
    out = {
        "tier_probes": int(st["probes"]),
        "tier_writes_dropped_queue_full": int(st["writes_dropped_queue_full"]),
        "tier_resets": int(st["resets"]),
        "tier_writes_cancelled_reset": int(st["writes_cancelled_reset"]),
    }
    for name, c in st["tiers"].items():
        for key in ("promoted_blocks", "promoted_bytes", "promotion_failures", "written_blocks",
                    "writes_dropped", "corrupted_blocks", "fingerprint_mismatches", "timeouts",
                    "io_errors", "blocks_cleared", "writes_dropped_reset"):  # fmt: skip
            out[f"{name}_{key}"] = int(c.get(key, 0))
    return out


# ---------------------------------------------------------------------------- metadata

_NO_JOBS = bytes(24)  # packed jobs of a step without any: [0 jobs, 0 loads, 0 groups]


@dataclass
class KvoffConnectorMetadata(KVConnectorMetadata):
    """What the scheduler role hands to every worker for one step (picklable).

    Attributes:
        packed_jobs: the step's loads (submitted before the forward pass) then stores (after
            it), packed by :meth:`kvoff.OffloadingScheduler.build_connector_meta_packed`: one
            ``bytes`` object, so that the engine's scheduling path makes no Python object per
            job; ``load_jobs`` / ``store_jobs`` give them as :class:`kvoff.TransferJob` records
            (without keys: the scheduler role keeps them), made on the workers.
        request_ids: the request of each packed job, same order.
        jobs_to_flush: in-flight job ids whose GPU blocks are rewritten this step: wait for
            them before the forward pass (docs/design.md invariant 4).
        finished_flushes: finished requests whose GPU blocks vLLM kept for a store due at
            their finish (store batching, ``store_batch_blocks``): this step's jobs include
            that store, so every worker reports them in ``finished_sending`` and vLLM frees
            the blocks (a later reuse waits for the store through ``jobs_to_flush``).
    """

    packed_jobs: bytes = _NO_JOBS
    request_ids: tuple[str, ...] = ()
    jobs_to_flush: tuple[int, ...] = ()
    finished_flushes: tuple[str, ...] = ()

    @functools.cached_property
    def _jobs(self) -> tuple[tuple[TransferJob, ...], tuple[TransferJob, ...]]:
        return OffloadingScheduler.jobs_from_packed(self.packed_jobs, self.request_ids)

    @property
    def load_jobs(self) -> tuple[TransferJob, ...]:
        """The loads as :class:`kvoff.TransferJob` records (made on first use: on the workers,
        off the engine's scheduling path)."""
        return self._jobs[0]

    @property
    def store_jobs(self) -> tuple[TransferJob, ...]:
        """The stores as :class:`kvoff.TransferJob` records (made on first use)."""
        return self._jobs[1]


@dataclass
class KvoffWorkerMetadata(KVConnectorWorkerMetadata):
    """One rank's job reports for one step, summed over ranks by :meth:`aggregate`.

    Attributes:
        reports: job id → ``[ranks that succeeded, ranks that failed]``.
        load_bytes, store_bytes: bytes moved (summed over ranks).
        load_seconds, store_seconds: transfer time of those bytes (summed over ranks).
    """

    reports: dict[int, list[int]] = field(default_factory=dict)
    load_bytes: int = 0
    store_bytes: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvoffWorkerMetadata:
        """Sums two ranks' reports.

        Raises:
            TypeError: when ``other`` is another connector's metadata.
        """
        if not isinstance(other, KvoffWorkerMetadata):
            raise TypeError(f"cannot aggregate KvoffWorkerMetadata with {type(other).__name__}")
        merged = {k: list(v) for k, v in self.reports.items()}
        for job, (ok, bad) in other.reports.items():
            counts = merged.setdefault(job, [0, 0])
            counts[0] += ok
            counts[1] += bad
        return KvoffWorkerMetadata(
            merged,
            self.load_bytes + other.load_bytes,
            self.store_bytes + other.store_bytes,
            self.load_seconds + other.load_seconds,
            self.store_seconds + other.store_seconds,
        )


# ------------------------------------------------------------------------------- stats

_COUNTERS: tuple[tuple[str, str], ...] = (
    ("hit_tokens", "Prompt tokens kvoff promised to load from its CPU pool"),
    ("lookups", "Lookup calls (a request that waits for GPU blocks is looked up again each step)"),
    ("lookup_retries", "Lookups answered 'retry later' (a needed block was in flight)"),
    ("load_jobs", "Load jobs (CPU to GPU)"),
    ("store_jobs", "Store jobs (GPU to CPU)"),
    ("blocks_loaded", "GPU blocks in load jobs"),
    ("blocks_stored", "GPU blocks in store jobs"),
    ("blocks_evicted", "Offloaded blocks evicted from the CPU pool to make room"),
    ("store_refusals", "Stores refused for lack of room (retried next step)"),
    ("stale_blocks_skipped", "Remembered GPU blocks found reallocated and never stored"),
    ("jobs_flushed", "In-flight jobs waited for because their GPU blocks were reused"),
    ("failed_jobs", "Jobs that failed on at least one rank"),
    ("blocks_discarded", "Offloaded blocks dropped because a load of them failed"),
    ("stores_skipped", "Blocks the store_threshold filter held back (offered too few times)"),
    ("load_bytes", "Bytes loaded CPU to GPU (all ranks)"),
    ("store_bytes", "Bytes stored GPU to CPU (all ranks)"),
)

#: The secondary tiers' counters (``disk_path`` / ``remote_url``), per tier (``disk_*``,
#: ``remote_*``) and for the coordinator (``tier_*``); in the stats only when tiers are on.
_TIER_COUNTERS: tuple[tuple[str, str], ...] = (
    ("tier_probes", "Keys asked of the secondary tiers on CPU pool misses"),
    ("tier_writes_dropped_queue_full", "Write-throughs dropped because the queue was full"),
    ("tier_resets", "Cache resets that cleared every tier (reset_prefix_cache with the connector)"),
    ("tier_writes_cancelled_reset", "Queued write-throughs a reset handed back unwritten"),
    *(
        (f"{tier}_{name}", f"{tier} tier: {doc}")
        for tier in ("disk", "remote")
        for name, doc in (
            ("promoted_blocks", "blocks promoted into the CPU pool"),
            ("promoted_bytes", "bytes promoted into the CPU pool"),
            ("promotion_failures", "promotions that failed (the request recomputes)"),
            ("written_blocks", "blocks written through from the CPU pool"),
            ("writes_dropped", "writes the tier refused (full, unwritable, timeout)"),
            ("corrupted_blocks", "blocks rejected for a bad header or checksum (never served)"),
            ("fingerprint_mismatches", "blocks of another model or layout seen, not served"),
            ("timeouts", "operations that ran into the tier's timeout"),
            ("io_errors", "I/O or connection errors (each a miss or a dropped write)"),
            ("blocks_cleared", "blocks a cache reset dropped from the tier"),
            ("writes_dropped_reset", "writes in flight at a cache reset, dropped unwritten"),
        )
    ),
)


def _configured_tier_counters(extra: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The :data:`_TIER_COUNTERS` of the tiers ``kv_connector_extra_config`` configures: the
    coordinator's ``tier_*`` when any, ``disk_*`` with ``disk_path``, ``remote_*`` with
    ``remote_url``; none without tiers (an operator's ``/metrics`` lists no counter of a tier
    the engine does not have). The tiers' stats report exactly these names."""
    tiers = [t for t, key in (("disk", "disk_path"), ("remote", "remote_url")) if extra.get(key)]
    if not tiers:
        return ()
    return tuple(
        (name, doc)
        for name, doc in _TIER_COUNTERS
        if name.startswith("tier_") or name.split("_", 1)[0] in tiers
    )


#: Gauges of :class:`KvoffConnector`: vLLM's CPU cache usage figures
#: (``vllm:kv_offload_cpu_cache_*_usage_perc``, which :class:`KvoffOffloadingSpec` reports under
#: vLLM's names) under kvoff's, ``vllm:kvoff_<name>``.
_GAUGES: tuple[tuple[str, str], ...] = (
    ("cpu_cache_usage_perc", "Fraction of the CPU pool's blocks that transfers pin now (stores "
     "in flight, loads, write-through to the tiers); as vLLM's "
     "vllm:kv_offload_cpu_cache_usage_perc"),
    ("cpu_cache_write_usage_perc", "Fraction of the CPU pool's blocks pinned by stores in flight"),
    ("cpu_cache_read_usage_perc", "Fraction of the CPU pool's blocks pinned by loads and "
     "write-through"),
)  # fmt: skip
_GAUGE_NAMES = frozenset(name for name, _ in _GAUGES)

#: The workers' transfer totals, after the scheduler's COUNTER_NAMES in the connector's stats.
_TRANSFER_TOTALS = ("load_bytes", "store_bytes", "load_seconds", "store_seconds")


@dataclass
class KvoffConnectorStats(KVConnectorStats):
    """kvoff's counters since the last report (``data``: name → value; see
    :data:`_COUNTERS`, plus ``load_seconds`` and ``store_seconds``) and its usage gauges at
    the report (:data:`_GAUGES`, fractions of the CPU pool's blocks).

    :meth:`reduce` adds GB/s per direction (bytes over the transfer seconds of all ranks,
    10^9 bytes per second).
    """

    def reset(self) -> None:
        """Forget every counter."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvoffConnectorStats:
        """Sums the counters of two reports.

        Raises:
            TypeError: when ``other`` is another connector's stats.
        """
        if not isinstance(other, KvoffConnectorStats):
            raise TypeError(f"cannot aggregate KvoffConnectorStats with {type(other).__name__}")
        merged = dict(self.data)
        for k, v in other.data.items():
            # a gauge is the newer report's (``other``), counters add up
            merged[k] = v if k in _GAUGE_NAMES else merged.get(k, 0) + v
        return KvoffConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        """The counters, and ``load_gbps`` / ``store_gbps``."""
        out: dict[str, int | float] = dict(self.data)
        for d in ("load", "store"):
            secs = self.data.get(f"{d}_seconds", 0.0)
            out[f"{d}_gbps"] = round(self.data.get(f"{d}_bytes", 0) / secs / 1e9, 3) if secs else 0
        return out

    def is_empty(self) -> bool:
        """Whether no counter moved (gauges alone are not news)."""
        return not any(v for k, v in self.data.items() if k not in _GAUGE_NAMES)


class KvoffPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters ``vllm:kvoff_<name>_total`` per engine, from
    :class:`KvoffConnectorStats` (hit tokens, lookups, jobs, blocks and bytes loaded and stored,
    evictions, refused stores, stale blocks skipped, flushes, failures, transfer seconds), and
    the CPU pool's usage gauges ``vllm:kvoff_cpu_cache_*usage_perc`` (:data:`_GAUGES`)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[tuple[int, str], Any] = {}
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        docs = dict(_COUNTERS) | dict(_configured_tier_counters(extra))
        docs["load_seconds"] = "Seconds spent loading (all ranks)"
        docs["store_seconds"] = "Seconds spent storing (all ranks)"
        for name, doc in docs.items():
            metric = self._counter_cls(
                name=f"vllm:kvoff_{name}", documentation=doc, labelnames=labelnames
            )
            for engine, values in per_engine_labelvalues.items():
                self._counters[(engine, name)] = metric.labels(*values)
        self._gauges: dict[tuple[int, str], Any] = {}
        for name, doc in _GAUGES:
            gauge = self._gauge_cls(
                name=f"vllm:kvoff_{name}", documentation=doc, labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )  # fmt: skip
            for engine, values in per_engine_labelvalues.items():
                self._gauges[(engine, name)] = gauge.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Adds one report's counters to the engine's Prometheus counters and sets its
        gauges."""
        for name, value in transfer_stats_data.items():
            gauge = self._gauges.get((engine_idx, name))
            if gauge is not None:
                gauge.set(value)
                continue
            counter = self._counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)


# --------------------------------------------------------------------------- the connector


class KvoffConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for kvoff (see the module docstring).

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
        self._config = _offloading_config(
            self._kv_transfer_config.kv_connector_extra_config, spec_path=False
        )
        self._spec = _cpu_spec(vllm_config, kv_cache_config, self._config)
        self._groups = len(kv_cache_config.kv_cache_groups)
        # A failed load is reported by its GPU blocks (vLLM recomputes from the first one) only
        # for one full-attention group: there every block before it holds valid KV. A window
        # or a Mamba state has null blocks before the loaded ones, so recomputing from there
        # would attend over them: the request is reported as failed instead (recomputed whole).
        self._block_level_load_errors = self._groups == 1 and group_kinds(self._spec)[0][0] == (
            "full_attention"
        )
        _check_tier_topology(vllm_config, self._config)
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._tier_seen: dict[str, int] = {}  # tier counters at the last stats call
        self._tier_version: Any = None  # TieredPool.stats_version() when they were read
        self._scheduler: OffloadingScheduler | None = None
        self._worker: OffloadingWorker | None = None
        self._job_requests: dict[int, str] = {}  # worker: load job -> request
        self._job_gpu_blocks: dict[int, tuple[int, ...]] = {}  # worker: load job -> blocks
        self._pending_meta = KvoffWorkerMetadata()
        self._flushed: list[Any] = []  # results taken by fences, reported with the next ones
        self._load_errors: set[int] = set()
        # scheduler: requests whose store is due at their finish, for the next step's metadata
        self._flushes_due: list[str] = []
        # counters: the scheduler's (COUNTER_NAMES), then bytes and seconds moved by the
        # workers; the values at the last get_kv_connector_stats
        self._transfer_totals = [0, 0, 0.0, 0.0]  # _TRANSFER_TOTALS
        self._totals_seen = [0, 0, 0.0, 0.0]  # their values at the last stats call
        self._totals_moved = False  # whether _transfer_totals moved since that call
        self._has_tiers = False  # whether tiers were attached (their counters are read then)
        self._counters_seen: tuple[int, ...] | None = None  # the scheduler's, likewise
        if role == KVConnectorRole.SCHEDULER:
            events = self._config.enable_events or bool(
                getattr(vllm_config, "kv_events_config", None)
                and vllm_config.kv_events_config.enable_kv_cache_events
            )
            self._scheduler = OffloadingScheduler(
                self._spec,
                enable_events=events,
                store_batch_blocks=self._config.store_batch_blocks,
                offload_prompt_only=self._config.offload_prompt_only,
                store_threshold=self._config.store_threshold,
                max_tracker_size=self._config.max_tracker_size,
            )
            if self._config.has_tiers:
                self._has_tiers = True
                _attach_tiers(
                    self._engine_id, self._scheduler, _tier_config(vllm_config, self._config),
                    vllm_config, self._spec,
                )  # fmt: skip
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning(
                    "kvoff: kv_load_failure_policy=%r fails a request whose load fails; set "
                    "kv_load_failure_policy='recompute' so that such tokens are recomputed",
                    self._kv_transfer_config.kv_load_failure_policy,
                )

    # ------------------------------------------------------------------ properties
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
        if self._scheduler is None:
            raise RuntimeError("KvoffConnector.scheduler exists in the scheduler role only")
        return self._scheduler

    @property
    def worker(self) -> OffloadingWorker:
        """kvoff's worker (worker role, after register_kv_caches).

        Raises:
            RuntimeError: in the scheduler role or before registration.
        """
        if self._worker is None:
            raise RuntimeError("KvoffConnector.worker exists in the worker role after "
                               "register_kv_caches")  # fmt: skip
        return self._worker

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
        if getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Builds the request's load job (``blocks``: the request's whole block table).

        Raises:
            ValueError: as :meth:`kvoff.OffloadingScheduler.update_state_after_alloc`
                (``num_external_tokens`` that is not what kvoff offered, block ids out of
                range).
        """
        table: Sequence[Sequence[int]] = ()  # nothing to load (the usual case): no table
        if num_external_tokens:
            table = blocks.get_block_ids(allow_none=True) or ((),) * self._groups
        self.scheduler.update_state_after_alloc(request, table, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvoffConnectorMetadata:
        """One step's loads, stores and fences (:class:`KvoffConnectorMetadata`)."""
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
            cached.resumed_req_ids,
            out.finished_req_ids,
            out.preempted_req_ids or (),
            [c.dst_block_id for c in copies] if copies else (),
            tail,
        )
        flushes: tuple[str, ...] = ()
        if self._flushes_due:  # stores due at requests' finish: emitted by this very step
            flushes, self._flushes_due = tuple(self._flushes_due), []
        return KvoffConnectorMetadata(packed, request_ids, tuple(flush), flushes)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Counts the ranks' job reports; jobs reported by every rank complete.

        Raises:
            TypeError: ``kv_connector_worker_meta`` that is not a :class:`KvoffWorkerMetadata`.
            ValueError: as :meth:`kvoff.OffloadingScheduler.update_connector_output_counts`
                (an unknown job, more reports than ranks); nothing is counted.
        """
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
        # OffloadingScheduler.request_finished_state's answer without its FinishState (bit 1:
        # a store is due): this hook runs for every request, about 2 per engine step
        if self.scheduler._finish(request) & 2:
            self._flushes_due.append(request.request_id)
            return True, None
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvoff's ``BlockStored`` / ``BlockRemoved`` events as vLLM's, medium ``"CPU"``, one
        per KV cache group: ``block_hashes`` are the engine's hashes of the last hash block of
        each offloaded block."""
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
        """The counters (:data:`_COUNTERS`) since the last call and the pool's usage gauges
        (:data:`_GAUGES`); ``None`` when no counter moved (the gauges did not either)."""
        if self._scheduler is None:
            return None
        data, self._counters_seen = self._scheduler.counters_delta(self._counters_seen)
        if data is not None:
            # the pool's pins change only with jobs, which move the counters: gauges are read
            # only then (about 0.2 µs)
            n, pinned, pending = self._scheduler.pool_usage()
            data["cpu_cache_usage_perc"] = pinned / n
            data["cpu_cache_write_usage_perc"] = pending / n
            data["cpu_cache_read_usage_perc"] = (pinned - pending) / n
        if self._totals_moved:  # (the engine calls this every step: the usual case is cheap)
            self._totals_moved = False
            totals, seen = self._transfer_totals, self._totals_seen
            data = data if data is not None else {}
            for name, v, w in zip(_TRANSFER_TOTALS, totals, seen, strict=True):
                if v != w:
                    data[name] = v - w
            self._totals_seen = list(totals)
        tiers = self._scheduler.tiers if self._has_tiers else None
        # the tiers' counters cost a few µs per tier and rank to read: only when they moved
        version = tiers.stats_version() if tiers is not None else None
        if tiers is not None and version != self._tier_version:
            self._tier_version = version
            now = _tier_totals(tiers)
            seen = self._tier_seen
            moved = {k: v - seen.get(k, 0) for k, v in now.items() if v != seen.get(k, 0)}
            if moved:
                data = {**(data or {}), **moved}
                self._tier_seen = now
        return None if data is None else KvoffConnectorStats(data=data)

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
        if self._scheduler is not None:
            dropped = self._scheduler.reset_cache()
            logger.info("kvoff: reset_cache dropped %d offloaded blocks", dropped)
        return True

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers the layers of kvoff's groups and allocates the CPU pool (pinned on a GPU)
        and, for a layer-major GPU cache, the staging buffer."""
        layers = {
            name for g in self._spec.kv_cache_config.kv_cache_groups for name in g.layer_names
        }
        # With tiers, the scheduler role reads and writes this pool: found in this process, or
        # mapped from shared memory when this worker runs in a process of its own.
        tiers = self._config.has_tiers
        shared = tiers and not _worker_in_engine_core(self._vllm_config)
        name = _pool_shm_name(self._engine_id, _worker_rank(self._vllm_config)) if shared else None
        worker = OffloadingWorker.from_spec(
            self._spec, config=self._config, shared_memory_name=name
        )
        worker.register_kv_caches({k: v for k, v in kv_caches.items() if k in layers})
        self._worker = worker
        if tiers and not shared:
            with _TIER_LOCK:
                _TIER_WORKERS[self._engine_id] = worker

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Waits for the jobs whose GPU blocks this step rewrites (fences) before the forward
        pass; their results are reported as usual."""
        if not isinstance(kv_connector_metadata, KvoffConnectorMetadata):
            return
        pending = self.worker.pending_jobs()
        flush = [j for j in kv_connector_metadata.jobs_to_flush if j in pending]
        if flush:
            self._flushed.extend(self.worker.wait(flush))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Submits this step's loads (asynchronous on a GPU; done on return on the CPU)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvoffConnectorMetadata)
        jobs = meta.load_jobs
        for job in jobs:
            self._job_requests[job.job_id] = job.request_id
            self._job_gpu_blocks[job.job_id] = job.gpu.block_ids
        if jobs:  # together: one copy per group for all of them (per-job results)
            self.worker.transfer_many_async([(j.job_id, j.src, j.dst) for j in jobs])

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
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvoffConnectorMetadata)
        jobs = meta.store_jobs
        if jobs:  # a step's stores together: one copy per group (per-job results)
            self.worker.transfer_many_async([(j.job_id, j.src, j.dst) for j in jobs])

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished jobs: loads become ``finished_recving`` (failed ones also
        ``failed_recving`` unless the model is one full-attention group, whose failed GPU blocks
        go to :meth:`get_block_ids_with_load_errors`); every job goes into the worker
        metadata."""
        results = KVConnectorTransferResults()
        step = getattr(self, "_connector_metadata", None)  # this step's (bound until cleared)
        if isinstance(step, KvoffConnectorMetadata) and step.finished_flushes:
            # their stores are this step's jobs: vLLM may free their blocks now
            results.finished_sending.update(step.finished_flushes)
        finished, self._flushed = [*self._flushed, *self.worker.get_finished()], []
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
        """GPU blocks of loads that failed since the last call (a model of one full-attention
        KV cache group; other models report the request in ``failed_recving``)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KvoffWorkerMetadata | None:
        """This rank's job reports since the last call (``None`` when there are none)."""
        meta = self._pending_meta
        if not meta.reports:
            return None
        self._pending_meta = KvoffWorkerMetadata()
        return meta

    def shutdown(self) -> None:
        """Waits for the jobs in flight (and the secondary tiers' reads and writes) and
        releases the pinned pool. Idempotent."""
        if self._config.has_tiers:
            _close_tiers(self._engine_id)  # the tiers read the pool: they stop first
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
            with _TIER_LOCK:
                if _TIER_WORKERS.get(self._engine_id) is self._worker:
                    del _TIER_WORKERS[self._engine_id]


# --------------------------------------------------------- vLLM's OffloadingConnector, kvoff inside


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
    num_evictable_blocks = num_retired_blocks = 0
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
        if num_blocks > 0:
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
        self._settled: dict[OffloadKey, int] = {}  # asked, answered, not promoted -> step
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
            del settled[first]
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
        state = {k: manager.lookup([k]) for k in keys if k not in new}  # 1, 0 or None
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
          tiers; 0.0 with 0 blocks), ``..._write_usage_perc`` the stores' share,
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
        # pending stores, loads, and blocks the tiers' write-through reads
        pinned = n - m.num_free_blocks - m.num_evictable_blocks
        usage = pinned / n if n > 0 else 0.0
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
            now, seen = _tier_totals(tiers), self._tier_seen
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

    Raises:
        ValueError: what :meth:`kvoff.OffloadingWorker.register_kv_caches` raises.
        kvoff.pinned.SharedMemoryError: the shared pool cannot be allocated.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        num_cpu_blocks: int,
        blocks_per_chunk: int,
        config: OffloadingConfig,
        *,
        shared_memory_name: str | None = None,
    ) -> None:
        num_gpu_blocks = kv_caches.tensors[0].tensor.shape[0]
        options = config.worker_options()
        self.worker = OffloadingWorker(
            num_gpu_blocks, num_cpu_blocks, blocks_per_chunk, **options,
            shared_memory_name=shared_memory_name,
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
        """Blocks until the jobs finished; their results still come from :meth:`get_finished`."""
        pending = self.worker.pending_jobs()
        ids = [j for j in job_ids if j in pending]
        if ids:
            self._done.extend(self._result(r) for r in self.worker.wait(ids))

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
    (:meth:`KvoffOffloadingManager.attach_tiers`, :func:`_tiers_on_pools`). The blocks carry a
    fingerprint of this path's layout (:func:`_spec_fingerprint`), distinct from
    :class:`KvoffConnector`'s: the two ways in lay a CPU slot out differently and never serve
    each other's blocks. The tiers' counters are Prometheus counters ``vllm:kvoff_<name>``
    (:meth:`build_metric_definitions`).

    Raises:
        kvoff.config.ConfigError, ValueError: as :class:`KvoffConnector`.
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
        the tiers ``extra_config`` configures (:func:`_configured_tier_counters`).
        :meth:`KvoffOffloadingManager.get_stats` reports them."""
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata
        from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VllmCPUOffloadingSpec

        return VllmCPUOffloadingSpec.build_metric_definitions(extra_config) | {
            f"vllm:kvoff_{name}": OffloadingCounterMetadata(documentation=doc)
            for name, doc in _configured_tier_counters(extra_config)
        }

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.kvoff_config = _offloading_config(self.extra_config, spec_path=True)
        self.num_cpu_blocks = compute_num_cpu_blocks(
            _require_bytes(self.kvoff_config),
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

    def _shm_name(self, rank: int) -> str:
        return _pool_shm_name(str(self.config.engine_id), rank)

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
            )
            if config.has_tiers and self.num_cpu_blocks > 0:
                self._attach_tiers(manager)
            self._manager = manager
        return self._manager

    def _attach_tiers(self, manager: KvoffOffloadingManager) -> None:
        par = self.config.parallel
        world = int(par.world_size)
        views = _shared_pool_views(str(self.config.engine_id), world, self.num_cpu_blocks)
        config = self.kvoff_config
        if config.disk_path is not None and int(par.data_parallel_size) > 1:
            # each data-parallel rank is an engine of its own; a disk tier serves one process
            dp = f"dp{int(par.data_parallel_index)}"
            config = config.model_copy(update={"disk_path": config.disk_path / dp})
        tiers, slot = _tiers_on_pools(config, views, lambda r: _spec_fingerprint(self.config, r))
        _attach_or_close(manager.attach_tiers, tiers, slot, config)
        logger.info("kvoff: tiers %s below the CPU pool of engine %s (OffloadingConnector, %d "
                    "rank(s))", [t.name for t in tiers], self.config.engine_id, world)  # fmt: skip

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KvoffOffloadingWorker:
        """The worker side (made once): kvoff's worker on vLLM's canonical KV caches; with
        tiers, its CPU pool is in shared memory for the scheduler's tiers.

        Raises:
            kvoff.pinned.SharedMemoryError: ``/dev/shm`` cannot hold the pool (with tiers).
        """
        if self._worker is None:
            name = (
                self._shm_name(int(self.config.parallel.rank))
                if self.kvoff_config.has_tiers
                else None
            )
            self._worker = KvoffOffloadingWorker(
                kv_caches, self.num_cpu_blocks, self.blocks_per_chunk, self.kvoff_config,
                shared_memory_name=name,
            )  # fmt: skip
        return self._worker


def _spec_fingerprint(config: Any, rank: int) -> bytes:
    """What must match for a block stored through :class:`KvoffOffloadingSpec` to be usable by
    this engine (:func:`kvoff.tiers.layout_fingerprint` of vLLM's ``OffloadingConfig``): the
    model and KV dtype, the offloaded groups (tokens per block, layers), tokens per hash,
    blocks per chunk, bytes per block, the KV cache layout, the parallel sizes and the rank.
    vLLM's ``OffloadingConfig`` has no model revision: a model name (or path) whose weights
    change must not share a disk path or Redis namespace with the old weights' blocks."""
    from kvoff.tiers.block_format import layout_fingerprint

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
