"""``kvoff bench tiers`` (engine side): what the secondary tiers cost the engine thread.

The engine calls the L1 manager on every step (``lookup``, ``prepare_store``, ``complete_store``,
``touch``); with tiers on, ``lookup`` goes through :class:`kvoff.tiers.coordinator.TieredPool` (it
promotes from the tiers on an L1 miss) and ``complete_store`` pins the stored blocks and queues
their write-through inside the C++ manager (``set_write_through``). The tier I/O itself runs on
background threads. This benchmark times the engine thread's calls per round, the same workload
both ways, rounds alternated (tiers off, tiers on, off, on, ...) so that the machine's noise hits
both alike, and reports the median per-call time and the ratio (target: tiers on within 5 % of
tiers off, issue 14).

Workload per round: ``lookup`` of ``batch`` keys stored earlier (L1 hits), ``prepare_store`` of
``batch`` new keys (evicting as many on a full pool), their bytes written into the slots (the
worker's copy: not timed), ``complete_store`` (with tiers: queued for write-through, or dropped
when the queue is full), then ``touch``. Only the engine's calls are timed. Keys never miss L1 in
the lookups, so the tiers' promotion path (which returns "retry later" by design) is not timed;
its engine-thread part is one ``poll``.
"""

from __future__ import annotations

import math
import mmap
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from kvoff import _scheduler
from kvoff.tiers.block_format import BlockFormat, layout_fingerprint
from kvoff.tiers.coordinator import TieredPool
from kvoff.tiers.disk import DiskTier
from kvoff.tools.bench_steps import StepWorkload

__all__ = ["bench_engine_calls", "bench_promotion", "bench_scheduler_steps_tiers"]


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"\x00"


