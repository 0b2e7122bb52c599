"""The ``kvoff`` command line: ``kvoff replay``, ``kvoff plan`` and ``kvoff bench scheduler``
(also ``python -m kvoff``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoff.tools.replay import ReplayConfig

__all__ = ["main", "parse_bytes"]


def parse_bytes(text: str) -> int:
    """Parse a byte count such as ``4096``, ``512MiB``, ``2GiB`` or ``1.5GB`` (SI or IEC units);
    :func:`kvoff.config.parse_byte_size` for argparse.

    Raises:
        argparse.ArgumentTypeError: for text that is not a positive byte count.
    """
    from kvoff.config import parse_byte_size

    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _build_parser() -> argparse.ArgumentParser:
    from kvoff.config import EVICTION_POLICIES
    from kvoff.models import MODEL_PRESETS
    from kvoff.transfer import ALL_MECHANISMS
    from kvoff.worker import GPU_LAYOUTS

    parser = argparse.ArgumentParser(
        prog="kvoff", description="kvoff: KV-cache offloading for LLM inference engines"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    rp = sub.add_parser(
        "replay",
        help="replay a Mooncake-format trace through an engine-style loop or a real vLLM engine",
        description=(
            "Replay a request trace. --engine sim (default): kvoff's engine-style loop: GPU "
            "prefix cache, then kvoff lookups and loads of cached prefixes into fresh GPU "
            "blocks, computation of the rest, stores of new full blocks; every loaded block is "
            "verified byte for byte. --engine vllm: the trace's prompts through a real vLLM "
            "engine with a tiny random model, once with kvoff (KvoffConnector) and once with "
            "the engine's own prefix cache only: prefill tokens computed, hits by source, wall "
            "time, TTFT and whether the outputs agree."
        ),
    )
    rp.add_argument(
        "--engine",
        default="sim",
        choices=("sim", "vllm"),
        help="sim: kvoff's engine-style loop (default); vllm: a real vLLM engine "
        "(needs the vllm extra)",
    )
    rp.add_argument(
        "--trace",
        default="conversation",
        help="'conversation' or 'synthetic' (bundled Mooncake traces) or a JSONL path "
        "(default: conversation)",
    )
    rp.add_argument(
        "--model",
        default="tiny",
        choices=sorted(MODEL_PRESETS),
        help="KV shape preset (default: tiny)",
    )
    rp.add_argument(
        "--block-size",
        type=_positive_int,
        default=None,
        help="GPU tokens per block (default: 16; 32 with --engine vllm, whose CPU backend "
        "needs a multiple of 32)",
    )
    rp.add_argument(
        "--offloaded-block-size",
        type=_positive_int,
        default=None,
        help="tokens per offloaded (CPU) block; a multiple of --block-size (default: 512)",
    )
    rp.add_argument(
        "--gpu-prefix-blocks",
        type=_non_negative_int,
        default=0,
        help="GPU blocks the engine's own prefix cache keeps between requests; "
        "0 disables it (default: 0)",
    )
    size = rp.add_mutually_exclusive_group()
    size.add_argument(
        "--cpu-blocks", type=_positive_int, default=None, help="kvoff pool size in offloaded blocks"
    )
    size.add_argument(
        "--cpu-bytes",
        type=parse_bytes,
        default=None,
        help="kvoff pool size in bytes, e.g. 8GiB (default when neither is given: 2GiB)",
    )
    rp.add_argument(
        "--policy",
        default=None,
        choices=[*EVICTION_POLICIES, "min"],
        help="eviction policy (default: lru); min: Belady's offline optimum, simulated (see "
        "kvoff/tools/belady.py)",
    )
    rp.add_argument(
        "--store-threshold",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="store admission: store an offloaded block only once requests offered it N times "
        "(a request that computed the block offers it; 0 or 1: every block, the default; "
        "vLLM's store_threshold). With --sweep-capacity: for the policies without +tN",
    )
    rp.add_argument(
        "--max-tracker-size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="with --store-threshold: keys whose offers are counted at most, the least "
        "recently offered forgotten first (default: 64000)",
    )
    rp.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="a JSON/YAML kvoff configuration file for the pool settings (also KVOFF_CONFIG_FILE "
        "and KVOFF_* variables); the flags above override it",
    )
    rp.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        help="replay only the first N requests (default: all; 200 with --engine vllm)",
    )
    rp.add_argument(
        "--trace-block-size",
        type=_positive_int,
        default=512,
        help="tokens per trace hash id (default: 512, Mooncake)",
    )
    rp.add_argument(
        "--device",
        default="cpu",
        help="where the engine's KV cache lives: cpu (default) or cuda: the replay's transfers "
        "then run on the GPU (pinned pool, the worker's streams, --mechanism)",
    )
    rp.add_argument(
        "--gpu-layout",
        default="layer_major",
        choices=list(GPU_LAYOUTS),
        help="KV cache layout: one tensor per layer (default) or all layers of a block together",
    )
    rp.add_argument(
        "--mechanism",
        default="auto",
        choices=list(ALL_MECHANISMS),
        help="transfer mechanism (default: auto, within the compute-slowdown budget)",
    )
    rp.add_argument(
        "--compute",
        action="store_true",
        help="also run each request's prefill cost (2 x parameters FLOPs per computed token as "
        "GEMMs) and report the time against recomputing every token and the ideal speedup",
    )
    rp.add_argument(
        "--compute-chunk-tokens",
        type=_positive_int,
        default=2048,
        help="tokens per GEMM chunk of the prefill cost (default: 2048)",
    )
    rp.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write the totals as JSON to FILE"
    )
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")
    tg = rp.add_argument_group("secondary tiers (below the CPU pool)")
    tg.add_argument(
        "--disk-path",
        default=None,
        metavar="DIR",
        help="a disk tier in DIR (one file of block slots; with --disk-bytes)",
    )
    tg.add_argument(
        "--disk-bytes",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="size of the disk tier (e.g. 8GiB; per engine)",
    )
    tg.add_argument(
        "--remote-url",
        default=None,
        metavar="URL",
        help="a shared tier on a Redis Cluster, e.g. redis://127.0.0.1:7000",
    )
    tg.add_argument(
        "--remote-namespace",
        default="kvoff-replay",
        help="key prefix in the remote tier (default: kvoff-replay)",
    )
    tg.add_argument(
        "--remote-timeout",
        type=float,
        default=0.25,
        metavar="SECONDS",
        help="a remote operation slower than this is a miss (default: 0.25)",
    )
    tg.add_argument(
        "--engines",
        type=_positive_int,
        default=1,
        help="split the trace across N engines that share the remote tier (default: 1)",
    )
    tg.add_argument(
        "--assign",
        choices=("round_robin", "session"),
        default="round_robin",
        help="with --engines: request i to engine i mod N, or by session (first hash id)",
    )
    vg = rp.add_argument_group("--engine vllm")
    vg.add_argument(
        "--tokens-per-hash",
        type=_positive_int,
        default=32,
        help="prompt tokens per trace hash id (scales the trace down; default: 32)",
    )
    vg.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=16,
        help="tokens generated per request (greedy; default: 16)",
    )
    vg.add_argument(
        "--concurrency",
        type=_positive_int,
        default=8,
        help="requests in flight, added in trace order as others finish (default: 8)",
    )
    vg.add_argument(
        "--gpu-blocks",
        type=_int_at_least(2),
        default=None,
        help="vLLM's num_gpu_blocks_override (default: room for --concurrency of the longest "
        "requests)",
    )
    vg.add_argument(
        "--engine-model",
        default="llama",
        help="a tiny random model (llama, mistral, gemma3; written on first use under "
        "~/.cache/kvoff) or a model folder (default: llama)",
    )
    vg.add_argument("--dtype", default="float32", help="the engine's dtype (default: float32)")
    vg.add_argument(
        "--runs",
        nargs="+",
        default=["kvoff", "engine_only"],
        choices=("kvoff", "engine_only"),
        help="which runs (default: both)",
    )
    rp.add_argument(
        "--sweep-capacity",
        default=None,
        metavar="N,N,...",
        help="replay once per policy (--policies) and CPU pool size (these CPU block counts) "
        "and print the hit rates as a table (--json: as JSON); replaces --cpu-blocks, "
        "--cpu-bytes and --policy",
    )
    rp.add_argument(
        "--policies",
        default=None,
        metavar="P,P,...",
        help="with --sweep-capacity: the policies (default: lru,arc,probation,min; min is "
        "Belady's offline optimum); a policy may carry a store threshold: lru+t2 is lru with "
        "--store-threshold 2 (rows lru and lru+t2 side by side; +t0: off for that row)",
    )
    rp.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="with --sweep-capacity: draw the hit-rate curves into FILE (needs matplotlib: "
        'pip install "kvoff[plot]")',
    )
    _add_plan_parser(sub)
    _add_bench_parser(sub)
    ip = sub.add_parser(
        "info",
        help="what this install of kvoff contains and whether this process matches it",
        description=(
            "Print kvoff's version (with its wheel label), the torch and CUDA it was built "
            "against, the GPU architectures compiled, the copy mechanisms usable here, the "
            "compilers, and whether the running torch, CUDA and GPUs match the build. Exits 1 "
            "when they do not."
        ),
    )
    ip.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def _info(args: argparse.Namespace) -> int:
    from kvoff.tools.info import build_info

    info = build_info()
    print(info.to_json() if args.json else info.format())
    return 0 if info.runtime_matches else 1


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """The ``bench`` subcommand and its ``scheduler`` benchmark."""
    from kvoff import _scheduler
    from kvoff.tools.bench import DEFAULT_POOL_SIZES, DEFAULT_STEP_SHAPES, LARGE_POOL_SIZE
    from kvoff.tools.bench_vllm import DEFAULT_RUNNING

    bp = sub.add_parser("bench", help="benchmarks", description="kvoff benchmarks")
    bench_sub = bp.add_subparsers(dest="bench_command", required=True)
    sp = bench_sub.add_parser(
        "scheduler",
        help="offloading manager and per-step scheduler cost, C++ vs a pure-Python baseline",
        description=(
            "Time the CPU offloading manager's lookup, prepare_store (with eviction) and "
            "complete_store on large pools three ways, on the same workload: in C++ with keys "
            "made in C++ (the scheduler's path), through the Python binding, and a pure-Python "
            "OrderedDict baseline of the same semantics; then the scheduler's per-step cost "
            "for B running requests x G KV cache groups (admission, prefill, decode steps). "
            "Prints tables; --json writes all numbers with the machine and versions."
        ),
    )
    sp.add_argument(
        "--pool-sizes",
        type=_positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help="pool sizes in slots (default: "
        + " ".join(str(n) for n in DEFAULT_POOL_SIZES)
        + f"; with --large also {LARGE_POOL_SIZE})",
    )
    sp.add_argument(
        "--large", action="store_true", help=f"also measure a pool of {LARGE_POOL_SIZE:,} slots"
    )
    sp.add_argument("--batch", type=_positive_int, default=256, help="keys per call (default: 256)")
    sp.add_argument(
        "--calls",
        type=_positive_int,
        default=1024,
        help="calls per timed round, for lookup and for stores (default: 1024)",
    )
    sp.add_argument(
        "--repeat",
        type=_positive_int,
        default=5,
        help="timed rounds per operation; the median is reported (default: 5)",
    )
    sp.add_argument(
        "--key-bytes",
        type=_int_at_least(2),
        default=9,
        help="key length: hash bytes + 1 group byte (default: 9; 33 for 32-byte digests)",
    )
    sp.add_argument(
        "--eviction-policy",
        default="lru",
        choices=list(_scheduler.eviction_policies()),
        help="the manager's eviction policy (default: lru; the Python baseline is LRU and "
        "runs only with lru)",
    )
    sp.add_argument("--seed", type=_non_negative_int, default=0, help="workload seed (default: 0)")
    sp.add_argument(
        "--no-baseline", action="store_true", help="skip the (slow) pure-Python baseline"
    )
    sp.add_argument(
        "--steps",
        type=_step_shape,
        nargs="+",
        default=None,
        metavar="BxG",
        help="per-step scheduler benchmark shapes: B running requests x G KV cache groups "
        "(default: " + " ".join(f"{b}x{g}" for b, g in DEFAULT_STEP_SHAPES) + ")",
    )
    sp.add_argument(
        "--decode-steps",
        type=_positive_int,
        default=64,
        help="decode steps timed per shape (default: 64)",
    )
    sp.add_argument(
        "--vs-vllm",
        action="store_true",
        help="instead: kvoff side by side with vLLM's own offloading under a real vLLM "
        "Scheduler (connector cost per engine step, same schedule check) and the CPU manager "
        "through Python (needs the vllm extra; see kvoff/tools/bench_vllm.py)",
    )
    sp.add_argument(
        "--running",
        type=_positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help="with --vs-vllm: running requests per measurement (default: "
        + " ".join(str(n) for n in DEFAULT_RUNNING)
        + ")",
    )
    sp.add_argument(
        "--rounds",
        type=_positive_int,
        default=None,
        metavar="N",
        help="with --vs-vllm: runs of each configuration per running count, in alternating "
        "order; medians over rounds are reported (default: 3)",
    )
    sp.add_argument(
        "--store-batch-blocks",
        type=_positive_int,
        default=None,
        metavar="N",
        help="with --vs-vllm: KvoffConnector's store_batch_blocks (default: the library's, "
        "4; 1 stores every block in the step it fills, as vLLM's connector does)",
    )
    sp.add_argument(
        "--store-decode-blocks",
        action="store_true",
        help="with --vs-vllm: every connector also stores the blocks decode fills "
        "(offload_prompt_only false for all three; default: prompt blocks only, the default "
        "of vLLM 0.32 and of kvoff)",
    )
    sp.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write the results as JSON to FILE"
    )
    _add_bench_transfer_parser(bench_sub)
    _add_bench_tiers_parser(bench_sub)
    from kvoff.tools.bench_manager_calls import add_manager_calls_parser

    add_manager_calls_parser(bench_sub)


def _add_bench_tiers_parser(bench_sub: argparse._SubParsersAction) -> None:
    """``kvoff bench tiers``."""
    tp = bench_sub.add_parser(
        "tiers",
        help="secondary tiers: disk against dd, Redis Cluster GB/s and lookup cost, the "
        "engine thread's cost with tiers on against off, and a promotion against the disk read",
        description=(
            "Time the disk tier's sequential block writes and reads against dd with O_DIRECT on "
            "the same file system, in the same run; a Redis Cluster tier's put and get GB/s and "
            "per-key lookup cost (a local 3-master cluster is started when --remote-url is not "
            "given and redis-server is installed); and the engine thread's manager calls through "
            "the tiered pool against the bare manager, rounds alternated; and one request's "
            "promotion from disk into L1 and the KV cache against the disk tier's own read of "
            "the same blocks. See kvoff/tools/bench_tiers.py and kvoff/tools/bench_tiered_pool.py."
        ),
    )
    tp.add_argument(
        "--disk-path", default=None, metavar="DIR", help="file system to measure (default: /tmp)"
    )
    tp.add_argument("--remote-url", default=None, metavar="URL", help="a Redis Cluster to use")
    tp.add_argument(
        "--no-remote", action="store_true", help="skip Redis (no local cluster is started)"
    )
    tp.add_argument(
        "--block-sizes",
        type=parse_bytes,
        nargs="+",
        default=None,
        metavar="BYTES",
        help="payload bytes per block (default: 64KiB 512KiB 2MiB)",
    )
    tp.add_argument(
        "--total-bytes",
        type=parse_bytes,
        default=512 << 20,
        metavar="BYTES",
        help="bytes written and read per block size on disk (default: 512MiB)",
    )
    tp.add_argument(
        "--remote-total-bytes",
        type=parse_bytes,
        default=256 << 20,
        metavar="BYTES",
        help="bytes per block size on Redis (default: 256MiB)",
    )
    tp.add_argument(
        "--lookup-batch", type=_positive_int, default=256, help="keys per lookup (default: 256)"
    )
    tp.add_argument(
        "--disk-repeat",
        type=_positive_int,
        default=3,
        help="side-by-side passes of the disk tier and dd per block size, medians reported "
        "(default: 3)",
    )
    tp.add_argument(
        "--promotion-bytes",
        type=parse_bytes,
        default=64 << 20,
        metavar="BYTES",
        help="bytes of the request promoted from disk per block size (default: 64MiB); the "
        "promotion is timed against the disk tier's own read of the same blocks, "
        "--disk-repeat passes",
    )
    tp.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write the results as JSON to FILE"
    )


def _add_bench_transfer_parser(bench_sub: argparse._SubParsersAction) -> None:
    """``kvoff bench transfer``."""
    from kvoff.staging import DEFAULT_STAGING_BYTES, DEFAULT_STAGING_PIECE_BYTES
    from kvoff.tools.bench_transfer import DEFAULT_PRESETS, JOB_SIZES, TRANSFER_PRESETS
    from kvoff.worker import GPU_LAYOUTS

    tp = bench_sub.add_parser(
        "transfer",
        help="GPU<->CPU block jobs per layout and mechanism against the link's limit, and "
        "their cost to a concurrent GEMM (CPU: against one memcpy)",
        description=(
            "Time worker jobs of shape presets (N randomly scattered blocks, all layers) in "
            "each GPU layout (layer-major, block-contiguous) for every mechanism (per_block, "
            "memcpy, batch, kernel, staged, auto) and direction (store, load, both at once), "
            "side by side with one contiguous copy of the same bytes (the link's ceiling); on a "
            "GPU also the slowdown of a concurrent 8192^3 bf16 GEMM, and engine-step job sizes. "
            "Without a GPU the same jobs run with CPU tensors against one contiguous memcpy. "
            "See kvoff/tools/bench_transfer.py."
        ),
    )
    tp.add_argument(
        "--presets",
        nargs="+",
        default=list(DEFAULT_PRESETS),
        choices=sorted(TRANSFER_PRESETS),
        metavar="NAME",
        help="shape presets (default: all: " + ", ".join(DEFAULT_PRESETS) + ")",
    )
    tp.add_argument(
        "--blocks",
        type=_positive_int,
        default=None,
        help="blocks per job (default: about --job-mib MiB per job)",
    )
    tp.add_argument("--job-mib", type=_positive_int, default=512, help="MiB per job (default: 512)")
    tp.add_argument(
        "--repeat", type=_positive_int, default=10, help="timed calls, median (default: 10)"
    )
    tp.add_argument(
        "--warmup", type=_non_negative_int, default=2, help="untimed calls first (default: 2)"
    )
    tp.add_argument("--seed", type=_non_negative_int, default=0, help="block id seed (default: 0)")
    tp.add_argument(
        "--kernel-blocks",
        type=_non_negative_int,
        default=0,
        help="thread blocks of the SM kernel (default 0: 10%% of the SMs)",
    )
    tp.add_argument(
        "--layouts",
        nargs="+",
        default=list(GPU_LAYOUTS),
        choices=list(GPU_LAYOUTS),
        metavar="LAYOUT",
        help="GPU cache layouts (default: both: " + ", ".join(GPU_LAYOUTS) + ")",
    )
    tp.add_argument(
        "--no-gemm",
        action="store_true",
        help="GPU: skip the concurrent-GEMM slowdown measurement",
    )
    tp.add_argument(
        "--job-sizes",
        type=_positive_int,
        nargs="*",
        default=list(JOB_SIZES),
        metavar="BLOCKS",
        help="blocks per job of the engine-step section (default: "
        + " ".join(map(str, JOB_SIZES))
        + "; none to skip it)",
    )
    tp.add_argument(
        "--step-jobs",
        type=_non_negative_int,
        default=16,
        metavar="JOBS",
        help="one-block jobs of the step-submission section, timed one by one and together "
        "(transfer_many_async) per direction (default: %(default)s; 0 to skip it)",
    )
    tp.add_argument(
        "--staging-mib",
        type=_non_negative_int,
        default=DEFAULT_STAGING_BYTES >> 20,
        help="the worker's staging buffer, both directions, MiB (default: %(default)s)",
    )
    tp.add_argument(
        "--staging-piece-mib",
        type=_positive_int,
        default=DEFAULT_STAGING_PIECE_BYTES >> 20,
        help="bytes per piece of a staged job, MiB (default: %(default)s)",
    )
    tp.add_argument(
        "--shared-pool",
        action="store_true",
        help="allocate the CPU pools in /dev/shm, as kvoff does for tiers with workers in "
        "processes of their own",
    )
    tp.add_argument(
        "--sweep",
        action="store_true",
        help="GPU: also sweep chunk sizes 4 KiB..2 MiB per mechanism and derive the auto "
        "thresholds (from these bandwidths and the measured GEMM slowdowns)",
    )
    tp.add_argument(
        "--write-thresholds",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --sweep: write the derived thresholds to FILE (use it with "
        "KVOFF_TRANSFER_THRESHOLDS=FILE)",
    )
    tp.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write the results as JSON to FILE"
    )


def _bench_transfer(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from kvoff.tools.bench_transfer import (
        TransferBenchParams,
        format_transfer_table,
        run_transfer_bench,
    )

    params = TransferBenchParams(
        presets=tuple(args.presets),
        num_blocks=args.blocks,
        target_bytes=args.job_mib << 20,
        repeat=args.repeat,
        warmup=args.warmup,
        seed=args.seed,
        sweep=args.sweep,
        kernel_blocks=args.kernel_blocks,
        layouts=tuple(args.layouts),
        gemm=not args.no_gemm,
        job_sizes=tuple(args.job_sizes),
        step_jobs=args.step_jobs,
        staging_bytes=args.staging_mib << 20,
        staging_piece_bytes=args.staging_piece_mib << 20,
        shared_pool=args.shared_pool,
    )
    doc = run_transfer_bench(
        params,
        json_path=args.json,
        write_thresholds=args.write_thresholds,
        argv=argv,
        log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
    )
    print(format_transfer_table(doc))
    if args.json is not None:
        print(f"JSON written to {args.json}")
    return 0


def _step_shape(text: str) -> tuple[int, int]:
    """An argparse type: ``BxG`` with 1 <= B and 1 <= G <= 8."""
    try:
        b, g = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BxG, e.g. 1024x4") from None
    if b < 1 or not 1 <= g <= 8:
        raise argparse.ArgumentTypeError(f"{text!r}: need B >= 1 and 1 <= G <= 8")
    return b, g


def _bench_vs_vllm(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff bench scheduler --vs-vllm``."""
    for name, default in _SCHEDULER_ONLY.items():
        if getattr(args, name) != default:
            raise ValueError(
                f"--{name.replace('_', '-')} applies to the CPU manager benchmark only; with "
                "--vs-vllm use --running, --rounds, --decode-steps and --seed"
            )
    from kvoff.tools.bench_vllm import VsVllmParams, run_vs_vllm

    params = VsVllmParams(
        steps=args.decode_steps,
        seed=args.seed,
        **({"running": tuple(args.running)} if args.running else {}),
        **({"rounds": args.rounds} if args.rounds else {}),
        store_batch_blocks=args.store_batch_blocks,
        offload_prompt_only=not args.store_decode_blocks,
    )
    run_vs_vllm(
        params,
        json_path=args.json,
        argv=argv,
        log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
    )
    return 0


