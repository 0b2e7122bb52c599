"""The request loop that ``kvoff replay``, Belady's MIN and the policy simulator share.

All three replay a Mooncake-format trace request by request with the same steps and count the
same things; only the pool differs (:mod:`kvoff.tools.replay`: the worker, the manager and real
transfers; :mod:`kvoff.tools.belady`: an offline MIN pool; :mod:`kvoff.tools.policy_sim`: the
C++ manager alone). :func:`run_request_loop` runs the steps and keeps the hit accounting; the
pool is a :class:`RequestPool`. Per request:

1. its **blocks** (:func:`request_blocks`): the trace hash id of each GPU block's last token and
   the identity ``(hash id, GPU position)`` of each full offloaded block, turned into keys;
2. the full-block **maximum**: the leading run of keys some earlier request already had;
3. ``g``: the leading full GPU blocks the engine's own prefix cache holds (:meth:`begin`);
4. **lookup** of the offloaded blocks from ``g // factor`` on: ``h`` leading hits; the GPU blocks
   ``[g, (g // factor + h) × factor)`` are **loaded** (:meth:`load`; a failed load is no hit),
   then every key of the request is **touched**;
5. the rest is **computed** (:meth:`compute`), and the full offloaded blocks holding computed
   tokens are **stored** in one all-or-nothing call (:meth:`store`; ``None``: no room, nothing
   stored, ``stores_skipped`` counts the blocks);
6. :meth:`end` (recency, the GPU prefix cache), then the request's tokens are counted.

Only full blocks are ever cached. This module also holds what the three share around the loop:
:class:`ReplayConfig`, :class:`ReplayResult`, :func:`offload_key` and :func:`pool_config`.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from kvoff.config import OffloadingConfig
from kvoff.tools.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_trace

__all__ = [
    "DEFAULT_CPU_BYTES",
    "ReplayConfig",
    "ReplayResult",
    "RequestBlocks",
    "RequestPool",
    "StoreOutcome",
    "check_pool_settings",
    "offload_key",
    "pool_config",
    "replay_requests",
    "request_blocks",
    "run_request_loop",
]

DEFAULT_CPU_BYTES = 2 * 1024**3
DEFAULT_COMPUTE_CHUNK_TOKENS = 2048


def offload_key(hash_id: int, position: int, group: int = 0) -> bytes:
    """Offload key of the GPU block at ``position`` whose last token is in the trace block
    ``hash_id`` (for an offloaded block: the key of its last GPU block), KV cache group
    ``group``: 16 bytes of BLAKE2b over the little-endian (hash_id, position, group)."""
    return hashlib.blake2b(struct.pack("<qqi", hash_id, position, group), digest_size=16).digest()


@dataclass(frozen=True)
class ReplayConfig:
    """Parameters of one replay.

    Attributes:
        trace: bundled trace name (``conversation``, ``synthetic``) or a JSONL path.
        model: KV shape preset (see :mod:`kvoff.models`).
        block_size: GPU tokens per block.
        offloaded_block_size: tokens per offloaded block; a multiple of ``block_size``.
        gpu_prefix_blocks: GPU blocks the engine's own prefix cache keeps between requests
            (0 disables it).
        cpu_blocks: kvoff pool size in offloaded blocks (exclusive with ``cpu_bytes``).
        cpu_bytes: kvoff pool size in bytes; when neither is given, 2 GiB.
        policy: eviction policy name, or ``"min"``: Belady's offline optimum, simulated by
            :func:`kvoff.tools.belady.run_min_replay` (no bytes move).
        store_threshold: the manager's store admission (offers before a block is stored;
            0 or 1: off; not with ``"min"``).
        max_tracker_size: keys whose offers the admission filter counts at most.
        limit: replay only ``limit`` requests.
        start: the first request replayed (0-based; the ones before it are skipped).
        warmup_requests: of the requests replayed, the first ones only fill the caches: served
            without compute, not counted in the totals (only a corrupted block or a failed
            transfer among them is) nor timed.
        trace_block_size: tokens per trace hash id (512 for Mooncake).
        device: ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``): where the "GPU" cache lives.
        gpu_layout: ``"layer_major"`` or ``"block_contiguous"``.
        mechanism: the worker's transfer mechanism (``"auto"``: within the default slowdown
            budget).
        compute: also run the prefill's GEMMs and report the time against recomputing.
        compute_chunk_tokens: tokens per GEMM chunk of the prefill cost (a chunked prefill).
        interleave_requests: with ``compute``, requests served with kvoff before the same ones
            are served by the engine's prefix cache alone (:mod:`kvoff.tools.replay_compute`).
        disk_path: a folder for a disk tier below the CPU pool (with ``disk_bytes``; one
            sub-folder per engine when ``engines > 1``).
        disk_bytes: bytes of the disk tier (per engine).
        remote_url: ``redis://host:port`` of a Redis Cluster shared by the engines.
        remote_namespace: key prefix in the remote tier (runs with the same namespace, model
            and layout share blocks).
        remote_timeout_s: seconds after which a remote operation is a miss (or a dropped
            write).
        shared_secret: with tiers, every block written to them carries a keyed MAC and
            blocks without a valid one are misses (docs/tiers.md); never shown in a repr.
        node_pool: the socket of a node pool (:mod:`kvoff.node_pool`) to use instead of a
            private CPU pool (its size and policy are the pool's).
        node_pool_reserve: on a node pool, store into slots the pool reserves for each engine
            (``NodePoolClient(reserve=True)``, as the vLLM connectors do): stores that need no
            round trip, for slots the index cannot use meanwhile.
        engines: engines the trace is split across (each with its own GPU cache, CPU pool and
            disk tier; all share the remote tier), served one request at a time in trace order.
        assign: ``"round_robin"`` (request ``i`` to engine ``i mod N``) or ``"session"`` (by
            the request's first hash id: requests that share a first block, a conversation or
            a system prompt, go to the same engine).
        tier_write_queue_blocks: blocks in write-through at most (default: a quarter of the CPU
            pool, at most 1024); the replay waits for room rather than dropping (it has no
            compute between requests to hide the writes behind).
    """

    trace: str = "conversation"
    model: str = "tiny"
    block_size: int = 16
    offloaded_block_size: int = 512
    gpu_prefix_blocks: int = 0
    cpu_blocks: int | None = None
    cpu_bytes: int | None = None
    policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64000
    limit: int | None = None
    start: int = 0
    warmup_requests: int = 0
    trace_block_size: int = MOONCAKE_BLOCK_SIZE
    device: str = "cpu"
    gpu_layout: str = "layer_major"
    mechanism: str = "auto"
    compute: bool = False
    compute_chunk_tokens: int = DEFAULT_COMPUTE_CHUNK_TOKENS
    interleave_requests: int = 16
    disk_path: str | None = None
    disk_bytes: int | None = None
    remote_url: str | None = None
    remote_namespace: str = "kvoff-replay"
    remote_timeout_s: float = 0.25
    node_pool: str | None = None
    node_pool_reserve: bool = False
    shared_secret: bytes | None = field(default=None, repr=False)
    engines: int = 1
    assign: str = "round_robin"
    tier_write_queue_blocks: int | None = None


@dataclass
class ReplayResult:
    """Totals of a replay (tokens, blocks, bytes, seconds) plus per-request hit tokens.

    The ``time_*``, ``ttft_*``, ``speedup*``, ``gemm_*`` and ``saving_fraction`` fields are set
    with ``compute`` (seconds; see :mod:`kvoff.tools.replay_compute`), ``None`` otherwise:
    ``time_with_s`` and ``time_without_s`` are the run with kvoff and with the engine's prefix
    cache alone (``hit_tokens_without`` its hits), interleaved per ``interleave_requests``
    requests; ``time_ideal_s`` the GEMMs for the tokens no cache hit; ``time_recompute_s``
    those for every input token; ``ttft_p50/p99_with/without_s`` the time to first token.

    ``stores_skipped`` counts offloaded blocks not stored because ``prepare_store`` found no
    room; ``stores_filtered`` those the ``store_threshold`` admission filter skipped (the
    manager's ``stores_skipped``).

    Host seconds the request loop spent where a request waits before its compute:
    ``fence_wait_s`` ordering its compute after stores still reading GPU blocks it was given
    (``fence_waits`` times; a stream-ordered wait on a GPU, so only the call's own cost),
    ``retry_wait_s`` blocked on jobs in flight before a lookup answered "retry later"
    (``lookup_retries`` times; ``lost_lookups``: with a node pool, hits another engine evicted
    before they were pinned, or a pool gone, served as misses), ``load_wait_s`` from
    submitting its load to the load's end on the CPU, to its stream-ordered wait on a GPU.
    """

    trace: str
    model: str
    block_size: int
    offloaded_block_size: int
    gpu_prefix_blocks: int
    cpu_blocks: int
    policy: str
    device: str = "cpu"
    gpu_layout: str = "layer_major"
    store_threshold: int = 0
    max_tracker_size: int = 64000
    mechanisms: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    input_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    hit_tokens: int = 0
    hit_rate: float = 0.0
    max_hit_rate: float = 0.0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    stores_skipped: int = 0
    stores_filtered: int = 0
    failed_transfers: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    store_gbps: float = 0.0
    load_gbps: float = 0.0
    blocks_verified: int = 0
    corrupted_blocks: int = 0
    evictions: int = 0
    lookup_retries: int = 0
    lost_lookups: int = 0
    fence_waits: int = 0
    fence_wait_s: float = 0.0
    retry_wait_s: float = 0.0
    load_wait_s: float = 0.0
    gpu_blocks: int = 0
    cpu_pool_bytes: int = 0
    computed_tokens: int = 0
    time_kvoff_s: float | None = None
    time_recompute_s: float | None = None
    speedup: float | None = None
    ideal_speedup: float | None = None
    speedup_vs_ideal: float | None = None
    time_with_s: float | None = None
    time_without_s: float | None = None
    time_ideal_s: float | None = None
    saving_fraction: float | None = None
    ttft_p50_with_s: float | None = None
    ttft_p99_with_s: float | None = None
    ttft_p50_without_s: float | None = None
    ttft_p99_without_s: float | None = None
    hit_tokens_without: int | None = None
    interleave_requests: int | None = None
    interleaved_chunks: int | None = None
    gemm_s: float | None = None
    gemm_alone_s: float | None = None
    gemm_lost_s: float | None = None
    compute_flops_per_token: float | None = None
    engines: int = 1
    warmup_requests: int = 0
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    tiers: dict[str, Any] = field(default_factory=dict)
    tier_corrupted_blocks: int = 0
    wall_s: float = 0.0
    per_request_gpu_hit_tokens: list[int] = field(default_factory=list, repr=False)
    per_request_cpu_hit_tokens: list[int] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """All totals (no per-request lists), as a JSON-ready dict."""
        d = asdict(self)
        d.pop("per_request_gpu_hit_tokens")
        d.pop("per_request_cpu_hit_tokens")
        return d


def pool_config(config: ReplayConfig, policy: str | None = None) -> OffloadingConfig:
    """The CPU pool of a replay: ``cpu_blocks`` or ``cpu_bytes`` (2 GiB when neither is given),
    ``offloaded_block_size``, ``store_threshold``, ``max_tracker_size`` and, when given, the
    eviction ``policy``.

    Raises:
        pydantic.ValidationError: a bad size, policy, store_threshold or max_tracker_size (the
            message names the field).
    """
    cpu_bytes = config.cpu_bytes
    if cpu_bytes is None and config.cpu_blocks is None:
        cpu_bytes = DEFAULT_CPU_BYTES
    extra = {} if policy is None else {"eviction_policy": policy}
    return OffloadingConfig(
        num_cpu_blocks=config.cpu_blocks,
        cpu_bytes_to_use=cpu_bytes,
        offloaded_block_size=config.offloaded_block_size,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
        **extra,
    )


def check_pool_settings(config: ReplayConfig) -> None:
    """The checks every replay of ``config`` makes first.

    Raises:
        ValueError: ``gpu_prefix_blocks`` < 0, or both ``cpu_blocks`` and ``cpu_bytes``.
    """
    if config.gpu_prefix_blocks < 0:
        raise ValueError(f"gpu_prefix_blocks must be >= 0, got {config.gpu_prefix_blocks}")
    if config.cpu_blocks is not None and config.cpu_bytes is not None:
        raise ValueError("give cpu_blocks or cpu_bytes, not both")


def replay_requests(
    config: ReplayConfig, requests: list[TraceRequest] | None = None
) -> list[TraceRequest]:
    """The requests a replay of ``config`` serves: ``requests`` (already loaded, the whole
    trace or its first ``start + limit``) or the trace; ``config.limit`` of them from request
    ``config.start`` on.

    Raises:
        FileNotFoundError / ValueError: as :func:`kvoff.tools.traces.load_trace`;
            ValueError also for ``start`` < 0.
    """
    if config.start < 0:
        raise ValueError(f"start must be >= 0 (a request index), got {config.start}")
    stop = None if config.limit is None else config.start + config.limit
    if requests is None:
        requests = load_trace(config.trace, stop, config.trace_block_size)
    return requests[config.start : stop]


@dataclass(frozen=True)
class RequestBlocks:
    """One request's blocks, as the replay names them.

    Attributes:
        input_length: prompt tokens.
        block_hids: ``(ceil(input_length / block_size),)`` int64: the trace hash id of each GPU
            block's last token (the partial last block's clamped to the prompt's end).
        num_full: full GPU blocks (``input_length // block_size``).
        identities: per full offloaded block, ``(hash id, GPU position)`` of its last GPU block
            (what :func:`offload_key` hashes); a hash id names its whole prefix, so this
            identifies the block's whole prefix.
    """

    input_length: int
    block_hids: np.ndarray
    num_full: int
    identities: list[tuple[int, int]]


def request_blocks(
    req: TraceRequest, block_size: int, factor: int, trace_block_size: int
) -> RequestBlocks:
    """The :class:`RequestBlocks` of ``req`` with GPU blocks of ``block_size`` tokens,
    offloaded blocks of ``factor`` GPU blocks and ``trace_block_size`` tokens per hash id."""
    length = req.input_length
    hash_ids = np.asarray(req.hash_ids, dtype=np.int64)
    positions = np.arange(math.ceil(length / block_size), dtype=np.int64)
    # trace block of each GPU block's last token (clamped for the partial last block)
    last_tok = np.minimum((positions + 1) * block_size, length) - 1
    block_hids = hash_ids[last_tok // trace_block_size]
    num_full_off = length // (block_size * factor)
    off_pos = (np.arange(num_full_off, dtype=np.int64) + 1) * factor - 1
    identities = [(int(block_hids[p]), int(p)) for p in off_pos]
    return RequestBlocks(length, block_hids, length // block_size, identities)


K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class StoreOutcome:
    """What one all-or-nothing store placed: ``stored`` offloaded blocks whose store is done
    (0 for a store still in flight, counted when it finishes) and ``evicted`` blocks."""

    stored: int
    evicted: int


class RequestPool(Protocol, Generic[K]):
    """The pool side of :func:`run_request_loop`: each method is one step of a request (module
    docstring); ``keys`` are the request's offload keys in prefix order."""

    def begin(self, index: int, blocks: RequestBlocks, keys: list[K]) -> int:
        """Request ``index`` starts: returns ``g``, the leading full GPU blocks the engine's
        prefix cache holds."""
        ...

    def lookup(self, keys: list[K]) -> int:
        """How many leading ``keys`` the pool holds (the request's keys after the GPU hits)."""
        ...

    def load(self, keys: list[K], first: int, end: int) -> bool:
        """Loads the request's GPU blocks ``[first, end)`` from the offloaded blocks ``keys``;
        ``False`` when the load failed (then no hit)."""
        ...

    def touch(self, keys: list[K]) -> None:
        """After the lookup and the load: the request references all of its ``keys``."""
        ...

    def compute(self, gpu_hits: int, hit_end: int) -> None:
        """The GPU blocks ``[gpu_hits, hit_end)`` were loaded, ``[hit_end, ...)`` are computed."""
        ...

    def store(self, keys: list[K], first: int) -> StoreOutcome | None:
        """One all-or-nothing store of ``keys`` (the offloaded blocks ``first`` on); ``None``
        when the pool has no room (nothing stored)."""
        ...

    def end(self, keys: list[K]) -> None:
        """The request is done (recency, the engine's prefix cache)."""
        ...


def run_request_loop(
    requests: Sequence[TraceRequest],
    pool: RequestPool[K],
    res: ReplayResult,
    key: Callable[[int, int], K],
    *,
    trace_block_size: int,
    progress: Callable[[int], None] | None = None,
    blocks: Sequence[RequestBlocks] | None = None,
    before: Callable[[int], None] | None = None,
) -> None:
    """Serves ``requests`` in order through ``pool`` (steps of the module docstring) and counts
    into ``res``: requests, input, GPU, kvoff and computed tokens (totals and per request), GPU
    blocks loaded, offloaded blocks stored (``StoreOutcome.stored``), skipped for want of room,
    evicted; at the end ``hit_tokens``, ``hit_rate`` and ``max_hit_rate``.

    Args:
        requests: the trace's requests.
        pool: the pool side.
        res: the totals to add to; its ``block_size`` and ``offloaded_block_size`` (a multiple
            of it) give the blocks.
        key: the offload key of an identity ``(hash id, GPU position)``.
        trace_block_size: tokens per trace hash id.
        progress: called with the number of requests done after each request.
        blocks: the requests' :func:`request_blocks`, when the caller already has them.
        before: called with ``i`` before request ``i`` is served (engines in separate
            processes take turns through it).
    """
    bs, obs = res.block_size, res.offloaded_block_size
    factor = obs // bs
    seen: set[K] = set()
    max_hit_tokens = 0
    for i, req in enumerate(requests):
        b = blocks[i] if blocks is not None else request_blocks(req, bs, factor, trace_block_size)
        keys = [key(hid, pos) for hid, pos in b.identities]
        n = len(keys)
        lead = 0
        while lead < n and keys[lead] in seen:
            lead += 1
        max_hit_tokens += lead * obs
        seen.update(keys)

        if before is not None:
            before(i)
        g = pool.begin(i, b, keys)
        g_off = g // factor
        h = pool.lookup(keys[g_off:]) if g_off < n else 0
        load_end = (g_off + h) * factor
        hit_end = g
        if load_end > g and pool.load(keys[g_off : g_off + h], g, load_end):
            hit_end = load_end
            res.blocks_loaded += load_end - g
        pool.touch(keys)
        pool.compute(g, hit_end)
        first_new = hit_end // factor
        if first_new < n:
            out = pool.store(keys[first_new:], first_new)
            if out is None:
                res.stores_skipped += n - first_new
            else:
                res.blocks_stored += out.stored
                res.evictions += out.evicted
        pool.end(keys)

        gpu_hit = g * bs
        cpu_hit = (hit_end - g) * bs
        res.requests += 1
        res.input_tokens += b.input_length
        res.gpu_hit_tokens += gpu_hit
        res.cpu_hit_tokens += cpu_hit
        res.computed_tokens += b.input_length - hit_end * bs
        res.per_request_gpu_hit_tokens.append(gpu_hit)
        res.per_request_cpu_hit_tokens.append(cpu_hit)
        if progress is not None:
            progress(i + 1)
    res.hit_tokens = res.gpu_hit_tokens + res.cpu_hit_tokens
    res.hit_rate = res.hit_tokens / res.input_tokens if res.input_tokens else 0.0
    res.max_hit_rate = max_hit_tokens / res.input_tokens if res.input_tokens else 0.0
