"""One secondary tier over the ranks of a tensor- or pipeline-parallel engine.

Every rank of such an engine holds its own part of each offloaded block (its KV heads, or its
layers) in its own CPU pool, and stores it under its own fingerprint (the fingerprint covers
the rank): rank ``r``'s part lives in rank ``r``'s tier (its own disk folder, or its own key
space in a shared Redis Cluster). kvoff's scheduler keeps one block per offload key across all
ranks, so :class:`RankedTier` makes the ranks' tiers of one kind look like one tier whose block
is the tuple of the ranks' parts:

* ``contains``: held when every rank holds its part;
* ``get``: served when every rank's part is served (a block one rank misses is a miss: the
  engine recomputes it on every rank);
* ``put``: stored when every rank stored its part (a part stored on some ranks only is harmless:
  it is never served alone);
* ``stats``: the ranks' counters summed.

The ranks' calls run in parallel, one thread per rank (a rank's part is 1/world_size of the
block, so one rank after another would pay each call's latency world_size times); the calling
thread waits for all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvoff.tiers.base import CallGate, SecondaryTier, byte_view, check_batch, run_all
from kvoff.tiers.block_format import BlockFormat

__all__ = ["RankedTier"]

_T = TypeVar("_T")


class RankedTier(SecondaryTier):
    """The per-rank tiers of one kind (all disk, or all remote) as one tier.

    Args:
        ranks: rank ``r``'s tier at position ``r``; all of one name (``"disk"`` or
            ``"remote"``), each with its rank's fingerprint and payload size.

    Attributes:
        name: the ranks' tier name.
        fmt: rank 0's fingerprint with the ranks' payload sizes summed (bytes of one block
            across all ranks; used for byte counters).
        ranks: the per-rank tiers.

    Raises:
        ValueError: no ranks, ranks of different names, the same tier object at two ranks, or
            two ranks with one fingerprint (their parts would be stored under one key, and one
            rank's part served as another's). Nothing is started or closed then.
    """

    def __init__(self, ranks: Sequence[SecondaryTier]) -> None:
        if not ranks:
            raise ValueError("RankedTier needs the tier of at least one rank")
        names = {t.name for t in ranks}
        if len(names) != 1:
            raise ValueError(f"the ranks' tiers must be of one kind, got names {sorted(names)}")
        seen: dict[int, int] = {}
        for r, t in enumerate(ranks):
            if id(t) in seen:
                raise ValueError(
                    f"ranks {seen[id(t)]} and {r} are the same tier object; give each rank a "
                    f"tier of its own, made with its rank's fingerprint "
                    f"(BlockFormat(layout_fingerprint(..., rank={r}), ...))"
                )
            seen[id(t)] = r
        fingerprints: dict[bytes, int] = {}
        for r, t in enumerate(ranks):
            fp = t.fmt.fingerprint
            if fp in fingerprints:
                raise ValueError(
                    f"ranks {fingerprints[fp]} and {r} share the fingerprint {fp.hex()}: their "
                    f"parts would be stored under one key and one rank's part served as the "
                    f"other's; make each rank's fingerprint with its rank, "
                    f"layout_fingerprint(..., rank=r) (rank={r} here)"
                )
            fingerprints[fp] = r
        self.ranks = list(ranks)
        self.name = ranks[0].name
        self.fmt = BlockFormat(
            ranks[0].fmt.fingerprint,
            sum(t.fmt.payload_bytes for t in ranks),
            shared_secret=ranks[0].fmt.shared_secret,
        )
        self._threads = ThreadPoolExecutor(len(ranks), thread_name_prefix=f"kvoff-{self.name}-rank")
        self._gate = CallGate(threading.Lock())  # calls on the rank threads (close waits)

    def _each(self, call: Callable[[int, SecondaryTier], _T]) -> list[_T]:
        """``call(r, tier)`` for every rank, in parallel; results in rank order (the first
        exception, if any, is raised after all finished). Once closed, the rank threads are gone
        and the ranks' tiers are closed: each rank is called in turn on this thread and answers
        misses itself (and counts them), as a closed tier does."""
        if len(self.ranks) == 1:
            return [call(0, self.ranks[0])]
        if not self._gate.enter():
            return [call(r, t) for r, t in enumerate(self.ranks)]
        try:
            return run_all(self._threads, call, list(enumerate(self.ranks)))
        finally:
            self._gate.exit()

    def _parts(self, bufs: Sequence[Any], what: str, *, writable: bool) -> list[list[Any]]:
        """Per rank, the part of each block (``bufs[i]``: one array per rank), every part
        checked before any rank is called, so that a bad argument changes nothing.

        Raises:
            ValueError: an entry that is not one array per rank, or a part that is not a
                C-contiguous array of its rank's ``payload_bytes`` (writable for reads).
        """
        for b in bufs:
            if not isinstance(b, (tuple, list)) or len(b) != len(self.ranks):
                raise ValueError(
                    f"each of the {what} must be a tuple of {len(self.ranks)} arrays (one per "
                    f"rank), got {type(b).__name__}"
                )
            for r, (tier, arr) in enumerate(zip(self.ranks, b, strict=True)):
                byte_view(arr, tier.fmt.payload_bytes, f"rank {r}'s part", writable=writable)
        return [[b[r] for b in bufs] for r in range(len(self.ranks))]

    def _all_ranks(
        self, keys: Sequence[bytes], bufs: Sequence[Any], what: str, write: bool
    ) -> list[bool]:
        """Every rank's ``get`` (``write`` False) or ``put`` of its parts; True per key where
        every rank answered True."""
        check_batch(keys, bufs, what)
        parts = self._parts(bufs, what, writable=not write)
        if write:
            answers = self._each(lambda r, t: t.put(keys, parts[r]))
        else:
            answers = self._each(lambda r, t: t.get(keys, parts[r]))
        return [all(a[i] for a in answers) for i in range(len(keys))]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """True where every rank's tier holds its part of the block (``contains`` of each); all
        False once closed.

        Raises:
            ValueError: a key that is not bytes of 1..64 (nothing is looked up).
            TypeError: ``keys`` is not a list or tuple (a single key, None).
        """
        check_batch(keys)
        answers = self._each(lambda r, t: t.contains(keys))
        return [all(a[i] for a in answers) for i in range(len(keys))]

    def get(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        """Reads each rank's part into its array of ``outs[i]`` (a tuple of one writable uint8
        array of that rank's ``payload_bytes`` per rank); True where every part was served; all
        False once closed.

        Raises:
            ValueError: an ``outs`` entry that is not one array per rank, or of the wrong size.
        """
        return self._all_ranks(keys, outs, "outs", write=False)

    def put(self, keys: Sequence[bytes], payloads: Sequence[Any]) -> list[bool]:
        """Writes each rank's part (``payloads[i]``: a tuple of one array per rank); True where
        every rank stored its part; all False (dropped) once closed.

        Raises:
            ValueError: a ``payloads`` entry that is not one array per rank, or of the wrong size.
        """
        return self._all_ranks(keys, payloads, "payloads", write=True)

    def evict(self, keys: Sequence[bytes]) -> int:
        """Removes every rank's part; returns how many keys rank 0 held (0 once closed).

        Raises:
            ValueError: a key that is not bytes of 1..64 (nothing is removed).
            TypeError: ``keys`` is not a list or tuple (a single key, None).
        """
        check_batch(keys)
        return self._each(lambda r, t: t.evict(keys))[0]

    def clear(self) -> int:
        """Clears every rank's tier (:meth:`SecondaryTier.clear`); returns rank 0's count (0
        once closed)."""
        return self._each(lambda r, t: t.clear())[0]

    def stats(self) -> dict[str, int | float]:
        """The ranks' counters summed (gauges such as ``blocks`` too: parts held, all ranks)."""
        out: dict[str, int | float] = {}
        for t in self.ranks:
            for k, v in t.stats().items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        """Waits for the calls in flight, then closes every rank's tier and the rank threads;
        later calls answer misses. Idempotent."""
        self._gate.close()  # calls from now on go to the closed ranks: misses
        for t in self.ranks:
            t.close()
        self._threads.shutdown(wait=True)
