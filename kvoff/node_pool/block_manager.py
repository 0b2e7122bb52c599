"""A node pool as the manager of kvoff's C++ scheduler (:class:`kvoff.OffloadingScheduler`, the
one :class:`kvoff.integrations.vllm.KvoffConnector` runs): :class:`NodePoolBlockManager`.

The scheduler calls its manager by CPU block ids (slots) where it can: it completes a job's
loads and stores by the slots ``prepare_load`` and ``prepare_store`` gave. The node pool's
calls take keys; the client keeps which key each of this engine's slots in flight holds (its
``NodePoolStores`` and ``NodePoolLoads``, in C++). The C++ side
(``cpp/bindings/node_pool_manager.cpp``) calls the methods below, and stores, completes stores
and loads, and touches through the client's ``NodePoolStores`` and ``NodePoolLoads`` itself;
their meaning is ``kvoff::BlockManager``'s (``cpp/include/kvoff/block_manager.h``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoff.node_pool import protocol as p
from kvoff.node_pool.client import NodePoolClient, NodePoolError, StoreSlots

__all__ = ["NodePoolBlockManager"]

# state codes the C++ side reads (BlockManager's BlockState, with a load pin of this engine)
_MISSING, _PENDING, _READY, _READY_LOADING = 0, 1, 2, 3
# the pool's state bytes (protocol.STATE_*) as those codes
_CODE_OF_STATE = bytes.maketrans(
    bytes((p.STATE_MISSING, p.STATE_READY, p.STATE_PENDING)), bytes((_MISSING, _READY, _PENDING))
)


class NodePoolBlockManager:
    """The node pool behind ``client``, with the calls kvoff's C++ scheduler makes of its
    manager. A look-up of a request's first key asks the pool for the key's chain (one round
    trip) and leases its ready blocks to this engine, so the request's later keys and its load
    cost no further round trip (:class:`kvoff.node_pool.NodePoolClient`).

    Args:
        client: this engine's (this rank's) connection to the pool.

    Attributes:
        client: the connection.
        load_failures: loads the pool refused (the pool gone, or a key evicted since it was
            looked up); the scheduler's hook raised for each (vLLM then recomputes).
    """

    def __init__(self, client: NodePoolClient) -> None:
        self.client = client
        self.load_failures = 0

    def states(self, keys: Sequence[bytes]) -> bytes:
        """A state code per key (0 missing, 1 pending, 2 ready, 3 ready and being loaded by
        this engine) up to and including the first missing key. The pool gone: missing."""
        codes = self.client.lookup_states(keys).translate(_CODE_OF_STATE)
        if _READY in codes and self.client.num_loads:
            loading = self.client.loading_mask(keys[: len(codes)])
            out = bytearray(codes)
            for i, c in enumerate(codes):
                if c == _READY and loading[i]:
                    out[i] = _READY_LOADING
            codes = bytes(out)
        return codes

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pins the keys for a load; their slots (region block ids), in order.

        Raises:
            NodePoolError: the pool refused (a key not ready any more, or the pool is gone);
                nothing is pinned.
        """
        try:
            return self.client.prepare_load(keys)
        except NodePoolError:
            self.load_failures += 1
            raise

    def complete_load_blocks(self, slots: Sequence[int]) -> None:
        """Unpins the slots of a finished load (those :meth:`prepare_load` gave; others are
        skipped). The C++ scheduler does this itself, through the client's ``NodePoolLoads``."""
        self.client.complete_load_slots(slots)

    def prepare_store(
        self, keys: Sequence[bytes]
    ) -> tuple[list[int], list[int], list[bytes]] | None:
        """Slots for the keys the pool does not hold: (their positions in ``keys``, their
        slots, the keys evicted for them), or None when the pool has no room or is gone, or
        gave a slot this engine is still writing (all or nothing;
        :meth:`NodePoolClient.prepare_store`)."""
        return _as_tuple(self.client.prepare_store(keys))

    def ask_store(self, keys: Sequence[bytes]) -> tuple[list[int], list[int], list[bytes]] | None:
        """:meth:`prepare_store` asked of the pool, not from the reservation (the C++ side
        tries the reservation itself first)."""
        return _as_tuple(self.client.ask_store(keys))

    def complete_store_blocks(self, slots: Sequence[int], success: bool) -> None:
        """Ends this engine's stores into ``slots``: hits for every engine (``success``) or
        freed."""
        self.client.complete_store_slots(slots, success)

    def touch(self, keys: Sequence[bytes], reused: bytes) -> None:
        """Makes the keys the most recent (``keys[0]`` first); ``reused``: 1 per reused key."""
        self.client.touch(keys, bytes(reused))

    def clear(self) -> int:
        """Drops nothing (other engines use the pool; the client logs it once); 0."""
        return self.client.clear()

    def take_events(self) -> list[tuple[bool, list[bytes]]]:
        """The pool's events for this engine's layout since the last call: (removed, keys)."""
        return [(e.removed, list(e.keys)) for e in self.client.take_events()]

    def block_state(self, key: bytes) -> str:
        """``"missing"``, ``"pending"`` or ``"ready"``. A key this engine is loading is ready
        (its load pins it; a leased load outlives a pool that went away, see
        :meth:`NodePoolClient.prepare_load`); any other key: the pool's answer now (one round
        trip, after this engine's queued calls; "missing" while the pool is gone)."""
        if self.client.load_pins(key):
            return "ready"
        return ("missing", "ready", "pending")[self.client.key_state(key)]

    def slot_in_flight(self, key: bytes) -> int | None:
        """The slot this engine is storing ``key`` into or loading it from, else None."""
        slot = self.client.storing_slot(key)
        return slot if slot is not None else self.client.loading_slot(key)

    def load_pins(self, key: bytes) -> int:
        """This engine's loads of ``key`` in flight."""
        return self.client.load_pins(key)

    def in_flight(self) -> dict[str, Any]:
        """This engine's slots in flight: ``{"storing": n, "loading": n}`` (tests, metrics)."""
        return {"storing": self.client.num_storing, "loading": self.client.num_loads}

    @property
    def stores_refused_in_flight(self) -> int:
        """Stores refused because the pool, restarted on the same region, handed out a slot
        this engine was still writing for the pool before."""
        return self.client.stores_refused_in_flight


def _as_tuple(got: StoreSlots | None) -> tuple[list[int], list[int], list[bytes]] | None:
    return None if got is None else (got.store_indices, got.block_ids, got.evicted_keys)