def _bench_tiers(args: argparse.Namespace) -> int:
    """``kvoff bench tiers``."""
    import tempfile

    from kvoff.tools.bench_tiered_pool import (
        bench_engine_calls,
        bench_promotion,
        bench_scheduler_steps_tiers,
    )
    from kvoff.tools.bench_tiers import (
        DEFAULT_BLOCK_SIZES,
        format_bench_tiers,
        run_bench_tiers,
        tier_failures,
    )

    log = lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if args.disk_path is not None:  # made if missing, as the disk tier makes its folder
        Path(args.disk_path).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvoff-bench-tiers-", dir=args.disk_path) as tmp:
        log(f"disk and Redis tiers (disk: {tmp})")
        result = run_bench_tiers(
            tmp,
            None if args.no_remote else args.remote_url,
            tuple(args.block_sizes or DEFAULT_BLOCK_SIZES),
            args.total_bytes,
            args.lookup_batch,
            remote_total_bytes=args.remote_total_bytes,
            start_local_redis=not args.no_remote,
            disk_repeat=args.disk_repeat,
        )
        log("engine thread: tiers off vs on")
        engine = bench_engine_calls(disk_path=tmp)
        log("scheduler steps: tiers off vs on, step by step")
        steps = bench_scheduler_steps_tiers(disk_path=tmp)
        log("promotion from disk into L1 and the KV cache vs the disk read")
        promotion = bench_promotion(
            block_sizes=tuple(args.block_sizes or DEFAULT_BLOCK_SIZES),
            request_bytes=args.promotion_bytes,
            repeat=args.disk_repeat,
            disk_path=tmp,
        )
    result["engine_thread"] = engine
    result["scheduler_steps"] = steps
    result["promotion"] = promotion
    print(format_bench_tiers(result))
    print(
        f"engine thread per round (lookup + store + touch of 32 keys): tiers off "
        f"{engine['tiers_off_us_per_round']:.1f} us, on {engine['tiers_on_us_per_round']:.1f} "
        f"us ({engine['ratio']:.3f}x)"
    )
    print(
        f"scheduler decode step, {steps['parameters']['num_requests']} running (median over "
        f"steps, side by side): tiers off {steps['tiers_off_step_us']:.1f} us, on "
        f"{steps['tiers_on_step_us']:.1f} us ({steps['ratio']:.3f}x; target <= 1.05x); "
        f"{steps['tier_stats']['writes_queued']} blocks written through, "
        f"{steps['tier_stats']['writes_dropped_queue_full']} dropped"
    )
    print(
        f"promotion of one request from disk (device {promotion['parameters']['device']}; "
        "ratios to the disk tier's own read of the same blocks, total time over passes of both "
        "orders, per-pass medians in brackets; target: into the KV cache <= 1.10x on a GPU)"
    )
    print(f"{'block':>9} {'blocks':>7} {'read ms':>8} {'to L1':>16} {'+ load':>16}")
    for r in promotion["results"]:
        print(
            f"{r['block_size'] >> 10:>5} KiB {r['blocks']:>7} {r['read_s'] * 1e3:>8.2f}"
            f" {r['promote_ratio_balanced']:>6.2f}x ({r['promote_ratio']:.2f}x)"
            f" {r['load_ratio_balanced']:>6.2f}x ({r['load_ratio']:.2f}x)"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"  JSON written to {args.json}")
    return 1 if tier_failures(result) else 0


