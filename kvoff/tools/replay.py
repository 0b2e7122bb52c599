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
   request's stored keys are then touched so that they are the most recent.
3. **Compute.** Every GPU block after the hits is "computed": written with a deterministic
   pattern derived from (hash id, block position, layer).
4. **Store.** Offloaded blocks that are full and contain computed tokens are stored GPU→CPU in one
   all-or-nothing ``prepare_store`` (when the pool cannot make room, nothing is stored and
   ``stores_skipped`` counts the blocks), then ``complete_store``.
5. **Recency.** The request's stored keys are touched last-to-first so that its head is the most
   recent (DESIGN.md invariant 8), and its full GPU blocks enter the GPU prefix cache the same way.

Only full blocks are ever cached. Block hashes: a GPU block at position ``p`` whose last token lies
in trace block ``t`` has the identity ``(hash_ids[t], p)`` — a Mooncake hash id already identifies
its whole prefix — and its offload key is a 16-byte BLAKE2b digest of that identity and the KV
cache group index (0 here).
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
from kvoff.tools.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_trace
from kvoff.worker import CPUBlockSpec, GPUBlockSpec, OffloadingWorker

__all__ = [
    "ReplayConfig",
    "ReplayResult",
    "block_pattern",
    "offload_key",
    "run_replay",
]

DEFAULT_CPU_BYTES = 2 * 1024**3
_U64 = np.uint64


