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


The package (one job per module; this ``__init__`` only re-exports the public names, the
paths vLLM loads stay ``kvoff.integrations.vllm``):

* :mod:`.connector`: :class:`KvoffConnector`, vLLM's connector API as a thin facade over the
  scheduler role (:mod:`.scheduler_role`, :class:`KvoffConnectorScheduler`) and the worker
  role (:mod:`.worker_role`, :class:`KvoffConnectorWorker`);
* :mod:`.metadata`: what crosses between the roles each step; :mod:`.metrics`: stats and
  Prometheus metrics;
* :mod:`.spec` (:class:`KvoffOffloadingSpec`, :class:`KvoffOffloadingWorker`) and
  :mod:`.spec_manager` (:class:`KvoffOffloadingManager`): the ``OffloadingConnector`` way in;
* :mod:`.translate`: vLLM's KV cache specs and ``kv_connector_extra_config`` in kvoff's terms;
* :mod:`.tier_wiring`: the secondary tiers from vLLM's configuration, on
  :mod:`kvoff.tiers.engine_tiers` (shared pools, one tier per rank).
"""

from __future__ import annotations

from kvoff._optional import extra_imports

# without vLLM: one line naming the extra to install, not a traceback
with extra_imports("vllm", "kvoff.integrations.vllm"):
    from kvoff.integrations.vllm.connector import KvoffConnector
    from kvoff.integrations.vllm.metadata import KvoffConnectorMetadata, KvoffWorkerMetadata
    from kvoff.integrations.vllm.metrics import KvoffConnectorStats, KvoffPromMetrics
    from kvoff.integrations.vllm.scheduler_role import KvoffConnectorScheduler
    from kvoff.integrations.vllm.spec import KvoffOffloadingSpec, KvoffOffloadingWorker
    from kvoff.integrations.vllm.spec_manager import (
        SETTLED_STEPS,
        KvoffCPUBlocks,
        KvoffOffloadingManager,
    )
    from kvoff.integrations.vllm.translate import VLLM_SPEC_KEYS, kvoff_kv_cache_config
    from kvoff.integrations.vllm.versions import VLLM_TESTED_VERSIONS
    from kvoff.integrations.vllm.worker_role import KvoffConnectorWorker

__all__ = [
    "SETTLED_STEPS",
    "VLLM_SPEC_KEYS",
    "VLLM_TESTED_VERSIONS",
    "KvoffCPUBlocks",
    "KvoffConnector",
    "KvoffConnectorMetadata",
    "KvoffConnectorScheduler",
    "KvoffConnectorStats",
    "KvoffConnectorWorker",
    "KvoffOffloadingManager",
    "KvoffOffloadingSpec",
    "KvoffOffloadingWorker",
    "KvoffPromMetrics",
    "KvoffWorkerMetadata",
    "kvoff_kv_cache_config",
]
