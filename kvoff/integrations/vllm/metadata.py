"""What crosses between KvoffConnector's roles each step: :class:`KvoffConnectorMetadata`
(the scheduler role's jobs and fences for every worker) and :class:`KvoffWorkerMetadata` (one
rank's job reports, summed over ranks by vLLM before the scheduler role counts them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvoff.scheduler import OffloadingScheduler, TransferJob

__all__ = ["KvoffConnectorMetadata", "KvoffWorkerMetadata"]

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
        refused_loads: requests whose hit the node pool could not pin once vLLM had allocated
            their blocks (the pool went away in between): every worker reports them as failed
            loads (``finished_recving`` and ``failed_recving``), and vLLM recomputes them.
    """

    packed_jobs: bytes = _NO_JOBS
    request_ids: tuple[str, ...] = ()
    jobs_to_flush: tuple[int, ...] = ()
    finished_flushes: tuple[str, ...] = ()
    refused_loads: tuple[str, ...] = ()

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
