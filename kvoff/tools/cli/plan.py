"""``kvoff plan``: what fits: GPU blocks, CPU blocks and the max model length of a model
(:mod:`kvoff.tools.plan`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from kvoff.tools.cli.common import (
    add_format_option,
    add_json_option,
    check_format,
    parse_bytes,
    positive_int,
    run_info,
    write_json,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff plan`` on the ``kvoff`` subparsers."""
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
        "--world-size", type=positive_int, default=1, help="tensor-parallel ranks (default: 1)"
    )
    pp.add_argument(
        "--num-gpu-blocks-override",
        type=positive_int,
        default=None,
        help="fixed GPU block count (replaces --gpu-memory for capacity)",
    )
    pp.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="required max model length in tokens (default: the largest that fits)",
    )
    pp.add_argument(
        "--block-size",
        type=positive_int,
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
    add_format_option(pp, "the plan")
    add_json_option(pp)
    pp.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff plan``: prints the plan; with ``--json FILE`` writes ``{"run", "plan"}``.
    Returns 0.

    Raises:
        ValueError: a plan that does not fit, a bad specs file, ``--format json`` with
            ``--json -``.
        OSError: a specs file that cannot be read.
    """
    from kvoff.tools.plan import PLAN_PRESETS, compute_plan, load_specs_file

    check_format(args)
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
    print(json.dumps(plan.to_dict(), indent=2) if args.format == "json" else plan.format())
    if args.json is not None:
        write_json(args.json, {"run": run_info(argv), "plan": plan.to_dict()})
    return 0