def bench_engine_calls(
    *,
    num_blocks: int = 4096,
    block_bytes: int = 16384,
    batch: int = 32,
    rounds: int = 400,
    repeat: int = 5,
    disk_path: str | None = None,
) -> dict[str, Any]:
    """Engine-thread time per round, tiers off vs on (a real disk tier).

    Args:
        num_blocks: L1 slots.
        block_bytes: bytes per block (slot).
        batch: keys per call.
        rounds: rounds per timed repeat (each round: lookup, store, touch of ``batch`` keys).
        repeat: timed repeats per configuration (alternated); medians are reported.
        disk_path: folder of the disk tier (default: a temporary folder).

    Returns:
        ``{"parameters", "tiers_off_us_per_round", "tiers_on_us_per_round", "ratio",
        "tier_stats"}`` (µs per round: medians over repeats).

    Raises:
        ValueError: a size below 1, or ``num_blocks < 4 × batch``.
    """
    for name, v in (("num_blocks", num_blocks), ("block_bytes", block_bytes), ("batch", batch),
                    ("rounds", rounds), ("repeat", repeat)):  # fmt: skip
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if num_blocks < 4 * batch:
        raise ValueError(f"num_blocks={num_blocks} must be >= 4 x batch={batch}")
    fmt = BlockFormat(layout_fingerprint(bench="tiered-pool", block_bytes=block_bytes), block_bytes)
    tmp = tempfile.TemporaryDirectory(prefix="kvoff-bench-tiers-") if disk_path is None else None
    path = disk_path if disk_path is not None else tmp.name  # type: ignore[union-attr]
    disk_bytes = (rounds * batch + 64) * (block_bytes + 8192) + (1 << 20)
    setups: dict[str, Any] = {}
    for mode in ("off", "on"):
        manager = _scheduler.CPUOffloadingManager(num_blocks, "lru")
        slots = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
        pool = None
        if mode == "on":
            disk = DiskTier(f"{path}/bench", disk_bytes, fmt)
            pool = TieredPool(manager, slots.__getitem__, [disk], write_queue_blocks=4 * batch)
        setups[mode] = (manager, slots, pool)
    payload = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8)
    next_key = {"off": 0, "on": 0}
    times: dict[str, list[float]] = {"off": [], "on": []}

    clock = time.perf_counter

    def store(mode: str, keys: list[bytes]) -> float:
        """Stores ``keys``; returns the seconds spent in the engine's calls (not in the copy
        into the slots, which is the worker's)."""
        manager, slots, _pool = setups[mode]
        t0 = clock()
        out = manager.prepare_store(keys)
        t1 = clock()
        if out is None:
            return t1 - t0
        for b in out.block_ids:
            slots[b] = payload
        t2 = clock()
        manager.complete_store(out.keys_to_store, True)
        return (t1 - t0) + (clock() - t2)

    for mode in ("off", "on"):  # fill half the pool
        keys = [_key(i) for i in range(num_blocks // 2)]
        for i in range(0, len(keys), batch):
            store(mode, keys[i : i + batch])
        next_key[mode] = len(keys)
        if setups[mode][2] is not None:
            setups[mode][2].wait()
    for _ in range(repeat):
        for mode in ("off", "on"):
            manager, _slots, pool = setups[mode]
            lookup = manager.lookup if pool is None else pool.lookup
            t = 0.0
            for _r in range(rounds):
                n = next_key[mode]
                held = [_key(i) for i in range(n - batch, n)]
                new = [_key(i) for i in range(n, n + batch)]
                t0 = clock()
                hits = lookup(held)
                t += clock() - t0
                t += store(mode, new)
                t0 = clock()
                manager.touch(new)
                t += clock() - t0
                if hits != batch:
                    raise RuntimeError(f"bench: lookup of held keys gave {hits} of {batch}")
                next_key[mode] = n + batch
            times[mode].append(t / rounds)
            if pool is not None:
                pool.wait()  # the next repeat starts with an empty write queue
    pool = setups["on"][2]
    stats = pool.stats() if pool is not None else {}
    if pool is not None:
        pool.close()
    if tmp is not None:
        tmp.cleanup()
    off = statistics.median(times["off"]) * 1e6
    on = statistics.median(times["on"]) * 1e6
    return {
        "parameters": {
            "num_blocks": num_blocks,
            "block_bytes": block_bytes,
            "batch": batch,
            "rounds": rounds,
            "repeat": repeat,
        },
        "tiers_off_us_per_round": off,
        "tiers_on_us_per_round": on,
        "ratio": on / off if off else None,
        "tier_stats": stats,
    }


def bench_scheduler_steps_tiers(
    *,
    num_requests: int = 256,
    num_groups: int = 1,
    decode_steps: int = 256,
    num_cpu_blocks: int = 32768,
    block_bytes: int = 16384,
    repeat: int = 3,
    step_gap_s: float = 0.002,
    disk_path: str | None = None,
) -> dict[str, Any]:
    """The engine step of kvoff's C++ ``OffloadingScheduler`` with secondary tiers off and on,
    side by side: two schedulers run the workload of
    :func:`kvoff.tools.bench_steps.bench_scheduler_steps` (``num_requests`` running requests
    decoding, a block completed and stored every 16 steps per request and group, every store
    reported complete after its step); the second has a real disk tier attached
    (``attach_tiers``) after its prefill step, so every store completed in the timed decode
    steps is written through (pinned, queued, written by the tier's threads, unpinned). Their
    decode steps alternate (off, on, then on, off, ...), each followed by ``step_gap_s`` of
    sleep, so the machine's drift hits both alike.

    Args:
        num_requests, num_groups, decode_steps, num_cpu_blocks: as
            :func:`~kvoff.tools.bench_steps.bench_scheduler_steps`.
        block_bytes: bytes per CPU slot written to the disk tier (the CPU pool is a numpy
            array of ``num_cpu_blocks × block_bytes`` bytes, touched only where written).
        repeat: pairs of fresh schedulers; every step of every pair counts.
        step_gap_s: the engine's forward pass after each step (slept, untimed; a real decode
            step takes 10 ms or more): without it the loop would produce blocks far faster
            than any engine, and the bounded write queue would drop most of them.
        disk_path: folder of the disk tier (default: a temporary folder).

    Returns:
        ``{"parameters", "tiers_off_step_us", "tiers_on_step_us", "ratio", "ratio_of_means",
        "per_repeat", "tier_stats"}``: µs per decode step (``build_connector_meta``), medians
        over all steps; ``per_repeat`` gives each pair's medians.

    Raises:
        ValueError: a parameter out of range (as ``bench_scheduler_steps``), ``block_bytes``
            or ``repeat`` below 1, a negative ``step_gap_s``.
    """
    if block_bytes < 1 or repeat < 1 or step_gap_s < 0:
        raise ValueError(
            f"need block_bytes >= 1, repeat >= 1 and step_gap_s >= 0, got {block_bytes}, "
            f"{repeat}, {step_gap_s}"
        )
    fmt = BlockFormat(layout_fingerprint(bench="scheduler-tiers", block_bytes=block_bytes),
                      block_bytes)  # fmt: skip
    tmp = tempfile.TemporaryDirectory(prefix="kvoff-bench-tiers-") if disk_path is None else None
    path = disk_path if disk_path is not None else tmp.name  # type: ignore[union-attr]
    slots = np.zeros((num_cpu_blocks, block_bytes), dtype=np.uint8)
    disk_bytes = 4096 * (block_bytes + 8192) + (1 << 20)
    off_s: list[float] = []
    on_s: list[float] = []
    per_repeat: list[dict[str, float]] = []
    stats: dict[str, Any] = {}
    try:
        for r in range(repeat):
            kw = {"decode_steps": decode_steps, "num_cpu_blocks": num_cpu_blocks, "seed": r}
            work = {m: StepWorkload(num_requests, num_groups, **kw) for m in ("off", "on")}
            disk = DiskTier(f"{path}/run{r}", disk_bytes, fmt)
            pool = work["on"].sched.attach_tiers([disk], slots.__getitem__)
            for step in range(decode_steps):
                for mode in ("off", "on") if step % 2 == 0 else ("on", "off"):
                    work[mode].decode_step()
                    if step_gap_s > 0:
                        time.sleep(step_gap_s)
            pool.wait()
            stats = pool.stats()
            work["on"].sched.close()
            off_s += work["off"].facade_s
            on_s += work["on"].facade_s
            per_repeat.append({
                "off": statistics.median(work["off"].facade_s) * 1e6,
                "on": statistics.median(work["on"].facade_s) * 1e6,
            })  # fmt: skip
    finally:
        if tmp is not None:
            tmp.cleanup()
    off = statistics.median(off_s) * 1e6
    on = statistics.median(on_s) * 1e6
    return {
        "parameters": {
            "num_requests": num_requests,
            "num_groups": num_groups,
            "decode_steps": decode_steps,
            "num_cpu_blocks": num_cpu_blocks,
            "block_bytes": block_bytes,
            "repeat": repeat,
            "step_gap_s": step_gap_s,
        },
        "tiers_off_step_us": off,
        "tiers_on_step_us": on,
        "ratio": on / off,
        "ratio_of_means": statistics.fmean(on_s) / statistics.fmean(off_s),
        "per_repeat": per_repeat,
        "tier_stats": stats,
    }


def bench_promotion(
    *,
    block_sizes: tuple[int, ...] = (65536, 524288, 2097152),
    request_bytes: int = 64 << 20,
    repeat: int = 5,
    device: str | None = None,
    disk_path: str | None = None,
) -> dict[str, Any]:
    """What a promotion from the disk tier costs on top of the disk read itself (issue 14's
    target: a promotion from disk to GPU adds no more than the disk read time + 10 %).

    Per block size, one request's worth of blocks (``request_bytes // block_size``, at least 1)
    is written to a real :class:`~kvoff.tiers.DiskTier` (O_DIRECT where the file system allows
    it, so no page cache on either side). Then, ``repeat`` times rounded up to an even number,
    in alternating order (as many passes read first as promote first):

    * **disk read**: the tier's own ``get`` of those keys into page-aligned buffers (header and
      xxh3 checked), the floor of any promotion;
    * **promotion**: the engine's path through :class:`~kvoff.tiers.coordinator.TieredPool` on
      an empty L1 whose slots are the worker's CPU pool: ``lookup`` (an L1 miss: "retry
      later", a probe starts), ``wait_reads`` (probe, L1 slots, the tier's ``get`` into them,
      ``complete_store``), the retried ``lookup`` (all hits); then the load into the device's
      KV cache: ``prepare_load``, :meth:`kvoff.OffloadingWorker.transfer_async` of the CPU
      blocks into GPU blocks, ``wait``, ``complete_load``. The loaded blocks are checked byte
      for byte in every pass (untimed), and L1 is emptied (``clear``) after it.

    An engine polls the tiers once per step, so in an engine a promotion also waits for step
    boundaries; this measures the data path alone.

    Reported per block size: median seconds of each, the medians of the per-pass ratios
    ``promote_ratio`` (to L1 / disk read) and ``load_ratio`` (to L1 and into the KV cache /
    disk read), and ``promote_ratio_balanced`` / ``load_ratio_balanced``: total time over all
    passes / total read time. The balanced ratios are the ones to hold against the target
    (``load_ratio_balanced <= 1.10`` on a GPU): on virtual disks the second of a pass's two
    reads of the same blocks is served faster (the host's cache sits below the guest's
    O_DIRECT: 10-20 % on the CI-like EPYC machine and on an H200 machine, 2026-11-26), so a
    pass's ratio depends on its order, and a median over an odd number of passes or over
    unbalanced orders favours one side. On a CPU build the "device" is
    CPU memory, so the load is a host memcpy of the same bytes, not a DMA.

    Args:
        block_sizes: bytes per block (positive multiples of 8 KiB: the KV cache is bf16 blocks
            of 16 tokens × 2 (K, V) × heads × 128 lanes, 8 KiB per head).
        request_bytes: bytes of one request's blocks.
        repeat: passes (>= 1; rounded up to an even number).
        device: the KV cache's device (default: ``cuda`` when kvoff's CUDA kernels and a GPU
            are there, else ``cpu``).
        disk_path: folder of the disk tiers (default: a temporary folder).

    Returns:
        ``{"parameters", "results": [per block size: block_size, blocks, bytes, direct_io,
        read_s, promote_s, load_s, promote_ratio, load_ratio, promote_ratio_balanced,
        load_ratio_balanced, passes]}``.

    Raises:
        ValueError: a block size that is not a positive multiple of 8 KiB, ``repeat`` < 1 or
            ``request_bytes`` < 1.
    """
    import torch

    import kvoff._build_info as info

    for bs in block_sizes:
        if bs < _LANE_BYTES or bs % _LANE_BYTES:
            raise ValueError(f"block size {bs} must be a positive multiple of {_LANE_BYTES} bytes")
    if repeat < 1 or request_bytes < 1:
        raise ValueError(f"need repeat >= 1 and request_bytes >= 1, got {repeat}, {request_bytes}")
    if device is None:
        device = "cuda" if info.WITH_CUDA and torch.cuda.is_available() else "cpu"
    tmp = tempfile.TemporaryDirectory(prefix="kvoff-bench-promo-") if disk_path is None else None
    path = disk_path if disk_path is not None else tmp.name  # type: ignore[union-attr]
    try:
        results = [
            _promotion_one_size(bs, request_bytes, repeat, device, f"{path}/promo-{bs}")
            for bs in block_sizes
        ]
    finally:
        if tmp is not None:
            tmp.cleanup()
    return {
        "parameters": {
            "block_sizes": list(block_sizes),
            "request_bytes": request_bytes,
            "repeat": repeat,
            "device": device,
        },
        "results": results,
    }


_LANE_BYTES = 16 * 2 * 128 * 2  # one head of a bf16 block: 16 tokens × (K, V) × 128 × 2 bytes


def _promotion_one_size(
    block_size: int, request_bytes: int, repeat: int, device: str, path: str
) -> dict[str, Any]:
    """:func:`bench_promotion` for one block size."""
    import torch

    from kvoff import CPUBlockSpec, GPUBlockSpec, OffloadingWorker
    from kvoff.tiers.disk import SUPERBLOCK_BYTES, slot_bytes_for

    n = max(1, request_bytes // block_size)
    heads = block_size // _LANE_BYTES
    kv = torch.zeros((n + 1, 2, 16, heads, 128), dtype=torch.bfloat16, device=device)
    worker = OffloadingWorker(num_gpu_blocks=n + 1, num_cpu_blocks=n)
    worker.register_kv_caches({"layer0": kv})
    slots = worker.cpu_pool.numpy()
    assert slots.shape == (n, block_size), slots.shape
    fmt = BlockFormat(layout_fingerprint(bench="promotion", block_size=block_size), block_size)
    disk = DiskTier(path, SUPERBLOCK_BYTES + n * slot_bytes_for(fmt), fmt)
    manager = _scheduler.CPUOffloadingManager(n, "lru")
    pool = TieredPool(manager, slots.__getitem__, [disk])
    keys = [_key(i) for i in range(n)]
    rng = np.random.default_rng(block_size)
    payloads = [rng.integers(0, 256, block_size, dtype=np.uint8) for _ in range(n)]
    passes: list[dict[str, Any]] = []
    try:
        if disk.put(keys, payloads) != [True] * n:
            raise RuntimeError(f"the disk tier at {path} refused the benchmark's blocks")
        outs = [np.frombuffer(mmap.mmap(-1, block_size), dtype=np.uint8) for _ in range(n)]
        gpu_ids = list(range(1, n + 1))  # block 0 is the engine's null block

        def read() -> float:
            t0 = time.perf_counter()
            served = disk.get(keys, outs)
            seconds = time.perf_counter() - t0
            if served != [True] * n:
                raise RuntimeError("the disk tier did not serve every block")
            return seconds

        def promote_and_load(job: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            if pool.lookup(keys) is not None:
                raise RuntimeError("L1 was not empty before a promotion pass")
            pool.wait_reads()
            hits = pool.lookup(keys)
            t1 = time.perf_counter()
            if hits != n:
                raise RuntimeError(f"the promotion brought {hits} of {n} blocks into L1")
            cpu_ids = manager.prepare_load(keys)
            worker.transfer_async(
                job, CPUBlockSpec(tuple(cpu_ids)), GPUBlockSpec.single_group(gpu_ids)
            )
            (result,) = worker.wait([job])
            manager.complete_load(keys)
            t2 = time.perf_counter()
            if not result.success:
                raise RuntimeError(f"the load failed: {result.error}")
            return t1 - t0, t2 - t0

        for p in range(repeat + repeat % 2):
            if p % 2 == 0:
                read_s = read()
                promote_s, load_s = promote_and_load(p)
            else:
                promote_s, load_s = promote_and_load(p)
                read_s = read()
            loaded = kv[1:].view(torch.uint8).reshape(n, block_size).cpu().numpy()
            if not all(np.array_equal(loaded[i], payloads[i]) for i in range(n)):
                raise RuntimeError("a promoted block differs from what was written")
            kv.zero_()
            manager.clear()
            passes.append({
                "read_first": p % 2 == 0, "read_s": read_s, "promote_s": promote_s,
                "load_s": load_s, "promote_ratio": promote_s / read_s,
                "load_ratio": load_s / read_s,
            })  # fmt: skip
        direct = bool(disk.stats()["direct_io"])
    finally:
        pool.close()  # closes the disk tier
    med = lambda name: statistics.median(p[name] for p in passes)  # noqa: E731
    total = lambda name: math.fsum(p[name] for p in passes)  # noqa: E731
    return {
        "block_size": block_size,
        "blocks": n,
        "bytes": n * block_size,
        "direct_io": direct,
        **{name: med(name) for name in ("read_s", "promote_s", "load_s")},
        "promote_ratio": med("promote_ratio"),
        "load_ratio": med("load_ratio"),
        "promote_ratio_balanced": total("promote_s") / total("read_s"),
        "load_ratio_balanced": total("load_s") / total("read_s"),
        "passes": passes,
    }
