"""``kvoff bench transfer``: how fast KV blocks move, per mechanism, against the link's limit.

Workload: a KV shape preset (:data:`TRANSFER_PRESETS`: layers × tensors per layer × bytes per
chunk), ``N`` blocks at random distinct GPU rows copied to random distinct CPU rows (a store,
GPU → CPU) or back (a load, CPU → GPU), through ``kvoff.ops.copy_blocks``. One call covers all
layers of the job, as the worker does. Each measurement is the median of ``repeat`` timed
calls after ``warmup`` untimed ones; GB/s are 10^9 bytes per second of moved block bytes.

On a GPU (CUDA build of kvoff, CUDA torch): for every mechanism (``per_block``: the naive
baseline of one copy call per block per tensor; ``memcpy``: one copy call per run of adjacent
blocks; ``batch``: one ``cudaMemcpyBatchAsync`` per job; ``kernel``: the SM gather/scatter
kernel on at most 10 % of the SMs; ``auto``: what the worker would choose) and direction
(``store``, ``load``, and ``both`` at once on two streams), side by side with (a) one contiguous
copy of the same number of bytes between a pinned host buffer and device memory (the practical
ceiling of the link) and (b) the naive baseline. Timed with CUDA events on the copy streams.

On CPU (no CUDA): the parallel gather (store) and scatter (load) of the CPU op against one
contiguous ``memcpy`` of the same bytes (libc ``memmove`` through ctypes: one call, one thread)
and torch's contiguous ``copy_`` (which may use several threads); the naive baseline is one
``memcpy`` per block per tensor on one thread (``per_block``). Timed with ``perf_counter``.

``--sweep`` adds synthetic single-tensor jobs of scattered chunks from 4 KiB to 2 MiB per
direction and mechanism; from them :func:`derive_thresholds` finds the chunk sizes where one
mechanism overtakes another, and ``--write-thresholds FILE`` stores them as the thresholds that
``mechanism="auto"`` uses (``KVOFF_TRANSFER_THRESHOLDS=FILE``; see :mod:`kvoff.transfer`).
"""

from __future__ import annotations

import ctypes
import json
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvoff.ops import batch_copy_supported, copy_blocks
from kvoff.tools.bench import run_info
from kvoff.transfer import DirectionThresholds, TransferThresholds, choose_mechanism

__all__ = [
    "SWEEP_CHUNK_BYTES",
    "TRANSFER_PRESETS",
    "TransferBenchParams",
    "TransferPreset",
    "derive_thresholds",
    "format_transfer_table",
    "run_transfer_bench",
]

GPU_MECHANISMS: tuple[str, ...] = ("per_block", "memcpy", "batch", "kernel", "auto")
"""Mechanisms timed on a GPU, in table order (``per_block`` is the naive baseline)."""

CPU_MECHANISMS: tuple[str, ...] = ("per_block", "auto")
"""Mechanisms timed on CPU: the naive per-block loop and the parallel gather/scatter."""

SWEEP_CHUNK_BYTES: tuple[int, ...] = tuple(4096 << k for k in range(10))  # 4 KiB .. 2 MiB

TARGETS = {
    "scattered_vs_contiguous_gpu": 0.90,
    "both_directions_vs_one": 1.7,
    "small_chunks_vs_per_block": 5.0,
    "kernel_sm_fraction_max": 0.10,
    "cpu_gather_vs_memcpy": 0.80,
}
"""The targets of issue 5, reported next to the measured ratios (never asserted)."""


