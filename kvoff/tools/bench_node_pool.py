"""``kvoff bench node-pool``: what a node pool costs an engine, against a private pool, side by
side in one run.

- **Copies**: the same store and load jobs (``blocks`` GPU blocks of a model's layout, CPU
  tensors without a GPU) into a private CPU pool and into a node pool's slots, mapped from
  ``/dev/shm``; rounds alternate which goes first; GB/s per round and the ratio of medians.
- **Calls**: one request's manager calls (``lookup``, ``prepare_store`` + ``complete_store``,
  ``touch`` of ``keys`` keys) through a :class:`kvoff.node_pool.NodePoolClient` against the
  same calls on an in-process manager: µs per call, median of rounds.
- **Misses**: a one-key look-up of a key the pool does not hold (a new request's first block)
  by a client that uses the pool's key filter and by one that asks the pool: µs per look-up.

The pool is a process of its own (``kvoff pool serve``), as it is for engines: on a machine
with few cores its round trips share them with the benchmark, as they would with an engine.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvoff import _scheduler
from kvoff.models import get_model_preset
from kvoff.node_pool import NodePoolClient
from kvoff.node_pool.process import pool_process
from kvoff.worker import CPUBlockSpec, GPUBlockSpec, OffloadingWorker

__all__ = ["run_node_pool_bench"]


def _median_s(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _interleaved(
    rounds: int, first: tuple[str, Any], second: tuple[str, Any], measure: Callable[[Any], float]
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """``measure(thing)`` of two named things per round, the first one first in even rounds and
    second in odd ones (so the machine's drift weighs on both); the values per round and their
    medians, by name."""
    rows: dict[str, list[float]] = {first[0]: [], second[0]: []}
    for rnd in range(rounds):
        for name, thing in (first, second) if rnd % 2 == 0 else (second, first):
            rows[name].append(measure(thing))
    return rows, {k: statistics.median(v) for k, v in rows.items()}


def _worker(model: str, blocks: int, slots: int, device: torch.device, **kw: Any):
    preset = get_model_preset(model)
    page = preset.layer_spec(16).page_size_bytes
    kv = {
        f"layer.{i}": torch.randint(0, 255, (blocks + 1, page), dtype=torch.uint8, device=device)
        for i in range(preset.num_layers)
    }
    w = OffloadingWorker(blocks + 1, slots, 1, pin_memory=device.type == "cuda", **kw)
    w.register_kv_caches(kv)
    return w


def run_node_pool_bench(
    model: str = "qwen2.5-7b",
    blocks: int = 256,
    keys: int = 32,
    rounds: int = 7,
    device: str = "cpu",
) -> dict[str, Any]:
    """Measures the node pool against a private pool (module docstring).

    Args:
        model: the layout preset of the copies (:mod:`kvoff.models`).
        blocks: GPU blocks per store or load job (16-token blocks, one CPU block each).
        keys: keys per manager call (32: a 16k-token request in 512-token blocks).
        rounds: rounds of each measurement (>= 1).
        device: ``cpu`` (CPU tensors) or ``cuda``.

    Returns:
        ``{"copy": {...}, "calls": {...}, "misses": {...}}`` with per-round GB/s and µs,
        medians and the ratios ``node_pool_vs_private`` (copies: GB/s over GB/s; calls: µs
        over µs) and ``filter_vs_asking`` (misses: µs over µs).

    Raises:
        ValueError: ``rounds``, ``blocks`` or ``keys`` < 1, or an unknown model.
    """
    if min(rounds, blocks, keys) < 1:
        raise ValueError(f"rounds, blocks and keys must be >= 1, got {rounds}, {blocks} and {keys}")
    dev = torch.device(device)
    region = f"kvoff-bench-node-pool-{os.getpid()}"
    sock = f"/tmp/kvoff-bench-node-pool-{os.getpid()}.sock"
    private = _worker(model, blocks, blocks, dev)
    try:
        with pool_process(sock, max(blocks, 4 * keys), private.slot_bytes, region=region):
            client = NodePoolClient(sock, b"kvoff bench node-pool", name="bench")
            shared = _worker(
                model, blocks, client.num_slots, dev,
                shared_memory_name=client.region, attach_shared_memory=True,
            )  # fmt: skip
            copy = _bench_copies(private, shared, blocks, rounds)
            calls = _bench_calls(client, keys, rounds)
            asking = NodePoolClient(sock, b"kvoff bench node-pool", name="bench, no filter",
                                    key_filter=False)  # fmt: skip
            misses = _bench_misses(client, asking, rounds)
            asking.close()
            client.close()
            shared.close()
    finally:
        private.close()
    return {
        "model": model, "blocks": blocks, "keys": keys, "rounds": rounds, "device": device,
        "slot_bytes": private.slot_bytes, "copy": copy, "calls": calls, "misses": misses,
    }  # fmt: skip


def _bench_copies(
    private: OffloadingWorker, shared: OffloadingWorker, blocks: int, rounds: int
) -> dict[str, Any]:
    gpu = GPUBlockSpec.single_group(range(1, blocks + 1))
    cpu = CPUBlockSpec(tuple(range(blocks)))
    job = [0]
    nbytes = blocks * private.bytes_per_gpu_block

    def run(w: OffloadingWorker, direction: str) -> float:
        def once() -> None:
            job[0] += 1
            src, dst = (gpu, cpu) if direction == "store" else (cpu, gpu)
            w.transfer_async(job[0], src, dst)
            (r,) = w.wait([job[0]])
            assert r.success, r.error

        return nbytes / _median_s(once, 3) / 1e9

    out: dict[str, Any] = {}
    for direction in ("store", "load"):
        rows, med = _interleaved(
            rounds, ("private", private), ("node_pool", shared), lambda w, d=direction: run(w, d)
        )
        out[direction] = {
            "private_gbps": rows["private"],
            "node_pool_gbps": rows["node_pool"],
            "node_pool_vs_private": med["node_pool"] / med["private"],
        }
    return out


def _bench_calls(client: NodePoolClient, num_keys: int, rounds: int) -> dict[str, Any]:
    manager = _scheduler.CPUOffloadingManager(client.num_slots, "lru")
    batch = [0]

    def request(m: Any) -> Callable[[], None]:
        def once() -> None:
            batch[0] += 1
            ks = [batch[0].to_bytes(8, "little") + i.to_bytes(8, "little")
                  for i in range(num_keys)]  # fmt: skip
            m.lookup(ks)
            out = m.prepare_store(ks)
            if out is not None:
                m.complete_store(list(out.keys_to_store), True)
            m.touch(ks)

        return once

    rows, med = _interleaved(
        rounds, ("private", manager), ("node_pool", client),
        lambda m: _median_s(request(m), 50) / 4 * 1e6,  # 4 calls per request
    )  # fmt: skip
    return {
        "private_us_per_call": rows["private"],
        "node_pool_us_per_call": rows["node_pool"],
        "node_pool_vs_private": med["node_pool"] / med["private"],
        "node_pool_us_per_call_median": med["node_pool"],
        "private_us_per_call_median": med["private"],
    }


def _bench_misses(filtered: NodePoolClient, asking: NodePoolClient, rounds: int) -> dict[str, Any]:
    """µs per one-key look-up of a key not in the pool, with the key filter and without."""
    serial = [0]
    before = filtered.answered_by_filter

    def miss(c: NodePoolClient) -> Callable[[], None]:
        def once() -> None:
            serial[0] += 1
            assert c.lookup([b"miss" + serial[0].to_bytes(12, "little")]) == 0

        return once

    rows, med = _interleaved(
        rounds, ("filter", filtered), ("asking", asking), lambda c: _median_s(miss(c), 50) * 1e6
    )
    return {
        "filter_us_per_lookup": rows["filter"],
        "asking_us_per_lookup": rows["asking"],
        "filter_us_per_lookup_median": med["filter"],
        "asking_us_per_lookup_median": med["asking"],
        "filter_vs_asking": med["filter"] / med["asking"],
        "answered_by_filter": filtered.answered_by_filter - before,
    }
