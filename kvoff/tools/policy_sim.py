"""Hit-rate sweeps of the eviction policies without moving bytes.

``kvoff replay --sweep-capacity`` replays every point with real stores and loads (about 6 min per
point for the conversation trace on a 2-core CPU box). The hit rate depends only on the
manager's decisions, so :func:`run_manager_replay` makes the same manager calls as
:func:`kvoff.tools.replay.run_replay` (the same request loop,
:func:`kvoff.tools.request_loop.run_request_loop`: same offload keys, lookup, ``touch``, one
all-or-nothing ``prepare_store``, ``touch``, then ``complete_store`` before the next request, as
the CPU replay's stores finish) on the C++ ``CPUOffloadingManager`` alone;
``tests/tools/test_policy_sim.py`` checks that its counts equal the replay's. The GPU prefix
cache is not modelled (``gpu_prefix_blocks`` must be 0, the replay's default).

``python -m kvoff.tools.policy_sim --trace T --sweep-capacity 1000,3000 --policies lru,min
[--store-threshold N] [--max-tracker-size N] [--json F.json] [--plot F.png]`` prints the table
of ``kvoff replay --sweep-capacity`` and writes the same JSON (``run``: machine, date, command;
``sweep``) and curves; ``min`` is :func:`kvoff.tools.belady.run_min_replay`. A policy with a
store threshold is written ``lru+t2`` (:func:`kvoff.tools.policy_sweep.parse_policies`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvoff.tools.belady import MIN_POLICY, run_min_replay
from kvoff.tools.cli.common import (
    add_json_option,
    check_output,
    is_stdout,
    text_to_stderr,
    write_json,
)
from kvoff.tools.policy_sweep import (
    PolicySweep,
    SweepPoint,
    format_sweep_table,
    parse_capacities,
    parse_policies,
    plot_sweep,
    resolve_policies,
)
from kvoff.tools.request_loop import (
    ReplayConfig,
    ReplayResult,
    RequestBlocks,
    StoreOutcome,
    offload_key,
    replay_requests,
    run_request_loop,
)
from kvoff.tools.traces import TraceRequest, load_trace

__all__ = ["main", "run_manager_replay", "run_manager_sweep"]


def run_manager_replay(
    config: ReplayConfig, requests: list[TraceRequest] | None = None
) -> ReplayResult:
    """The hit counts of ``run_replay(config)`` from the manager alone (module docstring).

    Raises:
        ValueError: ``gpu_prefix_blocks`` != 0, no ``cpu_blocks``, block sizes that do not
            divide, ``min`` with a ``store_threshold`` >= 2, or a ``store_threshold`` /
            ``max_tracker_size`` out of range (naming it).
    """
    from kvoff import _scheduler

    if config.policy == MIN_POLICY:
        if config.store_threshold >= 2:
            raise ValueError(
                "policy 'min' is the offline optimum without an admission filter; drop "
                f"store_threshold={config.store_threshold}"
            )
        return run_min_replay(config, requests=requests)
    if config.gpu_prefix_blocks or not config.cpu_blocks:
        raise ValueError("run_manager_replay needs gpu_prefix_blocks=0 and cpu_blocks")
    bs, obs = config.block_size, config.offloaded_block_size
    if obs % bs:
        raise ValueError(f"offloaded_block_size {obs} is not a multiple of block_size {bs}")
    t0 = time.perf_counter()
    reqs = replay_requests(config, requests)
    policy = config.policy or "lru"
    manager = _scheduler.CPUOffloadingManager(
        config.cpu_blocks,
        policy,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
    )
    res = ReplayResult(
        trace=config.trace,
        model=config.model,
        block_size=bs,
        offloaded_block_size=obs,
        gpu_prefix_blocks=0,
        cpu_blocks=config.cpu_blocks,
        policy=policy,
        device="manager-only",
        gpu_layout=config.gpu_layout,
        store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size,
        gpu_blocks=0,
        cpu_pool_bytes=0,
    )
    run_request_loop(
        reqs, _ManagerPool(manager), res, offload_key, trace_block_size=config.trace_block_size
    )
    res.stores_filtered = manager.stores_skipped
    res.wall_s = time.perf_counter() - t0
    return res


class _ManagerPool:
    """The manager-only side of :func:`kvoff.tools.request_loop.run_request_loop`: the replay's
    manager calls, no GPU cache, loads that cannot fail, stores that complete before the next
    request (as the CPU replay's do)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.stored: list[bytes] = []

    def begin(self, index: int, blocks: RequestBlocks, keys: list[bytes]) -> int:
        self.stored = []
        return 0

    def lookup(self, keys: list[bytes]) -> int:
        return self.manager.lookup(keys)

    def load(self, keys: list[bytes], first: int, end: int) -> bool:
        self.manager.prepare_load(keys)
        self.manager.complete_load(keys)
        return True

    def touch(self, keys: list[bytes]) -> None:
        self.manager.touch(keys)

    def compute(self, gpu_hits: int, hit_end: int) -> None:
        pass

    def store(self, keys: list[bytes], first: int) -> StoreOutcome | None:
        out = self.manager.prepare_store(keys)
        if out is None:
            return None
        self.stored = list(out.keys_to_store)
        return StoreOutcome(stored=len(self.stored), evicted=len(out.evicted_keys))

    def end(self, keys: list[bytes]) -> None:
        self.manager.touch(keys)
        if self.stored:
            self.manager.complete_store(self.stored, True)


def run_manager_sweep(
    base: ReplayConfig, capacities: Sequence[int], policies: Sequence[str], log=None
) -> PolicySweep:
    """:func:`kvoff.tools.policy_sweep.run_policy_sweep` with :func:`run_manager_replay`
    (policies as there: ``lru+t2`` carries a ``store_threshold``, others take
    ``base.store_threshold``).

    Raises:
        ValueError: a bad policy or ``+tN`` (:func:`kvoff.tools.policy_sweep.resolve_policies`),
            or what :func:`run_manager_replay` raises.
    """
    specs = resolve_policies(policies, base.store_threshold)
    requests = load_trace(base.trace, base.limit, base.trace_block_size)
    points = []
    result = None
    for label, policy, threshold in specs:
        for c in capacities:
            config = dataclasses.replace(
                base, cpu_blocks=c, cpu_bytes=None, policy=policy, store_threshold=threshold
            )
            result = run_manager_replay(config, requests)
            points.append(SweepPoint.from_result(result))
            if log is not None:
                log(f"{label:>10} {c:>9,}: hit rate {result.hit_rate:.4f} ({result.wall_s:.1f} s)")
    assert result is not None
    return PolicySweep(
        config=dataclasses.replace(base, cpu_blocks=capacities[0], cpu_bytes=None),
        capacities=tuple(capacities),
        policies=tuple(label for label, _, _ in specs),
        requests=result.requests,
        input_tokens=result.input_tokens,
        max_hit_rate=result.max_hit_rate,
        points=tuple(points),
    )


def _positive_limit(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive request count")
    return n


def main(argv: list[str] | None = None) -> int:
    """``python -m kvoff.tools.policy_sim``: full-block hit rates per policy and CPU pool
    capacity (blocks) on one trace, through the manager alone (no GPU model); a table, and
    with ``--json`` / ``--plot`` the sweep as JSON and a PNG. Returns the exit status (0).

    Raises:
        SystemExit: bad arguments, with status 2 and a message naming them: argparse's, an
            unknown policy or trace, a capacity below 1, a bad trace record, a path that cannot
            be read or written.
    """
    parser = argparse.ArgumentParser(prog="python -m kvoff.tools.policy_sim")
    parser.add_argument("--trace", default="conversation", help="bundled name or JSONL path")
    parser.add_argument("--sweep-capacity", required=True, metavar="N,N,...")
    parser.add_argument(
        "--policies",
        default="lru,arc,probation,min",
        metavar="P,P,...",
        help="policies, each optionally with a store threshold (lru+t2); default: "
        "lru,arc,probation,min",
    )
    parser.add_argument(
        "--store-threshold",
        type=int,
        default=0,
        metavar="N",
        help="the manager's store_threshold for policies without +tN (default: 0, off)",
    )
    parser.add_argument(
        "--max-tracker-size",
        type=int,
        default=64000,
        metavar="N",
        help="keys the store_threshold tracker holds at most (default: 64000)",
    )
    parser.add_argument("--limit", type=_positive_limit, default=None)
    add_json_option(parser)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        check_output(args.json, "--json")
        with text_to_stderr(is_stdout(args.json)):
            return _main(args, argv)
    except (ValueError, ImportError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    except OSError as exc:  # FileNotFoundError (an unknown trace) included
        where = f"{exc.filename}: " if exc.filename is not None and exc.strerror else ""
        parser.exit(2, f"{parser.prog}: error: {where}{exc.strerror or exc}\n")
    return 2  # pragma: no cover


def _main(args: argparse.Namespace, argv: list[str] | None) -> int:
    base = ReplayConfig(
        trace=args.trace,
        limit=args.limit,
        store_threshold=args.store_threshold,
        max_tracker_size=args.max_tracker_size,
    )
    sweep = run_manager_sweep(
        base,
        parse_capacities(args.sweep_capacity),
        parse_policies(args.policies),
        log=lambda m: print(f"  {m}", file=sys.stderr, flush=True),
    )
    print(format_sweep_table(sweep))
    if args.json is not None:
        from kvoff.tools.bench import run_info

        argv_ = list(sys.argv[1:] if argv is None else argv)
        info = run_info(argv_)
        info["command"] = "python -m kvoff.tools.policy_sim " + " ".join(argv_)
        info["simulation"] = "manager only (kvoff.tools.policy_sim); min: kvoff.tools.belady"
        write_json(args.json, {"run": info, "sweep": sweep.to_dict()})
    if args.plot is not None:
        plot_sweep(sweep, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
