"""``kvoff bench node-pool``: copies into a node pool's slots and manager calls through its
socket, against a private pool, side by side (:mod:`kvoff.tools.bench_node_pool`)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from kvoff.tools.cli.common import add_json_option, positive_int, run_info, write_json

__all__ = ["add_parser", "run"]


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff bench node-pool`` on the ``bench`` subparsers."""
    np_ = bench_sub.add_parser(
        "node-pool",
        help="what a node pool costs an engine against a private pool (copies, calls)",
        description=(
            "Store and load jobs into a node pool's slots (mapped from /dev/shm) against a "
            "private CPU pool, and one request's manager calls through the pool's socket "
            "against an in-process manager; rounds alternate which goes first."
        ),
    )
    np_.add_argument("--model", default="qwen2.5-7b", help="layout preset (default: qwen2.5-7b)")
    np_.add_argument("--blocks", type=positive_int, default=256,
                     help="GPU blocks per copy job (default: 256)")  # fmt: skip
    np_.add_argument("--keys", type=positive_int, default=32,
                     help="keys per manager call (default: 32)")  # fmt: skip
    np_.add_argument("--rounds", type=positive_int, default=7, help="rounds (default: 7)")
    np_.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="(default: cpu)")
    add_json_option(np_)
    np_.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff bench node-pool``: the table, and the results with ``--json``. Returns 0.

    Raises:
        ValueError: an unknown model.
    """
    from kvoff.tools.bench_node_pool import run_node_pool_bench

    r = run_node_pool_bench(args.model, args.blocks, args.keys, args.rounds, args.device)
    lines = [f"kvoff bench node-pool: {r['model']}, {r['device']}, {r['rounds']} rounds"]
    for d in ("store", "load"):
        c = r["copy"][d]
        lines.append(
            f"  {d:<6} private {statistics.median(c['private_gbps']):7.2f} GB/s   node pool "
            f"{statistics.median(c['node_pool_gbps']):7.2f} GB/s   ratio "
            f"{c['node_pool_vs_private']:.3f}"
        )
    c = r["calls"]
    lines.append(
        f"  calls  private {c['private_us_per_call_median']:7.2f} µs     node pool "
        f"{c['node_pool_us_per_call_median']:7.2f} µs     ratio {c['node_pool_vs_private']:.2f}"
        f"   ({r['keys']} keys a call)"
    )
    c = r["misses"]
    lines.append(
        f"  misses filter  {c['filter_us_per_lookup_median']:7.2f} µs     asking "
        f"{c['asking_us_per_lookup_median']:7.2f} µs     ratio {c['filter_vs_asking']:.3f}"
        "   (one-key look-ups of keys not in the pool)"
    )
    print("\n".join(lines))
    if args.json is not None:
        write_json(args.json, {"run": run_info(argv), "result": r})
    return 0
