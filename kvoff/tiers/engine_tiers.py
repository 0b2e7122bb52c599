"""Secondary tiers on an engine's CPU pools: the engine-independent wiring between the workers
that own the CPU pools and the scheduler side that drives the tiers.

The secondary tiers read and write the CPU pool, which the worker role allocates; the
scheduler role drives them. Two ways for the scheduler to reach the pool:

- in one process (one rank, the worker inside the engine core), the roles meet in this
  module's registry, by the engine's id (:func:`register_worker`, :func:`registered_worker`);
- with workers in processes of their own (one or more ranks), each rank's worker puts its pool
  in POSIX shared memory under a name made of the engine id and the rank
  (:func:`pool_shm_name`), and the scheduler maps every rank's pool
  (:func:`shared_pool_views`, on :class:`kvoff.pinned.SharedHostPool`).

On those pools :func:`tiers_on_pools` builds the configured tiers, one per rank for several
ranks (:class:`kvoff.tiers.ranked.RankedTier`), and :func:`attach_or_close` attaches them. An
engine's integration (e.g. :mod:`kvoff.integrations.vllm`) reads its own configuration and
calls these.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvoff.tiers.block_format import BlockFormat
from kvoff.tiers.coordinator import tiers_from_config
from kvoff.tiers.disk import SUPERBLOCK_BYTES, slot_bytes_for
from kvoff.tiers.ranked import RankedTier

if TYPE_CHECKING:
    from kvoff.config import OffloadingConfig

__all__ = [
    "attach_or_close",
    "close_tiers",
    "data_parallel_config",
    "pool_shm_name",
    "register_tiered",
    "register_worker",
    "registered_worker",
    "shared_pool_views",
    "tiers_on_pools",
    "unregister_worker",
]


class Closeable(Protocol):
    """What drives an engine's tiers (e.g. :class:`kvoff.OffloadingScheduler`): ``close()``
    waits for the tiers' reads and writes and closes them."""

    def close(self) -> None: ...


_TIER_LOCK = threading.Lock()
_TIER_WORKERS: dict[str, Any] = {}  # engine id -> its worker (the CPU pool), one process
_TIER_SCHEDULERS: dict[str, Closeable] = {}  # engine id -> what drives its tiers


def register_worker(engine_id: str, worker: Any) -> None:
    """Makes ``worker`` (a :class:`kvoff.OffloadingWorker`, whose ``cpu_pool`` the tiers use)
    the CPU pool of engine ``engine_id`` in this process."""
    with _TIER_LOCK:
        _TIER_WORKERS[engine_id] = worker


def registered_worker(engine_id: str) -> Any | None:
    """The worker :func:`register_worker` registered for engine ``engine_id`` in this
    process, or None."""
    with _TIER_LOCK:
        return _TIER_WORKERS.get(engine_id)


def unregister_worker(engine_id: str, worker: Any) -> None:
    """Forgets engine ``engine_id``'s worker if it is ``worker`` (a newer one is kept)."""
    with _TIER_LOCK:
        if _TIER_WORKERS.get(engine_id) is worker:
            del _TIER_WORKERS[engine_id]


def register_tiered(engine_id: str, owner: Closeable) -> None:
    """Records ``owner`` as what drives engine ``engine_id``'s tiers, for
    :func:`close_tiers`."""
    with _TIER_LOCK:
        _TIER_SCHEDULERS[engine_id] = owner


def close_tiers(engine_id: str) -> None:
    """Waits for the engine's tier work and closes its tiers (before its CPU pool goes)."""
    with _TIER_LOCK:
        scheduler = _TIER_SCHEDULERS.pop(engine_id, None)
    if scheduler is not None:
        scheduler.close()


