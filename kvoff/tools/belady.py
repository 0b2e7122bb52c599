"""Belady's MIN for ``kvoff replay``: the offline optimum of the CPU pool's eviction order.

``kvoff replay --policy min`` replays a trace with the replay's request loop
(:func:`kvoff.tools.request_loop.run_request_loop`: the engine's GPU prefix cache, kvoff lookups
of the blocks after its hits, stores of the new full offloaded blocks in one all-or-nothing
``prepare_store``), but the
CPU pool evicts with knowledge of the future, so no engine can run it. It is the reference that
an eviction policy is measured against: the hit rate that the best eviction order reaches with
the same pool, the same stores and the same lookups.

Definition (L. A. Belady, "A study of replacement algorithms for a virtual-storage computer",
IBM Systems Journal 5(2), 1966; its optimality for demand paging: R. L. Mattson, J. Gecsei,
D. R. Slutz, I. L. Traiger, "Evaluation techniques for storage hierarchies", IBM Systems Journal
9(2), 1970):

* only full offloaded blocks are cached, exactly as in the replay;
* a block's **next use** is the index of the next request whose offload keys contain it (a
  request that contains a block contains all of its ancestors, because a key identifies its
  whole prefix), or never;
* when ``prepare_store`` needs slots, MIN evicts the blocks whose next use is farthest in the
  future; among blocks with the same next use, the **deeper** block (the larger offloaded block
  index) goes first, so a prefix keeps its head; remaining ties (blocks never used again at the
  same depth) go least recently referenced first, which cannot change any hit;
* as in the manager, the keys of one ``prepare_store`` call are never evicted for each other and
  a call that cannot place all of its new keys stores nothing (``stores_skipped``).

Stores complete at once (the replay's CPU loop behaves the same way: a store finishes before the
next request looks it up). For demand paging MIN is optimal in block misses, which the tests
check against an exhaustive search on small reference streams; hit *tokens* count the leading
run of hits of each request, and MIN's tie rule keeps those runs whole.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from kvoff.models import get_model_preset
from kvoff.sizing import bytes_per_gpu_block as bytes_per_gpu_block_of
from kvoff.tools.request_loop import (
    ReplayConfig,
    ReplayResult,
    RequestBlocks,
    StoreOutcome,
    check_pool_settings,
    pool_config,
    replay_requests,
    request_blocks,
    run_request_loop,
)
from kvoff.tools.traces import TraceRequest

__all__ = ["MIN_POLICY", "NEVER", "BeladyPool", "min_block_misses", "run_min_replay"]

MIN_POLICY = "min"
"""The ``--policy`` name of Belady's MIN in ``kvoff replay`` (not an engine eviction policy)."""

NEVER = sys.maxsize
"""The next use of a block that no later request contains."""