def _bench(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    if args.vs_vllm:
        return _bench_vs_vllm(args, argv)
    if (
        args.running is not None
        or args.rounds is not None
        or args.store_batch_blocks is not None
        or args.store_decode_blocks
    ):
        raise ValueError(
            "--running, --rounds, --store-batch-blocks and --store-decode-blocks apply to "
            "--vs-vllm only"
        )
    from kvoff.tools.bench import (
        DEFAULT_POOL_SIZES,
        DEFAULT_STEP_SHAPES,
        LARGE_POOL_SIZE,
        ManagerBenchParams,
        run_scheduler_bench,
    )

    sizes = list(args.pool_sizes or DEFAULT_POOL_SIZES)
    if args.large and LARGE_POOL_SIZE not in sizes:
        sizes.append(LARGE_POOL_SIZE)
    params = ManagerBenchParams(
        pool_sizes=tuple(sizes),
        eviction_policy=args.eviction_policy,
        key_bytes=args.key_bytes,
        batch=args.batch,
        batches_per_round=args.calls,
        repeat=args.repeat,
        seed=args.seed,
        baseline=not args.no_baseline,
    )
    run_scheduler_bench(
        params,
        json_path=args.json,
        argv=argv,
        log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
        step_shapes=DEFAULT_STEP_SHAPES if args.steps is None else args.steps,
        decode_steps=args.decode_steps,
    )
    return 0


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """The ``plan`` subcommand's arguments."""
    from kvoff.config import EVICTION_POLICIES
    from kvoff.tools.plan import PLAN_PRESETS
    from kvoff.tools.plan import __doc__ as plan_doc

    specs_format = plan_doc[plan_doc.index("Specs file format") :] if plan_doc else ""
    pp = sub.add_parser(
        "plan",
        help="what fits: GPU blocks, CPU blocks and the max model length of a model",
        description=(
            "Plan the KV cache of one model: groups and page sizes, GPU blocks and tokens (per "
            "rank), CPU blocks and tokens (pool over all ranks), the max model length. Shapes "
            "are per rank (--world-size does not reshard them).\n\n" + specs_format
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = pp.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=sorted(PLAN_PRESETS), help="model preset")
    src.add_argument("--specs", type=Path, metavar="FILE.json", help="JSON file of layer specs")
    pp.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        required=True,
        help="GPU memory for the KV cache on one rank, e.g. 40GiB",
    )
    pp.add_argument(
        "--cpu-bytes",
        type=parse_bytes,
        required=True,
        help="CPU pool size over all ranks, e.g. 256GiB",
    )
    pp.add_argument(
        "--world-size", type=_positive_int, default=1, help="tensor-parallel ranks (default: 1)"
    )
    pp.add_argument(
        "--num-gpu-blocks-override",
        type=_positive_int,
        default=None,
        help="fixed GPU block count (replaces --gpu-memory for capacity)",
    )
    pp.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="required max model length in tokens (default: the largest that fits)",
    )
    pp.add_argument(
        "--block-size",
        type=_positive_int,
        default=None,
        help="tokens per offloaded (CPU) block; a multiple of the GPU block size "
        "(default: the GPU block size)",
    )
    pp.add_argument(
        "--policy",
        default="lru",
        choices=list(EVICTION_POLICIES),
        help="eviction policy (default: lru)",
    )
    pp.add_argument("--json", action="store_true", help="print the plan as a JSON object")


