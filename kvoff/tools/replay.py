"""``kvoff replay``: an engine-style loop that replays a real request trace through kvoff.

Each request of a Mooncake-format trace is served like an engine serves a prefill, by the request
loop that Belady's MIN and the policy simulator share (:mod:`kvoff.tools.request_loop`):

1. **GPU prefix cache.** The engine's own cache (LRU over full GPU blocks, at most
   ``gpu_prefix_blocks`` kept between requests; 0 disables it) gives the leading run of full GPU
   blocks it already holds: ``g`` blocks, ``gpu_hit_tokens = g × block_size``. Fresh GPU
   blocks come from a free queue, least recently freed first (as vLLM's free block queue).
2. **kvoff lookup and load.** The offload keys of the request's full offloaded blocks from
   ``g // block_size_factor`` on are looked up; the ``h`` leading hits are pinned
   (``prepare_load``), loaded CPU→GPU into freshly allocated GPU blocks (a partial first offloaded
   block when ``g`` is not a multiple of the factor), verified byte for byte against the pattern
   they were computed with, and unpinned. ``cpu_hit_tokens`` are the loaded tokens. All of the
   request's stored keys are then touched so that they are the most recent. A lookup that says
   "retry later" (a needed block is still being stored) waits for the stores in flight.
3. **Compute.** Every GPU block after the hits is "computed": written with a deterministic
   pattern derived from (hash id, block position, layer). With ``compute``, the prefill's cost
   runs too: GEMMs proportional to the computed tokens on the compute stream.
4. **Store.** Offloaded blocks that are full and contain computed tokens are stored GPU→CPU in one
   all-or-nothing ``prepare_store`` (when the pool cannot make room, nothing is stored and
   ``stores_skipped`` counts the blocks). With ``store_threshold`` >= 2 the manager's admission
   filter first skips blocks offered fewer times than that (a request that computed a block
   offers it; ``stores_filtered`` counts them). The store runs in the background (on a GPU it
   overlaps the next request); ``complete_store`` runs when the worker reports it finished. A
   GPU block that is the source of a store in flight is not rewritten before that store
   finishes (a fence, docs/design.md invariant 4): the next request that gets the block orders
   its compute after the store (:meth:`kvoff.OffloadingWorker.fence`, a stream-ordered wait on
   a GPU: the host is never blocked on it).
5. **Recency.** The request's stored keys are touched last-to-first so that its head is the most
   recent (docs/design.md invariant 8), and its full GPU blocks enter the GPU prefix cache the
   same way.

Only full blocks are ever cached. Block hashes: a GPU block at position ``p`` whose last token lies
in trace block ``t`` has the identity ``(hash_ids[t], p)`` — a Mooncake hash id already identifies
its whole prefix — and its offload key is a 16-byte BLAKE2b digest of that identity and the KV
cache group index (0 here).

**Devices.** ``device="cpu"`` (the default, what CI runs) keeps the "GPU" cache in CPU tensors.
``device="cuda"`` keeps it on the GPU, with a pinned pool, the worker's streams and
``mechanism="auto"``: the replay's transfers are real PCIe traffic. ``gpu_layout`` is
``layer_major`` (one tensor per layer) or ``block_contiguous`` (one buffer, all layers of a block
together).

**Compute** (``compute=True``). Each request also runs its prefill's cost, GEMMs for the
tokens it computes, and the run is timed against the engine's own prefix cache alone, interleaved
per chunk of ``interleave_requests`` requests (:mod:`kvoff.tools.replay_compute`). On a GPU the
loads, like the fences, are stream-ordered waits: the request's GEMMs start when its load is done
while the host goes on.
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from kvoff import _scheduler, sizing
from kvoff.models import ModelPreset, get_model_preset
from kvoff.tiers.block_format import BlockFormat, layout_fingerprint
from kvoff.tiers.coordinator import TieredPool, default_write_queue_blocks, make_tiers
from kvoff.tools.belady import MIN_POLICY, run_min_replay
from kvoff.tools.replay_compute import Interleaved, Marks, Prefill, Timer
from kvoff.tools.request_loop import (
    DEFAULT_COMPUTE_CHUNK_TOKENS,
    DEFAULT_CPU_BYTES,
    ReplayConfig,
    ReplayResult,
    RequestBlocks,
    StoreOutcome,
    check_pool_settings,
    offload_key,
    pool_config,
    replay_requests,
    run_request_loop,
)
from kvoff.tools.traces import TraceRequest
from kvoff.transfer import ALL_MECHANISMS
from kvoff.worker import GPU_LAYOUTS, CPUBlockSpec, GPUBlockSpec, OffloadingWorker

__all__ = [
    "DEFAULT_COMPUTE_CHUNK_TOKENS",
    "DEFAULT_CPU_BYTES",
    "ReplayConfig",
    "ReplayResult",
    "block_pattern",
    "offload_key",
    "pool_config",
    "replay_cpu_blocks",
    "run_replay",
]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2, _SEED = (
    _signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                         0xD6E8FEB86659FD93)
)  # fmt: skip


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    # SplitMix64 finaliser (Steele, Lea, Flood, "Fast splittable pseudorandom number
    # generators", OOPSLA 2014) on int64 tensors, whose arithmetic wraps modulo 2^64.
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def block_pattern(
    hash_ids: np.ndarray | torch.Tensor,
    positions: np.ndarray | torch.Tensor,
    layer: int,
    row_bytes: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The bytes a "computed" GPU block holds in one layer: ``(n, row_bytes)`` uint8 on
    ``device`` (computed there: on a GPU at memory speed, no host-to-device copy).

    Each 8-byte word ``w`` of block ``i`` is ``splitmix64(seed_i) ^ splitmix64(layer, w)`` with
    ``seed_i`` mixed from ``(hash_ids[i], positions[i])``, so every block, layer and word differs
    and a block loaded into the wrong place or from the wrong slot is detected.

    Args:
        hash_ids: ``(n,)`` int64 trace hash ids of the blocks.
        positions: ``(n,)`` int64 GPU block positions in the request.
        layer: layer index.
        row_bytes: bytes of one block of one layer; a multiple of 8.
        device: where to build the pattern.

    Raises:
        ValueError: when ``row_bytes`` is not a multiple of 8.
    """
    if row_bytes % 8:
        raise ValueError(f"row_bytes must be a multiple of 8, got {row_bytes}")
    h = torch.as_tensor(hash_ids, dtype=torch.int64).to(device)
    p = torch.as_tensor(positions, dtype=torch.int64).to(device)
    seed = _splitmix64(h * _SEED ^ p)
    words = _splitmix64(
        torch.arange(row_bytes // 8, dtype=torch.int64, device=device) + ((layer + 1) << 40)
    )
    return (seed[:, None] ^ words[None, :]).view(torch.uint8)


ASSIGNMENTS = ("round_robin", "session")
"""How ``--engines N`` splits the trace."""


@dataclass
class _Engine:
    """One engine of the replay: its worker (GPU cache and CPU pool), manager, tiers, GPU
    block allocator and prefix cache, and its stores in flight."""

    worker: OffloadingWorker
    gpu_rows: list[torch.Tensor]
    manager: Any
    pool: TieredPool | None
    free: deque[int]  # least recently freed first, as vLLM's free block queue
    gpu_cache: _GPUPrefixCache
    pending: dict[int, _Pending] = field(default_factory=dict)  # stores in flight
    loading: dict[int, list[bytes]] = field(default_factory=dict)  # loads in flight -> keys
    fences: dict[int, int] = field(default_factory=dict)  # GPU block -> store reading it

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.worker.close()
        if hasattr(self.manager, "close"):  # a node pool's client
            self.manager.close()


def _make_tiers(config: ReplayConfig, engine: int, fmt: BlockFormat) -> list[Any]:
    """The engine's secondary tiers: disk (its own folder), then remote (shared)."""
    path = config.disk_path
    if path is not None and config.engines > 1:
        path = os.path.join(path, f"engine-{engine}")
    return make_tiers(
        fmt, disk_path=path, disk_bytes=config.disk_bytes, remote_url=config.remote_url,
        remote_namespace=config.remote_namespace, remote_timeout_s=config.remote_timeout_s,
        shared_secret=config.shared_secret,
    )  # fmt: skip


def _make_engine(
    config: ReplayConfig, index: int, device: torch.device, num_gpu_blocks: int,
    num_cpu_blocks: int, factor: int, page: int, num_layers: int, policy: str,
    fingerprint: bytes,
) -> _Engine:  # fmt: skip
    """Engine ``index``: GPU cache in ``config.gpu_layout``, worker, manager and tiers."""
    if config.gpu_layout == "block_contiguous":
        buffer = torch.zeros((num_gpu_blocks, num_layers * page), dtype=torch.uint8,
                             device=device)  # fmt: skip
        kv_caches = {f"layer.{i}": buffer[:, i * page : (i + 1) * page] for i in range(num_layers)}
    else:
        kv_caches = {
            f"layer.{i}": torch.zeros((num_gpu_blocks, page), dtype=torch.uint8, device=device)
            for i in range(num_layers)
        }
    manager: Any
    if config.node_pool is not None:  # the node pool's index, its slots mapped here
        from kvoff.node_pool import NodePoolClient

        manager = NodePoolClient(config.node_pool, fingerprint, name=f"replay-engine-{index}",
                                 reserve=config.node_pool_reserve)  # fmt: skip
        worker = OffloadingWorker(
            num_gpu_blocks, manager.num_slots, factor, pin_memory=device.type == "cuda",
            mechanism=config.mechanism, shared_memory_name=manager.region,
            attach_shared_memory=True,
        )  # fmt: skip
    else:
        worker = OffloadingWorker(
            num_gpu_blocks, num_cpu_blocks, factor, pin_memory=device.type == "cuda",
            mechanism=config.mechanism,
        )  # fmt: skip
        manager = _scheduler.CPUOffloadingManager(
            num_cpu_blocks,
            policy,
            store_threshold=config.store_threshold,
            max_tracker_size=config.max_tracker_size,
        )
    worker.register_kv_caches(kv_caches)
    pool = None
    fmt = BlockFormat(fingerprint, worker.slot_bytes)
    tiers = _make_tiers(config, index, fmt)
    if tiers:
        slots = worker.cpu_pool.numpy()
        queue = config.tier_write_queue_blocks or default_write_queue_blocks(num_cpu_blocks)
        pool = TieredPool(manager, slots.__getitem__, tiers, write_queue_blocks=queue,
                          wait_when_full=True)  # fmt: skip
    free = deque(range(1, num_gpu_blocks))
    return _Engine(worker, worker.gpu_tensors(), manager, pool, free,
                   _GPUPrefixCache(config.gpu_prefix_blocks, free))  # fmt: skip


def _engine_of(req: TraceRequest, i: int, config: ReplayConfig) -> int:
    """The engine that serves request ``i`` (see ``ReplayConfig.assign``)."""
    if config.engines == 1:
        return 0
    if config.assign == "session" and req.hash_ids:
        return int(req.hash_ids[0]) % config.engines
    return i % config.engines


def _tier_totals(res: ReplayResult, engines: Sequence[_Engine]) -> None:
    """Per-tier totals over the engines: the pool's counters and the tiers' own stats summed
    (``*_gbps`` recomputed from the sums), plus the L1 hit tokens."""
    pools = [e.pool for e in engines if e.pool is not None]
    if not pools:
        return
    totals: dict[str, Any] = {}
    for pool in pools:
        st = pool.stats()
        for k, v in st.items():
            if k == "tiers":
                for name, tier in v.items():
                    t = totals.setdefault("tiers", {}).setdefault(name, {})
                    for tk, tv in tier.items():
                        if isinstance(tv, bool) or not isinstance(tv, int | float):
                            t[tk] = tv
                        elif not tk.endswith("_gbps"):
                            t[tk] = t.get(tk, 0) + tv
            elif isinstance(v, int | float):
                totals[k] = totals.get(k, 0) + v
    for t in totals.get("tiers", {}).values():
        rates = (
            ("read", "bytes_read", "read_seconds"),
            ("write", "bytes_written", "write_seconds"),
            ("promotion", "promoted_bytes", "promotion_seconds"),
        )
        for what, nbytes, sec in rates:
            if sec in t:
                t[f"{what}_gbps"] = t[nbytes] / t[sec] / 1e9 if t[sec] else 0.0
        res.tier_corrupted_blocks += int(t.get("corrupted_blocks", 0))
    res.tiers = totals
    res.tier_hit_tokens.setdefault("L1", 0)


class _GPUPrefixCache:
    """The engine's own prefix cache: full GPU blocks kept between requests, LRU."""

    def __init__(self, capacity: int, free: deque[int]) -> None:
        self.capacity = capacity
        self.free = free
        self.blocks: OrderedDict[tuple[int, int], int] = OrderedDict()  # last = most recent

    def leading_hits(self, idents: Sequence[tuple[int, int]]) -> int:
        n = 0
        for ident in idents:
            if ident not in self.blocks:
                break
            n += 1
        return n

    def admit(
        self, idents: Sequence[tuple[int, int]], block_ids: Sequence[int], in_use: set[int]
    ) -> set[int]:
        """Insert a finished request's full blocks, head most recent, and trim to capacity.

        Blocks trimmed away are freed unless they are in ``in_use`` (the request's own block
        table, which the caller frees). Returns the ids among ``block_ids`` the cache now owns.
        """
        if self.capacity == 0:
            return set()
        for ident, bid in zip(reversed(idents), reversed(block_ids), strict=True):
            old = self.blocks.get(ident)
            if old is not None and old != bid and old not in in_use:
                self.free.append(old)
            self.blocks[ident] = bid
            self.blocks.move_to_end(ident)
        while len(self.blocks) > self.capacity:
            _, bid = self.blocks.popitem(last=False)
            if bid not in in_use:
                self.free.append(bid)
        return {
            bid
            for ident, bid in zip(idents, block_ids, strict=True)
            if self.blocks.get(ident) == bid
        }


def _available_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


def _device(config: ReplayConfig) -> torch.device:
    try:
        device = torch.device(config.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={config.device!r} is not 'cpu' or 'cuda' (or 'cuda:N')")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' needs a GPU and a CUDA build of torch and kvoff, but "
            "torch.cuda.is_available() is False here; replay with --device cpu"
        )
    return device


@dataclass
class _Pending:
    keys: list[bytes]
    blocks: int
    gpu_ids: list[int]


def replay_cpu_blocks(config: ReplayConfig) -> tuple[int, int]:
    """``(CPU blocks, bytes per CPU block)`` of ``config``'s pool: ``cpu_blocks``, or
    ``cpu_bytes`` (2 GiB when neither is given) over the bytes of one offloaded block of
    ``config.model`` (one tensor per layer, :func:`kvoff.sizing.bytes_per_gpu_block` ×
    ``offloaded_block_size / block_size``).

    Raises:
        ValueError / pydantic.ValidationError: an unknown model or a bad pool setting.
    """
    preset = get_model_preset(config.model)
    offload_cfg = pool_config(config, None if config.policy == MIN_POLICY else config.policy)
    page = preset.layer_spec(config.block_size).page_size_bytes
    bytes_per_gpu_block = sizing.bytes_per_gpu_block([page] * preset.num_layers, 1)
    num = offload_cfg.resolve_num_cpu_blocks(bytes_per_gpu_block, config.block_size)
    return num, bytes_per_gpu_block * offload_cfg.block_size_factor(config.block_size)


def run_replay(
    config: ReplayConfig,
    progress: Callable[[int], None] | None = None,
    requests: list[TraceRequest] | None = None,
    before: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay ``config.trace`` through a kvoff CPU pool; see the module docstring for the loop.

    Args:
        config: what to replay and how.
        progress: called with the number of requests done after each request.
        requests: already loaded requests (else the trace is read).
        before: called with ``i`` before request ``i`` is served (see
            :func:`kvoff.tools.request_loop.run_request_loop`).

    Returns:
        The totals; ``corrupted_blocks`` counts loaded GPU blocks whose bytes differ from the
        pattern they were stored with (0 unless something is broken).

    Raises:
        ValueError: for a bad configuration (sizes, policy, model, device, layout, mechanism),
            ``device="cuda"`` without a GPU, or when the GPU cache and the CPU pool would not
            fit in this machine's (or GPU's) memory (the message says what to lower).
    """
    tiered = config.disk_path is not None or config.remote_url is not None
    if config.policy == MIN_POLICY and (tiered or config.engines > 1):
        raise ValueError(
            "policy 'min' simulates one CPU pool offline; drop the tiers and --engines"
        )
    if config.policy == MIN_POLICY and config.store_threshold >= 2:
        raise ValueError(
            f"policy 'min' is the offline optimum without an admission filter; drop "
            f"store_threshold={config.store_threshold} (--store-threshold) or pick an engine "
            "policy"
        )
    if config.policy == MIN_POLICY:  # Belady's MIN: an offline simulation of the same loop
        return run_min_replay(config, progress=progress, requests=requests)
    t_start = time.perf_counter()
    preset: ModelPreset = get_model_preset(config.model)
    bs = config.block_size
    obs = config.offloaded_block_size
    check_pool_settings(config)
    if config.gpu_layout not in GPU_LAYOUTS:
        raise ValueError(f"gpu_layout={config.gpu_layout!r} is not one of {list(GPU_LAYOUTS)}")
    if config.mechanism not in ALL_MECHANISMS:
        raise ValueError(f"mechanism={config.mechanism!r} is not one of {list(ALL_MECHANISMS)}")
    if config.compute_chunk_tokens < 1:
        raise ValueError(f"compute_chunk_tokens must be >= 1, got {config.compute_chunk_tokens}")
    if config.engines < 1:
        raise ValueError(f"engines must be >= 1, got {config.engines}")
    if config.node_pool is not None and (tiered or config.engines > 1 or config.compute
                                         or config.warmup_requests):  # fmt: skip
        raise ValueError(
            "a replay engine on a node pool has one engine, no tiers, no --compute and no "
            "--warmup yet; several engines on one node pool: kvoff replay --engines N --node-pool"
        )
    if config.interleave_requests < 1:
        raise ValueError(
            f"interleave_requests must be >= 1, got {config.interleave_requests}; give the "
            "requests served with kvoff before the same ones are served without it"
        )
    if config.assign not in ASSIGNMENTS:
        raise ValueError(f"assign={config.assign!r} is not one of {list(ASSIGNMENTS)}")
    if (config.disk_path is None) != (config.disk_bytes is None):
        raise ValueError(
            "a disk tier needs both disk_path and disk_bytes (--disk-path DIR --disk-bytes 8GiB)"
        )
    device = _device(config)
    cuda = device.type == "cuda"
    offload_cfg = pool_config(config, config.policy)
    factor = offload_cfg.block_size_factor(bs)
    spec = preset.layer_spec(bs)
    page = spec.page_size_bytes
    if page % 8:
        raise ValueError(f"page_size_bytes={page} of model {preset.name!r} is not a multiple of 8")
    # one tensor per layer, each block one page of it
    bytes_per_gpu_block = sizing.bytes_per_gpu_block([page] * preset.num_layers, 1)
    num_cpu_blocks = offload_cfg.resolve_num_cpu_blocks(bytes_per_gpu_block, bs)
    prefill = Prefill(preset, device, config.compute_chunk_tokens) if config.compute else None

    if config.warmup_requests < 0:
        raise ValueError(f"warmup_requests must be >= 0, got {config.warmup_requests}")
    reqs = replay_requests(config, requests)
    if config.warmup_requests >= len(reqs) > 0:
        raise ValueError(
            f"warmup_requests={config.warmup_requests} leaves none of the {len(reqs)} requests "
            "to replay; warm up with fewer or replay more (--limit)"
        )
    max_blocks = max((math.ceil(r.input_length / bs) for r in reqs), default=0)
    num_gpu_blocks = 1 + config.gpu_prefix_blocks + max_blocks  # block 0 is the null block
    # with compute, arm B (the engine's prefix cache alone) has a GPU cache of its own
    gpu_bytes = num_gpu_blocks * bytes_per_gpu_block * (2 if config.compute else 1)
    cpu_bytes = num_cpu_blocks * bytes_per_gpu_block * factor
    mem = _available_memory_bytes()
    host_bytes = config.engines * (cpu_bytes + (0 if cuda else gpu_bytes))
    if mem and host_bytes > 0.85 * mem:
        raise ValueError(
            f"model {preset.name!r} needs {gpu_bytes / 2**30:.1f} GiB for the GPU cache "
            f"({num_gpu_blocks} blocks: {config.gpu_prefix_blocks} prefix-cache blocks + "
            f"{max_blocks} for the longest request) and {cpu_bytes / 2**30:.1f} GiB for "
            f"{num_cpu_blocks} CPU blocks, more than 85% of this machine's "
            f"{mem / 2**30:.1f} GiB; lower --cpu-blocks/--cpu-bytes, --gpu-prefix-blocks or "
            "--limit" + ("" if preset.name == "tiny" else ", or use --model tiny")
        )
    if cuda:
        free_gpu, _ = torch.cuda.mem_get_info(device)
        if gpu_bytes > 0.8 * free_gpu:
            raise ValueError(
                f"the GPU cache needs {gpu_bytes / 2**30:.1f} GiB ({num_gpu_blocks} blocks), more "
                f"than 80% of the {free_gpu / 2**30:.1f} GiB free on {device}; lower "
                "--gpu-prefix-blocks or --limit"
            )

    fingerprint = layout_fingerprint(
        model=preset.name, num_layers=preset.num_layers, page_size_bytes=page, block_size=bs,
        offloaded_block_size=obs, dtype="uint8-pattern", world_size=1, rank=0,
    )  # fmt: skip
    engines = [
        _make_engine(config, e, device, num_gpu_blocks, num_cpu_blocks, factor, page,
                     preset.num_layers, offload_cfg.eviction_policy, fingerprint)
        for e in range(config.engines)
    ]  # fmt: skip
    res = ReplayResult(
        trace=config.trace,
        model=preset.name,
        block_size=bs,
        offloaded_block_size=obs,
        gpu_prefix_blocks=config.gpu_prefix_blocks,
        cpu_blocks=num_cpu_blocks,
        policy=offload_cfg.eviction_policy,
        device=str(device),
        gpu_layout=config.gpu_layout,
        store_threshold=offload_cfg.store_threshold,
        max_tracker_size=offload_cfg.max_tracker_size,
        gpu_blocks=num_gpu_blocks,
        cpu_pool_bytes=engines[0].worker.cpu_pool_bytes,
        engines=config.engines,
    )
    warm, reqs = reqs[: config.warmup_requests], reqs[config.warmup_requests :]
    pool = _EnginePool(config, reqs, engines, res, device, page, factor, prefill)
    arms = None
    if prefill is not None:
        arms, without = _interleaved(config, reqs, pool, num_gpu_blocks, factor, page,
                                     preset.num_layers, fingerprint)  # fmt: skip
    if warm:
        _warm_up(config, warm, pool)
        if arms is not None:
            _warm_up(config, warm, without)
        if arms is not None:
            arms.restart()

    def after(done: int) -> None:
        if arms is not None:
            arms.after(done)
        if progress is not None:
            progress(done)

    run_request_loop(
        reqs, pool, res, offload_key, trace_block_size=config.trace_block_size, progress=after,
        before=before,
    )  # fmt: skip
    for e in engines:
        pool.finish(e, e.worker.wait([*e.pending, *e.loading]))
        if e.pool is not None:
            e.pool.wait()
    res.corrupted_blocks += int(pool.corrupted)
    res.stores_filtered = sum(e.manager.stores_skipped for e in engines)
    res.store_gbps = res.bytes_stored / res.store_seconds / 1e9 if res.store_seconds else 0.0
    res.load_gbps = res.bytes_loaded / res.load_seconds / 1e9 if res.load_seconds else 0.0
    if arms is not None:
        arms.totals(res, without.res)
        for e in without.engines:
            e.close()
    _tier_totals(res, engines)
    for e in engines:
        e.close()
    res.wall_s = time.perf_counter() - t_start
    return res


def _warm_up(config: ReplayConfig, warm: list[TraceRequest], pool: _EnginePool) -> None:
    """Serves ``warm`` through ``pool``'s engines to fill their caches, untimed and uncounted
    (nothing computed; bytes still move and are checked), then waits for its jobs. A broken
    block is still reported in ``pool.res``."""
    res = replace(pool.res, mechanisms={}, tier_hit_tokens={}, tiers={},
                  per_request_gpu_hit_tokens=[], per_request_cpu_hit_tokens=[])  # fmt: skip
    warmer = _EnginePool(config, warm, pool.engines, res, pool.device, pool.page, pool.factor,
                         None, offload=pool.offload)  # fmt: skip
    run_request_loop(warm, warmer, res, offload_key, trace_block_size=config.trace_block_size)
    for e in warmer.engines:
        warmer.finish(e, e.worker.wait([*e.pending, *e.loading]))
        if e.pool is not None:
            e.pool.wait()
    pool.job_id = warmer.job_id  # job ids stay unique per worker
    pool.res.corrupted_blocks += int(warmer.corrupted)
    pool.res.failed_transfers += res.failed_transfers
    pool.res.warmup_requests = len(warm)


def _interleaved(
    config: ReplayConfig, reqs: list[TraceRequest], pool: _EnginePool, num_gpu_blocks: int,
    factor: int, page: int, num_layers: int, fingerprint: bytes,
) -> tuple[Interleaved, _EnginePool]:  # fmt: skip
    """With ``compute``: arm B (the same engines with their own GPU cache and prefix cache,
    without kvoff: a one-slot pool that is never used, no tiers) and the interleaving."""
    assert pool.prefill is not None
    bare = replace(config, disk_path=None, disk_bytes=None, remote_url=None)
    engines = [
        _make_engine(bare, e, pool.device, num_gpu_blocks, 1, factor, page, num_layers, "lru",
                     fingerprint)
        for e in range(config.engines)
    ]  # fmt: skip
    res = ReplayResult(
        trace=config.trace, model=pool.res.model, block_size=config.block_size,
        offloaded_block_size=config.offloaded_block_size,
        gpu_prefix_blocks=config.gpu_prefix_blocks, cpu_blocks=0, policy="none",
    )  # fmt: skip
    without = _EnginePool(config, reqs, engines, res, pool.device, page, factor, pool.prefill,
                          offload=False)  # fmt: skip

    def serve(lo: int, hi: int) -> list[Marks]:
        without.offset, first = lo, len(without.marks)
        run_request_loop(reqs[lo:hi], without, res, offload_key,
                         trace_block_size=config.trace_block_size)  # fmt: skip
        return without.marks[first:]

    arms = Interleaved(config.interleave_requests, len(reqs), pool.timer, pool.prefill,
                       pool.marks, serve)  # fmt: skip
    return arms, without


class _EnginePool:
    """The replay's side of :func:`kvoff.tools.request_loop.run_request_loop`: steps 1-5 of the
    module docstring on the engine that serves each request, with real transfers."""

    def __init__(
        self, config: ReplayConfig, requests: Sequence[TraceRequest], engines: list[_Engine],
        res: ReplayResult, device: torch.device, page: int, factor: int,
        prefill: Prefill | None, offload: bool = True,
    ) -> None:  # fmt: skip
        self.config, self.requests, self.engines, self.res = config, requests, engines, res
        self.device, self.page, self.factor, self.prefill = device, page, factor, prefill
        self.offload = offload  # False: the engine's own prefix cache alone (no kvoff)
        self.timer = Timer(device)
        self.marks: list[Marks] = []
        self.offset = 0  # index in ``requests`` of the loop's request 0 (a chunk's first)
        self.job_id = 0
        # loaded blocks that differ from their pattern, counted where they are checked (on a
        # GPU a device tensor: reading it back per request would stall the host)
        self.corrupted = torch.zeros((), dtype=torch.int64, device=device)
        # the request being served
        self.e = engines[0]
        self.blocks: RequestBlocks | None = None
        self.idents: list[tuple[int, int]] = []
        self.table: list[int] = []
        self.start_mark: object = None

    def finish(self, e: _Engine, results: Sequence[Any]) -> None:
        """complete_store for finished stores (the manager queues their write-through to the
        tiers; the replay first waits for room, having no compute to hide the tiers behind);
        their GPU blocks may be reused again."""
        res, pending, fences = self.res, e.pending, e.fences
        for r in results:
            res.mechanisms[r.mechanism] = res.mechanisms.get(r.mechanism, 0) + 1
            loaded = e.loading.pop(r.job_id, None)
            if loaded is not None:
                self._loaded(e, loaded, r)
                continue
            job = pending.pop(r.job_id, None)
            if job is None:
                continue
            if r.success and e.pool is not None:
                e.pool.wait_for_write_room(len(job.keys))
            e.manager.complete_store(job.keys, r.success)
            for b in job.gpu_ids:
                if fences.get(b) == r.job_id:
                    del fences[b]
            if r.success:
                res.blocks_stored += job.blocks
                res.bytes_stored += r.num_bytes
                res.store_seconds += r.seconds
            else:
                res.failed_transfers += 1

    def _loaded(self, e: _Engine, keys: list[bytes], r: Any) -> None:
        """A load's result: its slots are unpinned, its bytes and seconds counted."""
        e.manager.complete_load(keys)
        if not r.success:
            self.res.failed_transfers += 1
            return
        self.res.bytes_loaded += r.num_bytes
        self.res.load_seconds += r.seconds

    def begin(self, index: int, blocks: RequestBlocks, keys: list[bytes]) -> int:
        """1. the engine's GPU prefix cache; the request's compute is ordered after the stores
        that still read its fresh blocks (fences: a stream-ordered wait on a GPU, the host is
        not held)."""
        index += self.offset
        e = self.e = self.engines[_engine_of(self.requests[index], index, self.config)]
        self.finish(e, e.worker.get_finished())
        self.blocks = blocks
        self.start_mark = self.timer.mark() if self.prefill is not None else None
        num_full = blocks.num_full
        num_req_blocks = len(blocks.block_hids)  # the last may be partial
        self.idents = []
        g = 0
        if self.config.gpu_prefix_blocks:
            hids = blocks.block_hids[:num_full].tolist()
            self.idents = list(zip(hids, range(num_full), strict=True))
            g = e.gpu_cache.leading_hits(self.idents)
        table = [e.gpu_cache.blocks[self.idents[p]] for p in range(g)]
        table += [e.free.popleft() for _ in range(num_req_blocks - g)]
        self.table = table
        fenced = sorted({e.fences[b] for b in table[g:] if b in e.fences})
        if fenced:
            self.res.fence_waits += 1
            t0 = time.perf_counter()
            e.worker.fence(fenced)
            self.res.fence_wait_s += time.perf_counter() - t0
        return g

    def lookup(self, keys: list[bytes]) -> int:
        """2. kvoff lookup; a block being stored or promoted from a tier: wait, retry (an
        engine would schedule other requests meanwhile; a serial replay has none)."""
        if not self.offload:
            return 0
        e, res = self.e, self.res
        lookup = e.manager.lookup if e.pool is None else e.pool.lookup
        h = lookup(keys)
        tries = 0
        if self.config.node_pool is not None:
            # another engine may be storing the block: it finishes on its own, give it 1 s
            t0 = time.perf_counter()
            while h is None and tries < 1000:
                res.lookup_retries += tries == 0
                tries += 1
                self.finish(e, e.worker.get_finished())
                time.sleep(0.001)
                h = lookup(keys)
            res.retry_wait_s += time.perf_counter() - t0
            if h is None:
                res.lost_lookups += 1
                return 0
            return h
        while h is None:
            res.lookup_retries += 1
            tries += 1
            t0 = time.perf_counter()
            self.finish(e, e.worker.wait([*e.pending, *e.loading]))
            if e.pool is not None:
                e.pool.wait_reads()
            res.retry_wait_s += time.perf_counter() - t0
            h = (lookup if tries < 4 else e.manager.lookup)(keys)
            if h is None and tries >= 4:  # pragma: no cover - nothing is in flight any more
                raise RuntimeError("lookup still returns 'retry later' with nothing in flight")
        return h

    def load(self, keys: list[bytes], first: int, end: int) -> bool:
        """2. the load of the GPU blocks after the GPU hits. On a GPU the request's compute is
        ordered after it on the stream (the host goes on; the slots stay pinned until its
        result is taken); on the CPU it is done on return."""
        e, res, factor = self.e, self.res, self.factor
        if self.config.node_pool is not None:
            from kvoff.node_pool import NodePoolError

            try:
                cpu_ids = e.manager.prepare_load(keys)
            except NodePoolError:  # evicted by another engine since the lookup, or pool gone
                res.lost_lookups += 1
                return False
        else:
            cpu_ids = e.manager.prepare_load(keys)
        self.job_id += 1
        t0 = time.perf_counter()
        ok = e.worker.transfer_async(
            self.job_id,
            CPUBlockSpec(tuple(cpu_ids)),
            GPUBlockSpec.single_group(self.table[first:end], block_index=first),
        )
        if self.device.type == "cuda" and ok:
            e.loading[self.job_id] = keys
            e.worker.fence([self.job_id])
            res.load_wait_s += time.perf_counter() - t0
        else:
            (result,) = e.worker.wait([self.job_id])
            res.load_wait_s += time.perf_counter() - t0
            res.mechanisms[result.mechanism] = res.mechanisms.get(result.mechanism, 0) + 1
            self._loaded(e, keys, result)  # a failed load is counted there
            if not (ok and result.success):
                return False
        if e.pool is not None:  # hit tokens by where each offloaded block came from
            for j, key in enumerate(keys, first // factor):
                blocks = min((j + 1) * factor, end) - max(j * factor, first)
                src = e.pool.take_source(key)
                res.tier_hit_tokens[src] = res.tier_hit_tokens.get(src, 0) + blocks * res.block_size
        return True

    def touch(self, keys: list[bytes]) -> None:
        if self.offload:
            self.e.manager.touch(keys)

    def compute(self, gpu_hits: int, hit_end: int) -> None:
        """3. the prefill's cost (GEMMs for the computed tokens), the loaded blocks checked byte
        for byte, then the KV the prefill writes."""
        assert self.blocks is not None
        g, device, page, table = gpu_hits, self.device, self.page, self.table
        block_hids, length = self.blocks.block_hids, self.blocks.input_length
        positions = np.arange(len(block_hids), dtype=np.int64)
        computed = length - hit_end * self.res.block_size
        if self.prefill is not None:
            gemm_start = self.timer.mark()
            self.prefill.run(computed)
            self.marks.append(
                Marks(self.start_mark, gemm_start, self.timer.mark(), length, computed)
            )
        rows_of = self.e.gpu_rows
        if hit_end > g:  # loaded
            ids = torch.tensor(table[g:hit_end], dtype=torch.int64, device=device)
            bad = torch.zeros(hit_end - g, dtype=torch.bool, device=device)
            for layer, rows in enumerate(rows_of):
                want = block_pattern(block_hids[g:hit_end], positions[g:hit_end], layer, page,
                                     device)  # fmt: skip
                bad |= (rows[ids] != want).any(dim=1)
            self.res.blocks_verified += hit_end - g
            self.corrupted += bad.sum()
        if hit_end < len(block_hids):
            ids = torch.tensor(table[hit_end:], dtype=torch.int64, device=device)
            for layer, rows in enumerate(rows_of):
                rows[ids] = block_pattern(block_hids[hit_end:], positions[hit_end:], layer, page,
                                          device)  # fmt: skip

    def store(self, keys: list[bytes], first: int) -> StoreOutcome | None:
        """4. full offloaded blocks that hold computed tokens, stored in the background (the
        stored blocks are counted when the store finishes)."""
        e, factor = self.e, self.factor
        if not self.offload:
            return StoreOutcome(stored=0, evicted=0)
        out = e.manager.prepare_store(keys)
        if out is None:
            return None
        if out.keys_to_store:
            index = {k: j for j, k in enumerate(keys, first)}
            js = [index[k] for k in out.keys_to_store]
            gpu_ids = [self.table[j * factor + i] for j in js for i in range(factor)]
            self.job_id += 1
            e.pending[self.job_id] = _Pending(list(out.keys_to_store), len(js), gpu_ids)
            for b in gpu_ids:
                e.fences[b] = self.job_id
            e.worker.transfer_async(
                self.job_id,
                GPUBlockSpec.single_group(gpu_ids, block_index=js[0] * factor),
                CPUBlockSpec(tuple(out.block_ids)),
            )
        return StoreOutcome(stored=0, evicted=len(out.evicted_keys))

    def end(self, keys: list[bytes]) -> None:
        """5. recency; the engine keeps the full GPU blocks in its prefix cache, the rest is
        freed (a freed block under a store in flight is fenced when it is allocated again)."""
        e, table = self.e, self.table
        if self.offload:
            e.manager.touch(keys)
        if self.config.node_pool is not None:
            # engines on a node pool take turns: the next may be another process, which
            # would find these stores still pending (a replay of hit rates, not of time);
            # completions go without a reply, so the pool is asked to have handled them
            self.finish(e, e.worker.wait([*e.pending, *e.loading]))
            e.manager.sync()
        if self.config.gpu_prefix_blocks:
            num_full = len(self.idents)
            owned = e.gpu_cache.admit(self.idents, table[:num_full], set(table))
            e.free.extend(bid for bid in table if bid not in owned)
        else:
            e.free.extend(table)
