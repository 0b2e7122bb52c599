"""kvoff's numbers in vLLM's metrics: the counter and gauge names with their documentation,
:class:`KvoffConnectorStats` (KvoffConnector's counters between reports), :class:`KvoffPromMetrics`
(its Prometheus counters and gauges), and the secondary tiers' counters both ways in report
(:func:`tier_totals`, :func:`configured_tier_counters`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "TRANSFER_TOTALS",
    "KvoffConnectorStats",
    "KvoffPromMetrics",
    "configured_tier_counters",
    "tier_totals",
]

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
    ("jobs_flushed", "In-flight jobs the forward pass waited on: their GPU blocks were reused"),
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
            ("unauthenticated_blocks", "blocks without a valid MAC (shared_secret; never served)"),
            ("fingerprint_mismatches", "blocks of another model or layout seen, not served"),
            ("timeouts", "operations that ran into the tier's timeout"),
            ("io_errors", "I/O or connection errors (each a miss or a dropped write)"),
            ("blocks_cleared", "blocks a cache reset dropped from the tier"),
            ("writes_dropped_reset", "writes in flight at a cache reset, dropped unwritten"),
        )
    ),
)


def configured_tier_counters(extra: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
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
TRANSFER_TOTALS = ("load_bytes", "store_bytes", "load_seconds", "store_seconds")


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
        docs = dict(_COUNTERS) | dict(configured_tier_counters(extra))
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


def tier_totals(tiers: Any) -> dict[str, int]:
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
                    "writes_dropped", "corrupted_blocks", "unauthenticated_blocks",
                    "fingerprint_mismatches", "timeouts",
                    "io_errors", "blocks_cleared", "writes_dropped_reset"):  # fmt: skip
            out[f"{name}_{key}"] = int(c.get(key, 0))
    return out