def _plan(args: argparse.Namespace) -> int:
    from kvoff.tools.plan import PLAN_PRESETS, compute_plan, load_specs_file

    if args.model is not None:
        specs, source = PLAN_PRESETS[args.model].layer_specs(), args.model
    else:
        specs, source = load_specs_file(args.specs), str(args.specs)
    plan = compute_plan(
        specs,
        args.gpu_memory,
        args.cpu_bytes,
        world_size=args.world_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        max_model_len=args.max_model_len,
        offloaded_block_size=args.block_size,
        eviction_policy=args.policy,
        source=source,
    )
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.format())
    return 0


def _run_info() -> dict[str, object]:
    """Where and how a result was produced (:func:`kvoff.tools.bench.run_info`: command, date,
    machine, versions, build), plus torch's CPU thread count, which the replay's copies use."""
    import torch

    from kvoff.tools.bench import run_info

    info = run_info()
    info["machine"]["torch_threads"] = torch.get_num_threads()
    return info


_SIM_ONLY = {
    "cpu_blocks": None, "gpu_prefix_blocks": 0, "device": "cpu", "gpu_layout": "layer_major",
    "mechanism": "auto", "compute": False, "model": "tiny", "sweep_capacity": None,
    "policies": None, "plot": None, "engines": 1,
}  # fmt: skip