def pool_shm_name(engine_id: str, rank: int) -> str:
    """The shared-memory name of rank ``rank``'s CPU pool of engine ``engine_id`` (a file in
    /dev/shm; vLLM's engine ids are UUIDs, with ``_dp<rank>`` for data-parallel engines)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine_id)
    if len(safe) > 120:  # keep the name a file name; the hash keeps long ids apart
        safe = safe[:100] + "-" + hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return f"kvoff-pool-{safe}-r{rank}"


def data_parallel_config(
    config: OffloadingConfig, data_parallel_size: int, data_parallel_rank: int
) -> OffloadingConfig:
    """``config`` with the disk tier in ``disk_path/dp<rank>`` for a data-parallel engine: each
    data-parallel rank is an engine of its own, and a disk tier's file serves one process.
    ``config`` itself without a disk tier or data parallelism."""
    if config.disk_path is None or data_parallel_size <= 1:
        return config
    return config.model_copy(update={"disk_path": config.disk_path / f"dp{data_parallel_rank}"})


def tiers_on_pools(
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

    def make(fmt: BlockFormat, disk_path: Any, disk_bytes: int | None) -> list[Any]:
        update = {"disk_path": disk_path, "disk_bytes": disk_bytes}
        return tiers_from_config(config.model_copy(update=update), fmt)

    tiers = tiers_per_rank(
        len(views),
        lambda r: BlockFormat(fingerprint(r), int(views[r].shape[1])),
        make,
        config.disk_path,
        config.disk_bytes,
    )
    return tiers, rank_slots(views)


def rank_slots(views: Sequence[Any]) -> Callable[[int], Any]:
    """The slot function of :class:`kvoff.tiers.coordinator.TieredPool` over the ranks' CPU
    pools ``views`` (rank ``r``'s ``(num_blocks, slot_bytes)`` uint8 array at position ``r``):
    block id -> the slot's row with one rank, else the tuple of every rank's row (what a
    :class:`~kvoff.tiers.ranked.RankedTier` reads and writes)."""
    if len(views) == 1:
        return views[0].__getitem__

    def slot(block_id: int) -> tuple[Any, ...]:
        return tuple(v[block_id] for v in views)

    return slot


def tiers_per_rank(
    ranks: int,
    fmt_of: Callable[[int], BlockFormat],
    make: Callable[[BlockFormat, Any, int | None], list[Any]],
    disk_path: Any,
    disk_bytes: int | None,
) -> list[Any]:
    """The secondary tiers of a CPU pool of ``ranks`` tensor-parallel ranks, for a private
    pool (:func:`tiers_on_pools`) and a node pool (:mod:`kvoff.node_pool.pool_tiers`) alike.
    One rank: ``make(fmt_of(0), disk_path, disk_bytes)``. Several: rank ``r``'s own tiers are
    ``make(fmt_of(r), disk_path/rank<r>, disk_bytes // ranks)`` (:func:`disk_share`), one
    :class:`~kvoff.tiers.ranked.RankedTier` per kind over them (:func:`ranked_tiers`).

    Args:
        ranks: the pool's ranks (>= 1).
        fmt_of: rank -> the block format of its part of a block.
        make: (format, disk folder or None, disk bytes or None) -> that rank's tiers, fastest
            first.
        disk_path, disk_bytes: the whole disk tier's folder (a path or str; None: no disk
            tier) and its size in bytes.

    Raises:
        ValueError / OSError: what ``make`` raises, or a disk share smaller than one block of
            a rank; the tiers already made are closed first.
    """
    if ranks == 1:
        return make(fmt_of(0), disk_path, disk_bytes)

    def rank_tiers(r: int) -> list[Any]:
        fmt = fmt_of(r)
        if disk_path is None:
            return make(fmt, None, disk_bytes)
        path, share = disk_share(disk_path, disk_bytes, ranks, r, fmt)
        return make(fmt, path, share)

    return ranked_tiers(ranks, rank_tiers)


def disk_share(
    disk_path: Any, disk_bytes: int | None, world: int, rank: int, fmt: BlockFormat
) -> tuple[Path, int]:
    """Rank ``rank``'s disk tier of a ``world``-rank pool: its folder ``disk_path/rank<r>`` and
    its share of ``disk_bytes`` (``disk_bytes // world`` bytes).

    Raises:
        ValueError: the share holds no block of ``fmt`` (the message gives the bytes needed).
    """
    share = max(1, (disk_bytes or 0) // world)
    need = SUPERBLOCK_BYTES + slot_bytes_for(fmt)
    if share < need:
        raise ValueError(
            f"disk_bytes={disk_bytes} is split over {world} ranks ({share} bytes each), less "
            f"than one block of rank {rank} ({need} bytes with the file header); raise "
            f"disk_bytes to at least {need * world} (a useful tier holds many blocks)"
        )
    return Path(disk_path) / f"rank{rank}", share


def ranked_tiers(world: int, rank_tiers: Callable[[int], list[Any]]) -> list[Any]:
    """One :class:`~kvoff.tiers.ranked.RankedTier` per kind over the ``world`` ranks' own
    tiers (``rank_tiers(r)``: rank ``r``'s, fastest first, the same kinds for every rank).

    Raises:
        ValueError / OSError: what ``rank_tiers`` raises; the tiers already made are closed.
    """
    per_rank: list[list[Any]] = []
    try:
        for r in range(world):
            per_rank.append(rank_tiers(r))
    except BaseException:
        for ts in per_rank:
            for t in ts:
                t.close()
        raise
    return [RankedTier([ts[i] for ts in per_rank]) for i in range(len(per_rank[0]))]


def attach_or_close(
    attach: Callable[..., Any], tiers: list[Any], slot: Callable[[int], Any], config: Any
) -> None:
    """``attach(tiers, slot, write_queue_blocks=...)``; the tiers are closed if it raises."""
    try:
        attach(tiers, slot, write_queue_blocks=config.tier_write_queue_blocks)
    except BaseException:
        for t in tiers:
            t.close()
        raise


def shared_pool_views(engine_id: str, world: int, num_blocks: int) -> list[Any]:
    """Every rank's CPU pool of engine ``engine_id``, mapped from shared memory
    (:func:`pool_shm_name`), as ``(num_blocks, slot_bytes)`` uint8 arrays.

    Raises:
        kvoff.pinned.SharedMemoryError: a rank's pool is missing (a worker on another machine)
            or unreadable.
        RuntimeError: a rank's pool has another block count than ``num_blocks``.
    """
    from kvoff.pinned import SharedHostPool  # torch, loaded only when a scheduler maps pools

    pools = [SharedHostPool(pool_shm_name(engine_id, r)).tensors[0] for r in range(world)]
    for r, pool in enumerate(pools):
        if pool.shape[0] != num_blocks:
            raise RuntimeError(
                f"rank {r}'s shared CPU pool has {pool.shape[0]} blocks, the scheduler "
                f"plans {num_blocks}; the ranks must use one kvoff configuration"
            )
    return [p.numpy() for p in pools]
