"""Belady's MIN for ``kvoff replay``: the offline optimum of the CPU pool's eviction order.

``kvoff replay --policy min`` replays a trace with the engine-style loop of
:mod:`kvoff.tools.replay` (the engine's GPU prefix cache, kvoff lookups of the blocks after its
hits, stores of the new full offloaded blocks in one all-or-nothing ``prepare_store``), but the
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
from typing import TYPE_CHECKING

import numpy as np

from kvoff.models import get_model_preset
from kvoff.tools.traces import TraceRequest, load_trace

if TYPE_CHECKING:
    from kvoff.tools.replay import ReplayConfig, ReplayResult

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


def _request_keys(
    req: TraceRequest, block_size: int, factor: int, trace_block_size: int
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The replay's block identities of one request: the trace hash id of every GPU block's
    last token, and the offload identity ``(hash id, GPU position)`` of every full offloaded
    block (what :func:`kvoff.tools.replay.offload_key` hashes)."""
    length = req.input_length
    hash_ids = np.asarray(req.hash_ids, dtype=np.int64)
    positions = np.arange(math.ceil(length / block_size), dtype=np.int64)
    last_tok = np.minimum((positions + 1) * block_size, length) - 1
    block_hids = hash_ids[last_tok // trace_block_size]
    num_full_off = length // (block_size * factor)
    off_pos = (np.arange(num_full_off, dtype=np.int64) + 1) * factor - 1
    return block_hids, [(int(block_hids[p]), int(p)) for p in off_pos]


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
    from kvoff.tools.replay import ReplayResult, pool_config

    t_start = time.perf_counter()
    if config.gpu_prefix_blocks < 0:
        raise ValueError(f"gpu_prefix_blocks must be >= 0, got {config.gpu_prefix_blocks}")
    if config.cpu_blocks is not None and config.cpu_bytes is not None:
        raise ValueError("give cpu_blocks or cpu_bytes, not both")

    preset = get_model_preset(config.model)
    bs = config.block_size
    pool_cfg = pool_config(config)
    factor = pool_cfg.block_size_factor(bs)
    bytes_per_gpu_block = preset.layer_spec(bs).page_size_bytes * preset.num_layers
    num_cpu_blocks = pool_cfg.resolve_num_cpu_blocks(bytes_per_gpu_block, bs)
    tbs = config.trace_block_size
    reqs = requests if requests is not None else load_trace(config.trace, config.limit, tbs)
    if requests is not None and config.limit is not None:
        reqs = reqs[: config.limit]

    identities = [_request_keys(r, bs, factor, tbs) for r in reqs]
    uses = _next_uses([keys for _, keys in identities])
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
    pool = BeladyPool(num_cpu_blocks)
    gpu: OrderedDict[tuple[int, int], None] = OrderedDict()  # the engine's cache, LRU
    seen: set[tuple[int, int]] = set()
    max_hit_tokens = 0
    for n_done, (req, (block_hids, keys), nxt) in enumerate(
        zip(reqs, identities, uses, strict=True), 1
    ):
        length = req.input_length
        num_full = length // bs
        lead = 0
        while lead < len(keys) and keys[lead] in seen:
            lead += 1
        max_hit_tokens += lead * factor * bs
        seen.update(keys)

        idents = [(int(block_hids[p]), p) for p in range(num_full)]
        g = 0
        if config.gpu_prefix_blocks:
            while g < num_full and idents[g] in gpu:
                g += 1
        g_off = g // factor
        h = pool.leading_hits(keys[g_off:])
        load_end = (g_off + h) * factor
        hit_end = load_end if load_end > g else g
        if load_end > g:
            res.blocks_loaded += load_end - g
        for d, key in enumerate(keys):
            pool.reference(key, nxt[d], d)
        first_new = hit_end // factor
        if first_new < len(keys):
            out = pool.store(keys[first_new:], nxt[first_new:], range(first_new, len(keys)))
            if out is None:
                res.stores_skipped += len(keys) - first_new
            else:
                stored, evicted = out
                res.blocks_stored += len(stored)
                res.evictions += len(evicted)
        if config.gpu_prefix_blocks:
            for ident in reversed(idents):
                gpu[ident] = None
                gpu.move_to_end(ident)
            while len(gpu) > config.gpu_prefix_blocks:
                gpu.popitem(last=False)

        gpu_hit = g * bs
        cpu_hit = (hit_end - g) * bs
        res.requests += 1
        res.input_tokens += length
        res.gpu_hit_tokens += gpu_hit
        res.cpu_hit_tokens += cpu_hit
        res.computed_tokens += length - hit_end * bs
        res.per_request_gpu_hit_tokens.append(gpu_hit)
        res.per_request_cpu_hit_tokens.append(cpu_hit)
        if progress is not None:
            progress(n_done)

    res.hit_tokens = res.gpu_hit_tokens + res.cpu_hit_tokens
    res.hit_rate = res.hit_tokens / res.input_tokens if res.input_tokens else 0.0
    res.max_hit_rate = max_hit_tokens / res.input_tokens if res.input_tokens else 0.0
    res.bytes_stored = res.blocks_stored * factor * bytes_per_gpu_block
    res.bytes_loaded = res.blocks_loaded * bytes_per_gpu_block
    res.wall_s = time.perf_counter() - t_start
    return res
