"""``kvoff bench scheduler``: the offloading manager and the per-step scheduler cost, C++
against a pure-Python baseline (:mod:`kvoff.tools.bench`), or with ``--vs-vllm`` side by side
with vLLM's own offloading (:mod:`kvoff.tools.bench_vllm`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvoff.tools.cli.common import (
    add_json_option,
    int_at_least,
    is_stdout,
    non_negative_int,
    positive_int,
    write_json,
)

__all__ = ["add_parser", "run"]


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff bench scheduler`` on the ``bench`` subparsers."""
    from kvoff import _scheduler
    from kvoff.tools.bench import DEFAULT_POOL_SIZES, DEFAULT_STEP_SHAPES, LARGE_POOL_SIZE
    from kvoff.tools.bench_vllm import DEFAULT_RUNNING

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
        type=positive_int,
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
    sp.add_argument("--batch", type=positive_int, default=256, help="keys per call (default: 256)")
    sp.add_argument(
        "--calls",
        type=positive_int,
        default=1024,
        help="calls per timed round, for lookup and for stores (default: 1024)",
    )
    sp.add_argument(
        "--repeat",
        type=positive_int,
        default=5,
        help="timed rounds per operation; the median is reported (default: 5)",
    )
    sp.add_argument(
        "--key-bytes",
        type=int_at_least(2),
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
    sp.add_argument("--seed", type=non_negative_int, default=0, help="workload seed (default: 0)")
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
        type=positive_int,
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
        type=positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help="with --vs-vllm: running requests per measurement (default: "
        + " ".join(str(n) for n in DEFAULT_RUNNING)
        + ")",
    )
    sp.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        metavar="N",
        help="with --vs-vllm: runs of each configuration per running count, in alternating "
        "order; medians over rounds are reported (default: 3)",
    )
    sp.add_argument(
        "--store-batch-blocks",
        type=positive_int,
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
        "--node-pool",
        action="store_true",
        help="with --vs-vllm: also run KvoffOffloadingSpec attached to a node pool (kvoff pool "
        "serve in a child process, one per run) next to the same spec on a private pool "
        "(node_pool_vs_private; needs about the private pool's bytes in /dev/shm)",
    )
    add_json_option(sp)
    sp.set_defaults(run=run)


def _step_shape(text: str) -> tuple[int, int]:
    """An argparse type: ``BxG`` with 1 <= B and 1 <= G <= 8."""
    try:
        b, g = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BxG, e.g. 1024x4") from None
    if b < 1 or not 1 <= g <= 8:
        raise argparse.ArgumentTypeError(f"{text!r}: need B >= 1 and 1 <= G <= 8")
    return b, g


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff bench scheduler``: the tables, and the JSON document with ``--json``. Returns 0.

    Raises:
        ValueError: flags of the other benchmark, bad parameters (naming them).
    """
    if args.vs_vllm:
        return _run_vs_vllm(args, argv)
    if (
        args.running is not None
        or args.rounds is not None
        or args.store_batch_blocks is not None
        or args.store_decode_blocks
        or args.node_pool
    ):
        raise ValueError(
            "--running, --rounds, --store-batch-blocks, --store-decode-blocks and --node-pool "
            "apply to --vs-vllm only"
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
    doc = run_scheduler_bench(
        params,
        json_path=None if is_stdout(args.json) else args.json,
        argv=argv,
        log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
        step_shapes=DEFAULT_STEP_SHAPES if args.steps is None else args.steps,
        decode_steps=args.decode_steps,
    )
    if is_stdout(args.json):
        write_json(args.json, doc)
    return 0


def _run_vs_vllm(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
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
        node_pool=args.node_pool,
    )
    doc = run_vs_vllm(
        params,
        json_path=None if is_stdout(args.json) else args.json,
        argv=argv,
        log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True),
    )
    if is_stdout(args.json):
        write_json(args.json, doc)
    return 0


_SCHEDULER_ONLY = {
    "pool_sizes": None, "large": False, "batch": 256, "calls": 1024, "repeat": 5,
    "key_bytes": 9, "eviction_policy": "lru", "no_baseline": False, "steps": None,
}  # fmt: skip
