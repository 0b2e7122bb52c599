"""What an engine's :class:`kvoff.node_pool.NodePoolClient` knows of the pool between round
trips: the look-ahead's answers (:class:`KeptAnswers`) and the leases of ready keys the pool
gave this connection (:class:`Leases`).

Both hold this engine's keys unprefixed (the pool's replies carry prefixed keys: 8 bytes of the
engine's layout fingerprint, then the key; replies' keys of another prefix are other engines'
and are skipped). Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvoff.node_pool.protocol import STATE_READY

__all__ = ["KeptAnswers", "Leases"]

PREFIX_BYTES = 8
"""Bytes of the layout-fingerprint prefix of the pool's keys."""

SWEEP_ABOVE = 4096
"""Leases held before :meth:`Leases.add` sweeps the lapsed ones (at most once per
``lease_s / 2``): below it the few lapsed leases cost nothing; a sweep per call at 4,096 and
more (long chains looked up ahead and not loaded) cost 200-600 µs a call."""


class KeptAnswers:
    """The states of the keys a look-ahead answered, used for ``lookahead_s`` seconds after the
    reply (or until the engine changes the pool: :meth:`clear`).

    Args:
        prefix: this engine's key prefix (:data:`PREFIX_BYTES` bytes).
        lookahead_s: seconds a reply's answers are used (>= 0).
    """

    def __init__(self, prefix: bytes, lookahead_s: float) -> None:
        self.prefix, self.lookahead_s = prefix, lookahead_s
        self._states: dict[bytes, int] = {}
        self._until = 0.0

    def remember(self, prefixed: Sequence[bytes], states: bytes) -> None:
        """Keeps a reply's answers: ``states[i]`` (a ``protocol.STATE_*`` byte) of the pool's
        key ``prefixed[i]``; keys of other engines are skipped. The answers kept before stay
        and the whole set is used for ``lookahead_s`` from now."""
        known, pre = self._states, self.prefix
        for k, st in zip(prefixed, states, strict=True):
            if k[:PREFIX_BYTES] == pre:
                known[k[PREFIX_BYTES:]] = st
        self._until = time.monotonic() + self.lookahead_s

    def current(self) -> dict[bytes, int]:
        """The kept answers, key -> state byte (empty once ``lookahead_s`` has passed since the
        last :meth:`remember`); the caller reads it, never writes it."""
        if self._states and time.monotonic() > self._until:
            self._states.clear()
        return self._states

    def clear(self) -> None:
        """Forgets every answer (the engine changed the pool, or lost it)."""
        self._states.clear()


class Leases:
    """The ready keys the pool leased to this connection: key -> (slot, when the reply came).

    The pool pins a look-up's ready keys for this connection for ``lease_s`` seconds (its
    ``LOOKUP_AHEAD`` reply carries their slots), so a ``prepare_load`` of keys leased recently
    needs no reply, and one made after the pool died may load from the leased slots
    (:meth:`kvoff.node_pool.NodePoolClient.prepare_load`). A lease this connection does not use
    lapses at the pool; :meth:`add` sweeps such leases out here.

    Args:
        prefix: this engine's key prefix (:data:`PREFIX_BYTES` bytes).
    """

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self._held: dict[bytes, tuple[int, float]] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._held)

    def add(
        self, prefixed: Sequence[bytes], states: bytes, slots: Sequence[int], lease_s: float
    ) -> None:
        """Keeps the leases of a look-up reply: each of this engine's keys ``prefixed[i]``
        whose state byte ``states[i]`` is ``ready`` is leased from ``slots[i]`` as of now (a
        renewed lease gets the new time). Leases older than ``lease_s`` are swept out once more
        than :data:`SWEEP_ABOVE` are held, at most every ``lease_s / 2``."""
        held, pre, now = self._held, self.prefix, time.monotonic()
        for k, st, slot in zip(prefixed, states, slots, strict=True):
            if st == STATE_READY and k[:PREFIX_BYTES] == pre:
                held[k[PREFIX_BYTES:]] = (slot, now)
        if len(held) > SWEEP_ABOVE and now >= self._next_sweep:
            self._next_sweep = now + lease_s / 2
            old = now - lease_s
            for k in [k for k, (_, t) in held.items() if t < old]:
                del held[k]

    def take_fresh(self, keys: Sequence[bytes], fresh_after: float) -> list[int] | None:
        """The slots of ``keys`` when every one is leased, later than ``fresh_after``, and no
        key is given twice: those leases are used (removed) and their slots returned in order.
        Otherwise None, and nothing changes."""
        held = self._held
        if not keys or len(set(keys)) != len(keys):
            return None
        if not all(k in held and held[k][1] > fresh_after for k in keys):
            return None
        return [held.pop(k)[0] for k in keys]

    def snapshot(self, keys: Sequence[bytes]) -> list[tuple[int, float] | None]:
        """Each key's lease, ``(slot, time)``, or None where it has none; ``[None]`` when a
        key is given twice (such a load is never made from leases)."""
        if len(set(keys)) != len(keys):
            return [None]
        return [self._held.get(k) for k in keys]

    def discard(self, keys: Sequence[bytes]) -> None:
        """Drops the keys' leases (the pool used them for a load)."""
        for k in keys:
            self._held.pop(k, None)

    def clear(self) -> None:
        """Drops every lease (the connection is gone: the pool released them)."""
        self._held.clear()

    def age_all(self, seconds: float) -> None:
        """Makes every lease ``seconds`` old (tests: an engine that stalled that long since its
        look-up)."""
        then = time.monotonic() - seconds
        self._held = {k: (slot, then) for k, (slot, _) in self._held.items()}

    @staticmethod
    def held_after(leased: Sequence[tuple[int, float] | None], after: float) -> list[int] | None:
        """The slots of ``leased`` (a :meth:`snapshot`) when every entry is a lease taken later
        than ``after``; None when one is missing or older, or ``leased`` is empty."""
        held = [x for x in leased if x is not None and x[1] > after]
        if not leased or len(held) != len(leased):
            return None
        return [slot for slot, _ in held]
