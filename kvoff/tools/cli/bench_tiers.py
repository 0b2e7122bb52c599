"""``kvoff bench tiers``: the secondary tiers (disk against dd, Redis Cluster), the engine
thread's cost with tiers on, and a promotion against the disk read
(:mod:`kvoff.tools.bench_tiers`, :mod:`kvoff.tools.bench_tiered_pool`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvoff.tools.cli.common import (
    add_json_option,
    parse_bytes,
    positive_int,
    run_info,
    write_json,
)

__all__ = ["add_parser", "run"]


def _bytes_or_zero(text: str) -> int:
    """A byte count that may be 0 (off), for argparse.

    Raises:
        argparse.ArgumentTypeError: text that is not a byte count.
    """
    from kvoff.config import parse_byte_size

    try:
        return parse_byte_size(text, allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff bench tiers`` on the ``bench`` subparsers."""
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
        "--lookup-batch", type=positive_int, default=256, help="keys per lookup (default: 256)"
    )
    tp.add_argument(
        "--disk-repeat",
        type=positive_int,
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
        "--mac-total-bytes",
        type=_bytes_or_zero,
        default=256 << 20,
        metavar="BYTES",
        help="bytes of 512 KiB blocks the shared_secret MAC is timed on, against the xxh3 "
        "checksum and a memcpy (default: 256MiB; 0 skips it); with Redis, also 512 KiB gets "
        "and puts without and with a shared_secret",
    )
    add_json_option(tp)
    tp.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff bench tiers``: the tables, and the results with ``--json``. Returns 1 when a
    tier failed its checks (:func:`kvoff.tools.bench_tiers.tier_failures`), else 0.

    Raises:
        ValueError / OSError: bad sizes, a disk path that is not a folder.
    """
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
            mac_total_bytes=args.mac_total_bytes,
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
    result["run"] = run_info(argv)  # the command as parsed, not the process's sys.argv
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
        write_json(args.json, result)
    return 1 if tier_failures(result) else 0