_VLLM_ONLY = {
    "tokens_per_hash": 32, "max_tokens": 16, "concurrency": 8, "gpu_blocks": None,
    "engine_model": "llama", "dtype": "float32", "runs": ["kvoff", "engine_only"],
}  # fmt: skip

_SCHEDULER_ONLY = {
    "pool_sizes": None, "large": False, "batch": 256, "calls": 1024, "repeat": 5,
    "key_bytes": 9, "eviction_policy": "lru", "no_baseline": False, "steps": None,
}  # fmt: skip


def _check_output(path: Path | None, flag: str) -> None:
    """Fails before a long run when ``path`` (``--json``/``--plot``) cannot be written: an
    existing folder, or a parent that is not a folder; creates a missing parent folder."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file path, e.g. {path / 'out'}")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a folder; give a path in a folder")
    parent.mkdir(parents=True, exist_ok=True)


def _replay_vllm(args: argparse.Namespace) -> int:
    """``kvoff replay --engine vllm``."""
    from kvoff.config import OffloadingConfig
    from kvoff.tools.replay import DEFAULT_CPU_BYTES
    from kvoff.tools.replay_vllm import VllmReplayConfig, format_vllm_replay, run_vllm_replay

    for name, default in _SIM_ONLY.items():
        if getattr(args, name) != default:
            raise ValueError(
                f"--{name.replace('_', '-')} applies to --engine sim only; with --engine vllm "
                "the engine owns the GPU cache, the transfers and the model (see --engine-model)"
            )
    for name in ("store_threshold", "max_tracker_size"):
        if getattr(args, name) is not None:
            raise ValueError(
                f"--{name.replace('_', '-')} applies to --engine sim only (the vLLM replay "
                "does not pass it to its connector); drop it"
            )
    flags = {
        "cpu_bytes_to_use": args.cpu_bytes,
        "offloaded_block_size": args.offloaded_block_size,
        "eviction_policy": args.policy,
        "disk_path": args.disk_path,
        "disk_bytes": args.disk_bytes,
        "remote_url": args.remote_url,
    }
    pool = OffloadingConfig.load(
        args.config,
        defaults={"cpu_bytes_to_use": DEFAULT_CPU_BYTES},
        **{k: v for k, v in flags.items() if v is not None},
    )
    config = VllmReplayConfig(
        trace=args.trace,
        limit=args.limit or 200,
        trace_block_size=args.trace_block_size,
        tokens_per_hash=args.tokens_per_hash,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        block_size=args.block_size or 32,
        num_gpu_blocks=args.gpu_blocks,
        cpu_bytes=pool.cpu_bytes_to_use or DEFAULT_CPU_BYTES,
        offloaded_block_size=pool.offloaded_block_size,
        eviction_policy=pool.eviction_policy,
        model=args.engine_model,
        dtype=args.dtype,
        engines=tuple(dict.fromkeys(args.runs)),
        disk_path=None if pool.disk_path is None else str(pool.disk_path),
        disk_bytes=pool.disk_bytes,
        remote_url=pool.remote_url,
        remote_namespace=args.remote_namespace,
        remote_timeout_s=args.remote_timeout,
    )
    result = run_vllm_replay(
        config, log=None if args.no_progress else lambda m: print(f"  {m}", file=sys.stderr)
    )
    print(format_vllm_replay(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"run": _run_info(), "result": result}, indent=2) + "\n")
        print(f"  JSON written to {args.json}")
    exact = all(r["accounting_exact"] for r in result["runs"].values())
    return 0 if exact and result.get("outputs_equal", True) else 1


def _sweep(args: argparse.Namespace, config: ReplayConfig) -> int:
    """``kvoff replay --sweep-capacity``: the table, then --json and --plot."""
    from kvoff.tools.policy_sweep import (
        DEFAULT_SWEEP_POLICIES,
        format_sweep_table,
        parse_capacities,
        parse_policies,
        plot_sweep,
        run_policy_sweep,
    )

    capacities = parse_capacities(args.sweep_capacity)
    policies = (
        parse_policies(args.policies) if args.policies is not None else DEFAULT_SWEEP_POLICIES
    )
    plot_path = None
    if args.plot is not None:
        try:  # before the sweep, not after it
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise ValueError(
                'kvoff replay --plot needs matplotlib: pip install "kvoff[plot]" (or matplotlib)'
            ) from exc
        plot_path = args.plot if args.plot.suffix else args.plot.with_suffix(".png")
        _check_output(plot_path, "--plot")
    log = None if args.no_progress else lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)
    sweep = run_policy_sweep(config, capacities, policies, log=log)
    print(format_sweep_table(sweep))
    if args.json is not None:
        record = {"run": _run_info(), "sweep": sweep.to_dict()}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"  JSON written to {args.json}")
    if args.plot is not None:
        plot_sweep(sweep, plot_path or args.plot)
        print(f"  curves drawn in {plot_path}")
    corrupted = sum(p.corrupted_blocks for p in sweep.points)
    return 1 if corrupted else 0


def _replay(args: argparse.Namespace) -> int:
    _check_output(args.json, "--json")
    if args.engine == "vllm":
        return _replay_vllm(args)
    from tqdm import tqdm

    from kvoff.config import OffloadingConfig
    from kvoff.tools.replay import DEFAULT_CPU_BYTES, ReplayConfig, run_replay
    from kvoff.tools.traces import load_trace

    for name, default in _VLLM_ONLY.items():
        if getattr(args, name) != default:
            raise ValueError(
                f"--{name.replace('_', '-')} applies to --engine vllm only; add --engine vllm "
                "or drop it"
            )
    if args.policy == "min" and (args.compute or args.device != "cpu"):
        raise ValueError(
            "policy 'min' simulates the pool offline (no bytes move, nothing is computed); drop "
            "--compute and --device, or pick an engine policy"
        )
    if args.policy == "min" and (args.store_threshold or 0) >= 2:
        raise ValueError(
            "policy 'min' is the offline optimum without an admission filter; drop "
            "--store-threshold or pick an engine policy"
        )
    sweeping = args.sweep_capacity is not None
    if not sweeping and (args.policies is not None or args.plot is not None):
        raise ValueError(
            "--policies and --plot belong to a sweep; add --sweep-capacity N,N,... (CPU blocks)"
        )
    if sweeping and (args.cpu_blocks or args.cpu_bytes or args.policy):
        raise ValueError(
            "--sweep-capacity sets the pool size and the policy of every replay; drop "
            "--cpu-blocks, --cpu-bytes and --policy (use --policies for the policies)"
        )
    # pool settings: flags > KVOFF_* environment > --config file > replay defaults
    flags = {
        "num_cpu_blocks": args.cpu_blocks,
        "cpu_bytes_to_use": args.cpu_bytes,
        "offloaded_block_size": args.offloaded_block_size,
        "eviction_policy": None if args.policy == "min" else args.policy,
        "store_threshold": args.store_threshold,
        "max_tracker_size": args.max_tracker_size,
        # the tiers: flags, else KVOFF_DISK_PATH / KVOFF_DISK_BYTES / KVOFF_REMOTE_URL or the file
        "disk_path": args.disk_path,
        "disk_bytes": args.disk_bytes,
        "remote_url": args.remote_url,
    }
    pool = OffloadingConfig.load(
        args.config,
        defaults={"cpu_bytes_to_use": DEFAULT_CPU_BYTES, "offloaded_block_size": 512},
        **{k: v for k, v in flags.items() if v is not None},
    )
    config = ReplayConfig(
        trace=args.trace,
        model=args.model,
        block_size=args.block_size or 16,
        offloaded_block_size=pool.offloaded_block_size or 512,
        gpu_prefix_blocks=args.gpu_prefix_blocks,
        cpu_blocks=pool.num_cpu_blocks,
        cpu_bytes=pool.cpu_bytes_to_use,
        policy="min" if args.policy == "min" else pool.eviction_policy,
        store_threshold=pool.store_threshold,
        max_tracker_size=pool.max_tracker_size,
        limit=args.limit,
        trace_block_size=args.trace_block_size,
        device=args.device,
        gpu_layout=args.gpu_layout,
        mechanism=args.mechanism,
        compute=args.compute,
        compute_chunk_tokens=args.compute_chunk_tokens,
        disk_path=None if pool.disk_path is None else str(pool.disk_path),
        disk_bytes=pool.disk_bytes,
        remote_url=pool.remote_url,
        remote_namespace=args.remote_namespace,
        remote_timeout_s=args.remote_timeout,
        engines=args.engines,
        assign=args.assign,
    )
    if sweeping:
        return _sweep(args, config)
    requests = load_trace(config.trace, config.limit, config.trace_block_size)
    # tqdm's disable=None turns the bar off when stderr is not a terminal
    with tqdm(
        total=len(requests),
        unit="req",
        disable=True if args.no_progress else None,
        desc="replay",
        file=sys.stderr,
    ) as bar:
        last = 0

        def progress(done: int) -> None:
            nonlocal last
            if done - last >= 64 or done == len(requests):
                bar.update(done - last)
                last = done

        result = run_replay(config, progress=progress, requests=requests)
    s = result.summary()
    gib = 2**30
    on = s["store_threshold"] >= 2
    threshold = f", store_threshold {s['store_threshold']}" if on else ""
    filtered = f", {s['stores_filtered']:,} below store_threshold" if on else ""
    if s["device"] == "offline":  # Belady's MIN: simulated, no bytes moved
        print(
            f"kvoff replay: {s['requests']} requests of trace {s['trace']!r}, Belady's MIN "
            f"(offline optimum, simulated: no bytes moved), block_size {s['block_size']}, "
            f"offloaded_block_size {s['offloaded_block_size']}\n"
            f"  pool: {s['cpu_blocks']} CPU blocks, GPU prefix cache "
            f"{s['gpu_prefix_blocks']} blocks\n"
            f"  input tokens     {s['input_tokens']:>14,}\n"
            f"  GPU hit tokens   {s['gpu_hit_tokens']:>14,}\n"
            f"  kvoff hit tokens {s['cpu_hit_tokens']:>14,}\n"
            f"  hit rate         {s['hit_rate']:>14.4%}   (full-block maximum "
            f"{s['max_hit_rate']:.4%})\n"
            f"  stored           {s['blocks_stored']:>14,} blocks; {s['stores_skipped']} "
            "skipped (no room)\n"
            f"  evictions        {s['evictions']:>14,}"
        )
        if args.json is not None:
            args.json.write_text(json.dumps({"run": _run_info(), "result": s}, indent=2) + "\n")
            print(f"  JSON written to {args.json}")
        return 0
    print(
        f"kvoff replay: {s['requests']} requests of trace {s['trace']!r}, model {s['model']}, "
        f"block_size {s['block_size']}, offloaded_block_size {s['offloaded_block_size']}\n"
        f"  pool: {s['cpu_blocks']} CPU blocks ({s['cpu_pool_bytes'] / gib:.2f} GiB, "
        f"{s['policy']}{threshold}), GPU prefix cache {s['gpu_prefix_blocks']} blocks\n"
        f"  input tokens     {s['input_tokens']:>14,}\n"
        f"  GPU hit tokens   {s['gpu_hit_tokens']:>14,}\n"
        f"  kvoff hit tokens {s['cpu_hit_tokens']:>14,}\n"
        f"  hit rate         {s['hit_rate']:>14.4%}   (full-block maximum "
        f"{s['max_hit_rate']:.4%})\n"
        f"  stored           {s['blocks_stored']:>14,} blocks, {s['bytes_stored'] / gib:.2f} GiB "
        f"at {s['store_gbps']:.2f} GB/s; {s['stores_skipped']} skipped (no room)"
        f"{filtered}\n"
        f"  loaded           {s['blocks_loaded']:>14,} GPU blocks, {s['bytes_loaded'] / gib:.2f} "
        f"GiB at {s['load_gbps']:.2f} GB/s\n"
        f"  verified         {s['blocks_verified']:>14,} blocks, corrupted "
        f"{s['corrupted_blocks']}, failed transfers {s['failed_transfers']}\n"
        f"  evictions        {s['evictions']:>14,}\n"
        f"  waited           {s['fence_wait_s']:>14.3f} s on fences ({s['fence_waits']:,} times), "
        f"{s['retry_wait_s']:.3f} s on lookup retries ({s['lookup_retries']:,}), "
        f"{s['load_wait_s']:.3f} s on loads\n"
        f"  device           {s['device']:>14} ({s['gpu_layout']}; jobs by mechanism: "
        f"{s['mechanisms']})\n"
        f"  wall             {s['wall_s']:>14.1f} s"
    )
    if s["tiers"]:
        print(_format_tiers(s))
    if s["time_kvoff_s"] is not None:
        ideal = s["ideal_speedup"]
        print(
            f"  compute          {s['computed_tokens']:>14,} tokens computed, "
            f"{s['compute_flops_per_token'] / 1e9:.2f} GFLOP per token\n"
            f"  time with kvoff  {s['time_kvoff_s']:>14.3f} s (loads waited for, GEMMs)\n"
            f"  time recomputing {s['time_recompute_s']:>14.3f} s (every input token)\n"
            f"  speedup          {s['speedup']:>14.3f}x   (ideal 1/(1-hit rate) = "
            + (f"{ideal:.3f}x; {s['speedup_vs_ideal']:.1%} of it)" if ideal else "n/a)")
            + f"\n  GEMM lost        {s['gemm_lost_s']:>14.3f} s to transfers beside it "
            f"({s['gemm_s']:.3f} s vs {s['gemm_alone_s']:.3f} s alone)"
        )
    if args.json is not None:
        record = {"run": _run_info(), "result": s}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"  JSON written to {args.json}")
    bad = s["corrupted_blocks"] or s["failed_transfers"]
    return 1 if bad else 0


def _format_tiers(s: dict) -> str:
    """The replay's per-tier lines: hit tokens by source, then each tier's reads, writes,
    promotions, drops and rejected blocks."""
    t = s["tiers"]
    hits = ", ".join(f"{k} {v:,}" for k, v in s["tier_hit_tokens"].items())
    lines = [
        f"  engines          {s['engines']:>14}",
        f"  hit tokens by    {'source':>14}: {hits}",
        f"  write-through    {t['writes_queued']:>14,} blocks queued, "
        f"{t['writes_dropped_queue_full']:,} dropped (queue full); {t['probes']:,} tier probes",
    ]
    for name, x in t["tiers"].items():
        lines.append(
            f"  {name:<16} {x['promoted_blocks']:>14,} blocks promoted at "
            f"{x['promotion_gbps']:.2f} GB/s; read {x['bytes_read'] / 2**30:.2f} GiB at "
            f"{x['read_gbps']:.2f} GB/s, wrote {x['blocks_written']:,} blocks "
            f"({x['bytes_written'] / 2**30:.2f} GiB at {x['write_gbps']:.2f} GB/s); dropped "
            f"writes {x['writes_dropped']:,}; corrupted blocks rejected "
            f"{x['corrupted_blocks']:,}; timeouts {x.get('timeouts', 0):,}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvoff`` console script. Returns the process exit code (0: success;
    1: corrupted blocks or failed transfers, or `kvoff info` found a mismatch; 2: bad arguments)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if isinstance(getattr(args, "json", None), Path):  # a file: checked before a long run
            _check_output(args.json, "--json")
        if args.command == "replay":
            return _replay(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "info":
            return _info(args)
        if args.command == "bench" and args.bench_command == "transfer":
            return _bench_transfer(args, argv)
        if args.command == "bench" and args.bench_command == "tiers":
            return _bench_tiers(args)
        if args.command == "bench" and args.bench_command == "manager-calls":
            from kvoff.tools.bench_manager_calls import run_manager_calls_cli

            return run_manager_calls_cli(args, argv)
        if args.command == "bench":
            return _bench(args, argv)
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"kvoff {args.command}: error: {exc}\n")
    except OSError as exc:  # a path the user gave: a folder for a file, a file for a folder, ...
        where = f"{exc.filename}: " if exc.filename is not None else ""
        reason = exc.strerror or str(exc)
        parser.exit(2, f"kvoff {args.command}: error: {where}{reason}; check the path\n")
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
