"""The manager's cost per key under each eviction policy, side by side in one run.

``python -m kvoff.tools.bench_policies [--policies lru,probation] [--pool-sizes N ...]
[--rounds R] [--json FILE]`` runs the in-core workload of ``kvoff bench scheduler``
(:func:`kvoff._bench.bench_manager`, ``cpp/bench/manager_bench.cpp``: lookup, then
``prepare_store`` of new keys into a full pool, each evicting, then ``complete_store``) once per
policy per round, alternating the order of the policies from round to round so that drift on a
shared machine hits both. Per pool size and operation it reports the median over rounds of each
policy's ns per key and the ratio of each policy to the first (``lru``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvoff.tools.bench import DEFAULT_POOL_SIZES, ManagerBenchParams, run_info
from kvoff.tools.cli.common import (
    add_json_option,
    check_output,
    is_stdout,
    text_to_stderr,
    write_json,
)

__all__ = ["OPERATIONS", "bench_policies", "main"]

OPERATIONS = ("lookup", "prepare_store", "complete_store", "store")
"""``store`` is ``prepare_store`` plus ``complete_store`` per stored key."""


def _ns(result: dict[str, Any], op: str) -> float:
    if op == "store":
        keys = result["prepare_store"]["keys"]
        seconds = result["prepare_store"]["seconds"] + result["complete_store"]["seconds"]
        return seconds * 1e9 / keys
    return float(result[op]["ns_per_key"])


def bench_policies(
    policies: Sequence[str],
    params: ManagerBenchParams,
    rounds: int,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Per pool size: ``{"pool_size", "ns_per_key": {policy: {op: median}}, "samples":
    {policy: {op: [...]}}, "ratio_to_<first>": {policy: {op: ratio}}}`` (see the module
    docstring). Each sample is the median round of one ``bench_manager`` call.

    Raises:
        ValueError: an unknown policy, fewer than one round, or the policies disagreeing on
            the workload's lookup hits (they must run the same workload).
    """
    from kvoff import _bench, _scheduler

    known = _scheduler.eviction_policies()
    for p in policies:
        if p not in known:
            raise ValueError(f"unknown eviction policy {p!r}; choose from {list(known)}")
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    out = []
    for n in params.pool_sizes:
        samples: dict[str, dict[str, list[float]]] = {
            p: {op: [] for op in OPERATIONS} for p in policies
        }
        hits = set()
        for r in range(rounds):
            order = list(policies) if r % 2 == 0 else list(reversed(policies))
            for p in order:
                if log is not None:
                    log(f"pool {n:,} round {r + 1}/{rounds}: {p}")
                res = dict(
                    _bench.bench_manager(
                        n,
                        p,
                        params.key_bytes,
                        params.batch,
                        params.batches_per_round,
                        params.repeat,
                        params.seed,
                    )
                )
                hits.add(res["lookup_hits"])
                for op in OPERATIONS:
                    samples[p][op].append(_ns(res, op))
        if len(hits) != 1:
            raise ValueError(f"pool {n}: the policies ran different workloads (hits {hits})")
        medians = {p: {op: statistics.median(v) for op, v in s.items()} for p, s in samples.items()}
        first = policies[0]
        out.append(
            {
                "pool_size": n,
                "ns_per_key": medians,
                f"ratio_to_{first}": {
                    p: {op: medians[p][op] / medians[first][op] for op in OPERATIONS}
                    for p in policies
                },
                # the median of the per-round ratios (each round runs every policy back to back)
                f"paired_ratio_to_{first}": {
                    p: {
                        op: statistics.median(
                            a / b for a, b in zip(samples[p][op], samples[first][op], strict=True)
                        )
                        for op in OPERATIONS
                    }
                    for p in policies
                },
                "samples": samples,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kvoff.tools.bench_policies``: the eviction policies' manager cost in ns per
    key, side by side in one run (table on stdout, progress on stderr). Returns the exit
    status (0).

    Raises:
        SystemExit: bad arguments (argparse names them).
        ValueError: an unknown policy name (naming it and the choices).
    """
    parser = argparse.ArgumentParser(prog="python -m kvoff.tools.bench_policies")
    parser.add_argument("--policies", default="lru,probation", metavar="P,P,...")
    parser.add_argument("--pool-sizes", type=int, nargs="+", default=list(DEFAULT_POOL_SIZES))
    parser.add_argument("--rounds", type=int, default=5, help="runs per policy (default: 5)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per run")
    parser.add_argument("--calls", type=int, default=1024, help="calls per timed round")
    add_json_option(parser)
    args = parser.parse_args(argv)
    check_output(args.json, "--json")
    with text_to_stderr(is_stdout(args.json)):
        return _run(args, argv)


def _run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """:func:`main` of parsed arguments."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    params = ManagerBenchParams(
        pool_sizes=tuple(args.pool_sizes),
        batches_per_round=args.calls,
        repeat=args.repeat,
        baseline=False,
    )
    entries = bench_policies(
        policies, params, args.rounds, log=lambda m: print(f"  {m}", file=sys.stderr, flush=True)
    )
    first = policies[0]
    print(f"ns per key (median of {args.rounds} runs; ratio to {first}; median paired ratio)")
    for e in entries:
        for op in OPERATIONS:
            cells = "  ".join(
                f"{p} {e['ns_per_key'][p][op]:7.1f} ({e[f'ratio_to_{first}'][p][op]:.2f}x, "
                f"{e[f'paired_ratio_to_{first}'][p][op]:.2f}x)"
                for p in policies
            )
            print(f"{e['pool_size']:>10,}  {op:<15}{cells}")
    if args.json is not None:
        argv_ = list(sys.argv[1:] if argv is None else argv)
        info = run_info(argv_)
        info["command"] = "python -m kvoff.tools.bench_policies " + " ".join(argv_)
        doc = {
            "benchmark": "manager cost per key by eviction policy (kvoff bench scheduler workload)",
            "run": info,
            "parameters": {
                "policies": policies,
                "rounds": args.rounds,
                **{k: v for k, v in vars(params).items() if k != "pool_sizes"},
                "pool_sizes": list(params.pool_sizes),
            },
            "manager": entries,
        }
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
