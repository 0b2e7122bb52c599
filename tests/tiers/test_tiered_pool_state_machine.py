"""Hypothesis: random interleavings of store, lookup (with promotion), disk eviction, corruption,
restart and cache reset across L1 and a real disk tier keep both consistent: every block L1
serves has the bytes it was stored with since the last reset (a block of older weights is never
served: each reset changes every key's bytes), the disk's index matches what it holds, and no
pin or slot is left behind."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvoff import _scheduler
from kvoff.tiers.block_format import BlockFormat, layout_fingerprint
from kvoff.tiers.coordinator import TieredPool
from kvoff.tiers.disk import DiskTier, slot_bytes_for

PAYLOAD = 4096
FMT = BlockFormat(layout_fingerprint(test="tiered-pool-state-machine"), PAYLOAD)
L1_BLOCKS = 6
DISK_BLOCKS = 10
KEYS = 16


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(2, "little") + b"-offload-key"


def value(i: int, generation: int = 0) -> np.ndarray:
    """Key i's bytes under the weights of ``generation`` (the resets so far)."""
    fill = (i * 7 + generation * 101) % 251 + 1
    return np.full(PAYLOAD, fill, dtype=np.uint8) ^ np.arange(PAYLOAD, dtype=np.uint8)


class TieredPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory(prefix="kvoff-sm-")
        self.manager = _scheduler.CPUOffloadingManager(L1_BLOCKS, "lru")
        self.slots = np.zeros((L1_BLOCKS, PAYLOAD), dtype=np.uint8)
        self.disk = self._open_disk()
        self.pool = TieredPool(self.manager, self.slots.__getitem__, [self.disk],
                               write_queue_blocks=4)  # fmt: skip
        self.stored: set[int] = set()  # keys stored since the last reset (a tier holds no other)
        self.generation = 0  # resets so far: the weights every value is computed with

    def _open_disk(self) -> DiskTier:
        size = 4096 + DISK_BLOCKS * slot_bytes_for(FMT)
        return DiskTier(Path(self.dir.name), size, FMT)

    @rule(first=st.integers(0, KEYS - 1), n=st.integers(1, 3))
    def store(self, first: int, n: int) -> None:
        ids = [(first + j) % KEYS for j in range(n)]
        keys = [key(i) for i in dict.fromkeys(ids)]
        out = self.manager.prepare_store(keys)
        if out is None:
            return
        index = {key(i): i for i in ids}
        for k, b in zip(out.keys_to_store, out.block_ids, strict=True):
            self.slots[b] = value(index[k], self.generation)
        self.manager.complete_store(list(out.keys_to_store), True)
        self.stored.update(index[k] for k in out.keys_to_store)  # written through by the manager

    @rule(first=st.integers(0, KEYS - 1), n=st.integers(1, 4))
    def lookup_and_load(self, first: int, n: int) -> None:
        ids = [(first + j) % KEYS for j in range(n)]
        keys = [key(i) for i in dict.fromkeys(ids)]
        h = self.pool.lookup(keys)
        tries = 0
        while h is None and tries < 4:
            self.pool.wait_reads()
            h = self.pool.lookup(keys)
            tries += 1
        if h is None:
            self.pool.wait()
            h = self.manager.lookup(keys)
        assert h is not None
        if h:
            blocks = self.manager.prepare_load(keys[:h])
            for k, b in zip(keys[:h], blocks, strict=True):
                i = int.from_bytes(k[1:3], "little")
                np.testing.assert_array_equal(self.slots[b], value(i, self.generation))
            self.manager.complete_load(keys[:h])

    @rule(first=st.integers(0, KEYS - 1), n=st.integers(1, 4))
    def lookup_without_waiting(self, first: int, n: int) -> None:
        """A lookup as an engine makes it: a miss starts a probe and a promotion that later
        rules (a reset among them) find in flight."""
        keys = [key((first + j) % KEYS) for j in range(n)]
        self.pool.lookup(list(dict.fromkeys(keys)))

    @rule()
    def reset(self) -> None:
        """A cache reset for new weights, with write-through and promotions in flight: from now
        on every key's bytes differ, and no block of the old weights may be served."""
        self.pool.reset()
        self.manager.clear()
        self.generation += 1
        self.stored.clear()
        assert self.manager.num_stored_blocks == 0

    @rule(i=st.integers(0, KEYS - 1))
    def evict_from_disk(self, i: int) -> None:
        self.pool.wait()
        self.disk.evict([key(i)])

    @rule(i=st.integers(0, KEYS - 1))
    def corrupt_on_disk(self, i: int) -> None:
        """Flip a payload byte of key i's block on disk (if held): it must never be served."""
        self.pool.wait()
        path = next(Path(self.dir.name).glob("*.slots"))
        data = bytearray(path.read_bytes())
        at = bytes(data).find(value(i, self.generation)[:256].tobytes())
        if at > 0:
            data[at + 1000] ^= 0x5A
            path.write_bytes(bytes(data))

    @rule()
    def restart_disk(self) -> None:
        """A new process's disk tier on the same file (L1 is kept: the pool is rebuilt)."""
        self.pool.wait()
        self.pool.close()  # closes the disk tier too
        self.disk = self._open_disk()
        self.pool = TieredPool(self.manager, self.slots.__getitem__, [self.disk],
                               write_queue_blocks=4)  # fmt: skip

    @invariant()
    def every_l1_slot_is_counted_once(self) -> None:
        m = self.manager  # retired: dropped by a reset while a tier writer still read it
        counted = (m.num_free_blocks + m.num_stored_blocks + m.num_pending_blocks
                   + m.num_retired_blocks)  # fmt: skip
        assert counted == m.num_blocks

    @invariant()
    def disk_holds_only_stored_keys(self) -> None:
        held = self.disk.contains([key(i) for i in range(KEYS)])
        assert {i for i, h in enumerate(held) if h} <= self.stored
        assert sum(held) <= DISK_BLOCKS

    def teardown(self) -> None:
        self.pool.wait()
        # every write-through pin was released: L1 can make room for a whole new pool
        fresh = [b"fresh" + i.to_bytes(2, "little") for i in range(L1_BLOCKS)]
        out = self.manager.prepare_store(fresh)
        assert out is not None
        self.manager.complete_store(list(out.keys_to_store), False)
        self.pool.close()
        self.dir.cleanup()


TestTieredPoolMachine = pytest.mark.slow(TieredPoolMachine.TestCase)
TestTieredPoolMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