@dataclass(frozen=True)
class TransferPreset:
    """A KV shape as the copy sees it: ``num_layers × tensors_per_layer`` tensors whose rows
    (one per block) are ``chunk_bytes`` long.

    Attributes:
        name: preset name (``--preset``).
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
    def bytes_per_block(self) -> int:
        """Bytes one block moves over all tensors."""
        return self.num_layers * self.tensors_per_layer * self.chunk_bytes


TRANSFER_PRESETS: dict[str, TransferPreset] = {
    p.name: p
    for p in (
        TransferPreset(
            "llama-3-8b",
            32,
            2,
            32768,
            16,
            "Llama-3-8B, 16-token blocks, K and V separate: 16 tokens × 8 KV heads × head_dim "
            "128 × 2 bytes (bf16) = 32 KiB per K or V chunk, 32 layers (64 KiB per layer)",
        ),
        TransferPreset(
            "qwen2.5-1.5b",
            28,
            2,
            8192,
            16,
            "Qwen2.5-1.5B (GQA 6:1), 16-token blocks: 16 × 2 KV heads × 128 × 2 bytes = 8 KiB "
            "per K or V chunk, 28 layers",
        ),
        TransferPreset(
            "qwen2.5-0.5b",
            24,
            2,
            4096,
            16,
            "Qwen2.5-0.5B (GQA 7:1), 16-token blocks: 16 × 2 KV heads × 64 × 2 bytes = 4 KiB "
            "per K or V chunk, 24 layers",
        ),
        TransferPreset(
            "deepseek-v3-mla",
            61,
            1,
            73728,
            64,
            "DeepSeek-V3 MLA, 64-token blocks: 64 tokens × (512 latent + 64 RoPE) × 2 bytes = "
            "72 KiB per layer (one compressed KV tensor), 61 layers",
        ),
    )
}

DEFAULT_PRESETS: tuple[str, ...] = ("llama-3-8b", "qwen2.5-1.5b", "qwen2.5-0.5b", "deepseek-v3-mla")


@dataclass(frozen=True)
class TransferBenchParams:
    """What ``kvoff bench transfer`` runs.

    Attributes:
        presets: preset names (:data:`TRANSFER_PRESETS`).
        num_blocks: blocks per job (``None``: chosen per preset so that a job moves about
            ``target_bytes``).
        target_bytes: bytes per job when ``num_blocks`` is None.
        repeat: timed calls per measurement (median reported).
        warmup: untimed calls before.
        seed: seed of the random block ids.
        sweep: also run the chunk-size sweep (GPU only) and derive thresholds.
        kernel_blocks: thread blocks of the SM kernel (0: 10 % of the SMs).
    """

    presets: tuple[str, ...] = DEFAULT_PRESETS
    num_blocks: int | None = None
    target_bytes: int = 512 << 20
    repeat: int = 10
    warmup: int = 2
    seed: int = 0
    sweep: bool = False
    kernel_blocks: int = 0

    def blocks_for(self, preset: TransferPreset) -> int:
        """Blocks per job for ``preset``."""
        if self.num_blocks is not None:
            return self.num_blocks
        return max(8, self.target_bytes // preset.bytes_per_block)


# ----------------------------------------------------------------------------- tensors


@dataclass
class _Job:
    gpu: list[torch.Tensor]  # (rows, chunk_bytes) uint8, one per tensor, on the "GPU" side
    cpu: list[torch.Tensor]  # (rows, chunk_bytes) uint8 views of the (pinned) pool
    gpu_ids: torch.Tensor
    cpu_ids: torch.Tensor
    num_bytes: int
    num_chunks: int


def _make_job(num_tensors: int, chunk_bytes: int, n: int, device: torch.device, seed: int) -> _Job:
    """``num_tensors`` GPU-side and CPU-side tensors of ``2n`` rows each, and ``n`` random
    distinct row ids on each side (scattered: adjacent pairs are rare)."""
    rows = 2 * n
    gen = torch.Generator().manual_seed(seed)
    gpu = [
        torch.randint(0, 256, (rows, chunk_bytes), dtype=torch.uint8, generator=gen).to(device)
        for _ in range(num_tensors)
    ]
    pin = device.type == "cuda"
    cpu = [
        torch.zeros((rows, chunk_bytes), dtype=torch.uint8, pin_memory=pin)
        for _ in range(num_tensors)
    ]
    gpu_ids = torch.randperm(rows, generator=gen)[:n]
    cpu_ids = torch.randperm(rows, generator=gen)[:n]
    adjacent = int(((gpu_ids[1:] - gpu_ids[:-1] == 1) & (cpu_ids[1:] - cpu_ids[:-1] == 1)).sum())
    return _Job(
        gpu, cpu, gpu_ids, cpu_ids, n * chunk_bytes * num_tensors, (n - adjacent) * num_tensors
    )


def _gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


# ----------------------------------------------------------------------------- timing


def _time_cpu(fn: Callable[[], None], repeat: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _time_cuda(
    fns: Sequence[tuple[Callable[[], None], torch.cuda.Stream]], repeat: int, warmup: int
) -> float:
    """Median seconds from the first stream's start to the last stream's end of one round in
    which every ``fn`` runs on its stream concurrently."""
    device_stream = torch.cuda.current_stream()
    samples = []
    for r in range(warmup + repeat):
        start = torch.cuda.Event(enable_timing=True)
        start.record(device_stream)
        ends = []
        for fn, stream in fns:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                fn()
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                ends.append(end)
        for end in ends:
            end.synchronize()
        if r >= warmup:
            samples.append(max(start.elapsed_time(end) for end in ends) / 1e3)
    return statistics.median(samples)


def _copy_fn(job: _Job, direction: str, mechanism: str, kernel_blocks: int) -> Callable[[], None]:
    if direction == "store":
        return lambda: copy_blocks(
            job.gpu,
            job.cpu,
            job.gpu_ids,
            job.cpu_ids,
            mechanism=mechanism,
            kernel_blocks=kernel_blocks,
        )
    return lambda: copy_blocks(
        job.cpu,
        job.gpu,
        job.cpu_ids,
        job.gpu_ids,
        mechanism=mechanism,
        kernel_blocks=kernel_blocks,
    )


def _resolve_auto(job: _Job, direction: str, batch: bool) -> str:
    return choose_mechanism(
        job.num_bytes / max(job.num_chunks, 1),
        job.num_chunks,
        direction,  # type: ignore[arg-type]
        batch_supported=batch,
    )


# ----------------------------------------------------------------------------- GPU


def _gpu_contiguous(num_bytes: int, device: torch.device, repeat: int, warmup: int) -> dict:
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    store = _time_cuda([(lambda: host.copy_(dev, non_blocking=True), s1)], repeat, warmup)
    load = _time_cuda([(lambda: dev.copy_(host, non_blocking=True), s1)], repeat, warmup)
    host2 = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    both = _time_cuda(
        [
            (lambda: host.copy_(dev, non_blocking=True), s1),
            (lambda: dev.copy_(host2, non_blocking=True), s2),
        ],
        repeat,
        warmup,
    )
    return {
        "store_gbps": _gbps(num_bytes, store),
        "load_gbps": _gbps(num_bytes, load),
        "both_gbps": _gbps(2 * num_bytes, both),
    }


def _gpu_preset(
    preset: TransferPreset, p: TransferBenchParams, device: torch.device, batch: bool
) -> dict[str, Any]:
    n = p.blocks_for(preset)
    tensors = preset.num_layers * preset.tensors_per_layer
    store_job = _make_job(tensors, preset.chunk_bytes, n, device, p.seed)
    load_job = _make_job(tensors, preset.chunk_bytes, n, device, p.seed + 1)
    s_store, s_load = torch.cuda.Stream(device), torch.cuda.Stream(device)
    ceiling = _gpu_contiguous(store_job.num_bytes, device, p.repeat, p.warmup)
    mechanisms: dict[str, Any] = {}
    for m in GPU_MECHANISMS:
        store_fn = _copy_fn(store_job, "store", m, p.kernel_blocks)
        load_fn = _copy_fn(load_job, "load", m, p.kernel_blocks)
        t_store = _time_cuda([(store_fn, s_store)], p.repeat, p.warmup)
        t_load = _time_cuda([(load_fn, s_load)], p.repeat, p.warmup)
        t_both = _time_cuda([(store_fn, s_store), (load_fn, s_load)], p.repeat, p.warmup)
        row = {
            "store_gbps": _gbps(store_job.num_bytes, t_store),
            "load_gbps": _gbps(load_job.num_bytes, t_load),
            "both_gbps": _gbps(store_job.num_bytes + load_job.num_bytes, t_both),
        }
        if m == "auto":
            row["resolved"] = {
                "store": _resolve_auto(store_job, "store", batch),
                "load": _resolve_auto(load_job, "load", batch),
            }
        mechanisms[m] = row
    for row in mechanisms.values():
        row["store_vs_contiguous"] = row["store_gbps"] / ceiling["store_gbps"]
        row["load_vs_contiguous"] = row["load_gbps"] / ceiling["load_gbps"]
        row["both_vs_one_direction"] = row["both_gbps"] / max(row["store_gbps"], row["load_gbps"])
        row["store_vs_per_block"] = row["store_gbps"] / mechanisms["per_block"]["store_gbps"]
        row["load_vs_per_block"] = row["load_gbps"] / mechanisms["per_block"]["load_gbps"]
    return {
        "preset": asdict(preset),
        "num_blocks": n,
        "bytes_per_job": store_job.num_bytes,
        "chunks_per_job": store_job.num_chunks,
        "contiguous": ceiling,
        "mechanisms": mechanisms,
    }


def _gpu_sweep(p: TransferBenchParams, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    total = 256 << 20
    s = torch.cuda.Stream(device)
    for chunk in SWEEP_CHUNK_BYTES:
        n = max(8, total // chunk)
        job = _make_job(1, chunk, n, device, p.seed)
        entry: dict[str, Any] = {"chunk_bytes": chunk, "num_chunks": job.num_chunks}
        for direction in ("store", "load"):
            for m in ("memcpy", "batch", "kernel"):
                t = _time_cuda(
                    [(_copy_fn(job, direction, m, p.kernel_blocks), s)], p.repeat, p.warmup
                )
                entry[f"{direction}_{m}_gbps"] = _gbps(job.num_bytes, t)
        rows.append(entry)
    return rows


def derive_thresholds(sweep: Sequence[dict[str, Any]], source: str) -> TransferThresholds:
    """Thresholds from a sweep (rows of ``chunk_bytes`` and ``{direction}_{mechanism}_gbps``,
    ascending chunk sizes): per direction, the smallest swept chunk size from which the batch
    call is at least as fast as the kernel (``kernel_below_bytes``), from which copy calls reach
    98 % of the batch call (``batch_below_bytes``), and from which copy calls are at least as
    fast as the kernel (``kernel_below_bytes_without_batch``); one past the largest size when
    that never happens.

    Raises:
        ValueError: for an empty sweep.
    """
    if not sweep:
        raise ValueError("the sweep is empty: run kvoff bench transfer --sweep on a GPU")
    beyond = 2 * int(sweep[-1]["chunk_bytes"])

    def first(direction: str, better: str, than: str, factor: float = 1.0) -> int:
        for row in sweep:
            if row[f"{direction}_{better}_gbps"] >= factor * row[f"{direction}_{than}_gbps"]:
                return int(row["chunk_bytes"])
        return beyond

    per: dict[str, DirectionThresholds] = {}
    for d in ("store", "load"):
        kernel_below = first(d, "batch", "kernel")
        per[d] = DirectionThresholds(
            kernel_below_bytes=kernel_below,
            batch_below_bytes=max(kernel_below, first(d, "memcpy", "batch", 0.98)),
            kernel_below_bytes_without_batch=first(d, "memcpy", "kernel"),
        )
    return TransferThresholds(store=per["store"], load=per["load"], source=source)


# ----------------------------------------------------------------------------- CPU


def _cpu_preset(preset: TransferPreset, p: TransferBenchParams) -> dict[str, Any]:
    n = p.blocks_for(preset)
    tensors = preset.num_layers * preset.tensors_per_layer
    cpu = torch.device("cpu")
    job = _make_job(tensors, preset.chunk_bytes, n, cpu, p.seed)
    src = torch.randint(0, 256, (job.num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    memmove = ctypes.memmove
    one_memcpy = _time_cpu(
        lambda: memmove(dst.data_ptr(), src.data_ptr(), job.num_bytes), p.repeat, p.warmup
    )
    torch_copy = _time_cpu(lambda: dst.copy_(src), p.repeat, p.warmup)
    mechanisms = {}
    for m in CPU_MECHANISMS:
        t_store = _time_cpu(_copy_fn(job, "store", m, 0), p.repeat, p.warmup)
        t_load = _time_cpu(_copy_fn(job, "load", m, 0), p.repeat, p.warmup)
        mechanisms[m] = {
            "store_gbps": _gbps(job.num_bytes, t_store),
            "load_gbps": _gbps(job.num_bytes, t_load),
        }
    memcpy_gbps = _gbps(job.num_bytes, one_memcpy)
    for row in mechanisms.values():
        row["store_vs_memcpy"] = row["store_gbps"] / memcpy_gbps
        row["load_vs_memcpy"] = row["load_gbps"] / memcpy_gbps
        row["store_vs_per_block"] = row["store_gbps"] / mechanisms["per_block"]["store_gbps"]
        row["load_vs_per_block"] = row["load_gbps"] / mechanisms["per_block"]["load_gbps"]
    # Byte-exact check of the timed copies (a benchmark of wrong copies is worthless).
    copy_blocks(job.gpu, job.cpu, job.gpu_ids, job.cpu_ids)
    for g, c in zip(job.gpu, job.cpu, strict=True):
        if not torch.equal(g[job.gpu_ids], c[job.cpu_ids]):
            raise RuntimeError(f"kvoff bench transfer: the gather of {preset.name} is wrong")
    return {
        "preset": asdict(preset),
        "num_blocks": n,
        "bytes_per_job": job.num_bytes,
        "chunks_per_job": job.num_chunks,
        "contiguous": {
            "memcpy_gbps": memcpy_gbps,
            "torch_copy_gbps": _gbps(job.num_bytes, torch_copy),
        },
        "mechanisms": mechanisms,
    }


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


def _device_info(device: torch.device | None) -> dict[str, Any]:
    if device is None:
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
        json_path: where to write the results (directories are created).
        write_thresholds: where to write thresholds derived from the sweep (needs a GPU and
            ``params.sweep``).
        argv: the command line recorded in ``run.command``.
        log: progress messages.
        device: the CUDA device (default: ``cuda`` when available, else the CPU mode).

    Raises:
        ValueError: for an unknown preset, or ``write_thresholds`` without a GPU sweep.
    """
    for name in params.presets:
        if name not in TRANSFER_PRESETS:
            raise ValueError(
                f"unknown transfer preset {name!r}; choose from {sorted(TRANSFER_PRESETS)}"
            )
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if write_thresholds is not None and (device is None or not params.sweep):
        raise ValueError(
            "--write-thresholds needs a GPU and --sweep: thresholds come from measured crossovers"
        )
    doc: dict[str, Any] = {
        "benchmark": "kvoff bench transfer",
        "run": run_info(argv),
        "device": _device_info(device),
        "parameters": asdict(params),
        "units": "GB/s = 10^9 bytes of block data per second; median of `repeat` calls",
        "targets": TARGETS,
        "presets": [],
    }
    batch = device is not None and batch_copy_supported()
    for name in params.presets:
        preset = TRANSFER_PRESETS[name]
        log(f"{name}: {params.blocks_for(preset)} blocks")
        if device is None:
            doc["presets"].append(_cpu_preset(preset, params))
        else:
            doc["presets"].append(_gpu_preset(preset, params, device, batch))
            torch.cuda.empty_cache()
    if device is not None:
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
            info = doc["device"]
            thresholds = derive_thresholds(
                doc["sweep"],
                f"measured on {info['name']} (CUDA {info['cuda_runtime']}, driver "
                f"{info['driver']}) by `{doc['run']['command']}` on {doc['run']['date']}",
            )
            doc["thresholds"] = thresholds.to_json()
            if write_thresholds is not None:
                write_thresholds.parent.mkdir(parents=True, exist_ok=True)
                write_thresholds.write_text(json.dumps(thresholds.to_json(), indent=2) + "\n")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def format_transfer_table(doc: dict[str, Any]) -> str:
    """The results as text tables: GB/s per mechanism and direction, and the ratios."""
    lines = []
    gpu = doc["device"]["kind"] == "cuda"
    where = (
        doc["device"].get("name", "CPU")
        if gpu
        else f"CPU ({doc['device']['torch_threads']} threads)"
    )
    lines.append(f"kvoff bench transfer on {where}; GB/s (median of {doc['parameters']['repeat']})")
    for entry in doc["presets"]:
        pr = entry["preset"]
        lines.append("")
        lines.append(
            f"{pr['name']}: {entry['num_blocks']} scattered blocks x "
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
                f"  {'mechanism':<10} {'store':>7} {'load':>7} {'both':>7} {'st/ceil':>8} "
                f"{'ld/ceil':>8} {'both/1':>7} {'st/naive':>9} {'ld/naive':>9}"
            )
            for m, r in entry["mechanisms"].items():
                label = (
                    m if m != "auto" else f"auto({r['resolved']['store']}/{r['resolved']['load']})"
                )
                lines.append(
                    f"  {label:<10} {r['store_gbps']:7.1f} {r['load_gbps']:7.1f} "
                    f"{r['both_gbps']:7.1f} {r['store_vs_contiguous']:8.2f} "
                    f"{r['load_vs_contiguous']:8.2f} {r['both_vs_one_direction']:7.2f} "
                    f"{r['store_vs_per_block']:9.1f} {r['load_vs_per_block']:9.1f}"
                )
        else:
            lines.append(
                f"  one contiguous memcpy: {c['memcpy_gbps']:.1f}   torch copy_: "
                f"{c['torch_copy_gbps']:.1f}"
            )
            lines.append(
                f"  {'mechanism':<10} {'gather':>7} {'scatter':>8} {'gather/memcpy':>14} "
                f"{'scatter/memcpy':>15} {'vs naive':>9}"
            )
            for m, r in entry["mechanisms"].items():
                label = "parallel" if m == "auto" else m
                lines.append(
                    f"  {label:<10} {r['store_gbps']:7.1f} {r['load_gbps']:8.1f} "
                    f"{r['store_vs_memcpy']:14.2f} {r['load_vs_memcpy']:15.2f} "
                    f"{r['store_vs_per_block']:9.1f}"
                )
    if "kernel" in doc:
        k = doc["kernel"]
        lines.append(
            f"\nSM kernel: {k['thread_blocks']} thread blocks ({k['sm_fraction']:.0%} of the SMs)"
        )
    if "thresholds" in doc:
        lines.append("derived thresholds: " + json.dumps(doc["thresholds"]))
    return "\n".join(lines)
