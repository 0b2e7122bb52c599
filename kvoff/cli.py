"""The ``kvoff`` command line: ``kvoff replay`` (also ``python -m kvoff replay``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """Parse a byte count such as ``4096``, ``512MiB``, ``2GiB`` or ``1.5GB`` (SI or IEC units).

    Raises:
        argparse.ArgumentTypeError: for text that is not a positive byte count.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte count; write e.g. 4096, 512MiB, 2GiB or 1.5GB"
        )
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the byte count must be positive")
    return value


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

    parser = argparse.ArgumentParser(
        prog="kvoff", description="kvoff: KV-cache offloading for LLM inference engines"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    rp = sub.add_parser(
        "replay",
        help="replay a Mooncake-format trace through an engine-style loop",
        description=(
            "Replay a request trace: GPU prefix cache, then kvoff lookups and loads of cached "
            "prefixes into fresh GPU blocks, computation of the rest, stores of new full "
            "blocks; every loaded block is verified byte for byte."
        ),
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
        "--block-size", type=_positive_int, default=16, help="GPU tokens per block (default: 16)"
    )
    rp.add_argument(
        "--offloaded-block-size",
        type=_positive_int,
        default=512,
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
        default="lru",
        choices=list(EVICTION_POLICIES),
        help="eviction policy (default: lru)",
    )
    rp.add_argument(
        "--limit", type=_positive_int, default=None, help="replay only the first N requests"
    )
    rp.add_argument(
        "--trace-block-size",
        type=_positive_int,
        default=512,
        help="tokens per trace hash id (default: 512, Mooncake)",
    )
    rp.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write the totals as JSON to FILE"
    )
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _run_info() -> dict[str, object]:
    """Where and how a result was produced: command, date, machine, versions."""
    import datetime
    import os
    import platform

    import torch

    import kvoff

    return {
        "command": " ".join(["kvoff", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "kvoff_version": kvoff.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
    }


def _replay(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvoff.replay import ReplayConfig, run_replay
    from kvoff.traces import load_trace

    config = ReplayConfig(
        trace=args.trace,
        model=args.model,
        block_size=args.block_size,
        offloaded_block_size=args.offloaded_block_size,
        gpu_prefix_blocks=args.gpu_prefix_blocks,
        cpu_blocks=args.cpu_blocks,
        cpu_bytes=args.cpu_bytes,
        policy=args.policy,
        limit=args.limit,
        trace_block_size=args.trace_block_size,
    )
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
    print(
        f"kvoff replay: {s['requests']} requests of trace {s['trace']!r}, model {s['model']}, "
        f"block_size {s['block_size']}, offloaded_block_size {s['offloaded_block_size']}\n"
        f"  pool: {s['cpu_blocks']} CPU blocks ({s['cpu_pool_bytes'] / gib:.2f} GiB, "
        f"{s['policy']}), GPU prefix cache {s['gpu_prefix_blocks']} blocks\n"
        f"  input tokens     {s['input_tokens']:>14,}\n"
        f"  GPU hit tokens   {s['gpu_hit_tokens']:>14,}\n"
        f"  kvoff hit tokens {s['cpu_hit_tokens']:>14,}\n"
        f"  hit rate         {s['hit_rate']:>14.4%}   (full-block maximum "
        f"{s['max_hit_rate']:.4%})\n"
        f"  stored           {s['blocks_stored']:>14,} blocks, {s['bytes_stored'] / gib:.2f} GiB "
        f"at {s['store_gbps']:.2f} GB/s; {s['stores_skipped']} skipped (no room)\n"
        f"  loaded           {s['blocks_loaded']:>14,} GPU blocks, {s['bytes_loaded'] / gib:.2f} "
        f"GiB at {s['load_gbps']:.2f} GB/s\n"
        f"  verified         {s['blocks_verified']:>14,} blocks, corrupted "
        f"{s['corrupted_blocks']}, failed transfers {s['failed_transfers']}\n"
        f"  evictions        {s['evictions']:>14,}\n"
        f"  wall             {s['wall_s']:>14.1f} s"
    )
    if args.json is not None:
        record = {"run": _run_info(), "result": s}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"  JSON written to {args.json}")
    return 1 if s["corrupted_blocks"] or s["failed_transfers"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvoff`` console script. Returns the process exit code (0: success;
    1: corrupted blocks or failed transfers; 2: bad arguments)."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "replay":
            return _replay(args)
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"kvoff {args.command}: error: {exc}\n")
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
