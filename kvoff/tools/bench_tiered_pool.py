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

__all__ = ["bench_engine_calls", "bench_scheduler_steps_tiers"]


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