class BeladyPool:
    """A pool of ``capacity`` blocks that evicts by Belady's MIN (see the module docstring).

    Blocks are any hashable keys. The caller tells the pool each block's next use (a request
    index, or :data:`NEVER`) and depth (its offloaded block index) whenever a request references
    it: :meth:`reference` for blocks the pool holds, :meth:`store` for the blocks to store. Each
    eviction pops a heap of (next use, depth) entries, stale entries being skipped, so a request
    of ``k`` keys costs ``O(k log n)``.
    """

    def __init__(self, capacity: int) -> None:
        """An empty pool of ``capacity`` blocks.

        Raises:
            ValueError: ``capacity`` < 1.
        """
        if capacity < 1:
            raise ValueError(f"a MIN pool needs a capacity of at least 1 block, got {capacity}")
        self.capacity = capacity
        self._held: dict[Hashable, tuple[int, int, int]] = {}  # key -> heap priority
        self._heap: list[tuple[int, int, int, Hashable]] = []
        self._seq = 0

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._held)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is held."""
        return key in self._held

    def leading_hits(self, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` the pool holds (a lookup; changes nothing)."""
        n = 0
        for key in keys:
            if key not in self._held:
                break
            n += 1
        return n

    def _push(self, key: Hashable, next_use: int, depth: int) -> None:
        # heapq pops the smallest tuple: the farthest next use, then the deepest block, then the
        # block referenced least recently.
        self._seq += 1
        prio = (-next_use, -depth, self._seq)
        self._held[key] = prio
        heapq.heappush(self._heap, (*prio, key))

    def reference(self, key: Hashable, next_use: int, depth: int) -> None:
        """Records that the current request contains ``key``: its next use becomes ``next_use``.
        Nothing happens for a key the pool does not hold."""
        if key in self._held:
            self._push(key, next_use, depth)

    def store(
        self, keys: Sequence[Hashable], next_uses: Sequence[int], depths: Sequence[int]
    ) -> tuple[list[Hashable], list[Hashable]] | None:
        """``prepare_store`` of ``keys`` (one request's blocks, in prefix order) with MIN's
        victims: every key the pool does not hold gets a slot; the keys of the call are not
        evicted for each other.

        Returns:
            ``(stored, evicted)``: the keys stored (first occurrences, call order) and the keys
            evicted (eviction order); or ``None`` when free slots plus blocks that are not keys
            of the call are fewer than the new keys, and then nothing changed.
        """
        call = set(keys)
        new: list[int] = []  # positions of the first occurrence of each key not held
        seen: set[Hashable] = set()
        for i, key in enumerate(keys):
            if key not in self._held and key not in seen:
                seen.add(key)
                new.append(i)
        protected = sum(1 for key in call if key in self._held)
        need = len(new) - (self.capacity - len(self._held))
        if need > len(self._held) - protected:
            return None
        evicted: list[Hashable] = []
        skipped: list[tuple[int, int, int, Hashable]] = []
        while len(evicted) < need:
            entry = heapq.heappop(self._heap)
            key = entry[3]
            if self._held.get(key) != entry[:3]:
                continue  # stale: the block was referenced again or evicted since
            if key in call:
                skipped.append(entry)
                continue
            del self._held[key]
            evicted.append(key)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        for i in new:
            self._push(keys[i], next_uses[i], depths[i])
        return [keys[i] for i in new], evicted


