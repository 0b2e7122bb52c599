"""``kvoff replay``: an engine-style loop that replays a real request trace through kvoff.

Each request of a Mooncake-format trace is served like an engine serves a prefill:

1. **GPU prefix cache.** The engine's own cache (LRU over full GPU blocks, at most
   ``gpu_prefix_blocks`` kept between requests; 0 disables it) gives the leading run of full GPU
   blocks it already holds: ``g`` blocks, ``gpu_hit_tokens = g × block_size``.
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
   GPU block that is the source of a store in flight is not reused before that store finishes
   (a fence, docs/design.md invariant 4).
5. **Recency.** The request's stored keys are touched last-to-first so that its head is the most
   recent (docs/design.md invariant 8), and its full GPU blocks enter the GPU prefix cache the same way.

Only full blocks are ever cached. Block hashes: a GPU block at position ``p`` whose last token lies
in trace block ``t`` has the identity ``(hash_ids[t], p)`` — a Mooncake hash id already identifies
its whole prefix — and its offload key is a 16-byte BLAKE2b digest of that identity and the KV
cache group index (0 here).

**Devices.** ``device="cpu"`` (the default, what CI runs) keeps the "GPU" cache in CPU tensors.
``device="cuda"`` keeps it on the GPU, with a pinned pool, the worker's streams and
``mechanism="auto"``: the replay's transfers are real PCIe traffic. ``gpu_layout`` is
``layer_major`` (one tensor per layer) or ``block_contiguous`` (one buffer, all layers of a block
together).

**Compute** (``compute=True``). A prefill of ``T`` tokens costs ``2 × num_params × T`` FLOPs
(Kaplan et al. 2020): the replay runs that many GEMM FLOPs, as ``(c × hidden) @ (hidden ×
intermediate)`` GEMMs over chunks of ``c ≤ compute_chunk_tokens`` tokens, on the compute stream,
for the tokens each request computes. Per request it records (CUDA events; ``perf_counter`` on
the CPU) the time from the request's start to the end of its GEMMs, which includes waiting for
its loads, while earlier requests' stores stream beside it. A second pass then times the GEMMs
alone: for every input token (recomputing everything, the baseline) and for the tokens computed.
Reported: ``time_kvoff_s`` and ``time_recompute_s``, ``speedup`` (their ratio) against the ideal
``1 / (1 - hit_rate)`` (``speedup_vs_ideal``), and ``gemm_lost_s``: GEMM time lost to the
transfers running beside it.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from kvoff import _scheduler
from kvoff.config import OffloadingConfig
from kvoff.models import ModelPreset, get_model_preset
from kvoff.tiers.block_format import BlockFormat, layout_fingerprint
from kvoff.tiers.coordinator import TieredPool, default_write_queue_blocks, make_tiers
from kvoff.tools.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_trace
from kvoff.transfer import ALL_MECHANISMS
from kvoff.worker import GPU_LAYOUTS, CPUBlockSpec, GPUBlockSpec, OffloadingWorker

__all__ = [
    "ReplayConfig",
    "ReplayResult",
    "block_pattern",
    "offload_key",
    "run_replay",
]

DEFAULT_CPU_BYTES = 2 * 1024**3
DEFAULT_COMPUTE_CHUNK_TOKENS = 2048


def offload_key(hash_id: int, position: int, group: int = 0) -> bytes:
    """Offload key of the GPU block at ``position`` whose last token is in the trace block
    ``hash_id`` (for an offloaded block: the key of its last GPU block), KV cache group
    ``group``: 16 bytes of BLAKE2b over the little-endian (hash_id, position, group)."""
    return hashlib.blake2b(struct.pack("<qqi", hash_id, position, group), digest_size=16).digest()


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
        limit: replay only the first ``limit`` requests.
        trace_block_size: tokens per trace hash id (512 for Mooncake).
        device: ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``): where the "GPU" cache lives.
        gpu_layout: ``"layer_major"`` or ``"block_contiguous"``.
        mechanism: the worker's transfer mechanism (``"auto"``: within the default slowdown
            budget).
        compute: also run the prefill's GEMMs and report the time against recomputing.
        compute_chunk_tokens: tokens per GEMM chunk of the prefill cost (a chunked prefill).
        disk_path: a folder for a disk tier below the CPU pool (with ``disk_bytes``; one
            sub-folder per engine when ``engines > 1``).
        disk_bytes: bytes of the disk tier (per engine).
        remote_url: ``redis://host:port`` of a Redis Cluster shared by the engines.
        remote_namespace: key prefix in the remote tier (runs with the same namespace, model
            and layout share blocks).
        remote_timeout_s: seconds after which a remote operation is a miss (or a dropped
            write).
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
    trace_block_size: int = MOONCAKE_BLOCK_SIZE
    device: str = "cpu"
    gpu_layout: str = "layer_major"
    mechanism: str = "auto"
    compute: bool = False
    compute_chunk_tokens: int = DEFAULT_COMPUTE_CHUNK_TOKENS
    disk_path: str | None = None
    disk_bytes: int | None = None
    remote_url: str | None = None
    remote_namespace: str = "kvoff-replay"
    remote_timeout_s: float = 0.25
    engines: int = 1
    assign: str = "round_robin"
    tier_write_queue_blocks: int | None = None


ASSIGNMENTS = ("round_robin", "session")
"""How ``--engines N`` splits the trace."""


@dataclass
class ReplayResult:
    """Totals of a replay (tokens, blocks, bytes, seconds) plus per-request hit tokens.

    The ``time_*``, ``speedup*`` and ``gemm_*`` fields are set with ``compute`` (seconds; see
    the module docstring), ``None`` otherwise.

    ``stores_skipped`` counts offloaded blocks not stored because ``prepare_store`` found no
    room; ``stores_filtered`` those the ``store_threshold`` admission filter skipped (the
    manager's ``stores_skipped``).

    Host seconds the request loop spent blocked, where a request waits before its compute:
    ``fence_wait_s`` on stores still reading GPU blocks it was given (``fence_waits`` times),
    ``retry_wait_s`` on jobs in flight before a lookup answered "retry later"
    (``lookup_retries`` times), ``load_wait_s`` from submitting its load to the load's end.
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
    gemm_s: float | None = None
    gemm_alone_s: float | None = None
    gemm_lost_s: float | None = None
    compute_flops_per_token: float | None = None
    engines: int = 1
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


@dataclass
class _Engine:
    """One engine of the replay: its worker (GPU cache and CPU pool), manager, tiers, GPU
    block allocator and prefix cache, and its stores in flight."""

    worker: OffloadingWorker
    gpu_rows: list[torch.Tensor]
    manager: Any
    pool: TieredPool | None
    free: list[int]
    gpu_cache: _GPUPrefixCache
    pending: dict[int, _Pending] = field(default_factory=dict)  # stores in flight
    fences: dict[int, int] = field(default_factory=dict)  # GPU block -> store reading it

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.worker.close()


def _make_tiers(config: ReplayConfig, engine: int, fmt: BlockFormat) -> list[Any]:
    """The engine's secondary tiers: disk (its own folder), then remote (shared)."""
    path = config.disk_path
    if path is not None and config.engines > 1:
        path = os.path.join(path, f"engine-{engine}")
    return make_tiers(
        fmt, disk_path=path, disk_bytes=config.disk_bytes, remote_url=config.remote_url,
        remote_namespace=config.remote_namespace, remote_timeout_s=config.remote_timeout_s,
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
    worker = OffloadingWorker(
        num_gpu_blocks, num_cpu_blocks, factor, pin_memory=device.type == "cuda",
        mechanism=config.mechanism,
    )  # fmt: skip
    worker.register_kv_caches(kv_caches)
    manager = _scheduler.CPUOffloadingManager(
        num_cpu_blocks,
        policy,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
    )
    pool = None
    fmt = BlockFormat(fingerprint, worker.slot_bytes)
    tiers = _make_tiers(config, index, fmt)
    if tiers:
        slots = worker.cpu_pool.numpy()
        queue = config.tier_write_queue_blocks or default_write_queue_blocks(num_cpu_blocks)
        pool = TieredPool(manager, slots.__getitem__, tiers, write_queue_blocks=queue,
                          wait_when_full=True)  # fmt: skip
    free = list(range(num_gpu_blocks - 1, 0, -1))
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


class _Timer:
    """Marks on the compute stream (CUDA events) or host timestamps (CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a: object, b: object) -> float:
        if self.cuda:
            b.synchronize()  # type: ignore[attr-defined]
            return a.elapsed_time(b) / 1e3  # type: ignore[attr-defined]
        return float(b) - float(a)  # type: ignore[arg-type]


class _Prefill:
    """The prefill's cost: ``2 × num_params`` FLOPs per token as GEMMs on the current stream.

    A chunk of ``c`` tokens runs ``reps = round(num_params / (hidden × intermediate))`` GEMMs
    ``(c × hidden) @ (hidden × intermediate)`` (bf16 on a GPU, float32 on the CPU)."""

    def __init__(self, preset: ModelPreset, device: torch.device, chunk_tokens: int) -> None:
        if not (preset.hidden_size and preset.intermediate_size and preset.num_params):
            raise ValueError(
                f"model {preset.name!r} has no compute shape (hidden_size, intermediate_size, "
                "num_params); use a preset that has one for --compute"
            )
        h, i = preset.hidden_size, preset.intermediate_size
        self.reps = max(1, round(preset.num_params / (h * i)))
        self.flops_per_token = 2.0 * h * i * self.reps
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gen = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(chunk_tokens, h, dtype=dtype, device=device, generator=gen)
        self.w = torch.randn(h, i, dtype=dtype, device=device, generator=gen) / h**0.5
        self.out = torch.empty(chunk_tokens, i, dtype=dtype, device=device)
        self.chunk = chunk_tokens

    def run(self, tokens: int) -> None:
        for start in range(0, tokens, self.chunk):
            c = min(self.chunk, tokens - start)
            for _ in range(self.reps):
                torch.matmul(self.x[:c], self.w, out=self.out[:c])


class _GPUPrefixCache:
    """The engine's own prefix cache: full GPU blocks kept between requests, LRU."""

    def __init__(self, capacity: int, free: list[int]) -> None:
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


@dataclass
class _Marks:
    start: object
    gemm_start: object
    gemm_end: object
    input_tokens: int
    computed_tokens: int


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


def run_replay(
    config: ReplayConfig,
    progress: Callable[[int], None] | None = None,
    requests: list[TraceRequest] | None = None,
) -> ReplayResult:
    """Replay ``config.trace`` through a kvoff CPU pool; see the module docstring for the loop.

    Args:
        config: what to replay and how.
        progress: called with the number of requests done after each request.
        requests: already loaded requests (else the trace is read).

    Returns:
        The totals; ``corrupted_blocks`` counts loaded GPU blocks whose bytes differ from the
        pattern they were stored with (0 unless something is broken).

    Raises:
        ValueError: for a bad configuration (sizes, policy, model, device, layout, mechanism),
            ``device="cuda"`` without a GPU, or when the GPU cache and the CPU pool would not
            fit in this machine's (or GPU's) memory (the message says what to lower).
    """
    tiered = config.disk_path is not None or config.remote_url is not None
    if config.policy == "min" and (tiered or config.engines > 1):
        raise ValueError(
            "policy 'min' simulates one CPU pool offline; drop the tiers and --engines"
        )
    if config.policy == "min" and config.store_threshold >= 2:
        raise ValueError(
            f"policy 'min' is the offline optimum without an admission filter; drop "
            f"store_threshold={config.store_threshold} (--store-threshold) or pick an engine "
            "policy"
        )
    if config.policy == "min":  # Belady's MIN: an offline simulation of the same loop
        from kvoff.tools.belady import run_min_replay

        return run_min_replay(config, progress=progress, requests=requests)
    t_start = time.perf_counter()
    preset: ModelPreset = get_model_preset(config.model)
    bs = config.block_size
    obs = config.offloaded_block_size
    tbs = config.trace_block_size
    if config.gpu_prefix_blocks < 0:
        raise ValueError(f"gpu_prefix_blocks must be >= 0, got {config.gpu_prefix_blocks}")
    if config.cpu_blocks is not None and config.cpu_bytes is not None:
        raise ValueError("give cpu_blocks or cpu_bytes, not both")
    if config.gpu_layout not in GPU_LAYOUTS:
        raise ValueError(f"gpu_layout={config.gpu_layout!r} is not one of {list(GPU_LAYOUTS)}")
    if config.mechanism not in ALL_MECHANISMS:
        raise ValueError(f"mechanism={config.mechanism!r} is not one of {list(ALL_MECHANISMS)}")
    if config.compute_chunk_tokens < 1:
        raise ValueError(f"compute_chunk_tokens must be >= 1, got {config.compute_chunk_tokens}")
    if config.engines < 1:
        raise ValueError(f"engines must be >= 1, got {config.engines}")
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
    bytes_per_gpu_block = page * preset.num_layers
    num_cpu_blocks = offload_cfg.resolve_num_cpu_blocks(bytes_per_gpu_block, bs)
    prefill = _Prefill(preset, device, config.compute_chunk_tokens) if config.compute else None

    reqs = requests if requests is not None else load_trace(config.trace, config.limit, tbs)
    if requests is not None and config.limit is not None:
        reqs = reqs[: config.limit]
    max_blocks = max((math.ceil(r.input_length / bs) for r in reqs), default=0)
    num_gpu_blocks = 1 + config.gpu_prefix_blocks + max_blocks  # block 0 is the null block
    gpu_bytes = num_gpu_blocks * bytes_per_gpu_block
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
    seen_keys: set[bytes] = set()
    max_hit_tokens = 0
    job_id = 0
    timer = _Timer(device)
    marks: list[_Marks] = []

    def finish(e: _Engine, results: Sequence[Any]) -> None:
        """complete_store for finished stores (the manager queues their write-through to the
        tiers; the replay first waits for room, having no compute to hide the tiers behind);
        their GPU blocks may be reused again."""
        pending, fences = e.pending, e.fences
        for r in results:
            res.mechanisms[r.mechanism] = res.mechanisms.get(r.mechanism, 0) + 1
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

    def serve(e: _Engine, req: TraceRequest) -> None:
        """One request on engine ``e`` (steps 1-5 of the module docstring)."""
        nonlocal job_id, max_hit_tokens
        worker, manager, pending, fences = e.worker, e.manager, e.pending, e.fences
        free, gpu_cache, gpu_rows = e.free, e.gpu_cache, e.gpu_rows
        finish(e, worker.get_finished())
        length = req.input_length
        hash_ids = np.asarray(req.hash_ids, dtype=np.int64)
        num_req_blocks = math.ceil(length / bs)  # GPU blocks, the last may be partial
        num_full = length // bs  # full GPU blocks
        num_full_off = length // obs  # full offloaded blocks
        positions = np.arange(num_req_blocks, dtype=np.int64)
        # trace block of each GPU block's last token (clamped for the partial last block)
        last_tok = np.minimum((positions + 1) * bs, length) - 1
        block_hids = hash_ids[last_tok // tbs]
        off_pos = (np.arange(num_full_off, dtype=np.int64) + 1) * factor - 1
        keys = [offload_key(int(block_hids[p]), int(p)) for p in off_pos]

        lead = 0
        while lead < num_full_off and keys[lead] in seen_keys:
            lead += 1
        max_hit_tokens += lead * obs
        seen_keys.update(keys)
        start_mark = timer.mark() if prefill is not None else None

        # 1. engine's GPU prefix cache; fresh blocks wait for stores that still read them
        idents: list[tuple[int, int]] = []
        g = 0
        if config.gpu_prefix_blocks:
            idents = list(zip(block_hids[:num_full].tolist(), range(num_full), strict=True))
            g = gpu_cache.leading_hits(idents)
        table = [gpu_cache.blocks[idents[p]] for p in range(g)]
        table += [free.pop() for _ in range(num_req_blocks - g)]
        fenced = sorted({fences[b] for b in table[g:] if b in fences})
        if fenced:
            res.fence_waits += 1
            t0 = time.perf_counter()
            finish(e, worker.wait(fenced))
            res.fence_wait_s += time.perf_counter() - t0

        # 2. kvoff lookup + load of the blocks after the GPU hits
        g_off = g // factor
        lookup = manager.lookup if e.pool is None else e.pool.lookup
        h = lookup(keys[g_off:]) if g_off < num_full_off else 0
        tries = 0
        while h is None:  # a block is being stored or promoted from a tier: wait, retry
            res.lookup_retries += 1
            tries += 1
            t0 = time.perf_counter()
            finish(e, worker.wait(list(pending)))
            if e.pool is not None:
                e.pool.wait_reads()
            res.retry_wait_s += time.perf_counter() - t0
            h = (lookup if tries < 4 else manager.lookup)(keys[g_off:])
            if h is None and tries >= 4:  # pragma: no cover - nothing is in flight any more
                raise RuntimeError("lookup still returns 'retry later' with nothing in flight")
        load_end = (g_off + h) * factor
        hit_end = g
        loaded_ok = False
        if load_end > g:
            load_keys = keys[g_off : g_off + h]
            cpu_ids = manager.prepare_load(load_keys)
            job_id += 1
            t0 = time.perf_counter()
            ok = worker.transfer_async(
                job_id,
                CPUBlockSpec(tuple(cpu_ids)),
                GPUBlockSpec.single_group(table[g:load_end], block_index=g),
            )
            (result,) = worker.wait([job_id])
            res.load_wait_s += time.perf_counter() - t0
            manager.complete_load(load_keys)
            res.mechanisms[result.mechanism] = res.mechanisms.get(result.mechanism, 0) + 1
            if ok and result.success:
                loaded_ok = True
                hit_end = load_end
                if e.pool is not None:  # hit tokens by where each offloaded block came from
                    for j, key in enumerate(load_keys, g_off):
                        blocks = min((j + 1) * factor, load_end) - max(j * factor, g)
                        src = e.pool.take_source(key)
                        res.tier_hit_tokens[src] = res.tier_hit_tokens.get(src, 0) + blocks * bs
                res.blocks_loaded += load_end - g
                res.bytes_loaded += result.num_bytes
                res.load_seconds += result.seconds
            else:
                res.failed_transfers += 1
        manager.touch(keys)

        # 3. compute: the prefill's cost (GEMMs for the computed tokens), then the KV it writes
        computed = length - hit_end * bs
        if prefill is not None:
            gemm_start = timer.mark()
            prefill.run(computed)
            marks.append(_Marks(start_mark, gemm_start, timer.mark(), length, computed))
        if loaded_ok:
            ids = torch.tensor(table[g:load_end], dtype=torch.int64, device=device)
            bad = torch.zeros(load_end - g, dtype=torch.bool, device=device)
            for layer, rows in enumerate(gpu_rows):
                want = block_pattern(block_hids[g:load_end], positions[g:load_end], layer, page,
                                     device)  # fmt: skip
                bad |= (rows[ids] != want).any(dim=1)
            res.blocks_verified += load_end - g
            res.corrupted_blocks += int(bad.sum())
        if hit_end < num_req_blocks:
            ids = torch.tensor(table[hit_end:], dtype=torch.int64, device=device)
            for layer, rows in enumerate(gpu_rows):
                rows[ids] = block_pattern(block_hids[hit_end:], positions[hit_end:], layer, page,
                                          device)  # fmt: skip
        res.computed_tokens += computed

        # 4. store full offloaded blocks that hold computed tokens, in the background
        first_new = hit_end // factor
        if first_new < num_full_off:
            out = manager.prepare_store(keys[first_new:])
            if out is None:
                res.stores_skipped += num_full_off - first_new
            else:
                res.evictions += len(out.evicted_keys)
                if out.keys_to_store:
                    index = {k: j for j, k in enumerate(keys)}
                    js = [index[k] for k in out.keys_to_store]
                    gpu_ids = [table[j * factor + i] for j in js for i in range(factor)]
                    job_id += 1
                    pending[job_id] = _Pending(list(out.keys_to_store), len(js), gpu_ids)
                    for b in gpu_ids:
                        fences[b] = job_id
                    worker.transfer_async(
                        job_id,
                        GPUBlockSpec.single_group(gpu_ids, block_index=js[0] * factor),
                        CPUBlockSpec(tuple(out.block_ids)),
                    )
        manager.touch(keys)

        # 5. the engine keeps the full GPU blocks in its prefix cache; the rest is freed (a
        #    freed block under a store in flight is fenced when it is allocated again)
        if config.gpu_prefix_blocks:
            owned = gpu_cache.admit(idents, table[:num_full], set(table))
            free.extend(bid for bid in table if bid not in owned)
        else:
            free.extend(table)

        gpu_hit = g * bs
        cpu_hit = (hit_end - g) * bs
        res.requests += 1
        res.input_tokens += length
        res.gpu_hit_tokens += gpu_hit
        res.cpu_hit_tokens += cpu_hit
        res.per_request_gpu_hit_tokens.append(gpu_hit)
        res.per_request_cpu_hit_tokens.append(cpu_hit)

    for n_done, req in enumerate(reqs, 1):
        serve(engines[_engine_of(req, n_done - 1, config)], req)
        if progress is not None:
            progress(n_done)
    for e in engines:
        finish(e, e.worker.wait(list(e.pending)))
        if e.pool is not None:
            e.pool.wait()
    res.stores_filtered = sum(e.manager.stores_skipped for e in engines)
    res.hit_tokens = res.gpu_hit_tokens + res.cpu_hit_tokens
    res.hit_rate = res.hit_tokens / res.input_tokens if res.input_tokens else 0.0
    res.max_hit_rate = max_hit_tokens / res.input_tokens if res.input_tokens else 0.0
    res.store_gbps = res.bytes_stored / res.store_seconds / 1e9 if res.store_seconds else 0.0
    res.load_gbps = res.bytes_loaded / res.load_seconds / 1e9 if res.load_seconds else 0.0
    if prefill is not None:
        _compute_totals(res, prefill, marks, timer)
    _tier_totals(res, engines)
    for e in engines:
        e.close()
    res.wall_s = time.perf_counter() - t_start
    return res


def _compute_totals(
    res: ReplayResult, prefill: _Prefill, marks: list[_Marks], timer: _Timer
) -> None:
    """Fill the compute fields: the kvoff pass's marks, then the GEMMs alone (second pass)."""
    res.time_kvoff_s = sum(timer.seconds(m.start, m.gemm_end) for m in marks)
    res.gemm_s = sum(timer.seconds(m.gemm_start, m.gemm_end) for m in marks)
    full = 0.0
    alone = 0.0
    for m in marks:
        a = timer.mark()
        prefill.run(m.input_tokens)
        b = timer.mark()
        prefill.run(m.computed_tokens)
        c = timer.mark()
        full += timer.seconds(a, b)
        alone += timer.seconds(b, c)
    res.time_recompute_s = full
    res.gemm_alone_s = alone
    res.gemm_lost_s = res.gemm_s - alone
    res.compute_flops_per_token = prefill.flops_per_token
    res.speedup = full / res.time_kvoff_s if res.time_kvoff_s else None
    res.ideal_speedup = 1.0 / (1.0 - res.hit_rate) if res.hit_rate < 1 else None
    if res.speedup is not None and res.ideal_speedup is not None:
        res.speedup_vs_ideal = res.speedup / res.ideal_speedup
