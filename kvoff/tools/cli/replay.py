"""``kvoff replay``: a Mooncake-format trace through kvoff's engine-style loop
(:func:`kvoff.tools.replay.run_replay`, Belady's MIN, ``--sweep-capacity``) or a real vLLM
engine (``--engine vllm``, :mod:`kvoff.tools.replay_vllm`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoff._optional import require
from kvoff.tools.cli.common import (
    check_output,
    int_at_least,
    non_negative_int,
    parse_bytes,
    positive_int,
    run_info,
    write_json,
)
from kvoff.tools.cli.replay_report import format_replay

if TYPE_CHECKING:
    from kvoff.tools.request_loop import ReplayConfig
    from kvoff.tools.traces import TraceRequest

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff replay`` on the ``kvoff`` subparsers."""
    from kvoff.config import EVICTION_POLICIES
    from kvoff.models import MODEL_PRESETS
    from kvoff.transfer import ALL_MECHANISMS
    from kvoff.worker import GPU_LAYOUTS

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
        help="'conversation' or 'synthetic' (bundled Mooncake traces), 'unique' (the "
        "conversation trace's lengths, no block shared: nothing to gain) or a JSONL path "
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
        type=positive_int,
        default=None,
        help="GPU tokens per block (default: 16; 32 with --engine vllm, whose CPU backend "
        "needs a multiple of 32)",
    )
    rp.add_argument(
        "--offloaded-block-size",
        type=positive_int,
        default=None,
        help="tokens per offloaded (CPU) block; a multiple of --block-size (default: 512)",
    )
    rp.add_argument(
        "--gpu-prefix-blocks",
        type=non_negative_int,
        default=0,
        help="GPU blocks the engine's own prefix cache keeps between requests; "
        "0 disables it (default: 0)",
    )
    size = rp.add_mutually_exclusive_group()
    size.add_argument(
        "--cpu-blocks", type=positive_int, default=None, help="kvoff pool size in offloaded blocks"
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
        type=non_negative_int,
        default=None,
        metavar="N",
        help="store admission: store an offloaded block only once requests offered it N times "
        "(a request that computed the block offers it; 0 or 1: every block, the default; "
        "vLLM's store_threshold). With --sweep-capacity: for the policies without +tN",
    )
    rp.add_argument(
        "--max-tracker-size",
        type=positive_int,
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
        type=positive_int,
        default=None,
        help="replay only the first N requests (default: all; 200 with --engine vllm)",
    )
    rp.add_argument(
        "--trace-block-size",
        type=positive_int,
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
        "--start",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="replay from request N on (0-based; default: 0)",
    )
    rp.add_argument(
        "--best-reuse-window",
        type=positive_int,
        default=None,
        metavar="N",
        help="replay the N consecutive requests that reuse the most tokens among themselves "
        "(sets --start and --limit; for a short GPU run with many hits)",
    )
    rp.add_argument(
        "--warmup",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="first serve the N requests before the replayed ones (before --start or the "
        "--best-reuse-window), to fill the caches; they are not counted or timed (default: 0)",
    )
    rp.add_argument(
        "--interleave-requests",
        type=positive_int,
        default=16,
        metavar="N",
        help="with --compute: requests served with kvoff before the same ones are served by "
        "the engine's prefix cache alone, to time both under the same GPU clock (default: 16)",
    )
    rp.add_argument(
        "--compute-chunk-tokens",
        type=positive_int,
        default=2048,
        help="tokens per GEMM chunk of the prefill cost (default: 2048)",
    )
    rp.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the totals as JSON to FILE (-: to stdout, the text then to stderr)",
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
        type=positive_int,
        default=1,
        help="split the trace across N engines that share the remote tier (default: 1)",
    )
    tg.add_argument(
        "--assign",
        choices=("round_robin", "session"),
        default="round_robin",
        help="with --engines: request i to engine i mod N, or by session (first hash id)",
    )
    tg.add_argument(
        "--node-pool",
        nargs="?",
        const="",
        default=None,
        metavar="SOCKET",
        help="run the --engines as separate processes on one node pool (kvoff pool serve): "
        "the one at SOCKET, or one of --cpu-blocks/--cpu-bytes started for the run",
    )
    tg.add_argument(
        "--node-pool-reserve",
        action="store_true",
        help="with --node-pool: the engines store into slots the pool reserves for them, as "
        "the vLLM connectors do (no round trip per store; the slots are capacity the index "
        "cannot use meanwhile)",
    )
    vg = rp.add_argument_group("--engine vllm")
    vg.add_argument(
        "--tokens-per-hash",
        type=positive_int,
        default=32,
        help="prompt tokens per trace hash id (scales the trace down; default: 32)",
    )
    vg.add_argument(
        "--max-tokens",
        type=positive_int,
        default=16,
        help="tokens generated per request (greedy; default: 16)",
    )
    vg.add_argument(
        "--concurrency",
        type=positive_int,
        default=8,
        help="requests in flight, added in trace order as others finish (default: 8)",
    )
    vg.add_argument(
        "--gpu-blocks",
        type=int_at_least(2),
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
    rp.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff replay``: the checks of the flags, the replay, its text and ``--json``. Returns
    1 when a loaded block was corrupted or a transfer failed, else 0.

    Raises:
        ValueError: flags that do not go together, a bad pool setting or trace (naming it).
    """
    if args.engine == "vllm":
        return _run_vllm(args, argv)
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
        start=args.start,
        trace_block_size=args.trace_block_size,
        device=args.device,
        gpu_layout=args.gpu_layout,
        mechanism=args.mechanism,
        compute=args.compute,
        compute_chunk_tokens=args.compute_chunk_tokens,
        interleave_requests=args.interleave_requests,
        disk_path=None if pool.disk_path is None else str(pool.disk_path),
        disk_bytes=pool.disk_bytes,
        remote_url=pool.remote_url,
        shared_secret=(
            None if pool.shared_secret is None else pool.shared_secret.get_secret_value().encode()
        ),
        remote_namespace=args.remote_namespace,
        remote_timeout_s=args.remote_timeout,
        engines=args.engines,
        assign=args.assign,
        node_pool_reserve=args.node_pool_reserve,
    )
    if sweeping:
        return _sweep(args, argv, config)
    if args.node_pool is not None:
        return _node_pool(args, argv, config)
    window = None
    if args.best_reuse_window is not None:
        if args.limit is not None or args.start:
            raise ValueError(
                "--best-reuse-window picks the first request and the count; drop --start and "
                "--limit"
            )
        window, config, whole = _best_window(config, args.best_reuse_window)
    stop = None if config.limit is None else config.start + config.limit
    if window is None:
        whole = load_trace(config.trace, stop, config.trace_block_size)
    warmup = min(args.warmup, config.start)
    requests = whole[config.start - warmup : stop]
    # requests holds exactly the warm-up and the replayed ones
    config = dataclasses.replace(config, start=0, limit=None, warmup_requests=warmup)
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
    print(format_replay(s))
    if args.json is not None:
        doc = {"run": run_info(argv), "result": s}
        if window is not None:
            doc["window"] = window
        write_json(args.json, doc)
    if s["device"] == "offline":  # Belady's MIN: nothing moved, nothing to fail
        return 0
    bad = s["corrupted_blocks"] or s["failed_transfers"]
    return 1 if bad else 0


def _node_pool(args: argparse.Namespace, argv: Sequence[str] | None, config: ReplayConfig) -> int:
    """``kvoff replay --engines N --node-pool``: per engine and in all; exit 1 on a corrupted
    block or a failed transfer."""
    from kvoff.tools.replay_node_pool import run_node_pool_replay

    if args.best_reuse_window is not None or args.warmup:
        raise ValueError("--node-pool replays take --start and --limit; drop --best-reuse-window "
                         "and --warmup")  # fmt: skip
    out = run_node_pool_replay(config, socket_path=args.node_pool or None)
    t = out["total"]
    lines = [
        f"kvoff replay: {t['requests']} requests of trace {config.trace!r} on {t['engines']} "
        f"engine processes sharing one node pool ({t['cpu_blocks']} CPU blocks, {t['policy']}), "
        f"--assign {config.assign}",
    ]
    for i, e in enumerate(out["engines"]):
        lines.append(
            f"  engine {i}: {e['requests']:>6,} requests, hit rate {e['hit_rate']:.4%}, "
            f"{e['blocks_loaded']:,} GPU blocks loaded, corrupted {e['corrupted_blocks']}"
        )
    lines.append(
        f"  all:      {t['requests']:>6,} requests, hit rate {t['hit_rate']:.4%}, "
        f"{t['blocks_loaded']:,} GPU blocks loaded from the node pool, verified "
        f"{t['blocks_verified']:,}, corrupted {t['corrupted_blocks']}, failed transfers "
        f"{t['failed_transfers']}, lost lookups {t['lost_lookups']}, evictions {t['evictions']:,}"
    )
    print("\n".join(lines))
    if args.json is not None:
        write_json(args.json, {"run": run_info(argv), "result": t, "engines": out["engines"],
                               "pool": out["pool"]})  # fmt: skip
    return 1 if t["corrupted_blocks"] or t["failed_transfers"] else 0


def _best_window(
    config: ReplayConfig, size: int
) -> tuple[dict[str, Any], ReplayConfig, list[TraceRequest]]:
    """``--best-reuse-window``: the whole trace replayed through this run's pool by the C++
    manager alone (no bytes move, no GPU prefix cache), then the ``size`` requests in a row
    with the highest hit fraction."""
    from kvoff.tools.policy_sim import run_manager_replay
    from kvoff.tools.replay import replay_cpu_blocks
    from kvoff.tools.trace_windows import best_hit_window
    from kvoff.tools.traces import load_trace

    whole = load_trace(config.trace, None, config.trace_block_size)
    sim_config = dataclasses.replace(
        config, start=0, limit=None, gpu_prefix_blocks=0, cpu_blocks=replay_cpu_blocks(config)[0],
        cpu_bytes=None, disk_path=None, disk_bytes=None, remote_url=None, engines=1,
    )  # fmt: skip
    sim = run_manager_replay(sim_config, requests=whole)
    start, fraction = best_hit_window(
        [r.input_length for r in whole], sim.per_request_cpu_hit_tokens, size
    )
    print(
        f"best-reuse window: requests {start}..{start + size - 1}, {fraction:.1%} of their "
        f"tokens hit when the whole trace is replayed through {sim.cpu_blocks} CPU blocks "
        f"(the whole trace: {sim.hit_rate:.1%})",
        file=sys.stderr,
    )
    window = {"start": start, "requests": size, "simulated_hit_rate": fraction,
              "simulated_cpu_blocks": sim.cpu_blocks}  # fmt: skip
    return window, dataclasses.replace(config, start=start, limit=size), whole


def _sweep(args: argparse.Namespace, argv: Sequence[str] | None, config: ReplayConfig) -> int:
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
        require("matplotlib", "kvoff replay --plot")  # before the sweep, not after it
        plot_path = args.plot if args.plot.suffix else args.plot.with_suffix(".png")
        check_output(plot_path, "--plot")
    log = None if args.no_progress else lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)
    sweep = run_policy_sweep(config, capacities, policies, log=log)
    print(format_sweep_table(sweep))
    if args.json is not None:
        write_json(args.json, {"run": run_info(argv), "sweep": sweep.to_dict()})
    if args.plot is not None:
        plot_sweep(sweep, plot_path or args.plot)
        print(f"  curves drawn in {plot_path}")
    corrupted = sum(p.corrupted_blocks for p in sweep.points)
    return 1 if corrupted else 0


def _run_vllm(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
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
        write_json(args.json, {"run": run_info(argv), "result": result})
    exact = all(r["accounting_exact"] for r in result["runs"].values())
    return 0 if exact and result.get("outputs_equal", True) else 1


_SIM_ONLY = {
    "cpu_blocks": None, "gpu_prefix_blocks": 0, "device": "cpu", "gpu_layout": "layer_major",
    "mechanism": "auto", "compute": False, "model": "tiny", "sweep_capacity": None,
    "policies": None, "plot": None, "engines": 1,
}  # fmt: skip


_VLLM_ONLY = {
    "tokens_per_hash": 32, "max_tokens": 16, "concurrency": 8, "gpu_blocks": None,
    "engine_model": "llama", "dtype": "float32", "runs": ["kvoff", "engine_only"],
}  # fmt: skip
