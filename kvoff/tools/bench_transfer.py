"""``kvoff bench transfer``: how fast KV blocks move, and what that costs the forward pass.

Workload: a KV shape preset (:data:`TRANSFER_PRESETS`: layers × tensors per layer × bytes per
chunk) in each GPU layout (:data:`kvoff.slot_layout.GPU_LAYOUTS`):

* ``layer_major``: one tensor per layer (or per K/V half), the common case;
* ``block_contiguous``: all layers of a block in one contiguous region (vLLM's cross-layer
  layout, TRT-LLM's), registered as per-layer views into one buffer.

A job is ``N`` blocks at random distinct GPU rows stored to random distinct CPU slots (GPU →
CPU), or loaded back, through :class:`kvoff.OffloadingWorker` (slot-major CPU pool, its streams,
its staging buffer): exactly what an engine's jobs go through. For every mechanism (``per_block``:
one copy call per block per region, the naive baseline; ``memcpy``; ``batch``; ``kernel``; for
layer-major caches ``staged``; ``auto``: what the worker chooses) and direction (``store``,
``load``, ``both`` at once), side by side in one run with one contiguous copy of the same bytes
(pinned host ↔ device on a GPU: the link's ceiling; one ``memcpy`` on the CPU). Each figure is
the median wall time of ``repeat`` jobs after ``warmup`` (submit to completion); GB/s are 10^9
bytes of block data per second.

On a GPU it also measures ``gemm_slowdown``: an 8192³ bf16 GEMM loop on its own stream, timed
alone and while the mechanism's jobs stream (time with / time alone − 1), which is what the
engine's forward pass pays for the transfer. One such pair is noise (±8 % on an H200), so it runs
``gemm_rounds`` rounds of one "alone" and one "with transfers" timing back to back, alternating
which comes first so that slow drift cancels (:func:`interleaved_slowdowns`), and reports the
median of the rounds with their interquartile range, the 95 % confidence half-width of the median
and the rounds that half-width needed to fall below 1 % (:func:`summarize_slowdowns`); and
**engine-step job sizes** (1, 4, 16, 64, 256 blocks, as an engine issues them, launch overhead
included) next to a contiguous copy of the same bytes.

``--sweep`` (GPU) adds single-tensor jobs of scattered chunks from 4 KiB to 2 MiB per direction
and mechanism; with the slowdowns and the staged efficiency measured above they make the
thresholds ``mechanism="auto"`` decides from (:func:`derive_thresholds`;
``--write-thresholds FILE``, then ``KVOFF_TRANSFER_THRESHOLDS=FILE``; see :mod:`kvoff.transfer`).
The sweep and the derivation live in :mod:`kvoff.chunk_sweep`, which the first-use calibration
of ``auto`` (:mod:`kvoff.calibration`) calls too.

Without a GPU the same layouts and mechanisms run with CPU tensors (``staged`` included, through
a CPU staging buffer) against one contiguous ``memcpy`` (one thread) and torch's ``copy_`` of the
same bytes; there is no GEMM slowdown and no ``both`` (CPU copies run in the calling thread).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvoff.chunk_sweep import derive_thresholds, measure_chunk_sweep
from kvoff.jobs import CPUBlockSpec, GPUBlockSpec
from kvoff.ops import batch_copy_supported
from kvoff.sizing import bytes_per_gpu_block
from kvoff.slot_layout import GPU_LAYOUTS
from kvoff.tools.bench import run_info
from kvoff.tools.slowdown_rounds import (
    GEMM_ROUNDS,
    SLOWDOWN_HALF_WIDTH_TARGET,
    SlowdownSummary,
    check_rounds,
    interleaved_slowdowns,
    summarize_slowdowns,
)
from kvoff.transfer import (
    COPY_MECHANISMS,
    DEFAULT_STAGING_BYTES,
    DEFAULT_STAGING_PIECE_BYTES,
    default_thresholds,
)
from kvoff.worker import OffloadingWorker

__all__ = [
    "JOB_SIZES",
    "SWEEP_CHUNK_BYTES",
    "TRANSFER_PRESETS",
    "TransferBenchParams",
    "TransferPreset",
    "derive_thresholds",
    "format_transfer_table",
    "run_transfer_bench",
]

MECHANISMS_BY_LAYOUT: dict[str, tuple[str, ...]] = {
    "layer_major": ("per_block", "memcpy", "batch", "kernel", "staged", "auto"),
    "block_contiguous": ("per_block", "memcpy", "batch", "kernel", "auto"),
}
"""Mechanisms timed per GPU layout, in table order (staging a block-contiguous cache would
only add a pass)."""

SWEEP_CHUNK_BYTES: tuple[int, ...] = tuple(4096 << k for k in range(10))  # 4 KiB .. 2 MiB

JOB_SIZES: tuple[int, ...] = (1, 4, 16, 64, 256)
"""Blocks per job of the engine-step section (an engine stores a few blocks per step)."""

GEMM_SIZE = 8192
"""M = N = K of the bf16 GEMM whose slowdown is measured."""

TARGETS = {
    "layer_major_auto_vs_contiguous": 0.95,
    "layer_major_auto_both_vs_contiguous": 0.90,
    "layer_major_auto_gemm_slowdown_max": 0.03,
    "block_contiguous_auto_vs_contiguous": 0.97,
    "block_contiguous_auto_gemm_slowdown_max": 0.02,
    "small_chunks_auto_vs_contiguous": 0.90,
    "job_16_blocks_time_vs_contiguous_max": 1.2,
}
"""The targets of issue 12 (H100 or H200), reported next to the measured ratios (never
asserted)."""


@dataclass(frozen=True)
class TransferPreset:
    """A KV shape as the copy sees it: ``num_layers × tensors_per_layer`` tensors whose rows
    (one per block) are ``chunk_bytes`` long.

    Attributes:
        name: preset name (``--presets``).
        num_layers: layers copied per job.
        tensors_per_layer: 2 when K and V are separate tensors (``kv_first`` layouts such as
            vLLM's FlashAttention cache), 1 when one row holds the layer's whole block.
        chunk_bytes: bytes of one block of one tensor.
        block_size: tokens per block.
        description: the model numbers (from its published ``config.json``) and the arithmetic.
    """

    name: str
    num_layers: int
    tensors_per_layer: int
    chunk_bytes: int
    block_size: int
    description: str

    @property
    def num_tensors(self) -> int:
        """Copied tensors (regions of a layer-major block)."""
        return self.num_layers * self.tensors_per_layer

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block moves over all tensors (one slot sub-block):
        :func:`kvoff.sizing.bytes_per_gpu_block` of one ``chunk_bytes`` block per tensor."""
        return bytes_per_gpu_block([self.chunk_bytes] * self.num_tensors, 1)


TRANSFER_PRESETS: dict[str, TransferPreset] = {
    p.name: p
    for p in (
        TransferPreset(
            "llama-3-8b", 32, 2, 32768, 16,
            "Llama-3-8B, 16-token blocks, K and V separate: 16 tokens × 8 KV heads × head_dim "
            "128 × 2 bytes (bf16) = 32 KiB per K or V chunk, 32 layers (2 MiB per block)",
        ),
        TransferPreset(
            "qwen2.5-1.5b", 28, 2, 8192, 16,
            "Qwen2.5-1.5B (GQA 6:1), 16-token blocks: 16 × 2 KV heads × 128 × 2 bytes = 8 KiB "
            "per K or V chunk, 28 layers",
        ),
        TransferPreset(
            "qwen2.5-0.5b", 24, 2, 4096, 16,
            "Qwen2.5-0.5B (GQA 7:1), 16-token blocks: 16 × 2 KV heads × 64 × 2 bytes = 4 KiB "
            "per K or V chunk, 24 layers",
        ),
        TransferPreset(
            "deepseek-v3-mla", 61, 1, 73728, 64,
            "DeepSeek-V3 MLA, 64-token blocks: 64 tokens × (512 latent + 64 RoPE) × 2 bytes = "
            "72 KiB per layer (one compressed KV tensor), 61 layers",
        ),
    )
}  # fmt: skip

DEFAULT_PRESETS: tuple[str, ...] = ("llama-3-8b", "qwen2.5-1.5b", "qwen2.5-0.5b", "deepseek-v3-mla")


@dataclass(frozen=True)
class TransferBenchParams:
    """What ``kvoff bench transfer`` runs.

    Attributes:
        presets: preset names (:data:`TRANSFER_PRESETS`).
        layouts: GPU layouts (:data:`kvoff.slot_layout.GPU_LAYOUTS`).
        num_blocks: blocks per job (``None``: chosen per preset so that a job moves about
            ``target_bytes``).
        target_bytes: bytes per job when ``num_blocks`` is None.
        repeat: timed jobs per measurement (median reported).
        warmup: untimed jobs before.
        seed: seed of the random block ids.
        sweep: also run the chunk-size sweep (GPU only) and derive thresholds.
        kernel_blocks: thread blocks of the SM kernel (0: 10 % of the SMs); applies to the
            ``kernel`` rows only.
        gemm: measure the concurrent GEMM slowdown (GPU only).
        gemm_rounds: rounds of the GEMM-slowdown measurement, each one "alone" and one "with
            transfers" timing of the GEMM loop in alternating order (>= 1; at least 6 for a 95 %
            interval of the median, see :func:`summarize_slowdowns`).
        job_sizes: blocks per job of the engine-step section (empty: skip it).
        step_jobs: one-block jobs per engine step in the step-submission section (a decode
            step stores one block for each of many requests): submitted one by one
            (``transfer_async`` each) and together (``transfer_many_async``), alternating,
            per direction (0: skip it).
        staging_bytes: the worker's staging buffer, both directions (bytes).
        staging_piece_bytes: bytes per piece of a staged job.
        shared_pool: put each worker's CPU pool in POSIX shared memory (``/dev/shm``), as
            kvoff does for an engine whose workers run in processes of their own and that has
            secondary tiers (:class:`kvoff.pinned.HostPool` ``shared_name``).
    """

    presets: tuple[str, ...] = DEFAULT_PRESETS
    layouts: tuple[str, ...] = GPU_LAYOUTS
    num_blocks: int | None = None
    target_bytes: int = 512 << 20
    repeat: int = 10
    warmup: int = 2
    seed: int = 0
    sweep: bool = False
    kernel_blocks: int = 0
    gemm: bool = True
    gemm_rounds: int = GEMM_ROUNDS
    job_sizes: tuple[int, ...] = JOB_SIZES
    step_jobs: int = 16
    staging_bytes: int = DEFAULT_STAGING_BYTES
    staging_piece_bytes: int = DEFAULT_STAGING_PIECE_BYTES
    shared_pool: bool = False

    def blocks_for(self, preset: TransferPreset) -> int:
        """Blocks per job for ``preset``."""
        if self.num_blocks is not None:
            return self.num_blocks
        return max(8, self.target_bytes // preset.bytes_per_block)


# ----------------------------------------------------------------------------- helpers


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(
    fn: Callable[[], None], device: torch.device, repeat: int, warmup: int
) -> float:
    """Median wall time of ``fn`` (which must block until its work is done)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@dataclass
class _Setup:
    """A registered worker over one preset in one layout, and the ids of its jobs."""

    worker: OffloadingWorker
    store: tuple[GPUBlockSpec, CPUBlockSpec]
    load: tuple[CPUBlockSpec, GPUBlockSpec]
    gpu_rows: list[torch.Tensor]
    num_bytes: int
    store_gpu: torch.Tensor
    store_cpu: torch.Tensor
    load_gpu: torch.Tensor
    load_cpu: torch.Tensor


class _Jobs:
    """Unique job ids for one worker."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self) -> int:
        self.next += 1
        return self.next


_POOL_IDS = itertools.count()


def _setup(
    preset: TransferPreset,
    layout: str,
    n: int,
    device: torch.device,
    seed: int,
    mechanism: str,
    p: TransferBenchParams,
) -> _Setup:
    """A worker with ``2n`` GPU and CPU rows; stores read GPU rows ``perm[:n]`` into CPU slots
    ``perm'[:n]``, loads write the other halves (no job reads what another writes)."""
    rows = 2 * n
    gen = torch.Generator().manual_seed(seed)
    t = preset.num_tensors
    if layout == "block_contiguous":
        buf = torch.randint(
            0, 256, (rows, t * preset.chunk_bytes), dtype=torch.uint8, generator=gen
        )
        buf = buf.to(device)
        kv = {
            f"t{k}": buf[:, k * preset.chunk_bytes : (k + 1) * preset.chunk_bytes] for k in range(t)
        }
    else:
        kv = {
            f"t{k}": torch.randint(0, 256, (rows, preset.chunk_bytes), dtype=torch.uint8,
                                   generator=gen).to(device)
            for k in range(t)
        }  # fmt: skip
    shm_name = f"kvoff-bench-{os.getpid()}-{next(_POOL_IDS)}" if p.shared_pool else None
    worker = OffloadingWorker(
        rows, rows, 1,
        pin_memory=device.type == "cuda",
        mechanism=mechanism,
        staging_bytes=p.staging_bytes,
        staging_piece_bytes=p.staging_piece_bytes,
        shared_memory_name=shm_name,
    )  # fmt: skip
    worker.register_kv_caches(kv)
    assert worker.gpu_layouts == [layout], (worker.gpu_layouts, layout)
    gpu_perm = torch.randperm(rows, generator=gen)
    cpu_perm = torch.randperm(rows, generator=gen)
    sg, lg = gpu_perm[:n], gpu_perm[n:]
    sc, lc = cpu_perm[:n], cpu_perm[n:]
    return _Setup(
        worker,
        (GPUBlockSpec.single_group(sg.tolist()), CPUBlockSpec(tuple(sc.tolist()))),
        (CPUBlockSpec(tuple(lc.tolist())), GPUBlockSpec.single_group(lg.tolist())),
        worker.gpu_tensors(),
        n * preset.bytes_per_block,
        sg, sc, lg, lc,
    )  # fmt: skip


def _run_jobs(s: _Setup, jobs: _Jobs, directions: Sequence[str], copies: int = 1) -> list[str]:
    """Submit ``copies`` jobs per direction (interleaved), wait for all; returns mechanisms.

    Raises:
        RuntimeError: when a job failed (a benchmark of failed copies is worthless).
    """
    ids = []
    for _ in range(copies):
        for d in directions:
            jid = jobs()
            src, dst = s.store if d == "store" else s.load
            s.worker.transfer_async(jid, src, dst)
            ids.append(jid)
    results = s.worker.wait(ids)
    _check(results)
    return [r.mechanism for r in results]


def _verify(s: _Setup, jobs: _Jobs, preset: TransferPreset) -> None:
    """Byte-exact check of one store and one load through the worker.

    Raises:
        RuntimeError: naming the preset and the mechanism when bytes differ.
    """
    w = s.worker
    _run_jobs(s, jobs, ["store"])
    pool = w.cpu_pool.view(-1, w.bytes_per_gpu_block)[s.store_cpu]  # (n, sub-block)
    off = 0
    for rows in s.gpu_rows:
        want = rows[s.store_gpu.to(rows.device)].cpu()
        if not torch.equal(pool[:, off : off + rows.shape[1]], want):
            raise RuntimeError(
                f"kvoff bench transfer: {preset.name} store ({w.mechanism}) is wrong"
            )
        off += rows.shape[1]
    slots = w.cpu_pool.view(-1, w.bytes_per_gpu_block)
    gen = torch.Generator().manual_seed(len(s.load_cpu))
    slots[s.load_cpu] = torch.randint(0, 256, (len(s.load_cpu), slots.shape[1]),
                                      dtype=torch.uint8, generator=gen)  # fmt: skip
    _run_jobs(s, jobs, ["load"])
    pool = slots[s.load_cpu]
    off = 0
    for rows in s.gpu_rows:
        got = rows[s.load_gpu.to(rows.device)].cpu()
        if not torch.equal(got, pool[:, off : off + rows.shape[1]]):
            raise RuntimeError(f"kvoff bench transfer: {preset.name} load ({w.mechanism}) is wrong")
        off += rows.shape[1]


# ----------------------------------------------------------------------------- contiguous


def _contiguous(num_bytes: int, device: torch.device, p: TransferBenchParams) -> dict[str, float]:
    """The ceiling: one contiguous copy of ``num_bytes`` (GPU: pinned host ↔ device on side
    streams; CPU: one libc memcpy on one thread, and torch's ``copy_``)."""
    if device.type == "cuda":
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        host2 = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        dev2 = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def on(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

        def store() -> None:
            on(s1, host, dev)
            s1.synchronize()

        def load() -> None:
            on(s2, dev2, host2)
            s2.synchronize()

        def both() -> None:
            on(s1, host, dev)
            on(s2, dev2, host2)
            s1.synchronize()
            s2.synchronize()

        t = {k: _median_seconds(f, device, p.repeat, p.warmup)
             for k, f in (("store", store), ("load", load), ("both", both))}  # fmt: skip
        return {
            "store_gbps": _gbps(num_bytes, t["store"]),
            "load_gbps": _gbps(num_bytes, t["load"]),
            "both_gbps": _gbps(2 * num_bytes, t["both"]),
        }
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    memmove = ctypes.memmove
    one = _median_seconds(
        lambda: memmove(dst.data_ptr(), src.data_ptr(), num_bytes), device, p.repeat, p.warmup
    )
    torch_copy = _median_seconds(lambda: dst.copy_(src), device, p.repeat, p.warmup)
    return {"memcpy_gbps": _gbps(num_bytes, one), "torch_copy_gbps": _gbps(num_bytes, torch_copy)}


def _contiguous_job_seconds(num_bytes: int, device: torch.device, p: TransferBenchParams) -> dict:
    """Wall seconds of one contiguous copy of ``num_bytes`` per direction, launch included."""
    if device.type == "cuda":
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)

        def copy(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
            def run() -> None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                stream.synchronize()

            return run

        return {
            "store": _median_seconds(copy(host, dev), device, p.repeat, p.warmup),
            "load": _median_seconds(copy(dev, host), device, p.repeat, p.warmup),
        }
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = _median_seconds(lambda: dst.copy_(src), device, p.repeat, p.warmup)
    return {"store": t, "load": t}


# ----------------------------------------------------------------------------- GEMM


class _Gemm:
    """An 8192³ bf16 GEMM loop on its own stream (the engine's forward pass stand-in)."""

    def __init__(self, device: torch.device, size: int = GEMM_SIZE) -> None:
        gen = torch.Generator(device=device).manual_seed(1)
        self.a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
        self.b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.a)
        self.stream = torch.cuda.Stream(device)
        self.device = device

    def run(self, count: int) -> float:
        """Enqueue ``count`` GEMMs; returns milliseconds per GEMM (CUDA events on the GEMM's
        stream; blocks until they are done)."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for _ in range(count):
                torch.matmul(self.a, self.b, out=self.out)
            end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end) / count


def _gemm_slowdown(gemm: _Gemm, s: _Setup, jobs: _Jobs, directions: Sequence[str],
                   job_seconds: float, rounds: int = GEMM_ROUNDS,
                   count: int = 20) -> SlowdownSummary:  # fmt: skip
    """The GEMM loop's slowdown while jobs of ``directions`` stream, over ``rounds`` interleaved
    rounds (:func:`interleaved_slowdowns`, :func:`summarize_slowdowns`). Each timing is one loop
    of ``count`` GEMMs (seconds per GEMM); for "with transfers" enough jobs are queued first to
    outlast the loop, so every GEMM runs beside a transfer, and all of them finish before the
    next timing.

    Raises:
        ValueError: ``rounds`` < 1.
        RuntimeError: a job failed.
    """
    gemm.run(3)  # warm
    window = gemm.run(count) * count / 1e3  # seconds of one loop alone (untimed: sizes the queue)
    copies = max(2, min(256, int(2 * window / max(job_seconds, 1e-6)) + 1))

    def alone() -> float:
        return gemm.run(count) / 1e3

    def with_transfers() -> float:
        ids = []
        for _ in range(copies):
            for d in directions:
                jid = jobs()
                src, dst = s.store if d == "store" else s.load
                s.worker.transfer_async(jid, src, dst)
                ids.append(jid)
        secs = gemm.run(count) / 1e3
        _check(s.worker.wait(ids))
        return secs

    return summarize_slowdowns(interleaved_slowdowns(alone, with_transfers, rounds))


# ----------------------------------------------------------------------------- presets


def _bench_layout(
    preset: TransferPreset,
    layout: str,
    p: TransferBenchParams,
    device: torch.device,
    gemm: _Gemm | None,
) -> dict[str, Any]:
    n = p.blocks_for(preset)
    gpu = device.type == "cuda"
    ceiling = _contiguous(n * preset.bytes_per_block, device, p)
    mechanisms: dict[str, Any] = {}
    for m in MECHANISMS_BY_LAYOUT[layout]:
        s = _setup(preset, layout, n, device, p.seed, m, p)
        jobs = _Jobs()
        _verify(s, jobs, preset)
        directions = ("store", "load", "both") if gpu else ("store", "load")
        row: dict[str, Any] = {}
        resolved: dict[str, str] = {}
        for d in directions:
            ds = ["store", "load"] if d == "both" else [d]
            got: list[str] = []

            def run(
                ds: list[str] = ds, got: list[str] = got, s: _Setup = s, jobs: _Jobs = jobs
            ) -> None:
                got[:] = _run_jobs(s, jobs, ds)

            secs = _median_seconds(run, device, p.repeat, p.warmup)
            row[f"{d}_gbps"] = _gbps(s.num_bytes * len(ds), secs)
            row[f"{d}_seconds"] = secs
            if d != "both":
                resolved[d] = got[0]
        if m == "auto":
            row["resolved"] = resolved
        if gemm is not None:
            slow = {
                d: _gemm_slowdown(gemm, s, jobs, ["store", "load"] if d == "both" else [d],
                                  row[f"{d}_seconds"], p.gemm_rounds)
                for d in directions
            }  # fmt: skip
            row["gemm_slowdown"] = {d: r.median for d, r in slow.items()}
            row["gemm_slowdown_rounds"] = {d: list(r.rounds) for d, r in slow.items()}
            row["gemm_slowdown_spread"] = {d: r.spread for d, r in slow.items()}
            row["gemm_slowdown_half_width"] = {d: r.half_width for d, r in slow.items()}
            row["gemm_slowdown_rounds_needed"] = {d: r.rounds_needed for d, r in slow.items()}
        s.worker.close()
        mechanisms[m] = row
        _sync(device)
        if gpu:
            torch.cuda.empty_cache()
    base = mechanisms["per_block"]
    for row in mechanisms.values():
        if gpu:
            row["store_vs_contiguous"] = row["store_gbps"] / ceiling["store_gbps"]
            row["load_vs_contiguous"] = row["load_gbps"] / ceiling["load_gbps"]
            row["both_vs_contiguous"] = row["both_gbps"] / ceiling["both_gbps"]
            row["both_vs_one_direction"] = row["both_gbps"] / max(
                row["store_gbps"], row["load_gbps"]
            )
        else:
            row["store_vs_memcpy"] = row["store_gbps"] / ceiling["memcpy_gbps"]
            row["load_vs_memcpy"] = row["load_gbps"] / ceiling["memcpy_gbps"]
        row["store_vs_per_block"] = row["store_gbps"] / base["store_gbps"]
        row["load_vs_per_block"] = row["load_gbps"] / base["load_gbps"]
    entry: dict[str, Any] = {
        "preset": asdict(preset),
        "gpu_layout": layout,
        "num_blocks": n,
        "bytes_per_job": n * preset.bytes_per_block,
        "chunks_per_job": n * (preset.num_tensors if layout == "layer_major" else 1),
        "contiguous": ceiling,
        "mechanisms": mechanisms,
    }
    if p.job_sizes:
        entry["job_sizes"] = _bench_job_sizes(preset, layout, p, device)
    if p.step_jobs:
        entry["step_jobs"] = _bench_step_jobs(preset, layout, p, device)
    return entry


def _bench_step_jobs(
    preset: TransferPreset, layout: str, p: TransferBenchParams, device: torch.device
) -> dict[str, Any]:
    """One engine step's jobs: ``p.step_jobs`` one-block jobs (``auto``) per direction,
    submitted one by one and together (:meth:`kvoff.OffloadingWorker.transfer_many_async`),
    in alternating order, each timed from the first submission until every job finished.

    Raises:
        RuntimeError: when a job failed.
    """
    n = p.step_jobs
    s = _setup(preset, layout, n, device, p.seed + 11, "auto", p)
    jobs = _Jobs()
    specs = {
        "store": [(GPUBlockSpec.single_group([int(g)]), CPUBlockSpec((int(c),)))
                  for g, c in zip(s.store_gpu.tolist(), s.store_cpu.tolist(), strict=True)],
        "load": [(CPUBlockSpec((int(c),)), GPUBlockSpec.single_group([int(g)]))
                 for g, c in zip(s.load_gpu.tolist(), s.load_cpu.tolist(), strict=True)],
    }  # fmt: skip
    out: dict[str, Any] = {"jobs": n, "bytes_per_job": preset.bytes_per_block}
    for d, pairs in specs.items():

        def one_by_one(pairs: list = pairs) -> None:
            ids = []
            for src, dst in pairs:
                ids.append(jobs())
                s.worker.transfer_async(ids[-1], src, dst)
            _check(s.worker.wait(ids))

        def together(pairs: list = pairs) -> None:
            batch = [(jobs(), src, dst) for src, dst in pairs]
            s.worker.transfer_many_async(batch)
            _check(s.worker.wait([j for j, _, _ in batch]))

        samples: dict[str, list[float]] = {"one_by_one": [], "together": []}
        for fn in (one_by_one, together) * p.warmup:
            fn()
        for k in range(p.repeat):
            order = (("one_by_one", one_by_one), ("together", together))
            for name, fn in order if k % 2 == 0 else order[::-1]:
                _sync(device)
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        a = statistics.median(samples["one_by_one"])
        b = statistics.median(samples["together"])
        out[f"{d}_one_by_one_us"] = a * 1e6
        out[f"{d}_together_us"] = b * 1e6
        out[f"{d}_together_speedup"] = a / b
    s.worker.close()
    return out


def _check(results: Sequence[Any]) -> None:
    """Raises RuntimeError naming the first failed job of ``results``."""
    bad = [r for r in results if not r.success]
    if bad:
        raise RuntimeError(f"kvoff bench transfer: job {bad[0].job_id} failed: {bad[0].error}")


def _bench_job_sizes(
    preset: TransferPreset, layout: str, p: TransferBenchParams, device: torch.device
) -> list[dict[str, Any]]:
    """Wall time of ``auto`` jobs of each size (submit to completion) against a contiguous
    copy of the same bytes."""
    out = []
    s = _setup(preset, layout, max(p.job_sizes), device, p.seed + 7, "auto", p)
    jobs = _Jobs()
    for size in p.job_sizes:
        sub = _Setup(
            s.worker,
            (GPUBlockSpec.single_group(s.store_gpu[:size].tolist()),
             CPUBlockSpec(tuple(s.store_cpu[:size].tolist()))),
            (CPUBlockSpec(tuple(s.load_cpu[:size].tolist())),
             GPUBlockSpec.single_group(s.load_gpu[:size].tolist())),
            s.gpu_rows, size * preset.bytes_per_block,
            s.store_gpu[:size], s.store_cpu[:size], s.load_gpu[:size], s.load_cpu[:size],
        )  # fmt: skip
        contiguous = _contiguous_job_seconds(sub.num_bytes, device, p)
        row: dict[str, Any] = {"blocks": size, "bytes": sub.num_bytes}
        for d in ("store", "load"):
            got: list[str] = []

            def run(d: str = d, got: list[str] = got, sub: _Setup = sub) -> None:
                got[:] = _run_jobs(sub, jobs, [d])

            secs = _median_seconds(run, device, p.repeat, p.warmup)
            row[f"{d}_us"] = secs * 1e6
            row[f"contiguous_{d}_us"] = contiguous[d] * 1e6
            row[f"{d}_time_vs_contiguous"] = secs / contiguous[d]
            row[f"{d}_mechanism"] = got[0]
        out.append(row)
    s.worker.close()
    return out


# ----------------------------------------------------------------------------- sweep


def _gpu_sweep(p: TransferBenchParams, device: torch.device) -> list[dict[str, Any]]:
    """Single-tensor jobs of scattered chunks, per chunk size, direction and mechanism, moved
    by the op directly (256 MiB per job): :func:`kvoff.chunk_sweep.measure_chunk_sweep`."""
    return measure_chunk_sweep(
        device, SWEEP_CHUNK_BYTES, total_bytes=256 << 20, repeat=p.repeat, warmup=p.warmup,
        seed=p.seed, kernel_blocks=p.kernel_blocks,
    )  # fmt: skip


def _costs_from_presets(doc: dict[str, Any]) -> tuple[dict, dict]:
    """Per direction: the worst measured gemm_slowdown of each mechanism over the presets
    (``staged`` from layer-major rows), and staged GB/s over the best copy-engine GB/s of the
    same preset's block-contiguous layout (whole sub-blocks: what staging DMAs)."""
    slow: dict[str, dict[str, float]] = {"store": {}, "load": {}}
    eff: dict[str, list[float]] = {"store": [], "load": []}
    by_preset: dict[str, dict[str, Any]] = {}
    for entry in doc["presets"]:
        by_preset.setdefault(entry["preset"]["name"], {})[entry["gpu_layout"]] = entry
        for m, row in entry["mechanisms"].items():
            if m in COPY_MECHANISMS and "gemm_slowdown" in row:
                for d in ("store", "load"):
                    slow[d][m] = max(slow[d].get(m, 0.0), row["gemm_slowdown"][d])
    for layouts in by_preset.values():
        if {"layer_major", "block_contiguous"} <= set(layouts):
            staged = layouts["layer_major"]["mechanisms"]["staged"]
            ce = layouts["block_contiguous"]["mechanisms"]
            for d in ("store", "load"):
                best = max(ce["memcpy"][f"{d}_gbps"], ce["batch"][f"{d}_gbps"])
                eff[d].append(staged[f"{d}_gbps"] / best)
    return slow, {d: min(v) for d, v in eff.items() if v}


# ----------------------------------------------------------------------------- run


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def _device_info(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"kind": "cpu", "torch_threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    return {
        "kind": "cuda",
        "name": props.name,
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "cuda_runtime": torch.version.cuda,
        "driver": _nvidia_driver(),
        "batch_copy_supported": batch_copy_supported(),
    }


def run_transfer_bench(
    params: TransferBenchParams,
    *,
    json_path: Path | None = None,
    write_thresholds: Path | None = None,
    argv: Sequence[str] | None = None,
    log: Callable[[str], None] = lambda _msg: None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Run the benchmark, print nothing, return (and optionally write) the JSON document.

    Args:
        params: what to run.
        json_path: where to write the results (directories are created). The file is
            rewritten after every preset and layout with ``"complete": false`` and once more at
            the end with ``true``, so a run cut short (a lent GPU's time limit) keeps what it
            measured.
        write_thresholds: where to write thresholds derived from the sweep and the measured
            costs (needs a GPU, ``params.sweep``, ``params.gemm`` and both layouts).
        argv: the command line recorded in ``run.command``.
        log: progress messages.
        device: the device of the GPU side (default: ``cuda`` when available, else the CPU).

    Raises:
        ValueError: for an unknown preset or layout, ``params.gemm_rounds`` < 1, or
            ``write_thresholds`` without what it needs.
        RuntimeError: when a timed copy is not byte-exact or a job fails.
    """
    for name in params.presets:
        if name not in TRANSFER_PRESETS:
            raise ValueError(
                f"unknown transfer preset {name!r}; choose from {sorted(TRANSFER_PRESETS)}"
            )
    for layout in params.layouts:
        if layout not in GPU_LAYOUTS:
            raise ValueError(f"unknown GPU layout {layout!r}; choose from {list(GPU_LAYOUTS)}")
    check_rounds(params.gemm_rounds, "gemm_rounds")
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    gpu = device.type == "cuda"
    if write_thresholds is not None and not (
        gpu and params.sweep and params.gemm and set(params.layouts) == set(GPU_LAYOUTS)
    ):
        raise ValueError(
            "--write-thresholds needs a GPU, --sweep, the GEMM slowdowns and both layouts: "
            "thresholds come from measured bandwidths and costs"
        )
    doc: dict[str, Any] = {
        "benchmark": "kvoff bench transfer",
        "run": run_info(argv),
        "device": _device_info(device),
        "parameters": asdict(params),
        "units": (
            "GB/s = 10^9 bytes of block data per second, median wall time of `repeat` jobs "
            "(submit to completion); gemm_slowdown = median over gemm_rounds interleaved rounds "
            "of GEMM time with transfers / alone - 1 (fractions; gemm_slowdown_spread: their "
            "interquartile range; gemm_slowdown_half_width: 95 % order-statistic confidence "
            "half-width of the median; gemm_slowdown_rounds_needed: rounds until it fell below "
            f"{SLOWDOWN_HALF_WIDTH_TARGET}, null if it did not)"
        ),
        "targets": TARGETS,
        "thresholds_used": default_thresholds().source,
        "presets": [],
        "complete": False,
    }
    gemm = _Gemm(device) if gpu and params.gemm else None
    for name in params.presets:
        preset = TRANSFER_PRESETS[name]
        for layout in params.layouts:
            log(f"{name} {layout}: {params.blocks_for(preset)} blocks")
            doc["presets"].append(_bench_layout(preset, layout, params, device, gemm))
            _write_json(json_path, doc)
    if gpu:
        kernel_blocks = params.kernel_blocks or max(
            1, torch.cuda.get_device_properties(device).multi_processor_count // 10
        )
        doc["kernel"] = {
            "thread_blocks": kernel_blocks,
            "sm_fraction": kernel_blocks
            / torch.cuda.get_device_properties(device).multi_processor_count,
        }
        if params.sweep:
            log("sweep")
            doc["sweep"] = _gpu_sweep(params, device)
            slow, eff = _costs_from_presets(doc)
            if all(set(COPY_MECHANISMS) <= set(slow[d]) for d in slow) and len(eff) == 2:
                info = doc["device"]
                thresholds = derive_thresholds(
                    doc["sweep"], slow, eff,
                    f"measured on {info['name']} (CUDA {info['cuda_runtime']}, driver "
                    f"{info['driver']}) by `{doc['run']['command']}` on {doc['run']['date']}",
                )  # fmt: skip
                doc["thresholds"] = thresholds.to_json()
                if write_thresholds is not None:
                    write_thresholds.parent.mkdir(parents=True, exist_ok=True)
                    write_thresholds.write_text(json.dumps(thresholds.to_json(), indent=2) + "\n")
    doc["complete"] = True
    _write_json(json_path, doc)
    return doc


def _write_json(path: Path | None, doc: dict[str, Any]) -> None:
    """Writes ``doc`` to ``path`` (if any) through a temporary file and a rename, so a reader
    or a kill mid-write never sees half a document."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def format_transfer_table(doc: dict[str, Any]) -> str:
    """The results as text tables: GB/s per layout, mechanism and direction, and the ratios."""
    lines = []
    gpu = doc["device"]["kind"] == "cuda"
    where = (
        doc["device"].get("name", "CPU")
        if gpu
        else f"CPU ({doc['device']['torch_threads']} threads)"
    )
    header = f"kvoff bench transfer on {where}; GB/s (median of {doc['parameters']['repeat']})"
    if gpu and "gemm_rounds" in doc["parameters"]:
        header += f"; GEMM slowdown: median of {doc['parameters']['gemm_rounds']} rounds"
    lines.append(header)
    for entry in doc["presets"]:
        pr = entry["preset"]
        lines.append("")
        lines.append(
            f"{pr['name']} ({entry['gpu_layout']}): {entry['num_blocks']} scattered blocks x "
            f"{pr['num_layers'] * pr['tensors_per_layer']} tensors x {pr['chunk_bytes']} B "
            f"= {entry['bytes_per_job'] / 2**20:.0f} MiB per job"
        )
        c = entry["contiguous"]
        if gpu:
            lines.append(
                f"  contiguous pinned copy: store {c['store_gbps']:.1f}  load {c['load_gbps']:.1f}"
                f"  both {c['both_gbps']:.1f}"
            )
            lines.append(
                f"  {'mechanism':<22} {'store':>6} {'load':>6} {'both':>6} {'st/ceil':>7} "
                f"{'ld/ceil':>7} {'both/ceil':>9} {'gemm st/ld/both':>17}"
            )
        else:
            lines.append(
                f"  one contiguous memcpy: {c['memcpy_gbps']:.1f}   torch copy_: "
                f"{c['torch_copy_gbps']:.1f}"
            )
            lines.append(
                f"  {'mechanism':<22} {'store':>6} {'load':>6} {'st/memcpy':>9} {'ld/memcpy':>9} "
                f"{'vs naive':>8}"
            )
        for m, r in entry["mechanisms"].items():
            label = m if m != "auto" else f"auto({r['resolved']['store']}/{r['resolved']['load']})"
            if gpu:
                gs = r.get("gemm_slowdown")
                slow = f"{gs['store']:+.0%}/{gs['load']:+.0%}/{gs['both']:+.0%}" if gs else "-"
                lines.append(
                    f"  {label:<22} {r['store_gbps']:6.1f} {r['load_gbps']:6.1f} "
                    f"{r['both_gbps']:6.1f} {r['store_vs_contiguous']:7.2f} "
                    f"{r['load_vs_contiguous']:7.2f} {r['both_vs_contiguous']:9.2f} {slow:>17}"
                )
            else:
                lines.append(
                    f"  {label:<22} {r['store_gbps']:6.1f} {r['load_gbps']:6.1f} "
                    f"{r['store_vs_memcpy']:9.2f} {r['load_vs_memcpy']:9.2f} "
                    f"{r['store_vs_per_block']:8.1f}"
                )
        if "step_jobs" in entry:
            sj = entry["step_jobs"]
            lines.append(
                f"  a step's {sj['jobs']} one-block jobs, one by one / together: store "
                f"{sj['store_one_by_one_us']:.0f} / {sj['store_together_us']:.0f} us "
                f"({sj['store_together_speedup']:.2f}x), load {sj['load_one_by_one_us']:.0f} / "
                f"{sj['load_together_us']:.0f} us ({sj['load_together_speedup']:.2f}x)"
            )
        for js in entry.get("job_sizes", []):
            lines.append(
                f"  job of {js['blocks']:>3} blocks: store {js['store_us']:9.1f} us "
                f"({js['store_time_vs_contiguous']:.2f}x contiguous, {js['store_mechanism']}), "
                f"load {js['load_us']:9.1f} us ({js['load_time_vs_contiguous']:.2f}x, "
                f"{js['load_mechanism']})"
            )
    if "kernel" in doc:
        k = doc["kernel"]
        lines.append(
            f"\nSM kernel: {k['thread_blocks']} thread blocks ({k['sm_fraction']:.0%} of the SMs)"
        )
    if "thresholds" in doc:
        lines.append("derived thresholds: " + json.dumps(doc["thresholds"]))
    return "\n".join(lines)
