"""Secondary tiers below kvoff's CPU pool (L1): a local disk tier and a shared Redis Cluster tier.

* :mod:`kvoff.tiers.block_format`: the header every stored block carries (magic, version,
  layout fingerprint, key, length, xxh3 checksum; with a ``shared_secret``, an HMAC-SHA256 over
  header, key and payload) and :func:`layout_fingerprint`.
* :mod:`kvoff.tiers.base`: :class:`SecondaryTier`, the interface (batched, thread-safe, never
  raising for I/O conditions).
* :mod:`kvoff.tiers.disk`: :class:`DiskTier`, slots in one preallocated file, O_DIRECT, LRU,
  index rebuilt from the headers after a restart.
* :mod:`kvoff.tiers.coordinator`: :class:`TieredPool`, the CPU pool (L1) with tiers below it:
  asynchronous promotion on L1 misses and bounded write-through.
* :mod:`kvoff.tiers.redis_cluster`: :class:`RedisClusterTier` on redis-py's cluster client, and
  :class:`LocalRedisCluster`, a throwaway localhost cluster for tests and benchmarks.

``redis`` is imported only when :mod:`kvoff.tiers.redis_cluster` is.
"""

from __future__ import annotations

from kvoff.tiers.base import STAT_KEYS, SecondaryTier
from kvoff.tiers.block_format import (
    HEADER_BYTES,
    BlockFormat,
    check_block,
    encode_header,
    layout_fingerprint,
)
from kvoff.tiers.coordinator import TieredPool
from kvoff.tiers.disk import DiskTier

__all__ = [
    "HEADER_BYTES",
    "STAT_KEYS",
    "BlockFormat",
    "DiskTier",
    "SecondaryTier",
    "TieredPool",
    "check_block",
    "encode_header",
    "layout_fingerprint",
]
