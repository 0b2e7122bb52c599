"""Per-step cost of the offloading scheduler (``kvoff bench scheduler``, "scheduler_steps").

The workload is an engine's steady state: ``B`` running requests over ``G`` KV cache groups
(group 0 full attention, the others sliding window), each admitted with a ``prompt_tokens``
prompt (one prefill step that stores every full block), then ``decode_steps`` decode steps of
one token per request; a request completes a block every ``block_size`` steps, which allocates
one GPU block per group and stores one offloaded block per group. Every store job is reported
complete right after its step. No bytes move: this measures scheduling alone.

Two timings per step, side by side:
  * ``facade``: :meth:`kvoff.scheduler.OffloadingScheduler.build_connector_meta` from a
    prebuilt :class:`~kvoff.scheduler.SchedulerStep` to a
    :class:`~kvoff.scheduler.ConnectorMetadata` (what an engine pays), and
  * ``core``: the C++ call alone with prebuilt argument columns (what the scheduling logic
    costs without the Python dataclasses).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from kvoff.offloading_spec import CPUOffloadingSpec
from kvoff.scheduler import OffloadingScheduler, Request, ScheduledRequest, SchedulerStep
from kvoff.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

__all__ = ["StepWorkload", "bench_scheduler_steps"]

_BLOCK_SIZE = 16
_HIT_REQUESTS = 256
"""Requests admitted as CPU pool hits per shape (at most ``B``): ``admit_hit_us_per_request``."""


def _spec(num_groups: int, num_gpu_blocks: int, num_cpu_blocks: int) -> CPUOffloadingSpec:
    """A spec with tiny pages (bytes do not matter here) and exactly ``num_cpu_blocks`` slots."""
    specs = []
    for g in range(num_groups):
        kw: dict[str, Any] = {
            "block_size": _BLOCK_SIZE,
            "num_kv_heads": 1,
            "head_size": 1,
            "dtype": torch.float16,
        }
        specs.append(
            FullAttentionSpec(**kw) if g == 0 else SlidingWindowSpec(**kw, sliding_window=4096)
        )
    page = specs[0].page_size_bytes
    config = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=tuple(
            KVCacheTensor(page * num_gpu_blocks, (f"l{g}",)) for g in range(num_groups)
        ),
        kv_cache_groups=tuple(KVCacheGroupSpec((f"l{g}",), specs[g]) for g in range(num_groups)),
    )
    return CPUOffloadingSpec(config, cpu_bytes_to_use=num_cpu_blocks * page * num_groups)


class StepWorkload:
    """The workload of :func:`bench_scheduler_steps`, one step at a time, so that two
    schedulers can be stepped alternately (``kvoff bench tiers`` compares tiers off and on
    step by step, which cancels the machine's drift).

    Construction admits every request (timed: ``admit_s``) and runs the prefill step (timed:
    ``prefill_s``); each :meth:`decode_step` builds one decode step (untimed, the engine's
    own work), times ``build_connector_meta`` (facade) and the C++ call alone on a twin step
    (core), then reports the step's store jobs complete (timed apart).

    Raises:
        ValueError: as :func:`bench_scheduler_steps`.
    """

    def __init__(
        self,
        num_requests: int,
        num_groups: int,
        *,
        prompt_tokens: int = 1024,
        decode_steps: int = 64,
        num_cpu_blocks: int = 1 << 20,
        seed: int = 0,
    ) -> None:
        if num_requests < 1 or not 1 <= num_groups <= 8 or prompt_tokens < _BLOCK_SIZE:
            raise ValueError(
                f"need num_requests >= 1, 1 <= num_groups <= 8 and prompt_tokens >= "
                f"{_BLOCK_SIZE}, got {num_requests}, {num_groups}, {prompt_tokens}"
            )
        self.num_groups = num_groups
        blocks_per_request = -(-(prompt_tokens + decode_steps + 1) // _BLOCK_SIZE)
        num_hits = min(num_requests, _HIT_REQUESTS)
        num_gpu_blocks = (num_requests + num_hits) * num_groups * blocks_per_request + 1
        self.sched = OffloadingScheduler(_spec(num_groups, num_gpu_blocks, num_cpu_blocks))
        self._rng = random.Random(seed)
        self._next_block = 1
        # Admission: every request misses (fresh random hashes).
        self.requests = []
        for i in range(num_requests):
            n_hash = prompt_tokens // _BLOCK_SIZE
            self.requests.append(
                Request(f"r{i}", [self._rng.randbytes(16) for _ in range(n_hash)], prompt_tokens)
            )
        tables = {
            r.request_id: [
                list(self._alloc(-(-prompt_tokens // _BLOCK_SIZE))) for _ in range(num_groups)
            ]
            for r in self.requests
        }
        sched = self.sched
        t0 = time.perf_counter()
        for r in self.requests:
            sched.get_num_new_matched_tokens(r, 0)
            sched.update_state_after_alloc(r, tables[r.request_id], 0)
        self.admit_s = time.perf_counter() - t0
        prefill = SchedulerStep(
            tuple(
                ScheduledRequest(
                    r.request_id, tuple(tuple(t) for t in tables[r.request_id]), 0, prompt_tokens
                )
                for r in self.requests
            )
        )
        t0 = time.perf_counter()
        meta = sched.build_connector_meta(prefill)
        self.prefill_s = time.perf_counter() - t0
        self.prefill_blocks = sum(len(j.gpu.block_ids) for j in meta.store_jobs)
        sched.update_connector_output([(j.job_id, True) for j in meta.store_jobs])
        # Hit admission: new requests repeating admitted prompts (every block is in the CPU
        # pool), each looked up and given a load job of the whole prompt, then let go (their
        # loads are cancelled, unpinning the blocks).
        hit_s = 0.0
        self.hit_tokens = 0
        hit_requests = []
        for i in range(num_hits):
            src = self.requests[i]
            hit = Request(f"h{i}", list(src.block_hashes), prompt_tokens + 1)
            table = [list(self._alloc(-(-(prompt_tokens + 1) // _BLOCK_SIZE)))
                     for _ in range(num_groups)]  # fmt: skip
            t0 = time.perf_counter()
            n, _ = sched.get_num_new_matched_tokens(hit, 0)
            sched.update_state_after_alloc(hit, table, n or 0)
            hit_s += time.perf_counter() - t0
            self.hit_tokens += n or 0
            hit_requests.append(hit)
        for hit in hit_requests:
            sched.request_finished(hit)
        self.admit_hit_s = hit_s / max(num_hits, 1)
        self.num_hits = num_hits
        self._computed = dict.fromkeys((r.request_id for r in self.requests), prompt_tokens)
        self._empty = tuple(() for _ in range(num_groups))
        self.facade_s: list[float] = []
        self.core_s: list[float] = []
        self.complete_s = 0.0
        self.jobs = 0

    def _alloc(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self._next_block, self._next_block + n))
        self._next_block += n
        return ids

    def decode_step(self) -> float:
        """One decode step (one token per request); returns its facade seconds."""
        sched = self.sched
        scheduled = []
        for r in self.requests:
            c = self._computed[r.request_id]
            new = self._empty
            if c % _BLOCK_SIZE == 0:  # the new token opens a block in every group
                new = tuple(self._alloc(1) for _ in range(self.num_groups))
            scheduled.append(ScheduledRequest(r.request_id, new, c, 1))
            r.num_tokens = c + 1
            if (c + 1) % _BLOCK_SIZE == 0:
                r.block_hashes.append(self._rng.randbytes(16))
            self._computed[r.request_id] = c + 1
        step = SchedulerStep(tuple(scheduled))
        # The core call with prebuilt columns, on a twin step that allocates nothing new:
        core_ids = [s.request_id for s in scheduled]
        core_none = [None] * len(scheduled)
        core_computed = [s.num_computed_tokens + 1 for s in scheduled]
        core_zero = [0] * len(scheduled)
        t0 = time.perf_counter()
        meta = sched.build_connector_meta(step)
        t1 = time.perf_counter()
        # Deliberately below the facade: this benchmark splits the step's cost into the Python
        # facade and the C++ core call, so it times the core object itself.
        sched._core.build_connector_meta(
            core_ids, core_none, core_computed, core_zero, (), (), (), (), None
        )
        t2 = time.perf_counter()
        self.facade_s.append(t1 - t0)
        self.core_s.append(t2 - t1)
        reports = [(j.job_id, True) for j in meta.store_jobs]
        self.jobs += len(reports)
        t0 = time.perf_counter()
        sched.update_connector_output(reports)
        self.complete_s += time.perf_counter() - t0
        return self.facade_s[-1]


def bench_scheduler_steps(
    num_requests: int,
    num_groups: int,
    *,
    prompt_tokens: int = 1024,
    decode_steps: int = 64,
    num_cpu_blocks: int = 1 << 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Times the scheduler hooks for ``num_requests`` requests × ``num_groups`` groups.

    Args:
        num_requests: running requests ``B`` (>= 1).
        num_groups: KV cache groups ``G`` (1..8); group 0 full attention, others sliding
            window (4096 tokens).
        prompt_tokens: prompt length (tokens) of every request.
        decode_steps: decode steps timed (one token per request per step).
        num_cpu_blocks: CPU pool slots.
        seed: makes the block hashes (random 16-byte strings) reproducible.

    Returns:
        A dict: parameters, ``admit_us_per_request`` (get_num_new_matched_tokens +
        update_state_after_alloc, a miss), ``admit_hit_us_per_request`` (the same for a
        request whose whole prompt is in the CPU pool: its lookup and load job, over
        ``admit_hit_requests`` = min(B, 256) requests; ``admit_hit_tokens_per_request``: the
        hit), ``prefill_step_ms`` (the step storing every
        prompt block) with ``prefill_blocks_stored``, and for decode steps
        ``decode_step_us`` / ``decode_step_core_us`` (median over steps, facade and C++ call),
        per request (``..._per_request_ns``), ``complete_us_per_job``
        (update_connector_output) and ``decode_store_jobs`` (stores issued while decoding).

    Raises:
        ValueError: a parameter out of range.
    """
    w = StepWorkload(
        num_requests, num_groups, prompt_tokens=prompt_tokens, decode_steps=decode_steps,
        num_cpu_blocks=num_cpu_blocks, seed=seed,
    )  # fmt: skip
    for _ in range(decode_steps):
        w.decode_step()
    decode_us = statistics.median(w.facade_s) * 1e6
    core_us = statistics.median(w.core_s) * 1e6
    return {
        "num_requests": num_requests,
        "num_groups": num_groups,
        "prompt_tokens": prompt_tokens,
        "decode_steps": decode_steps,
        "num_cpu_blocks": num_cpu_blocks,
        "admit_us_per_request": w.admit_s / num_requests * 1e6,
        "admit_hit_us_per_request": w.admit_hit_s * 1e6,
        "admit_hit_requests": w.num_hits,
        "admit_hit_tokens_per_request": w.hit_tokens / max(w.num_hits, 1),
        "prefill_step_ms": w.prefill_s * 1e3,
        "prefill_blocks_stored": w.prefill_blocks,
        "decode_step_us": decode_us,
        "decode_step_per_request_ns": decode_us * 1e3 / num_requests,
        "decode_step_core_us": core_us,
        "decode_step_core_per_request_ns": core_us * 1e3 / num_requests,
        "decode_store_jobs": w.jobs,
        "complete_us_per_job": w.complete_s / w.jobs * 1e6 if w.jobs else 0.0,
    }