def offload_key(hash_id: int, position: int, group: int = 0) -> bytes:
    """Offload key of the GPU block at ``position`` whose last token is in the trace block
    ``hash_id`` (for an offloaded block: the key of its last GPU block), KV cache group
    ``group``: 16 bytes of BLAKE2b over the little-endian (hash_id, position, group)."""
    return hashlib.blake2b(struct.pack("<qqi", hash_id, position, group), digest_size=16).digest()


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # SplitMix64 finaliser (Steele, Lea, Flood, "Fast splittable pseudorandom number
    # generators", OOPSLA 2014); uint64 arithmetic wraps in numpy.
    with np.errstate(over="ignore"):
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def block_pattern(
    hash_ids: np.ndarray, positions: np.ndarray, layer: int, row_bytes: int
) -> torch.Tensor:
    """The bytes a "computed" GPU block holds in one layer: ``(n, row_bytes)`` uint8.

    Each 8-byte word ``w`` of block ``i`` is ``splitmix64(seed_i) ^ splitmix64(layer, w)`` with
    ``seed_i`` mixed from ``(hash_ids[i], positions[i])``, so every block, layer and word differs
    and a block loaded into the wrong place or from the wrong slot is detected.

    Args:
        hash_ids: ``(n,)`` int64 trace hash ids of the blocks.
        positions: ``(n,)`` int64 GPU block positions in the request.
        layer: layer index.
        row_bytes: bytes of one block of one layer; a multiple of 8.

    Raises:
        ValueError: when ``row_bytes`` is not a multiple of 8.
    """
    if row_bytes % 8:
        raise ValueError(f"row_bytes must be a multiple of 8, got {row_bytes}")
    with np.errstate(over="ignore"):
        seed = _splitmix64(
            hash_ids.astype(_U64) * _U64(0xD6E8FEB86659FD93) ^ positions.astype(_U64)
        )
        words = _splitmix64(np.arange(row_bytes // 8, dtype=_U64) + _U64((layer + 1) << 40))
    rows = seed[:, None] ^ words[None, :]
    return torch.from_numpy(rows.view(np.int64)).view(torch.uint8)


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
        policy: eviction policy name.
        limit: replay only the first ``limit`` requests.
        trace_block_size: tokens per trace hash id (512 for Mooncake).
    """

    trace: str = "conversation"
    model: str = "tiny"
    block_size: int = 16
    offloaded_block_size: int = 512
    gpu_prefix_blocks: int = 0
    cpu_blocks: int | None = None
    cpu_bytes: int | None = None
    policy: str = "lru"
    limit: int | None = None
    trace_block_size: int = MOONCAKE_BLOCK_SIZE


@dataclass
class ReplayResult:
    """Totals of a replay (tokens, blocks, bytes, seconds) plus per-request hit tokens."""

    trace: str
    model: str
    block_size: int
    offloaded_block_size: int
    gpu_prefix_blocks: int
    cpu_blocks: int
    policy: str
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
    gpu_blocks: int = 0
    cpu_pool_bytes: int = 0
    wall_s: float = 0.0
    per_request_gpu_hit_tokens: list[int] = field(default_factory=list, repr=False)
    per_request_cpu_hit_tokens: list[int] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """All totals (no per-request lists), as a JSON-ready dict."""
        d = asdict(self)
        d.pop("per_request_gpu_hit_tokens")
        d.pop("per_request_cpu_hit_tokens")
        return d


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
        ValueError: for a bad configuration (sizes, policy, model), or when the GPU cache and the
            CPU pool would not fit in this machine's memory (the message says what to lower).
    """
    t_start = time.perf_counter()
    preset: ModelPreset = get_model_preset(config.model)
    bs = config.block_size
    obs = config.offloaded_block_size
    tbs = config.trace_block_size
    if config.gpu_prefix_blocks < 0:
        raise ValueError(f"gpu_prefix_blocks must be >= 0, got {config.gpu_prefix_blocks}")
    if config.cpu_blocks is not None and config.cpu_bytes is not None:
        raise ValueError("give cpu_blocks or cpu_bytes, not both")
    offload_cfg = OffloadingConfig(
        num_cpu_blocks=config.cpu_blocks,
        cpu_bytes_to_use=(
            config.cpu_bytes
            if config.cpu_bytes is not None or config.cpu_blocks is not None
            else DEFAULT_CPU_BYTES
        ),
        offloaded_block_size=obs,
        eviction_policy=config.policy,
    )
    factor = offload_cfg.block_size_factor(bs)
    spec = preset.layer_spec(bs)
    page = spec.page_size_bytes
    if page % 8:
        raise ValueError(f"page_size_bytes={page} of model {preset.name!r} is not a multiple of 8")
    bytes_per_gpu_block = page * preset.num_layers
    num_cpu_blocks = offload_cfg.resolve_num_cpu_blocks(bytes_per_gpu_block, bs)

    reqs = requests if requests is not None else load_trace(config.trace, config.limit, tbs)
    if requests is not None and config.limit is not None:
        reqs = reqs[: config.limit]
    max_blocks = max((math.ceil(r.input_length / bs) for r in reqs), default=0)
    num_gpu_blocks = 1 + config.gpu_prefix_blocks + max_blocks  # block 0 is the null block
    gpu_bytes = num_gpu_blocks * bytes_per_gpu_block
    cpu_bytes = num_cpu_blocks * bytes_per_gpu_block * factor
    mem = _available_memory_bytes()
    if mem and gpu_bytes + cpu_bytes > 0.85 * mem:
        raise ValueError(
            f"model {preset.name!r} needs {gpu_bytes / 2**30:.1f} GiB for the GPU cache "
            f"({num_gpu_blocks} blocks: {config.gpu_prefix_blocks} prefix-cache blocks + "
            f"{max_blocks} for the longest request) and {cpu_bytes / 2**30:.1f} GiB for "
            f"{num_cpu_blocks} CPU blocks, more than 85% of this machine's "
            f"{mem / 2**30:.1f} GiB; lower --cpu-blocks/--cpu-bytes, --gpu-prefix-blocks or "
            "--limit, or use --model tiny"
        )

    kv_caches = {
        f"layer.{i}": torch.zeros((num_gpu_blocks, page), dtype=torch.uint8)
        for i in range(preset.num_layers)
    }
    worker = OffloadingWorker(num_gpu_blocks, num_cpu_blocks, factor, pin_memory=False)
    worker.register_kv_caches(kv_caches)
    gpu_rows = worker.gpu_tensors()
    manager = _scheduler.CPUOffloadingManager(num_cpu_blocks, offload_cfg.eviction_policy)

    free = list(range(num_gpu_blocks - 1, 0, -1))
    gpu_cache = _GPUPrefixCache(config.gpu_prefix_blocks, free)
    res = ReplayResult(
        trace=config.trace,
        model=preset.name,
        block_size=bs,
        offloaded_block_size=obs,
        gpu_prefix_blocks=config.gpu_prefix_blocks,
        cpu_blocks=num_cpu_blocks,
        policy=offload_cfg.eviction_policy,
        gpu_blocks=num_gpu_blocks,
        cpu_pool_bytes=worker.cpu_pool_bytes,
    )
    seen_keys: set[bytes] = set()
    max_hit_tokens = 0
    job_id = 0

    def patterns(hids: np.ndarray, pos: np.ndarray, layer: int) -> torch.Tensor:
        return block_pattern(hids, pos, layer, page)

    for n_done, req in enumerate(reqs, 1):
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

        # 1. engine's GPU prefix cache
        idents: list[tuple[int, int]] = []
        g = 0
        if config.gpu_prefix_blocks:
            idents = list(zip(block_hids[:num_full].tolist(), range(num_full), strict=True))
            g = gpu_cache.leading_hits(idents)
        table = [gpu_cache.blocks[idents[p]] for p in range(g)]
        table += [free.pop() for _ in range(num_req_blocks - g)]

        # 2. kvoff lookup + load of the blocks after the GPU hits
        g_off = g // factor
        h = manager.lookup(keys[g_off:]) if g_off < num_full_off else 0
        if h is None:  # pragma: no cover - every job completes before the next request
            raise RuntimeError("lookup returned None in a synchronous replay")
        load_end = (g_off + h) * factor
        hit_end = g
        if load_end > g:
            load_keys = keys[g_off : g_off + h]
            cpu_ids = manager.prepare_load(load_keys)
            job_id += 1
            ok = worker.transfer_async(
                job_id,
                CPUBlockSpec(tuple(cpu_ids)),
                GPUBlockSpec.single_group(table[g:load_end], block_index=g),
            )
            (result,) = worker.wait([job_id])
            manager.complete_load(load_keys)
            if ok and result.success:
                hit_end = load_end
                res.blocks_loaded += load_end - g
                res.bytes_loaded += result.num_bytes
                res.load_seconds += result.seconds
                ids = torch.tensor(table[g:load_end], dtype=torch.int64)
                bad = torch.zeros(load_end - g, dtype=torch.bool)
                for layer, rows in enumerate(gpu_rows):
                    want = patterns(block_hids[g:load_end], positions[g:load_end], layer)
                    bad |= (rows[ids] != want).any(dim=1)
                res.blocks_verified += load_end - g
                res.corrupted_blocks += int(bad.sum())
            else:
                res.failed_transfers += 1
        manager.touch(keys)

        # 3. compute the rest
        if hit_end < num_req_blocks:
            ids = torch.tensor(table[hit_end:], dtype=torch.int64)
            for layer, rows in enumerate(gpu_rows):
                rows[ids] = patterns(block_hids[hit_end:], positions[hit_end:], layer)

        # 4. store full offloaded blocks that hold computed tokens
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
                    ok = worker.transfer_async(
                        job_id,
                        GPUBlockSpec.single_group(gpu_ids, block_index=js[0] * factor),
                        CPUBlockSpec(tuple(out.block_ids)),
                    )
                    (result,) = worker.wait([job_id])
                    success = ok and result.success
                    manager.complete_store(out.keys_to_store, success)
                    if success:
                        res.blocks_stored += len(js)
                        res.bytes_stored += result.num_bytes
                        res.store_seconds += result.seconds
                    else:
                        res.failed_transfers += 1
        manager.touch(keys)

        # 5. the engine keeps the full GPU blocks in its prefix cache; the rest is freed
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
        if progress is not None:
            progress(n_done)

    res.hit_tokens = res.gpu_hit_tokens + res.cpu_hit_tokens
    res.hit_rate = res.hit_tokens / res.input_tokens if res.input_tokens else 0.0
    res.max_hit_rate = max_hit_tokens / res.input_tokens if res.input_tokens else 0.0
    res.store_gbps = res.bytes_stored / res.store_seconds / 1e9 if res.store_seconds else 0.0
    res.load_gbps = res.bytes_loaded / res.load_seconds / 1e9 if res.load_seconds else 0.0
    res.wall_s = time.perf_counter() - t_start
    return res