def _next_uses(requests: Sequence[Sequence[Hashable]]) -> list[list[int]]:
    """Per request, per key: the index of the next request containing the key, or NEVER."""
    nxt: dict[Hashable, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        keys = requests[i]
        out[i] = [nxt.get(k, NEVER) for k in keys]
        for k in keys:
            nxt[k] = i
    return out


def min_block_misses(requests: Sequence[Sequence[Hashable]], capacity: int) -> int:
    """Block misses of MIN on a reference stream, under the replay's store rule.

    Each request is a sequence of distinct keys in prefix order. Per request: its leading run of
    held keys is a hit; every held key of the request is referenced; the keys after the hits are
    stored in one all-or-nothing call. A miss is a key of a request that the pool does not hold
    when the request arrives. The depth of a key is its position in the request.

    Raises:
        ValueError: ``capacity`` < 1, or a request that repeats a key.
    """
    for i, keys in enumerate(requests):
        if len(set(keys)) != len(keys):
            raise ValueError(f"request {i} repeats a key: {list(keys)!r}; keys must be distinct")
    pool = BeladyPool(capacity)
    uses = _next_uses(requests)
    misses = 0
    for keys, nxt in zip(requests, uses, strict=True):
        misses += sum(1 for k in keys if k not in pool)
        h = pool.leading_hits(keys)
        for d, k in enumerate(keys):
            pool.reference(k, nxt[d], d)
        if h < len(keys):
            pool.store(keys[h:], nxt[h:], range(h, len(keys)))
    return misses


class _MinPool:
    """Belady's side of :func:`kvoff.tools.request_loop.run_request_loop`: the engine's GPU
    prefix cache (LRU over full GPU blocks) and a :class:`BeladyPool`, told each key's next use
    (precomputed from the whole trace). Stores complete at once."""

    def __init__(self, capacity: int, gpu_prefix_blocks: int, uses: list[list[int]]) -> None:
        self.pool = BeladyPool(capacity)
        self.gpu_prefix_blocks = gpu_prefix_blocks
        self.gpu: OrderedDict[tuple[int, int], None] = OrderedDict()  # last = most recent
        self.uses = uses
        self.nxt: list[int] = []
        self.idents: list[tuple[int, int]] = []

    def begin(self, index: int, blocks: RequestBlocks, keys: list[tuple[int, int]]) -> int:
        self.nxt = self.uses[index]
        hids = blocks.block_hids
        self.idents = [(int(hids[p]), p) for p in range(blocks.num_full)]
        g = 0
        if self.gpu_prefix_blocks:
            while g < blocks.num_full and self.idents[g] in self.gpu:
                g += 1
        return g

    def lookup(self, keys: list[tuple[int, int]]) -> int:
        return self.pool.leading_hits(keys)

    def load(self, keys: list[tuple[int, int]], first: int, end: int) -> bool:
        return True  # nothing moves

    def touch(self, keys: list[tuple[int, int]]) -> None:
        for d, key in enumerate(keys):
            self.pool.reference(key, self.nxt[d], d)

    def compute(self, gpu_hits: int, hit_end: int) -> None:
        pass

    def store(self, keys: list[tuple[int, int]], first: int) -> StoreOutcome | None:
        out = self.pool.store(keys, self.nxt[first:], range(first, first + len(keys)))
        if out is None:
            return None
        stored, evicted = out
        return StoreOutcome(stored=len(stored), evicted=len(evicted))

    def end(self, keys: list[tuple[int, int]]) -> None:
        if self.gpu_prefix_blocks:  # head most recent
            for ident in reversed(self.idents):
                self.gpu[ident] = None
                self.gpu.move_to_end(ident)
            while len(self.gpu) > self.gpu_prefix_blocks:
                self.gpu.popitem(last=False)


def run_min_replay(
    config: ReplayConfig,
    progress: Callable[[int], None] | None = None,
    requests: list[TraceRequest] | None = None,
) -> ReplayResult:
    """The replay of ``config`` (see :func:`kvoff.tools.replay.run_replay`) with MIN as the
    CPU pool's eviction order, simulated: no bytes move, so the transfer timings are 0 and
    ``device`` is ``"offline"``; blocks, bytes and hit tokens are what the replay would count.

    Args:
        config: the replay; ``config.policy`` is ignored (always ``"min"``), ``device``,
            ``gpu_layout``, ``mechanism`` and ``compute`` do not apply.
        progress: called with the number of requests done after each request.
        requests: already loaded requests (else the trace is read).

    Raises:
        ValueError: for bad sizes (block sizes, pool size, model), as the replay.
    """
    t_start = time.perf_counter()
    check_pool_settings(config)
    preset = get_model_preset(config.model)
    bs = config.block_size
    pool_cfg = pool_config(config)
    factor = pool_cfg.block_size_factor(bs)
    page = preset.layer_spec(bs).page_size_bytes  # one tensor per layer, a page per block
    bytes_per_gpu_block = bytes_per_gpu_block_of([page] * preset.num_layers, 1)
    num_cpu_blocks = pool_cfg.resolve_num_cpu_blocks(bytes_per_gpu_block, bs)
    tbs = config.trace_block_size
    reqs = replay_requests(config, requests)

    blocks = [request_blocks(r, bs, factor, tbs) for r in reqs]
    uses = _next_uses([b.identities for b in blocks])
    max_blocks = max((math.ceil(r.input_length / bs) for r in reqs), default=0)
    res = ReplayResult(
        trace=config.trace,
        model=preset.name,
        block_size=bs,
        offloaded_block_size=config.offloaded_block_size,
        gpu_prefix_blocks=config.gpu_prefix_blocks,
        cpu_blocks=num_cpu_blocks,
        policy=MIN_POLICY,
        device="offline",
        gpu_layout=config.gpu_layout,
        gpu_blocks=1 + config.gpu_prefix_blocks + max_blocks,
        cpu_pool_bytes=num_cpu_blocks * bytes_per_gpu_block * factor,
    )
    pool = _MinPool(num_cpu_blocks, config.gpu_prefix_blocks, uses)
    run_request_loop(
        reqs, pool, res, _identity, trace_block_size=tbs, progress=progress, blocks=blocks
    )
    res.bytes_stored = res.blocks_stored * factor * bytes_per_gpu_block
    res.bytes_loaded = res.blocks_loaded * bytes_per_gpu_block
    res.wall_s = time.perf_counter() - t_start
    return res


def _identity(hash_id: int, position: int) -> tuple[int, int]:
    """MIN's key of an offloaded block: its identity itself (no hashing needed offline)."""
    return (hash_id, position)
