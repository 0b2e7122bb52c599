"""The secondary tiers below a node pool (``kvoff pool serve --disk-path ... --remote-url ...``).

The pool writes every block its engines store through to them and promotes what they hold back
into its slots (:mod:`kvoff.node_pool.server`, "Tiers"). Their blocks carry the pool's format
(:func:`tier_format`): the keys already hold the engines' layout prefixes, so the fingerprint
names the pool's slot size (and, with several ranks, the rank) only.

**Several ranks** (``--ranks N``, a tensor-parallel engine's pool): slot ``i`` of every rank's
region holds that rank's part of one block. Each rank's parts go to tiers of their own, as a
private pool's ranks do (:func:`kvoff.tiers.engine_tiers.tiers_on_pools`): a disk folder
``<disk_path>/rank<r>`` of ``disk_bytes / N`` bytes, and Redis keys under the rank's
fingerprint; a block is a hit only when every rank's part is
(:class:`kvoff.tiers.ranked.RankedTier`).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["pool_tiers", "tier_format"]


def tier_format(
    slot_bytes: int, shared_secret: bytes | None = None, rank: int | None = None
) -> Any:
    """The block format of a node pool's secondary tiers: blocks of ``slot_bytes`` bytes (one
    rank's part of a block) whose keys carry the engines' layout prefixes, so the fingerprint
    names the pool's slot size only, and ``rank`` for a pool of several ranks (None: a pool of
    one rank, whose fingerprint has no rank) (:class:`kvoff.tiers.block_format.BlockFormat`;
    ``shared_secret``: the MAC key).

    Raises:
        ValueError: as :class:`~kvoff.tiers.block_format.BlockFormat`.
    """
    from kvoff.tiers.block_format import BlockFormat, layout_fingerprint

    fields: dict[str, Any] = {"kind": "kvoff node pool", "slot_bytes": int(slot_bytes)}
    if rank is not None:
        fields["rank"] = int(rank)
    return BlockFormat(layout_fingerprint(**fields), int(slot_bytes), shared_secret=shared_secret)


def pool_tiers(
    slot_bytes: int,
    ranks: int = 1,
    *,
    disk_path: str | os.PathLike[str] | None = None,
    disk_bytes: int | None = None,
    remote_url: str | None = None,
    remote_namespace: str = "kvoff",
    shared_secret: bytes | None = None,
) -> list[Any]:
    """The tiers below a node pool of ``ranks`` regions of ``slot_bytes``-byte slots, fastest
    first (:func:`kvoff.tiers.coordinator.make_tiers`): with one rank the tiers themselves,
    with several one :class:`~kvoff.tiers.ranked.RankedTier` per kind over the ranks' own
    tiers (module docstring). Empty when neither ``disk_path`` nor ``remote_url`` is given.

    Args:
        slot_bytes: bytes of one slot (one rank's part of a block).
        ranks: the pool's tensor-parallel ranks (>= 1).
        disk_path, disk_bytes: the disk tier's folder and size in bytes (the whole tier's:
            each of several ranks gets ``disk_bytes // ranks`` in ``<disk_path>/rank<r>``).
        remote_url, remote_namespace: the Redis Cluster tier.
        shared_secret: the key of the blocks' MAC (bytes, >= 16; None: no MAC).

    Raises:
        ValueError / OSError: what the tiers' constructors raise (a disk path that cannot be
            made or sized, a bad URL or namespace, a short secret), or a disk share smaller
            than one block of a rank; the tiers already made are closed first.
    """
    from kvoff.tiers.coordinator import make_tiers
    from kvoff.tiers.engine_tiers import tiers_per_rank

    if ranks < 1:
        raise ValueError(f"ranks must be >= 1 (the pool's tensor-parallel ranks), got {ranks}")

    def make(fmt: Any, path: Any, nbytes: int | None) -> list[Any]:
        return make_tiers(
            fmt, disk_path=path, disk_bytes=nbytes, remote_url=remote_url,
            remote_namespace=remote_namespace, shared_secret=shared_secret,
        )  # fmt: skip

    return tiers_per_rank(
        ranks,
        lambda r: tier_format(slot_bytes, rank=None if ranks == 1 else r),
        make,
        disk_path,
        disk_bytes,
    )
