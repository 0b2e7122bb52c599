"""``kvoff bench transfer``: GPU<->CPU block jobs per layout and mechanism against the link's
limit, and their cost to a concurrent GEMM (:mod:`kvoff.tools.bench_transfer`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvoff.tools.cli.common import (
    add_json_option,
    is_stdout,
    non_negative_int,
    positive_int,
    write_json,
)

__all__ = ["add_parser", "run"]


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff bench transfer`` on the ``bench`` subparsers."""
    from kvoff.slot_layout import GPU_LAYOUTS
    from kvoff.tools.bench_transfer import DEFAULT_PRESETS, JOB_SIZES, TRANSFER_PRESETS
    from kvoff.tools.slowdown_rounds import GEMM_ROUNDS
    from kvoff.transfer import DEFAULT_STAGING_BYTES, DEFAULT_STAGING_PIECE_BYTES

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
        type=positive_int,
        default=None,
        help="blocks per job (default: about --job-mib MiB per job)",
    )
    tp.add_argument("--job-mib", type=positive_int, default=512, help="MiB per job (default: 512)")
    tp.add_argument(
        "--repeat", type=positive_int, default=10, help="timed calls, median (default: 10)"
    )
    tp.add_argument(
        "--warmup", type=non_negative_int, default=2, help="untimed calls first (default: 2)"
    )
    tp.add_argument("--seed", type=non_negative_int, default=0, help="block id seed (default: 0)")
    tp.add_argument(
        "--kernel-blocks",
        type=non_negative_int,
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
        "--gemm-rounds",
        type=positive_int,
        default=GEMM_ROUNDS,
        help="GPU: interleaved alone / with-transfers rounds of the GEMM slowdown, median "
        "reported (default: %(default)s)",
    )
    tp.add_argument(
        "--job-sizes",
        type=positive_int,
        nargs="*",
        default=list(JOB_SIZES),
        metavar="BLOCKS",
        help="blocks per job of the engine-step section (default: "
        + " ".join(map(str, JOB_SIZES))
        + "; none to skip it)",
    )
    tp.add_argument(
        "--step-jobs",
        type=non_negative_int,
        default=16,
        metavar="JOBS",
        help="one-block jobs of the step-submission section, timed one by one and together "
        "(transfer_many_async) per direction (default: %(default)s; 0 to skip it)",
    )
    tp.add_argument(
        "--staging-mib",
        type=non_negative_int,
        default=DEFAULT_STAGING_BYTES >> 20,
        help="the worker's staging buffer, both directions, MiB (default: %(default)s)",
    )
    tp.add_argument(
        "--staging-piece-mib",
        type=positive_int,
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
    add_json_option(tp)
    tp.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff bench transfer``: the table, and the results with ``--json`` (a file is
    rewritten as the run goes, so a run cut short keeps what it measured). Returns 0.

    Raises:
        ValueError: a bad preset, layout or ``--write-thresholds`` without what it needs.
        RuntimeError: a timed copy that is not byte-exact, a failed job.
    """
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
        gemm_rounds=args.gemm_rounds,
        job_sizes=tuple(args.job_sizes),
        step_jobs=args.step_jobs,
        staging_bytes=args.staging_mib << 20,
        staging_piece_bytes=args.staging_piece_mib << 20,
        shared_pool=args.shared_pool,
    )
    doc = run_transfer_bench(
        params,
        json_path=None if is_stdout(args.json) else args.json,
        write_thresholds=args.write_thresholds,
        argv=argv,
        log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
    )
    print(format_transfer_table(doc))
    if is_stdout(args.json):
        write_json(args.json, doc)
    elif args.json is not None:
        print(f"JSON written to {args.json}")
    return 0
